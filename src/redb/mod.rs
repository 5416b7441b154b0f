//! [`RedbStore`]: the durable on-disk store on redb 4.x (feature `redb`).
//!
//! - `open.rs`: creating (0600) and opening a file, refusing foreign,
//!   damaged and newer files, the meta table, the recovery policy;
//! - `tables.rs`: the three tables and the record + index pair helpers;
//! - `writer.rs`: the group-commit writer thread;
//! - this file: the public type, its builder, and the read paths.

mod errors;
mod open;
mod tables;
mod writer;

use crate::codec;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, Record, State, check_durations};
use crate::response::{DEFAULT_MAX_BODY_BYTES, Response, check_body_limit};
use crate::store::{MAX_SWEEP_BATCH, Store};
use crate::sweeper::{Sweeper, SweeperConfig};
use crate::time::{Clock, SystemClock, Timestamp};
use ::redb::{Database, ReadableDatabase};
use errors::engine;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use writer::{Msg, Op, Reply, Writer};

/// Requests that may wait in a store's write queue. A caller that finds it
/// full waits for room (back-pressure); nothing is ever dropped.
pub const WRITE_QUEUE_DEPTH: usize = 4_096;
/// Most requests the writer applies in one transaction (one commit).
pub const MAX_WRITE_BATCH: usize = 1_024;
/// redb's page cache size unless [`RedbStoreBuilder::cache_bytes`] says otherwise.
pub const DEFAULT_CACHE_BYTES: usize = 64 * 1024 * 1024;

/// What survives a crash: the promise behind every acknowledged write.
///
/// ```
/// use idemstore::{Durability, RedbStore};
/// use std::time::Duration;
///
/// # let dir = tempfile::tempdir()?;
/// // The default: every acknowledged claim survives power loss.
/// assert_eq!(Durability::default(), Durability::Immediate);
/// // Chosen explicitly: at most 50 ms of acknowledged writes may be lost.
/// let store = RedbStore::builder()
///     .durability(Durability::Periodic { max_loss: Duration::from_millis(50) })
///     .open(dir.path().join("relaxed.idem"))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Durability {
    /// Every write batch is committed and fsynced before any caller in it is
    /// answered: an acknowledged claim or completion survives a process crash
    /// and a power loss. Concurrent callers share one fsync (group commit).
    #[default]
    Immediate,
    /// Batches are committed without an fsync, and a durable commit is made
    /// once `max_loss` has passed since the last one (also when the store is
    /// idle, and at a clean shutdown). A process crash **or** a power loss
    /// loses the acknowledged writes of at most the last `max_loss` (plus the
    /// duration of one batch): redb keeps non-durable commits out of the
    /// file's header until a durable one. A lost claim lets a retry claim the
    /// key again and run the side effect twice, so choose this only where
    /// the downstream system deduplicates by the fencing token anyway.
    Periodic {
        /// The loss window; at least 1 ms.
        max_loss: Duration,
    },
}

/// What opening a store does with PROCESSING records it finds.
///
/// One process holds a store file (a second open is [`Error::Locked`]), so
/// a PROCESSING record found at open belongs to a process that died.
///
/// ```
/// use idemstore::{RecoveryPolicy, RedbStore};
/// # let dir = tempfile::tempdir()?;
/// let store = RedbStore::builder()
///     .recovery(RecoveryPolicy::ExpireLeases)
///     .open(dir.path().join("orders.idem"))?;
/// assert_eq!(store.stats().leases_expired_on_open, 0);
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecoveryPolicy {
    /// Leave leases alone: a retry waits until the dead owner's lease ends
    /// (the seeds' behaviour; the default).
    #[default]
    WaitForLease,
    /// End every live lease at open, so a retry takes over at once (with a
    /// new fencing token). Reads every record once at open.
    ExpireLeases,
}

/// Group-commit counters of a [`RedbStore`] since it was opened.
///
/// ```
/// # use idemstore::{Fingerprint, Key, RedbStore, Store, Timestamp};
/// # use std::time::Duration;
/// # let dir = tempfile::tempdir()?;
/// let store = RedbStore::open(dir.path().join("s.idem"))?;
/// let d = Duration::from_secs(1);
/// let _ = store.begin(&Key::new("", "k")?, &Fingerprint::of(b""), Timestamp::EPOCH, d, d)?;
/// let stats = store.stats();
/// assert_eq!((stats.requests, stats.commits), (1, 1));
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedbStats {
    /// Requests the writer took (begins that missed the replay fast path,
    /// completes, releases, sweeps).
    pub requests: u64,
    /// Batches the writer ran: one write transaction each.
    pub batches: u64,
    /// Transactions committed (a batch that wrote nothing is not committed).
    pub commits: u64,
    /// Commits made durable with an fsync (all of them under [`Durability::Immediate`]).
    pub durable_commits: u64,
    /// The largest batch so far.
    pub largest_batch: u64,
    /// Begins answered `Replay` from a read transaction, without the writer.
    pub fast_replays: u64,
    /// Records deleted by sweeps (the background sweeper's and explicit
    /// [`Store::sweep_expired`] calls).
    pub swept: u64,
    /// Leases ended at open by [`RecoveryPolicy::ExpireLeases`].
    pub leases_expired_on_open: u64,
}

