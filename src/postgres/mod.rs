//! [`PostgresStore`]: the same [`Store`] contract over a PostgreSQL table,
//! for services that run several replicas (feature `postgres`). The
//! statements, the schema and the clock are described on [`PostgresStore`].

mod errors;
mod options;
mod pool;
mod row;
mod schema;
mod sql;

pub use options::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_POOL_SIZE, DEFAULT_STATEMENT_TIMEOUT, DEFAULT_TABLE,
    MAX_POOL_SIZE, MAX_TABLE_NAME_BYTES, PostgresStoreBuilder,
};

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, Record, State, check_durations};
use crate::response::Response;
use crate::store::{MAX_SWEEP_BATCH, Store};
use crate::time::{Clock, Timestamp};
use errors::{db_error, pool_error};
use sql::{Sql, Stmt};
use std::sync::Arc;
use std::time::Duration;

/// Most times one `begin` runs its statement when concurrent writers keep
/// committing between its snapshot and its conflict check (each retry
/// takes a new snapshot, so a second attempt almost always settles it).
///
/// ```
/// assert!(idemstore::postgres::MAX_BEGIN_ATTEMPTS >= 2);
/// ```
pub const MAX_BEGIN_ATTEMPTS: usize = 8;

/// An idempotency store in a PostgreSQL table, shared by every replica of a
/// service: the same [`Store`] contract as the embedded stores, over a pool
/// of connections (feature `postgres`).
///
/// ```no_run
/// use idemstore::{Begin, Fingerprint, Key, PostgresStore, Response, Store, Timestamp};
/// use std::time::Duration;
///
/// let store = PostgresStore::connect("postgres://app@db.internal/orders")?;
/// store.migrate()?;
/// let key = Key::new("tenant-42", "order-1")?;
/// let fp = Fingerprint::of(b"sku=A&qty=1");
/// let now = Timestamp::from_system_time(std::time::SystemTime::now());
/// let (lease, retention) = (Duration::from_secs(30), Duration::from_secs(24 * 3600));
/// if let Begin::Claimed(claim) = store.begin(&key, &fp, now, lease, retention)? {
///     store.complete(&key, &claim, &Response::new(201, "charged"), now, retention)?;
/// }
/// # Ok::<(), idemstore::Error>(())
/// ```
///
/// # One statement per call
///
/// Every call is one prepared statement in its own transaction: one round
/// trip, one commit. `begin` is an `INSERT .. ON CONFLICT (scope, id) DO
/// UPDATE .. WHERE <expired, or same fingerprint with the lease run out>
/// RETURNING ..` with a read of the existing row in the same statement, so
/// Claimed, Replay, InFlight and Conflict all come back in that round trip;
/// the write decides on the newest row under its lock, never on an earlier
/// read. When the statement's snapshot already shows a live record that
/// cannot be claimed, the statement writes nothing (no row lock, no WAL
/// flush): a replay is a read. When a concurrent writer
/// commits between the statement's snapshot and its conflict check, the
/// statement sees no row (or an older one); it is then run again, at most
/// [`MAX_BEGIN_ATTEMPTS`] times. Fencing tokens come from a sequence, drawn
/// under a transaction-scoped advisory lock on the key, so the claims of a
/// key get increasing tokens in the order they commit. `complete` and `release`
/// are conditional on the token. `sweep_expired` deletes one bounded batch,
/// oldest expiry first, skipping rows another sweeper holds.
///
/// After a server restart or failover, a call that meets a connection the
/// server ended runs again on another one; a repeated `complete` or
/// `release` that finds its own lost first run done reports success.
///
/// **Durability** is the server's: `Claimed` is returned after the commit,
/// which with the default `synchronous_commit = on` means the WAL is flushed
/// (and, with synchronous replication, on the standbys the server waits for).
///
/// # Time: the caller's clock, and skew between replicas
///
/// Deadlines are computed from the `now` each call passes in, not from the
/// database clock. That keeps the [`Store`] contract (every backend takes
/// `now`; tests run on a manual clock and are deterministic), and it means
/// each replica judges leases and expiry by its own clock. Skew between
/// replicas therefore matters: a replica whose clock runs ahead by `s` sees
/// other replicas' leases end `s` early — it may take over a claim whose
/// owner is still inside its lease — and sees records expire `s` early.
/// Fencing tokens still stop the stale owner from completing, but its side
/// effect may already have run. Keep the clocks synchronised (NTP, chrony)
/// and the skew well under the lease (a lease of tens of seconds against
/// millisecond NTP skew is comfortable).
///
/// # The schema
///
/// One table (default [`DEFAULT_TABLE`]) keyed by (scope, id), with the
/// fingerprint, state, lease deadline, expiry, fencing token, attempt count
/// and the response in plain columns (status, header names and values as
/// `bytea[]`, body as `bytea`); a sequence for tokens; an index on the
/// expiry. [`PostgresStore::migrate`] creates them and is idempotent; the
/// schema version is kept in the table's comment, and a table of the same
/// name that is not ours, or is newer, is refused with a typed error.
///
/// Connections are plain TCP or unix sockets without TLS (the client is
/// built with `NoTls`): reach the server over a trusted network or a local
/// TLS proxy.
pub struct PostgresStore {
    pool: pool::Pool,
    sql: Arc<Sql>,
    max_body_bytes: usize,
    /// Never read by the store: handed out by [`Store::clock`].
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.pool.state();
        f.debug_struct("PostgresStore")
            .field("table", &self.sql.table)
            .field("connections", &state.connections)
            .field("idle_connections", &state.idle_connections)
            .field("max_body_bytes", &self.max_body_bytes)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Options for a store; [`PostgresStoreBuilder::connect`] takes the
    /// server's URL (`postgres://user[:password]@host[:port]/database[?options]`,
    /// or the `key=value` form libpq accepts).
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::builder()
    ///     .pool_size(32)
    ///     .connect("postgres://app@db.internal/orders")?;
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn builder() -> PostgresStoreBuilder {
        PostgresStoreBuilder::new()
    }

