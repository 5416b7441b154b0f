//! [`RedbStats`]: the group-commit counters.

// std's atomics, not crate::sync's: these are counters only, no decision
// reads them, and under the model checker a scheduling point at each would
// only multiply the schedules to explore.
use std::sync::atomic::AtomicU64;

/// Group-commit counters of a [`RedbStore`](crate::RedbStore) since it was opened.
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
    /// sweeps); begins answered on the read fast path do not.
    pub requests: u64,
    /// Groups committed by a leader (one log frame each).
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
    /// Leases ended at open by [`RecoveryPolicy::ExpireLeases`](crate::redb::RecoveryPolicy::ExpireLeases).
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

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) requests: AtomicU64,
    pub(super) groups: AtomicU64,
    pub(super) commits: AtomicU64,
    pub(super) durable_commits: AtomicU64,
    pub(super) logged_commits: AtomicU64,
    pub(super) largest_group: AtomicU64,
    pub(super) fast_replays: AtomicU64,
    pub(super) fast_refusals: AtomicU64,
    pub(super) swept: AtomicU64,
    pub(super) checkpoints: AtomicU64,
}
