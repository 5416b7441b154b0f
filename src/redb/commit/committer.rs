//! The line and its committer: callers (threads and futures alike) queue
//! their ops, and the committer thread commits them in groups (`decide`,
//! one frame, one `fdatasync`) and answers each. A full line makes a thread
//! wait and a future pend. A future dropped in line leaves it; dropped
//! later, a claim nobody saw is released through the line (docs/design.md,
//! "Futures in the line").

use super::super::Shared;
use super::super::health::On;
use super::super::shared::{InLine, MAX_GROUP_OPS, Op, Reply, Slot, WRITE_QUEUE_DEPTH};
use crate::error::{Error, Result};
use crate::record::Begin;
use crate::sync::{Arc, Instant, MutexGuard};
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
        self.db.health.check()
    }

    /// Puts `op` in line and waits for its answer. A full line
    /// (`WRITE_QUEUE_DEPTH`) waits for room.
    pub(in crate::redb) fn submit(&self, op: Op) -> Result<Reply> {
        self.check_submit()?;
        let mine = Arc::new(Slot::default());
        {
            let mut q = self.line.lock();
            while q.waiting.len() >= WRITE_QUEUE_DEPTH && !q.closed {
                q = self.line.room.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if q.closed {
                return Err(Error::Closed);
            }
            self.push(&mut q, op, Arc::clone(&mine));
        }
        mine.wait()
    }

    /// Puts `op` at the back of the line, waking the committer if it sleeps.
    pub(in crate::redb) fn push(&self, q: &mut InLine, op: Op, slot: Arc<Slot>) {
        q.waiting.push_back((op, slot));
        if !std::mem::replace(&mut q.awake, true) {
            self.line.committer.notify_one();
        }
    }

    /// Gives back a claim that nobody will see (a dropped future's
    /// `answer`): its release is queued with nobody waiting. Once the
    /// committer has stopped, nothing is queued: the claim then ends with
    /// its lease.
    pub(in crate::redb) fn release_unseen(&self, answer: Result<Reply>) {
        let Ok(Reply::Begin(Begin::Claimed(claim), key)) = answer else {
            return;
        };
        let mut q = self.line.lock();
        if !q.stopped {
            let release = Op::Release { key, claim };
            self.push(&mut q, release, Arc::new(Slot::unseen()));
        }
    }

    /// One group: commits the front of the line and answers it.
    fn commit_next(&self) {
        let (mut ops, slots) = {
            let mut q = self.line.lock();
            let full = q.waiting.len() >= WRITE_QUEUE_DEPTH;
            let n = q.waiting.len().min(MAX_GROUP_OPS);
            let (ops, slots): (Vec<Op>, Vec<Arc<Slot>>) = q.waiting.drain(..n).unzip();
            self.make_room(q, full);
            (ops, slots)
        };
        // A dropped future can empty the line under the committer.
        let answers = if ops.is_empty() {
            Vec::new()
        } else {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.commit_group(&mut ops)))
                .unwrap_or_else(|_| {
                    // A bug while committing: what was written is unknown.
                    let error = Error::backend("a panic while committing a group");
                    let error = self.fail("commit", On::Store, error);
                    ops.iter().map(|_| Err(error.replicate())).collect()
                })
        };
        for (slot, answer) in slots.into_iter().zip(answers) {
            if let Some(unseen) = slot.answer(answer) {
                // Its future was dropped while the group committed.
                self.release_unseen(unseen);
            }
        }
    }
}

