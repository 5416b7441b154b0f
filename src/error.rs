//! The one public error type.

use std::fmt;

/// A boxed error from an engine or the operating system, kept as the
/// [`source`](std::error::Error::source) of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in idemstore.
///
/// Every variant has a message that says what happened and what to do; the
/// engine's own error, where there is one, is the [`source`](std::error::Error::source).
/// No engine type appears in a variant, so a backend can change without
/// breaking callers.
///
/// # Example
///
/// ```
/// use idemstore::{Error, Key};
///
/// let err = Key::new("tenant", "").unwrap_err();
/// assert!(matches!(err, Error::InvalidKey { .. }));
/// assert_eq!(err.to_string(), "invalid idempotency key: the id is empty (1..=255 bytes required)");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The key's scope or id is empty or too long. Raised before any I/O.
    InvalidKey {
        /// Why the key was refused.
        reason: String,
    },
    /// A response is over a limit (body bytes, header count or header bytes).
    /// Raised before any write: nothing is stored.
    ResponseTooLarge {
        /// Which limit: `"body bytes"`, `"header count"` or `"header bytes"`.
        what: &'static str,
        /// The size that was offered.
        size: usize,
        /// The limit in force.
        limit: usize,
    },
    /// A step is over a limit (`"name bytes"`, `"output bytes"`, `"steps"`
    /// or `"step bytes in the record"`; the limits are in
    /// [`limits`](crate::limits)). Raised before any write: nothing is
    /// recorded.
    StepLimit {
        /// Which limit.
        what: &'static str,
        /// The size that was offered.
        size: usize,
        /// The limit in force.
        limit: usize,
    },
    /// An argument or a configuration value is out of range
    /// (a zero lease, a retention shorter than the lease, a limit above its hard cap).
    InvalidArgument {
        /// What was wrong.
        reason: String,
    },
    /// The claim is no longer the current one: its lease was taken over, it
    /// was released, or the record expired. Nothing was changed.
    StaleClaim,
    /// Stored bytes failed verification (magic, checksum, layout or a record
    /// invariant). The record is never replayed.
    Corrupt {
        /// The key whose record is damaged, when known (printable form).
        key: Option<String>,
        /// What failed to verify.
        detail: String,
    },
    /// The file or record was written by a format version this build cannot
    /// read: a newer release of idemstore, a pre-release build (a redb store
    /// of format 1 or 2, a PostgreSQL table of schema 1), or not an
    /// idemstore file at all.
    UnsupportedFormat {
        /// The version found.
        found: u32,
        /// The version this build writes, the newest it reads.
        supported: u32,
    },
    /// A previous commit or fsync failed, so whether it reached the disk is
    /// unknown: the store refuses writes until it has recovered. A
    /// `RedbStore` recovers by itself once the cause is gone (space freed,
    /// a transient I/O error), as an open would, and reads go on meanwhile;
    /// see `RedbStore::health`. Other stores are reopened.
    Poisoned {
        /// The failure that stopped the writes, when the store knows it.
        cause: Option<Cause>,
    },
    /// The store file is held by another open store (in this or another
    /// process). Nothing was read or written.
    Locked {
        /// The path that is locked.
        path: String,
        /// Who holds it, when the platform tells (Linux: `pid N (command
        /// line)` from `/proc/locks`, or `this process`).
        holder: Option<String>,
    },
    /// The store was opened read-only (an inspection) and this call would
    /// write. Nothing was written.
    ReadOnly {
        /// The store file.
        path: String,
    },
    /// The store has been shut down.
    Closed,
    /// An operating-system I/O error (a full disk, a read-only directory, ...).
    Io(std::io::Error),
    /// An error from the storage engine, or an injected fault in tests.
    Backend(BoxError),
    /// A message handler in an inbox batch panicked
    /// (`idemstore::redb::Inbox::handle_batch`): none of its writes were
    /// stored, and its batch-mates were handled without it.
    HandlerPanicked {
        /// What the panic said (its payload, when it was text).
        message: String,
    },
}

