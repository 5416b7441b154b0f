//! File helpers: owner-only opening, directory syncs, locks, the redb
//! header check, positional I/O, preallocation, the log file. A bottom
//! module.

use super::errors::engine_error;
use crate::error::{Error, Result};
use ::redb::StorageBackend;
use std::path::Path;

/// redb's file magic (its private `MAGICNUMBER`, fixed within a major
/// version), checked so that a foreign file is refused before redb touches it.
const REDB_MAGIC: [u8; 9] = [b'r', b'e', b'd', b'b', 0x1A, 0x0A, 0xA9, 0x0D, 0x0A];

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

/// Makes a new directory entry durable.
pub(super) fn sync_parent(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        std::fs::File::open(parent)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// Refuses a non-empty file that does not start with a redb header, before
/// redb reads (or writes) anything else in it.
pub(super) fn check_foreign(backend: &impl StorageBackend) -> Result<()> {
    let len = backend
        .len()
        .map_err(|e| engine_error(::redb::StorageError::from(e)))?;
    if len == 0 {
        return Ok(());
    }
    let mut head = [0u8; REDB_MAGIC.len()];
    if len < head.len() as u64 {
        return Err(not_ours(format!(
            "{len} bytes, shorter than a storage header"
        )));
    }
    backend
        .read(0, &mut head)
        .map_err(|e| engine_error(::redb::StorageError::from(e)))?;
    if head != REDB_MAGIC {
        return Err(not_ours("it does not start with a redb header"));
    }
    Ok(())
}

pub(super) fn not_ours(detail: impl std::fmt::Display) -> Error {
    Error::corrupt(None, format!("not an idemstore store file: {detail}"))
}

/// The write-ahead log beside the store file `store` (`<store>-wal`);
/// public as [`RedbStore::log_path`](super::RedbStore::log_path).
pub(super) fn log_path(store: impl AsRef<Path>) -> std::path::PathBuf {
    let store = store.as_ref();
    let mut name = store.file_name().unwrap_or_default().to_os_string();
    name.push("-wal");
    store.with_file_name(name)
}

/// The log on a real file: positional reads and writes, `fdatasync`. The
/// store file's lock (taken first) is what keeps a second process out.
#[derive(Debug)]
pub(super) struct FileLog {
    file: std::fs::File,
}

impl FileLog {
    /// Opens (creating, mode 0600) the log beside `store`, making a new
    /// directory entry durable.
    pub(super) fn open(store: &Path) -> Result<FileLog> {
        let path = log_path(store);
        let existed = path.exists();
        let file = open_owner_only(&path)?;
        if !existed {
            file.sync_all()?;
            sync_parent(&path)?;
        }
        Ok(FileLog { file })
    }

    /// Opens the log beside `store` for reading only (`None` when there is
    /// none): every write through it fails, and nothing is created.
    pub(super) fn open_read_only(store: &Path) -> Result<Option<FileLog>> {
        match std::fs::File::open(log_path(store)) {
            Ok(file) => Ok(Some(FileLog { file })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

impl StorageBackend for FileLog {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        read_at(&self.file, out, offset)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.file.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        #[cfg(unix)]
        {
            std::os::unix::fs::FileExt::write_all_at(&self.file, data, offset)
        }
        #[cfg(windows)]
        {
            let mut done = 0;
            while let Some(rest) = data.get(done..).filter(|r| !r.is_empty()) {
                let n = std::os::windows::fs::FileExt::seek_write(
                    &self.file,
                    rest,
                    offset + done as u64,
                )?;
                if n == 0 {
                    return Err(std::io::ErrorKind::WriteZero.into());
                }
                done += n;
            }
            Ok(())
        }
    }
}

/// Fills `out` from `file` at `offset` (positional: no shared cursor).
pub(super) fn read_at(file: &std::fs::File, out: &mut [u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, out, offset)
    }
    #[cfg(windows)]
    {
        let mut done = 0;
        while let Some(rest) = out.get_mut(done..).filter(|r| !r.is_empty()) {
            let n = std::os::windows::fs::FileExt::seek_read(file, rest, offset + done as u64)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            done += n;
        }
        Ok(())
    }
}

/// Makes the log file at least `capacity` bytes long, writing zeros over
/// the missing part, and syncs it; returns the size frames may use.
pub(super) fn preallocate(file: &dyn StorageBackend, capacity: u64) -> Result<u64> {
    let len = file.len().map_err(Error::Io)?;
    if len >= capacity {
        return Ok(len);
    }
    // Grown first (some backends write only within their length), then
    // written: with a sparse tail every append's fdatasync would also
    // write block allocations.
    file.set_len(capacity).map_err(Error::Io)?;
    const CHUNK: usize = 1024 * 1024;
    let zeros = vec![0u8; CHUNK];
    let mut at = len;
    while at < capacity {
        let n = (capacity - at).min(CHUNK as u64) as usize;
        file.write(at, zeros.get(..n).unwrap_or_default())
            .map_err(Error::Io)?;
        at += n as u64;
    }
    file.sync_data().map_err(Error::Io)?;
    Ok(capacity)
}

/// The lock methods of a [`StorageBackend`] that wraps another in the field
/// `$inner`, passed on unchanged: the wrappers (`source::SharedBackend`,
/// `witness::Witnessed`) change what they do with data, never the locks.
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
