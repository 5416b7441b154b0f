//! [`RedbStore`]: the durable on-disk store on redb 4.x (feature `redb`),
//! its builder, durability and recovery options, statistics and limits, and
//! the [`Inbox`] for message consumers (examples: [`RedbStore`],
//! [`RedbStoreBuilder`]). How the files divide the work, layer by layer:
//! `docs/design.md` ("Where the code is").

pub mod admin;
mod builder;
mod checkpoint;
mod commit;
mod damage;
mod db;
mod file;
mod heal;
mod health;
mod inbox;
mod memtable;
mod meta;
mod open;
mod overlay;
mod record_log;
mod recovery;
mod requests;
mod shared;
#[cfg(all(test, shuttle))]
mod shuttle_tests;
mod tables;

/// The redb crate the store is built on, for an [`Inbox`] handler's own
/// tables (`TableDefinition`, `ReadableTable`, `WriteTransaction`): the same
/// version as the store's, whatever the caller's own dependency says.
pub use ::redb as engine;
pub use builder::RedbStoreBuilder;
pub use damage::LossReport;
pub use health::Health;
pub use inbox::{Delivery, Inbox, Message};
// Fixed sizes, not public: tests read them through `idemstore::unstable::redb`.
#[cfg(feature = "unstable-internals")]
pub(crate) use {
    memtable::MEMTABLE_BYTES,
    record_log::{FRAME_ALIGN, MIN_WAL_BYTES, WAL_BYTES},
    shared::WRITE_QUEUE_DEPTH,
};

use crate::error::{Error, Result};
use crate::sweeper::{Sweeper, SweeperConfig};
use crate::sync::Arc;
use crate::sync::atomic::Ordering;
use crate::sync::thread::{self, JoinHandle};
use crate::time::Clock;
use db::{Engine, Usable};
use shared::Shared;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The durable idempotency store on redb: one file, one process.
///
/// Writes join a line; a committer thread commits each waiting group with
/// one log append and one `fdatasync` (group commit): throughput grows with
/// concurrency, and every acknowledged claim is durable. A `begin` that
/// writes nothing (Replay, InFlight, Conflict) does not join the line;
/// [`Store::begin_async`](crate::Store::begin_async) and friends join it as
/// futures, no thread waiting per request. After a failed write (a full
/// disk, an I/O error) writes are refused ([`Error::Poisoned`], with the
/// cause) while reads and replays go on, until the store heals by itself
/// with nothing lost ([`health`](Self::health)).
///
/// ```
/// use idemstore::{Begin, Fingerprint, Key, RedbStore, Response, Store, Timestamp};
/// use idemstore::redb::Health;
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
///
/// // The accessors:
/// assert_eq!(store.path(), Some(path.as_path()));
/// assert_ne!(store.store_id(), RedbStore::open(dir.path().join("b.idem"))?.store_id());
/// assert!(!store.is_read_only() && !store.is_poisoned() && matches!(store.health(), Health::Healthy));
/// assert!(store.loss_report().is_none() && store.sweeper().is_none());
/// store.compact()?;
/// # Ok::<(), idemstore::Error>(())
/// ```
pub struct RedbStore {
    shared: Arc<Shared>,
    /// The checkpointer (checkpoint.rs).
    background: Option<JoinHandle<()>>,
    /// The committer (commit/committer.rs); none for a read-only store.
    committer: Option<JoinHandle<()>>,
    sweeper: Option<Sweeper>,
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
            .field("path", &self.path())
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

    /// Whether this store was opened with [`RedbStoreBuilder::open_read_only`]
    /// (example: [`RedbStore`]).
    pub fn is_read_only(&self) -> bool {
        self.shared.read_only.is_some()
    }

    /// Options: durability, cache size, response limit, recovery policy,
    /// sweeper (example: [`RedbStoreBuilder`]).
    pub fn builder() -> RedbStoreBuilder {
        RedbStoreBuilder::default()
    }

