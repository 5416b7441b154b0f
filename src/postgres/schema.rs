//! The table, its sequence and index, the schema-version marker, and the
//! idempotent migration that creates them.
//!
//! The version lives in the table's comment (`idemstore records, schema
//! version N`): reading it is one catalog lookup, and a table that someone
//! else created under the same name has no such comment, so it is refused
//! instead of written to.

use super::errors::db_error;
use super::sql::Sql;
#[cfg(feature = "unstable-internals")]
use super::sql::{STATE_DONE, STATE_PROCESSING};
use crate::error::{Error, Result};
use tokio_postgres::Client;

/// The schema this build creates. It also reads and writes version 1
/// tables, which differ only by their CHECK constraints; `migrate` drops
/// those and marks the table version 2.
pub(super) const SCHEMA_VERSION: u32 = 2;
/// The first schema: the same columns, with every record invariant also a
/// CHECK constraint.
const SCHEMA_V1: u32 = 1;
const MARKER_PREFIX: &str = "idemstore records, schema version ";

/// What the catalog says about the configured table.
enum Found {
    Absent,
    /// Version 1: used as it is; `migrate` upgrades it.
    V1,
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
        Found::Current | Found::V1 => Ok(()),
        Found::Absent => Err(Error::invalid_argument(format!(
            "PostgreSQL table {} does not exist: run PostgresStore::migrate() once \
             (with a role allowed to create tables), or build with migrate_on_build(true)",
            sql.table
        ))),
    }
}

/// Creates the sequence, table and index unless they exist, or upgrades a
/// version 1 table (drops its CHECK constraints, marks it version 2), in
/// one transaction under an advisory lock, so replicas migrating at the
/// same time do not trip over each other. On an error the transaction may
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
        Found::V1 => upgrade_v1(client, sql).await?,
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
        SCHEMA_V1 => Ok(Found::V1),
        // Newer: written by a later release (or a number no release wrote).
        found => Err(Error::UnsupportedFormat {
            found,
            supported: SCHEMA_VERSION,
        }),
    }
}

/// The schema. The record invariants `Record::check` tests are not CHECK
/// constraints (version 1 had them): PostgreSQL parses a table's CHECK
/// expressions again for every statement that writes it, which measured
/// 60 µs of the 80 µs an INSERT of a claim cost the server (docs/format.md,
/// "PostgreSQL schema"). Every row the store reads is still checked
/// (`row::record`), so a row a hand-written UPDATE broke is reported as
/// `Error::Corrupt` for its key when read, instead of refused when written.
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
            PRIMARY KEY (scope, id)
        );
        ALTER SEQUENCE \"{seq}\" OWNED BY \"{t}\".token;
        CREATE INDEX IF NOT EXISTS \"{idx}\" ON \"{t}\" (expires_at, scope, id);
        COMMENT ON TABLE \"{t}\" IS '{MARKER_PREFIX}{SCHEMA_VERSION}';"
    )
}

/// Version 1 to 2: drops the table's CHECK constraints (every one: the
/// version 1 schema had no others) and marks it version 2. Rows are not
/// touched. Runs inside `migrate`'s transaction.
async fn upgrade_v1(client: &Client, sql: &Sql) -> Result<()> {
    let db = |e| db_error(e, &sql.table);
    let rows = client
        .query(
            "SELECT conname FROM pg_constraint WHERE conrelid = to_regclass($1) AND contype = 'c'",
            &[&format!("\"{}\"", sql.table)],
        )
        .await
        .map_err(db)?;
    let mut ddl = String::new();
    for row in rows {
        let name: String = row.try_get(0).map_err(db)?;
        // A name PostgreSQL generated (`<table>_<column>_check`, ...):
        // quoted, with any quote in it doubled.
        ddl.push_str(&format!(
            "ALTER TABLE \"{}\" DROP CONSTRAINT \"{}\";",
            sql.table,
            name.replace('"', "\"\"")
        ));
    }
    ddl.push_str(&format!(
        "COMMENT ON TABLE \"{}\" IS '{MARKER_PREFIX}{SCHEMA_VERSION}';",
        sql.table
    ));
    client.batch_execute(&ddl).await.map_err(db)
}

/// The version 1 schema's DDL, for the upgrade's tests.
#[cfg(feature = "unstable-internals")]
pub(super) fn ddl_v1(sql: &Sql) -> String {
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
        COMMENT ON TABLE \"{t}\" IS '{MARKER_PREFIX}{SCHEMA_V1}';"
    )
}
