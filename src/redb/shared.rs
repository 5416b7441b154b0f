//! [`Shared`]: what the callers and the background thread share (engine,
//! memtable, line, commit lock, the background flags), the read path
//! (memtable, then redb), flush and clean close, and poisoning.

use super::config::Config;
use super::health::{Health, On};
use super::line::{MAX_WRITE_BATCH, Queue};
use super::memtable::Mem;
use super::record_log::Wal;
use super::snapshot::Snapshot;
use super::stats::Counters;
use super::tables::Source;
use super::{Durability, RecoveryPolicy, health, open, source, tables, witness};
use crate::error::{Cause, Error, Result};
use crate::record::Record;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::{
    Arc, Condvar, Instant, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
    TryLockError,
};
use crate::time::Clock;
use ::redb::{Database, StorageBackend};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The background thread's flags (guarded by `Shared::bg`).
#[derive(Debug, Default)]
pub(super) struct Bg {
    pub(super) shutdown: bool,
}

/// The engine behind the store's database lock.
pub(super) struct Engine {
    pub(super) db: Database,
    pub(super) usable: Usable,
}

/// What the engine in [`Engine::db`] may be used for, from least to most.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Usable {
    /// While a heal cannot open the files at all: an empty stand-in, and
    /// reads fail with the cause instead of reading it.
    No,
    /// While a heal cannot open the files for writing: a view of them that
    /// writes nothing (`overlay::open_view_of`). Reads go on; a write
    /// transaction is refused with the cause (it would reach memory only).
    ForReads,
    /// The store's files, opened for writing.
    Yes,
}

/// A read lock on a usable engine (see [`Shared::read_db`]).
pub(super) struct DbRead<'a>(RwLockReadGuard<'a, Engine>);

impl std::ops::Deref for DbRead<'_> {
    type Target = Database;
    fn deref(&self) -> &Database {
        &self.0.db
    }
}

/// What the callers and the background thread share.
pub(super) struct Shared {
    /// The read path's kept redb snapshot and the count of redb commits
    /// (snapshot.rs); declared before `db` so that it is dropped first.
    pub(super) snapshot: Snapshot,
    /// A read lock for every transaction; [`RedbStore::compact`](super::RedbStore::compact) and a
    /// heal take the write lock, which is how they wait out every live
    /// transaction.
    pub(super) db: RwLock<Engine>,
    /// Poisoned or not, and why (health.rs).
    pub(super) health: health::HealthCell,
    /// Where a heal reopens the engine from (heal.rs).
    pub(super) source: source::Source,
    /// Sees every I/O error of the engine's storage (witness.rs).
    pub(super) witness: Arc<witness::IoWitness>,
    /// What the last failed attempt to heal saw.
    pub(super) attempts: Mutex<health::Attempts>,
    /// The options a heal reopens with (no lease ended, nothing verified).
    pub(super) heal_config: Config,
    /// The store's clock (when a failure happened).
    pub(super) clock: Arc<dyn Clock>,
    /// The store file, in errors (`None` for a storage backend).
    pub(super) path: Option<PathBuf>,
    pub(super) stats: Counters,
    /// The active and frozen memtables (see memtable.rs for the read order).
    pub(super) mem: RwLock<Mem>,
    /// The line of callers (commit.rs).
    pub(super) queue: Mutex<Queue>,
    /// Signalled when a leader takes a group out of a full line.
    pub(super) queue_room: Condvar,
    /// Wakes the committer thread (native.rs) when it is given the leader
    /// role, or the line closes.
    pub(super) committer_cv: Condvar,
    /// The commit lock: the leader holds it for a group, a direct
    /// transaction for its transaction.
    pub(super) core: Mutex<Core>,
    /// The background thread's flags; `bg_cv` wakes it (a frozen memtable,
    /// shutdown) and wakes those waiting for a checkpoint to finish.
    pub(super) bg: Mutex<Bg>,
    pub(super) bg_cv: Condvar,
    /// Relaxed durability: frames written since the last sync.
    pub(super) log_unsynced: AtomicBool,
    /// The log file, for the background sync.
    pub(super) log_file: Arc<dyn StorageBackend>,
    pub(super) durability: Durability,
    pub(super) checkpoint_interval: Duration,
    pub(super) max_batch: usize,
    /// When the active memtable began (a freeze, a direct transaction, or
    /// the first record after either), in ms since `started`.
    pub(super) started: Instant,
    pub(super) memtable_since_ms: AtomicU64,
    /// `Some(path)` for a store opened read-only: every write is refused
    /// ([`Error::ReadOnly`]) before it reaches the commit path.
    pub(super) read_only: Option<String>,
}

/// What only the leader (or a direct transaction) touches: held for the
/// whole of a group's commit. Lock order: the queue is never held while
/// taking this; this, then the memtable, then the database.
#[derive(Debug)]
pub(super) struct Core {
    pub(super) wal: Wal,
    /// The largest fencing token handed out.
    pub(super) token_hwm: u64,
}

