//! [`SledStats`]: the counters of the durable path.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of a [`SledStore`](crate::SledStore)'s durable path, from
/// [`SledStore::stats`](crate::SledStore::stats).
///
/// `data_fsyncs` close to `commits` means one fsync per write (one client);
/// far below means group flushing works (many clients).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SledStats {
    /// Write transactions committed (claims, completions, releases, sweeps).
    pub commits: u64,
    /// sled flushes run (one per group round).
    pub flushes: u64,
    /// `fdatasync` calls on the data file (at [`Durability::OsBuffered`](super::Durability::OsBuffered)
    /// only the one at open).
    pub data_fsyncs: u64,
    /// Blob files fsynced (sled never does).
    pub blob_fsyncs: u64,
    /// Time spent in sled's flush (`pwrite` + `sync_file_range`), in all
    /// rounds. sled blocks every transaction while it flushes.
    pub flush_micros: u64,
    /// Time spent in the fsyncs after it (new blobs + `fdatasync` of the
    /// data file), in all rounds. Transactions proceed meanwhile.
    pub fsync_micros: u64,
}

/// Counters of the durable path, as [`SledStore::stats`](crate::SledStore::stats) reports them.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) commits: AtomicU64,
    pub(super) flushes: AtomicU64,
    pub(super) data_fsyncs: AtomicU64,
    pub(super) blob_fsyncs: AtomicU64,
    pub(super) flush_micros: AtomicU64,
    pub(super) fsync_micros: AtomicU64,
}

impl Counters {
    /// The counters as they are now.
    pub(super) fn snapshot(&self) -> SledStats {
        SledStats {
            commits: self.commits.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
            data_fsyncs: self.data_fsyncs.load(Ordering::Relaxed),
            blob_fsyncs: self.blob_fsyncs.load(Ordering::Relaxed),
            flush_micros: self.flush_micros.load(Ordering::Relaxed),
            fsync_micros: self.fsync_micros.load(Ordering::Relaxed),
        }
    }
}
