//! PostgreSQL and pool errors, mapped into the one [`Error`].
//!
//! Everything the server or the network says becomes [`Error::Backend`]
//! (transient: a retry may succeed), boxed with a message that names what
//! to do; the client's error is the source. No `tokio-postgres` type
//! reaches the public API. A missing or older schema found at build is not
//! transient (see `schema.rs`).

use crate::error::Error;
use std::fmt;
use std::time::Duration;
use tokio_postgres::error::{DbError, SqlState};

/// A backend failure with the store's explanation in front of the engine's.
#[derive(Debug)]
struct PgFailure {
    what: String,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
    /// Also show the source's own sources: a failed connection's
    /// tokio-postgres error names only its kind ("db error", "error
    /// performing TLS handshake"), and the reason (the server's message,
    /// the certificate's fault) is in its source.
    with_causes: bool,
}

impl fmt::Display for PgFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.source)?;
        let mut cause = self.source.source();
        while let Some(c) = cause.filter(|_| self.with_causes) {
            write!(f, ": {c}")?;
            cause = c.source();
        }
        Ok(())
    }
}

impl std::error::Error for PgFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// An error from a statement on `table`.
pub(super) fn db_error(err: tokio_postgres::Error, table: &str) -> Error {
    let what = match err.code() {
        Some(code) if *code == SqlState::UNDEFINED_TABLE => format!(
            "PostgreSQL table {table} (or its sequence) does not exist: \
             run PostgresStore::migrate() (or build with migrate_on_build(true))"
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
        with_causes: false,
    }))
}

/// True when the server ended the connection (a restart, a failover, an
/// administrator's `pg_terminate_backend`) or the client found it closed:
/// the pooled connection is dead, and a new one may well work.
pub(super) fn is_dead_connection(err: &tokio_postgres::Error) -> bool {
    err.is_closed()
        || err.code().is_some_and(|code| {
            *code == SqlState::ADMIN_SHUTDOWN || *code == SqlState::CRASH_SHUTDOWN
        })
}

/// True for the notice PostgreSQL sends when a commit's wait for a
/// synchronous standby ends early (`pg_cancel_backend`, or
/// `pg_terminate_backend` just before the connection closes): the commit
/// is on the primary and visible there, and the standby may not have it.
/// The commit itself answers success, so this WARNING is the only sign.
/// It carries no SQLSTATE of its own (the cancel's is the generic 01000),
/// so it is known by its text, as `syncrep.c` words it; a server whose
/// `lc_messages` translates it is not recognised (docs/operations.md).
pub(super) fn is_unreplicated_commit(notice: &DbError) -> bool {
    is_unreplicated_text(notice.message(), notice.detail())
}

fn is_unreplicated_text(message: &str, detail: Option<&str>) -> bool {
    // Both of syncrep.c's warnings (cancel, terminate) carry this detail;
    // the messages are checked too, in case a server words the detail anew.
    detail.is_some_and(|d| d.starts_with("The transaction has already committed locally"))
        || message.starts_with("canceling wait for synchronous replication")
        || message.starts_with("canceling the wait for synchronous replication")
}

/// A call one of whose commits PostgreSQL reported done on the primary only
/// (its wait for a synchronous standby was cancelled), every time it ran.
pub(super) fn unreplicated() -> Error {
    failure(
        "PostgreSQL committed a call's write on the primary only".to_owned(),
        "its wait for the synchronous standby was cancelled, so a failover may lose it; \
         the outcome is unknown until a retry finds it durable",
    )
}

fn failure(what: String, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::Backend(Box::new(PgFailure {
        what,
        source: source.into(),
        with_causes: false,
    }))
}

/// A connection attempt the server, the network or TLS refused, with the
/// reason (the server's message, the certificate's fault).
pub(super) fn connect_error(err: tokio_postgres::Error) -> Error {
    Error::Backend(Box::new(PgFailure {
        what: "could not connect to PostgreSQL".to_owned(),
        source: Box::new(err),
        with_causes: true,
    }))
}

/// A connection attempt that did not finish within the connect timeout.
pub(super) fn connect_timeout(timeout: Duration) -> Error {
    failure(
        "could not connect to PostgreSQL".to_owned(),
        format!("no answer within the connect timeout ({timeout:?})"),
    )
}

/// Every connection stayed busy for the whole connect timeout.
pub(super) fn pool_exhausted(timeout: Duration) -> Error {
    failure(
        "no PostgreSQL connection within the connect timeout \
         (every pooled connection stayed busy)"
            .to_owned(),
        format!("waited {timeout:?}"),
    )
}

/// The circuit breaker is open: refused without trying the server.
pub(super) fn unavailable(why: &str, probe_interval: Duration) -> Error {
    failure(
        format!(
            "PostgreSQL is unreachable; calls fail at once until the background probe \
             (every {probe_interval:?}) reconnects"
        ),
        why.to_owned(),
    )
}

/// A call that did not answer within the call timeout. It may still take
/// effect: the server may be waiting for a synchronous standby, or a lock.
pub(super) fn call_timed_out(timeout: Duration) -> Error {
    failure(
        "PostgreSQL did not answer within the call timeout".to_owned(),
        format!(
            "no answer within {timeout:?}; the call may still take effect \
             (a claim it makes is given back, and whether a completion was \
             stored is known by reading the record)"
        ),
    )
}

/// Build did not finish within its timeout.
pub(super) fn build_timeout(timeout: Duration) -> Error {
    failure(
        "PostgresStore build did not finish".to_owned(),
        format!("no answer within the build timeout ({timeout:?})"),
    )
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
            with_causes: false,
        }));
        assert_eq!(
            err.to_string(),
            "storage backend error: PostgreSQL connection failed: connection refused"
        );
        assert!(err.source().and_then(|s| s.source()).is_some());
        assert!(err.is_transient());
    }

    #[test]
    fn the_synchronous_standby_warnings_are_recognised_and_no_other() {
        let detail = "The transaction has already committed locally, but might not have been replicated to the standby.";
        assert!(is_unreplicated_text(
            "canceling wait for synchronous replication due to user request",
            Some(detail)
        ));
        assert!(is_unreplicated_text(
            "canceling the wait for synchronous replication and terminating connection due to administrator command",
            Some(detail)
        ));
        assert!(is_unreplicated_text("anything", Some(detail)));
        assert!(!is_unreplicated_text(
            "there is no transaction in progress",
            None
        ));
        assert!(!is_unreplicated_text("canceling statement", Some("other")));
        let err = unreplicated();
        assert!(matches!(err, Error::Backend(_)), "{err}");
        assert!(err.is_transient());
    }
}
