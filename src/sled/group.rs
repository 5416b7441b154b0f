//! Group commit for sled: many writers, one flush + fsync.
//!
//! Every write transaction takes a sequence number before it commits
//! (`issued`) and publishes it after (`completed`; transactions are
//! serialised by the store's writer lock, so sequence numbers complete in
//! order). A caller that must not answer before its write (or a write it
//! read) is durable calls [`GroupSync::wait_durable`] with that number.
//!
//! Whoever finds no flush in progress becomes the leader: it notes the
//! highest completed sequence number, runs the flush step (sled flush +
//! fdatasync) and publishes that number as durable. Callers that arrive
//! while a flush is running wait on a condition variable and are covered by
//! the next round, which one of them leads. So under load one fsync covers
//! every write that committed during the previous fsync.
//!
//! A failed flush poisons the group: whether the covered writes reached the
//! disk is unknown, so nothing after it may be acknowledged. Every caller
//! whose write (or read) the failed round covered gets the same error, the
//! round's own ([`Error::replicate`]), whether it led the round or waited
//! for it: the variant, and so [`Error::is_transient`], does not depend on
//! who happened to lead. Callers the round did not cover get
//! [`Error::Poisoned`], as every later write does.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// The durability state shared by all writers of one store.
#[derive(Debug, Default)]
pub(crate) struct GroupSync {
    /// Highest sequence number handed to a write transaction.
    issued: AtomicU64,
    /// Highest sequence number whose transaction has finished (committed or
    /// failed): every number up to it is finished.
    completed: AtomicU64,
    /// Highest sequence number known durable, readable without the lock.
    durable_hint: AtomicU64,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Debug, Default)]
struct State {
    durable: u64,
    leader: bool,
    poisoned: bool,
    /// The first failed round: the highest sequence number it covered, and
    /// its error, for every caller it covered.
    failed: Option<(u64, Error)>,
}

impl GroupSync {
    /// Takes the next sequence number. Call with the writer lock held,
    /// right before the transaction.
    pub(crate) fn issue(&self) -> u64 {
        self.issued.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Publishes that the transaction holding `seq` has finished. Call with
    /// the writer lock held, whatever the transaction's outcome, so that
    /// `completed` never stalls.
    pub(crate) fn finish(&self, seq: u64) {
        self.completed.store(seq, Ordering::SeqCst);
    }

    /// Takes the next sequence number and returns a guard that finishes it
    /// when dropped, also if the transaction panics (readers wait for
    /// `completed` to reach the numbers they saw issued). A panic poisons
    /// the group: the transaction may be half-applied in memory.
    pub(crate) fn begin_write(&self) -> WriteTicket<'_> {
        WriteTicket {
            group: self,
            seq: self.issue(),
        }
    }

    /// The sequence number that covers everything a read may have seen:
    /// any transaction visible to a read made before this call took its
    /// number before it committed.
    pub(crate) fn read_horizon(&self) -> u64 {
        self.issued.load(Ordering::SeqCst)
    }

    /// True once the transaction holding `seq` (and every earlier one) has
    /// finished.
    pub(crate) fn is_finished(&self, seq: u64) -> bool {
        self.completed.load(Ordering::SeqCst) >= seq
    }

    /// True once a flush has failed.
    pub(crate) fn is_poisoned(&self) -> bool {
        self.lock().poisoned
    }

    /// Marks the group poisoned without a flush (a failed commit).
    pub(crate) fn poison(&self) {
        self.lock().poisoned = true;
        self.wake.notify_all();
    }

