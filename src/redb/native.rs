//! The native async entry: a [`Submitted`] future queues its [`Op`] with a
//! [`Waiter::Task`] slot, which its group's leader fills and wakes once the
//! frame is durable; when only futures wait, the committer thread leads. A
//! future dropped in line leaves it; dropped later, a claim nobody saw is
//! released through the line (docs/design.md, "Futures in the line").

use super::Shared;
use super::line::{InLine, Op, Reply, Slot, WRITE_QUEUE_DEPTH, Waiter};
use crate::error::{Error, Result};
use crate::sync::Arc;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A request in the line, as a future. See the module docs.
pub(super) struct Submitted {
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
    pub(super) fn submit_async(self: &Arc<Self>, op: Op) -> Result<Submitted> {
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
    pub(super) fn run_committer(&self) {
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
    pub(super) fn close_line(&self) {
        let room = {
            let mut q = self.line.lock();
            q.closed = true;
            self.line.committer.notify_all();
            self.line.room.notify_all();
            std::mem::take(&mut q.room)
        };
        room.into_iter().for_each(std::task::Waker::wake);
    }

    /// A dropped future's slot: out of the line if it is still there, else
    /// abandoned; a claim it made and nobody saw is released.
    fn abandon(&self, slot: &Arc<Slot>, begin_key: Option<Vec<u8>>) {
        {
            let mut q = self.line.lock();
            if let Some(at) = q.waiting.iter().position(|(_, s)| Arc::ptr_eq(s, slot)) {
                let full = q.waiting.len() >= WRITE_QUEUE_DEPTH;
                let _ = q.waiting.remove(at);
                if full {
                    self.line.room.notify_all();
                    let room = std::mem::take(&mut q.room);
                    drop(q);
                    room.into_iter().for_each(std::task::Waker::wake);
                }
                return;
            }
        }
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
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::record::Begin;
    use crate::time::Timestamp;
    use std::task::Waker;
    use std::time::Duration;

    const D: Duration = Duration::from_secs(10);

    fn begin(id: usize) -> Op {
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
        let shared = super::super::commit::tests::shared();
        let mut queued: Vec<Submitted> = (0..WRITE_QUEUE_DEPTH)
            .map(|i| shared.submit_async(begin(i)).unwrap())
            .collect();
        assert!(
            shared.line.lock().committer,
            "the role went to the committer"
        );
        let mut late = shared.submit_async(begin(WRITE_QUEUE_DEPTH)).unwrap();
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
        let shared = super::super::commit::tests::shared();
        // Dropped while queued: out of the line, nothing written.
        drop(shared.submit_async(begin(1)).unwrap());
        assert!(shared.line.lock().waiting.is_empty());
        // Dropped after its group committed, answer unread: released.
        let answered = shared.submit_async(begin(2)).unwrap();
        lead_all(&shared);
        assert!(matches!(shared.read(b"\x002"), Ok(Some(_))));
        drop(answered);
        assert_eq!(shared.line.lock().waiting.len(), 1, "the release is queued");
        lead_all(&shared);
        assert!(matches!(shared.read(b"\x002"), Ok(None)));
        // Dropped while its group commits: the leader releases it.
        let taken = shared.submit_async(begin(3)).unwrap();
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
        let shared = super::super::commit::tests::shared();
        let mut queued = shared.submit_async(begin(1)).unwrap();
        shared.close_line();
        assert!(matches!(shared.submit_async(begin(2)), Err(Error::Closed)));
        assert!(matches!(shared.submit(begin(3)), Err(Error::Closed)));
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
