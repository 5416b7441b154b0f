//! The table, its sequence and index, the schema-version marker, and the
//! idempotent migration that creates them. This build reads the one schema
//! version it creates: a table of another version is refused.
//!
//! The version lives in the table's comment (`idemstore records, schema
//! version N`): reading it is one catalog lookup, and a table that someone
//! else created under the same name has no such comment, so it is refused
//! instead of written to.

use super::errors::db_error;
use super::sql::Sql;
use crate::error::{Error, Result};
use tokio_postgres::Client;

/// The schema this build creates, and the only one it reads or writes
/// (versions 1, with every record invariant also a CHECK constraint, 2,
/// without the step columns, and 3, with the key in the expiry index,
/// were made by pre-release builds only).
pub(super) const SCHEMA_VERSION: u32 = 4;
const MARKER_PREFIX: &str = "idemstore records, schema version ";

/// What the catalog says about the configured table.
enum Found {
    Absent,
    Current,
}

/// The check at build: the table must exist and be ours, of this schema
/// version. A missing table is [`Error::InvalidArgument`] (the store was
/// pointed at a table nobody created: migrate, or name another), an older
/// or newer version [`Error::UnsupportedFormat`] (the version found and
/// [`SCHEMA_VERSION`]), a table that is not ours
/// [`Error::Corrupt`]; none of them is transient, so a service fails at
/// start-up instead of answering 503 to every request.
pub(super) async fn check(client: &Client, sql: &Sql) -> Result<()> {
    match inspect(client, sql).await? {
        Found::Current => Ok(()),
        Found::Absent => Err(Error::invalid_argument(format!(
            "PostgreSQL table {} does not exist: run PostgresStore::migrate() once \
             (with a role allowed to create tables), or build with migrate_on_build(true)",
            sql.table
        ))),
    }
}

/// Creates the sequence, table and index unless they exist, in one
/// transaction under an advisory lock, so replicas migrating at the same
/// time do not trip over each other. A table of another schema version is
/// refused, as by [`check`]. On an error the transaction may
/// still be open: the caller drops the connection.
pub(super) async fn migrate(client: &Client, sql: &Sql) -> Result<()> {
    let db = |e| db_error(e, &sql.table);
    client.batch_execute("BEGIN").await.map_err(db)?;
    client
        .execute(
            "SELECT pg_advisory_xact_lock(hashtext($1))",
            &[&format!("idemstore migrate {}", sql.table)],
        )
        .await
        .map_err(db)?;
    match inspect(client, sql).await? {
        Found::Absent => client.batch_execute(&ddl(sql)).await.map_err(db)?,
        Found::Current => {}
    }
    client.batch_execute("COMMIT").await.map_err(db)
}

async fn inspect(client: &Client, sql: &Sql) -> Result<Found> {
    let db = |e| db_error(e, &sql.table);
    let row = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL, obj_description(to_regclass($1), 'pg_class')",
            &[&format!("\"{}\"", sql.table)],
        )
        .await
        .map_err(db)?;
    let exists: bool = row.try_get(0).map_err(db)?;
    let comment: Option<String> = row.try_get(1).map_err(db)?;
    if !exists {
        return Ok(Found::Absent);
    }
    let foreign = |why: &str| {
        Error::corrupt(
            None,
            format!(
                "table {} is not an idemstore table ({why}); nothing was written to it: \
                 choose another name with PostgresStoreBuilder::table",
                sql.table
            ),
        )
    };
    let version = comment
        .as_deref()
        .ok_or_else(|| foreign("it has no schema marker comment"))?
        .strip_prefix(MARKER_PREFIX)
        .ok_or_else(|| foreign("its comment is not the idemstore schema marker"))?
        .parse::<u32>()
        .map_err(|_| foreign("its schema marker has no version number"))?;
    match version {
        SCHEMA_VERSION => Ok(Found::Current),
        // Older (pre-release) or newer (a later release, or a number no
        // release wrote).
        found => Err(Error::UnsupportedFormat {
            found,
            supported: SCHEMA_VERSION,
        }),
    }
}

/// The schema. The record invariants `Record::check` tests are not CHECK
/// constraints: PostgreSQL parses a table's CHECK expressions again for
/// every statement that writes it, which was most of a claim's INSERT
/// (docs/format.md, "PostgreSQL schema"). Every row the store reads is
/// still checked (`row::record`), so a row a hand-written UPDATE broke is
/// reported as `Error::Corrupt` for its key when read, instead of refused
/// when written.
///
/// Steps are two arrays, names and outputs, the i-th of each one step, in
/// the order recorded (as the response's headers are): the statements
/// append a step, count the steps and find a released record's in the
/// server (`cardinality`, `array_append`), which one `bytea` of the codec's
/// encoding would hide from them, and an operator reads them with SQL.
/// Names are `bytea`, not `text`: a step name is any UTF-8 string, and
/// `text` cannot hold a NUL; `row::record` checks they are UTF-8. Not
/// null, empty by default, so a write that does not name them (a claim of
/// a fresh key, an inbox's DONE insert) stores no steps.
///
/// The expiry index is on `expires_at` alone: the sweep reads it in
/// expiry order and sorts each expiry's few rows by key (an incremental
/// sort). Every claim and completion writes an entry into it (a completion
/// moves the expiry, so it is never a HOT update), a third the size with
/// the key left out, and about 120 bytes less WAL a cycle.
fn ddl(sql: &Sql) -> String {
    let (t, seq, idx) = (&sql.table, &sql.sequence, &sql.index);
    format!(
        "CREATE SEQUENCE IF NOT EXISTS \"{seq}\" AS bigint MINVALUE 1 NO CYCLE;
        CREATE TABLE IF NOT EXISTS \"{t}\" (
            scope         bytea    NOT NULL,
            id            bytea    NOT NULL,
            fingerprint   bytea    NOT NULL,
            state         smallint NOT NULL,
            lease_until   bigint,
            expires_at    bigint   NOT NULL,
            created_at    bigint   NOT NULL,
            token         bigint   NOT NULL,
            attempts      bigint   NOT NULL,
            status        integer,
            header_names  bytea[],
            header_values bytea[],
            body          bytea,
            step_names    bytea[]  NOT NULL DEFAULT '{{}}',
            step_outputs  bytea[]  NOT NULL DEFAULT '{{}}',
            PRIMARY KEY (scope, id)
        );
        ALTER SEQUENCE \"{seq}\" OWNED BY \"{t}\".token;
        CREATE INDEX IF NOT EXISTS \"{idx}\" ON \"{t}\" (expires_at);
        COMMENT ON TABLE \"{t}\" IS '{MARKER_PREFIX}{SCHEMA_VERSION}';"
    )
}
