//! The leader role: the first thread in line leads a group
//! ([`Shared::lead_once`]), passes the role on and answers the group. A
//! future ([`Submitted`]) never leads (a runtime thread must not block on
//! an fsync): the committer thread leads for it. A full line makes a thread
//! wait and a future pend. A future dropped in line leaves it; dropped
//! later, a claim nobody saw is released through the line (docs/design.md,
//! "Futures in the line").

use super::super::Shared;
use super::super::health::On;
use super::super::shared::{InLine, MAX_GROUP_OPS, Op, Reply, Slot, WRITE_QUEUE_DEPTH, Waiter};
use crate::error::{Error, Result};
use crate::record::Begin;
use crate::sync::{Arc, MutexGuard};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

impl Shared {
    /// The checks before a request joins the line: writable
    /// ([`Error::ReadOnly`]), not poisoned.
    pub(in crate::redb) fn check_submit(&self) -> Result<()> {
        if let Some(path) = &self.read_only {
            return Err(Error::ReadOnly { path: path.clone() });
        }
        self.db.check_healthy()
    }

    /// Puts `op` in line and returns its answer, leading groups while this caller
    /// is at the front of the line. A full line (`WRITE_QUEUE_DEPTH`) waits
    /// for room.
    pub(in crate::redb) fn submit(&self, op: Op) -> Result<Reply> {
        self.check_submit()?;
        let mine = Arc::new(Slot::new(Waiter::Thread));
        let mut lead = {
            let mut q = self.line.lock();
            while q.waiting.len() >= WRITE_QUEUE_DEPTH && !q.closed {
                q = self.line.room.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if q.closed {
                return Err(Error::Closed);
            }
            let lead = !q.leading;
            self.push(&mut q, op, Arc::clone(&mine));
            lead
        };
        loop {
            if lead && let Some(answer) = self.lead_once(Some(&mine)) {
                return answer;
            }
            // Wait for an answer, or for the role (after leading: this
            // caller was not in the group, a long line).
            if let Some(answer) = mine.wait() {
                return answer;
            }
            lead = true;
        }
    }

    /// Puts `op` at the back of the line. A thread that finds no leader
    /// takes the role itself (its caller leads); a task, or a release
    /// nobody waits for, hands it to the committer thread.
    pub(in crate::redb) fn push(&self, q: &mut InLine, op: Op, slot: Arc<Slot>) {
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
    fn wake_committer(&self, q: &mut InLine) {
        if !std::mem::replace(&mut q.committer, true) {
            self.line.committer.notify_one();
        }
    }

    /// Gives back a claim of `key` that nobody will see (a dropped future's
    /// `answer`): its release is queued with nobody waiting, and the
    /// committer leads it if no one else does. Once the committer has
    /// stopped, nothing is queued: the claim then ends with its lease.
    pub(in crate::redb) fn release_unseen(&self, key: Vec<u8>, answer: Result<Reply>) {
        let Ok(Reply::Begin(Begin::Claimed(claim))) = answer else {
            return;
        };
        let mut q = self.line.lock();
        if !q.stopped {
            let release = Op::Release { key, claim };
            self.push(&mut q, release, Arc::new(Slot::new(Waiter::Nobody)));
        }
    }

    /// One turn of the role: commits the group at the front of the line,
    /// passes the role on, answers the group. Returns `mine`'s answer when
    /// it was in the group.
    pub(in crate::redb) fn lead_once(&self, mine: Option<&Arc<Slot>>) -> Option<Result<Reply>> {
        let (ops, slots) = {
            let mut q = self.line.lock();
            let full = q.waiting.len() >= WRITE_QUEUE_DEPTH;
            let n = q.waiting.len().min(MAX_GROUP_OPS);
            let (ops, slots): (Vec<Op>, Vec<Arc<Slot>>) = q.waiting.drain(..n).unzip();
            let threads = slots.iter().filter(|s| s.waiter == Waiter::Thread).count();
            q.threads = q.threads.saturating_sub(threads);
            self.make_room(q, full);
            (ops, slots)
        };
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
        self.pass_role(&mut self.line.lock());
        let mut own = None;
        for ((op, slot), answer) in ops.into_iter().zip(slots).zip(answers) {
            if mine.is_some_and(|m| Arc::ptr_eq(m, &slot)) {
                own = Some(answer);
            } else if let (Some(unseen), Op::Begin { key, .. }) = (slot.answer(answer), op) {
                // Its future was dropped while the group committed.
                self.release_unseen(key, unseen);
            }
        }
        own
    }

    /// The role goes to the first thread in line (it is blocked anyway),
    /// else to the committer while the line holds tasks, else to nobody.
    fn pass_role(&self, q: &mut InLine) {
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

/// A request in the line, as a future (see the module docs).
pub(in crate::redb) struct Submitted {
    shared: Arc<Shared>,
    state: State,
    /// A `begin`'s key, to release a claim its dropped caller never saw.
    begin_key: Option<Vec<u8>>,
}

enum State {
    /// The line was full: the op waits here for room.
    Room(Op),
    Waiting(Arc<Slot>),
    Finished,
}

impl Shared {
    /// Puts `op` in line without blocking and returns the future of its
    /// answer; refused at once (read-only, poisoned, closed) otherwise.
    pub(in crate::redb) fn submit_async(self: &Arc<Self>, op: Op) -> Result<Submitted> {
        self.check_submit()?;
        let begin_key = match &op {
            Op::Begin { key, .. } => Some(key.clone()),
            _ => None,
        };
        let mut submitted = Submitted {
            shared: Arc::clone(self),
            state: State::Room(op),
            begin_key,
        };
        let refused = submitted.try_join(&mut self.line.lock());
        refused.map_or(Ok(submitted), Err)
    }

    /// The committer thread's body: leads while it holds the role, sleeps
    /// otherwise, and stops once the store is closed and the line is empty.
    pub(in crate::redb) fn run_committer(&self) {
        let mut q = self.line.lock();
        loop {
            if q.committer {
                drop(q);
                let _ = self.lead_once(None);
                q = self.line.lock();
                continue;
            }
            if q.closed && q.waiting.is_empty() {
                q.stopped = true;
                return;
            }
            q = self
                .line
                .committer
                .wait(q)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Closes the line (the store is being dropped): nothing joins it any
    /// more, and every waiter for room is woken to hear so. The committer
    /// commits what is left, then stops.
    pub(in crate::redb) fn close_line(&self) {
        let mut q = self.line.lock();
        q.closed = true;
        self.line.committer.notify_all();
        self.make_room(q, true);
    }

    /// Wakes the callers waiting for room if the line was `full` (only then
    /// can there be any, and a notify is a syscall even with nobody
    /// waiting): the threads, and the tasks once `q` is let go.
    fn make_room(&self, mut q: MutexGuard<'_, InLine>, full: bool) {
        if full {
            self.line.room.notify_all();
            let room = std::mem::take(&mut q.room);
            drop(q);
            room.into_iter().for_each(Waker::wake);
        }
    }

    /// A dropped future's slot: out of the line if it is still there, else
    /// abandoned; a claim it made and nobody saw is released.
    fn abandon(&self, slot: &Arc<Slot>, begin_key: Option<Vec<u8>>) {
        let mut q = self.line.lock();
        if let Some(at) = q.waiting.iter().position(|(_, s)| Arc::ptr_eq(s, slot)) {
            let full = q.waiting.len() >= WRITE_QUEUE_DEPTH;
            let _ = q.waiting.remove(at);
            return self.make_room(q, full);
        }
        drop(q);
        if let (Some(answer), Some(key)) = (slot.abandon(), begin_key) {
            self.release_unseen(key, answer);
        }
    }
}

impl Submitted {
    /// Moves the op into the line if there is room (`None`), or registers
    /// nothing and leaves it here; `Some(error)` when the line is closed.
    fn try_join(&mut self, q: &mut InLine) -> Option<Error> {
        if q.closed {
            self.state = State::Finished;
            return Some(Error::Closed);
        }
        if q.waiting.len() >= WRITE_QUEUE_DEPTH {
            return None;
        }
        if let State::Room(op) = std::mem::replace(&mut self.state, State::Finished) {
            let slot = Arc::new(Slot::new(Waiter::Task));
            self.shared.push(q, op, Arc::clone(&slot));
            self.state = State::Waiting(slot);
        }
        None
    }
}

impl Future for Submitted {
    type Output = Result<Reply>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Reply>> {
        let this = self.get_mut();
        if matches!(this.state, State::Room(_)) {
            let shared = Arc::clone(&this.shared);
            let mut q = shared.line.lock();
            if let Some(refused) = this.try_join(&mut q) {
                return Poll::Ready(Err(refused));
            }
            if matches!(this.state, State::Room(_)) {
                q.room.push(cx.waker().clone());
                return Poll::Pending;
            }
        }
        match &this.state {
            State::Waiting(slot) => {
                let answer = std::task::ready!(slot.poll(cx));
                this.state = State::Finished;
                Poll::Ready(answer)
            }
            State::Room(_) | State::Finished => Poll::Ready(Err(Error::backend(
                "a store future was polled after it completed",
            ))),
        }
    }
}

impl Drop for Submitted {
    fn drop(&mut self) {
        if let State::Waiting(slot) = std::mem::replace(&mut self.state, State::Finished) {
            self.shared.abandon(&slot, self.begin_key.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{D, begin, shared};
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::time::Timestamp;
    use std::time::Duration;

    /// A thread that finds the line full waits for room
    /// (`WRITE_QUEUE_DEPTH`): the line never grows past it. Closing the
    /// line lets the waiter go with `Error::Closed`.
    #[test]
    fn a_full_line_makes_a_thread_wait_for_room() {
        let shared = shared();
        {
            let mut q = shared.line.lock();
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
        assert_eq!(shared.line.lock().waiting.len(), WRITE_QUEUE_DEPTH);
        shared.line.lock().closed = true;
        shared.line.room.notify_all();
        let answer = rx.recv_timeout(Duration::from_secs(10));
        assert!(matches!(answer, Ok(Err(Error::Closed))), "{answer:?}");
        assert_eq!(shared.line.lock().waiting.len(), WRITE_QUEUE_DEPTH);
    }

    /// After its group, a leader passes the role to the first thread in
    /// line (it is blocked anyway), past the tasks before it: not to the
    /// committer, which would cost that thread a wake-up round trip.
    #[test]
    fn the_role_passes_to_the_first_thread_in_line() {
        let shared = shared();
        let slot = |waiter| Arc::new(Slot::new(waiter));
        let (leader, task, next) = (
            slot(Waiter::Thread),
            slot(Waiter::Task),
            slot(Waiter::Thread),
        );
        {
            let mut q = shared.line.lock();
            shared.push(&mut q, begin(b"a"), Arc::clone(&leader));
            // The rest of the leader's group (`MAX_GROUP_OPS`): tasks' sweeps.
            for _ in 1..MAX_GROUP_OPS {
                let sweep = Op::Sweep {
                    now: Timestamp::EPOCH,
                    max: 1,
                };
                shared.push(&mut q, sweep, slot(Waiter::Task));
            }
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
        assert!(next.is_leading(), "the thread leads next");
        assert!(task.is_waiting());
        let q = shared.line.lock();
        assert!(!q.committer, "the committer was not asked");
        assert_eq!((q.waiting.len(), q.threads), (2, 1));
    }

    fn numbered(id: usize) -> Op {
        Op::Begin {
            key: format!("\0{id}").into_bytes(),
            fingerprint: Fingerprint::of(b"fp"),
            now: Timestamp::from_millis(1_000),
            lease: D,
            retention: D,
        }
    }

    fn poll(f: &mut Submitted) -> Poll<Result<Reply>> {
        Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
    }

    fn lead_all(shared: &Shared) {
        while !shared.line.lock().waiting.is_empty() {
            let _ = shared.lead_once(None);
        }
    }

    #[test]
    fn a_full_line_keeps_the_op_until_a_group_makes_room() {
        // No committer runs here: this test leads.
        let shared = shared();
        let mut queued: Vec<Submitted> = (0..WRITE_QUEUE_DEPTH)
            .map(|i| shared.submit_async(numbered(i)).unwrap())
            .collect();
        assert!(
            shared.line.lock().committer,
            "the role went to the committer"
        );
        let mut late = shared.submit_async(numbered(WRITE_QUEUE_DEPTH)).unwrap();
        assert!(matches!(late.state, State::Room(_)));
        assert!(poll(&mut late).is_pending());
        assert_eq!(shared.line.lock().room.len(), 1);
        let _ = shared.lead_once(None);
        assert!(shared.line.lock().room.is_empty(), "woken");
        assert!(poll(&mut late).is_pending());
        assert!(matches!(late.state, State::Waiting(_)));
        lead_all(&shared);
        assert!(matches!(
            poll(&mut late),
            Poll::Ready(Ok(Reply::Begin(Begin::Claimed(_))))
        ));
        for f in &mut queued {
            assert!(matches!(
                poll(f),
                Poll::Ready(Ok(Reply::Begin(Begin::Claimed(_))))
            ));
        }
        let q = shared.line.lock();
        assert!(!q.committer && q.waiting.is_empty());
    }

    #[test]
    fn a_dropped_future_leaves_the_line_or_gives_its_claim_back() {
        let shared = shared();
        // Dropped while queued: out of the line, nothing written.
        drop(shared.submit_async(numbered(1)).unwrap());
        assert!(shared.line.lock().waiting.is_empty());
        // Dropped after its group committed, answer unread: released.
        let answered = shared.submit_async(numbered(2)).unwrap();
        lead_all(&shared);
        assert!(matches!(shared.read(b"\x002"), Ok(Some(_))));
        drop(answered);
        assert_eq!(shared.line.lock().waiting.len(), 1, "the release is queued");
        lead_all(&shared);
        assert!(matches!(shared.read(b"\x002"), Ok(None)));
        // Dropped while its group commits: the leader releases it.
        let taken = shared.submit_async(numbered(3)).unwrap();
        let State::Waiting(slot) = &taken.state else {
            panic!("queued")
        };
        assert!(slot.abandon().is_none());
        std::mem::forget(taken);
        lead_all(&shared);
        assert!(matches!(shared.read(b"\x003"), Ok(None)));
        assert!(matches!(shared.read(b"\x001"), Ok(None)));
    }

    #[test]
    fn a_closed_line_refuses_new_requests() {
        let shared = shared();
        let mut queued = shared.submit_async(numbered(1)).unwrap();
        shared.close_line();
        assert!(matches!(
            shared.submit_async(numbered(2)),
            Err(Error::Closed)
        ));
        assert!(matches!(shared.submit(numbered(3)), Err(Error::Closed)));
        // What was queued before is still answered (the committer drains).
        lead_all(&shared);
        assert!(matches!(poll(&mut queued), Poll::Ready(Ok(_))));
        shared.run_committer();
        assert!(shared.line.lock().stopped);
        // A dropped future's release after the stop is not queued.
        let claim = crate::record::Claim::unprotected();
        shared.release_unseen(b"\x001".to_vec(), Ok(Reply::Begin(Begin::Claimed(claim))));
        assert!(shared.line.lock().waiting.is_empty());
    }
}
