//! sled's errors as the one public [`Error`]: no sled type escapes the
//! backend, but the engine's error stays the `source`. A bottom module: it
//! imports nothing of the backend.

use crate::error::Error;
use ::sled::transaction::TransactionError;

/// Maps a sled error: I/O stays I/O, corruption is [`Error::Corrupt`], the
/// rest (unsupported use, a sled bug) is [`Error::Backend`].
pub(crate) fn from_sled(err: ::sled::Error) -> Error {
    match err {
        ::sled::Error::Io(e) => Error::Io(e),
        e @ ::sled::Error::Corruption { .. } => {
            Error::corrupt(None, format!("sled reports corruption: {e}"))
        }
        other => Error::backend(other),
    }
}

/// Maps a transaction error whose abort value is already an idemstore error.
pub(crate) fn from_tx(err: TransactionError<Error>) -> Error {
    match err {
        TransactionError::Abort(e) => e,
        TransactionError::Storage(e) => from_sled(e),
    }
}
