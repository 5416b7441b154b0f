//! The line of callers and the leader role: a caller queues its request
//! in a [`Slot`]; the first thread in line leads a group
//! ([`Shared::lead_once`], the commit in `commit/mod.rs`), passes the role
//! on and answers the group. Futures wait in the same line but never lead:
//! the committer thread (native.rs) leads for them. A full line
//! (`WRITE_QUEUE_DEPTH`) makes a caller wait for room.

use super::super::Shared;
use super::super::health::On;
use super::{Op, Reply};
use crate::error::{Error, Result};
use crate::record::Begin;
use crate::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};

/// Requests that may wait in a store's line. A caller that finds it full
/// waits for room (back-pressure); nothing is ever dropped.
pub(crate) const WRITE_QUEUE_DEPTH: usize = 4_096;
/// Most requests a leader commits in one group (one log frame).
pub(crate) const MAX_WRITE_BATCH: usize = 1_024;

/// Who waits on a [`Slot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(in crate::redb) enum Waiter {
    /// A blocked thread (`submit`): it may be made the leader.
    #[default]
    Thread,
    /// A future (`submit_async`, native.rs): woken through its waker; it
    /// never leads, since leading would block its runtime thread on an fsync.
    Task,
    /// Nobody: a release queued on behalf of a dropped future.
    Nobody,
}

/// Where one queued caller waits.
#[derive(Debug, Default)]
pub(in crate::redb) struct Slot {
    state: Mutex<SlotInner>,
    cv: Condvar,
    waiter: Waiter,
}

