//! The set-based statements of [`PgInbox::handle_batch`](super::PgInbox::handle_batch):
//! a whole batch locked, decided, and written DONE, a statement each.
//!
//! Each connection prepares them at its first batch (one round trip for
//! all three) and keeps them in [`InboxSql`]'s cache, beside the store's own
//! prepared statements ([`Stmt`](super::sql::Stmt)) rather than among them.
//! Prepared, they are planned once per connection (a generic plan after
//! PostgreSQL's first few custom ones), not at every batch: planning them
//! cost about as much as running them.

use super::pool::Conn;
use super::sql::{RECORD_COLUMNS, STATE_DONE, STATE_PROCESSING};
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use tokio_postgres::Statement;
use tokio_postgres::types::Type;

/// The inbox's statement texts for one table.
#[derive(Debug)]
pub(super) struct InboxSql {
    /// `$1 key locks bigint[]`, sorted: waits for and takes each key's
    /// transaction-scoped advisory lock, in that order → one row (a count).
    pub(super) lock_all: String,
    /// `$1 scopes bytea[], $2 ids bytea[], $3 fingerprints bytea[]` (one
    /// element per distinct key), `$4 now` → one row per key: `ord bigint`
    /// (its 1-based position), `token bigint` (drawn when the key's record
    /// is claimable for that fingerprint, else NULL), then
    /// [`RECORD_COLUMNS`] (all NULL when the key has no row).
    pub(super) decide: String,
    /// `$1 scopes bytea[], $2 ids bytea[], $3 fingerprints bytea[], $4
    /// expiries bigint[], $5 creation times bigint[], $6 tokens bigint[], $7
    /// attempts bigint[], $8 statuses int[], $9 first header int[], $10 last
    /// header int[] (1-based, inclusive, into $11 and $12), $11 header names
    /// bytea[], $12 header values bytea[], $13 bodies bytea[], $14 now` →
    /// one row (`ord bigint`, the 1-based position) per DONE record written.
    pub(super) write_done: String,
    /// `write_done`'s `$1` to `$13` → rows inserted: every record a new
    /// row, with no conflict check (a row that exists fails the statement;
    /// see `write_and_commit`).
    pub(super) insert_done: String,
    /// `SELECT nextval(..)`: one token.
    pub(super) next_token: String,
    /// The statements prepared on each connection that ran a batch; an
    /// entry whose connection is gone is dropped at the next insert.
    cache: Mutex<Vec<(Weak<Conn>, Arc<Prepared>)>>,
}

/// [`InboxSql`]'s statements prepared on one connection.
#[derive(Debug)]
pub(super) struct Prepared {
    pub(super) lock_all: Statement,
    pub(super) decide: Statement,
    pub(super) write_done: Statement,
    pub(super) insert_done: Statement,
}

