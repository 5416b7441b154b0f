//! The store's operations, written once, as async functions on the store's
//! runtime: the blocking [`Store`](crate::Store) methods and the `_async`
//! methods of [`PostgresStore`](super::PostgresStore) both run these.

use super::errors::{self, db_error};
use super::inbox_sql::pipelined;
use super::line::{Job, Line};
use super::pool::{Conn, Pool};
use super::schema;
use super::sql::{self, Sql, Stmt};
use super::stats::Counters;
use super::{MAX_BEGIN_ATTEMPTS, row};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, Record, State};
use crate::response::Response;
use crate::step::{MAX_STEPS, Step};
use crate::store::MAX_SWEEP_BATCH;
use crate::time::Timestamp;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::Row;

/// What every operation needs: the pool, the statements, the limits and
/// the counters. Shared (`Arc`) by the store and the work it spawns.
pub(super) struct Core {
    pub(super) pool: Pool,
    pub(super) sql: Arc<Sql>,
    pub(super) max_body_bytes: usize,
    pub(super) counters: Arc<Counters>,
    /// The group-commit line `begin` and `complete` go through.
    pub(super) line: Line<Job>,
}

impl Core {
    /// At build: opens `min_idle` connections (at least one), then checks
    /// the schema, or migrates it when `migrate` is set.
    pub(super) async fn setup(&self, min_idle: u32, migrate: bool) -> Result<()> {
        self.pool.warm(min_idle.max(1)).await?;
        if migrate {
            return self.migrate().await;
        }
        let pooled = self.pool.get().await?;
        schema::check(&pooled.conn().client, &self.sql).await
    }

    pub(super) async fn migrate(&self) -> Result<()> {
        Counters::bump(&self.counters.calls);
        let pooled = self.pool.get().await?;
        let done = schema::migrate(&pooled.conn().client, &self.sql).await;
        if done.is_err() {
            // Its transaction may still be open: never hand it out again.
            pooled.discard();
        }
        done
    }

    /// Runs `op` on a pooled connection; when the server had ended that
    /// connection (after a restart or failover every idle pooled connection
    /// is dead), runs it again on another one, up to the pool size + 1
    /// times. `op` is told whether this is such a repetition: the first run
    /// may have committed before the connection died (its answer was lost),
    /// so a repeated `complete` or `release` that finds nothing to do checks
    /// whether its own first run did it. A repeated `begin` that finds its
    /// own lost claim answers InFlight: fail closed, as the error would.
    /// A run one of whose commits the server reported on the primary only
    /// ([`Conn::unreplicated`]) is run again the same way: a success read
    /// back is acknowledged only once durable.
    /// `repeated`: the first run is already a repetition (a group whose
    /// connection broke after its `COMMIT` was sent ran it).
    async fn retrying<T, F, Fut>(&self, repeated: bool, mut op: F) -> Result<T>
    where
        F: FnMut(Arc<Conn>, bool) -> Fut,
        Fut: Future<Output = Result<T, RunError>>,
    {
        let attempts = self.pool.max_size().saturating_add(1);
        let mut last = None;
        for _ in 0..attempts {
            let pooled = self.pool.get().await?;
            let conn = pooled.conn();
            let seen = conn.unreplicated();
            let ran = op(Arc::clone(&conn), repeated || last.is_some()).await;
            match ran {
                Err(RunError::Db(err)) if errors::is_dead_connection(&err) => {
                    pooled.discard();
                    last = Some(self.db(err));
                }
                // A commit of this run is on the primary only: its outcome
                // is unknown, as after a broken connection, though this
                // one stays usable.
                _ if conn.unreplicated() != seen => last = Some(errors::unreplicated()),
                Err(RunError::Db(err)) => return Err(self.db(err)),
                Err(RunError::Store(err)) => return Err(err),
                Ok(value) => return Ok(value),
            }
        }
        Err(last.unwrap_or_else(|| Error::backend("no PostgreSQL connection attempt was made")))
    }

    fn db(&self, err: tokio_postgres::Error) -> Error {
        db_error(err, &self.sql.table)
    }

