//! [`RedbStore`]: the durable on-disk store on redb 4.x (feature `redb`).
//!
//! - `open.rs`: creating (0600) and opening a file, refusing foreign,
//!   damaged and newer files, the meta table, the recovery policy;
//! - `tables.rs`: the three tables and the record + index pair helpers;
//! - `writer.rs`: the group-commit writer thread;
//! - `wal.rs`: the write-ahead log that makes a batch durable with one append;
//! - `options.rs`: durability, recovery policy, the builder;
//! - `stats.rs`: the group-commit counters;
//! - `inspect.rs` (feature `cli`): operator access for the `idemstore` binary;
//! - `inbox.rs`: the co-transactional inbox for message consumers;
//! - this file: the public type, the read paths, the `Store` impl.

mod errors;
mod inbox;
#[cfg(feature = "cli")]
pub(crate) mod inspect;
mod open;
mod options;
mod stats;
mod tables;
mod wal;
mod writer;

pub use inbox::{Delivery, Inbox};
use options::Config;
pub use options::{DEFAULT_CACHE_BYTES, Durability, RecoveryPolicy, RedbStoreBuilder};
use stats::Counters;
pub use stats::RedbStats;
pub use wal::{CHECKPOINT_INTERVAL, MIN_WAL_BYTES, WAL_BYTES};

use crate::codec;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, Record, check_durations};
use crate::response::Response;
use crate::store::{MAX_SWEEP_BATCH, Store};
use crate::sweeper::Sweeper;
use crate::time::Timestamp;
use ::redb::{Database, ReadableDatabase};
use errors::engine;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use wal::Wal;
use writer::{Msg, Op, Reply, Writer};

/// Requests that may wait in a store's write queue. A caller that finds it
/// full waits for room (back-pressure); nothing is ever dropped.
pub const WRITE_QUEUE_DEPTH: usize = 4_096;
/// Most requests the writer applies in one transaction (one commit).
pub const MAX_WRITE_BATCH: usize = 1_024;

/// What the callers and the writer thread share.
struct Shared {
    /// A read lock for every transaction (the writer's batches and the read
    /// paths); [`RedbStore::compact`] takes the write lock, which is how it
    /// pauses the writer and waits out every live transaction.
    db: RwLock<Database>,
    poisoned: AtomicBool,
    stats: Counters,
    /// The write-ahead log; `None` when every batch commits durably (a
    /// store opened over a bare storage backend).
    wal: Mutex<Option<Wal>>,
}

