//! [`PostgresStats`]: what a [`PostgresStore`](super::PostgresStore) has done
//! and what state its pool and circuit breaker are in.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters and gauges of a [`PostgresStore`](crate::PostgresStore), from
/// [`PostgresStore::stats`](crate::PostgresStore::stats).
///
/// `refusals` rising while `breaker_open` is true is the server being
/// unreachable (every call fails at once); `pool_waits` rising means callers
/// queue for a connection (raise `max_size`, within the server's
/// `max_connections`); `snapshot_retries` counts `begin`s that raced a
/// concurrent claim of the same key and ran their statement again.
///
/// ```no_run
/// let store = idemstore::PostgresStore::connect("postgres://app@db.internal/orders")?;
/// let stats = store.stats();
/// assert!(stats.connections <= 16);
/// println!("{} calls, {} refused while the server was unreachable", stats.calls, stats.refusals);
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PostgresStats {
    /// Store calls made (`begin`, `complete`, `release`, `get`,
    /// `sweep_expired`, `migrate`), sync or async.
    pub calls: u64,
    /// Calls refused at once, without trying the server, because the
    /// circuit breaker was open.
    pub refusals: u64,
    /// Times a `begin` waited for a concurrent claim of its key to commit
    /// and ran its statement again (the snapshot race; see `MAX_BEGIN_ATTEMPTS`).
    pub snapshot_retries: u64,
    /// Checkouts that found every connection busy and waited.
    pub pool_waits: u64,
    /// Transactions that carried the `begin`s and `complete`s of several
    /// concurrent calls (group commits); `grouped_calls / group_commits`
    /// is the mean group size.
    pub group_commits: u64,
    /// Calls answered by a group commit.
    pub grouped_calls: u64,
    /// Blocking `begin`s and `complete`s that ran on a calling-thread lane
    /// (the commit line idle, the caller outside any tokio runtime): no
    /// hand-off to the store's runtime thread.
    pub caller_driven_calls: u64,
    /// Connections opened (at build, on demand, and by the reconnect probe).
    pub connections_opened: u64,
    /// Connections found dead (a server restart or failover, a terminated
    /// backend) and dropped; the call moved on to another one.
    pub connections_lost: u64,
    /// Connection attempts that failed.
    pub connect_failures: u64,
    /// Times the circuit breaker opened.
    pub breaker_trips: u64,
    /// Connections open now (idle and in use).
    pub connections: u64,
    /// Connections open and idle now.
    pub idle_connections: u64,
    /// Whether the circuit breaker is open now (calls fail at once until the
    /// probe reconnects).
    pub breaker_open: bool,
}

/// The counters behind [`PostgresStats`], shared by the store, its pool and
/// its breaker.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) calls: AtomicU64,
    pub(super) refusals: AtomicU64,
    pub(super) snapshot_retries: AtomicU64,
    pub(super) pool_waits: AtomicU64,
    pub(super) group_commits: AtomicU64,
    pub(super) grouped_calls: AtomicU64,
    pub(super) caller_driven_calls: AtomicU64,
    pub(super) connections_opened: AtomicU64,
    pub(super) connections_lost: AtomicU64,
    pub(super) connect_failures: AtomicU64,
    pub(super) breaker_trips: AtomicU64,
}

impl Counters {
    pub(super) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The counters as they are now; the pool fills in its gauges.
    pub(super) fn snapshot(&self) -> PostgresStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PostgresStats {
            calls: get(&self.calls),
            refusals: get(&self.refusals),
            snapshot_retries: get(&self.snapshot_retries),
            pool_waits: get(&self.pool_waits),
            group_commits: get(&self.group_commits),
            grouped_calls: get(&self.grouped_calls),
            caller_driven_calls: get(&self.caller_driven_calls),
            connections_opened: get(&self.connections_opened),
            connections_lost: get(&self.connections_lost),
            connect_failures: get(&self.connect_failures),
            breaker_trips: get(&self.breaker_trips),
            connections: 0,
            idle_connections: 0,
            breaker_open: false,
        }
    }
}
