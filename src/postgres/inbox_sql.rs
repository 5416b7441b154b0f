//! The set-based statements of [`PgInbox::handle_batch`](super::PgInbox::handle_batch):
//! a whole batch claimed in one statement and marked DONE in another.
//!
//! They are run unprepared (`query_typed`: parse, bind and execute in one
//! round trip), once or twice per batch, so they need no slot among the
//! store's prepared statements ([`Stmt`](super::sql::Stmt)).

use super::sql::{RECORD_COLUMNS, STATE_DONE, STATE_PROCESSING};

/// The inbox's statement texts for one table.
#[derive(Debug)]
pub(super) struct InboxSql {
    /// `$1 scopes bytea[], $2 ids bytea[], $3 fingerprints bytea[], $4 key
    /// locks bigint[]` (one element per distinct key, sorted by lock), `$5
    /// now, $6 now + lease, $7 now + retention` → one row per key that was
    /// claimed or has a row in the statement's snapshot: `ord bigint` (the
    /// key's 1-based position in the arrays), `claimed bool`, then
    /// [`RECORD_COLUMNS`]. A key without a row is being claimed by another
    /// transaction, or was committed after the snapshot: see
    /// [`claim`](InboxSql::claim)'s comment.
    pub(super) claim: String,
    /// `$1 scopes bytea[], $2 ids bytea[], $3 tokens bigint[], $4 statuses
    /// int[], $5 first header int[], $6 last header int[] (1-based,
    /// inclusive, into $7 and $8), $7 header names bytea[], $8 header values
    /// bytea[], $9 bodies bytea[], $10 now, $11 now + retention` → one row
    /// (`ord bigint`, the 1-based position) per record written DONE.
    pub(super) done: String,
    /// `$1 key locks bigint[]` (sorted): waits for and takes each key's
    /// transaction-scoped advisory lock, in that order.
    pub(super) lock_all: String,
}