impl Shared {
    pub(super) fn new(opened: open::Opened, config: &Config, path: Option<&Path>) -> Arc<Shared> {
        let log_file = opened.wal.file();
        Arc::new(Shared {
            snapshot: Snapshot::default(),
            db: RwLock::new(Engine {
                db: opened.db,
                usable: Usable::Yes,
            }),
            health: health::HealthCell::default(),
            source: opened.source,
            witness: opened.witness,
            attempts: Mutex::new(health::Attempts::default()),
            heal_config: Config {
                recovery: RecoveryPolicy::WaitForLease,
                verify_on_open: false,
                accept_loss: false,
                sweeper: None,
                ..config.clone()
            },
            clock: Arc::clone(&config.clock),
            path: path.map(Path::to_path_buf),
            stats: Counters::default(),
            mem: RwLock::new(Mem::default()),
            queue: Mutex::new(Queue::default()),
            queue_room: Condvar::new(),
            committer_cv: Condvar::new(),
            core: Mutex::new(Core {
                wal: opened.wal,
                token_hwm: opened.token_hwm,
            }),
            bg: Mutex::new(Bg::default()),
            bg_cv: Condvar::new(),
            log_unsynced: AtomicBool::new(false),
            log_file,
            durability: config.durability,
            checkpoint_interval: config.checkpoint_interval,
            max_batch: MAX_WRITE_BATCH,
            started: Instant::now(),
            memtable_since_ms: AtomicU64::new(0),
            read_only: config.read_only.then(|| {
                path.map_or_else(
                    || "<storage backend>".to_owned(),
                    |p| p.display().to_string(),
                )
            }),
        })
    }

    // None of these locks guards an invariant a panic could leave half-done
    // (a panic while leading poisons the store), so a poisoned lock is
    // taken as it is.
    /// The engine for a transaction, or the cause when a heal could not
    /// reopen it yet.
    pub(super) fn read_db(&self) -> Result<DbRead<'_>> {
        self.db_for(Usable::ForReads)
    }
    /// The engine for a write transaction: the files opened for writing,
    /// or the cause.
    pub(super) fn write_ready_db(&self) -> Result<DbRead<'_>> {
        self.db_for(Usable::Yes)
    }
    pub(super) fn db_for(&self, need: Usable) -> Result<DbRead<'_>> {
        let engine = self.db.read().unwrap_or_else(|p| p.into_inner());
        if engine.usable < need {
            return Err(self.poisoned_error());
        }
        Ok(DbRead(engine))
    }
    /// The engine for exclusive use (a heal, a compaction, the verifier's
    /// in-place check): every transaction waited out, the kept read
    /// snapshot dropped and the use counted as a commit (redb compacts and
    /// checks only with no live read, and a heal may change the files).
    pub(super) fn write_db(&self) -> RwLockWriteGuard<'_, Engine> {
        let engine = self.db.write().unwrap_or_else(|p| p.into_inner());
        self.snapshot.committed();
        engine
    }
    pub(super) fn read_mem(&self) -> RwLockReadGuard<'_, Mem> {
        self.mem.read().unwrap_or_else(|p| p.into_inner())
    }
    pub(super) fn write_mem(&self) -> RwLockWriteGuard<'_, Mem> {
        self.mem.write().unwrap_or_else(|p| p.into_inner())
    }
    pub(super) fn lock_core(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub(super) fn try_lock_core(&self) -> Option<MutexGuard<'_, Core>> {
        match self.core.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }
    pub(super) fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub(super) fn lock_bg(&self) -> MutexGuard<'_, Bg> {
        self.bg.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the background thread (a memtable was frozen, or shutdown).
    pub(super) fn wake_background(&self) {
        let _bg = self.lock_bg();
        self.bg_cv.notify_all();
    }

    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The active memtable begins now (a freeze, a direct transaction, or
    /// its first record).
    pub(super) fn start_memtable_clock(&self) {
        self.memtable_since_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }

    /// How long until the active memtable is old enough to checkpoint.
    pub(super) fn checkpoint_left(&self) -> Duration {
        let since = self
            .now_ms()
            .saturating_sub(self.memtable_since_ms.load(Ordering::Relaxed));
        self.checkpoint_interval
            .saturating_sub(Duration::from_millis(since))
    }

    pub(super) fn checkpoint_due(&self) -> bool {
        self.checkpoint_left().is_zero()
    }

    /// The latest state of `key_bytes`: the memtable, then redb (verified).
    pub(super) fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>> {
        self.read_counted(key_bytes).map(|(record, _)| record)
    }

    /// [`read`](Self::read), and when redb answered, the commit count it
    /// answered under (a `begin`'s [`absent_at`](super::line::Op::Begin)).
    pub(super) fn read_counted(&self, key_bytes: &[u8]) -> Result<(Option<Record>, Option<u64>)> {
        {
            let mem = self.read_mem();
            if let Some(entry) = mem.get(key_bytes) {
                return Ok((super::memtable::decode(key_bytes, entry)?, None));
            }
        }
        // Counted after the memtable was read: see snapshot.rs.
        let seen = self.snapshot.count();
        let db = self.read_db()?;
        let record = self
            .snapshot
            .read(&db, seen, |tables| tables.read(key_bytes))
            .and_then(|read| read)
            .map_err(|e| self.engine_failed("read", e))?;
        Ok((record, Some(seen)))
    }

    /// An engine error met `during` an operation: an I/O error (redb then
    /// refuses every later use until it is reopened) poisons the store, so
    /// that it heals; a store already poisoned answers with its cause.
    pub(super) fn engine_failed(&self, during: &'static str, error: Error) -> Error {
        match error {
            Error::Io(_) if self.is_poisoned() => self.poisoned_error(),
            Error::Io(_) => self.fail(during, health::On::Store, error),
            other => other,
        }
    }

    /// Makes everything in memory durable in redb and retires the log.
    pub(super) fn flush(&self) -> Result<()> {
        let mut core = self.lock_core();
        self.flush_locked(&mut core)
    }

    /// The last commit of a clean stop: memory goes into the file durably,
    /// and the same commit marks the log closed
    /// ([`META_WAL_STATE`](tables::META_WAL_STATE)), so the next open needs
    /// nothing from it. A read-only view writes nothing.
    pub(super) fn close(&self) -> Result<()> {
        self.check_writable()?;
        let mut core = self.lock_core();
        self.direct_locked(&mut core, true, |t, _| {
            t.set_meta(tables::META_WAL_STATE, &[tables::WAL_CLOSED])
        })
    }

    /// [`flush`](Self::flush) with the commit lock held.
    pub(super) fn flush_locked(&self, core: &mut Core) -> Result<()> {
        let dirty = !self.read_mem().is_empty() || core.wal.is_dirty();
        if dirty {
            self.direct_locked(core, true, |_, _| Ok::<_, Error>(()))?;
        }
        Ok(())
    }
}