    /// The lone `begin`'s statement for these arguments (the pooled path's
    /// and the calling thread's lane's).
    pub(super) fn begin_step<'a>(
        &self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> BeginStep<'a> {
        BeginStep {
            key,
            fingerprint,
            now,
            lease,
            retention,
            lock: sql::key_lock(&self.sql.table, key),
        }
    }

    /// A lone `begin`: its statement in its own transaction, run again on
    /// a snapshot race or a broken connection.
    pub(super) async fn begin_alone(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
        repeated: bool,
    ) -> Result<Begin> {
        let step = &self.begin_step(key, fingerprint, now, lease, retention);
        self.retrying(repeated, |conn, _| async move {
            step.run(&conn, &self.counters).await
        })
        .await
    }

    /// A lone `complete`: its conditional DONE write in its own
    /// transaction. `times`: the completion time and the new expiry.
    pub(super) async fn complete_alone(
        &self,
        key: &Key,
        claim: &Claim,
        token: i64,
        response: &Response,
        times: (i64, i64),
        repeated: bool,
    ) -> Result<()> {
        let r = &row::response_columns(response);
        let done = self
            .retrying(repeated, |conn, retried| async move {
                let updated = complete_on(&conn, key, token, times, r).await?;
                if updated > 0 || !retried {
                    return Ok(updated > 0);
                }
                // Only this claim's holder can have stored a DONE record under
                // its token: if it holds this response, the lost first run did,
                // though perhaps only locally (a commit whose wait for a
                // synchronous standby was cut off stays visible on the
                // primary), so it is acknowledged once it is durable.
                let mine = stored(&conn, key).await?.is_some_and(|rec| {
                    rec.state == State::Done
                        && rec.token == claim.token
                        && rec.response.as_ref() == Some(response)
                });
                if mine {
                    durable(&conn).await?;
                }
                Ok(mine)
            })
            .await?;
        if done { Ok(()) } else { Err(Error::StaleClaim) }
    }

    pub(super) async fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        let Some(token) = row::token(claim.token) else {
            return Err(Error::StaleClaim);
        };
        Counters::bump(&self.counters.calls);
        let released = self
            .retrying(false, |conn, retried| async move {
                // logic::release's two outcomes, one statement each, sent
                // together (one round trip): at most one of them changes
                // the row, whichever runs first (see sql.rs).
                let params: &[&(dyn tokio_postgres::types::ToSql + Sync)] =
                    &[&key.scope(), &key.id(), &token];
                let (deleted, kept) = pipelined(
                    conn.execute(Stmt::Release, params),
                    conn.execute(Stmt::ReleaseKeep, params),
                )
                .await;
                let changed = deleted? + kept?;
                if changed > 0 || !retried {
                    return Ok(changed > 0);
                }
                // Gone, or kept with its steps and its lease over: the lost
                // first run released it (or, if another owner took over and
                // then gave it up, the key is free all the same), once that
                // is durable (see complete_alone).
                let free = stored(&conn, key).await?.is_none_or(|rec| {
                    rec.state == State::Processing && rec.lease_until == Some(Timestamp::EPOCH)
                });
                if free {
                    durable(&conn).await?;
                }
                Ok(free)
            })
            .await?;
        if released {
            Ok(())
        } else {
            Err(Error::StaleClaim)
        }
    }

    pub(super) async fn renew(
        &self,
        key: &Key,
        claim: &Claim,
        now: Timestamp,
        lease: Duration,
    ) -> Result<Claim> {
        Counters::bump(&self.counters.calls);
        crate::record::check_lease(lease)?;
        let Some(token) = row::token(claim.token) else {
            return Err(Error::StaleClaim);
        };
        let (at, until) = (row::millis(now), row::millis(now + lease));
        // Running it again after a lost connection is harmless: the lease
        // only ever grows.
        let renewed: Option<i64> = self
            .retrying(false, |conn, _| async move {
                let rows = conn
                    .query(Stmt::Renew, &[&key.scope(), &key.id(), &token, &at, &until])
                    .await?;
                match rows.first() {
                    Some(row) => Ok(Some(row.try_get::<_, i64>(0)?)),
                    None => Ok(None),
                }
            })
            .await?;
        match renewed {
            Some(lease_until) => {
                let mut claim = claim.clone();
                claim.lease_until = Timestamp::from_millis(u64::try_from(lease_until).unwrap_or(0));
                Ok(claim)
            }
            None => Err(Error::StaleClaim),
        }
    }

    /// `record_step`: the row read, `logic::record_step`'s decision on it,
    /// and its write as a conditional append ([`Stmt::RecordStep`]) that
    /// holds only while the row is still the owner's with the steps read
    /// (else it is read and decided again: a racing takeover, complete,
    /// release or expiry then makes it `StaleClaim`, writing nothing). Two
    /// round trips, no transaction held open across them. A step already
    /// recorded writes nothing, and is acknowledged once the row read is
    /// durable: the commit that recorded it (an earlier call's, whose
    /// answer was lost) may be on this primary only.
    pub(super) async fn record_step(
        &self,
        key: &Key,
        claim: &Claim,
        step: &Step,
        now: Timestamp,
    ) -> Result<()> {
        Counters::bump(&self.counters.calls);
        let Some(token) = row::token(claim.token) else {
            return Err(Error::StaleClaim);
        };
        let at = row::millis(now);
        let (name, output) = (step.name.as_bytes(), &step.output[..]);
        self.retrying(false, |conn, _| async move {
            // Each failed append means the record changed since it was
            // read: a step appended by a concurrent call of this claim
            // (at most MAX_STEPS of them), or a change that makes the next
            // decision StaleClaim.
            for _ in 0..=MAX_STEPS + 1 {
                let existing = stored(&conn, key).await?;
                let Some(record) = logic::record_step(existing, claim, step, now)? else {
                    durable(&conn).await?;
                    return Ok(());
                };
                // The steps as read: the decided record has one more.
                let seen = i32::try_from(record.steps.len().saturating_sub(1)).unwrap_or(i32::MAX);
                let appended = conn
                    .execute(
                        Stmt::RecordStep,
                        &[&key.scope(), &key.id(), &token, &at, &name, &output, &seen],
                    )
                    .await?;
                if appended > 0 {
                    return Ok(());
                }
            }
            Err(RunError::Store(Error::backend(format!(
                "record_step on {key} raced with concurrent writers too many times in a row"
            ))))
        })
        .await
    }

    pub(super) async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        Counters::bump(&self.counters.calls);
        let record = self
            .retrying(false, |conn, _| async move { stored(&conn, key).await })
            .await?;
        Ok(logic::visible(record, now))
    }

    pub(super) async fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        Counters::bump(&self.counters.calls);
        let max = max.min(MAX_SWEEP_BATCH);
        if max == 0 {
            return Ok(0);
        }
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        let at = row::millis(now);
        let deleted = self
            .retrying(false, |conn, _| async move {
                Ok(conn.execute(Stmt::Sweep, &[&at, &limit]).await?)
            })
            .await?;
        let deleted = usize::try_from(deleted).unwrap_or(usize::MAX);
        crate::observability::swept("postgres", deleted);
        Ok(deleted)
    }
}

