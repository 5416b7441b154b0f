//! The commit line's data: a write as queued ([`Op`]), its answer
//! ([`Reply`]), the [`Slot`] where its caller waits, the [`InLine`] of them
//! and the line's sizes. Who leads is `commit/leader.rs`'s.

use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, Claim};
use crate::response::Response;
use crate::step::Step;
use crate::sync::{Arc, Condvar, Mutex, MutexGuard};
use crate::time::Timestamp;
use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// The line of callers waiting to commit, and its wake-ups.
pub(super) struct Line {
    callers: Mutex<InLine>,
    /// Signalled when a leader takes a group out of a full line.
    pub(super) room: Condvar,
    /// Wakes the committer thread (commit/leader.rs) when it is given the leader
    /// role, or the line closes.
    pub(super) committer: Condvar,
    /// Most ops a leader commits in one group.
    pub(super) max_group: usize,
}

impl Default for Line {
    fn default() -> Line {
        Line {
            callers: Mutex::new(InLine::default()),
            room: Condvar::new(),
            committer: Condvar::new(),
            max_group: MAX_GROUP_OPS,
        }
    }
}

impl Line {
    pub(super) fn lock(&self) -> MutexGuard<'_, InLine> {
        self.callers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A write in line. Keys are already encoded.
#[derive(Debug)]
pub(super) enum Op {
    Begin {
        key: Vec<u8>,
        fingerprint: Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    },
    Complete {
        key: Vec<u8>,
        claim: Claim,
        response: Response,
        now: Timestamp,
        retention: Duration,
    },
    Release {
        key: Vec<u8>,
        claim: Claim,
    },
    Renew {
        key: Vec<u8>,
        claim: Claim,
        now: Timestamp,
        lease: Duration,
    },
    Step {
        key: Vec<u8>,
        claim: Claim,
        step: Step,
        now: Timestamp,
    },
    Sweep {
        now: Timestamp,
        max: usize,
    },
}

/// The answer to one [`Op`].
#[derive(Debug)]
pub(super) enum Reply {
    Begin(Begin),
    Done,
    Renewed(Claim),
    Swept(usize),
}

/// Requests that may wait in a store's line (a caller that finds it full waits).
pub(crate) const WRITE_QUEUE_DEPTH: usize = 4_096;
/// Most requests a leader commits in one group (one log frame).
pub(crate) const MAX_GROUP_OPS: usize = 1_024;

/// Who waits on a [`Slot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::redb) enum Waiter {
    /// A blocked thread (`submit`): it may be made the leader.
    Thread,
    /// A future (`submit_async`): woken through its waker; it
    /// never leads, since leading would block its runtime thread on an fsync.
    Task,
    /// Nobody: a release queued on behalf of a dropped future.
    Nobody,
}

/// Where one queued caller waits.
#[derive(Debug)]
pub(in crate::redb) struct Slot {
    state: Mutex<SlotInner>,
    cv: Condvar,
    pub(in crate::redb) waiter: Waiter,
}

#[derive(Debug, Default)]
struct SlotInner {
    state: SlotState,
    /// A task's waker, from its latest poll.
    waker: Option<Waker>,
    /// Nobody will take the answer (a dropped future, a release nobody
    /// waits for): the leader keeps it (see [`Slot::answer`]).
    abandoned: bool,
}

#[derive(Debug, Default)]
enum SlotState {
    #[default]
    Waiting,
    /// The caller is now the leader.
    Lead,
    Done(Result<Reply>),
}

impl Slot {
    pub(in crate::redb) fn new(waiter: Waiter) -> Slot {
        Slot {
            state: Mutex::new(SlotInner {
                abandoned: waiter == Waiter::Nobody,
                ..SlotInner::default()
            }),
            cv: Condvar::new(),
            waiter,
        }
    }

    fn lock(&self) -> MutexGuard<'_, SlotInner> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sleeps until this caller is answered (`Some`) or made the leader
    /// (`None`).
    pub(in crate::redb) fn wait(&self) -> Option<Result<Reply>> {
        let mut inner = self.lock();
        loop {
            match std::mem::take(&mut inner.state) {
                SlotState::Waiting => {
                    inner = self.cv.wait(inner).unwrap_or_else(|p| p.into_inner());
                }
                SlotState::Lead => return None,
                SlotState::Done(answer) => return Some(answer),
            }
        }
    }

