//! The runs of a key in this process (its *flight*), shared by every guard
//! over one store: who owns the key here, and the duplicates waiting for it.
//!
//! **A live local owner is decided here, not by the wall clock.** A lease is
//! a wall-clock timestamp (it must survive a restart), so a clock that steps
//! forward by more than the remaining lease (NTP correcting a slow clock, a
//! VM resumed or migrated) makes every claim look expired at once, and the
//! store would let a retry take a key over while its owner still runs in
//! this very process. So every run *enters* the flight of its key before it
//! calls `begin`; a run that finds the key owned by a live run of this
//! process with the same fingerprint answers InFlight without asking the
//! store. An owner is live while its run lives and its renewals have not
//! found the claim taken over (renewal on), or for its lease measured on the
//! monotonic clock since the claim (renewal off). The wall-clock lease
//! decides only for owners in other processes, or gone.
//!
//! **Waiting duplicates.** The store only says "in flight"; it cannot say
//! whether the owner runs in this process, and polling it would cost a store
//! call per tick. A duplicate of a guard with waiting on that was told
//! InFlight waits on the flight (a `Condvar` for the synchronous `run`,
//! wakers for `run_async`: one state machine, two ways to block) until:
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
//! an owner that never lands wakes its waiters with "not stored" and stops
//! counting as live at once.
//!
//! The table is the process's: a flight is keyed by the store object
//! ([`Store::instance`](crate::Store::instance)) and the key, and leaves the
//! table when its last participant does. A store object cannot be freed
//! while a run over it holds an entry (the run's guard holds the store), so
//! its address names it for as long as its entries exist.

use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::Claim;
use crate::response::Response;
use crate::time::Timestamp;
use std::collections::HashMap;
use std::collections::hash_map::{Entry, RandomState};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard, PoisonError};
use std::task::Waker;
#[cfg(feature = "tokio")]
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

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

/// The flights of the process, one per (store object, key) with a
/// participant, by the hash of the pair: a run hashes its key once (the
/// tables' own hasher only passes that hash on). The tables are shards,
/// so that runs of other keys on other threads rarely share a lock or its
/// cache line.
#[derive(Debug)]
pub(crate) struct Flights {
    shards: [Mutex<Table>; SHARDS],
    /// Keyed at random: the keys come from clients.
    hasher: RandomState,
}

type Table = HashMap<u64, Bucket, BuildHasherDefault<Prehashed>>;

const SHARDS: usize = 16;

impl Default for Flights {
    fn default() -> Flights {
        Flights {
            shards: std::array::from_fn(|_| Mutex::default()),
            hasher: RandomState::new(),
        }
    }
}

/// The flights whose pairs share a hash (almost always one).
#[derive(Debug)]
enum Bucket {
    One(Arc<Flight>),
    Many(Vec<Arc<Flight>>),
}

impl Bucket {
    fn find(&self, store: usize, key: &Key) -> Option<&Arc<Flight>> {
        let is = |f: &&Arc<Flight>| f.store == store && f.key == *key;
        match self {
            Bucket::One(flight) => Some(flight).filter(is),
            Bucket::Many(flights) => flights.iter().find(is),
        }
    }

    fn push(&mut self, flight: Arc<Flight>) {
        match self {
            Bucket::One(first) => *self = Bucket::Many(vec![Arc::clone(first), flight]),
            Bucket::Many(flights) => flights.push(flight),
        }
    }

    /// Takes `flight` out; true when the bucket is left empty.
    fn remove(&mut self, flight: &Arc<Flight>) -> bool {
        match self {
            Bucket::One(only) => Arc::ptr_eq(only, flight),
            Bucket::Many(flights) => {
                flights.retain(|f| !Arc::ptr_eq(f, flight));
                flights.is_empty()
            }
        }
    }
}

/// A hasher for keys that are hashes already.
#[derive(Debug, Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// The process's flights.
pub(crate) static FLIGHTS: LazyLock<Flights> = LazyLock::new(Flights::default);

#[derive(Debug)]
struct Flight {
    store: usize,
    key: Key,
    hash: u64,
    state: Mutex<FlightState>,
    landed: Condvar,
}

#[derive(Debug, Default)]
struct FlightState {
    /// Participants whose `begin` has not answered yet.
    pending: usize,
    /// The participant that holds the claim, until it lands.
    owner: Option<Owner>,
    /// The owner's result, once landed (`None` inside: not stored).
    result: Option<Option<Response>>,
    /// Async waiters to wake on any change.
    wakers: Vec<Waker>,
    /// Threads blocked on `landed`: notified only when there are any
    /// (a notification is a system call even when nobody waits).
    sleepers: usize,
}