    fn start(mut opened: open::Opened, config: Config, path: Option<PathBuf>) -> Result<RedbStore> {
        let (leases, frames) = (opened.leases_expired, opened.recovered.frames);
        let mut loss = std::mem::take(&mut opened.loss);
        loss.frames_replayed = frames;
        crate::observability::opened(path.as_deref(), frames, leases, config.read_only);
        let mut store = RedbStore {
            store_id: opened.store_id,
            shared: Shared::new(opened, &config, path.as_deref()),
            background: None,
            committer: None,
            sweeper: None,
            max_body_bytes: config.max_body_bytes,
            leases_expired_on_open: leases,
            frames_replayed_on_open: frames,
            loss_report: (!loss.findings.is_empty()).then_some(loss),
        };
        // The threads hold the shared state, not the store: no cycle, and a
        // thread that cannot start drops the store, which stops the others.
        let checkpointer = Arc::clone(&store.shared);
        let run = move || checkpoint::run(checkpointer);
        store.background = Some(spawn("idemstore-redb-checkpointer", run)?);
        if store.shared.read_only.is_none() {
            let committer = Arc::clone(&store.shared);
            let run = move || committer.run_committer();
            store.committer = Some(spawn("idemstore-redb-committer", run)?);
        }
        if let Some(sweep) = config.sweeper {
            let shared = Arc::clone(&store.shared);
            store.sweeper = Some(Sweeper::spawn_fn(
                "idemstore-redb-sweeper",
                config.clock,
                sweep,
                move |now, max| shared.sweep(now, max),
            )?);
        }
        Ok(store)
    }

    /// The file this store was opened from (`None` for a storage backend;
    /// example: [`RedbStore`]).
    pub fn path(&self) -> Option<&Path> {
        self.shared.db.path.as_deref()
    }

    /// A number naming this store file for its life (16 random bytes from
    /// its creation, big-endian), e.g. to tell two stores' fencing tokens
    /// apart, as [`SledStore::store_id`](crate::SledStore::store_id) does
    /// (example: [`RedbStore`]).
    pub fn store_id(&self) -> u128 {
        u128::from_be_bytes(self.store_id)
    }

    /// The background sweeper, when one was configured (to read its
    /// counters; example: [`RedbStoreBuilder`]).
    pub fn sweeper(&self) -> Option<&Sweeper> {
        self.sweeper.as_ref()
    }

    /// What this open gave up, when it was opened with
    /// [`accept_loss`](RedbStoreBuilder::accept_loss) (its example) and
    /// found damage; `None` when nothing was dropped.
    pub fn loss_report(&self) -> Option<&LossReport> {
        self.loss_report.as_ref()
    }

    /// Group-commit counters since open (example: [`RedbStats`]).
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

    /// True after a failed write, until the store has healed (while
    /// [`health`](Self::health) is not `Healthy`; example: [`RedbStore`]).
    pub fn is_poisoned(&self) -> bool {
        self.shared.db.health.is_poisoned()
    }

    /// Whether the store writes, and if not, why ([`Health`]);
    /// `docs/operations.md` ("Disk full and I/O errors") says what to do
    /// in each state (example: [`RedbStore`]).
    pub fn health(&self) -> Health {
        self.shared.db.health.health()
    }

    /// Reclaims free space in the file (after sweeps), returning whether
    /// anything was moved (example: [`RedbStore`]). It checkpoints the
    /// memtable first; redb compacts only with no live transaction, so until
    /// it returns no group commits and reads of the store file wait. Run it
    /// at a quiet time: it can take as long as rewriting the live data.
    pub fn compact(&self) -> Result<bool> {
        self.shared.check_submit()?;
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

fn spawn(name: &str, run: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    thread::Builder::new()
        .name(name.to_owned())
        .spawn(run)
        .map_err(Error::Io)
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
        *self.shared.memory.lock_bg() = true;
        self.shared.memory.wake_background();
        // It finishes a checkpoint in progress.
        if let Some(background) = self.background.take() {
            let _ = background.join();
        }
        if !self.is_poisoned() {
            // A failure is recorded (poisoned, with its cause) by the commit.
            let _ = self.shared.close();
        }
    }
}

/// What survives a crash: the promise behind every acknowledged write.
///
/// ```
/// use idemstore::RedbStore;
/// use idemstore::redb::Durability;
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
    /// Every group is durable before any caller in it is answered: an
    /// acknowledged claim or completion survives a process crash and a power
    /// loss. Concurrent callers share one fsync (group commit), of a small
    /// append to the log `<file>-wal`.
    #[default]
    Immediate,
    /// Groups are appended to the log without an fsync; the log is synced
    /// once `max_loss` has passed since the last sync (also when idle; a
    /// clean shutdown writes everything into the store file durably). A
    /// process crash **or** a power loss loses the acknowledged writes of at
    /// most the last `max_loss` (plus one group's duration). A lost claim
    /// lets a retry claim the key again and run the side effect twice:
    /// choose this only where the downstream deduplicates by fencing token.
    Periodic {
        /// The loss window; at least 1 ms.
        max_loss: Duration,
    },
}

