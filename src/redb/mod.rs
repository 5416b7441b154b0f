//! [`RedbStore`]: the durable on-disk store on redb 4.x (feature `redb`),
//! its builder, durability and recovery options, statistics and limits, and
//! the [`Inbox`] for message consumers.
//!
//! ```
//! use idemstore::redb::{Durability, RedbStore};
//! # let dir = tempfile::tempdir()?;
//! let store = RedbStore::builder()
//!     .durability(Durability::Immediate)   // the default: fsync before every answer
//!     .open(dir.path().join("orders.idem"))?;
//! assert_eq!(store.stats().commits, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # How it works
//!
//! The write path is an LSM front end with redb as the base table:
//!
//! ```text
//! caller ─► line ─► leader: decide (memtable → redb) ─► log frame + fdatasync ─► memtable
//!                                                             checkpointer ─► redb (durable)
//! ```
//!
//! - `commit.rs`: leader/follower group commit, the group's decisions,
//!   direct transactions (inbox, admin, compaction);
//! - `native.rs`: the native async entry (futures in the line, the
//!   committer thread that leads for them);
//! - `memtable.rs`: the records written since the last checkpoint;
//! - `record_log/`: the write-ahead log of records (two segments,
//!   4 KiB-aligned frames): `frame.rs` its bytes, `writer.rs` the appends,
//!   `reader.rs` the walk a replay makes;
//! - `checkpoint.rs`: the background thread that writes frozen memtables
//!   into redb;
//! - `open.rs`: creating (0600) and opening a file, refusing foreign,
//!   damaged and newer files, the recovery policy; `recovery.rs`: the
//!   log's recovery at an open and a heal (what is wrong with the log, the
//!   walk over its live frames, the replay's durable commit); `meta.rs`:
//!   the meta table's reads and writes (format version, store id, the
//!   log's recorded state);
//! - `page_log/`: the page log (`page_log`: redb's commits as frames in
//!   `<file>-pages`): `frame.rs` its frames and their replay, `backend.rs`
//!   the store file behind the log; and `overlay.rs`: a file read through
//!   in-memory pages (inspections, and a heal's view for reads);
//!   `page_images.rs`: the page images both keep;
//! - `health.rs`: poisoning, the cause and [`Health`]; `heal.rs`: the heal
//!   that reopens the engine (from `source.rs`); `witness.rs`: the last
//!   I/O error the engine met;
//! - `file.rs`: owner-only files, directory sync, locks, the redb header
//!   check;
//! - `loss.rs`: what an open that accepts loss gave up;
//! - `tables.rs`: the three tables and the record + index pair helpers;
//! - `errors.rs`: redb's errors as the one public [`Error`];
//! - `options.rs`: durability, recovery policy, the builder;
//! - `stats.rs`: the counters;
//! - `admin/`: operator access ([`admin`]: facts, scans, verify, evict,
//!   import, the export line format), for the `idemstore` binary and the
//!   testkit's crash checker;
//! - `inbox/`: the co-transactional inbox for message consumers (`batch.rs`:
//!   a batch of deliveries in one transaction, re-run without a failed one);
//! - this file: the public type, the read paths, the `Store` impl.

pub mod admin;
mod checkpoint;
mod commit;
mod errors;
mod file;
mod heal;
mod health;
mod inbox;
mod loss;
mod memtable;
mod meta;
mod native;
mod open;
mod options;
pub(crate) mod page_log;
mod record_log;
mod recovery;
#[cfg(all(test, shuttle))]
mod shuttle_tests;
mod source;
mod stats;
mod tables;
mod witness;

/// The redb crate the store is built on, for an [`Inbox`] handler's own
/// tables (`TableDefinition`, `ReadableTable`, `WriteTransaction`): the same
/// version as the store's, whatever the caller's own dependency says.
pub use ::redb as engine;
pub use health::{HEAL_BACKOFF_MAX, HEAL_BACKOFF_MIN, Health};
pub use inbox::{Delivery, Inbox, MAX_INBOX_BATCH, Message};
pub use loss::LossReport;
pub use memtable::MEMTABLE_BYTES;
use options::Config;
pub use options::{DEFAULT_CACHE_BYTES, Durability, RecoveryPolicy, RedbStoreBuilder};
pub use page_log::PAGE_LOG_BYTES;
pub use record_log::{CHECKPOINT_INTERVAL, FRAME_ALIGN, MIN_WAL_BYTES, WAL_BYTES};
use stats::Counters;
pub use stats::RedbStats;