/// The run that holds the claim of a flight's key.
#[derive(Debug)]
struct Owner {
    fingerprint: Fingerprint,
    /// When `begin` answered, on the monotonic clock.
    since: Instant,
    /// The owner's lease.
    lease: Duration,
    /// Its claim; once the guard renews it, with the renewal attached.
    claim: Claim,
}

impl Owner {
    /// The lease end a duplicate with `fingerprint` is told, or `None` when
    /// this owner does not hold off such a duplicate: another fingerprint
    /// (the store answers it), a claim a renewal found taken over, or,
    /// without renewal, a lease run out on the monotonic clock.
    fn live_until(&self, fingerprint: &Fingerprint, now: Timestamp) -> Option<Timestamp> {
        if self.fingerprint != *fingerprint || self.claim.lease_lost() {
            return None;
        }
        let left = if self.claim.renewal.is_some() {
            // Renewed while the run lives: the next renewal stores about
            // a lease from now, whatever the wall clock did.
            self.lease
        } else {
            (self.since + self.lease).checked_duration_since(Instant::now())?
        };
        Some(self.claim.lease_until().max(now + left))
    }
}

impl FlightState {
    /// The answer for a waiter, or `None` to keep waiting.
    fn answer(&self) -> Option<Waited> {
        match &self.result {
            Some(Some(response)) => Some(Waited::Stored(response.clone())),
            Some(None) => Some(Waited::Retry),
            None if self.owner.is_none() && self.pending == 0 => Some(Waited::InFlight),
            None => None,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every change under these locks is whole before the lock is let go: a
    // panic elsewhere cannot leave the state half-written.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Inside `begin`.
    Pending,
    /// `begin` answered something other than Claimed (or was not asked:
    /// a live local owner answered).
    Begun,
    /// `begin` answered Claimed; the result is not landed yet.
    Owner,
    /// Landed.
    Done,
}

/// One run's participation in the flight of its key.
#[derive(Debug)]
pub(crate) struct Entered {
    flights: &'static Flights,
    flight: Arc<Flight>,
    fingerprint: Fingerprint,
    phase: Phase,
    /// A live local owner's lease end, when one held the key at entry.
    local_owner: Option<Timestamp>,
}

impl Flights {
    /// Enters the flight of `key` on the store object `store` (creating
    /// it). When a live run of this process owns the key for the same
    /// `fingerprint`, the participant does not ask the store
    /// ([`Entered::local_owner`]); otherwise it counts as inside `begin`.
    pub(crate) fn enter(
        &'static self,
        store: usize,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
    ) -> Entered {
        let hash = self.hasher.hash_one((store, key));
        // Made before the lock, which is then held for a lookup only: a
        // key is rarely in flight twice at once.
        let new = Arc::new(Flight {
            store,
            key: key.clone(),
            hash,
            state: Mutex::default(),
            landed: Condvar::new(),
        });
        let mut table = self.lock(hash);
        let flight = match table.entry(hash) {
            Entry::Occupied(mut bucket) => match bucket.get().find(store, key) {
                Some(flight) => Arc::clone(flight),
                None => {
                    bucket.get_mut().push(Arc::clone(&new));
                    new
                }
            },
            Entry::Vacant(slot) => {
                slot.insert(Bucket::One(Arc::clone(&new)));
                new
            }
        };
        let mut state = lock(&flight.state);
        let local_owner = state
            .owner
            .as_ref()
            .and_then(|owner| owner.live_until(fingerprint, now));
        if local_owner.is_none() {
            state.pending += 1;
        }
        drop(state);
        drop(table);
        Entered {
            flights: self,
            flight,
            fingerprint: *fingerprint,
            phase: if local_owner.is_some() {
                Phase::Begun
            } else {
                Phase::Pending
            },
            local_owner,
        }
    }

    /// The shard of `hash`.
    fn lock(&self, hash: u64) -> MutexGuard<'_, Table> {
        // The high bits: the tables index their buckets with the low ones.
        let shard = usize::try_from(hash >> 60).unwrap_or(0) % SHARDS;
        lock(self.shards.get(shard).unwrap_or(&self.shards[0]))
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }
}

impl Entered {
    /// The lease end to answer InFlight with when a live run of this
    /// process owned the key (same fingerprint) as this run entered.
    pub(crate) fn local_owner(&self) -> Option<Timestamp> {
        self.local_owner
    }

