//! The group-commit line's data: the jobs callers queue (`Job`) and the
//! queue with its runner count (`Line`), kept below the store's operations
//! and the runners (`ops.rs`, `group.rs`) so that both can name them, and
//! generic over the job so that the model checker can run the queue with
//! threads for runners.

use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::{Begin, Claim};
use crate::response::Response;
use crate::sync::{Mutex, MutexGuard};
use crate::time::Timestamp;
use std::collections::VecDeque;
use std::sync::PoisonError;
use std::time::Duration;
use tokio::sync::oneshot;

/// One call waiting on the line.
pub(super) enum Job {
    Begin(BeginJob),
    Complete(CompleteJob),
}

pub(super) struct BeginJob {
    pub(super) key: Key,
    pub(super) fingerprint: Fingerprint,
    pub(super) now: Timestamp,
    pub(super) lease: Duration,
    pub(super) retention: Duration,
    pub(super) reply: oneshot::Sender<Result<Begin>>,
}

pub(super) struct CompleteJob {
    pub(super) key: Key,
    pub(super) claim: Claim,
    /// `row::token(claim.token)`, checked at submission.
    pub(super) token: i64,
    pub(super) response: Response,
    pub(super) now: Timestamp,
    pub(super) retention: Duration,
    pub(super) reply: oneshot::Sender<Result<()>>,
}

impl Job {
    pub(super) fn key(&self) -> &Key {
        match self {
            Job::Begin(job) => &job.key,
            Job::Complete(job) => &job.key,
        }
    }
}

/// The queue and how many runners drain it: the line's whole state, kept
/// apart from what the jobs are so that the model checker can run it with
/// threads for runners (`shuttle_tests` below).
pub(super) struct Line<T> {
    state: Mutex<LineState<T>>,
}

struct LineState<T> {
    queue: VecDeque<T>,
    runners: usize,
}

impl<T> Default for Line<T> {
    fn default() -> Self {
        Line {
            state: Mutex::new(LineState {
                queue: VecDeque::new(),
                runners: 0,
            }),
        }
    }
}

impl<T> Line<T> {
    fn lock(&self) -> MutexGuard<'_, LineState<T>> {
        // Every change under this lock is a single push, drain or count
        // update: consistent at any point a panic could occur.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `job`; true when the caller must start a runner (fewer than
    /// `max_runners` run; the new one is counted in already).
    pub(super) fn push(&self, job: T, max_runners: usize) -> bool {
        let mut state = self.lock();
        state.queue.push_back(job);
        let start = state.runners < max_runners;
        if start {
            state.runners += 1;
        }
        start
    }

    /// A runner's next group: up to `max` jobs, oldest first; `None` when
    /// the queue is empty, and the runner is then counted out, under the
    /// same lock [`push`](Line::push) takes, so a job queued after this
    /// sees one runner fewer and starts one if it must. Never lost: a job
    /// is queued either before this look (and taken) or after it (and
    /// starts a runner).
    pub(super) fn next_group(&self, max: usize) -> Option<Vec<T>> {
        let mut state = self.lock();
        let n = state.queue.len().min(max);
        if n == 0 {
            state.runners = state.runners.saturating_sub(1);
            return None;
        }
        Some(state.queue.drain(..n).collect())
    }

    /// True when no job waits and no runner runs (a hint: it may change
    /// as soon as the lock is let go).
    pub(super) fn is_idle(&self) -> bool {
        let state = self.lock();
        state.runners == 0 && state.queue.is_empty()
    }

    /// Counts out a runner that ended without `next_group` saying so (it
    /// panicked, or was dropped with the runtime).
    pub(super) fn runner_gone(&self) {
        let mut state = self.lock();
        state.runners = state.runners.saturating_sub(1);
    }
}

/// The line under the Shuttle model checker (`scripts/shuttle-tests`):
/// callers queue jobs from several threads while runners (threads here,
/// tasks on the store's runtime in production) take groups and count
/// themselves out. What must hold in every schedule: every job is taken
/// exactly once (none is left queued with no runner to take it: the test
/// would then wait forever, which Shuttle reports), and no more than the
/// limit of runners ever run at once.
#[cfg(all(test, shuttle))]
mod shuttle_tests {
    use super::*;
    use crate::shuttle_support::explore;
    use crate::sync::{Arc, Condvar, thread};
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Scenario {
        line: Line<usize>,
        /// Jobs taken, and a condvar the test waits on for all of them.
        taken: Mutex<Vec<usize>>,
        all_taken: Condvar,
        running: AtomicUsize,
        most_running: AtomicUsize,
    }

    fn runner(s: Arc<Scenario>, max_group: usize) {
        let now = s.running.fetch_add(1, Ordering::SeqCst) + 1;
        s.most_running.fetch_max(now, Ordering::SeqCst);
        loop {
            let Some(group) = s.line.next_group(max_group) else {
                s.running.fetch_sub(1, Ordering::SeqCst);
                return;
            };
            assert!(!group.is_empty() && group.len() <= max_group);
            thread::yield_now(); // the group's round trip
            let mut taken = s.taken.lock().unwrap_or_else(PoisonError::into_inner);
            taken.extend(group);
            s.all_taken.notify_all();
        }
    }

    fn scenario(callers: usize, jobs_each: usize, max_runners: usize, max_group: usize) {
        let s = Arc::new(Scenario {
            line: Line::default(),
            taken: Mutex::new(Vec::new()),
            all_taken: Condvar::new(),
            running: AtomicUsize::new(0),
            most_running: AtomicUsize::new(0),
        });
        let threads: Vec<_> = (0..callers)
            .map(|c| {
                let s = Arc::clone(&s);
                thread::spawn(move || {
                    for j in 0..jobs_each {
                        if s.line.push(c * jobs_each + j, max_runners) {
                            let s = Arc::clone(&s);
                            thread::spawn(move || runner(s, max_group));
                        }
                    }
                })
            })
            .collect();
        for caller in threads {
            caller.join().expect("a caller");
        }
        let expected = callers * jobs_each;
        let mut taken = s.taken.lock().unwrap_or_else(PoisonError::into_inner);
        while taken.len() < expected {
            taken = s
                .all_taken
                .wait(taken)
                .unwrap_or_else(PoisonError::into_inner);
        }
        let mut seen = taken.clone();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..expected).collect::<Vec<_>>(),
            "each job taken once"
        );
        assert!(s.most_running.load(Ordering::SeqCst) <= max_runners);
    }

    #[test]
    fn shuttle_every_queued_job_is_taken_once() {
        explore("postgres line: three callers, two runners", || {
            scenario(3, 2, 2, 2)
        });
    }

    #[test]
    fn shuttle_one_runner_drains_what_queues_behind_it() {
        explore("postgres line: two callers, one runner", || {
            scenario(2, 3, 1, 4)
        });
    }
}
