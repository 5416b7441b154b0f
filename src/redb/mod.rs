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
//! # Files
//!
//! An LSM front end with redb as the base table: caller → line → leader
//! (decide: memtable, then redb) → log frame + `fdatasync` → memtable;
//! the checkpointer writes frozen memtables into redb durably.
//!
//! - `shared.rs` composes the parts, each owning its locks: `line.rs`
//!   (callers waiting to commit), `log.rs` (the commit lock and the log),
//!   `memtable.rs` (what is in memory), `db.rs` (the engine and its health)
//! - `requests.rs`, `snapshot.rs`: the `Store` impl, its read fast path,
//!   the kept snapshot
//! - `commit/`, `native.rs`: group commit, the async entry
//! - `record_log/`, `checkpoint.rs`: the log and the checkpoint
//! - `open.rs`, `recovery.rs`, `meta.rs`, `heal.rs`: open,
//!   replay, heal
//! - `health.rs`, `damage.rs` (and the loss report): failures
//! - `overlay.rs`, `file.rs`, `tables.rs`: in-memory pages, file helpers,
//!   the tables and `commit`, the one way into redb
//! - `config.rs`, `builder.rs`, `stats.rs`: options and counters
//! - `admin/`, `inbox/`: operator access, the co-transactional inbox and
//!   the atomic step

pub mod admin;
mod builder;
mod checkpoint;
mod commit;
mod config;
mod damage;
mod db;
mod file;
mod heal;
mod health;
mod inbox;
mod line;
mod log;
mod memtable;
mod meta;
mod native;
mod open;
mod overlay;
mod record_log;
mod recovery;
mod requests;
mod shared;
#[cfg(all(test, shuttle))]
mod shuttle_tests;
mod snapshot;
mod stats;
mod tables;

/// The redb crate the store is built on, for an [`Inbox`] handler's own
/// tables (`TableDefinition`, `ReadableTable`, `WriteTransaction`): the same
/// version as the store's, whatever the caller's own dependency says.
pub use ::redb as engine;
pub use builder::RedbStoreBuilder;
use config::Config;
pub use config::{Durability, RecoveryPolicy};
pub use damage::LossReport;
pub use health::Health;
pub use inbox::{Delivery, Inbox, Message};
pub use stats::RedbStats;
// Fixed sizes, not public: tests read them through `idemstore::unstable::redb`.
#[cfg(feature = "unstable-internals")]
pub(crate) use {
    line::WRITE_QUEUE_DEPTH,
    memtable::MEMTABLE_BYTES,
    record_log::{FRAME_ALIGN, MIN_WAL_BYTES, WAL_BYTES},
};

use crate::error::{Error, Result};
use crate::sweeper::Sweeper;
use crate::sync::Arc;
use crate::sync::atomic::Ordering;
use crate::sync::thread::{self, JoinHandle};
use crate::time::Clock;
use db::{Engine, Usable};
use line::{Op, Reply};
use requests::unexpected;
use shared::Shared;
use std::path::{Path, PathBuf};

/// The durable idempotency store on redb: one file, one process.
///
/// Writes join a line; the first caller in line commits the waiting group
/// with one log append and one `fdatasync` (group commit), so throughput
/// grows with concurrency while every acknowledged claim is durable. A
/// `begin` that writes nothing (Replay, InFlight, Conflict) does not join
/// the line. [`Store::begin_async`](crate::Store::begin_async) and friends
/// join it as futures: no thread waits per request.
///
/// After a failed write (a full disk, an I/O error) writes are refused
/// ([`Error::Poisoned`], with the cause) while reads and replays go on,
/// until the store heals by itself, with nothing lost; see
/// [`health`](Self::health).
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
    /// handed out by [`Store::clock`](crate::Store::clock).
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

    /// Whether this store was opened with [`RedbStoreBuilder::open_read_only`].
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
            groups: c.groups.load(Ordering::Relaxed),
            commits: c.commits.load(Ordering::Relaxed),
            durable_commits: c.durable_commits.load(Ordering::Relaxed),
            logged_commits: c.logged_commits.load(Ordering::Relaxed),
            frames_replayed_on_open: self.frames_replayed_on_open,
            checkpoints: c.checkpoints.load(Ordering::Relaxed),
            largest_group: c.largest_group.load(Ordering::Relaxed),
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
        self.shared.db.is_poisoned()
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
        self.shared.db.health()
    }

    /// Reclaims free space in the file (after sweeps), returning whether
    /// anything was moved.
    ///
    /// It checkpoints the memtable first. redb compacts only with no live
    /// transaction, so until it returns no group commits and reads of the
    /// store file wait. Run it at a quiet time; it can take as long as
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
        self.shared.db.check_healthy()?;
        let mut core = self.shared.log.lock();
        // Compaction moves pages of the durable state only: make everything
        // in memory part of it first (and retire the log).
        self.shared.flush_locked(&mut core)?;
        let mut engine = self.shared.db.write_db();
        if engine.usable != Usable::Yes {
            return Err(self.shared.db.poisoned_error());
        }
        engine.db.compact().map_err(|e| {
            self.shared
                .engine_failed("compaction", file::engine_error(e))
        })
    }
}

/// Stops the checkpointer and waits for it (it finishes a checkpoint in progress).
fn stop_background(shared: &Shared, background: Option<JoinHandle<()>>) {
    {
        let mut bg = shared.memory.lock_bg();
        bg.shutdown = true;
        shared.memory.bg_cv.notify_all();
    }
    if let Some(background) = background {
        let _ = background.join();
    }
}

impl Drop for RedbStore {
    fn drop(&mut self) {
        // Order: the sweeper (it submits writes); the committer (futures
        // outlive the store, it answers what is in line and may need the
        // checkpointer); the checkpointer; then memory goes into redb
        // durably, so a clean stop leaves nothing to replay.
        drop(self.sweeper.take());
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