impl Error {
    /// The same failure for another caller of a failed commit group (redb)
    /// or flush round (sled): the variant, and so [`Error::is_transient`],
    /// is the same for every caller. `Error` is not `Clone` (it holds an
    /// `io::Error`); this keeps the kind and the message.
    #[cfg_attr(
        not(any(feature = "redb", feature = "sled")),
        allow(dead_code, reason = "only the group-commit backends replicate errors")
    )]
    pub(crate) fn replicate(&self) -> Error {
        match self {
            Error::Io(e) => Error::Io(std::io::Error::new(e.kind(), e.to_string())),
            Error::Poisoned { cause } => Error::Poisoned {
                cause: cause.clone(),
            },
            Error::Closed => Error::Closed,
            Error::Corrupt { key, detail } => Error::corrupt(key.clone(), detail.clone()),
            other => Error::backend(other.to_string()),
        }
    }

    pub(crate) fn invalid_argument(reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            reason: reason.into(),
        }
    }

    pub(crate) fn corrupt(key: Option<String>, detail: impl Into<String>) -> Error {
        Error::Corrupt {
            key,
            detail: detail.into(),
        }
    }

    /// Wraps any engine error as [`Error::Backend`].
    ///
    /// ```
    /// let err = idemstore::Error::backend("connection refused");
    /// assert_eq!(err.to_string(), "storage backend error: connection refused");
    /// ```
    pub fn backend(err: impl Into<BoxError>) -> Error {
        Error::Backend(err.into())
    }

    /// True when retrying the same call later may succeed without operator
    /// action (an I/O or backend error); false for errors that a retry cannot
    /// fix (bad input, a stale claim, corruption, poisoning, a locked file).
    ///
    /// ```
    /// use idemstore::Error;
    /// assert!(!Error::StaleClaim.is_transient());
    /// assert!(Error::backend("timeout").is_transient());
    /// ```
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Io(_) | Error::Backend(_) => true,
            // A store that heals by itself: writes come back without a restart.
            Error::Poisoned { cause: Some(cause) } => cause.heals(),
            _ => false,
        }
    }

    /// The [`std::io::ErrorKind`] of an I/O failure: of an [`Error::Io`], or
    /// of the failure that poisoned the store ([`Error::Poisoned`]'s
    /// cause). `StorageFull` is a full disk (ENOSPC, EDQUOT).
    ///
    /// ```
    /// use idemstore::Error;
    /// use std::io::{self, ErrorKind};
    /// let full = Error::from(io::Error::new(ErrorKind::StorageFull, "no space left on device"));
    /// assert_eq!(full.io_kind(), Some(ErrorKind::StorageFull));
    /// assert_eq!(Error::StaleClaim.io_kind(), None);
    /// ```
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            Error::Io(e) => Some(e.kind()),
            Error::Poisoned { cause: Some(cause) } => cause.io_kind(),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidKey { reason } => write!(f, "invalid idempotency key: {reason}"),
            Error::ResponseTooLarge { what, size, limit } => write!(
                f,
                "response too large: {size} {what} exceeds the limit of {limit}; nothing was stored"
            ),
            Error::StepLimit { what, size, limit } => write!(
                f,
                "step too large: {size} {what} exceeds the limit of {limit}; nothing was recorded"
            ),
            Error::InvalidArgument { reason } => write!(f, "invalid argument: {reason}"),
            Error::StaleClaim => f.write_str(
                "stale claim: the lease was taken over, released or expired; nothing was changed",
            ),
            Error::Corrupt {
                key: Some(key),
                detail,
            } => {
                write!(f, "corrupt record for key {key}: {detail}")
            }
            Error::Corrupt { key: None, detail } => write!(f, "corrupt store: {detail}"),
            Error::UnsupportedFormat { found, supported } if found > supported => write!(
                f,
                "unsupported format version {found} (this build reads version {supported}); \
                 upgrade idemstore or open a different file"
            ),
            Error::UnsupportedFormat { found, supported } => write!(
                f,
                "unsupported format version {found} (this build reads version {supported}; \
                 older versions, written by pre-release builds, are not read)"
            ),
            Error::Poisoned { cause: None } => {
                f.write_str("store poisoned by an earlier failed commit or fsync; reopen the store")
            }
            Error::Poisoned { cause: Some(cause) } => {
                write!(f, "writes are refused: {cause}; {}", cause.advice())
            }
            Error::Locked {
                path,
                holder: Some(holder),
            } => write!(
                f,
                "store file {path} is locked: another open store holds it ({holder})"
            ),
            Error::Locked { path, holder: None } => write!(
                f,
                "store file {path} is locked: another open store (in this or another process) holds it"
            ),
            Error::ReadOnly { path } => write!(
                f,
                "store {path} is open read-only (for inspection): this call would write; \
                 nothing was written"
            ),
            Error::Closed => f.write_str("store is closed"),
            Error::Io(err) => write!(f, "I/O error: {err}"),
            Error::Backend(err) => write!(f, "storage backend error: {err}"),
            Error::HandlerPanicked { message } => write!(
                f,
                "the message handler panicked ({message}); nothing it wrote was stored"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io(err) => Some(err),
            Error::Backend(err) => Some(err.as_ref()),
            _ => None,
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(err: std::io::Error) -> Error {
        Error::Io(err)
    }
}

