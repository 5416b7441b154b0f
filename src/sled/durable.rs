//! The flush step that makes sled's writes durable for real.
//!
//! sled 0.34.7 lays a store directory out as:
//!
//! ```text
//! conf        storage parameters (written once, never fsynced by sled)
//! db          the log-structured data file: every page write is appended here
//! blobs/<lsn> one file per log item larger than a quarter segment (~128 KiB)
//! snap.<lsn>  a page-table snapshot (sled fsyncs these itself)
//! ```
//!
//! `Db::flush` writes the dirty io buffers into `db` with `pwrite` and then,
//! on Linux, calls `sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)`
//! (sled `pagecache/iobuf.rs`). That starts and waits for writeback of the
//! range, but does not flush the drive's write cache and does not persist
//! the file's size or extent metadata: after a power loss the data may be
//! gone. Blob files are written with `write_all` and never synced at all
//! (`pagecache/blob_io.rs`).
//!
//! So after sled's flush this step fsyncs every blob file it has not synced
//! yet and the `blobs` directory, and then fdatasyncs `db`. Blobs go first:
//! a log entry that is durable must never point at a blob that is not.
//! What an acknowledged write survives is the store's [`Durability`].

use super::stats::Counters;
use crate::error::{Error, Result};
use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

/// What an acknowledged write survives on a [`SledStore`](crate::SledStore).
///
/// A separate type from redb's durability setting because the relaxed
/// levels of the two engines survive different things: sled's flush
/// already hands the data to the operating system (it survives a process
/// kill), redb's non-durable commit does not.
///
/// ```
/// use idemstore::sled::Durability;
/// assert_eq!(Durability::default(), Durability::Immediate);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Durability {
    /// Survives a process crash and a power loss: every acknowledged write
    /// is flushed by sled and then fdatasynced (data file) and fsynced (new
    /// blob files), one flush + fsync per group of concurrent writers.
    #[default]
    Immediate,
    /// Survives a process crash, not a power loss: every acknowledged write
    /// is in the operating system's page cache (sled's flush, which ends in
    /// `sync_file_range`), but nothing is fsynced before the answer. sled's
    /// own background thread fsyncs the data file about every 500 ms, on a
    /// best-effort basis; the store fsyncs everything (blobs included) at
    /// open and at a clean close.
    OsBuffered,
}

/// The data file and blob directory of one open store, and the flush step.
#[derive(Debug)]
pub(crate) struct DiskSync {
    durability: Durability,
    /// A second handle on sled's `db` file: fsync acts on the file, not on
    /// the descriptor, so syncing through it syncs sled's writes.
    data_file: File,
    dir: PathBuf,
    blobs_dir: PathBuf,
    /// Names of blob files already fsynced (pruned when sled deletes them).
    synced_blobs: Mutex<HashSet<OsString>>,
    pub(crate) counters: Counters,
    /// Test seam (feature `test-util`): this many next fsyncs fail.
    failing_syncs: AtomicU32,
}

/// The data file's name inside a sled directory.
pub(crate) const DATA_FILE: &str = "db";
/// The blob directory's name inside a sled directory.
pub(crate) const BLOBS_DIR: &str = "blobs";
/// The storage-parameters file's name inside a sled directory.
pub(crate) const CONF_FILE: &str = "conf";

impl DiskSync {
    /// Opens the handles after sled has created its files, and makes the
    /// directory entries and sled's `conf` durable (sled never syncs them).
    pub(crate) fn open(dir: &Path, durability: Durability) -> Result<DiskSync> {
        let data_file = File::options()
            .read(true)
            .write(true)
            .open(dir.join(DATA_FILE))?;
        let blobs_dir = dir.join(BLOBS_DIR);
        let sync = DiskSync {
            durability,
            data_file,
            dir: dir.to_path_buf(),
            blobs_dir,
            synced_blobs: Mutex::new(HashSet::new()),
            counters: Counters::default(),
            failing_syncs: AtomicU32::new(0),
        };
        // Once per open, at every durability level: the files and their
        // directory entries exist durably before the marker names them.
        File::open(dir.join(CONF_FILE))?.sync_all()?;
        sync.data_file.sync_all()?;
        sync_dir(&sync.blobs_dir)?;
        sync_dir(&sync.dir)?;
        Ok(sync)
    }

    /// sled's flush, then (at [`Durability::Immediate`]) the fsyncs that
    /// make it durable.
    pub(crate) fn flush(&self, db: &::sled::Db) -> Result<()> {
        self.flush_and_sync(db, self.durability == Durability::Immediate)
    }

    /// sled's flush and the fsyncs, at any durability level: at open and
    /// clean close, before the marker file vouches for what is on disk.
    pub(crate) fn sync_now(&self, db: &::sled::Db) -> Result<()> {
        self.flush_and_sync(db, true)
    }

    fn flush_and_sync(&self, db: &::sled::Db, fsync: bool) -> Result<()> {
        let c = &self.counters;
        c.flushes.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        db.flush().map_err(super::errors::from_sled)?;
        c.flush_micros
            .fetch_add(micros_since(started), Ordering::Relaxed);
        if !fsync {
            return Ok(());
        }
        let started = Instant::now();
        self.sync_new_blobs()?;
        self.injected_fault()?;
        self.data_file.sync_data()?;
        c.fsync_micros
            .fetch_add(micros_since(started), Ordering::Relaxed);
        c.data_fsyncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Fsyncs blob files written since the last call, then their directory.
    /// Listing an empty directory is one `getdents` call, so the common case
    /// (no large pages) costs next to nothing.
    fn sync_new_blobs(&self) -> Result<()> {
        let mut synced = self.synced_blobs.lock().unwrap_or_else(|p| p.into_inner());
        let mut present = HashSet::new();
        let mut new = 0u64;
        for entry in std::fs::read_dir(&self.blobs_dir)? {
            let entry = entry?;
            let name = entry.file_name();
            if !synced.contains(&name) {
                match File::open(entry.path()) {
                    Ok(f) => f.sync_all()?,
                    // sled garbage-collected it between listing and opening.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e.into()),
                }
                new += 1;
            }
            present.insert(name);
        }
        // Forgetting names sled has deleted keeps the set as small as the
        // directory. A deletion need not be durable: a blob that comes back
        // after a power loss is unreferenced and only costs space.
        *synced = present;
        if new > 0 {
            sync_dir(&self.blobs_dir)?;
            self.counters.blob_fsyncs.fetch_add(new, Ordering::Relaxed);
        }
        Ok(())
    }

    fn injected_fault(&self) -> Result<()> {
        let hit = self
            .failing_syncs
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if hit {
            return Err(Error::Io(std::io::Error::other(
                "injected fdatasync failure (test-util)",
            )));
        }
        Ok(())
    }

    /// Makes the next `count` fsyncs fail (test seam).
    #[cfg(feature = "test-util")]
    pub(crate) fn fail_next_syncs(&self, count: u32) {
        self.failing_syncs.store(count, Ordering::SeqCst);
    }
}

fn micros_since(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// fsync on a directory makes its entries (file creations, deletions) durable.
fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)?.sync_all()?;
    Ok(())
}