impl InboxSql {
    /// `table` and `sequence` as [`Sql`](super::sql::Sql) holds them
    /// (checked identifiers).
    pub(super) fn new(table: &str, sequence: &str) -> InboxSql {
        let t = format!("\"{table}\"");
        let seq = format!("\"{sequence}\"");
        let (p, d) = (STATE_PROCESSING, STATE_DONE);
        let columns = |prefix: &str| {
            RECORD_COLUMNS
                .split(',')
                .map(|c| format!("{prefix}.{}", c.trim()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (c_cols, l_cols) = (columns("c"), columns("l"));
        // Each key's claim decision is `Stmt::Begin`'s (see sql.rs), made for
        // every key of the batch at once:
        //
        // 1. `locked` reads each key's row as the statement's snapshot shows
        //    it. A live row that cannot be claimed (DONE, PROCESSING under a
        //    live lease, another fingerprint) is returned as it is, unlocked
        //    and unwritten: the caller's `logic::begin` answers Replay,
        //    InFlight or Conflict from it.
        // 2. Otherwise the key's transaction-scoped advisory lock is taken,
        //    WAITING for it (Begin only tries it), and only then is its token
        //    drawn (`nextval` in the INSERT's SELECT, a row at a time). Every
        //    claim of a key, through the store or an inbox, draws its token
        //    under that lock, held until its commit: so the claims of one key
        //    draw their tokens in the order they commit, as with Begin.
        // 3. The INSERT .. ON CONFLICT .. WHERE decides on the newest
        //    committed row, under its row lock: the atomic step. A key the
        //    snapshot showed claimable but whose newest row is not (a claim
        //    committed after the snapshot, the one this statement waited
        //    for) gets no row back, or its snapshot row; the caller runs the
        //    statement again for those keys, with a new snapshot. It then
        //    holds their locks, so nothing but a store's own complete,
        //    release, renew or sweep can move them again.
        //
        // Deadlocks: the keys come sorted by lock id, one row each, and the
        // LATERAL subquery (kept a subquery by its LIMIT, so a nested loop
        // over `input` in array order) takes the locks in that order. Two
        // batches therefore take the locks they share in the same order,
        // and a claimer waits on a row only after it holds the key's lock,
        // which no other claimer then holds (the store's own writes wait
        // for nothing while they hold a row). So batches never wait on each
        // other in a cycle, whatever their overlap.
        //
        // Waiting (not trying, as Begin does) is what a batch needs: a key
        // being claimed elsewhere (another consumer handling the same
        // message) is answered once that claim commits or rolls back
        // (Duplicate, or claimed here), in this same statement and the one
        // rerun, without a round trip per key.
        let claim = format!(
            "WITH input AS MATERIALIZED (
                SELECT u.scope, u.id, u.wanted, u.lock, u.ord
                  FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::bigint[])
                       WITH ORDINALITY AS u(scope, id, wanted, lock, ord)
            ),
            locked AS MATERIALIZED (
                SELECT i.*, r.*,
                       CASE WHEN r.state IS NULL OR r.expires_at <= $5::bigint
                                 OR (r.state = {p} AND r.fingerprint = i.wanted
                                     AND r.lease_until <= $5::bigint)
                            THEN (SELECT true FROM pg_advisory_xact_lock(i.lock))
                            ELSE false END AS held
                  FROM input i
                  LEFT JOIN LATERAL (
                      SELECT {RECORD_COLUMNS} FROM {t} s
                       WHERE s.scope = i.scope AND s.id = i.id LIMIT 1
                  ) r ON true
            ),
            claimed AS (
                INSERT INTO {t} AS r (scope, id, fingerprint, state, lease_until, expires_at,
                                      created_at, token, attempts)
                SELECT l.scope, l.id, l.wanted, {p}::smallint, $6::bigint, $7::bigint,
                       $5::bigint, nextval('{seq}'), 1
                  FROM locked l WHERE l.held
                ON CONFLICT (scope, id) DO UPDATE SET
                    fingerprint = excluded.fingerprint,
                    state = {p},
                    lease_until = excluded.lease_until,
                    expires_at = CASE WHEN r.expires_at <= $5::bigint THEN excluded.expires_at
                                      ELSE GREATEST(r.expires_at, excluded.lease_until) END,
                    created_at = CASE WHEN r.expires_at <= $5::bigint THEN excluded.created_at
                                      ELSE r.created_at END,
                    token = excluded.token,
                    attempts = CASE WHEN r.expires_at <= $5::bigint THEN 1
                                    ELSE LEAST(r.attempts + 1, 4294967295) END,
                    status = NULL, header_names = NULL, header_values = NULL, body = NULL
                WHERE r.expires_at <= $5::bigint
                   OR (r.state = {p} AND r.fingerprint = excluded.fingerprint
                       AND r.lease_until <= $5::bigint)
                RETURNING r.scope, r.id, {RECORD_COLUMNS}
            )
            SELECT l.ord, true AS claimed, {c_cols}
              FROM claimed c JOIN locked l ON l.scope = c.scope AND l.id = c.id
            UNION ALL
            SELECT l.ord, false, {l_cols}
              FROM locked l
             WHERE l.state IS NOT NULL
               AND NOT EXISTS (SELECT 1 FROM claimed c WHERE c.scope = l.scope AND c.id = l.id)"
        );
        // `complete`'s ownership check (PROCESSING, same token, not expired)
        // for every record at once. The headers of all responses come as
        // two flat arrays, each response's as a slice of them (an empty
        // slice is an empty array, as `complete` stores no headers).
        let done = format!(
            "UPDATE {t} AS r SET state = {d}, lease_until = NULL, expires_at = $11::bigint,
                    status = u.status,
                    header_names = ($7::bytea[])[u.first_header:u.last_header],
                    header_values = ($8::bytea[])[u.first_header:u.last_header],
                    body = u.body
               FROM unnest($1::bytea[], $2::bytea[], $3::bigint[], $4::int[], $5::int[],
                           $6::int[], $9::bytea[])
                    WITH ORDINALITY AS u(scope, id, token, status, first_header, last_header,
                                         body, ord)
              WHERE r.scope = u.scope AND r.id = u.id AND r.state = {p}
                AND r.token = u.token AND r.expires_at > $10::bigint
              RETURNING u.ord"
        );
        let lock_all = "SELECT true FROM unnest($1::bigint[]) AS u(lock), \
                        LATERAL pg_advisory_xact_lock(u.lock)"
            .to_owned();
        InboxSql {
            claim,
            done,
            lock_all,
        }
    }
}
