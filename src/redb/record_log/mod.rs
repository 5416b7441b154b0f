//! The record log (`<file>-wal`): a group becomes durable with one aligned
//! append and one `fdatasync`, not a redb commit that rewrites every page it
//! touched. This file: the log's sizes, its path, [`FileLog`]; `frame.rs`
//! the bytes (docs/format.md), `writer.rs` the appends, `reader.rs` the walk.
//!
//! Invariants (`Durability::Immediate`):
//!
//! 1. A group's records and token high-water mark go to the log as one
//!    frame, which is `fdatasync`ed before the memtable sees the records or
//!    a caller is answered: nothing is visible before it is durable.
//! 2. Two segments; epoch `e` writes segment `e % 2`. A freeze moves the log
//!    to `e + 1` while the checkpoint writes `e`'s records into redb; its
//!    durable commit stores `e + 1` as the durable epoch, which retires all
//!    of `e` in that one commit. A segment is reused only once its epoch is
//!    retired (a freeze waits for the running checkpoint).
//! 3. An open replays epoch `E` (segment `E % 2`), then `E + 1`, commits
//!    durably, and writes `E + 2`.
//! 4. A frame starts on a fresh 4 KiB block, so an append never rewrites a
//!    sector holding acknowledged bytes: a torn sector damages only the
//!    frame being written.
//! 5. Every write transaction outside the line takes in the memtable and
//!    then moves the epoch on ([`Shared::direct`](super::Shared)): replaying
//!    older frames over its writes would undo them.

use crate::error::Result;
use ::redb::StorageBackend;
use std::path::Path;
use std::time::Duration;

mod frame;
mod reader;
mod writer;

pub(crate) use frame::FRAME_ALIGN;
pub(super) use frame::{FrameBuf, Layout, entries};
pub(super) use reader::{applier, frames_seen, walk};
pub(super) use writer::LogWriter;

/// Size of a store's log file (`<file>-wal`): two segments of
/// half this size. Zero-filled at creation, so an append changes neither
/// size nor allocation and `fdatasync` has no metadata to write.
pub(crate) const WAL_BYTES: u64 = 8 * 1024 * 1024;

/// Smallest log the builder accepts (`log_bytes`): two segments of two
/// aligned 4 KiB blocks each.
pub(crate) const MIN_WAL_BYTES: u64 = 4 * FRAME_ALIGN;

/// Longest time a logged write stays only in the memtable and the log
/// before the background checkpointer starts writing it into the store
/// file (an idle store is checkpointed too). It bounds the work of a
/// replay after a crash.
pub(crate) const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(500);

/// The log's path beside the store file: `<name>-wal`.
pub(super) fn log_path(store: &Path) -> std::path::PathBuf {
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
        let file = super::file::open_owner_only(&path)?;
        if !existed {
            file.sync_all()?;
            super::file::sync_parent(&path)?;
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
        super::file::read_at(&self.file, out, offset)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_sits_beside_the_store() {
        assert_eq!(
            log_path(Path::new("/srv/orders.idem")),
            Path::new("/srv/orders.idem-wal")
        );
    }
}
