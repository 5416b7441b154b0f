//! File helpers: owner-only opening, directory syncs, locks, the redb header
//! check, the log file, the backend wrappers ([`SharedBackend`] for a heal's
//! reopen, [`Witnessed`] for the engine's I/O errors), and redb's errors as
//! the one public [`Error`] (`engine_error`). A bottom module.

use crate::error::{Error, Result};
use ::redb::StorageBackend;
use ::redb::backends::FileBackend;
use std::io::{Error as IoError, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
/// ([`IoWitness`]).
pub(super) fn is_latched(error: &Error) -> bool {
    matches!(error, Error::Io(io) if io.get_ref().is_some_and(|e| e.is::<Latched>()))
}

/// redb's file magic (its private `MAGICNUMBER`, fixed within a major
/// version), checked so that a foreign file is refused before redb touches it.
const REDB_MAGIC: [u8; 9] = [b'r', b'e', b'd', b'b', 0x1A, 0x0A, 0xA9, 0x0D, 0x0A];

/// How a caller's storage backend is named in errors.
pub(super) const BACKEND: &str = "<storage backend>";

/// Owner-only: response snapshots can hold personal data.
#[cfg(unix)]
pub(super) const FILE_MODE: u32 = 0o600;

pub(super) fn open_owner_only(path: &Path) -> Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true).write(true).create(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, FILE_MODE);
    Ok(options.open(path)?)
}

/// Takes the store file's shared lock for a read-only view (the writer's
/// is redb's), or [`Error::Locked`] naming who holds the store.
pub(super) fn try_lock_shared(file: &std::fs::File, store: &Path) -> Result<()> {
    match file.try_lock_shared() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::Locked {
            path: store.display().to_string(),
            holder: crate::holder::lock_holder(store),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(e.into()),
    }
}

pub(super) fn sync_parent(path: &Path) -> Result<()> {
    #[cfg(unix)]
    std::fs::File::open(parent_dir(path))?.sync_all()?;
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// The directory holding `path` (`.` for a bare file name).
#[cfg(unix)]
pub(super) fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Refuses a non-empty file that does not start with a redb header, before
/// redb reads (or writes) anything else in it.
pub(super) fn check_foreign(backend: &impl StorageBackend) -> Result<()> {
    let len = backend.len().map_err(Error::Io)?;
    if len == 0 {
        return Ok(());
    }
    let mut head = [0u8; REDB_MAGIC.len()];
    if len < head.len() as u64 {
        return Err(not_ours(format!(
            "{len} bytes, shorter than a storage header"
        )));
    }
    backend.read(0, &mut head).map_err(Error::Io)?;
    if head != REDB_MAGIC {
        return Err(not_ours("it does not start with a redb header"));
    }
    Ok(())
}

pub(super) fn not_ours(detail: impl std::fmt::Display) -> Error {
    Error::corrupt(None, format!("not an idemstore store file: {detail}"))
}

/// Public as [`RedbStore::log_path`](super::RedbStore::log_path).
pub(super) fn log_path(store: impl AsRef<Path>) -> PathBuf {
    let store = store.as_ref();
    let mut name = store.file_name().unwrap_or_default().to_os_string();
    name.push("-wal");
    store.with_file_name(name)
}

/// redb's [`FileBackend`] over `file`: positional reads and writes,
/// `fdatasync`, and lock methods that only the engine calls (for the log,
/// the store file's lock, taken first, keeps a second process out).
pub(super) fn file_backend(file: std::fs::File) -> Result<FileBackend> {
    FileBackend::new(file).map_err(engine_error)
}

/// Opens (creating, mode 0600) the log beside `store`, making a new
/// directory entry durable; and whether it was created.
pub(super) fn open_log(store: &Path) -> Result<(FileBackend, bool)> {
    let path = log_path(store);
    let existed = path.exists();
    let file = open_owner_only(&path)?;
    if !existed {
        file.sync_all()?;
        sync_parent(&path)?;
    }
    Ok((file_backend(file)?, !existed))
}

/// Makes the log file at least `capacity` bytes long in written zeros, and
/// syncs it; returns the size frames may use.
pub(super) fn preallocate(file: &dyn StorageBackend, capacity: u64) -> Result<u64> {
    let len = file.len().map_err(Error::Io)?;
    if len >= capacity {
        return Ok(len);
    }
    // Grown first (some backends write only within their length), then
    // written: a sparse tail would make every fdatasync allocate blocks.
    file.set_len(capacity).map_err(Error::Io)?;
    const CHUNK: usize = 1024 * 1024;
    let zeros = vec![0u8; CHUNK];
    for at in (len..capacity).step_by(CHUNK) {
        let n = (capacity - at).min(CHUNK as u64) as usize;
        file.write(at, zeros.get(..n).unwrap_or_default())
            .map_err(Error::Io)?;
    }
    file.sync_data().map_err(Error::Io)?;
    Ok(capacity)
}

/// The lock methods of a [`StorageBackend`] wrapping another in `$inner`,
/// passed on unchanged.
macro_rules! forward_locks {
    ($inner:tt) => {
        $crate::redb::file::forward_locks!($inner: try_lock_range -> bool,
            try_lock_shared_range -> bool, lock_range -> (), lock_shared_range -> (),
            unlock_range -> (), query_lock_range -> bool);
    };
    ($inner:tt: $($name:ident -> $out:ty),*) => {$(
        fn $name(
            &self,
            start: ::std::ops::Bound<u64>,
            end: ::std::ops::Bound<u64>,
        ) -> ::std::result::Result<$out, ::redb::BackendError> {
            self.$inner.$name(start, end)
        }
    )*};
}
pub(super) use forward_locks;

/// Where a heal reopens the engine from.
pub(super) enum Origin {
    Path(PathBuf),
    /// A caller's backend (`open_backend`), shared with the engine.
    Backend(Arc<dyn StorageBackend>),
    /// A read-only view: it writes nothing, so it never heals.
    None,
}

/// A backend the engine shares with the store: every call but `close` goes
/// through (a heal opens the same backend again after the engine closed it).
#[derive(Debug)]
pub(super) struct SharedBackend(pub(super) Arc<dyn StorageBackend>);

impl StorageBackend for SharedBackend {
    fn len(&self) -> std::io::Result<u64> {
        self.0.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.0.read(offset, out)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.0.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.0.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.0.write(offset, data)
    }
    forward_locks!(0);
}

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

    pub(super) fn count(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }

    /// The last one, made again with the same kind and text.
    pub(super) fn last(&self) -> Option<IoError> {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.as_ref().map(|seen| match seen.os_code {
            Some(code) => IoError::from_raw_os_error(code),
            None => IoError::new(seen.kind, seen.text.clone()),
        })
    }
}

/// A backend whose I/O errors an [`IoWitness`] sees.
#[derive(Debug)]
pub(super) struct Witnessed<B> {
    inner: B,
    witness: Arc<IoWitness>,
}

impl<B> Witnessed<B> {
    pub(super) fn new(inner: B, witness: Arc<IoWitness>) -> Witnessed<B> {
        Witnessed { inner, witness }
    }

    fn seen<T>(&self, result: std::io::Result<T>) -> std::io::Result<T> {
        result.inspect_err(|e| self.witness.saw(e))
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
    forward_locks!(inner);
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
