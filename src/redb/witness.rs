//! [`Witnessed`]: the engine's storage, wrapped so that the store keeps the
//! last I/O error the engine met. redb's later refusals (`PreviousIo`) and
//! errors inside an inbox handler's transaction lose the cause; the
//! [`IoWitness`] keeps its kind and text (a full disk stays `StorageFull`).
//! A bottom module: it imports only `file.rs`.

use ::redb::StorageBackend;
use std::io::{Error as IoError, ErrorKind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The I/O errors the engine's storage returned: how many, and the last.
#[derive(Debug, Default)]
pub(super) struct IoWitness {
    count: AtomicU64,
    last: Mutex<Option<Seen>>,
}

/// An I/O error as it was seen (an `io::Error` is not `Clone`).
#[derive(Debug)]
struct Seen {
    kind: ErrorKind,
    os_code: Option<i32>,
    text: String,
}

impl IoWitness {
    fn saw(&self, error: &IoError) {
        let seen = Seen {
            kind: error.kind(),
            os_code: error.raw_os_error(),
            text: error.to_string(),
        };
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(seen);
        self.count.fetch_add(1, Ordering::SeqCst);
    }

    /// How many I/O errors the engine's storage has returned so far.
    pub(super) fn count(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }

    /// The last one, made again: the same kind, and the same text (an
    /// operating system's error is made from its code).
    pub(super) fn last(&self) -> Option<IoError> {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.as_ref().map(|seen| match seen.os_code {
            Some(code) => IoError::from_raw_os_error(code),
            None => IoError::new(seen.kind, seen.text.clone()),
        })
    }
}

/// A backend whose I/O errors an [`IoWitness`] sees on their way to the
/// engine. Every call goes to the backend underneath unchanged.
#[derive(Debug)]
pub(super) struct Witnessed<B> {
    inner: B,
    witness: std::sync::Arc<IoWitness>,
}

impl<B> Witnessed<B> {
    pub(super) fn new(inner: B, witness: std::sync::Arc<IoWitness>) -> Witnessed<B> {
        Witnessed { inner, witness }
    }

    fn seen<T>(&self, result: std::io::Result<T>) -> std::io::Result<T> {
        if let Err(e) = &result {
            self.witness.saw(e);
        }
        result
    }
}

impl<B: StorageBackend> StorageBackend for Witnessed<B> {
    fn len(&self) -> std::io::Result<u64> {
        self.seen(self.inner.len())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.seen(self.inner.read(offset, out))
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.seen(self.inner.set_len(len))
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.seen(self.inner.sync_data())
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.seen(self.inner.write(offset, data))
    }
    fn close(&self) -> std::io::Result<()> {
        self.inner.close()
    }
    super::file::forward_locks!(inner);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A backend whose every I/O fails with `error`'s kind.
    #[derive(Debug)]
    struct Failing(Option<i32>);

    impl Failing {
        fn error(&self) -> IoError {
            match self.0 {
                Some(code) => IoError::from_raw_os_error(code),
                None => IoError::new(ErrorKind::TimedOut, "slow disk"),
            }
        }
    }

    impl StorageBackend for Failing {
        fn len(&self) -> std::io::Result<u64> {
            Err(self.error())
        }
        fn read(&self, _: u64, _: &mut [u8]) -> std::io::Result<()> {
            Err(self.error())
        }
        fn set_len(&self, _: u64) -> std::io::Result<()> {
            Err(self.error())
        }
        fn sync_data(&self) -> std::io::Result<()> {
            Err(self.error())
        }
        fn write(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
            Err(self.error())
        }
    }

    #[test]
    fn every_io_error_is_seen_and_the_last_made_again() {
        let witness = Arc::new(IoWitness::default());
        assert!(witness.last().is_none());
        let disk = Witnessed::new(Failing(Some(28)), Arc::clone(&witness));
        let mut buf = [0u8; 1];
        assert!(disk.len().is_err());
        assert!(disk.read(0, &mut buf).is_err());
        assert!(disk.set_len(1).is_err());
        assert!(disk.sync_data().is_err());
        assert!(disk.write(0, &buf).is_err());
        assert_eq!(witness.count(), 5);
        let last = witness.last().expect("seen");
        assert_eq!(last.kind(), ErrorKind::StorageFull);
        assert_eq!(last.raw_os_error(), Some(28));
        assert_eq!(last.to_string(), IoError::from_raw_os_error(28).to_string());
        let other = Witnessed::new(Failing(None), Arc::clone(&witness));
        assert!(other.sync_data().is_err());
        assert_eq!(witness.count(), 6);
        let last = witness.last().expect("seen");
        assert_eq!(last.kind(), ErrorKind::TimedOut);
        assert_eq!(last.to_string(), "slow disk");
    }

    #[test]
    fn a_success_is_not_an_error() {
        let witness = Arc::new(IoWitness::default());
        let disk = Witnessed::new(
            ::redb::backends::InMemoryBackend::new(),
            Arc::clone(&witness),
        );
        disk.set_len(8).expect("set_len");
        disk.write(0, &[1; 8]).expect("write");
        let mut out = [0u8; 8];
        disk.read(0, &mut out).expect("read");
        disk.sync_data().expect("sync");
        assert_eq!(disk.len().expect("len"), 8);
        assert_eq!(out, [1; 8]);
        assert_eq!(witness.count(), 0);
        assert!(witness.last().is_none());
    }
}
