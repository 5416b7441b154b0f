//! Waiting duplicates: in-process notification from the owner of a claim to
//! the duplicates that found its record PROCESSING.
//!
//! The store only says "in flight"; it cannot say whether the owner runs in
//! this process, and polling it would cost a store call per tick. So every
//! run of a guard with waiting on *enters* a [`Flight`] for its key before it
//! calls `begin`, and tells the flight what `begin` answered. A duplicate
//! that was told InFlight then waits on the flight (a `Condvar` for the
//! synchronous `run`, wakers for `run_async`: one state machine, two ways to
//! block) until:
//!
//! - the local owner lands its result — stored: the duplicate replays it;
//!   not stored (released, failed, lost): the duplicate asks the store again;
//! - no participant holds the claim and none is still inside `begin`: the
//!   owner is in another process (or already gone), so waiting cannot help
//!   and the duplicate answers InFlight at once;
//! - the deadline passes: InFlight, as without waiting.
//!
//! Counting the participants still inside `begin` closes the window between
//! an owner's `begin` returning Claimed and the owner saying so: a duplicate
//! whose `begin` saw that claim waits for the owner's report instead of
//! concluding that nobody local owns the key.
//!
//! Every participant is an RAII [`Entered`]: a run that is dropped (a
//! cancelled future, a panicking handler) leaves the flight consistent, and
//! an owner that never lands wakes its waiters with "not stored".

use crate::key::Key;
use crate::response::Response;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::Waker;
#[cfg(feature = "tokio")]
use std::task::{Context, Poll};
use std::time::Instant;

/// What a waiting duplicate learns.
#[derive(Debug)]
pub(crate) enum Waited {
    /// The local owner stored this response: replay it.
    Stored(Response),
    /// The local owner finished without storing: ask the store again.
    Retry,
    /// No participant in this process owns the key (or the deadline passed).
    InFlight,
}

/// The flights of one guard (shared by its clones), one per key with a
/// participant.
#[derive(Debug, Default)]
pub(crate) struct Flights {
    table: Mutex<HashMap<Key, Arc<Flight>>>,
}

#[derive(Debug, Default)]
struct Flight {
    state: Mutex<FlightState>,
    landed: Condvar,
}

#[derive(Debug, Default)]
struct FlightState {
    /// Participants whose `begin` has not answered yet.
    pending: usize,
    /// A participant holds the claim and has not landed.
    owned: bool,
    /// The owner's result, once landed (`None` inside: not stored).
    result: Option<Option<Response>>,
    /// Async waiters to wake on any change.
    wakers: Vec<Waker>,
}

