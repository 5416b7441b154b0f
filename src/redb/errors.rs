//! redb's errors as the one public [`Error`]: no redb type escapes, but the
//! engine's error stays the `source`.

use crate::error::Error;

/// Any redb error as an [`Error`]: I/O stays [`Error::Io`], corruption that
/// redb detected is [`Error::Corrupt`], everything else is [`Error::Backend`]
/// with the redb error as its source.
pub(super) fn engine_error(err: impl Into<::redb::Error>) -> Error {
    match err.into() {
        ::redb::Error::Io(io) => Error::Io(io),
        // redb refuses every use after an I/O error of its own until it is
        // reopened: an I/O failure, so that the store poisons and heals.
        // The store names the earlier error where it can (`is_latched`).
        ::redb::Error::PreviousIo => Error::Io(std::io::Error::other(Latched)),
        ::redb::Error::Corrupted(detail) => {
            Error::corrupt(None, format!("the storage engine found damage: {detail}"))
        }
        other => Error::backend(other),
    }
}

/// redb's `PreviousIo`: the engine refuses to go on after an I/O error it
/// met earlier, without saying which.
#[derive(Debug)]
struct Latched;

impl std::fmt::Display for Latched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an earlier I/O error left the storage engine unusable until it is reopened")
    }
}

impl std::error::Error for Latched {}

/// Whether `error` is redb's refusal after an earlier I/O error, which
/// names no cause: the store replaces it with the error its witness saw
/// (`file::IoWitness`).
pub(super) fn is_latched(error: &Error) -> bool {
    matches!(error, Error::Io(io) if io.get_ref().is_some_and(|e| e.is::<Latched>()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_stays_io_and_corruption_is_corrupt() {
        let io = engine_error(::redb::StorageError::Io(std::io::Error::other("disk gone")));
        assert!(matches!(io, Error::Io(_)));
        let bad = engine_error(::redb::StorageError::Corrupted("bad page".into()));
        assert!(matches!(bad, Error::Corrupt { key: None, .. }));
        assert!(bad.to_string().contains("bad page"), "{bad}");
        let latched = engine_error(::redb::StorageError::PreviousIo);
        assert!(matches!(latched, Error::Io(_)), "{latched}");
        assert!(is_latched(&latched));
        assert!(
            latched.to_string().contains("an earlier I/O error"),
            "{latched}"
        );
        assert!(!is_latched(&io));
        assert!(!is_latched(&Error::Io(std::io::Error::other("disk gone"))));
        let other = engine_error(::redb::TransactionError::WouldBlock);
        assert!(matches!(other, Error::Backend(_)));
    }
}