/// One `begin`'s statement and its reruns on one connection: the atomic
/// step of [`Core::begin`], and the claim an inbox delivery makes inside
/// its transaction.
pub(super) struct BeginStep<'a> {
    pub(super) key: &'a Key,
    pub(super) fingerprint: &'a Fingerprint,
    pub(super) now: Timestamp,
    pub(super) lease: Duration,
    pub(super) retention: Duration,
    /// `sql::key_lock` of the key.
    pub(super) lock: i64,
}

impl BeginStep<'_> {
    pub(super) async fn run(&self, conn: &Conn, counters: &Counters) -> Result<Begin, RunError> {
        let (key, fingerprint, now, lease, retention, lock) = (
            self.key,
            self.fingerprint,
            self.now,
            self.lease,
            self.retention,
            self.lock,
        );
        let (scope, id, fp) = (key.scope(), key.id(), &fingerprint.as_bytes()[..]);
        let (at, lease_until, expires_at) = (
            row::millis(now),
            row::millis(now + lease),
            row::millis(now + retention),
        );
        for _ in 0..MAX_BEGIN_ATTEMPTS {
            let rows = conn
                .query(
                    Stmt::Begin,
                    &[&scope, &id, &fp, &at, &lease_until, &expires_at, &lock],
                )
                .await?;
            // No row: another begin is claiming the key, or committed it
            // after this statement's snapshot was taken (see sql.rs).
            // Wait for that claim to commit, then run it again.
            if let Some(first) = rows.first()
                && let Some(answer) = self.answer_of_row(first, 0)?
            {
                return Ok(answer);
            }
            Counters::bump(&counters.snapshot_retries);
            conn.execute(Stmt::WaitKey, &[&lock]).await?;
        }
        Err(RunError::Store(Error::backend(format!(
            "begin on {key} raced with concurrent writers {MAX_BEGIN_ATTEMPTS} times in a row"
        ))))
    }
}