/// What opening a store does with PROCESSING records it finds.
///
/// One process holds a store file (a second open is [`Error::Locked`]), so
/// a PROCESSING record found at open belongs to a process that died
/// (example: [`RedbStoreBuilder`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecoveryPolicy {
    /// Leave leases alone: a retry waits until the dead owner's lease ends
    /// (the default: a call the dead owner made downstream may still be
    /// landing).
    #[default]
    WaitForLease,
    /// End every live lease at open, so a retry takes over at once (with a
    /// new fencing token). Reads every record once at open.
    ExpireLeases,
}

/// Options of a store being opened.
#[derive(Clone, Debug)]
pub(super) struct Config {
    pub(super) durability: Durability,
    pub(super) cache_bytes: usize,
    pub(super) max_body_bytes: usize,
    pub(super) recovery: RecoveryPolicy,
    pub(super) sweeper: Option<SweeperConfig>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) verify_on_open: bool,
    pub(super) checkpoint_interval: Duration,
    pub(super) log_bytes: u64,
    pub(super) accept_loss: bool,
    /// An inspection: nothing is written (`RedbStore::builder().open_read_only`).
    pub(super) read_only: bool,
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
/// assert_eq!(idemstore::redb::RedbStats::default().mean_group(), 0.0);
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedbStats {
    /// Requests that joined the line (claiming begins, completes, releases,
    /// renewals, steps, sweeps); begins answered on the read fast path do not.
    pub requests: u64,
    /// Groups committed by the committer (one log frame each).
    pub groups: u64,
    /// Groups and direct transactions that wrote something.
    pub commits: u64,
    /// redb commits made durable with an fsync: checkpoints and direct
    /// transactions (inbox, admin writes, compaction, an oversized group).
    pub durable_commits: u64,
    /// Groups made durable by one append and `fdatasync` of the log.
    pub logged_commits: u64,
    /// Frames replayed from the log when the store was opened:
    /// groups acknowledged after the last checkpoint before a crash.
    pub frames_replayed_on_open: u64,
    /// The largest group so far.
    pub largest_group: u64,
    /// Begins answered `Replay` on the read fast path.
    pub fast_replays: u64,
    /// Begins answered InFlight or Conflict on the read fast path.
    pub fast_refusals: u64,
    /// Records deleted by sweeps (the sweeper's and [`Store::sweep_expired`](crate::Store::sweep_expired)'s).
    pub swept: u64,
    /// Leases ended at open by [`RecoveryPolicy::ExpireLeases`].
    pub leases_expired_on_open: u64,
    /// Frozen memtables the background checkpointer wrote into the store
    /// file (each one durable redb commit that retired a log segment).
    pub checkpoints: u64,
}

impl RedbStats {
    /// Mean requests per group (0 before the first group; example:
    /// [`RedbStats`]).
    pub fn mean_group(&self) -> f64 {
        if self.groups == 0 {
            0.0
        } else {
            self.requests as f64 / self.groups as f64
        }
    }
}

// std's atomics, not crate::sync's: these are counters only, no decision
// reads them, and under the model checker a scheduling point at each would
// only multiply the schedules to explore.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) requests: std::sync::atomic::AtomicU64,
    pub(super) groups: std::sync::atomic::AtomicU64,
    pub(super) commits: std::sync::atomic::AtomicU64,
    pub(super) durable_commits: std::sync::atomic::AtomicU64,
    pub(super) logged_commits: std::sync::atomic::AtomicU64,
    pub(super) largest_group: std::sync::atomic::AtomicU64,
    pub(super) fast_replays: std::sync::atomic::AtomicU64,
    pub(super) fast_refusals: std::sync::atomic::AtomicU64,
    pub(super) swept: std::sync::atomic::AtomicU64,
    pub(super) checkpoints: std::sync::atomic::AtomicU64,
}
