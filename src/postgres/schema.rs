//! The table, its sequence and index, the schema-version marker, and the
//! idempotent migration that creates them.
//!
//! The version lives in the table's comment (`idemstore records, schema
//! version N`): reading it is one catalog lookup, and a table that someone
//! else created under the same name has no such comment, so it is refused
//! instead of written to.

use super::errors::db_error;
use super::sql::{STATE_DONE, STATE_PROCESSING, Sql};
use crate::error::{Error, Result};
use tokio_postgres::Client;

/// The schema this build creates and reads.
pub(super) const SCHEMA_VERSION: u32 = 1;
const MARKER_PREFIX: &str = "idemstore records, schema version ";

/// What the catalog says about the configured table.
enum Found {
    Absent,
    Current,
}

/// The check at build: the table must exist and be ours, of this schema
/// version. A missing table is [`Error::InvalidArgument`] (the store was
/// pointed at a table nobody created: migrate, or name another), an older
/// or newer version [`Error::UnsupportedFormat`], a table that is not ours
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
/// time do not trip over each other. On an error the transaction may still
/// be open: the caller drops the connection.
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
    if let Found::Absent = inspect(client, sql).await? {
        client.batch_execute(&ddl(sql)).await.map_err(db)?;
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
        // Newer: written by a later release. Older: there is none yet
        // (version 1 is the first); a later release migrates it forward.
        found => Err(Error::UnsupportedFormat {
            found,
            supported: SCHEMA_VERSION,
        }),
    }
}

/// The schema. Every record invariant `Record::check` tests is also a
/// CHECK constraint, so no writer (this one, or a hand-written UPDATE) can
/// store a record the store would refuse to read.
fn ddl(sql: &Sql) -> String {
    let (t, seq, idx) = (&sql.table, &sql.sequence, &sql.index);
    let (p, d) = (STATE_PROCESSING, STATE_DONE);
    format!(
        "CREATE SEQUENCE IF NOT EXISTS \"{seq}\" AS bigint MINVALUE 1 NO CYCLE;
        CREATE TABLE IF NOT EXISTS \"{t}\" (
            scope         bytea    NOT NULL CHECK (octet_length(scope) <= 255),
            id            bytea    NOT NULL CHECK (octet_length(id) BETWEEN 1 AND 255),
            fingerprint   bytea    NOT NULL CHECK (octet_length(fingerprint) = 32),
            state         smallint NOT NULL CHECK (state IN ({p}, {d})),
            lease_until   bigint   CHECK (lease_until >= 0),
            expires_at    bigint   NOT NULL CHECK (expires_at >= 0),
            created_at    bigint   NOT NULL CHECK (created_at >= 0),
            token         bigint   NOT NULL CHECK (token > 0),
            attempts      bigint   NOT NULL CHECK (attempts BETWEEN 1 AND 4294967295),
            status        integer  CHECK (status BETWEEN 0 AND 65535),
            header_names  bytea[],
            header_values bytea[],
            body          bytea,
            PRIMARY KEY (scope, id),
            CHECK ((state = {p}) = (lease_until IS NOT NULL)),
            CHECK ((state = {d}) = (status IS NOT NULL AND header_names IS NOT NULL
                                    AND header_values IS NOT NULL AND body IS NOT NULL)),
            CHECK (cardinality(header_names) = cardinality(header_values))
        );
        ALTER SEQUENCE \"{seq}\" OWNED BY \"{t}\".token;
        CREATE INDEX IF NOT EXISTS \"{idx}\" ON \"{t}\" (expires_at, scope, id);
        COMMENT ON TABLE \"{t}\" IS '{MARKER_PREFIX}{SCHEMA_VERSION}';"
    )
}
