//! The statements, written once per store for its table.
//!
//! Every call is one statement in its own (autocommit) transaction, so one
//! round trip and one commit. The five `begin` cases of `logic::begin` are
//! mirrored in the `ON CONFLICT .. DO UPDATE .. WHERE` of [`Stmt::Begin`];
//! the answers that write nothing (Conflict, Replay, InFlight) are decided
//! by `logic::begin` itself from the row the statement returns.

use crate::key::Key;

/// `state` column values (the same numbers as the record codec's tags).
pub(super) const STATE_PROCESSING: i16 = 1;
pub(super) const STATE_DONE: i16 = 2;

/// The record columns, in the order [`super::row`] decodes them.
pub(super) const RECORD_COLUMNS: &str = "fingerprint, state, lease_until, expires_at, created_at, \
     token, attempts, status, header_names, header_values, body, step_names, step_outputs";

/// The record columns as the group statement's `live` reads them (from
/// the table, aliased `r`).
const LIVE_COLUMNS: &str = "r.fingerprint, r.state, r.lease_until, r.expires_at, r.created_at, \
     r.token, r.attempts, r.status, r.header_names, r.header_values, r.body, r.step_names, \
     r.step_outputs";

/// The record columns as an `INSERT .. RETURNING` of the table aliased `r`.
const CLAIMED_COLUMNS: &str = LIVE_COLUMNS;

/// The settings that set-based statements (a group's, an inbox batch's
/// `decide`) are planned under, for the rest of the transaction: the text
/// of [`Stmt::PlanSettings`], run right after `BEGIN`. Those statements
/// join arrays of keys against the table, and are prepared. Left to
/// itself, PostgreSQL would plan them afresh at every run (a custom plan
/// looks cheaper than the generic one, since it knows the arrays'
/// lengths), and, planned while the table is small (a new deploy), would
/// pick a sequential scan and a hash join and keep that plan as the table
/// grows. Every run of such a statement happens after these settings: one
/// generic plan per connection, made of index lookups per key whatever the
/// table's size. A prepared `set_config` costs next to nothing, where the
/// same settings as `SET LOCAL` commands are a simple query parsed every
/// time (docs/performance.md, "PostgreSQL", for the figures).
const PLAN_SETTINGS: &str = "SELECT set_config('enable_seqscan', 'off', true), \
     set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true), \
     set_config('plan_cache_mode', 'force_generic_plan', true)";

/// Puts [`Stmt::PlanSettings`]' settings back to the session's for the rest of
/// the transaction: sent before a handler's own statements run.
pub(super) const SET_END: &str = "SET LOCAL enable_seqscan TO DEFAULT; \
     SET LOCAL enable_hashjoin TO DEFAULT; SET LOCAL enable_mergejoin TO DEFAULT; \
     SET LOCAL plan_cache_mode TO DEFAULT";

