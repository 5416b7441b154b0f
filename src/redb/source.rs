//! Where a store's engine is opened from, kept so that a heal (heal.rs)
//! can open it again: the path, or the caller's backend shared through
//! [`SharedBackend`]. A bottom module: it imports only `file.rs`.

use ::redb::StorageBackend;
use std::path::PathBuf;
use std::sync::Arc;

/// Where a heal reopens the engine from.
pub(super) enum Origin {
    /// A store file, opened as `open` opens it.
    Path(PathBuf),
    /// A caller's store backend (`open_backend`), shared with the engine
    /// through [`SharedBackend`] so that a heal can open it again.
    Backend(Arc<dyn StorageBackend>),
    /// A read-only view: it writes nothing, so it never heals.
    None,
}

/// A backend the engine shares with the store: every call goes to the one
/// underneath but `close`, which is left to the last owner (dropping it),
/// since a heal opens the same backend again after the engine closed it.
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
    super::file::forward_locks!(0);
}
