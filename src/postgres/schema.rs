//! The table, its sequence and index, the schema-version marker, and the
//! idempotent migration that creates them.
//!
//! The version lives in the table's comment (`idemstore records, schema
//! version N`): reading it is one catalog lookup, and a table that someone
//! else created under the same name has no such comment, so it is refused
//! instead of written to.

use super::errors::db_error;
use super::pool::Conn;
use super::sql::{STATE_DONE, STATE_PROCESSING, Sql};
use crate::error::{Error, Result};

/// The schema this build creates and reads.
pub(super) const SCHEMA_VERSION: u32 = 1;
const MARKER_PREFIX: &str = "idemstore records, schema version ";

/// What the catalog says about the configured table.
enum Found {
    Absent,
    Current,
}

/// Checks the table, if it exists: ours, and of this schema version.
pub(super) fn check(conn: &mut Conn, sql: &Sql) -> Result<()> {
    inspect(&mut conn.client, sql).map(|_| ())
}

/// Creates the sequence, table and index unless they exist, in one
/// transaction under an advisory lock, so replicas migrating at the same
/// time do not trip over each other.
pub(super) fn migrate(conn: &mut Conn, sql: &Sql) -> Result<()> {
    let mut tx = conn
        .client
        .transaction()
        .map_err(|e| db_error(e, &sql.table))?;
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext($1))",
        &[&format!("idemstore migrate {}", sql.table)],
    )
    .map_err(|e| db_error(e, &sql.table))?;
    if let Found::Absent = inspect(&mut tx, sql)? {
        tx.batch_execute(&ddl(sql))
            .map_err(|e| db_error(e, &sql.table))?;
    }
    tx.commit().map_err(|e| db_error(e, &sql.table))
}

fn inspect(client: &mut impl ::postgres::GenericClient, sql: &Sql) -> Result<Found> {
    let row = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL, obj_description(to_regclass($1), 'pg_class')",
            &[&format!("\"{}\"", sql.table)],
        )
        .map_err(|e| db_error(e, &sql.table))?;
    let exists: bool = row.try_get(0).map_err(|e| db_error(e, &sql.table))?;
    let comment: Option<String> = row.try_get(1).map_err(|e| db_error(e, &sql.table))?;
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
        found if found > SCHEMA_VERSION => Err(Error::UnsupportedFormat {
            found,
            supported: SCHEMA_VERSION,
        }),
        _ => Err(foreign("its schema marker has an unknown version")),
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