/// Why a store stopped writing: the first failure of a commit, a sync or
/// a checkpoint, kept so that every later refusal
/// ([`Error::Poisoned`]) and the store's health say what it was, on
/// which file, during what, and not only that something failed.
///
/// ```
/// use idemstore::{Cause, Error};
/// use std::io::{self, ErrorKind};
/// let full = io::Error::new(ErrorKind::StorageFull, "no space left on device");
/// let cause = Cause::new("checkpoint", Some("/var/lib/app/orders.idem"), &Error::Io(full));
/// assert_eq!(cause.io_kind(), Some(ErrorKind::StorageFull));
/// assert_eq!(cause.during(), "checkpoint");
/// assert_eq!(
///     cause.to_string(),
///     "checkpoint failed: no space left on device, on /var/lib/app/orders.idem"
/// );
/// let refused = Error::Poisoned { cause: Some(cause) };
/// assert!(refused.to_string().contains("resume by themselves once space is freed"), "{refused}");
/// assert_eq!(refused.io_kind(), Some(ErrorKind::StorageFull));
/// ```
#[derive(Clone, Debug)]
pub struct Cause(std::sync::Arc<CauseInner>);

#[derive(Debug)]
struct CauseInner {
    during: &'static str,
    path: Option<String>,
    io_kind: Option<std::io::ErrorKind>,
    message: String,
    heals: bool,
}

impl Cause {
    /// The cause `error` gives, met `during` an operation (`"log append"`,
    /// `"checkpoint"`, ...) on the file at `path`. Damage
    /// ([`Error::Corrupt`], [`Error::UnsupportedFormat`]) does not heal by
    /// itself; an I/O or engine error may.
    pub fn new(during: &'static str, path: Option<&str>, error: &Error) -> Cause {
        let (io_kind, message) = match error {
            // The operating system's text, without our "I/O error: " prefix.
            Error::Io(e) => (Some(e.kind()), e.to_string()),
            Error::Poisoned { cause: Some(c) } => (c.io_kind(), c.0.message.clone()),
            other => (None, other.to_string()),
        };
        let heals = !matches!(
            error,
            Error::Corrupt { .. } | Error::UnsupportedFormat { .. }
        );
        Cause(std::sync::Arc::new(CauseInner {
            during,
            path: path.map(str::to_owned),
            io_kind,
            message,
            heals,
        }))
    }