impl Shared {
    fn read_db(&self) -> RwLockReadGuard<'_, Database> {
        // The lock guards no invariant of ours (redb is transactional), so a
        // panic elsewhere while it was held leaves nothing half-done.
        self.db.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The write-ahead log. Every write transaction holds this from before
    /// `begin_write` until after its commit (lock order: this, then `db`),
    /// so a frame and the commit it stands for are never split by another
    /// transaction. A panic while held poisons the store (the writer's
    /// guard), so the state inside is never used half-updated.
    fn lock_wal(&self) -> MutexGuard<'_, Option<Wal>> {
        self.wal.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Commits a write transaction made outside the writer (inbox, CLI,
    /// compaction) durably. When the log holds frames, the commit also
    /// retires them (a new epoch): replaying them later over this
    /// transaction's writes would undo those. A failed commit poisons the
    /// store. `wal` is the guard taken before the transaction began.
    fn direct_commit(
        &self,
        wal: &mut Option<Wal>,
        mut txn: ::redb::WriteTransaction,
    ) -> Result<()> {
        let poison = |e: Error| {
            self.poisoned.store(true, Ordering::SeqCst);
            e
        };
        txn.set_durability(::redb::Durability::Immediate)
            .map_err(engine)?;
        let retire = wal.as_ref().is_some_and(Wal::is_dirty);
        if retire && let Some(w) = wal.as_ref() {
            w.stamp(&txn)?;
        }
        txn.commit().map_err(|e| poison(engine(e)))?;
        if retire && let Some(w) = wal.as_mut() {
            w.checkpointed();
        }
        self.stats.commits.fetch_add(1, Ordering::Relaxed);
        self.stats.durable_commits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The durable idempotency store on redb: one file, one process.
///
/// Writes go through one writer thread per store that commits whatever is
/// queued in one transaction and one fsync (group commit), so throughput
/// grows with concurrency while every acknowledged claim is durable. A
/// `begin` whose answer writes nothing (Replay, InFlight, Conflict) is
/// answered from a read transaction without the writer. After a failed commit the
/// store is poisoned: every later write is [`Error::Poisoned`] until it is
/// reopened.
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
    tx: SyncSender<Msg>,
    writer: Option<JoinHandle<()>>,
    // Mutex only to make the store Sync (a Sweeper holds an mpsc receiver).
    sweeper: Option<Sweeper>,
    path: Option<PathBuf>,
    store_id: [u8; 16],
    max_body_bytes: usize,
    leases_expired_on_open: u64,
    frames_replayed_on_open: u64,
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

    /// Options: durability, cache size, response limit, recovery policy, sweeper.
    pub fn builder() -> RedbStoreBuilder {
        RedbStoreBuilder::default()
    }

    fn start(opened: open::Opened, config: Config, path: Option<PathBuf>) -> Result<RedbStore> {
        let shared = Arc::new(Shared {
            db: RwLock::new(opened.db),
            poisoned: AtomicBool::new(false),
            stats: Counters::default(),
            wal: Mutex::new(opened.wal),
        });
        let (tx, rx) = mpsc::sync_channel(WRITE_QUEUE_DEPTH);
        let writer = Writer {
            shared: Arc::clone(&shared),
            rx,
            token_hwm: opened.token_hwm,
            durability: config.durability,
            max_batch: MAX_WRITE_BATCH,
            unflushed: false,
            last_durable: Instant::now(),
            replier: None,
        };
        let writer = std::thread::Builder::new()
            .name("idemstore-redb-writer".to_owned())
            .spawn(move || writer.run())
            .map_err(Error::Io)?;
        let mut store = RedbStore {
            shared,
            tx,
            writer: Some(writer),
            sweeper: None,
            path,
            store_id: opened.store_id,
            max_body_bytes: config.max_body_bytes,
            leases_expired_on_open: opened.leases_expired,
            frames_replayed_on_open: opened.frames_replayed,
        };
        if let Some(sweep) = config.sweeper {
            // The sweeper holds a queue sender, not the store: no cycle, and
            // dropping the store stops it before the writer.
            let tx = store.tx.clone();
            let sweeper = Sweeper::spawn_fn(
                "idemstore-redb-sweeper",
                config.clock,
                sweep,
                move |now, max| match submit(&tx, Op::Sweep { now, max })? {
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

    /// 16 bytes naming this store file for its life (written when it was
    /// created), e.g. to tell fencing tokens of two stores apart.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let a = idemstore::RedbStore::open(dir.path().join("a.idem"))?;
    /// let b = idemstore::RedbStore::open(dir.path().join("b.idem"))?;
    /// assert_ne!(a.store_id(), b.store_id());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn store_id(&self) -> [u8; 16] {
        self.store_id
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
            largest_batch: c.largest_batch.load(Ordering::Relaxed),
            fast_replays: c.fast_replays.load(Ordering::Relaxed),
            fast_refusals: c.fast_refusals.load(Ordering::Relaxed),
            swept: c.swept.load(Ordering::Relaxed),
            leases_expired_on_open: self.leases_expired_on_open,
        }
    }

    /// True after a failed commit: writes are refused until the store is reopened.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// assert!(!idemstore::RedbStore::open(dir.path().join("s.idem"))?.is_poisoned());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn is_poisoned(&self) -> bool {
        self.shared.poisoned.load(Ordering::SeqCst)
    }

    /// Reclaims free space in the file (after sweeps), returning whether
    /// anything was moved.
    ///
    /// redb compacts only with no live transaction, so this takes the
    /// store's database lock exclusively: it waits for the writer's current
    /// batch and for every read in progress, and until it returns the writer
    /// does not start a new batch (queued writes wait, back-pressure applies)
    /// and reads wait. Run it at a quiet time; it can take as long as
    /// rewriting the live data.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let store = idemstore::RedbStore::open(dir.path().join("s.idem"))?;
    /// store.compact()?;
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn compact(&self) -> Result<bool> {
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let mut wal = self.shared.lock_wal();
        let mut db = self.shared.db.write().unwrap_or_else(|p| p.into_inner());
        // Compaction moves pages of the durable state only: make every
        // logged batch part of it first (and retire the log).
        if wal.as_ref().is_some_and(Wal::is_dirty) {
            let txn = db.begin_write().map_err(engine)?;
            self.shared.direct_commit(&mut wal, txn)?;
        }
        db.compact().map_err(engine)
    }

    fn submit(&self, op: Op) -> Result<Reply> {
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        submit(&self.tx, op).map_err(|e| match e {
            Error::Closed if self.is_poisoned() => Error::Poisoned,
            other => other,
        })
    }

    /// The read fast path. Answers `begin` from a read transaction when the answer writes
    /// nothing (Replay, InFlight, Conflict): the same state machine decides,
    /// and only a claim goes through the writer. A committed record is what
    /// the writer would see too, so the answer is the one it would give.
    fn fast_begin(
        &self,
        key_bytes: &[u8],
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Option<Begin>> {
        let existing = self.read(key_bytes)?;
        if existing.is_none() {
            return Ok(None);
        }
        // A claim needs a token and a write: that is the writer's. The token
        // handed to the state machine here is never stored.
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

    /// The stored record (verified), from a read transaction.
    fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>> {
        let db = self.shared.read_db();
        let txn = db.begin_read().map_err(engine)?;
        let table = txn.open_table(tables::RECORDS).map_err(engine)?;
        match table.get(key_bytes).map_err(engine)? {
            Some(v) => Ok(Some(codec::decode_record(key_bytes, v.value())?)),
            None => Ok(None),
        }
    }
}

/// Queues `op` and waits for the writer's answer. A full queue blocks here.
fn submit(tx: &SyncSender<Msg>, op: Op) -> Result<Reply> {
    let (reply_tx, reply_rx) = mpsc::sync_channel(1);
    tx.send(Msg::Op(op, reply_tx)).map_err(|_| Error::Closed)?;
    reply_rx.recv().map_err(|_| Error::Closed)?
}

fn unexpected(reply: &Reply) -> Error {
    Error::backend(format!(
        "writer answered with the wrong kind of reply: {reply:?}"
    ))
}

impl Drop for RedbStore {
    fn drop(&mut self) {
        // Sweeper first (it feeds the writer), then the writer: it finishes
        // what is queued, makes it durable and exits, so the file is closed
        // (and its lock released) when drop returns.
        drop(self.sweeper.take());
        let _ = self.tx.send(Msg::Shutdown);
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
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
        check_durations(lease, retention)?;
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let key_bytes = codec::encode_key(key);
        if let Some(answer) = self.fast_begin(&key_bytes, fingerprint, now, lease, retention)? {
            return Ok(answer);
        }
        match self.submit(Op::Begin {
            key: key_bytes,
            fingerprint: *fingerprint,
            now,
            lease,
            retention,
        })? {
            Reply::Begin(answer) => Ok(answer),
            other => Err(unexpected(&other)),
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
        logic::check_response(response, self.max_body_bytes)?;
        match self.submit(Op::Complete {
            key: codec::encode_key(key),
            claim: claim.clone(),
            response: response.clone(),
            now,
            retention,
        })? {
            Reply::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        match self.submit(Op::Release {
            key: codec::encode_key(key),
            claim: claim.clone(),
        })? {
            Reply::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        Ok(logic::visible(self.read(&codec::encode_key(key))?, now))
    }

    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        let max = max.min(MAX_SWEEP_BATCH);
        if max == 0 {
            return Ok(0);
        }
        match self.submit(Op::Sweep { now, max })? {
            Reply::Swept(n) => Ok(n),
            other => Err(unexpected(&other)),
        }
    }
}