    /// Records what `begin` answered: a claim makes this run the owner,
    /// live for `lease` on the monotonic clock unless renewed.
    pub(crate) fn begun(&mut self, claimed: Option<(&Claim, Duration)>) {
        if self.phase != Phase::Pending {
            return;
        }
        self.phase = if claimed.is_some() {
            Phase::Owner
        } else {
            Phase::Begun
        };
        let fingerprint = self.fingerprint;
        // Becoming the owner cannot finish the flight.
        self.update(claimed.is_none(), |s| {
            s.pending -= 1;
            if let Some((claim, lease)) = claimed {
                s.owner = Some(Owner {
                    fingerprint,
                    since: Instant::now(),
                    lease,
                    claim: claim.clone(),
                });
            }
        });
    }

    /// The owner's claim as the guard renews it (its renewal attached), so
    /// that the owner stays live for as long as its run.
    pub(crate) fn renewed(&mut self, claim: &Claim) {
        if self.phase != Phase::Owner {
            return;
        }
        let mut state = lock(&self.flight.state);
        if let Some(owner) = state.owner.as_mut() {
            owner.claim = claim.clone();
        }
    }

    /// The owner's result: `Some` when the response was stored.
    pub(crate) fn land(&mut self, stored: Option<Response>) {
        if self.phase != Phase::Owner {
            return;
        }
        self.phase = Phase::Done;
        self.update(true, |s| {
            s.owner = None;
            s.result = Some(stored);
        });
    }