impl RedbStats {
    /// Mean requests per batch (0 before the first batch).
    ///
    /// ```
    /// assert_eq!(idemstore::RedbStats::default().mean_batch(), 0.0);
    /// ```
    pub fn mean_batch(&self) -> f64 {
        if self.batches == 0 {
            0.0
        } else {
            self.requests as f64 / self.batches as f64
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    batches: AtomicU64,
    commits: AtomicU64,
    durable_commits: AtomicU64,
    largest_batch: AtomicU64,
    fast_replays: AtomicU64,
    swept: AtomicU64,
}

/// What the callers and the writer thread share.
struct Shared {
    /// A read lock for every transaction (the writer's batches and the read
    /// paths); [`RedbStore::compact`] takes the write lock, which is how it
    /// pauses the writer and waits out every live transaction.
    db: RwLock<Database>,
    poisoned: AtomicBool,
    stats: Counters,
}

impl Shared {
    fn read_db(&self) -> RwLockReadGuard<'_, Database> {
        // The lock guards no invariant of ours (redb is transactional), so a
        // panic elsewhere while it was held leaves nothing half-done.
        self.db.read().unwrap_or_else(|p| p.into_inner())
    }
}

/// Options of a store being opened.
#[derive(Clone, Debug)]
struct Config {
    durability: Durability,
    cache_bytes: usize,
    max_body_bytes: usize,
    recovery: RecoveryPolicy,
    sweeper: Option<SweeperConfig>,
    clock: Arc<dyn Clock>,
    verify_on_open: bool,
}

/// Options for opening a [`RedbStore`]; from [`RedbStore::builder`].
///
/// ```
/// use idemstore::{Durability, RecoveryPolicy, RedbStore, SweeperConfig};
/// use std::time::Duration;
///
/// # let dir = tempfile::tempdir()?;
/// let store = RedbStore::builder()
///     .durability(Durability::Immediate)
///     .cache_bytes(16 << 20)
///     .max_body_bytes(64 * 1024)
///     .recovery(RecoveryPolicy::WaitForLease)
///     .sweeper(SweeperConfig::default().interval(Duration::from_secs(30)))
///     .open(dir.path().join("orders.idem"))?;
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `open`"]
pub struct RedbStoreBuilder {
    config: Config,
}

impl Default for RedbStoreBuilder {
    fn default() -> Self {
        RedbStoreBuilder {
            config: Config {
                durability: Durability::Immediate,
                cache_bytes: DEFAULT_CACHE_BYTES,
                max_body_bytes: DEFAULT_MAX_BODY_BYTES,
                recovery: RecoveryPolicy::WaitForLease,
                sweeper: None,
                clock: Arc::new(SystemClock),
                verify_on_open: false,
            },
        }
    }
}

impl RedbStoreBuilder {
    /// What an acknowledged write survives; [`Durability::Immediate`] by default.
    pub fn durability(mut self, durability: Durability) -> Self {
        self.config.durability = durability;
        self
    }
    /// redb's page cache, in bytes ([`DEFAULT_CACHE_BYTES`] by default).
    pub fn cache_bytes(mut self, bytes: usize) -> Self {
        self.config.cache_bytes = bytes;
        self
    }
    /// The largest response body stored ([`DEFAULT_MAX_BODY_BYTES`] by
    /// default, at most [`MAX_BODY_BYTES_HARD_CAP`](crate::MAX_BODY_BYTES_HARD_CAP),
    /// checked at open).
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.config.max_body_bytes = bytes;
        self
    }
    /// What opening does with PROCESSING records ([`RecoveryPolicy::WaitForLease`] by default).
    pub fn recovery(mut self, policy: RecoveryPolicy) -> Self {
        self.config.recovery = policy;
        self
    }
    /// Runs a background [`Sweeper`] with this configuration for the life
    /// of the store (none by default: call [`Store::sweep_expired`] yourself).
    pub fn sweeper(mut self, config: SweeperConfig) -> Self {
        self.config.sweeper = Some(config);
        self
    }
    /// The clock the sweeper and the recovery policy read
    /// ([`SystemClock`] by default). The store's operations take `now` from
    /// their caller.
    pub fn clock(mut self, clock: impl Clock + 'static) -> Self {
        self.config.clock = Arc::new(clock);
        self
    }
    /// Verifies every page's checksum at open (redb's integrity check), so
    /// that a file damaged outside redb is refused at open rather than found
    /// later. Reads the whole file; off by default.
    pub fn verify_on_open(mut self, verify: bool) -> Self {
        self.config.verify_on_open = verify;
        self
    }