/// The statements a connection prepares (on first use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stmt {
    /// `$1 scope, $2 id, $3 fingerprint, $4 now, $5 now + lease, $6 now + retention,
    /// $7 key lock` → at most one row: `claimed bool`, `released bool` (the
    /// claimed row was [released](RELEASED) with its steps kept: the claim
    /// is not a takeover), then [`RECORD_COLUMNS`].
    Begin = 0,
    /// `$1 scope, $2 id, $3 token, $4 now, $5 now + retention, $6 status,
    /// $7 header names, $8 header values, $9 body` → rows affected (0 or 1).
    Complete = 1,
    /// `$1 scope, $2 id, $3 token` → rows deleted (0 or 1): the owner's
    /// record when it has no steps. Sent with [`Stmt::ReleaseKeep`] (their
    /// conditions exclude each other, so their order does not matter).
    Release = 2,
    /// `$1 scope, $2 id` → at most one row of [`RECORD_COLUMNS`].
    Get = 3,
    /// `$1 now, $2 max` → rows deleted.
    Sweep = 4,
    /// `$1 key lock`: waits until no begin holds the key's advisory lock
    /// (and releases it at once: autocommit).
    WaitKey = 5,
    /// `$1 scope, $2 id, $3 token, $4 now, $5 now + lease` → at most one
    /// row: the new `lease_until`.
    Renew = 6,
    /// A group's begins, one statement (see `group`): arrays `$1 scopes,
    /// $2 ids, $3 fingerprints, $4 nows, $5 lease deadlines, $6 expiries,
    /// $7 key locks`, one element per job, distinct keys in key order →
    /// rows of `n bigint`, `claimed bool`, `released bool` (always false:
    /// a group never claims a released row), [`RECORD_COLUMNS`], `scope`,
    /// `id`: a claim (`n` NULL, the key naming its job), or a key's row as
    /// read (`n` the job's 1-based position, the key NULL); a job with
    /// neither must run again alone.
    BeginGroup = 7,
    /// A group's completes, one statement: arrays `$1 scopes, $2 ids,
    /// $3 tokens, $4 nows, $5 expiries, $6 statuses, $7 bodies, $8 each
    /// job's first header's offset in $9/$10, $9 header names, $10 header
    /// values (all jobs' headers, concatenated)`, distinct keys → the `n` of
    /// each job that stored its response.
    CompleteGroup = 8,
    /// [`PLAN_SETTINGS`]: one row, the four settings as set.
    PlanSettings = 9,
    /// No arguments → one row. A transaction that writes one WAL record
    /// and nothing else: its commit waits, as every commit does, until
    /// the WAL up to it is as durable as `synchronous_commit` asks (on a
    /// synchronous standby too), so everything committed before it is.
    /// Run before an answer learnt by reading is acknowledged.
    Durable = 10,
    /// [`Stmt::Begin`]'s arguments → one row, the new `token`, when the
    /// key had no row and the statement claimed it; no row otherwise (a
    /// row exists, or another begin holds the key's lock), and then
    /// [`Stmt::Begin`] decides.
    BeginFresh = 11,
    /// `$1 scope, $2 id, $3 token` → rows updated (0 or 1): the owner's
    /// record when it has steps, kept with its lease at [`RELEASED`].
    ReleaseKeep = 12,
    /// `$1 scope, $2 id, $3 token, $4 now, $5 step name, $6 step output,
    /// $7 how many steps the caller read` → rows updated (0 or 1): the step
    /// appended when the owner's record still holds exactly the steps read.
    RecordStep = 13,
}

impl Stmt {
    pub(super) const COUNT: usize = 14;
}

/// `lease_until` of a PROCESSING record whose owner released it and whose
/// steps are kept (`logic`'s `RELEASED`, `Timestamp::EPOCH`, as stored):
/// over at any `now`, so every claim condition below (`lease_until <= now`)
/// already finds it claimable, and every ownership check refuses it
/// (`lease_until <> RELEASED`). A real lease is never 0: it is `now +
/// lease` with a lease of at least 1 ms.
pub(super) const RELEASED: i64 = 0;

/// The statement texts and object names for one table.
#[derive(Debug)]
pub(super) struct Sql {
    pub(super) table: String,
    pub(super) sequence: String,
    pub(super) index: String,
    texts: [String; Stmt::COUNT],
}

