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

/// How many runners the line keeps going: up to `base` whenever jobs
/// wait, and up to `most` while at least `backlog` jobs wait (`base >= 1`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Flight {
    pub(super) base: usize,
    pub(super) most: usize,
    pub(super) backlog: usize,
}

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

    /// Queues `job`; true when the caller must start a runner (the new one
    /// is counted in already): fewer than `flight.base` run, or fewer than
    /// `flight.most` and at least `flight.backlog` jobs wait.
    pub(super) fn push(&self, job: T, flight: Flight) -> bool {
        let mut state = self.lock();
        state.queue.push_back(job);
        let start = state.runners < flight.base
            || (state.runners < flight.most && state.queue.len() >= flight.backlog);
        if start {
            state.runners += 1;
        }
        start
    }

    /// A runner's next group: up to `max` jobs, oldest first; `None` when
    /// the runner is to end, and it is then counted out, under the same
    /// lock [`push`](Line::push) takes, so a job queued after this sees one
    /// runner fewer and starts one if it must. A runner ends when the queue
    /// is empty, or when more than `flight.base` run and fewer than
    /// `flight.backlog` jobs wait (the other runners take them). Never
    /// lost: a job is queued either before this look (and taken, now or by
    /// one of the at least `flight.base` runners left) or after it (and
    /// starts a runner if fewer than `flight.base` run).
    pub(super) fn next_group(&self, max: usize, flight: Flight) -> Option<Vec<T>> {
        let mut state = self.lock();
        let waiting = state.queue.len();
        if waiting == 0 || (state.runners > flight.base && waiting < flight.backlog) {
            state.runners = state.runners.saturating_sub(1);
            return None;
        }
        Some(state.queue.drain(..waiting.min(max)).collect())
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

#[cfg(test)]
mod tests {
    use super::*;

    const FLIGHT: Flight = Flight {
        base: 1,
        most: 2,
        backlog: 3,
    };

    #[test]
    fn a_backlog_starts_one_more_runner_and_a_short_queue_ends_it() {
        let line = Line::default();
        assert!(line.push(1, FLIGHT), "the base runner starts");
        assert!(!line.push(2, FLIGHT), "two waiting: no backlog yet");
        assert!(line.push(3, FLIGHT), "three waiting: the backlog runner");
        assert!(!line.push(4, FLIGHT), "never more than `most`");
        assert_eq!(line.next_group(2, FLIGHT), Some(vec![1, 2]));
        // Two runners, two waiting (under the backlog): the one asking ends
        // and leaves them to the other, which takes them.
        assert_eq!(line.next_group(8, FLIGHT), None);
        assert_eq!(line.next_group(8, FLIGHT), Some(vec![3, 4]));
        assert!(!line.is_idle(), "the last runner is still counted in");
        assert_eq!(line.next_group(8, FLIGHT), None);
        assert!(line.is_idle());
        assert!(line.push(5, FLIGHT), "an idle line starts a runner again");
        // A backlog exactly at the bound keeps the second runner going.
        assert!(!line.push(6, FLIGHT));
        assert!(line.push(7, FLIGHT));
        assert_eq!(line.next_group(8, FLIGHT), Some(vec![5, 6, 7]));
    }

    #[test]
    fn a_runner_gone_without_a_word_is_counted_out() {
        let line = Line::default();
        assert!(line.push(1, FLIGHT));
        assert_eq!(line.next_group(8, FLIGHT), Some(vec![1]));
        // The runner panicked mid-group: its drop guard counts it out.
        line.runner_gone();
        assert!(line.is_idle());
        assert!(line.push(2, FLIGHT), "the next job starts a runner");
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

    fn runner(s: Arc<Scenario>, max_group: usize, flight: Flight) {
        let now = s.running.fetch_add(1, Ordering::SeqCst) + 1;
        s.most_running.fetch_max(now, Ordering::SeqCst);
        loop {
            let Some(group) = s.line.next_group(max_group, flight) else {
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

    fn scenario(callers: usize, jobs_each: usize, flight: Flight, max_group: usize) {
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
                        if s.line.push(c * jobs_each + j, flight) {
                            let s = Arc::clone(&s);
                            thread::spawn(move || runner(s, max_group, flight));
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
        assert!(s.most_running.load(Ordering::SeqCst) <= flight.most.max(flight.base));
    }

    #[test]
    fn shuttle_every_queued_job_is_taken_once() {
        explore("postgres line: three callers, two runners", || {
            scenario(3, 2, fixed(2), 2)
        });
    }

    #[test]
    fn shuttle_one_runner_drains_what_queues_behind_it() {
        explore("postgres line: two callers, one runner", || {
            scenario(2, 3, fixed(1), 4)
        });
    }

    /// A runner beyond the base one starts on a backlog and ends when it
    /// shrinks, leaving the jobs still queued to the base runner: none is
    /// stranded, and no more than `most` runners ever run.
    #[test]
    fn shuttle_a_backlog_runner_leaves_nothing_stranded() {
        explore(
            "postgres line: three callers, one runner, a second on a backlog of 2",
            || {
                scenario(
                    3,
                    2,
                    Flight {
                        base: 1,
                        most: 2,
                        backlog: 2,
                    },
                    1,
                )
            },
        );
    }

    fn fixed(runners: usize) -> Flight {
        Flight {
            base: runners,
            most: runners,
            backlog: usize::MAX,
        }
    }
}
