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
    /// read (a newer release of idemstore, or not an idemstore file at all).
    UnsupportedFormat {
        /// The version found.
        found: u32,
        /// The newest version this build reads.
        supported: u32,
    },
    /// A previous commit or fsync failed, so whether it reached the disk is
    /// unknown. The store refuses further writes until it is reopened.
    Poisoned,
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
            Error::Poisoned => Error::Poisoned,
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
        matches!(self, Error::Io(_) | Error::Backend(_))
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
            Error::UnsupportedFormat { found, supported } => write!(
                f,
                "unsupported format version {found} (this build reads up to version {supported}); \
                 upgrade idemstore or open a different file"
            ),
            Error::Poisoned => {
                f.write_str("store poisoned by an earlier failed commit or fsync; reopen the store")
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
        assert!(matches!(Error::Poisoned.replicate(), Error::Poisoned));
        assert!(matches!(Error::Closed.replicate(), Error::Closed));
        let corrupt = Error::corrupt(Some("t/o".into()), "bad crc");
        assert_eq!(corrupt.replicate().to_string(), corrupt.to_string());
        assert!(matches!(Error::StaleClaim.replicate(), Error::Backend(_)));
    }
}