impl FlightState {
    /// The answer for a waiter, or `None` to keep waiting.
    fn answer(&self) -> Option<Waited> {
        match &self.result {
            Some(Some(response)) => Some(Waited::Stored(response.clone())),
            Some(None) => Some(Waited::Retry),
            None if !self.owned && self.pending == 0 => Some(Waited::InFlight),
            None => None,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The state is a few counters updated in one step each: a panic
    // elsewhere cannot leave it half-written.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Inside `begin`.
    Pending,
    /// `begin` answered something other than Claimed.
    Begun,
    /// `begin` answered Claimed; the result is not landed yet.
    Owner,
    /// Landed.
    Done,
}

/// One run's participation in the flight of its key.
#[derive(Debug)]
pub(crate) struct Entered {
    flights: Arc<Flights>,
    key: Key,
    flight: Arc<Flight>,
    phase: Phase,
}

impl Flights {
    /// Enters the flight of `key` (creating it), as a participant inside `begin`.
    pub(crate) fn enter(self: &Arc<Self>, key: &Key) -> Entered {
        let mut table = lock(&self.table);
        let flight = Arc::clone(table.entry(key.clone()).or_default());
        lock(&flight.state).pending += 1;
        drop(table);
        Entered {
            flights: Arc::clone(self),
            key: key.clone(),
            flight,
            phase: Phase::Pending,
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.table).len()
    }
}

impl Entered {
    /// Records what `begin` answered: `claimed` makes this run the owner.
    pub(crate) fn begun(&mut self, claimed: bool) {
        if self.phase != Phase::Pending {
            return;
        }
        self.phase = if claimed { Phase::Owner } else { Phase::Begun };
        self.update(|s| {
            s.pending -= 1;
            s.owned |= claimed;
        });
    }

    /// The owner's result: `Some` when the response was stored.
    pub(crate) fn land(&mut self, stored: Option<Response>) {
        if self.phase != Phase::Owner {
            return;
        }
        self.phase = Phase::Done;
        self.update(|s| {
            s.owned = false;
            s.result = Some(stored);
        });
    }

    /// Applies `change`, wakes every waiter, and drops the flight from the
    /// table once it can no longer produce a result (landed, or nobody owns
    /// it and nobody is inside `begin`), so the next arrival starts afresh.
    fn update(&self, change: impl FnOnce(&mut FlightState)) {
        // Lock order: table, then flight (as in `enter`).
        let mut table = lock(&self.flights.table);
        let mut state = lock(&self.flight.state);
        change(&mut state);
        let finished = state.result.is_some() || (!state.owned && state.pending == 0);
        if finished
            && table
                .get(&self.key)
                .is_some_and(|f| Arc::ptr_eq(f, &self.flight))
        {
            table.remove(&self.key);
        }
        for waker in state.wakers.drain(..) {
            waker.wake();
        }
        drop(state);
        drop(table);
        self.flight.landed.notify_all();
    }

    /// Blocks this thread until the flight answers or `deadline` passes.
    pub(crate) fn wait_blocking(&self, deadline: Instant) -> Waited {
        let mut state = lock(&self.flight.state);
        loop {
            if let Some(answer) = state.answer() {
                return answer;
            }
            let now = Instant::now();
            if now >= deadline {
                return Waited::InFlight;
            }
            state = self
                .flight
                .landed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Polls for the flight's answer without blocking (the deadline is the
    /// caller's timer).
    #[cfg(feature = "tokio")]
    pub(crate) fn poll_answer(&self, cx: &mut Context<'_>) -> Poll<Waited> {
        let mut state = lock(&self.flight.state);
        if let Some(answer) = state.answer() {
            return Poll::Ready(answer);
        }
        if !state.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            state.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        match self.phase {
            // Dropped inside `begin` (a cancelled future): no longer pending.
            Phase::Pending => self.begun(false),
            // An owner that never landed (panic, cancellation): its waiters
            // must not wait for a result that will not come.
            Phase::Owner => self.land(None),
            Phase::Begun | Phase::Done => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key() -> Key {
        Key::new("", "k").unwrap()
    }

    #[test]
    fn waiter_gets_the_stored_response() {
        let flights = Arc::new(Flights::default());
        let mut owner = flights.enter(&key());
        owner.begun(true);
        let mut dup = flights.enter(&key());
        dup.begun(false);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            owner.land(Some(Response::new(201, "done")));
        });
        let got = dup.wait_blocking(Instant::now() + Duration::from_secs(10));
        assert!(matches!(got, Waited::Stored(ref r) if r.body() == b"done"));
        t.join().unwrap();
        drop(dup);
        assert_eq!(flights.len(), 0);
    }

    #[test]
    fn no_local_owner_answers_at_once() {
        let flights = Arc::new(Flights::default());
        let mut dup = flights.enter(&key());
        dup.begun(false);
        let started = Instant::now();
        let got = dup.wait_blocking(started + Duration::from_secs(60));
        assert!(matches!(got, Waited::InFlight));
        assert!(started.elapsed() < Duration::from_secs(30));
        assert_eq!(flights.len(), 0);
    }

    #[test]
    fn waits_for_a_participant_still_inside_begin() {
        // The owner's `begin` has committed (the duplicate saw PROCESSING)
        // but the owner has not reported yet: the duplicate must not give up.
        let flights = Arc::new(Flights::default());
        let mut owner = flights.enter(&key());
        let mut dup = flights.enter(&key());
        dup.begun(false);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            owner.begun(true);
            owner.land(Some(Response::new(200, "x")));
        });
        let got = dup.wait_blocking(Instant::now() + Duration::from_secs(10));
        assert!(matches!(got, Waited::Stored(_)));
        t.join().unwrap();
    }

    #[test]
    fn dropped_owner_wakes_waiters_with_retry() {
        let flights = Arc::new(Flights::default());
        let mut owner = flights.enter(&key());
        owner.begun(true);
        let mut dup = flights.enter(&key());
        dup.begun(false);
        drop(owner);
        assert!(matches!(
            dup.wait_blocking(Instant::now() + Duration::from_secs(10)),
            Waited::Retry
        ));
    }

    #[test]
    fn deadline_answers_in_flight() {
        let flights = Arc::new(Flights::default());
        let mut owner = flights.enter(&key());
        owner.begun(true);
        let mut dup = flights.enter(&key());
        dup.begun(false);
        let got = dup.wait_blocking(Instant::now() + Duration::from_millis(10));
        assert!(matches!(got, Waited::InFlight));
        owner.land(None);
    }
}