    /// Makes this (thread) caller the leader.
    pub(in crate::redb) fn lead(&self) {
        self.lock().state = SlotState::Lead;
        self.cv.notify_one();
    }

    /// Hands the caller its answer and wakes it. An abandoned slot's answer
    /// comes back: nobody else will see it.
    pub(in crate::redb) fn answer(&self, answer: Result<Reply>) -> Option<Result<Reply>> {
        let waker = {
            let mut inner = self.lock();
            if inner.abandoned {
                return Some(answer);
            }
            inner.state = SlotState::Done(answer);
            inner.waker.take()
        };
        match waker {
            Some(waker) => waker.wake(),
            None => self.cv.notify_one(),
        }
        None
    }

    /// A task's poll: its answer, or `Pending` with its waker kept.
    pub(in crate::redb) fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<Reply>> {
        let mut inner = self.lock();
        match std::mem::take(&mut inner.state) {
            SlotState::Done(answer) => Poll::Ready(answer),
            other => {
                inner.state = other;
                match &inner.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => inner.waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }

    /// A dropped future gives its slot up: the answer if it came already
    /// (its caller must deal with it), or `None` and the leader will.
    pub(in crate::redb) fn abandon(&self) -> Option<Result<Reply>> {
        let mut inner = self.lock();
        inner.abandoned = true;
        inner.waker = None;
        match std::mem::take(&mut inner.state) {
            SlotState::Done(answer) => Some(answer),
            _ => None,
        }
    }
}

/// The line of callers.
#[derive(Debug, Default)]
pub(in crate::redb) struct InLine {
    pub(in crate::redb) waiting: VecDeque<(Op, Arc<Slot>)>,
    /// Someone holds the leader role. When false the line is empty, so a
    /// caller that finds no leader is at the front of the line.
    pub(in crate::redb) leading: bool,
    /// Threads ([`Waiter::Thread`]) in the line: only they, or the
    /// committer, can take the role.
    pub(in crate::redb) threads: usize,
    /// The committer thread holds the role (commit/leader.rs).
    pub(in crate::redb) committer: bool,
    /// The store is being dropped: no caller joins the line any more.
    pub(in crate::redb) closed: bool,
    /// The committer has stopped: nothing joins the line at all.
    pub(in crate::redb) stopped: bool,
    /// Tasks waiting for room in a full line.
    pub(in crate::redb) room: Vec<Waker>,
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Slot {
        /// The caller was made the leader and has not taken the role yet.
        pub(in crate::redb) fn is_leading(&self) -> bool {
            matches!(self.lock().state, SlotState::Lead)
        }

        /// The caller waits: neither answered nor made the leader.
        pub(in crate::redb) fn is_waiting(&self) -> bool {
            matches!(self.lock().state, SlotState::Waiting)
        }
    }

    /// Counts its wakes.
    #[derive(Default)]
    struct Wakes(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A future polled again with another waker (a task moved between
    /// executors, or `select!` polling it from a new task) is woken through
    /// the last one: a slot that kept the first waker would leave its
    /// future asleep with its answer.
    #[test]
    fn a_slot_wakes_the_waker_of_its_last_poll() {
        let slot = Slot::new(Waiter::Task);
        let (first, last) = (Arc::new(Wakes::default()), Arc::new(Wakes::default()));
        for wakes in [&first, &first, &last] {
            let waker = std::task::Waker::from(Arc::clone(wakes));
            let mut cx = Context::from_waker(&waker);
            assert!(slot.poll(&mut cx).is_pending());
        }
        assert!(slot.answer(Ok(Reply::Done)).is_none(), "not abandoned");
        let count = |w: &Arc<Wakes>| w.0.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!((count(&first), count(&last)), (0, 1));
        let waker = std::task::Waker::from(Arc::clone(&last));
        let mut cx = Context::from_waker(&waker);
        assert!(matches!(slot.poll(&mut cx), Poll::Ready(Ok(Reply::Done))));
    }
}
