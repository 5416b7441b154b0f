//! Lease renewal while a handler runs: one timer thread for the whole
//! process renews every claim a guard's run registered, so a run costs no
//! thread of its own (sync or async alike), and a handler that outlives its
//! lease keeps its key.
//!
//! A run registers its claim before it calls the handler ([`renew_while`])
//! and gets a [`Renewing`] back; dropping it (the handler returned, failed,
//! panicked, or the async run was cancelled) takes the claim out of the
//! timer at once. Each renewal is [`Store::renew`](crate::Store::renew)
//! with the guard's lease, every [`RENEW_FRACTION`]th of it:
//!
//! - renewed: the claim's live [`lease_until`](crate::Claim::lease_until)
//!   moves on, and the next renewal is due one interval later;
//! - [`Error::StaleClaim`]: another caller took the key over (or the
//!   record is gone): the claim is marked lost
//!   ([`Claim::lease_lost`](crate::Claim::lease_lost)) and no longer
//!   renewed; the guard then writes nothing for it and answers
//!   [`Outcome::LeaseLost`](crate::Outcome::LeaseLost);
//! - any other error (the store is down): tried again one interval later,
//!   while the lease already stored still holds.
//!
//! The thread sleeps on a condition variable until the earliest renewal is
//! due (an idle process: until a claim is registered), never polls, and is
//! never joined: it holds nothing that a process exit must wait for. A
//! store call that blocks delays the renewals behind it; an interval of a
//! third of the lease leaves two more tries before the lease ends.

use super::Guard;
use super::outcome::Counters;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::record::{Claim, Renewal};
use crate::store::Store;
// The timer's lock, condition variable, clock and thread come from the
// seam a model checker can stand in for (src/sync.rs; the schedules are in
// this file's `shuttle_tests`).
use crate::sync::{Condvar, Instant, Mutex, MutexGuard, thread};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// A claim's lease is renewed every `lease / RENEW_FRACTION` while its
/// handler runs (at least every millisecond;
/// [`Guard::renewal_interval`](super::Guard::renewal_interval)).
pub(super) const RENEW_FRACTION: u32 = 3;

/// One renewal: calls the store for the claim and says what it answered.
type RenewFn = Box<dyn Fn() -> Result<Claim> + Send + Sync>;

/// A registered claim.
struct Task {
    renew: RenewFn,
    every: Duration,
    lease: Arc<Renewal>,
    /// The guard's counters (renewals, lost leases).
    counters: Arc<Counters>,
}

/// The registered claims. Every registered claim not being renewed right
/// now has exactly one entry in `due`, and a run's drop takes its entry
/// out: nothing is left behind per request, however many requests run.
#[derive(Default)]
struct State {
    /// When each registered claim is due, earliest first.
    due: BTreeSet<(Instant, u64)>,
    /// Each registered claim, and the time of its entry in `due`.
    tasks: HashMap<u64, (Arc<Task>, Instant)>,
    /// The claim being renewed now (outside the lock).
    running: Option<u64>,
    /// When the thread will look at `due` next: a registration wakes it
    /// only when it is due before that (a run registers and deregisters
    /// per request; waking the thread each time would cost a context
    /// switch per request).
    alarm: Alarm,
    next_id: u64,
    /// The thread returns (only ever set by a test's own timer).
    stopped: bool,
}

struct Timer {
    state: Mutex<State>,
    /// Wakes the thread (a new, earlier renewal) and those waiting for a
    /// renewal in progress to end.
    cv: Condvar,
}

impl Timer {
    /// A timer and its thread; `None` when the thread cannot be started.
    fn start() -> Option<Arc<Timer>> {
        let timer = Arc::new(Timer {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        });
        let running = Arc::clone(&timer);
        thread::Builder::new()
            .name("idemstore-renewer".to_owned())
            .spawn(move || running.run())
            .ok()
            .map(|_| timer)
    }