use crate::codec;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, Record, check_durations};
use crate::response::Response;
use crate::store::{MAX_SWEEP_BATCH, Store, StoreFuture, ready};
use crate::sweeper::Sweeper;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::thread::{self, JoinHandle};
use crate::sync::{
    Arc, Condvar, Instant, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
    TryLockError,
};
use crate::time::{Clock, Timestamp};
use ::redb::{Database, ReadableDatabase, StorageBackend};
use commit::{Core, Op, Queue, Reply};
use errors::engine;
use memtable::Mem;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Requests that may wait in a store's line. A caller that finds it full
/// waits for room (back-pressure); nothing is ever dropped.
pub const WRITE_QUEUE_DEPTH: usize = 4_096;
/// Most requests a leader commits in one group (one log frame).
pub const MAX_WRITE_BATCH: usize = 1_024;

/// The background thread's flags (guarded by `Shared::bg`).
#[derive(Debug, Default)]
struct Bg {
    shutdown: bool,
}

/// The engine behind the store's database lock.
struct Engine {
    db: Database,
    usable: Usable,
}

/// What the engine in [`Engine::db`] may be used for, from least to most.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Usable {
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
struct DbRead<'a>(RwLockReadGuard<'a, Engine>);

impl std::ops::Deref for DbRead<'_> {
    type Target = Database;
    fn deref(&self) -> &Database {
        &self.0.db
    }
}

/// What the callers and the background thread share.
struct Shared {
    /// A read lock for every transaction; [`RedbStore::compact`] and a
    /// heal take the write lock, which is how they wait out every live
    /// transaction.
    db: RwLock<Engine>,
    /// Poisoned or not, and why (health.rs).
    health: health::HealthCell,
    /// Where a heal reopens the engine from (heal.rs).
    source: source::Source,
    /// Sees every I/O error of the engine's storage (witness.rs).
    witness: Arc<witness::IoWitness>,
    /// What the last failed attempt to heal saw.
    attempts: Mutex<heal::Attempts>,
    /// The options a heal reopens with (no lease ended, nothing verified).
    heal_config: Config,
    /// The store's clock (when a failure happened).
    clock: Arc<dyn Clock>,
    /// The store file, in errors (`None` for a storage backend).
    path: Option<PathBuf>,
    stats: Counters,
    /// The active and frozen memtables (see memtable.rs for the read order).
    mem: RwLock<Mem>,
    /// The line of callers (commit.rs).
    queue: Mutex<Queue>,
    /// Signalled when a leader takes a group out of a full line.
    queue_room: Condvar,
    /// Wakes the committer thread (native.rs) when it is given the leader
    /// role, or the line closes.
    committer_cv: Condvar,
    /// The commit lock: the leader holds it for a group, a direct
    /// transaction for its transaction.
    core: Mutex<Core>,
    /// The background thread's flags; `bg_cv` wakes it (a frozen memtable,
    /// shutdown) and wakes those waiting for a checkpoint to finish.
    bg: Mutex<Bg>,
    bg_cv: Condvar,
    /// Relaxed durability with the log: frames written since the last sync.
    log_unsynced: AtomicBool,
    /// The log file (`None` without a log), for the background sync.
    log_file: Option<Arc<dyn StorageBackend>>,
    durability: Durability,
    checkpoint_interval: Duration,
    max_batch: usize,
    /// When the active memtable began (a freeze, a direct transaction, or
    /// the first record after either), in ms since `started`.
    started: Instant,
    memtable_since_ms: AtomicU64,
    /// `Some(path)` for a store opened read-only: every write is refused
    /// ([`Error::ReadOnly`]) before it reaches the commit path.
    read_only: Option<String>,
}

