//! The calling threads' lanes: a blocking `begin` or `complete` made while
//! the commit line is idle, from a thread outside any tokio runtime, runs
//! its lone statement on a connection the calling thread drives itself.
//!
//! Why: every other call is spawned on the store's runtime thread and its
//! answer sent back, two thread wake-ups around each round trip
//! (docs/performance.md, "PostgreSQL"). A caller making one call
//! at a time (one client thread, a consumer loop) pays them on every call,
//! and the blocking `postgres` client a user would write by hand does not:
//! it polls its socket on the calling thread. The lane does the same with
//! the store's own statements: a current-thread tokio runtime of its own
//! holds one connection, whose I/O task runs only while a caller is in
//! that runtime's `block_on`, on the caller's thread.
//!
//! When it is taken, and why that keeps every answer the same:
//!
//! - Only when the commit line is idle (no job queued, no runner): under
//!   concurrency calls go to the line, where group commit pays more than a
//!   saved wake-up. The check is a hint; a call that takes the lane as the
//!   line fills is one more lone statement, as a group's fallback runs.
//! - The statement is the lone call's (`BeginStep`, `complete_on`), in its
//!   own transaction: the answers are the lone path's. A `begin` may try
//!   the plain claim of an absent key first (`BeginStep::claim_fresh`,
//!   cheaper on the server than the full statement), which claims what
//!   the full statement would have claimed or writes nothing, and then
//!   the full statement decides.
//! - One caller per lane at a time (`try_lock`). A store keeps up to
//!   [`MAX_LANES`] of them (one per four pooled connections): a few
//!   threads calling at once each drive their own connection, as the
//!   hand-written path does, instead of queueing for groups of two or
//!   three. A thread tries its own lane first (threads are spread over
//!   them), then the others; with all busy it goes to the line.
//! - A connection the server ended is dropped and the call runs again on
//!   the store's runtime as a repetition, exactly as `Core::retrying` would
//!   run it on another pooled connection (a `complete` whose first run
//!   committed is recognised there). So does a call whose commit the
//!   server reported on the primary only (its connection is kept).
//! - A lane's connection holds one of the pool's permits (`max_size`
//!   bounds both), never the last free one; it is opened only while the
//!   breaker is closed, and a failed attempt opens the breaker and starts
//!   the probe on the store's runtime, as a pooled checkout would.
//! - Inside a tokio runtime (a worker, `spawn_blocking`) the lane is never
//!   taken: a runtime cannot be driven from inside another.
//!
//! A lane's runtime is shut down without blocking when the store is
//! dropped (`shutdown_background`), so a store dropped inside an async
//! context does not panic.

use super::errors::{call_timed_out, db_error, is_dead_connection};
use super::ops::{Core, RunError, complete_on};
use super::pool::{Conn, Dedicated};
use super::row;
use super::stats::Counters;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, check_durations};
use crate::response::Response;
use crate::time::Timestamp;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;
use tokio::runtime::{Handle, Runtime};

/// Most calling-thread lanes one store keeps (see the module docs): each
/// holds a connection, and a store keeps one lane per four connections of
/// its pool ([`max_size`](super::PostgresStoreBuilder::max_size)), at least
/// one and at most this many, so that the lanes never hold more than a
/// quarter of the pool (besides one) while the commit line is busy.
const MAX_LANES: usize = 8;

/// The lanes: each empty until a call first takes it.
pub(super) struct Lanes {
    slots: Box<[Mutex<Option<Held>>]>,
    /// The store's call timeout, which bounds a lane's call too.
    call_timeout: Duration,
    /// Whether a `begin` tries [`BeginStep::claim_fresh`] first: while
    /// begins claim fresh keys, their one plain statement; once one finds
    /// its key taken (a replay, a retry), the full statement alone, so
    /// that a caller re-sending keys does not pay two statements a call,
    /// until a begin claims a key at its first attempt again. A hint:
    /// either statement gives the same answer.
    fresh_first: AtomicBool,
}

impl Lanes {
    /// The lanes of a store whose pool holds `max_size` connections.
    pub(super) fn for_pool(max_size: u32, call_timeout: Duration) -> Lanes {
        let count = usize::try_from(max_size / 4)
            .unwrap_or(MAX_LANES)
            .clamp(1, MAX_LANES);
        Lanes {
            slots: (0..count).map(|_| Mutex::new(None)).collect(),
            call_timeout,
            fresh_first: AtomicBool::new(true),
        }
    }
}