    /// Ends the thread at its next wake-up (the process's timer never ends:
    /// for the timers of tests).
    #[cfg(test)]
    pub(super) fn stop(&self) {
        self.lock().stopped = true;
        self.cv.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every change under the lock is whole before the lock is let go.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The thread's loop: the earliest due renewal, run outside the lock.
    fn run(&self) {
        let mut state = self.lock();
        loop {
            if state.stopped {
                return;
            }
            let (id, task) = match next_due(&mut state) {
                Next::Run(id, task) => (id, task),
                Next::Sleep(Some(wait)) => {
                    state.alarm = Alarm::At(Instant::now() + wait);
                    state = self
                        .cv
                        .wait_timeout(state, wait)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    state.alarm = Alarm::Awake;
                    continue;
                }
                Next::Sleep(None) => {
                    state.alarm = Alarm::Never;
                    state = self.cv.wait(state).unwrap_or_else(|p| p.into_inner());
                    state.alarm = Alarm::Awake;
                    continue;
                }
            };
            state.running = Some(id);
            drop(state);
            let answer = crate::observability::store_op("renew", || (task.renew)());
            state = self.lock();
            state.running = None;
            self.cv.notify_all();
            // What the renewal learned is the claim's even if its run ended
            // meanwhile (a blocking run's drop waits for this, and then reads
            // it); only a run still registered is renewed again.
            let again = match answer {
                Ok(claim) => {
                    task.lease.renewed(claim.lease_until());
                    super::bump(&task.counters.renewals);
                    true
                }
                Err(Error::StaleClaim) => {
                    task.lease.lose();
                    super::bump(&task.counters.leases_lost);
                    state.tasks.remove(&id);
                    false
                }
                // The lease stored so far still holds: try again later.
                Err(_) => true,
            };
            if again {
                state.schedule(id, Instant::now() + task.every);
            }
        }
    }
}

/// When the timer thread looks at `due` next.
#[derive(Clone, Copy, Default)]
enum Alarm {
    /// It is awake (it looks before it sleeps again).
    #[default]
    Awake,
    /// It sleeps until this instant.
    At(Instant),
    /// It sleeps until woken (nothing was due).
    Never,
}

impl Alarm {
    /// Whether a claim due `at` must wake the thread.
    fn misses(self, at: Instant) -> bool {
        match self {
            Alarm::Awake => false,
            Alarm::At(wake) => at < wake,
            Alarm::Never => true,
        }
    }
}

enum Next {
    Run(u64, Arc<Task>),
    /// Nothing due yet: sleep this long, or until woken.
    Sleep(Option<Duration>),
}

fn next_due(state: &mut State) -> Next {
    let Some(&(at, id)) = state.due.first() else {
        return Next::Sleep(None);
    };
    let now = Instant::now();
    if at > now {
        return Next::Sleep(Some(at.saturating_duration_since(now)));
    }
    state.due.pop_first();
    match state.tasks.get(&id) {
        Some((task, _)) => Next::Run(id, Arc::clone(task)),
        // Unreachable: an entry of `due` names a registered claim.
        None => Next::Sleep(Some(Duration::ZERO)),
    }
}

impl State {
    /// `id`, still registered, is due `at` (its one entry in `due`).
    fn schedule(&mut self, id: u64, at: Instant) {
        if let Some((_, due)) = self.tasks.get_mut(&id) {
            *due = at;
            self.due.insert((at, id));
        }
    }
}

/// The process's timer, its thread started on first use; `None` when the
/// thread could not be started (the claim is then not renewed, as with
/// renewal off).
fn timer() -> Option<&'static Arc<Timer>> {
    static TIMER: OnceLock<Option<Arc<Timer>>> = OnceLock::new();
    TIMER.get_or_init(Timer::start).as_ref()
}

/// What a registered run holds: dropping it stops the renewals of its claim.
pub(super) struct Renewing {
    id: u64,
    timer: Arc<Timer>,
    /// Wait for a renewal in progress to end before the drop returns (the
    /// blocking run: the store is then free of the renewal's handle before
    /// the run writes its outcome; never on an async task's thread).
    wait: bool,
}