impl Shared {
    fn new(opened: open::Opened, config: &Config, path: Option<&Path>) -> Arc<Shared> {
        let log_file = opened.wal.as_ref().map(record_log::Wal::file);
        Arc::new(Shared {
            db: RwLock::new(Engine {
                db: opened.db,
                usable: Usable::Yes,
            }),
            health: health::HealthCell::default(),
            source: opened.source,
            witness: opened.witness,
            attempts: Mutex::new(heal::Attempts::default()),
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
                unflushed: false,
                last_durable: Instant::now(),
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
    fn read_db(&self) -> Result<DbRead<'_>> {
        self.db_for(Usable::ForReads)
    }
    /// The engine for a write transaction: the files opened for writing,
    /// or the cause.
    fn write_ready_db(&self) -> Result<DbRead<'_>> {
        self.db_for(Usable::Yes)
    }
    fn db_for(&self, need: Usable) -> Result<DbRead<'_>> {
        let engine = self.db.read().unwrap_or_else(|p| p.into_inner());
        if engine.usable < need {
            return Err(self.poisoned_error());
        }
        Ok(DbRead(engine))
    }
    fn write_db(&self) -> RwLockWriteGuard<'_, Engine> {
        self.db.write().unwrap_or_else(|p| p.into_inner())
    }
    fn read_mem(&self) -> RwLockReadGuard<'_, Mem> {
        self.mem.read().unwrap_or_else(|p| p.into_inner())
    }
    fn write_mem(&self) -> RwLockWriteGuard<'_, Mem> {
        self.mem.write().unwrap_or_else(|p| p.into_inner())
    }
    fn lock_core(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn try_lock_core(&self) -> Option<MutexGuard<'_, Core>> {
        match self.core.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }
    fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn lock_bg(&self) -> MutexGuard<'_, Bg> {
        self.bg.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the background thread (a memtable was frozen, or shutdown).
    fn wake_background(&self) {
        let _bg = self.lock_bg();
        self.bg_cv.notify_all();
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The active memtable begins now (a freeze, a direct transaction, or
    /// its first record).
    fn start_memtable_clock(&self) {
        self.memtable_since_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }

    /// How long until the active memtable is old enough to checkpoint.
    fn checkpoint_left(&self) -> Duration {
        let since = self
            .now_ms()
            .saturating_sub(self.memtable_since_ms.load(Ordering::Relaxed));
        self.checkpoint_interval
            .saturating_sub(Duration::from_millis(since))
    }

    fn checkpoint_due(&self) -> bool {
        self.checkpoint_left().is_zero()
    }

    /// The latest state of `key_bytes`: the memtable, then redb (verified).
    fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>> {
        {
            let mem = self.read_mem();
            if let Some(entry) = mem.get(key_bytes) {
                return Ok(entry.clone());
            }
        }
        // Opened after the memtable was read: see memtable.rs.
        let db = self.read_db()?;
        (|| {
            let txn = db.begin_read().map_err(engine)?;
            let table = txn.open_table(tables::RECORDS).map_err(engine)?;
            match table.get(key_bytes).map_err(engine)? {
                Some(v) => Ok(Some(codec::decode_record(key_bytes, v.value())?)),
                None => Ok(None),
            }
        })()
        .map_err(|e| self.engine_failed("read", e))
    }

    /// An engine error met `during` an operation: an I/O error (redb then
    /// refuses every later use until it is reopened) poisons the store, so
    /// that it heals; a store already poisoned answers with its cause.
    fn engine_failed(&self, during: &'static str, error: Error) -> Error {
        match error {
            Error::Io(_) if self.is_poisoned() => self.poisoned_error(),
            Error::Io(_) => self.fail(during, health::On::Store, error),
            other => other,
        }
    }

    /// Makes everything in memory durable in redb and retires the log.
    fn flush(&self) -> Result<()> {
        let mut core = self.lock_core();
        self.flush_locked(&mut core)
    }

    /// The last commit of a clean stop: everything in memory goes into the
    /// file durably, and with a log the same commit marks it closed
    /// ([`META_WAL_STATE`](tables::META_WAL_STATE)), so the next open knows
    /// the log holds nothing it needs and may be missing.
    fn close(&self) -> Result<()> {
        let mut core = self.lock_core();
        if core.wal.is_none() {
            return self.flush_locked(&mut core);
        }
        self.direct_locked(&mut core, |txn, _| {
            let mut meta = txn.open_table(tables::META).map_err(engine)?;
            meta.insert(tables::META_WAL_STATE, [tables::WAL_CLOSED].as_slice())
                .map_err(engine)?;
            Ok::<_, Error>(())
        })
    }

    /// [`flush`](Self::flush) with the commit lock held.
    fn flush_locked(&self, core: &mut Core) -> Result<()> {
        let dirty = !self.read_mem().is_empty()
            || core.wal.as_ref().is_some_and(record_log::Wal::is_dirty)
            || core.unflushed;
        if dirty {
            self.direct_locked(core, |_, _| Ok::<_, Error>(()))?;
        }
        Ok(())
    }
}

/// The durable idempotency store on redb: one file, one process.
///
/// Writes join a line; the first caller in line commits the whole waiting
/// group with one write-ahead-log append and one `fdatasync` (leader/follower
/// group commit), so throughput grows with concurrency while every
/// acknowledged claim is durable. A background thread checkpoints what was
/// written into the store file. A `begin` whose answer writes nothing
/// (Replay, InFlight, Conflict) is answered on the read fast path without
/// joining the line. The native async entry ([`Store::begin_async`] and
/// friends, what `Guard::run_async` uses) joins the same line as a future
/// woken when its group is durable: no thread waits per request, and the
/// store's one committer thread leads when only futures are in line.
///
/// After a failed write (a full disk, an I/O error) the store is
/// poisoned: the call that hit it gets the I/O error, naming the file and
/// the operation, and every later write is [`Error::Poisoned`] with that
/// cause, while reads and replays go on. It heals by itself once the cause
/// is gone, reopening the engine and replaying the log as an open would,
/// with nothing lost; [`health`](Self::health) says which it is. See the module
/// source (`src/redb/mod.rs`) for the write path.
///
/// ```
/// use idemstore::{Begin, Fingerprint, Key, RedbStore, Response, Store, Timestamp};
/// use std::time::Duration;
///
/// # let dir = tempfile::tempdir()?;
/// let path = dir.path().join("orders.idem");
/// let key = Key::new("tenant-42", "order-1")?;
/// let fp = Fingerprint::of(b"sku=A&qty=1");
/// let (lease, retention) = (Duration::from_secs(30), Duration::from_secs(24 * 3600));
/// let now = Timestamp::from_millis(1_700_000_000_000);
/// {
///     let store = RedbStore::open(&path)?;
///     let Begin::Claimed(claim) = store.begin(&key, &fp, now, lease, retention)? else { panic!() };
///     store.complete(&key, &claim, &Response::new(201, "charged"), now, retention)?;
/// } // dropped: the file is closed
/// let store = RedbStore::open(&path)?;
/// assert_eq!(store.begin(&key, &fp, now, lease, retention)?, Begin::Replay(Response::new(201, "charged")));
/// # Ok::<(), idemstore::Error>(())
/// ```
pub struct RedbStore {
    shared: Arc<Shared>,
    /// The checkpointer (checkpoint.rs).
    background: Option<JoinHandle<()>>,
    /// The committer (native.rs); none for a read-only store.
    committer: Option<JoinHandle<()>>,
    sweeper: Option<Sweeper>,
    /// The builder's clock: read by recovery at open and the sweeper, and
    /// handed out by [`Store::clock`].
    clock: Arc<dyn Clock>,
    path: Option<PathBuf>,
    store_id: [u8; 16],
    max_body_bytes: usize,
    leases_expired_on_open: u64,
    frames_replayed_on_open: u64,
    /// What an open with `accept_loss` gave up, when it gave up anything.
    loss_report: Option<LossReport>,
}

impl std::fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedbStore")
            .field("path", &self.path)
            .field("poisoned", &self.is_poisoned())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl RedbStore {
    /// Opens (or creates) the store file at `path` with the default options.
    /// See [`RedbStoreBuilder::open`] for the errors.
    pub fn open(path: impl AsRef<Path>) -> Result<RedbStore> {
        RedbStore::builder().open(path)
    }

    /// Opens the existing store file at `path` for reading only: the
    /// operator's inspection (`idemstore get`, `list`, `stats`, `verify`,
    /// `export`), and a way to read a backup, a forensic copy or a file the
    /// caller may not write.
    ///
    /// No byte of the store file or its write-ahead log changes and no file
    /// is created: the file is opened read-only and read through a private
    /// in-memory overlay, so redb's recovery of an uncleanly closed file and
    /// the replay of the log's frames happen in memory. The view holds
    /// everything a writer's open would ([`RedbStats::frames_replayed_on_open`]
    /// says how many log frames that took) and ends no lease. Reads
    /// ([`Store::get`], [`admin`](Self::admin)'s facts, scans and verify)
    /// work; every write ([`Store::begin`] when it would claim,
    /// `complete`, `release`, `sweep_expired`, [`compact`](Self::compact),
    /// evict, import, an [`Inbox`]) is [`Error::ReadOnly`].
    ///
    /// While it is open it holds a shared lock on the file: a writer's open
    /// is [`Error::Locked`] meanwhile, and this open is [`Error::Locked`]
    /// while a writer holds the file (the message names the holder where
    /// the platform tells). Errors, all before anything is read into the
    /// view: a missing file is [`Error::Io`] (`NotFound`); an empty, foreign
    /// or damaged one, or a log an open would refuse, is [`Error::Corrupt`];
    /// a newer format is [`Error::UnsupportedFormat`].
    ///
    /// ```
    /// use idemstore::{Error, Fingerprint, Key, RedbStore, Store, Timestamp};
    /// use std::time::Duration;
    /// # let dir = tempfile::tempdir()?;
    /// let path = dir.path().join("orders.idem");
    /// let hour = Duration::from_secs(3600);
    /// let key = Key::new("t", "order-1")?;
    /// drop({
    ///     let store = RedbStore::open(&path)?;
    ///     store.begin(&key, &Fingerprint::of(b"x"), Timestamp::EPOCH, hour, hour)?;
    ///     store
    /// });
    /// let before = std::fs::read(&path)?;
    ///
    /// let view = RedbStore::open_read_only(&path)?;
    /// assert!(view.is_read_only());
    /// assert!(view.admin().get_raw(&key)?.is_some());
    /// let other = Key::new("t", "order-2")?;
    /// let refused = view.begin(&other, &Fingerprint::of(b"x"), Timestamp::EPOCH, hour, hour);
    /// assert!(matches!(refused, Err(Error::ReadOnly { .. })));
    /// drop(view);
    /// assert_eq!(std::fs::read(&path)?, before, "not a byte changed");
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    ///
    /// [`Inbox`]: crate::redb::Inbox
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<RedbStore> {
        RedbStore::builder().open_read_only(path)
    }

    /// Whether this store was opened with [`open_read_only`](Self::open_read_only).
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let store = idemstore::RedbStore::open(dir.path().join("s.idem"))?;
    /// assert!(!store.is_read_only());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn is_read_only(&self) -> bool {
        self.shared.read_only.is_some()
    }

    /// Options: durability, cache size, response limit, recovery policy, sweeper.
    pub fn builder() -> RedbStoreBuilder {
        RedbStoreBuilder::default()
    }

    fn start(mut opened: open::Opened, config: Config, path: Option<PathBuf>) -> Result<RedbStore> {
        let store_id = opened.store_id;
        let leases_expired_on_open = opened.leases_expired;
        let frames_replayed_on_open = opened.frames_replayed;
        let mut loss = std::mem::take(&mut opened.loss);
        loss.frames_replayed = opened.frames_replayed;
        let loss_report = (!loss.is_empty()).then_some(loss);
        crate::observability::opened(
            path.as_deref(),
            frames_replayed_on_open,
            leases_expired_on_open,
            config.read_only,
        );
        let shared = Shared::new(opened, &config, path.as_deref());
        let background = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name("idemstore-redb-checkpointer".to_owned())
                .spawn(move || checkpoint::run(shared))
                .map_err(Error::Io)?
        };
        let committer = match &shared.read_only {
            Some(_) => None,
            None => {
                let leader = Arc::clone(&shared);
                let spawned = thread::Builder::new()
                    .name("idemstore-redb-committer".to_owned())
                    .spawn(move || leader.run_committer());
                match spawned {
                    Ok(handle) => Some(handle),
                    Err(e) => {
                        stop_background(&shared, Some(background));
                        return Err(Error::Io(e));
                    }
                }
            }
        };
        let mut store = RedbStore {
            shared,
            background: Some(background),
            committer,
            sweeper: None,
            clock: Arc::clone(&config.clock),
            path,
            store_id,
            max_body_bytes: config.max_body_bytes,
            leases_expired_on_open,
            frames_replayed_on_open,
            loss_report,
        };
        if let Some(sweep) = config.sweeper {
            // The sweeper holds the shared state, not the store: no cycle,
            // and dropping the store stops it first.
            let shared = Arc::clone(&store.shared);
            let sweeper = Sweeper::spawn_fn(
                "idemstore-redb-sweeper",
                config.clock,
                sweep,
                move |now, max| match shared.submit(Op::Sweep { now, max })? {
                    Reply::Swept(n) => Ok(n),
                    other => Err(unexpected(&other)),
                },
            )?;
            store.sweeper = Some(sweeper);
        }
        Ok(store)
    }

    /// The file this store was opened from (`None` for a storage backend).
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let path = dir.path().join("s.idem");
    /// let store = idemstore::RedbStore::open(&path)?;
    /// assert_eq!(store.path(), Some(path.as_path()));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// A number naming this store file for its life (16 random bytes
    /// written when it was created, read big-endian), e.g. to tell fencing
    /// tokens of two stores apart. The same type as
    /// [`SledStore::store_id`](crate::SledStore::store_id)'s.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let a = idemstore::RedbStore::open(dir.path().join("a.idem"))?;
    /// let b = idemstore::RedbStore::open(dir.path().join("b.idem"))?;
    /// assert_ne!(a.store_id(), b.store_id());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn store_id(&self) -> u128 {
        u128::from_be_bytes(self.store_id)
    }

    /// The background sweeper, when one was configured (to read its counters).
    ///
    /// ```
    /// use idemstore::{RedbStore, SweeperConfig};
    /// # let dir = tempfile::tempdir()?;
    /// let store = RedbStore::builder().sweeper(SweeperConfig::default()).open(dir.path().join("s.idem"))?;
    /// assert_eq!(store.sweeper().map(|s| s.swept()), Some(0));
    /// assert!(RedbStore::open(dir.path().join("t.idem"))?.sweeper().is_none());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn sweeper(&self) -> Option<&Sweeper> {
        self.sweeper.as_ref()
    }

    /// What this open gave up, when it was opened with
    /// [`accept_loss`](RedbStoreBuilder::accept_loss) and found damage;
    /// `None` when nothing was dropped.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let store = idemstore::RedbStore::open(dir.path().join("s.idem"))?;
    /// assert!(store.loss_report().is_none());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn loss_report(&self) -> Option<&LossReport> {
        self.loss_report.as_ref()
    }

    /// Group-commit counters since open.
    pub fn stats(&self) -> RedbStats {
        let c = &self.shared.stats;
        RedbStats {
            requests: c.requests.load(Ordering::Relaxed),
            batches: c.batches.load(Ordering::Relaxed),
            commits: c.commits.load(Ordering::Relaxed),
            durable_commits: c.durable_commits.load(Ordering::Relaxed),
            logged_commits: c.logged_commits.load(Ordering::Relaxed),
            frames_replayed_on_open: self.frames_replayed_on_open,
            checkpoints: c.checkpoints.load(Ordering::Relaxed),
            largest_batch: c.largest_batch.load(Ordering::Relaxed),
            fast_replays: c.fast_replays.load(Ordering::Relaxed),
            fast_refusals: c.fast_refusals.load(Ordering::Relaxed),
            swept: c.swept.load(Ordering::Relaxed),
            leases_expired_on_open: self.leases_expired_on_open,
        }
    }

    /// True after a failed write, until the store has healed: writes are
    /// refused meanwhile ([`Error::Poisoned`], with the cause). See
    /// [`health`](Self::health).
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// assert!(!idemstore::RedbStore::open(dir.path().join("s.idem"))?.is_poisoned());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn is_poisoned(&self) -> bool {
        self.shared.is_poisoned()
    }

    /// Whether the store writes: [`Health::Healthy`]; or
    /// [`Health::Degraded`] after a failed write, with the cause and when
    /// it happened, while it heals by itself (reads and replays go on,
    /// writes are refused); or [`Health::Failed`] when it found damage that
    /// needs an operator. `docs/operations.md` ("Disk full and I/O
    /// errors") says what to do in each.
    ///
    /// ```
    /// use idemstore::redb::Health;
    /// # let dir = tempfile::tempdir()?;
    /// let store = idemstore::RedbStore::open(dir.path().join("s.idem"))?;
    /// assert!(matches!(store.health(), Health::Healthy));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn health(&self) -> Health {
        self.shared.health()
    }

    /// Reclaims free space in the file (after sweeps), returning whether
    /// anything was moved.
    ///
    /// It first checkpoints what the memtable holds. redb compacts only
    /// with no live transaction, so this holds the commit lock and takes
    /// the store's database lock exclusively: it waits for the group being
    /// committed and for every read in progress, and until it returns no
    /// group commits (queued writes wait, back-pressure applies) and reads
    /// of the store file wait. Run it at a quiet time; it can take as long as
    /// rewriting the live data.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let store = idemstore::RedbStore::open(dir.path().join("s.idem"))?;
    /// store.compact()?;
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn compact(&self) -> Result<bool> {
        self.shared.check_writable()?;
        self.shared.check_healthy()?;
        let mut core = self.shared.lock_core();
        // Compaction moves pages of the durable state only: make everything
        // in memory part of it first (and retire the log).
        self.shared.flush_locked(&mut core)?;
        let mut engine = self.shared.write_db();
        if engine.usable != Usable::Yes {
            return Err(self.shared.poisoned_error());
        }
        engine
            .db
            .compact()
            .map_err(|e| self.shared.engine_failed("compaction", errors::engine(e)))
    }

    /// The read fast path. Answers `begin` without joining the line when
    /// the answer writes nothing (Replay, InFlight, Conflict): the same
    /// state machine decides, on the latest state (memtable, then redb),
    /// and only a claim goes through a group. What the memtable or redb
    /// shows is durable, so the answer is the one a leader would give.
    fn fast_begin(
        &self,
        key_bytes: &[u8],
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Option<Begin>> {
        let existing = self.shared.read(key_bytes)?;
        if existing.is_none() {
            return Ok(None);
        }
        // A claim needs a token and a write: that is the leader's. The
        // token handed to the state machine here is never stored.
        let step = logic::begin(existing, fingerprint, now, lease, retention, || Ok(0))?;
        if step.write.is_some() {
            return Ok(None);
        }
        let counter = match step.answer {
            Begin::Replay(_) => &self.shared.stats.fast_replays,
            _ => &self.shared.stats.fast_refusals,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(Some(step.answer))
    }
}

/// Stops the checkpointer and waits for it (it finishes a checkpoint in progress).
fn stop_background(shared: &Shared, background: Option<JoinHandle<()>>) {
    {
        let mut bg = shared.lock_bg();
        bg.shutdown = true;
        shared.bg_cv.notify_all();
    }
    if let Some(background) = background {
        let _ = background.join();
    }
}

/// What `begin` does next: answered on the fast path, or a request for the line.
enum Next {
    Answered(Begin),
    Queue(Op),
}

fn begun(reply: Reply) -> Result<Begin> {
    match reply {
        Reply::Begin(answer) => Ok(answer),
        other => Err(unexpected(&other)),
    }
}

fn done(reply: Reply) -> Result<()> {
    match reply {
        Reply::Done => Ok(()),
        other => Err(unexpected(&other)),
    }
}

fn unexpected(reply: &Reply) -> Error {
    Error::backend(format!(
        "the commit path answered with the wrong kind of reply: {reply:?}"
    ))
}

impl Drop for RedbStore {
    fn drop(&mut self) {
        // The sweeper first (it submits writes), then the checkpointer (it
        // finishes a checkpoint in progress), then everything still in
        // memory goes into redb durably, so a clean stop leaves nothing to
        // replay, and the file is closed (its lock released) when drop
        // returns.
        drop(self.sweeper.take());
        // Futures may outlive the store (they hold the shared state): the
        // committer answers what is in line before it stops; it may need
        // the checkpointer, so it goes first.
        self.shared.close_line();
        if let Some(committer) = self.committer.take() {
            let _ = committer.join();
        }
        stop_background(&self.shared, self.background.take());
        if !self.is_poisoned() {
            // A failure is recorded (poisoned, with its cause) by the commit.
            let _ = self.shared.close();
        }
    }
}

impl RedbStore {
    /// `begin` up to the line: the checks, then the fast path.
    fn prepare_begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Next> {
        check_durations(lease, retention)?;
        let key_bytes = codec::encode_key(key);
        if let Some(answer) = self.fast_begin(&key_bytes, fingerprint, now, lease, retention)? {
            return Ok(Next::Answered(answer));
        }
        Ok(Next::Queue(Op::Begin {
            key: key_bytes,
            fingerprint: *fingerprint,
            now,
            lease,
            retention,
        }))
    }

    fn complete_op(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<Op> {
        logic::check_response(response, self.max_body_bytes)?;
        Ok(Op::Complete {
            key: codec::encode_key(key),
            claim: claim.clone(),
            response: response.clone(),
            now,
            retention,
        })
    }

    fn release_op(key: &Key, claim: &Claim) -> Op {
        Op::Release {
            key: codec::encode_key(key),
            claim: claim.clone(),
        }
    }

    /// `op` through the line as a future mapped by `answer`; refusals
    /// before the line are a ready error.
    fn queue_async<'a, T: Send + 'a>(
        &self,
        op: Result<Op>,
        answer: fn(Reply) -> Result<T>,
    ) -> StoreFuture<'a, T> {
        match op.and_then(|op| self.shared.submit_async(op)) {
            Ok(submitted) => Box::pin(async move { answer(submitted.await?) }),
            Err(refused) => ready(Err(refused)),
        }
    }
}

impl Store for RedbStore {
    fn begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        match self.prepare_begin(key, fingerprint, now, lease, retention)? {
            Next::Answered(answer) => Ok(answer),
            Next::Queue(op) => begun(self.shared.submit(op)?),
        }
    }

    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        let op = self.complete_op(key, claim, response, now, retention)?;
        done(self.shared.submit(op)?)
    }

    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        done(self.shared.submit(RedbStore::release_op(key, claim))?)
    }

    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        Ok(logic::visible(
            self.shared.read(&codec::encode_key(key))?,
            now,
        ))
    }

    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        let max = max.min(MAX_SWEEP_BATCH);
        if max == 0 {
            return Ok(0);
        }
        match self.shared.submit(Op::Sweep { now, max })? {
            Reply::Swept(n) => Ok(n),
            other => Err(unexpected(&other)),
        }
    }

    fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.clock)
    }

    /// The fast path (Replay, InFlight, Conflict from memory or a redb
    /// read) answers at once; a claim joins the commit line and the future
    /// completes when its group is durable, with no thread waiting for it.
    /// Dropped before it completes, it leaves no claim: see
    /// [Native async](Store#native-async).
    fn begin_async<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Option<StoreFuture<'a, Begin>> {
        Some(
            match self.prepare_begin(key, fingerprint, now, lease, retention) {
                Ok(Next::Answered(answer)) => ready(Ok(answer)),
                Ok(Next::Queue(op)) => self.queue_async(Ok(op), begun),
                Err(refused) => ready(Err(refused)),
            },
        )
    }

    /// Joins the commit line; completes when the DONE record is durable.
    fn complete_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        response: &'a Response,
        now: Timestamp,
        retention: Duration,
    ) -> Option<StoreFuture<'a, ()>> {
        let op = self.complete_op(key, claim, response, now, retention);
        Some(self.queue_async(op, done))
    }

    /// Joins the commit line; completes when the release is durable.
    fn release_async<'a>(&'a self, key: &'a Key, claim: &'a Claim) -> Option<StoreFuture<'a, ()>> {
        Some(self.queue_async(Ok(RedbStore::release_op(key, claim)), done))
    }
}