impl InboxSql {
    /// `table` and `sequence` as [`Sql`](super::sql::Sql) holds them
    /// (checked identifiers).
    pub(super) fn new(table: &str, sequence: &str) -> InboxSql {
        let t = format!("\"{table}\"");
        let seq = format!("\"{sequence}\"");
        let (p, d) = (STATE_PROCESSING, STATE_DONE);
        let r_cols = RECORD_COLUMNS
            .split(',')
            .map(|c| format!("r.{}", c.trim()))
            .collect::<Vec<_>>()
            .join(", ");
        // Run after `lock_all` (in the same transaction, so with a snapshot
        // taken once every key's lock is held): no claim of these keys can
        // commit any more until this transaction ends, so the rows read
        // here are the ones to decide on. The claim decision is Begin's
        // (sql.rs): expired, or PROCESSING under the same fingerprint with
        // its lease run out. A claimable key draws its token here, under
        // its lock, so the claims of one key draw their tokens in the order
        // they commit, as with Begin. A record released with its steps kept
        // (`lease_until` 0) is claimable too, as `lease_until <= now` says;
        // logic::begin, on the row read, tells that claim from a takeover.
        let decide = format!(
            "SELECT u.ord,
                    CASE WHEN r.state IS NULL OR r.expires_at <= $4::bigint
                              OR (r.state = {p} AND r.fingerprint = u.wanted
                                  AND r.lease_until <= $4::bigint)
                         THEN nextval('{seq}') END AS token,
                    {r_cols}
               FROM unnest($1::bytea[], $2::bytea[], $3::bytea[])
                    WITH ORDINALITY AS u(scope, id, wanted, ord)
               LEFT JOIN {t} r ON r.scope = u.scope AND r.id = u.id"
        );
        // Each handled message's DONE record, as logic::begin and
        // logic::complete made it from the row `decide` read, written in one
        // statement (no PROCESSING row is ever written: it would live only
        // inside this transaction). Only writers that take no key lock can
        // have moved a row since `decide`: the previous owner's complete or
        // renew (the row is then not claimable, and is not written: the
        // caller rolls back and runs the batch again), a release or a sweep
        // (the row is gone, and the record is inserted). The WHERE is
        // Begin's claim condition on the newest row, under its row lock.
        // The headers of all responses come as two flat arrays, each
        // response's as a slice of them (an empty slice is an empty array,
        // as `complete` stores no headers).
        let write_done = format!(
            "WITH u AS MATERIALIZED (
                SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::bigint[],
                                     $5::bigint[], $6::bigint[], $7::bigint[], $8::int[],
                                     $9::int[], $10::int[], $13::bytea[])
                       WITH ORDINALITY AS u(scope, id, fingerprint, expires_at, created_at,
                                            token, attempts, status, first_header,
                                            last_header, body, ord)
            ),
            written AS (
                INSERT INTO {t} AS r (scope, id, fingerprint, state, lease_until, expires_at,
                                      created_at, token, attempts, status, header_names,
                                      header_values, body)
                SELECT u.scope, u.id, u.fingerprint, {d}::smallint, NULL, u.expires_at,
                       u.created_at, u.token, u.attempts, u.status,
                       ($11::bytea[])[u.first_header:u.last_header],
                       ($12::bytea[])[u.first_header:u.last_header], u.body
                  FROM u
                ON CONFLICT (scope, id) DO UPDATE SET
                    fingerprint = excluded.fingerprint,
                    state = {d},
                    lease_until = NULL,
                    expires_at = excluded.expires_at,
                    created_at = excluded.created_at,
                    token = excluded.token,
                    attempts = excluded.attempts,
                    status = excluded.status,
                    header_names = excluded.header_names,
                    header_values = excluded.header_values,
                    body = excluded.body,
                    step_names = '{{}}',
                    step_outputs = '{{}}'
                WHERE r.expires_at <= $14::bigint
                   OR (r.state = {p} AND r.fingerprint = excluded.fingerprint
                       AND r.lease_until <= $14::bigint)
                RETURNING r.scope, r.id
            )
            SELECT u.ord FROM written w JOIN u ON u.scope = w.scope AND u.id = w.id"
        );
        // write_done's INSERT alone, for keys that had no row.
        let insert_done = format!(
            "INSERT INTO {t} (scope, id, fingerprint, state, lease_until, expires_at, created_at,
                              token, attempts, status, header_names, header_values, body)
             SELECT u.scope, u.id, u.fingerprint, {d}::smallint, NULL, u.expires_at,
                    u.created_at, u.token, u.attempts, u.status,
                    ($11::bytea[])[u.first_header:u.last_header],
                    ($12::bytea[])[u.first_header:u.last_header], u.body
               FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::bigint[], $5::bigint[],
                           $6::bigint[], $7::bigint[], $8::int[], $9::int[], $10::int[],
                           $13::bytea[])
                    AS u(scope, id, fingerprint, expires_at, created_at, token, attempts,
                         status, first_header, last_header, body)"
        );
        // The locks in array order: the LATERAL function scan runs once per
        // element, in order (a nested loop over the unnest).
        let lock_all = "SELECT count(*) FROM unnest($1::bigint[]) AS u(lock), \
                        LATERAL pg_advisory_xact_lock(u.lock)"
            .to_owned();
        InboxSql {
            lock_all,
            decide,
            write_done,
            insert_done,
            next_token: format!("SELECT nextval('{seq}')"),
            cache: Mutex::new(Vec::new()),
        }
    }

    /// The statements prepared on `conn`: from the cache, or prepared now
    /// (the four requests sent together, one round trip).
    pub(super) async fn prepared(
        &self,
        conn: &Arc<Conn>,
    ) -> Result<Arc<Prepared>, tokio_postgres::Error> {
        let found = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|(c, _)| c.upgrade().is_some_and(|c| Arc::ptr_eq(&c, conn)))
            .map(|(_, p)| Arc::clone(p));
        if let Some(found) = found {
            return Ok(found);
        }
        let client = &conn.client;
        let (bytea, int8, int4) = (Type::BYTEA_ARRAY, Type::INT8_ARRAY, Type::INT4_ARRAY);
        let decide_types = [bytea.clone(), bytea.clone(), bytea.clone(), Type::INT8];
        let done_types = [
            bytea.clone(),
            bytea.clone(),
            bytea.clone(),
            int8.clone(),
            int8.clone(),
            int8.clone(),
            int8.clone(),
            int4.clone(),
            int4.clone(),
            int4,
            bytea.clone(),
            bytea.clone(),
            bytea,
            Type::INT8,
        ];
        let (((lock_all, decide), write_done), insert_done) = pipelined(
            pipelined(
                pipelined(
                    client.prepare_typed(&self.lock_all, &[int8]),
                    client.prepare_typed(&self.decide, &decide_types),
                ),
                client.prepare_typed(&self.write_done, &done_types),
            ),
            client.prepare_typed(&self.insert_done, &done_types[..13]),
        )
        .await;
        let prepared = Arc::new(Prepared {
            lock_all: lock_all?,
            decide: decide?,
            write_done: write_done?,
            insert_done: insert_done?,
        });
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        // A connection the pool dropped (dead, or discarded after a failed
        // transaction) takes its statements with it.
        cache.retain(|(c, _)| c.strong_count() > 0);
        cache.push((Arc::downgrade(conn), Arc::clone(&prepared)));
        Ok(prepared)
    }
}

/// Runs `a` and `b` together, polling `a` first. A statement's future sends
/// its request at its first poll, so both requests leave in this order
/// before either reply is awaited: two statements, one round trip.
pub(super) async fn pipelined<A: Future, B: Future>(a: A, b: B) -> (A::Output, B::Output) {
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    let (mut out_a, mut out_b) = (None, None);
    std::future::poll_fn(|cx| {
        if out_a.is_none()
            && let std::task::Poll::Ready(v) = a.as_mut().poll(cx)
        {
            out_a = Some(v);
        }
        if out_b.is_none()
            && let std::task::Poll::Ready(v) = b.as_mut().poll(cx)
        {
            out_b = Some(v);
        }
        match (out_a.take(), out_b.take()) {
            (Some(a), Some(b)) => std::task::Poll::Ready((a, b)),
            (a, b) => {
                (out_a, out_b) = (a, b);
                std::task::Poll::Pending
            }
        }
    })
    .await
}
