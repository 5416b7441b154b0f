//! The options as data: [`Durability`], [`RecoveryPolicy`], and `Config`
//! (what an open, a recovery and a heal read). A bottom module.

use crate::sweeper::SweeperConfig;
use crate::time::Clock;
use std::sync::Arc;
use std::time::Duration;

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
    /// Batches are appended to the log without an fsync; the log is synced
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
/// One process holds a store file (a second open is [`Error::Locked`](crate::Error::Locked)), so
/// a PROCESSING record found at open belongs to a process that died
/// (example: [`RedbStoreBuilder`](super::RedbStoreBuilder)).
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
