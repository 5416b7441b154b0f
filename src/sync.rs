//! The synchronization primitives of the redb write path (`src/redb/`) and
//! of the guard's lease-renewal timer (`src/guard/renew.rs`), in one place,
//! so that a model checker can stand in for them.
//!
//! Normally these are `std`'s, re-exported unchanged. In a test build with
//! `--cfg shuttle` they are [Shuttle]'s: its scheduler then decides which
//! thread runs next at every lock, condvar, atomic and thread operation, and
//! the commit line's tests (`src/redb/shuttle_tests.rs`) run the production
//! code under many schedules (docs/testing.md, "The commit line under a
//! model checker"). Nothing else changes between the two builds.
//!
//! Shuttle does not model time, so two things are filled in here for it:
//!
//! - `Instant` is a virtual clock, one per execution, that moves forward
//!   by a random step (0 to `STEP_MS` ms, drawn from Shuttle's seeded
//!   randomness, so a failing schedule replays) at every reading. With the
//!   tests' checkpoint interval shorter than `STEP_MS`, the committer's "is it
//!   due?" checks then come out both ways, at points the scheduler chooses.
//! - Shuttle's `Condvar::wait_timeout` never times out (it is a plain
//!   `wait`), and its `wait` never wakes spuriously. `Condvar` wraps it: a
//!   wait returns at once, holding the lock, one time in
//!   `EARLY_ONE_IN` (a spurious wake-up; for `wait_timeout` a timeout,
//!   with the virtual clock moved past it), and otherwise waits for a
//!   notify. Every early return is a behaviour the real primitive allows.
//!   A deadlock is still found: a thread whose only way on is a timeout
//!   keeps timing out, and the test's step bound fails it.
//!
//! What Shuttle cannot see: redb and the storage backends lock with `std`'s
//! primitives inside their own calls. Shuttle switches threads only at its
//! own primitives, so a redb call runs as one step, which is exact as long
//! as it never *blocks* on a lock another (suspended) task holds; all
//! tasks share one OS thread, so such a block would hang the test rather
//! than fail it. The one blocking call in redb is `begin_write` while
//! another write transaction is live. The write path opens write
//! transactions in three places, and they never overlap: a direct
//! transaction (`commit/mod.rs`: the inbox, admin writes, a group too
//! large for the log) holds the commit lock and opens its transaction only
//! after `wait_checkpointed` saw no frozen memtable; the checkpointer
//! (checkpoint.rs) opens one only while a frozen memtable exists and drops
//! it before clearing it, and only the commit lock's holder freezes; a
//! heal (heal.rs) runs on the checkpointer's thread and holds the commit
//! lock. Nothing else opens one while the store runs (the open and the
//! close run alone). The shuttle tests still bound the case: each
//! run has a wall-clock watchdog that aborts the test binary with a message
//! instead of hanging.
//!
//! [Shuttle]: https://docs.rs/shuttle

#[cfg(not(all(test, shuttle)))]
#[cfg_attr(
    not(feature = "redb"),
    allow(unused_imports, reason = "the redb write path uses the rest")
)]
pub(crate) use std::{
    sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, atomic},
    thread,
    time::Instant,
};

#[cfg(all(test, shuttle))]
pub(crate) use model::{Condvar, Instant};
#[cfg(all(test, shuttle))]
pub(crate) use shuttle::{
    sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, atomic},
    thread,
};

/// Shuttle's missing pieces: a virtual clock and a condvar that may return
/// early. See the module docs.
#[cfg(all(test, shuttle))]
mod model {
    use shuttle::rand::{Rng, thread_rng};
    use shuttle::sync::{LockResult, MutexGuard, PoisonError};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    /// Largest step of the virtual clock at one reading, in ms.
    pub(crate) const STEP_MS: u64 = 2;
    /// A wait returns early (spuriously, or timed out) once in this many.
    pub(crate) const EARLY_ONE_IN: u32 = 8;

    shuttle::lazy_static! {
        // Per execution: Shuttle drops it at the end of each. A std atomic,
        // not Shuttle's: reading the clock is no scheduling point.
        static ref NOW_MS: AtomicU64 = AtomicU64::new(0);
    }

    fn advance(by: Duration) -> Duration {
        let by = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        Duration::from_millis(NOW_MS.fetch_add(by, Ordering::SeqCst).saturating_add(by))
    }

    /// A point on the virtual clock: the time since the execution began.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    pub(crate) struct Instant(Duration);

    impl Instant {
        /// Reads the clock, which first moves on by 0 to [`STEP_MS`] ms.
        pub(crate) fn now() -> Instant {
            let step = thread_rng().gen_range(0..=STEP_MS);
            Instant(advance(Duration::from_millis(step)))
        }

        /// The time from `self` to a new reading.
        pub(crate) fn elapsed(&self) -> Duration {
            Instant::now().0.saturating_sub(self.0)
        }

        /// The time from `earlier` to `self`, zero if `earlier` is later.
        pub(crate) fn saturating_duration_since(&self, earlier: Instant) -> Duration {
            self.0.saturating_sub(earlier.0)
        }
    }

    impl std::ops::Add<Duration> for Instant {
        type Output = Instant;
        fn add(self, d: Duration) -> Instant {
            Instant(self.0.saturating_add(d))
        }
    }

    fn early() -> bool {
        thread_rng().gen_range(0..EARLY_ONE_IN) == 0
    }

    /// What [`Condvar::wait_timeout`] says besides the guard.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct WaitTimeoutResult(bool);

    impl WaitTimeoutResult {
        /// Whether the wait ended by its timeout.
        #[allow(dead_code)] // std's type has it; no caller asks yet.
        pub(crate) fn timed_out(&self) -> bool {
            self.0
        }
    }

    /// Shuttle's condvar, with early returns. See the module docs.
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(shuttle::sync::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Condvar {
            Condvar(shuttle::sync::Condvar::new())
        }

        pub(crate) fn wait<'a, T>(
            &self,
            guard: MutexGuard<'a, T>,
        ) -> LockResult<MutexGuard<'a, T>> {
            if early() {
                return Ok(guard);
            }
            self.0.wait(guard)
        }

        pub(crate) fn wait_timeout<'a, T>(
            &self,
            guard: MutexGuard<'a, T>,
            dur: Duration,
        ) -> LockResult<(MutexGuard<'a, T>, WaitTimeoutResult)> {
            if early() {
                advance(dur);
                return Ok((guard, WaitTimeoutResult(true)));
            }
            match self.0.wait(guard) {
                Ok(guard) => Ok((guard, WaitTimeoutResult(false))),
                Err(p) => Err(PoisonError::new((p.into_inner(), WaitTimeoutResult(false)))),
            }
        }

        pub(crate) fn notify_one(&self) {
            self.0.notify_one();
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }
}
