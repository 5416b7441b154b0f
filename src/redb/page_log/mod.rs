//! The page log (`<file>-pages`, [`RedbStoreBuilder::page_log`]): the store
//! file behind a redo log of redb's page writes, so that a durable redb
//! commit is one sequential append and one `fdatasync` of the log instead
//! of a write of every dirty page and an `fdatasync` of the store file.
//! The inbox commits a batch this way; the request path's own write-ahead
//! log (`record_log/`) is unchanged above it. This file holds the log's
//! size, its path beside the store file and the replay of the log beside
//! a store ([`replay_beside`]); `frame.rs` lays out the frames and replays
//! a run, `backend.rs` is [`PageLog`] (the store file behind the log, which
//! writes the frames), and `overlay.rs` reads a store file through
//! in-memory pages without writing it (for inspections, and for a heal's
//! view for reads), with `page_images.rs`, the page images both keep.
//!
//! The store has two logs because they make two kinds of commit cheap: the
//! record log (`record_log/`, on by default,
//! [`write_ahead_log`](super::RedbStoreBuilder::write_ahead_log)) holds the
//! records a group of claims and completions changed, above redb, while
//! this one (off by default, [`RedbStoreBuilder::page_log`]) sits under
//! redb and holds the pages of redb's own commits (the inbox's, the
//! checkpoints', the admin writes).
//!
//! # Durability reasoning
//!
//! redb's contract is that what was written before a `sync_data` that
//! returned is durable. Here it is durable in the log: the frame holding
//! those writes was synced before `sync_data` returned. The store file is
//! written only by a checkpoint, with pages whose frames are durable (or, in
//! a checkpoint that stands in for a frame, with the pending writes too,
//! made durable by the file's own sync before `sync_data` returns).
//!
//! A new run begins only after the store file holds everything (a
//! checkpoint synced it, or a replay applied and synced the old run), and
//! its marker is synced before any frame follows it. So the frames a
//! replay applies are always a whole run from its start: either the run
//! the store file already holds (replaying it again rewrites the same
//! images: nothing changes), or the current one. A marker torn at a crash
//! reads as no run at all, which is right: the file already holds
//! everything. The old run's frames after a new marker are never read:
//! their epoch differs.
//!
//! [`RedbStoreBuilder::page_log`]: super::RedbStoreBuilder::page_log

use crate::error::{Error, Result};
use ::redb::StorageBackend;
use std::io::{Error as IoError, ErrorKind};
use std::path::{Path, PathBuf};

mod backend;
mod frame;
mod overlay;
mod page_images;

pub(super) use backend::PageLog;
pub(crate) use frame::{Replayed, replay};
#[cfg(feature = "unstable-internals")]
pub(crate) use frame::{encode_frame, encode_set_len, encode_write};
pub(super) use overlay::{Overlay, open_overlay, open_view_of};

/// The page log's size (`<file>-pages`, preallocated): a commit whose
/// frame would not fit makes a checkpoint of the store file instead, so the
/// pages kept in memory are at most about this much.
pub(crate) const PAGE_LOG_BYTES: u64 = 32 << 20;

/// The page log's path beside the store file: `<name>-pages`.
pub(super) fn pages_path(store: &Path) -> PathBuf {
    let mut name = store.file_name().unwrap_or_default().to_os_string();
    name.push("-pages");
    store.with_file_name(name)
}

/// Replays the page log beside `store`, if there is one, into `target`
/// (an in-memory overlay of a read-only view): the log is opened read-only
/// and, with `lock`, shared-locked, so a writer is [`Error::Locked`].
pub(super) fn replay_beside(
    store: &Path,
    target: &dyn StorageBackend,
    lock: bool,
) -> Result<Replayed> {
    let path = pages_path(store);
    let file = match std::fs::File::open(&path) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Replayed::default()),
        other => other?,
    };
    if lock {
        super::file::try_lock(&file, super::file::Lock::Shared, store, &path)?;
    }
    let log = ::redb::backends::FileBackend::new(file)
        .map_err(|e| Error::Io(IoError::other(e.to_string())))?;
    replay(&log, target)
}