impl Drop for Renewing {
    fn drop(&mut self) {
        let mut state = self.timer.lock();
        if let Some((_, at)) = state.tasks.remove(&self.id) {
            state.due.remove(&(at, self.id));
        }
        while self.wait && state.running == Some(self.id) {
            state = self.timer.cv.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Registers `claim` for renewal by `renew` `every` so long, and returns
/// the claim the handler gets (its lease live, its loss visible) with the
/// registration. `None`: the timer could not be started.
fn renew_on(
    timer: &Arc<Timer>,
    claim: Claim,
    every: Duration,
    renew: RenewFn,
    counters: Arc<Counters>,
    wait: bool,
) -> (Claim, Option<Renewing>) {
    let cell = Arc::new(Renewal::new(claim.lease_until()));
    let mut claim = claim;
    claim.renewal = Some(Arc::clone(&cell));
    let task = Arc::new(Task {
        renew,
        every,
        lease: cell,
        counters,
    });
    let id = {
        let mut state = timer.lock();
        let id = state.next_id;
        state.next_id = state.next_id.wrapping_add(1);
        let due = Instant::now() + every;
        state.tasks.insert(id, (task, due));
        state.due.insert((due, id));
        // Wake the thread only when it would sleep past this renewal.
        if state.alarm.misses(due) {
            timer.cv.notify_all();
        }
        id
    };
    let timer = Arc::clone(timer);
    (claim, Some(Renewing { id, timer, wait }))
}

impl<S: Store + 'static> Guard<S> {
    /// `claim` as the handler gets it: registered for renewal while the
    /// handler runs when this guard renews leases. `wait`: the drop of the registration
    /// waits out a renewal in progress (the blocking run).
    pub(super) fn renewing(
        &self,
        key: &Key,
        claim: Claim,
        wait: bool,
    ) -> (Claim, Option<Renewing>) {
        let (Some(every), Some(timer)) = (self.renewal_interval(), timer()) else {
            return (claim, None);
        };
        let (store, key, held) = (Arc::clone(&self.store), key.clone(), claim.clone());
        let (clock, lease) = (Arc::clone(&self.clock), self.lease);
        let renew: RenewFn = Box::new(move || store.renew(&key, &held, clock.now(), lease));
        renew_on(timer, claim, every, renew, Arc::clone(&self.counters), wait)
    }
}

/// A renewal for the timer's tests: counts its calls in `calls` and
/// answers the `n`th with `answer(n)` (from 1).
#[cfg(test)]
fn counting(
    calls: &Arc<std::sync::atomic::AtomicU64>,
    answer: impl Fn(u64) -> Result<Claim> + Send + Sync + 'static,
) -> RenewFn {
    let calls = Arc::clone(calls);
    Box::new(move || answer(calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::Timestamp;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn counted(c: &Arc<Counters>) -> (u64, u64) {
        (
            c.renewals.load(Ordering::SeqCst),
            c.leases_lost.load(Ordering::SeqCst),
        )
    }

    fn claim() -> Claim {
        Claim::new(7, Timestamp::from_millis(1_000), false, 1)
    }

    /// Renewals come every third of the lease and move the claim's live
    /// lease; a stale answer marks it lost and ends its renewals; dropping
    /// the registration stops them.
    #[test]
    fn renewals_move_the_lease_until_one_is_stale() {
        let calls = Arc::new(AtomicU64::new(0));
        let renew = counting(&calls, |n| match n {
            1 | 2 => Ok(Claim::new(
                7,
                Timestamp::from_millis(1_000 + n * 100),
                false,
                1,
            )),
            _ => Err(Error::StaleClaim),
        });
        let c = Arc::<Counters>::default();
        let timer = Timer::start().expect("a thread");
        let every = Duration::from_millis(5);
        let (claim, renewing) = renew_on(&timer, claim(), every, renew, Arc::clone(&c), true);
        assert!(renewing.is_some());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !claim.lease_lost() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(claim.lease_lost());
        assert_eq!(claim.lease_until(), Timestamp::from_millis(1_200));
        assert_eq!(counted(&c), (2, 1));
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            3,
            "no renewal after a stale one"
        );
        drop(renewing);
        timer.stop();
    }

    /// Renewals keep their cadence, every third of the lease, for answers
    /// and errors alike: a timer that renewed again at once would call the
    /// store in a loop. (An upper bound with a wide margin: a loaded
    /// machine only makes renewals later, never more.)
    #[test]
    fn renewals_come_every_third_of_the_lease_not_in_a_loop() {
        for fails in [false, true] {
            let calls = Arc::new(AtomicU64::new(0));
            let renew = counting(&calls, move |_| match fails {
                true => Err(Error::backend("store down")),
                false => Ok(Claim::new(7, Timestamp::from_millis(2_000), false, 1)),
            });
            let timer = Timer::start().expect("a thread");
            let every = Duration::from_millis(20);
            let c = Arc::<Counters>::default();
            let (_claim, renewing) = renew_on(&timer, claim(), every, renew, c, true);
            std::thread::sleep(30 * every); // ten leases
            drop(renewing);
            timer.stop();
            // About 30 at the cadence; a loop makes thousands.
            let n = calls.load(Ordering::SeqCst);
            assert!((1..=60).contains(&n), "{n} renewals in ten leases");
        }
    }

    /// The first renewal comes a third of the lease after the claim, not at
    /// once; and a claim due before everything queued wakes the sleeping
    /// timer (a thread asleep until a long lease's renewal would miss it).
    #[test]
    fn the_first_renewal_waits_and_an_earlier_claim_wakes_the_timer() {
        let renewed = |_| Ok(Claim::new(7, Timestamp::from_millis(2_000), false, 1));
        let timer = Timer::start().expect("a thread");
        let (slow, fast) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let c = Arc::<Counters>::default();
        let long = Duration::from_secs(10);
        let (_a, a) = renew_on(
            &timer,
            claim(),
            long,
            counting(&slow, renewed),
            Arc::clone(&c),
            true,
        );
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(slow.load(Ordering::SeqCst), 0, "renewed at once");
        // The timer sleeps until the slow claim's renewal, 10 s away.
        let short = Duration::from_millis(10);
        let (_b, b) = renew_on(&timer, claim(), short, counting(&fast, renewed), c, true);
        let deadline = Instant::now() + Duration::from_secs(5);
        while fast.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(fast.load(Ordering::SeqCst) > 0, "the timer was not woken");
        drop((a, b));
        timer.stop();
    }

    /// A registration wakes the thread only when the thread would sleep
    /// past it: not while it is awake, not before an alarm set earlier.
    #[test]
    fn a_registration_wakes_the_thread_only_when_it_would_be_missed() {
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        assert!(!Alarm::Awake.misses(now));
        assert!(Alarm::Never.misses(later));
        assert!(Alarm::At(later).misses(now));
        assert!(!Alarm::At(now).misses(later));
        assert!(!Alarm::At(now).misses(now));
    }

    /// A run's drop takes its claim out of the timer whole: nothing stays
    /// queued per request (a queue that kept an entry per request until
    /// its due time would hold rate × interval entries).
    #[test]
    fn dropped_registrations_leave_nothing_queued() {
        let timer = Timer::start().expect("a thread");
        let calls = Arc::new(AtomicU64::new(0));
        let runs: Vec<_> = (0..1_000)
            .map(|_| {
                let renew = counting(&calls, |_| Err(Error::StaleClaim));
                renew_on(
                    &timer,
                    claim(),
                    Duration::from_secs(60),
                    renew,
                    Arc::default(),
                    true,
                )
            })
            .collect();
        assert_eq!(timer.lock().due.len(), 1_000);
        drop(runs);
        let state = timer.lock();
        assert!(state.due.is_empty() && state.tasks.is_empty());
        drop(state);
        timer.stop();
    }

    /// A dropped registration is renewed no more, and an error other than
    /// a stale claim is retried.
    #[test]
    fn a_dropped_registration_stops_and_errors_are_retried() {
        let calls = Arc::new(AtomicU64::new(0));
        let renew = counting(&calls, |_| Err(Error::backend("store down")));
        let c = Arc::<Counters>::default();
        let timer = Timer::start().expect("a thread");
        let every = Duration::from_millis(2);
        let (claim, renewing) = renew_on(&timer, claim(), every, renew, Arc::clone(&c), true);
        let deadline = Instant::now() + Duration::from_secs(10);
        while calls.load(Ordering::SeqCst) < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(calls.load(Ordering::SeqCst) >= 3, "retried");
        assert!(!claim.lease_lost() && counted(&c) == (0, 0));
        drop(renewing);
        let after = calls.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(calls.load(Ordering::SeqCst), after, "stopped on drop");
        timer.stop();
    }
}

/// The timer under the Shuttle model checker (`scripts/shuttle-tests`):
/// runs register claims, have them renewed and drop their registrations
/// while the timer thread renews, under many schedules. What must hold in
/// every one: no deadlock (a drop that waits out a renewal in progress, the
/// timer asleep while a run registers), no renewal of a claim after its
/// blocking run's drop returned, no renewal after a stale one, and the
/// thread ends when told.
#[cfg(all(test, shuttle))]
mod shuttle_tests {
    use super::*;
    use crate::shuttle_support::explore;
    use crate::time::Timestamp;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A renewal that counts its calls and answers the `stale_from`th and
    /// later ones with a stale claim.
    fn stale_from(calls: &Arc<AtomicU64>, stale_from: u64) -> RenewFn {
        counting(calls, move |n| match n >= stale_from {
            true => Err(Error::StaleClaim),
            false => Ok(Claim::new(1, Timestamp::from_millis(n), false, 1)),
        })
    }

    fn register(timer: &Arc<Timer>, renew: RenewFn, wait: bool) -> (Claim, Option<Renewing>) {
        let claim = Claim::new(1, Timestamp::EPOCH, false, 1);
        renew_on(
            timer,
            claim,
            Duration::from_millis(1),
            renew,
            Arc::default(),
            wait,
        )
    }

    #[test]
    fn shuttle_two_runs_register_and_drop_while_the_timer_renews() {
        explore("renewal timer: two runs", || {
            let timer = Timer::start().expect("a thread");
            let runs: Vec<_> = (0..2u64)
                .map(|i| {
                    let timer = Arc::clone(&timer);
                    thread::spawn(move || {
                        let calls = Arc::new(AtomicU64::new(0));
                        // The second run's claim is found stale at its first renewal.
                        let stale = if i == 0 { u64::MAX } else { 1 };
                        let (claim, renewing) = register(&timer, stale_from(&calls, stale), true);
                        for _ in 0..3 {
                            thread::yield_now();
                        }
                        drop(renewing);
                        let after_drop = calls.load(Ordering::SeqCst);
                        for _ in 0..3 {
                            thread::yield_now();
                        }
                        assert_eq!(
                            calls.load(Ordering::SeqCst),
                            after_drop,
                            "renewed after its blocking run's drop returned"
                        );
                        if i == 1 {
                            assert!(after_drop <= 1, "renewed after a stale answer");
                            assert_eq!(claim.lease_lost(), after_drop == 1);
                        }
                    })
                })
                .collect();
            for run in runs {
                run.join().expect("a run");
            }
            timer.stop();
        });
    }

    /// An async run's drop does not wait for a renewal in progress, but
    /// after it nothing new is started for its claim.
    #[test]
    fn shuttle_a_run_that_does_not_wait_is_renewed_at_most_once_more() {
        explore("renewal timer: no wait", || {
            let timer = Timer::start().expect("a thread");
            let calls = Arc::new(AtomicU64::new(0));
            let (_claim, renewing) = register(&timer, stale_from(&calls, u64::MAX), false);
            thread::yield_now();
            drop(renewing);
            let after_drop = calls.load(Ordering::SeqCst);
            for _ in 0..4 {
                thread::yield_now();
            }
            assert!(calls.load(Ordering::SeqCst) <= after_drop + 1);
            timer.stop();
        });
    }
}