    /// What was being done: `"log append"`, `"checkpoint"`, `"commit"`,
    /// `"read"`, `"recovery"`, ...
    pub fn during(&self) -> &'static str {
        self.0.during
    }

    /// The file the failure was met on, when known.
    pub fn path(&self) -> Option<&str> {
        self.0.path.as_deref()
    }

    /// The failure's [`std::io::ErrorKind`], for an I/O failure
    /// (`StorageFull` for a full disk).
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        self.0.io_kind
    }

    /// The failure's own message (the operating system's, the engine's).
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// Whether the store may recover by itself once this cause is gone
    /// (false for damage, which needs an operator).
    pub fn heals(&self) -> bool {
        self.0.heals
    }

    /// What the operator (or the caller) can expect or do.
    pub(crate) fn advice(&self) -> &'static str {
        if !self.heals() {
            "the store cannot recover by itself: see docs/operations.md (verify, salvage)"
        } else if self.io_kind() == Some(std::io::ErrorKind::StorageFull) {
            "writes resume by themselves once space is freed"
        } else {
            "the store retries with back-off and resumes writing by itself once the cause is gone"
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.0.during, self.0.message)?;
        if let Some(path) = &self.0.path {
            write!(f, ", on {path}")?;
        }
        Ok(())
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn io_error_is_the_source() {
        let err = Error::from(std::io::Error::other("disk full"));
        assert!(err.source().is_some());
        assert!(err.to_string().contains("disk full"));
        assert!(err.is_transient());
    }

    #[test]
    fn a_cause_names_the_operation_the_file_and_the_kind() {
        let eio = Error::from(std::io::Error::other("input/output error"));
        let cause = Cause::new("log append", Some("/d/s.idem-wal"), &eio);
        assert_eq!(
            cause.to_string(),
            "log append failed: input/output error, on /d/s.idem-wal"
        );
        assert_eq!(cause.io_kind(), Some(std::io::ErrorKind::Other));
        assert_eq!(cause.path(), Some("/d/s.idem-wal"));
        assert_eq!(cause.message(), "input/output error");
        assert!(cause.heals());
        let refused = Error::Poisoned { cause: Some(cause) };
        assert!(
            refused
                .to_string()
                .starts_with("writes are refused: log append failed")
        );
        assert!(
            refused.to_string().contains("retries with back-off"),
            "{refused}"
        );
        assert!(refused.is_transient());
        let damaged = Cause::new("recovery", None, &Error::corrupt(None, "bad page"));
        assert!(!damaged.heals());
        assert_eq!(damaged.io_kind(), None);
        assert!(damaged.to_string().contains("bad page"));
        let refused = Error::Poisoned {
            cause: Some(damaged),
        };
        assert!(!refused.is_transient());
        assert!(
            refused.to_string().contains("cannot recover by itself"),
            "{refused}"
        );
        assert!(!(Error::Poisoned { cause: None }).is_transient());
    }

    #[test]
    fn messages_name_the_key() {
        let err = Error::corrupt(Some("t/o".into()), "checksum mismatch");
        assert_eq!(
            err.to_string(),
            "corrupt record for key t/o: checksum mismatch"
        );
    }

    #[test]
    fn a_replicated_error_keeps_its_variant_and_message() {
        let io = Error::from(std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            "disk full",
        ));
        let copy = io.replicate();
        assert!(matches!(&copy, Error::Io(e) if e.kind() == std::io::ErrorKind::StorageFull));
        assert_eq!(copy.to_string(), io.to_string());
        assert_eq!(copy.is_transient(), io.is_transient());
        assert!(matches!(
            (Error::Poisoned { cause: None }).replicate(),
            Error::Poisoned { cause: None }
        ));
        let cause = Cause::new("checkpoint", Some("/s"), &io);
        let poisoned = Error::Poisoned { cause: Some(cause) }.replicate();
        assert_eq!(poisoned.io_kind(), Some(std::io::ErrorKind::StorageFull));
        assert!(poisoned.is_transient());
        assert!(matches!(Error::Closed.replicate(), Error::Closed));
        let corrupt = Error::corrupt(Some("t/o".into()), "bad crc");
        assert_eq!(corrupt.replicate().to_string(), corrupt.to_string());
        assert!(matches!(Error::StaleClaim.replicate(), Error::Backend(_)));
    }
}