    /// Opens the store file at `path`, creating it (mode 0600 on Unix) if it
    /// does not exist.
    ///
    /// Errors: [`Error::Locked`] when another open store holds the file;
    /// [`Error::Corrupt`] for a file that is not an idemstore store (a
    /// foreign file, a redb database without idemstore's meta table) or is
    /// damaged; [`Error::UnsupportedFormat`] for a store written by a newer
    /// format version. None of these touch the file.
    pub fn open(self, path: impl AsRef<Path>) -> Result<RedbStore> {
        let path = path.as_ref();
        self.check()?;
        let opened = open::open_path(path, &self.config)?;
        RedbStore::start(opened, self.config, Some(path.to_path_buf()))
    }

    /// Opens a store over any redb [`StorageBackend`](::redb::StorageBackend):
    /// the seam for simulated power loss in tests and for custom storage.
    ///
    /// This is the one engine-specific entry point: it names a redb type,
    /// so it follows redb's major version. Everything else in idemstore's
    /// API is engine-free.
    ///
    /// ```
    /// use idemstore::RedbStore;
    /// let store = RedbStore::builder().open_backend(redb::backends::InMemoryBackend::new())?;
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn open_backend(self, backend: impl ::redb::StorageBackend) -> Result<RedbStore> {
        self.check()?;
        let opened = open::open_backend(backend, &self.config, Path::new("<storage backend>"))?;
        RedbStore::start(opened, self.config, None)
    }

    fn check(&self) -> Result<()> {
        check_body_limit(self.config.max_body_bytes)?;
        if let Durability::Periodic { max_loss } = self.config.durability
            && max_loss.as_millis() == 0
        {
            return Err(Error::invalid_argument(
                "Durability::Periodic needs a loss window of at least 1 ms",
            ));
        }
        Ok(())
    }
}

/// The durable idempotency store on redb: one file, one process.
///
/// Writes go through one writer thread per store that commits whatever is
/// queued in one transaction and one fsync (group commit), so throughput
/// grows with concurrency while every acknowledged claim is durable. A
/// `begin` that finds a DONE record with the same fingerprint is answered
/// from a read transaction without the writer. After a failed commit the
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
    sweeper: Mutex<Option<Sweeper>>,
    path: Option<PathBuf>,
    store_id: [u8; 16],
    max_body_bytes: usize,
    leases_expired_on_open: u64,
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
        };
        let writer = std::thread::Builder::new()
            .name("idemstore-redb-writer".to_owned())
            .spawn(move || writer.run())
            .map_err(Error::Io)?;
        let mut store = RedbStore {
            shared,
            tx,
            writer: Some(writer),
            sweeper: Mutex::new(None),
            path,
            store_id: opened.store_id,
            max_body_bytes: config.max_body_bytes,
            leases_expired_on_open: opened.leases_expired,
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
            *store.sweeper.get_mut().unwrap_or_else(|p| p.into_inner()) = Some(sweeper);
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
            largest_batch: c.largest_batch.load(Ordering::Relaxed),
            fast_replays: c.fast_replays.load(Ordering::Relaxed),
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
        let mut db = self.shared.db.write().unwrap_or_else(|p| p.into_inner());
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

    /// The replay fast path: a DONE, unexpired record with this fingerprint,
    /// read without the writer. Anything else goes through the writer.
    fn fast_replay(
        &self,
        key_bytes: &[u8],
        fingerprint: &Fingerprint,
        now: Timestamp,
    ) -> Result<Option<Response>> {
        let Some(record) = self.read(key_bytes)? else {
            return Ok(None);
        };
        if record.state != State::Done
            || record.is_expired(now)
            || record.fingerprint != *fingerprint
        {
            return Ok(None);
        }
        self.shared
            .stats
            .fast_replays
            .fetch_add(1, Ordering::Relaxed);
        Ok(Some(record.response.unwrap_or_default()))
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
        drop(
            self.sweeper
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
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
        if let Some(response) = self.fast_replay(&key_bytes, fingerprint, now)? {
            return Ok(Begin::Replay(response));
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