    /// Returns once every write up to `seq` is durable, leading a flush
    /// round with `flush` when none is running. When a round fails, every
    /// caller whose `seq` it covered (its leader, those waiting for it, and
    /// those that come to wait later) gets the flush's error, replicated;
    /// every other caller gets [`Error::Poisoned`].
    pub(crate) fn wait_durable(&self, seq: u64, flush: impl Fn() -> Result<()>) -> Result<()> {
        if self.durable_hint.load(Ordering::SeqCst) >= seq {
            return Ok(());
        }
        // Wait for the transaction that took `seq` to finish, so that the
        // round we lead or join covers it. Callers that may be early block
        // on the writer lock first (see `Inner::wait_durable`); this spin
        // is the backstop.
        while self.completed.load(Ordering::SeqCst) < seq {
            std::thread::yield_now();
        }
        let mut state = self.lock();
        loop {
            if state.durable >= seq {
                return Ok(());
            }
            if let Some((covered, error)) = &state.failed
                && seq <= *covered
            {
                return Err(error.replicate());
            }
            if state.poisoned {
                return Err(Error::Poisoned { cause: None });
            }
            if state.leader {
                state = self.wake.wait(state).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            state.leader = true;
            let covered = self.completed.load(Ordering::SeqCst);
            drop(state);
            let outcome = flush();
            state = self.lock();
            state.leader = false;
            match outcome {
                Ok(()) => {
                    state.durable = state.durable.max(covered);
                    self.durable_hint.store(state.durable, Ordering::SeqCst);
                    self.wake.notify_all();
                }
                Err(err) => {
                    state.poisoned = true;
                    let copy = err.replicate();
                    state.failed.get_or_insert((covered, copy));
                    self.wake.notify_all();
                    return Err(err);
                }
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a few integers updated together under the lock; a
        // panic elsewhere cannot leave it half-written.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A sequence number in use by one write transaction; see
/// [`GroupSync::begin_write`].
#[derive(Debug)]
pub(crate) struct WriteTicket<'a> {
    group: &'a GroupSync,
    seq: u64,
}

impl WriteTicket<'_> {
    /// The sequence number.
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }
}

impl Drop for WriteTicket<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.group.poison();
        }
        self.group.finish(self.seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn one_round_covers_every_finished_write() {
        let g = GroupSync::default();
        let flushes = AtomicU32::new(0);
        let flush = || {
            flushes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        for _ in 0..3 {
            let seq = g.issue();
            g.finish(seq);
        }
        g.wait_durable(3, flush).unwrap();
        g.wait_durable(1, flush).unwrap();
        g.wait_durable(2, flush).unwrap();
        assert_eq!(flushes.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn concurrent_waiters_share_flushes() {
        let g = Arc::new(GroupSync::default());
        let writer = Mutex::new(());
        let flushes = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..32 {
                s.spawn(|| {
                    for _ in 0..20 {
                        let seq = {
                            let _w = writer.lock().unwrap();
                            let seq = g.issue();
                            g.finish(seq);
                            seq
                        };
                        g.wait_durable(seq, || {
                            flushes.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_millis(1));
                            Ok(())
                        })
                        .unwrap();
                    }
                });
            }
        });
        let n = flushes.load(Ordering::SeqCst);
        assert!(n < 640, "{n} flushes for 640 writes: no grouping");
    }

    /// A transaction that panics must not leave readers spinning on a
    /// sequence number that never finishes, and must poison the store.
    #[test]
    fn panicking_write_finishes_its_ticket_and_poisons() {
        let g = GroupSync::default();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ticket = g.begin_write();
            panic!("engine bug");
        }));
        assert!(r.is_err());
        let horizon = g.read_horizon();
        assert!(matches!(
            g.wait_durable(horizon, || Ok(())),
            Err(Error::Poisoned { cause: None })
        ));
    }

    /// A flush that fails must never let a later caller believe its write
    /// is durable: the leader gets the flush's error, a caller the round did
    /// not cover gets Poisoned.
    #[test]
    fn failed_flush_poisons() {
        let g = GroupSync::default();
        let seq = g.issue();
        g.finish(seq);
        let err = g
            .wait_durable(seq, || Err(Error::from(std::io::Error::other("EIO"))))
            .unwrap_err();
        assert!(matches!(err, Error::Io(_)), "{err:?}");
        let later = g.issue();
        g.finish(later);
        assert!(matches!(
            g.wait_durable(later, || Ok(())),
            Err(Error::Poisoned { cause: None })
        ));
        assert!(g.is_poisoned());
    }

    /// Regression: the caller that led a failing round got the flush's I/O
    /// error (transient) and the callers waiting for the same round got
    /// Poisoned (not transient), so what a caller saw depended on who led.
    /// Every caller the round covered now gets the same variant, message
    /// and `is_transient()`.
    #[test]
    fn every_caller_of_a_failed_round_gets_the_same_error() {
        const CALLERS: u64 = 16;
        let g = GroupSync::default();
        for _ in 0..CALLERS {
            let seq = g.issue();
            g.finish(seq);
        }
        let started = std::sync::Barrier::new(usize::try_from(CALLERS).unwrap());
        let errors: Vec<Error> = std::thread::scope(|s| {
            let handles: Vec<_> = (1..=CALLERS)
                .map(|seq| {
                    let (g, started) = (&g, &started);
                    s.spawn(move || {
                        started.wait();
                        g.wait_durable(seq, || {
                            // Hold the round open so that the others queue
                            // behind it, then fail as a disk would.
                            std::thread::sleep(std::time::Duration::from_millis(20));
                            Err(Error::from(std::io::Error::new(
                                std::io::ErrorKind::StorageFull,
                                "EIO",
                            )))
                        })
                        .unwrap_err()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let first = errors.first().unwrap();
        for err in &errors {
            assert!(
                matches!(err, Error::Io(e) if e.kind() == std::io::ErrorKind::StorageFull),
                "{err:?}"
            );
            assert_eq!(err.to_string(), first.to_string());
            assert_eq!(err.is_transient(), first.is_transient());
        }
        // A write the failed round did not cover is refused as Poisoned.
        let later = g.issue();
        g.finish(later);
        assert!(matches!(
            g.wait_durable(later, || Ok(())),
            Err(Error::Poisoned { cause: None })
        ));
    }
}