    /// Applies `change`, wakes every waiter, and drops the flight from the
    /// table once it can no longer produce a result (landed, or nobody owns
    /// it and nobody is inside `begin`), so the next arrival starts afresh.
    /// A change that cannot finish the flight (`may_finish` false) takes
    /// the flight's lock alone.
    fn update(&self, may_finish: bool, change: impl FnOnce(&mut FlightState)) {
        // Lock order: table, then flight (as in `enter`).
        let mut table = may_finish.then(|| self.flights.lock(self.flight.hash));
        let mut state = lock(&self.flight.state);
        change(&mut state);
        let finished = state.result.is_some() || (state.owner.is_none() && state.pending == 0);
        if finished
            && let Some(table) = table.as_mut()
            && let Entry::Occupied(mut bucket) = table.entry(self.flight.hash)
            && bucket.get_mut().remove(&self.flight)
        {
            bucket.remove();
        }
        for waker in state.wakers.drain(..) {
            waker.wake();
        }
        let sleepers = state.sleepers > 0;
        drop(state);
        drop(table);
        if sleepers {
            self.flight.landed.notify_all();
        }
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
            state.sleepers += 1;
            state = self
                .flight
                .landed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            state.sleepers -= 1;
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
            Phase::Pending => self.begun(None),
            // An owner that never landed (panic, cancellation): its waiters
            // must not wait for a result that will not come, and it no
            // longer holds off duplicates.
            Phase::Owner => self.land(None),
            Phase::Begun | Phase::Done => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    fn key() -> Key {
        Key::new("", "k").unwrap()
    }

    fn fp() -> Fingerprint {
        Fingerprint::of(b"x")
    }

    fn t0() -> Timestamp {
        Timestamp::from_millis(1_000)
    }

    fn claim() -> Claim {
        Claim::new(1, t0() + LEASE, false, 1)
    }

    fn flight(store: usize, id: &str) -> Arc<Flight> {
        Arc::new(Flight {
            store,
            key: Key::new("", id).unwrap(),
            hash: 7,
            state: Mutex::default(),
            landed: Condvar::new(),
        })
    }

    #[test]
    fn a_bucket_keeps_pairs_with_one_hash_apart() {
        // Equal hashes cannot be produced through `RandomState`: the
        // bucket is filled directly.
        let (a, b, c) = (flight(1, "a"), flight(1, "b"), flight(2, "a"));
        let mut bucket = Bucket::One(Arc::clone(&a));
        assert!(bucket.find(1, &a.key).is_some_and(|f| Arc::ptr_eq(f, &a)));
        assert!(bucket.find(1, &b.key).is_none());
        assert!(bucket.find(2, &a.key).is_none());
        bucket.push(Arc::clone(&b));
        bucket.push(Arc::clone(&c));
        assert!(bucket.find(1, &b.key).is_some_and(|f| Arc::ptr_eq(f, &b)));
        assert!(bucket.find(2, &a.key).is_some_and(|f| Arc::ptr_eq(f, &c)));
        assert!(bucket.find(2, &b.key).is_none());
        assert!(!bucket.remove(&a), "two flights are left");
        assert!(bucket.find(1, &a.key).is_none());
        assert!(bucket.find(1, &b.key).is_some());
        assert!(!bucket.remove(&b));
        assert!(bucket.find(2, &a.key).is_some());
        assert!(bucket.remove(&c), "the bucket is empty");
        assert!(!Bucket::One(Arc::clone(&a)).remove(&b), "another flight");
        assert!(Bucket::One(Arc::clone(&a)).remove(&a));
    }

    #[test]
    fn a_live_owner_holds_off_its_own_fingerprint_only() {
        use crate::record::Renewal;
        let flights: &'static Flights = Box::leak(Box::default());
        let mut owner = flights.enter(1, &key(), &fp(), t0());
        assert_eq!(owner.local_owner(), None);
        owner.begun(Some((&claim(), LEASE)));
        // Far past the wall-clock lease: still held off, told a lease ahead.
        let later = t0() + 100 * LEASE;
        let dup = flights.enter(1, &key(), &fp(), later);
        // No renewal attached yet: the lease left on the monotonic clock.
        assert!(
            dup.local_owner()
                .is_some_and(|until| until > later && until <= later + LEASE)
        );
        drop(dup);
        // Another fingerprint, another store object: the store answers.
        assert_eq!(
            flights
                .enter(1, &key(), &Fingerprint::of(b"y"), later)
                .local_owner(),
            None
        );
        assert_eq!(flights.enter(2, &key(), &fp(), later).local_owner(), None);
        // A renewal found the claim taken over: no longer live.
        let renewal = Arc::new(Renewal::new(t0() + LEASE));
        let mut renewed = claim();
        renewed.renewal = Some(Arc::clone(&renewal));
        owner.renewed(&renewed);
        assert!(
            flights
                .enter(1, &key(), &fp(), later)
                .local_owner()
                .is_some()
        );
        renewal.lose();
        assert_eq!(flights.enter(1, &key(), &fp(), later).local_owner(), None);
        owner.land(None);
        assert_eq!(flights.enter(1, &key(), &fp(), later).local_owner(), None);
        assert_eq!(flights.len(), 0);
    }

    #[test]
    fn waiter_gets_the_stored_response() {
        let flights: &'static Flights = Box::leak(Box::default());
        let mut owner = flights.enter(1, &key(), &fp(), t0());
        owner.begun(Some((&claim(), LEASE)));
        let mut dup = flights.enter(1, &key(), &fp(), t0());
        dup.begun(None);
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
        let flights: &'static Flights = Box::leak(Box::default());
        let mut dup = flights.enter(1, &key(), &fp(), t0());
        dup.begun(None);
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
        let flights: &'static Flights = Box::leak(Box::default());
        let mut owner = flights.enter(1, &key(), &fp(), t0());
        let mut dup = flights.enter(1, &key(), &fp(), t0());
        dup.begun(None);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            owner.begun(Some((&claim(), LEASE)));
            owner.land(Some(Response::new(200, "x")));
        });
        let got = dup.wait_blocking(Instant::now() + Duration::from_secs(10));
        assert!(matches!(got, Waited::Stored(_)));
        t.join().unwrap();
    }

    #[test]
    fn dropped_owner_wakes_waiters_with_retry() {
        let flights: &'static Flights = Box::leak(Box::default());
        let mut owner = flights.enter(1, &key(), &fp(), t0());
        owner.begun(Some((&claim(), LEASE)));
        let mut dup = flights.enter(1, &key(), &fp(), t0());
        dup.begun(None);
        drop(owner);
        assert!(matches!(
            dup.wait_blocking(Instant::now() + Duration::from_secs(10)),
            Waited::Retry
        ));
    }

    #[test]
    fn deadline_answers_in_flight() {
        let flights: &'static Flights = Box::leak(Box::default());
        let mut owner = flights.enter(1, &key(), &fp(), t0());
        owner.begun(Some((&claim(), LEASE)));
        let mut dup = flights.enter(1, &key(), &fp(), t0());
        dup.begun(None);
        let got = dup.wait_blocking(Instant::now() + Duration::from_millis(10));
        assert!(matches!(got, Waited::InFlight));
        owner.land(None);
    }
}
