//! Healing: after a failed write, the store writes again once the cause
//! is gone, without a restart and without losing anything.
//!
//! A failed write may or may not be on disk, and redb refuses every use of
//! a database after an I/O error of its own (`PreviousIo`) until it is
//! opened again. So a heal does what an open does, inside the running
//! store, under the commit lock and the database's write lock (no group
//! commits, no transaction is live):
//!
//! 1. the old engine is closed first (its file locks must go before the
//!    files are opened again; an empty in-memory stand-in marked unusable
//!    holds its place, so no read ever sees it), and reopened from the
//!    same files ([`Source`]): the store file, and the page log when the
//!    store has one;
//! 2. the write-ahead log's live frames are replayed into it and committed
//!    durably with a new epoch, as an open does (`open::heal_log`). What
//!    the memtable holds is exactly those frames (it is published only
//!    after its frame is durable), so the memtable is then emptied: its
//!    records are in the store file. A frame whose write failed may be
//!    replayed or not: its callers were told it failed, and either way the
//!    result is what a crash at that moment followed by an open gives.
//!
//! If step 1 fails (the files cannot be read), reads fail with the cause
//! until a later attempt succeeds. If step 2 fails (the disk is still
//! full), redb refuses the engine again, so it is reopened once more for
//! reads, and the memtable is kept: reads and replays go on, writes stay
//! refused, and the background thread tries again after its back-off.

use super::errors::engine;
use super::tables::{META, META_TOKEN_HWM};
use super::{Engine, Shared};
use crate::error::{Error, Result};
use ::redb::{Database, ReadableDatabase, StorageBackend};
use std::ops::Bound;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Where a heal reopens the engine from.
pub(super) enum Source {
    /// A store file, opened as `open` opens it.
    Path(PathBuf),
    /// A caller's backends (`open_backend*`), shared with the engine
    /// through [`SharedBackend`] so that a heal can open them again.
    Backend {
        store: Arc<dyn StorageBackend>,
        pages: Option<Arc<dyn StorageBackend>>,
    },
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
    fn try_lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, ::redb::BackendError> {
        self.0.try_lock_range(start, end)
    }
    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, ::redb::BackendError> {
        self.0.try_lock_shared_range(start, end)
    }
    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), ::redb::BackendError> {
        self.0.lock_range(start, end)
    }
    fn lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<(), ::redb::BackendError> {
        self.0.lock_shared_range(start, end)
    }
    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), ::redb::BackendError> {
        self.0.unlock_range(start, end)
    }
    fn query_lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, ::redb::BackendError> {
        self.0.query_lock_range(start, end)
    }
}

/// The empty engine that holds a closed one's place.
fn stand_in() -> Result<Database> {
    Database::builder()
        .create_with_backend(::redb::backends::InMemoryBackend::new())
        .map_err(engine)
}

impl Shared {
    /// One attempt to heal a poisoned store (see the module docs).
    pub(super) fn heal(&self) -> Result<()> {
        let mut core = self.lock_core();
        let mut engine = self.write_db();
        self.reopen(&mut engine)?;
        let meta = match self.reopened_meta(&engine.db) {
            Ok(meta) => meta,
            Err(e) => return Err(self.unhealed(&mut engine, e)),
        };
        let name = self
            .path
            .clone()
            .unwrap_or_else(|| "<storage backend>".into());
        let recovered = match core.wal.as_ref().map(super::wal::Wal::file) {
            Some(file) => {
                super::open::heal_log(&engine.db, file, &meta, &self.heal_config, &name).map(Some)
            }
            // Without a log the state is the engine's: a durable commit
            // proves it writes again.
            None => probe(&engine.db, core.token_hwm.max(meta.token_hwm)).map(|()| None),
        };
        let wal = match recovered {
            Ok(wal) => wal,
            Err(e) => return Err(self.unhealed(&mut engine, e)),
        };
        let hwm = self
            .reopened_meta(&engine.db)
            .map_or(meta.token_hwm, |m| m.token_hwm);
        core.token_hwm = core.token_hwm.max(hwm);
        if wal.is_some() {
            core.wal = wal;
        }
        core.unflushed = false;
        core.last_durable = Instant::now();
        {
            let mut mem = self.write_mem();
            mem.active.clear();
            mem.active_bytes = 0;
            mem.frozen = None;
        }
        self.log_unsynced.store(false, Ordering::SeqCst);
        self.start_memtable_clock();
        drop(engine);
        self.healthy_again();
        Ok(())
    }

    /// Closes the engine and opens it again from the files. On failure the
    /// stand-in stays, marked unusable.
    fn reopen(&self, engine: &mut Engine) -> Result<()> {
        let old = std::mem::replace(&mut engine.db, stand_in()?);
        engine.usable = false;
        drop(old);
        let (db, _) = super::open::reopen_engine(&self.source, &self.heal_config)?;
        engine.db = db;
        engine.usable = true;
        Ok(())
    }

    fn reopened_meta(&self, db: &Database) -> Result<super::open::MetaEntries> {
        let txn = db.begin_read().map_err(engine)?;
        super::open::read_meta_entries(&txn)
    }

    /// A heal's replay or probe failed: redb refuses the engine after its
    /// failed commit, so it is opened once more for reads; writes stay
    /// refused. Returns `error`.
    fn unhealed(&self, engine: &mut Engine, error: Error) -> Error {
        let _ = self.reopen(engine);
        error
    }
}

/// A durable commit of the token high-water mark.
fn probe(db: &Database, token_hwm: u64) -> Result<()> {
    let txn = db.begin_write().map_err(engine)?;
    {
        let mut meta = txn.open_table(META).map_err(engine)?;
        meta.insert(META_TOKEN_HWM, token_hwm.to_be_bytes().as_slice())
            .map_err(engine)?;
    }
    txn.commit().map_err(engine)
}
