//! The record log (`<file>-wal`, the write-ahead log): how a group becomes
//! durable with one small append and one `fdatasync`, instead of one redb
//! commit that rewrites every B-tree page the group touched. This file
//! holds the log's sizes, its path beside the store file and [`FileLog`]
//! (the log on a real file); `frame.rs` lays out the file and the frames,
//! `writer.rs` appends them ([`Wal`]), `reader.rs` walks them for a
//! replay, and `recovery.rs`, beside this directory, recovers the log at an
//! open and at a heal.
//!
//! The store's one log: it holds the records a group of claims and
//! completions changed, above redb; redb's own commits (the inbox's, the
//! checkpoints', the admin writes) are durable commits of the store file.
//!
//! Why: idempotency keys are random, so every claim lands on its own leaf
//! page; a durable redb commit of a 60-request batch rewrote ~375 KiB
//! (copy-on-write leaves and branches) to store ~20 KiB of records, and the
//! disk's write bandwidth, not its fsync rate, set the ceiling. The log
//! writes what changed (the records), nothing else; the B-tree pages are
//! written by checkpoints, where many records share each commit.
//!
//! How (`Durability::Immediate`, the default; see `commit.rs` and
//! `checkpoint.rs` for the two sides):
//!
//! 1. A group's leader decides its requests and records each record put or
//!    delete, and the new fencing-token high-water mark, in a [`Journal`].
//! 2. The journal goes to the log as one [`frame`](Wal::append), on a
//!    [`FRAME_ALIGN`] boundary, and the log is `fdatasync`ed; only then are
//!    the records published to the memtable and the callers answered, so
//!    nothing is visible before it is durable.
//! 3. The file is two segments. Frames of epoch `e` go to segment `e % 2`.
//!    When the memtable is handed to the checkpointer (its segment is
//!    full, it is larger than [`MEMTABLE_BYTES`](super::memtable::MEMTABLE_BYTES),
//!    or older than [`CHECKPOINT_INTERVAL`]), the log moves to epoch `e + 1`
//!    in the other segment, and commits go on there while the checkpoint
//!    writes epoch `e`'s records into redb. The checkpoint's durable commit
//!    stores `e + 1` as the durable epoch (a meta entry): that one commit
//!    retires every frame of `e`, with no truncation and no second write.
//!    A segment is written again only after the epoch it held is retired
//!    (a new freeze waits for the running checkpoint).
//! 4. Opening a store replays the frames of the durable epoch `E` (segment
//!    `E % 2`) and then of `E + 1` (the other), each from the start of its
//!    segment, commits durably, and starts writing epoch `E + 2`.
//!
//! Because a frame starts on a fresh 4 KiB block, an append never writes a
//! sector holding acknowledged bytes: a device that tears a sector into
//! garbage during a power cut can damage only the frame being written.
//!
//! Every write transaction outside the line (the inbox, the admin evict
//! and import, `compact`, a group too large for a segment) first takes in
//! the memtable and then moves the epoch on (see
//! [`Shared::direct`](super::Shared)), since replaying older frames over
//! its writes would undo them.
//!
//! The frames' layout is drawn in `frame.rs` and specified in
//! docs/format.md.

use crate::error::Result;
use ::redb::StorageBackend;
use std::path::Path;
use std::time::Duration;

mod frame;
mod reader;
mod writer;

pub(crate) use frame::FRAME_ALIGN;
pub(super) use frame::{Journal, Layout, entries};
pub(super) use reader::{applier, frames_seen, walk};
pub(super) use writer::Wal;

/// Size of a store's write-ahead log file (`<file>-wal`): two segments of
/// half this size each. It is written with zeros at creation (so appends
/// never change the file's size or allocation, and `fdatasync` has no
/// metadata to write), then each segment is reused from its start once the
/// checkpoint of the frames it held is durable. A group's frame takes whole
/// 4 KiB blocks; a group too large for a whole segment commits
/// straight into the store file (durably) instead.
///
/// ```
/// assert_eq!(idemstore::redb::WAL_BYTES, 8 << 20);
/// ```
pub const WAL_BYTES: u64 = 8 * 1024 * 1024;

/// Smallest log the builder accepts (`wal_bytes`): two segments of two
/// aligned 4 KiB blocks each.
///
/// ```
/// assert_eq!(idemstore::redb::MIN_WAL_BYTES, 16 * 1024);
/// ```
pub const MIN_WAL_BYTES: u64 = 4 * FRAME_ALIGN;

/// Longest time a logged write stays only in the memtable and the log
/// before the background checkpointer starts writing it into the store
/// file (an idle store is checkpointed too). It bounds the work of a
/// replay after a crash.
///
/// ```
/// assert_eq!(idemstore::redb::CHECKPOINT_INTERVAL.as_millis(), 500);
/// ```
pub const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(500);

/// The log's path beside the store file: `<name>-wal`.
pub(super) fn wal_path(store: &Path) -> std::path::PathBuf {
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
        let path = wal_path(store);
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
        match std::fs::File::open(wal_path(store)) {
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
            wal_path(Path::new("/srv/orders.idem")),
            Path::new("/srv/orders.idem-wal")
        );
    }
}