    /// A store with the default options on the server at `url`; see
    /// [`PostgresStoreBuilder::connect`] for the errors.
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::connect("postgres://app@db.internal/orders")?;
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn connect(url: &str) -> Result<PostgresStore> {
        PostgresStoreBuilder::new().connect(url)
    }

    /// Creates the table, its token sequence and its expiry index unless
    /// they exist. Idempotent, and safe to run from several replicas at once
    /// (they serialise on an advisory lock); run it once at deploy, with a
    /// role allowed to create tables.
    ///
    /// Errors: [`Error::Corrupt`] when a table of that name exists but is
    /// not an idemstore table (nothing is changed); [`Error::UnsupportedFormat`]
    /// when a newer idemstore created it; [`Error::Backend`] for server errors.
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::connect("postgres://app@db.internal/orders")?;
    /// store.migrate()?;
    /// store.migrate()?; // a second run changes nothing
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn migrate(&self) -> Result<()> {
        schema::migrate(&mut *self.conn()?, &self.sql)
    }

    /// The table this store uses.
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::connect("postgres://app@db.internal/orders")?;
    /// assert_eq!(store.table(), idemstore::postgres::DEFAULT_TABLE);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    fn conn(&self) -> Result<r2d2::PooledConnection<pool::Manager>> {
        self.pool.get().map_err(pool_error)
    }

    /// Runs `op` on a pooled connection; when the server had ended that
    /// connection (after a restart or failover every idle pooled connection
    /// is dead), runs it again on another one, up to the pool size + 1
    /// times. `op` is told whether this is such a repetition: the first run
    /// may have committed before the connection died (its answer was lost),
    /// so a repeated `complete` or `release` that finds nothing to do checks
    /// whether its own first run did it. A repeated `begin` that finds its
    /// own lost claim answers InFlight: fail closed, as the error would.
    fn retrying<T>(
        &self,
        mut op: impl FnMut(&mut pool::Conn, bool) -> Result<T, RunError>,
    ) -> Result<T> {
        let attempts = self.pool.max_size().saturating_add(1);
        let mut last = None;
        for _ in 0..attempts {
            let mut conn = self.conn()?;
            match op(&mut conn, last.is_some()) {
                Err(RunError::Db(err)) if errors::is_dead_connection(&err) => {
                    // Returned to the pool closed, so r2d2 drops it.
                    last = Some(err);
                }
                Err(RunError::Db(err)) => return Err(self.db(err)),
                Err(RunError::Store(err)) => return Err(err),
                Ok(value) => return Ok(value),
            }
        }
        Err(match last {
            Some(err) => self.db(err),
            None => Error::backend("no PostgreSQL connection attempt was made"),
        })
    }

    /// The record for `key` as stored (expired or not), on `conn`.
    fn stored(conn: &mut pool::Conn, key: &Key) -> Result<Option<Record>, RunError> {
        let rows = conn.query(Stmt::Get, &[&key.scope(), &key.id()])?;
        Ok(match rows.first() {
            Some(found) => Some(row::record(key, found, 0)?),
            None => None,
        })
    }

    fn db(&self, err: ::postgres::Error) -> Error {
        db_error(err, &self.sql.table)
    }
}