impl BeginStep<'_> {
    /// [`Stmt::BeginFresh`]: the claim of a key with no row, in one plain
    /// statement; `None` when it wrote nothing (the key has a row, or
    /// another begin holds its lock) and [`run`](Self::run) must decide.
    /// The claim is the one [`Stmt::Begin`] makes of an absent key: attempt
    /// 1, the lease deadline as stored.
    pub(super) async fn claim_fresh(&self, conn: &Conn) -> Result<Option<Begin>, RunError> {
        let (key, fp) = (self.key, &self.fingerprint.as_bytes()[..]);
        let (at, lease_until, expires_at) = (
            row::millis(self.now),
            row::millis(self.now + self.lease),
            row::millis(self.now + self.retention),
        );
        let rows = conn
            .query(
                Stmt::BeginFresh,
                &[
                    &key.scope(),
                    &key.id(),
                    &fp,
                    &at,
                    &lease_until,
                    &expires_at,
                    &self.lock,
                ],
            )
            .await?;
        let Some(first) = rows.first() else {
            return Ok(None);
        };
        let token: i64 = first.try_get(0)?;
        let corrupt = |what: String| Error::corrupt(Some(key.to_string()), what);
        let token =
            u64::try_from(token).map_err(|_| corrupt(format!("token {token} is negative")))?;
        let lease_until = u64::try_from(lease_until).unwrap_or(0);
        Ok(Some(Begin::Claimed(Claim::new(
            token,
            Timestamp::from_millis(lease_until),
            false,
            1,
        ))))
    }

    /// What one row of a claim statement answers (`claimed_at`: the column
    /// of its `claimed` flag, then its `released` flag, the record's
    /// columns after them): the claim it
    /// made, or, when it wrote nothing, `logic::begin`'s answer on the row
    /// as read. `None` when that row would have been claimed: another begin
    /// is claiming the key or has (a newer row than the snapshot shows),
    /// and the statement must run again once that one commits. The lone
    /// statement and the group's (`group.rs`) both answer through this.
    pub(super) fn answer_of_row(
        &self,
        found: &Row,
        claimed_at: usize,
    ) -> Result<Option<Begin>, RunError> {
        let claimed: bool = found.try_get(claimed_at)?;
        let released: bool = found.try_get(claimed_at + 1)?;
        let record = row::record(self.key, found, claimed_at + 2)?;
        if claimed {
            return Ok(Some(Begin::Claimed(claim_of(&record, released))));
        }
        let (fp, now, lease, keep) = (self.fingerprint, self.now, self.lease, self.retention);
        let step = logic::begin(Some(record), fp, now, lease, keep, || Ok(0))?;
        Ok(step.write.is_none().then_some(step.answer))
    }
}

/// The conditional DONE write of `complete` on `conn`: rows updated (0 or
/// 1). `times` are the completion time and the new expiry, as stored.
pub(super) async fn complete_on(
    conn: &Conn,
    key: &Key,
    token: i64,
    times: (i64, i64),
    r: &row::ResponseColumns<'_>,
) -> Result<u64, RunError> {
    let (at, expires_at) = times;
    Ok(conn
        .execute(
            Stmt::Complete,
            &[
                &key.scope(),
                &key.id(),
                &token,
                &at,
                &expires_at,
                &r.status,
                &r.names,
                &r.values,
                &r.body,
            ],
        )
        .await?)
}

/// Returns once everything committed before it is as durable as a commit
/// of this connection's ([`Stmt::Durable`]).
pub(super) async fn durable(conn: &Conn) -> Result<(), RunError> {
    conn.query(Stmt::Durable, &[]).await?;
    Ok(())
}

/// The record for `key` as stored (expired or not), on `conn`.
pub(super) async fn stored(conn: &Conn, key: &Key) -> Result<Option<Record>, RunError> {
    let rows = conn.query(Stmt::Get, &[&key.scope(), &key.id()]).await?;
    Ok(match rows.first() {
        Some(found) => Some(row::record(key, found, 0)?),
        None => None,
    })
}

/// What one run of a statement can fail with: the server's error (which
/// [`Core::retrying`] looks at) or one of ours.
pub(super) enum RunError {
    Db(tokio_postgres::Error),
    Store(Error),
}

impl RunError {
    /// As the caller sees it: the server's error named for `table`.
    pub(super) fn into_error(self, table: &str) -> Error {
        match self {
            RunError::Db(err) => db_error(err, table),
            RunError::Store(err) => err,
        }
    }
}

impl From<tokio_postgres::Error> for RunError {
    fn from(err: tokio_postgres::Error) -> RunError {
        RunError::Db(err)
    }
}

impl From<Error> for RunError {
    fn from(err: Error) -> RunError {
        RunError::Store(err)
    }
}

/// The claim for a record the statement just claimed, carrying its steps.
/// `logic::begin` gives a fresh record attempt 1 and a claim of a
/// PROCESSING record the previous attempts + 1, so "attempt > 1" is
/// exactly "a PROCESSING record was claimed": a takeover unless that record
/// was `released` (its lease at `sql::RELEASED`, steps kept).
pub(super) fn claim_of(record: &Record, released: bool) -> Claim {
    let mut claim = Claim::new(
        record.token,
        record.lease_until.unwrap_or(Timestamp::EPOCH),
        record.attempts > 1 && !released,
        record.attempts,
    );
    claim.steps.clone_from(&record.steps);
    claim
}