/// The lane a thread tries first: threads spread over the lanes, and a
/// thread that calls again finds its own lane's connection (and its
/// prepared statements) free.
fn first_slot(count: usize) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    MINE.with(|mine| mine % count.max(1))
}

/// Drops a lane's connection, found dead, counting it as lost (its permit
/// goes back to the pool).
fn lose(core: &Core, conn: &mut Option<Dedicated>) {
    if conn.take().is_some() {
        Counters::bump(&core.counters.connections_lost);
    }
}

/// The lanes' indexes in the order a thread tries them: `first`, then the
/// others, each once.
fn slot_order(first: usize, count: usize) -> impl Iterator<Item = usize> {
    (0..count).map(move |i| (first + i) % count)
}

/// The lane's runtime and, once opened, its connection.
struct Held {
    runtime: Option<Runtime>,
    conn: Option<Dedicated>,
}

impl Drop for Held {
    fn drop(&mut self) {
        // The connection's client first (its I/O task then ends), then the
        // runtime, without blocking: a store may be dropped in async code.
        drop(self.conn.take());
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// What became of a call offered to the lane.
pub(super) enum Ran<T> {
    /// The lane ran it: its answer.
    Answered(Result<T>),
    /// Not taken (the store busy, an async context, the lane busy or
    /// unable to open a connection): run it the usual way.
    NotTaken,
    /// The lane's connection died under it, after the statement may have
    /// committed, or the server reported its commit on the primary only:
    /// run it again as a repetition.
    Broken,
}

impl Lanes {
    /// Runs `op` on the lane's connection when the lane may be taken (see
    /// the module docs). `store`: the store's runtime, where the probe runs
    /// if opening the connection fails.
    fn run<T, F, Fut>(&self, core: &Core, store: &Handle, op: F) -> Ran<T>
    where
        F: FnOnce(Arc<Conn>) -> Fut,
        Fut: Future<Output = Result<T, RunError>>,
    {
        if Handle::try_current().is_ok() || !core.line.is_idle() || core.pool.breaker_is_open() {
            return Ran::NotTaken;
        }
        let count = self.slots.len();
        let Some(mut slot) = slot_order(first_slot(count), count).find_map(|i| {
            let lane = self.slots.get(i)?;
            match lane.try_lock() {
                Ok(slot) => Some(slot),
                Err(TryLockError::WouldBlock) => None,
                Err(TryLockError::Poisoned(poisoned)) => {
                    // A panic mid-call: its connection's state is unknown.
                    let mut slot = poisoned.into_inner();
                    *slot = None;
                    lane.clear_poison();
                    Some(slot)
                }
            }
        }) else {
            return Ran::NotTaken;
        };
        if slot.is_none() {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return Ran::NotTaken;
            };
            *slot = Some(Held {
                runtime: Some(runtime),
                conn: None,
            });
        }
        let Some(Held {
            runtime: Some(runtime),
            conn,
        }) = slot.as_mut()
        else {
            return Ran::NotTaken;
        };
        if conn.as_ref().is_some_and(|c| c.conn.client.is_closed()) {
            lose(core, conn);
        }
        let bound = self.call_timeout;
        if conn.is_none() {
            // The timer is made inside the runtime, which owns the time driver.
            match runtime
                .block_on(async { tokio::time::timeout(bound, core.pool.dedicated()).await })
            {
                Err(_) => return Ran::Answered(Err(call_timed_out(bound))),
                Ok(None) => return Ran::NotTaken,
                Ok(Some(Err(err))) => {
                    core.pool.trip_after(&err, store);
                    return Ran::Answered(Err(err));
                }
                Ok(Some(Ok(opened))) => *conn = Some(opened),
            }
        }
        let Some(held) = conn.as_ref() else {
            return Ran::NotTaken;
        };
        Counters::bump(&core.counters.calls);
        let seen = held.conn.unreplicated();
        let Ok(ran) = runtime
            .block_on(async { tokio::time::timeout(bound, op(Arc::clone(&held.conn))).await })
        else {
            // Its statement may still run on the server; the connection's
            // state is unknown, so it is dropped (its permit goes back). A
            // claim the statement makes is not given back: its lease ends it.
            *conn = None;
            return Ran::Answered(Err(call_timed_out(bound)));
        };
        let unreplicated = held.conn.unreplicated() != seen;
        if !matches!(&ran, Err(RunError::Db(err)) if is_dead_connection(err)) {
            Counters::bump(&core.counters.caller_driven_calls);
        }
        match ran {
            Err(RunError::Db(err)) if is_dead_connection(&err) => {
                lose(core, conn);
                Ran::Broken
            }
            // Its commit is on the primary only: the outcome is unknown, as
            // after a broken connection, though this one stays usable.
            _ if unreplicated => Ran::Broken,
            Ok(value) => Ran::Answered(Ok(value)),
            Err(RunError::Db(err)) => Ran::Answered(Err(db_error(err, &core.sql.table))),
            Err(RunError::Store(err)) => Ran::Answered(Err(err)),
        }
    }

    /// A blocking `begin` on the lane: the lone statement. Arguments the
    /// line would refuse are left to it ([`Ran::NotTaken`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn begin(
        &self,
        core: &Core,
        store: &Handle,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Ran<Begin> {
        if check_durations(lease, retention).is_err() {
            return Ran::NotTaken;
        }
        let fresh = &self.fresh_first;
        // Built only once the lane is taken (the key lock is a hash).
        self.run(core, store, |conn| async move {
            let step = core.begin_step(key, fingerprint, now, lease, retention);
            if fresh.load(Ordering::Relaxed) {
                if let Some(claimed) = step.claim_fresh(&conn).await? {
                    return Ok(claimed);
                }
                fresh.store(false, Ordering::Relaxed);
            }
            let answer = step.run(&conn, &core.counters).await?;
            if matches!(&answer, Begin::Claimed(claim) if claim.attempt() == 1) {
                fresh.store(true, Ordering::Relaxed);
            }
            Ok(answer)
        })
    }

    /// A blocking `complete` on the lane: the conditional DONE write.
    /// Arguments the line would refuse are left to it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn complete(
        &self,
        core: &Core,
        store: &Handle,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Ran<()> {
        if logic::check_response(response, core.max_body_bytes).is_err() {
            return Ran::NotTaken;
        }
        let Some(token) = row::token(claim.token) else {
            return Ran::NotTaken;
        };
        self.run(core, store, |conn| async move {
            let columns = row::response_columns(response);
            let times = row::times(now, retention);
            let updated = complete_on(&conn, key, token, times, &columns).await?;
            if updated > 0 {
                Ok(())
            } else {
                Err(RunError::Store(Error::StaleClaim))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_keeps_one_lane_per_four_connections_within_bounds() {
        let lanes = |max_size| {
            Lanes::for_pool(max_size, Duration::from_secs(5))
                .slots
                .len()
        };
        assert_eq!(lanes(1), 1);
        assert_eq!(lanes(7), 1);
        assert_eq!(lanes(8), 2);
        assert_eq!(lanes(16), 4);
        assert_eq!(lanes(32), MAX_LANES);
        assert_eq!(lanes(u32::MAX), MAX_LANES);
    }

    #[test]
    fn threads_start_on_different_lanes() {
        let here = first_slot(4);
        assert_eq!(first_slot(4), here, "a thread keeps its lane");
        let starts: Vec<(usize, usize)> = (0..8)
            .map(|_| std::thread::spawn(|| (first_slot(4), first_slot(1))))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("a thread"))
            .collect();
        assert!(
            starts.iter().all(|&(s, one)| s < 4 && one == 0),
            "{starts:?}"
        );
        assert!(
            starts.iter().any(|&(s, _)| s != starts[0].0),
            "spread: {starts:?}"
        );
    }

    #[test]
    fn a_thread_tries_its_own_lane_then_every_other_once() {
        for count in 1..6 {
            for first in 0..count {
                let order: Vec<usize> = slot_order(first, count).collect();
                assert_eq!(order.first(), Some(&first));
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..count).collect::<Vec<_>>(), "{order:?}");
            }
        }
    }
}
