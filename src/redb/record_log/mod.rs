//! The record log (`<file>-wal`, the write-ahead log): how a group becomes
//! durable with one small append and one `fdatasync`, instead of one redb
//! commit that rewrites every B-tree page the group touched. This file
//! holds the log's sizes, its path beside the store file and [`FileLog`]
//! (the log on a real file); `frame.rs` lays out the file and the frames,
//! `writer.rs` appends them ([`Wal`]), `reader.rs` walks them for a
//! replay, and `recovery.rs`, beside this directory, recovers the log at an
//! open and at a heal.
//!
//! The store has two logs because they make two kinds of commit cheap:
//! this one (on by default,
//! [`write_ahead_log`](super::RedbStoreBuilder::write_ahead_log)) holds
//! the records a group of claims and completions changed, above redb,
//! while the page log (`page_log/`, off by default,
//! [`page_log`](super::RedbStoreBuilder::page_log)) sits under redb and
//! holds the pages of redb's own commits (the inbox's, the checkpoints',
//! the admin writes).
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
//! A format-2 log (before this layout) is one region of back-to-back
//! frames that also carry index entries; it is replayed as such once, at
//! the open that upgrades the store to format 3.
//!
//! The frames' layout is drawn in `frame.rs` and specified in
//! docs/format.md, the reference for both logs.

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
///
/// On Linux the log is also opened with `O_DIRECT`, and a write of whole
/// blocks at a block boundary (every append: [`Wal`] pads each frame to
/// [`FRAME_ALIGN`](frame::FRAME_ALIGN)) goes through it. Such a write is
/// in the device when it returns, so the `fdatasync` after it finds no
/// dirty page to write back and only makes the device flush its cache:
/// the same durability (the file's blocks were all written at creation,
/// so no allocation or size change waits on the journal either) for about
/// a third less kernel CPU per append on ext4. Where the filesystem
/// refuses `O_DIRECT` (tmpfs) the log is written through the page cache.
/// The kernel drops cached pages of a range written directly, so reads
/// through the buffered handle (a heal's replay) see what was written.
#[derive(Debug)]
pub(super) struct FileLog {
    file: std::fs::File,
    #[cfg(target_os = "linux")]
    direct: Option<std::fs::File>,
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
        Ok(FileLog {
            file,
            #[cfg(target_os = "linux")]
            direct: open_direct(&path),
        })
    }

    /// Whether appends bypass the page cache (a test asks).
    #[cfg(all(test, target_os = "linux"))]
    fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Opens the log beside `store` for reading only (`None` when there is
    /// none): every write through it fails, and nothing is created.
    pub(super) fn open_read_only(store: &Path) -> Result<Option<FileLog>> {
        match std::fs::File::open(wal_path(store)) {
            Ok(file) => Ok(Some(FileLog {
                file,
                #[cfg(target_os = "linux")]
                direct: None,
            })),
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
        #[cfg(target_os = "linux")]
        if let Some(direct) = &self.direct
            && offset.is_multiple_of(DIRECT_BLOCK)
            && (data.len() as u64).is_multiple_of(DIRECT_BLOCK)
            && !data.is_empty()
        {
            return write_direct(direct, offset, data);
        }
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

/// The block size of `O_DIRECT` writes: a multiple of every logical block
/// size in use (512 or 4096), and [`FRAME_ALIGN`](frame::FRAME_ALIGN).
#[cfg(target_os = "linux")]
const DIRECT_BLOCK: u64 = 4096;

/// The log opened for writing with `O_DIRECT`, or `None` where that is
/// refused: the log is then written through the page cache.
#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = rustix::fs::OFlags::DIRECT.bits();
    std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(i32::try_from(flags).ok()?)
        .open(path)
        .ok()
}

/// Writes `data` (whole blocks) at `offset` (a block boundary) through the
/// `O_DIRECT` handle, from a block-aligned copy, as `O_DIRECT` requires
/// (a buffer one block longer has a block-aligned run of `data.len()`
/// bytes in it).
#[cfg(target_os = "linux")]
fn write_direct(file: &std::fs::File, offset: u64, data: &[u8]) -> std::io::Result<()> {
    let block = DIRECT_BLOCK as usize;
    let mut buffer = vec![0u8; data.len() + block];
    let start = buffer.as_ptr().align_offset(block);
    let aligned = buffer
        .get_mut(start..start + data.len())
        .ok_or_else(|| std::io::Error::other("no aligned run in the write buffer"))?;
    aligned.copy_from_slice(data);
    std::os::unix::fs::FileExt::write_all_at(file, aligned, offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An append through the `O_DIRECT` handle reads back through the
    /// buffered one, over bytes the page cache held from before, and
    /// writes that are not whole blocks still work (through the page cache).
    #[cfg(target_os = "linux")]
    #[test]
    fn direct_appends_read_back_through_the_page_cache() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("s.idem");
        let log = FileLog::open(&store).unwrap();
        log.set_len(4 * DIRECT_BLOCK).unwrap();
        log.write(0, &[7; 4 * DIRECT_BLOCK as usize]).unwrap();
        let mut cached = [0u8; 16];
        log.read(DIRECT_BLOCK, &mut cached).unwrap();
        assert_eq!(cached, [7; 16]);
        let block: Vec<u8> = (0..DIRECT_BLOCK).map(|i| (i % 251) as u8).collect();
        log.write(DIRECT_BLOCK, &block).unwrap();
        log.sync_data().unwrap();
        let mut back = vec![0u8; DIRECT_BLOCK as usize];
        log.read(DIRECT_BLOCK, &mut back).unwrap();
        assert_eq!(back, block);
        log.write(3, b"abc").unwrap();
        let mut small = [0u8; 4];
        log.read(2, &mut small).unwrap();
        assert_eq!(&small, b"\x07abc");
        // tmpfs refuses O_DIRECT; the test directory's filesystem may too.
        eprintln!("O_DIRECT in use: {}", log.is_direct());
    }

    #[test]
    fn the_log_sits_beside_the_store() {
        assert_eq!(
            wal_path(Path::new("/srv/orders.idem")),
            Path::new("/srv/orders.idem-wal")
        );
    }
}