impl Store for PostgresStore {
    fn begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        check_durations(lease, retention)?;
        let (scope, id, fp) = (key.scope(), key.id(), &fingerprint.as_bytes()[..]);
        let (at, lease_until, expires_at) = (
            row::millis(now),
            row::millis(now + lease),
            row::millis(now + retention),
        );
        let lock = sql::key_lock(&self.sql.table, key);
        self.retrying(|conn, _| {
            for _ in 0..MAX_BEGIN_ATTEMPTS {
                let rows = conn.query(
                    Stmt::Begin,
                    &[&scope, &id, &fp, &at, &lease_until, &expires_at, &lock],
                )?;
                // No row: another begin is claiming the key, or committed it
                // after this statement's snapshot was taken (see sql.rs).
                // Wait for that claim to commit, then run it again.
                let Some(first) = rows.first() else {
                    conn.execute(Stmt::WaitKey, &[&lock])?;
                    continue;
                };
                let claimed: bool = first.try_get(0)?;
                let record = row::record(key, first, 1)?;
                if claimed {
                    return Ok(Begin::Claimed(claim_of(&record)));
                }
                // Nothing was written: the answer is logic::begin's, from the
                // row as read. If that row would have been claimed, another
                // begin is claiming it or has (a newer row than the snapshot
                // shows); wait for it and run the statement again.
                let step =
                    logic::begin(Some(record), fingerprint, now, lease, retention, || Ok(0))?;
                if step.write.is_none() {
                    return Ok(step.answer);
                }
                conn.execute(Stmt::WaitKey, &[&lock])?;
            }
            Err(RunError::Store(Error::backend(format!(
                "begin on {key} raced with concurrent writers {MAX_BEGIN_ATTEMPTS} times in a row"
            ))))
        })
    }

    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        logic::check_response(response, self.max_body_bytes)?;
        let Some(token) = row::token(claim.token) else {
            return Err(Error::StaleClaim);
        };
        let r = row::response_columns(response);
        let (at, expires_at) = (row::millis(now), row::millis(now + retention));
        let done = self.retrying(|conn, retried| {
            let updated = conn.execute(
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
            )?;
            if updated > 0 || !retried {
                return Ok(updated > 0);
            }
            // Only this claim's holder can have stored a DONE record under
            // its token: if it holds this response, the lost first run did.
            Ok(PostgresStore::stored(conn, key)?.is_some_and(|rec| {
                rec.state == State::Done
                    && rec.token == claim.token
                    && rec.response.as_ref() == Some(response)
            }))
        })?;
        if done { Ok(()) } else { Err(Error::StaleClaim) }
    }

    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        let Some(token) = row::token(claim.token) else {
            return Err(Error::StaleClaim);
        };
        let released = self.retrying(|conn, retried| {
            let deleted = conn.execute(Stmt::Release, &[&key.scope(), &key.id(), &token])?;
            if deleted > 0 || !retried {
                return Ok(deleted > 0);
            }
            // Gone: the lost first run deleted it (or, if another owner took
            // over and then gave it up, the key is free all the same).
            Ok(PostgresStore::stored(conn, key)?.is_none())
        })?;
        if released {
            Ok(())
        } else {
            Err(Error::StaleClaim)
        }
    }

    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        let record = self.retrying(|conn, _| PostgresStore::stored(conn, key))?;
        Ok(logic::visible(record, now))
    }

    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        let max = max.min(MAX_SWEEP_BATCH);
        if max == 0 {
            return Ok(0);
        }
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        let deleted =
            self.retrying(|conn, _| Ok(conn.execute(Stmt::Sweep, &[&row::millis(now), &limit])?))?;
        let deleted = usize::try_from(deleted).unwrap_or(usize::MAX);
        crate::observability::swept("postgres", deleted);
        Ok(deleted)
    }

    fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.clock)
    }
}

/// What one run of a statement can fail with: the server's error (which
/// [`PostgresStore::retrying`] looks at) or one of ours.
enum RunError {
    Db(::postgres::Error),
    Store(Error),
}

impl From<::postgres::Error> for RunError {
    fn from(err: ::postgres::Error) -> RunError {
        RunError::Db(err)
    }
}

impl From<Error> for RunError {
    fn from(err: Error) -> RunError {
        RunError::Store(err)
    }
}

/// The claim for a record the statement just claimed. `logic::begin` gives
/// a fresh record attempt 1 and a takeover the previous attempts + 1, so
/// "attempt > 1" is exactly "this was a takeover".
fn claim_of(record: &Record) -> Claim {
    Claim {
        token: record.token,
        lease_until: record.lease_until.unwrap_or(Timestamp::EPOCH),
        takeover: record.attempts > 1,
        attempt: record.attempts,
    }
}