impl Sql {
    /// `table` is a checked identifier (lower-case ASCII, digits, `_`), so
    /// formatting it into the SQL is safe; it is quoted anyway so that a
    /// reserved word (`user`, `order`) works as a name.
    pub(super) fn new(table: &str) -> Sql {
        let sequence = format!("{table}_token_seq");
        let index = format!("{table}_expires_idx");
        let t = format!("\"{table}\"");
        let seq = format!("\"{sequence}\"");
        let (p, d, rel) = (STATE_PROCESSING, STATE_DONE, RELEASED);
        // The claim decision is logic::begin's, and nothing else: the key's
        // record is expired (`now >= expires_at`: a fresh record replaces
        // it), or it is PROCESSING under the same fingerprint with its lease
        // run out (a takeover: new token, lease renewed, expiry never
        // earlier, attempts + 1 saturating at u32::MAX, steps kept; an
        // expired record's steps go with it). A record its owner released
        // with its steps kept (`lease_until = RELEASED`) is claimed the
        // same way, at once, but the claim is not a takeover. It is made
        // twice:
        //
        // 1. On the row as the statement's snapshot shows it (`live`). When
        //    that row is live and not claimable, the statement writes and
        //    locks nothing, and the answer (Replay, InFlight, Conflict) is
        //    logic::begin's on that row: a replay costs no row lock, no
        //    transaction id and no WAL flush.
        // 2. Otherwise, in the ON CONFLICT .. WHERE, on the newest committed
        //    row, under its row lock: the atomic step. If it claims, RETURNING
        //    has the new record. If not, a concurrent transaction committed
        //    the key after the snapshot was taken; the statement then returns
        //    the snapshot's row (claimable) or none, and the caller runs it
        //    again with a new snapshot.
        //
        // Takeover or not: logic::begin tells them apart by the lease the
        // claimed row had (RELEASED or run out), which RETURNING cannot
        // show (it shows the new row). So the statement claims a row only
        // when the newest row and the snapshot's (`released`) agree on
        // being released, and answers the snapshot's. When they do not
        // (the owner released the row after the snapshot was taken; the
        // other way round needs a claim, which the key lock excludes), it
        // claims nothing and runs again, as after any other change.
        //
        // Tokens: a claiming begin takes a transaction-scoped advisory lock
        // on the key ($7, see `key_lock`) and only then draws its token, so
        // claims of one key draw their tokens in the order they commit.
        // Without it, a fresh INSERT draws its token before it looks for a
        // conflicting row, and may wait there (for a concurrent release or
        // sweep of that row) while another begin claims and releases the
        // key with a larger token: the later claim would get the smaller one.
        //
        // The lock is only tried, not waited for: when another begin holds
        // it (it is claiming the key right now), this statement writes
        // nothing and returns what its snapshot shows; the caller then waits
        // for that claim's commit with [`Stmt::WaitKey`], which takes no row
        // lock and flushes nothing, and runs the statement again. Waiting
        // here instead would make every concurrent duplicate lock the row
        // and flush the WAL in turn behind the claim.
        let begin = format!(
            "WITH live AS (
                SELECT {RECORD_COLUMNS} FROM {t} WHERE scope = $1 AND id = $2
            ),
            key_lock AS MATERIALIZED (
                SELECT CASE WHEN NOT EXISTS (
                           SELECT 1 FROM live
                            WHERE expires_at > $4
                              AND NOT (state = {p} AND fingerprint = $3::bytea
                                       AND lease_until <= $4))
                       THEN pg_try_advisory_xact_lock($7::bigint)
                       ELSE false END AS held
            ),
            released AS (
                SELECT coalesce(bool_or(lease_until = {rel}), false) AS was FROM live
            ),
            claimed AS (
                INSERT INTO {t} AS r (scope, id, fingerprint, state, lease_until, expires_at,
                                      created_at, token, attempts)
                SELECT $1::bytea, $2::bytea, $3::bytea, {p}::smallint, $5::bigint, $6::bigint,
                       $4::bigint, nextval('{seq}'), 1
                  FROM key_lock WHERE held
                ON CONFLICT (scope, id) DO UPDATE SET
                    fingerprint = excluded.fingerprint,
                    state = {p},
                    lease_until = excluded.lease_until,
                    expires_at = CASE WHEN r.expires_at <= $4 THEN excluded.expires_at
                                      ELSE GREATEST(r.expires_at, excluded.lease_until) END,
                    created_at = CASE WHEN r.expires_at <= $4 THEN excluded.created_at
                                      ELSE r.created_at END,
                    token = excluded.token,
                    attempts = CASE WHEN r.expires_at <= $4 THEN 1
                                    ELSE LEAST(r.attempts + 1, 4294967295) END,
                    status = NULL, header_names = NULL, header_values = NULL, body = NULL,
                    step_names = CASE WHEN r.expires_at <= $4 THEN '{{}}' ELSE r.step_names END,
                    step_outputs = CASE WHEN r.expires_at <= $4 THEN '{{}}'
                                        ELSE r.step_outputs END
                WHERE r.expires_at <= $4
                   OR (r.state = {p} AND r.fingerprint = excluded.fingerprint
                       AND r.lease_until <= $4
                       AND (r.lease_until = {rel}) = (SELECT was FROM released))
                RETURNING {RECORD_COLUMNS}
            )
            SELECT true AS claimed, (SELECT was FROM released), {RECORD_COLUMNS} FROM claimed
            UNION ALL
            SELECT false, false, {RECORD_COLUMNS} FROM live
             WHERE NOT EXISTS (SELECT 1 FROM claimed)"
        );
        // Stmt::Begin's claim of an absent key alone, the common case: the
        // record logic::begin makes when there is none, under the same
        // advisory lock, the token drawn after the lock is held (nextval is
        // in the target list, evaluated only once the WHERE has passed).
        // Nothing else is decided here: a row of the key, committed or not
        // (the conflict, checked under the lock, after the token is drawn:
        // a token is spent, which leaves a gap and orders nothing), or a
        // lock held elsewhere writes nothing and returns no row, and
        // Stmt::Begin runs. One plain INSERT is what the server runs
        // fastest: no probe for the row first (a second index descent on
        // every fresh claim, telling nothing the conflict does not).
        let begin_fresh = format!(
            "INSERT INTO {t} (scope, id, fingerprint, state, lease_until, expires_at,
                              created_at, token, attempts)
             SELECT $1::bytea, $2::bytea, $3::bytea, {p}::smallint, $5::bigint, $6::bigint,
                    $4::bigint, nextval('{seq}'), 1
              WHERE pg_try_advisory_xact_lock($7::bigint)
             ON CONFLICT (scope, id) DO NOTHING
             RETURNING token"
        );
        // logic::complete's ownership check (logic's `owned`): PROCESSING,
        // same token, not released, not expired. A DONE record has no steps.
        let complete = format!(
            "UPDATE {t} SET state = {d}, lease_until = NULL, expires_at = $5,
                    status = $6, header_names = $7, header_values = $8, body = $9,
                    step_names = '{{}}', step_outputs = '{{}}'
              WHERE scope = $1 AND id = $2 AND state = {p} AND token = $3
                AND lease_until <> {rel} AND expires_at > $4"
        );
        // logic::release's check: PROCESSING, same token, not released
        // (expiry not checked); then logic::release's choice, one statement
        // each: no steps, the row is deleted; steps, it is kept, its lease
        // at RELEASED. Steps under one token are only ever appended, so a
        // step recorded between the two only moves the row from the first
        // statement's case to the second's.
        let release = format!(
            "DELETE FROM {t} WHERE scope = $1 AND id = $2 AND state = {p} AND token = $3
                AND lease_until <> {rel} AND cardinality(step_names) = 0"
        );
        let release_keep = format!(
            "UPDATE {t} SET lease_until = {rel}
              WHERE scope = $1 AND id = $2 AND state = {p} AND token = $3
                AND lease_until <> {rel} AND cardinality(step_names) > 0"
        );
        // logic::renew: the owner's check (PROCESSING, same token, not
        // released, not expired), the lease never shortened, the expiry
        // never before it.
        let renew = format!(
            "UPDATE {t} SET lease_until = GREATEST(lease_until, $5),
                    expires_at = GREATEST(expires_at, lease_until, $5)
              WHERE scope = $1 AND id = $2 AND state = {p} AND token = $3
                AND lease_until <> {rel} AND expires_at > $4
              RETURNING lease_until"
        );
        // logic::record_step's write, once logic::record_step has decided
        // it on the row as read ($7: how many steps that row held): the
        // owner's check (PROCESSING, same token, not released, not expired)
        // on the newest row under its row lock, and the steps unchanged
        // since the read. Under one token the steps are only ever appended
        // (a takeover, a fresh claim, a complete or a release changes the
        // token, the state or the lease, which the owner's check refuses),
        // so the same count is the same steps, and the append is what
        // logic::record_step decided. No row: the record changed since the
        // read; the caller reads it and decides again.
        let record_step = format!(
            "UPDATE {t} SET step_names = array_append(step_names, $5::bytea),
                    step_outputs = array_append(step_outputs, $6::bytea)
              WHERE scope = $1 AND id = $2 AND state = {p} AND token = $3
                AND lease_until <> {rel} AND expires_at > $4
                AND cardinality(step_names) = $7::integer"
        );
        // Stmt::Begin over a group of distinct keys: the same two decisions
        // per row, each job's own `now` standing where $4 stands above
        // (`p.at`; in the ON CONFLICT, `excluded.created_at`, which the
        // INSERT sets to it). `probe` reads each key's row (an index lookup
        // per key) and tries the key's advisory lock when that row is
        // absent or claimable, as `key_lock` above; the claimable keys then
        // draw their tokens in key order. The keys come sorted, so the
        // INSERT takes its row locks in key order.
        //
        // Rows: each claim (`n` NULL: the key, last, names its job), then
        // every key's row as read (`n` its 1-based position, `claimed`
        // false). Nothing joins the claims back to the input: without hash
        // joins (PLAN_SETTINGS) that join was a nested loop over both lists,
        // quadratic in the group's size.
        //
        // A released row (lease_until = RELEASED) is never claimed here:
        // telling that claim from a takeover needs the claimed row's old
        // lease, which the claims could only get by that join. Its key's
        // lock is not tried, the ON CONFLICT refuses it too (a release
        // committed after the probe), and the job's row as read is then a
        // claimable one, so the job runs again alone (Stmt::Begin), which
        // claims it.
        let begin_group = format!(
            "WITH input AS (
                SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::bigint[],
                                     $5::bigint[], $6::bigint[], $7::bigint[])
                       WITH ORDINALITY AS i(scope, id, fp, at, lease_until, expires_at, lock, n)
            ),
            probe AS MATERIALIZED (
                SELECT i.n, i.scope AS k_scope, i.id AS k_id, i.fp, i.at,
                       i.lease_until AS k_lease_until, i.expires_at AS k_expires_at,
                       {LIVE_COLUMNS},
                       CASE WHEN r.state IS NULL
                                 OR NOT coalesce(r.expires_at > i.at
                                                 AND NOT (r.state = {p} AND r.fingerprint = i.fp
                                                          AND r.lease_until <= i.at
                                                          AND r.lease_until <> {rel}), false)
                            THEN pg_try_advisory_xact_lock(i.lock)
                            ELSE false END AS held
                  FROM input i LEFT JOIN {t} r ON r.scope = i.scope AND r.id = i.id
                 ORDER BY i.n
            ),
            claimed AS (
                INSERT INTO {t} AS r (scope, id, fingerprint, state, lease_until, expires_at,
                                      created_at, token, attempts)
                SELECT p.k_scope, p.k_id, p.fp, {p}::smallint, p.k_lease_until,
                       p.k_expires_at, p.at, nextval('{seq}'), 1
                  FROM probe p
                 WHERE p.held
                 ORDER BY p.n
                ON CONFLICT (scope, id) DO UPDATE SET
                    fingerprint = excluded.fingerprint,
                    state = {p},
                    lease_until = excluded.lease_until,
                    expires_at = CASE WHEN r.expires_at <= excluded.created_at
                                      THEN excluded.expires_at
                                      ELSE GREATEST(r.expires_at, excluded.lease_until) END,
                    created_at = CASE WHEN r.expires_at <= excluded.created_at
                                      THEN excluded.created_at
                                      ELSE r.created_at END,
                    token = excluded.token,
                    attempts = CASE WHEN r.expires_at <= excluded.created_at THEN 1
                                    ELSE LEAST(r.attempts + 1, 4294967295) END,
                    status = NULL, header_names = NULL, header_values = NULL, body = NULL,
                    step_names = CASE WHEN r.expires_at <= excluded.created_at THEN '{{}}'
                                      ELSE r.step_names END,
                    step_outputs = CASE WHEN r.expires_at <= excluded.created_at THEN '{{}}'
                                        ELSE r.step_outputs END
                WHERE r.expires_at <= excluded.created_at
                   OR (r.state = {p} AND r.fingerprint = excluded.fingerprint
                       AND r.lease_until <= excluded.created_at AND r.lease_until <> {rel})
                RETURNING {CLAIMED_COLUMNS}, r.scope, r.id
            )
            SELECT NULL::bigint AS n, true AS claimed, false AS released, {RECORD_COLUMNS},
                   scope, id
              FROM claimed
            UNION ALL
            SELECT n, false, false, {RECORD_COLUMNS}, NULL::bytea, NULL::bytea FROM probe
             WHERE state IS NOT NULL"
        );
        // Stmt::Complete over a group of distinct keys; each job's headers
        // are its slice of the concatenated arrays (an empty slice is `{}`).
        let complete_group = format!(
            "UPDATE {t} r SET state = {d}, lease_until = NULL, expires_at = u.expires_at,
                    step_names = '{{}}', step_outputs = '{{}}', status = u.status,
                    header_names = ($9::bytea[])[u.first + 1 : u.next],
                    header_values = ($10::bytea[])[u.first + 1 : u.next],
                    body = u.body
               FROM (SELECT *, lead(first, 1, cardinality($9::bytea[])) OVER (ORDER BY n) AS next
                       FROM unnest($1::bytea[], $2::bytea[], $3::bigint[], $4::bigint[],
                                   $5::bigint[], $6::integer[], $7::bytea[], $8::integer[])
                            WITH ORDINALITY AS u(scope, id, token, at, expires_at, status, body,
                                                 first, n)) u
              WHERE r.scope = u.scope AND r.id = u.id AND r.state = {p} AND r.token = u.token
                AND r.lease_until <> {rel} AND r.expires_at > u.at
              RETURNING u.n"
        );
        let get = format!("SELECT {RECORD_COLUMNS} FROM {t} WHERE scope = $1 AND id = $2");
        // Oldest expiry first through the expiry index, ties in key order
        // (as the other stores and the model sweep them: an incremental sort
        // of each expiry's rows, read in index order); rows another sweeper
        // (another replica) or a begin has locked are skipped, not waited
        // for. The DELETE re-checks the expiry (logic::sweepable).
        let sweep = format!(
            "WITH due AS (
                SELECT scope, id FROM {t} WHERE expires_at <= $1
                 ORDER BY expires_at, scope, id LIMIT $2 FOR UPDATE SKIP LOCKED
            )
            DELETE FROM {t} r USING due
             WHERE r.scope = due.scope AND r.id = due.id AND r.expires_at <= $1"
        );
        Sql {
            table: table.to_owned(),
            sequence,
            index,
            texts: [
                begin,
                complete,
                release,
                get,
                sweep,
                "SELECT pg_advisory_xact_lock($1::bigint)".to_owned(),
                renew,
                begin_group,
                complete_group,
                PLAN_SETTINGS.to_owned(),
                "SELECT pg_logical_emit_message(true, 'idemstore', '')".to_owned(),
                begin_fresh,
                release_keep,
                record_step,
            ],
        }
    }

    pub(super) fn text(&self, stmt: Stmt) -> &str {
        self.texts.get(stmt as usize).map_or("", String::as_str)
    }
}

/// The advisory-lock id of `key` in `table`: the first 8 bytes of a SHA-256
/// over both (length-prefixed), the same in every replica and build. Two
/// keys that collide only serialise their begins.
pub(super) fn key_lock(table: &str, key: &Key) -> i64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [table.as_bytes(), key.scope(), key.id()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    let digest = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(digest.get(..8).unwrap_or(&[0; 8]));
    i64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_locks_differ_by_table_scope_and_id() {
        let k = |s: &str, i: &str| Key::new(s, i).unwrap();
        let a = key_lock("t", &k("ab", "c"));
        assert_eq!(a, key_lock("t", &k("ab", "c")));
        assert_ne!(a, key_lock("t", &k("a", "bc")));
        assert_ne!(a, key_lock("u", &k("ab", "c")));
    }
}