#[derive(Debug, Default)]
struct SlotInner {
    state: SlotState,
    /// A task's waker, from its latest poll.
    waker: Option<Waker>,
    /// Nobody will take the answer (a dropped future, a detached op): the
    /// leader keeps it (see [`Slot::answer`]).
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
    fn wait(&self) -> Option<Result<Reply>> {
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
    fn lead(&self) {
        self.lock().state = SlotState::Lead;
        self.cv.notify_one();
    }

    /// Hands the caller its answer and wakes it. An abandoned slot's answer
    /// comes back: nobody else will see it.
    fn answer(&self, answer: Result<Reply>) -> Option<Result<Reply>> {
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
pub(in crate::redb) struct Queue {
    pub(in crate::redb) waiting: VecDeque<(Op, Arc<Slot>)>,
    /// Someone holds the leader role. When false the line is empty, so a
    /// caller that finds no leader is at the front of the line.
    leading: bool,
    /// Threads ([`Waiter::Thread`]) in the line: only they, or the
    /// committer, can take the role.
    threads: usize,
    /// The committer thread holds the role (native.rs).
    pub(in crate::redb) committer: bool,
    /// The store is being dropped: no caller joins the line any more.
    pub(in crate::redb) closed: bool,
    /// The committer has stopped: nothing joins the line at all.
    pub(in crate::redb) stopped: bool,
    /// Tasks waiting for room in a full line.
    pub(in crate::redb) room: Vec<Waker>,
}

impl Shared {
    /// [`Error::ReadOnly`] for a store opened read-only.
    pub(in crate::redb) fn check_writable(&self) -> Result<()> {
        match &self.read_only {
            Some(path) => Err(Error::ReadOnly { path: path.clone() }),
            None => Ok(()),
        }
    }

    /// The checks before a request joins the line: writable, not poisoned.
    pub(in crate::redb) fn check_submit(&self) -> Result<()> {
        self.check_writable()?;
        self.check_healthy()
    }

    /// Queues `op` and returns its answer, leading groups while this caller
    /// is at the front of the line. A full line (`WRITE_QUEUE_DEPTH`) waits
    /// for room.
    pub(in crate::redb) fn submit(&self, op: Op) -> Result<Reply> {
        self.check_submit()?;
        let mine = Arc::new(Slot::new(Waiter::Thread));
        let lead = {
            let mut q = self.lock_queue();
            while q.waiting.len() >= WRITE_QUEUE_DEPTH && !q.closed {
                q = self.queue_room.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if q.closed {
                return Err(Error::Closed);
            }
            let lead = !q.leading;
            self.push(&mut q, op, Arc::clone(&mine));
            lead
        };
        if !lead && let Some(answer) = mine.wait() {
            return answer;
        }
        loop {
            if let Some(answer) = self.lead_once(Some(&mine)) {
                return answer;
            }
            // Not in this group (the line was longer than a group): wait
            // for the role to come back, or for an answer.
            if let Some(answer) = mine.wait() {
                return answer;
            }
        }
    }

    /// Puts `op` at the back of the line. A thread that finds no leader
    /// takes the role itself (its caller leads); a task or a detached op
    /// hands it to the committer thread.
    pub(in crate::redb) fn push(&self, q: &mut Queue, op: Op, slot: Arc<Slot>) {
        let waiter = slot.waiter;
        q.waiting.push_back((op, slot));
        if waiter == Waiter::Thread {
            q.threads += 1;
        }
        if !std::mem::replace(&mut q.leading, true) && waiter != Waiter::Thread {
            self.wake_committer(q);
        }
    }

    /// Gives the leader role to the committer thread.
    fn wake_committer(&self, q: &mut Queue) {
        if !std::mem::replace(&mut q.committer, true) {
            self.committer_cv.notify_one();
        }
    }

    /// Queues a release nobody waits for (a dropped future's claim); the
    /// committer leads it if no one else does. Nothing is queued once the
    /// committer has stopped: the claim then ends with its lease.
    pub(in crate::redb) fn detach(&self, op: Op) {
        let mut q = self.lock_queue();
        if !q.stopped {
            self.push(&mut q, op, Arc::new(Slot::new(Waiter::Nobody)));
        }
    }

    /// One turn of the role: commits the group at the front of the line,
    /// passes the role on, answers the group. Returns `mine`'s answer when
    /// it was in the group.
    pub(in crate::redb) fn lead_once(&self, mine: Option<&Arc<Slot>>) -> Option<Result<Reply>> {
        let (group, room) = {
            let mut q = self.lock_queue();
            let full = q.waiting.len() >= WRITE_QUEUE_DEPTH;
            let n = q.waiting.len().min(self.max_batch);
            let group: Vec<(Op, Arc<Slot>)> = q.waiting.drain(..n).collect();
            let threads = group
                .iter()
                .filter(|(_, s)| s.waiter == Waiter::Thread)
                .count();
            q.threads = q.threads.saturating_sub(threads);
            // A notify is a syscall even with nobody waiting: only a
            // full line can have callers waiting for room.
            if full {
                self.queue_room.notify_all();
            }
            (
                group,
                if full {
                    std::mem::take(&mut q.room)
                } else {
                    Vec::new()
                },
            )
        };
        room.into_iter().for_each(Waker::wake);
        let (ops, slots): (Vec<Op>, Vec<Arc<Slot>>) = group.into_iter().unzip();
        // A dropped future can empty the line under the committer.
        let answers = if ops.is_empty() {
            Vec::new()
        } else {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.commit_group(&ops)))
                .unwrap_or_else(|_| {
                    // A bug while leading: what was written is unknown.
                    let error = Error::backend("a panic while committing a group");
                    let error = self.fail("commit", On::Store, error);
                    ops.iter().map(|_| Err(error.replicate())).collect()
                })
        };
        // Pass the role on first: the next group's commit overlaps the
        // wake-ups of this one's followers.
        self.pass_role(&mut self.lock_queue());
        let mut own = None;
        for ((op, slot), answer) in ops.into_iter().zip(slots).zip(answers) {
            if mine.is_some_and(|m| Arc::ptr_eq(m, &slot)) {
                own = Some(answer);
            } else if let Some(unseen) = slot.answer(answer) {
                // Its future was dropped while the group committed: a claim
                // nobody will see is given back at once.
                if let (Op::Begin { key, .. }, Ok(Reply::Begin(Begin::Claimed(claim)))) =
                    (op, unseen)
                {
                    self.detach(Op::Release { key, claim });
                }
            }
        }
        own
    }

    /// The role goes to the first thread in line (it is blocked anyway),
    /// else to the committer while the line holds tasks, else to nobody.
    fn pass_role(&self, q: &mut Queue) {
        if q.waiting.is_empty() {
            q.leading = false;
            q.committer = false;
            return;
        }
        if q.threads > 0
            && let Some((_, next)) = q.waiting.iter().find(|(_, s)| s.waiter == Waiter::Thread)
        {
            q.committer = false;
            next.lead();
            return;
        }
        self.wake_committer(q);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{begin, shared};
    use super::*;
    use std::time::Duration;

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

    /// A thread that finds the line full waits for room
    /// (`WRITE_QUEUE_DEPTH`): the line never grows past it. Closing the
    /// line lets the waiter go with `Error::Closed`.
    #[test]
    fn a_full_line_makes_a_thread_wait_for_room() {
        let shared = shared(true);
        {
            let mut q = shared.lock_queue();
            for i in 0..WRITE_QUEUE_DEPTH {
                let id = format!("k{i}");
                shared.push(
                    &mut q,
                    begin(id.as_bytes()),
                    Arc::new(Slot::new(Waiter::Nobody)),
                );
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let submitter = Arc::clone(&shared);
        std::thread::spawn(move || {
            let _ = tx.send(submitter.submit(begin(b"late")));
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(100)).is_err(),
            "the caller waits"
        );
        assert_eq!(shared.lock_queue().waiting.len(), WRITE_QUEUE_DEPTH);
        shared.lock_queue().closed = true;
        shared.queue_room.notify_all();
        let answer = rx.recv_timeout(Duration::from_secs(10));
        assert!(matches!(answer, Ok(Err(Error::Closed))), "{answer:?}");
        assert_eq!(shared.lock_queue().waiting.len(), WRITE_QUEUE_DEPTH);
    }

    /// After its group, a leader passes the role to the first thread in
    /// line (it is blocked anyway), past the tasks before it: not to the
    /// committer, which would cost that thread a wake-up round trip.
    #[test]
    fn the_role_passes_to_the_first_thread_in_line() {
        let mut shared = shared(true);
        Arc::get_mut(&mut shared).expect("not shared yet").max_batch = 1;
        let slot = |waiter| Arc::new(Slot::new(waiter));
        let (leader, task, next) = (
            slot(Waiter::Thread),
            slot(Waiter::Task),
            slot(Waiter::Thread),
        );
        {
            let mut q = shared.lock_queue();
            shared.push(&mut q, begin(b"a"), Arc::clone(&leader));
            shared.push(&mut q, begin(b"b"), Arc::clone(&task));
            shared.push(&mut q, begin(b"c"), Arc::clone(&next));
            // A thread leads: the task behind it does not call the committer.
            assert!(!q.committer);
        }
        let own = shared.lead_once(Some(&leader));
        assert!(
            matches!(own, Some(Ok(Reply::Begin(Begin::Claimed(_))))),
            "{own:?}"
        );
        assert!(
            matches!(next.lock().state, SlotState::Lead),
            "the thread leads next"
        );
        assert!(matches!(task.lock().state, SlotState::Waiting));
        let q = shared.lock_queue();
        assert!(!q.committer, "the committer was not asked");
        assert_eq!((q.waiting.len(), q.threads), (2, 1));
    }
}
