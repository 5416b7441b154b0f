//! PostgreSQL and pool errors, mapped into the one [`Error`].
//!
//! Everything the server or the network says becomes [`Error::Backend`]
//! (transient: a retry may succeed), boxed with a message that names what
//! to do; the client's error is the source. No `postgres` or `r2d2` type
//! reaches the public API.

use crate::error::Error;
use ::postgres::error::SqlState;
use std::fmt;

/// A backend failure with the store's explanation in front of the engine's.
#[derive(Debug)]
struct PgFailure {
    what: String,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl fmt::Display for PgFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.source)
    }
}

impl std::error::Error for PgFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// An error from a statement on `table`.
pub(super) fn db_error(err: ::postgres::Error, table: &str) -> Error {
    let what = match err.code() {
        Some(code) if *code == SqlState::UNDEFINED_TABLE => format!(
            "PostgreSQL table {table} (or its sequence) does not exist: \
             run PostgresStore::migrate() once before use"
        ),
        Some(code) if *code == SqlState::QUERY_CANCELED => format!(
            "a statement on {table} ran past the statement timeout \
             (a lock held elsewhere, or an overloaded server)"
        ),
        Some(code) => match err.as_db_error() {
            Some(db) => format!(
                "PostgreSQL refused a statement on {table} (SQLSTATE {}: {})",
                code.code(),
                db.message()
            ),
            None => format!(
                "PostgreSQL refused a statement on {table} (SQLSTATE {})",
                code.code()
            ),
        },
        None if err.is_closed() => "the PostgreSQL connection was closed".to_owned(),
        None => "PostgreSQL connection failed".to_owned(),
    };
    Error::Backend(Box::new(PgFailure {
        what,
        source: Box::new(err),
    }))
}

/// True when the server ended the connection (a restart, a failover, an
/// administrator's `pg_terminate_backend`) or the client found it closed:
/// the pooled connection is dead, and a new one may well work.
pub(super) fn is_dead_connection(err: &::postgres::Error) -> bool {
    err.is_closed()
        || err.code().is_some_and(|code| {
            *code == SqlState::ADMIN_SHUTDOWN || *code == SqlState::CRASH_SHUTDOWN
        })
}

/// No connection within the connect timeout: the server is down or
/// unreachable, or every pooled connection stayed busy.
pub(super) fn pool_error(err: r2d2::Error) -> Error {
    Error::Backend(Box::new(PgFailure {
        what: "no PostgreSQL connection within the connect timeout \
               (server down or unreachable, or the pool exhausted)"
            .to_owned(),
        source: Box::new(err),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn failures_keep_their_source_and_say_what_to_do() {
        let err = Error::Backend(Box::new(PgFailure {
            what: "PostgreSQL connection failed".to_owned(),
            source: "connection refused".into(),
        }));
        assert_eq!(
            err.to_string(),
            "storage backend error: PostgreSQL connection failed: connection refused"
        );
        assert!(err.source().and_then(|s| s.source()).is_some());
        assert!(err.is_transient());
    }
}
