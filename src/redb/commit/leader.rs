//! The leader role: the first thread in line leads a group
//! ([`Shared::lead_once`]), passes the role on and answers the group.
//! Futures never lead (a runtime thread must not block on an fsync): the
//! committer thread leads for them. A full line makes a caller wait.

use super::super::Shared;
use super::super::health::On;
use super::super::line::{InLine, Op, Reply, Slot, WRITE_QUEUE_DEPTH, Waiter};
use crate::error::{Error, Result};
use crate::record::Begin;
use crate::sync::Arc;
use std::task::Waker;

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
        self.db.check_healthy()
    }

    /// Puts `op` in line and returns its answer, leading groups while this caller
    /// is at the front of the line. A full line (`WRITE_QUEUE_DEPTH`) waits
    /// for room.
    pub(in crate::redb) fn submit(&self, op: Op) -> Result<Reply> {
        self.check_submit()?;
        let mine = Arc::new(Slot::new(Waiter::Thread));
        let lead = {
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
        if !lead && let Some(answer) = mine.wait() {
            return answer;
        }
        loop {
            if let Some(answer) = self.lead_once(Some(&mine)) {
                return answer;
            }
            // Not in this group (a long line): wait for the role or an answer.
            if let Some(answer) = mine.wait() {
                return answer;
            }
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
        let (ops, slots, room) = {
            let mut q = self.line.lock();
            let full = q.waiting.len() >= WRITE_QUEUE_DEPTH;
            let n = q.waiting.len().min(self.line.max_group);
            let (ops, slots): (Vec<Op>, Vec<Arc<Slot>>) = q.waiting.drain(..n).unzip();
            let threads = slots.iter().filter(|s| s.waiter == Waiter::Thread).count();
            q.threads = q.threads.saturating_sub(threads);
            // Only a full line can have callers waiting for room (a
            // notify is a syscall even with nobody waiting).
            let mut room = Vec::new();
            if full {
                self.line.room.notify_all();
                room = std::mem::take(&mut q.room);
            }
            (ops, slots, room)
        };
        room.into_iter().for_each(Waker::wake);
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

#[cfg(test)]
mod tests {
    use super::super::tests::{begin, shared};
    use super::*;
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
        let mut shared = shared();
        Arc::get_mut(&mut shared)
            .expect("not shared yet")
            .line
            .max_group = 1;
        let slot = |waiter| Arc::new(Slot::new(waiter));
        let (leader, task, next) = (
            slot(Waiter::Thread),
            slot(Waiter::Task),
            slot(Waiter::Thread),
        );
        {
            let mut q = shared.line.lock();
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
        assert!(next.is_leading(), "the thread leads next");
        assert!(task.is_waiting());
        let q = shared.line.lock();
        assert!(!q.committer, "the committer was not asked");
        assert_eq!((q.waiting.len(), q.threads), (2, 1));
    }
}