impl Shared {
    /// Whether writes are refused.
    pub(super) fn is_poisoned(&self) -> bool {
        self.health.is_poisoned()
    }

    /// Poisons with `error` (met `during` an operation on `on`; the first
    /// failure stays the cause) and returns it, an I/O error keeping its
    /// kind and gaining the file and the operation.
    pub(super) fn fail(&self, during: &'static str, on: On, error: Error) -> Error {
        let error = self.named(error);
        let path = self.file_name(on);
        let cause = Cause::new(during, Some(&path), &error);
        if self.health.poison(&cause, self.clock.now()) {
            crate::observability::poisoned("redb", &cause);
            crate::observability::health("redb", if cause.heals() { 1 } else { 2 });
        }
        // The background thread heals; it may be asleep for long.
        self.wake_background();
        match error {
            Error::Io(e) => Error::Io(std::io::Error::new(e.kind(), cause.to_string())),
            other => other,
        }
    }

    /// `error`, or, when it is the engine's refusal after an earlier I/O
    /// error (which names none), the last I/O error the engine's storage
    /// returned: the cause, with its kind.
    pub(super) fn named(&self, error: Error) -> Error {
        if !super::errors::is_latched(&error) {
            return error;
        }
        self.witness.last().map_or(error, Error::Io)
    }

    /// The error a write gets while the store is poisoned.
    pub(super) fn poisoned_error(&self) -> Error {
        Error::Poisoned {
            cause: self.health.cause(),
        }
    }

    /// [`Err`] of [`poisoned_error`](Self::poisoned_error) while poisoned.
    /// The flag and the cause are set and cleared together under the
    /// cause's lock, so a write that races the end of a heal is either
    /// refused with the cause or let through, never refused without one.
    pub(super) fn check_healthy(&self) -> crate::error::Result<()> {
        self.health.refusal().map_or(Ok(()), Err)
    }

    /// Whether the background thread should try to heal: poisoned by a
    /// cause that may go away.
    pub(super) fn heals(&self) -> bool {
        self.is_poisoned() && self.health.cause().is_none_or(|c| c.heals())
    }

    /// The I/O kind of the failure being healed.
    pub(super) fn health_cause_kind(&self) -> Option<std::io::ErrorKind> {
        self.health.cause().and_then(|c| c.io_kind())
    }

    /// Writes are accepted again (the store healed).
    pub(super) fn healthy_again(&self) {
        if let Some(fault) = self.health.clear() {
            let since = fault.since.until(self.clock.now());
            crate::observability::healed("redb", &fault.cause, since);
            crate::observability::health("redb", 0);
        }
    }

    /// The store's health.
    pub(super) fn health(&self) -> Health {
        self.health.health()
    }

    fn file_name(&self, on: On) -> String {
        match (&self.path, on) {
            (Some(path), On::Store) => path.display().to_string(),
            (Some(path), On::Log) => super::record_log::wal_path(path).display().to_string(),
            (None, On::Store) => "<storage backend>".to_owned(),
            (None, On::Log) => "<log backend>".to_owned(),
        }
    }
}
