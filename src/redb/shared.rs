//! [`Shared`]: what the callers and the background thread share, composed
//! of parts that each own their locks: [`Line`], [`Log`] (the commit
//! lock), [`Memory`] and [`Db`]. Here: the read path, flush, clean close.
//!
//! Lock order: the line's lock is never held while taking another;
//! otherwise the log, then the background lock, then the memtable, then
//! the engine. One exception, safe: a failure met while the memtable is
//! read-locked wakes the background thread (its lock); no writer of the
//! memtable waits for the background lock.

use super::Config;
use super::Counters;
use super::Durability;
use super::db::Db;
use super::health::On;
use super::line::Line;
use super::memtable::{self, Memory};
use super::record_log::LogWriter;
use super::tables;
use super::{open, tables::META_LOG_STATE};
use crate::error::{Error, Result};
use crate::record::Record;
use crate::sync::atomic::AtomicBool;
use crate::sync::{Arc, Mutex, MutexGuard, TryLockError};
use ::redb::StorageBackend;
use std::path::Path;

/// What the callers and the background thread share.
pub(super) struct Shared {
    pub(super) line: Line,
    pub(super) log: Log,
    pub(super) memory: Memory,
    pub(super) db: Db,
    pub(super) stats: Counters,
    /// `Some(path)` for a store opened read-only: every write is refused
    /// ([`Error::ReadOnly`]) before it reaches the commit path.
    pub(super) read_only: Option<String>,
}

/// The record log and the commit lock, and what relaxed durability needs
/// to sync the log later.
pub(super) struct Log {
    /// The commit lock: the leader holds it for a group, a direct
    /// transaction for its transaction.
    core: Mutex<Core>,
    /// Relaxed durability: frames written since the last sync.
    pub(super) unsynced: AtomicBool,
    /// The log file, for the background sync.
    pub(super) file: Arc<dyn StorageBackend>,
    pub(super) durability: Durability,
}

/// What only the holder of the commit lock touches.
#[derive(Debug)]
pub(super) struct Core {
    pub(super) writer: LogWriter,
    /// The largest fencing token handed out.
    pub(super) token_hwm: u64,
}

impl Log {
    // A panic while leading poisons the store, so a poisoned lock is taken
    // as it is (as every lock of the store's).
    pub(super) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn try_lock(&self) -> Option<MutexGuard<'_, Core>> {
        match self.core.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }
}

impl Shared {
    pub(super) fn new(opened: open::Opened, config: &Config, path: Option<&Path>) -> Arc<Shared> {
        Arc::new(Shared {
            line: Line::default(),
            log: Log {
                file: opened.wal.file(),
                core: Mutex::new(Core {
                    writer: opened.wal,
                    token_hwm: opened.token_hwm,
                }),
                unsynced: AtomicBool::new(false),
                durability: config.durability,
            },
            memory: Memory::new(config.checkpoint_interval),
            db: Db::new(opened.db, opened.source, opened.witness, config, path),
            stats: Counters::default(),
            read_only: config.read_only.then(|| {
                path.map_or_else(
                    || "<storage backend>".to_owned(),
                    |p| p.display().to_string(),
                )
            }),
        })
    }

    /// The latest state of `key_bytes`: the memtable, then redb (verified).
    pub(super) fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>> {
        if let Some(entry) = self.memory.read_mem().get(key_bytes) {
            return memtable::decode(key_bytes, entry);
        }
        // Counted after the memtable was read (db.rs).
        let seen = self.db.snapshot.count();
        self.db
            .read_tables(seen, |tables| tables.read(key_bytes))
            .and_then(|read| read)
            .map_err(|e| self.engine_failed("read", e))
    }

    /// An engine error met `during` an operation: an I/O error (after which
    /// redb refuses every use until reopened) poisons the store, so that it
    /// heals; a store already poisoned answers with its cause.
    pub(super) fn engine_failed(&self, during: &'static str, error: Error) -> Error {
        match error {
            Error::Io(_) if self.db.is_poisoned() => self.db.poisoned_error(),
            Error::Io(_) => self.fail(during, On::Store, error),
            other => other,
        }
    }

    /// Poisons the store with `error` (see [`Db::poison`]) and wakes the
    /// background thread, which heals (it may be asleep for long).
    pub(super) fn fail(&self, during: &'static str, on: On, error: Error) -> Error {
        let error = self.db.poison(during, on, error);
        self.memory.wake_background();
        error
    }

    /// Makes everything in memory durable in redb and retires the log.
    pub(super) fn flush(&self) -> Result<()> {
        self.flush_locked(&mut self.log.lock())
    }

    /// The last commit of a clean stop: memory goes into the file durably,
    /// and the same commit marks the log closed ([`META_LOG_STATE`]), so
    /// the next open needs nothing from it. A read-only view writes nothing.
    pub(super) fn close(&self) -> Result<()> {
        self.direct(|t, _| t.set_meta(META_LOG_STATE, &[tables::LOG_CLOSED]))
    }

    /// [`flush`](Self::flush) with the commit lock held.
    pub(super) fn flush_locked(&self, core: &mut Core) -> Result<()> {
        if !self.memory.read_mem().is_empty() || core.writer.is_dirty() {
            self.direct_locked(core, true, |_, _| Ok::<_, Error>(()))?;
        }
        Ok(())
    }
}