/// A request in the line, as a future (see the module docs).
pub(in crate::redb) struct Submitted {
    shared: Arc<Shared>,
    state: State,
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
        let mut submitted = Submitted {
            shared: Arc::clone(self),
            state: State::Room(op),
        };
        let refused = submitted.try_join(&mut self.line.lock());
        refused.map_or(Ok(submitted), Err)
    }

    /// The committer thread's body: commits groups while the line holds
    /// any; idle, freezes the active memtable once it is due (a store gone
    /// quiet still checkpoints within the interval), sleeps otherwise;
    /// stops once the store is closed and the line is empty.
    pub(in crate::redb) fn run_committer(&self) {
        loop {
            // Read before the line's lock (lock order: shared.rs). A
            // poisoned store freezes nothing: its heal empties memory.
            let interval = self.memory.checkpoint_interval;
            let due = self.memory.read_mem().checkpoint_left(interval);
            let due = due.filter(|_| !self.db.health.is_poisoned());
            let mut q = self.line.lock();
            if !q.waiting.is_empty() {
                drop(q);
                self.commit_next();
                continue;
            }
            if q.closed {
                q.stopped = true;
                return;
            }
            q.awake = false;
            let cv = &self.line.committer;
            match due {
                None => drop(cv.wait(q)),
                Some(left) if !left.is_zero() => drop(cv.wait_timeout(q, left)),
                Some(_) => {
                    drop(q);
                    // After a running checkpoint; on a failure (poisoned
                    // meanwhile) not again before another interval.
                    if self.freeze(&mut self.log.lock()).is_err() {
                        self.memory.write_mem().since = Some(Instant::now());
                    }
                }
            }
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
    fn abandon(&self, slot: &Arc<Slot>) {
        let mut q = self.line.lock();
        if let Some(at) = q.waiting.iter().position(|(_, s)| Arc::ptr_eq(s, slot)) {
            let full = q.waiting.len() >= WRITE_QUEUE_DEPTH;
            let _ = q.waiting.remove(at);
            return self.make_room(q, full);
        }
        drop(q);
        if let Some(answer) = slot.abandon() {
            self.release_unseen(answer);
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
            let slot = Arc::new(Slot::default());
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
            self.shared.abandon(&slot);
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
                shared.push(&mut q, begin(id.as_bytes()), Arc::new(Slot::unseen()));
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

    fn numbered(id: usize) -> Op {
        Op::Begin {
            key: format!("\0{id}").into_bytes(),
            fingerprint: Fingerprint::of(b"fp"),
            now: Timestamp::from_millis(1_000),
            lease: D,
            retention: D,
            absent_at: None,
        }
    }

    fn poll(f: &mut Submitted) -> Poll<Result<Reply>> {
        Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
    }

    fn lead_all(shared: &Shared) {
        while !shared.line.lock().waiting.is_empty() {
            shared.commit_next();
        }
    }

    #[test]
    fn a_full_line_keeps_the_op_until_a_group_makes_room() {
        // No committer runs here: this test commits.
        let shared = shared();
        let mut queued: Vec<Submitted> = (0..WRITE_QUEUE_DEPTH)
            .map(|i| shared.submit_async(numbered(i)).unwrap())
            .collect();
        assert!(shared.line.lock().awake, "the committer was woken");
        let mut late = shared.submit_async(numbered(WRITE_QUEUE_DEPTH)).unwrap();
        assert!(matches!(late.state, State::Room(_)));
        assert!(poll(&mut late).is_pending());
        assert_eq!(shared.line.lock().room.len(), 1);
        shared.commit_next();
        assert!(shared.line.lock().room.is_empty(), "woken");
        assert!(poll(&mut late).is_pending());
        assert!(matches!(late.state, State::Waiting(_)));
        lead_all(&shared);
        assert!(matches!(
            poll(&mut late),
            Poll::Ready(Ok(Reply::Begin(Begin::Claimed(_), _)))
        ));
        for f in &mut queued {
            assert!(matches!(
                poll(f),
                Poll::Ready(Ok(Reply::Begin(Begin::Claimed(_), _)))
            ));
        }
        assert!(shared.line.lock().waiting.is_empty());
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
        // Dropped while its group commits: the committer releases it.
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

    /// A poisoned store refuses a write with its cause before the write
    /// joins the line: nothing is queued.
    #[test]
    fn a_poisoned_store_refuses_before_the_line() {
        let shared = shared();
        let _ = shared.fail("test", On::Log, Error::backend("the disk is gone"));
        let refused = shared.submit_async(numbered(1)).map(drop);
        assert!(matches!(&refused, Err(e) if e.to_string().contains("the disk is gone")));
        assert!(shared.line.lock().waiting.is_empty());
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
        let claimed = Reply::Begin(Begin::Claimed(claim), b"\x001".to_vec());
        shared.release_unseen(Ok(claimed));
        assert!(shared.line.lock().waiting.is_empty());
    }

    /// Counts its wakes.
    struct Woken(std::sync::atomic::AtomicUsize);
    impl std::task::Wake for Woken {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A task polled again with another waker (it moved) is woken through
    /// the latest one, once; an answer before any poll is simply taken.
    #[test]
    fn a_slot_wakes_the_waker_of_its_last_poll() {
        let count = |w: &std::sync::Arc<Woken>| w.0.load(std::sync::atomic::Ordering::SeqCst);
        let (first, last) = (
            std::sync::Arc::new(Woken(0.into())),
            std::sync::Arc::new(Woken(0.into())),
        );
        let slot = Slot::default();
        for w in [&first, &last, &last] {
            let waker = Waker::from(std::sync::Arc::clone(w));
            assert!(slot.poll(&mut Context::from_waker(&waker)).is_pending());
        }
        assert!(slot.answer(Ok(Reply::Done)).is_none());
        assert_eq!((count(&first), count(&last)), (0, 1));
        let waker = Waker::from(std::sync::Arc::clone(&last));
        let answer = slot.poll(&mut Context::from_waker(&waker));
        assert!(matches!(answer, Poll::Ready(Ok(Reply::Done))));
        let early = Slot::default();
        assert!(early.answer(Ok(Reply::Done)).is_none());
        assert!(matches!(
            early.poll(&mut Context::from_waker(&waker)),
            Poll::Ready(Ok(_))
        ));
        assert_eq!(count(&last), 1);
    }
}
