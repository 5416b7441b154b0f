//! The conformance suite: the contract (the five `begin` cases, fencing,
//! expiry, limits, concurrency), run unchanged against every backend
//! through [`conformance!`](crate::conformance!).
//!
//! A backend's tests write a factory `fn() -> Subject` that opens a fresh,
//! empty store (and keeps whatever must outlive it, such as a temp dir), then
//! invoke the macro. Fault scenarios wrap the subject in `FaultyStore`, so
//! the engine underneath is the real one. Each case is also a public
//! function taking the factory, and [`run_all`] runs them all and reports.

use crate::{FaultyStore, Op};
use idemstore::{
    Begin, Claim, Clock, Error, Fingerprint, Guard, Key, ManualClock, Outcome, Response, State,
    Step, Store, Timestamp,
};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

/// A fresh store under test, plus what must live as long as it.
pub struct Subject {
    /// The store under test.
    pub store: Arc<dyn Store>,
    _keep: Box<dyn Any + Send + Sync>,
}

impl Subject {
    /// A subject: `store`, and `keep` (dropped after the store; e.g. the
    /// `tempfile::TempDir` its files are in, or `()`).
    pub fn new(store: impl Store + 'static, keep: impl Any + Send + Sync) -> Subject {
        Subject {
            store: Arc::new(store),
            _keep: Box::new(keep),
        }
    }
}

/// Runs the whole conformance suite against a store factory, one `#[test]`
/// per case, in the calling crate's test module.
///
/// `$factory` is a `fn() -> Subject` that opens a fresh, empty store (and
/// keeps whatever must outlive it, such as a temporary directory, in the
/// [`Subject`]). `conformance!(factory, when: enabled)` runs each case only
/// when `enabled()` is true, for a backend that needs an external server:
/// its `enabled` should say plainly when the server is missing (and fail
/// under CI rather than skip).
///
/// ```
/// use idemstore::MemoryStore;
/// use idemstore_testkit::conformance::Subject;
///
/// fn subject() -> Subject {
///     Subject::new(MemoryStore::new(), ())
/// }
///
/// idemstore_testkit::conformance!(subject);
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! conformance {
    ($factory:path) => {
        $crate::conformance!($factory, when: $crate::conformance::always);
    };
    ($factory:path, when: $enabled:path) => {
        $crate::__conformance_cases!(__conformance_tests; $factory, $enabled);
    };
}

/// The one list of cases: passes it to `$callback` after `$args`, so the
/// `#[test]`s of [`conformance!`] and [`CASES`] cannot drift apart.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($callback:ident; $($args:tt)*) => {
        $crate::$callback! { $($args)*;
            seed_eight_concurrent_workers_execute_once,
            seed_complete_fails_then_takeover_then_window,
            begin_claims_absent_key,
            begin_conflict_leaves_record_untouched,
            begin_replays_done,
            begin_in_flight_inside_lease,
            begin_takes_over_expired_lease,
            lease_boundaries,
            expiry_boundaries,
            stale_claim_rejected_after_takeover,
            release_lets_a_retry_claim_at_once,
            renew_extends_the_lease_and_never_shortens_it,
            renew_after_takeover_is_stale,
            renew_of_a_completed_or_released_claim_is_stale,
            renew_racing_a_takeover_has_one_winner,
            renew_keeps_the_record_alive_past_its_retention,
            a_handler_five_leases_long_runs_once,
            a_clock_step_never_runs_a_live_handler_twice,
            scopes_isolate,
            expired_records_invisible_before_sweep,
            sweep_removes_only_expired_and_is_bounded,
            sweep_takes_equal_expiries_in_key_order,
            tokens_increase_across_keys,
            clock_jumps_never_let_a_stale_owner_complete,
            oversized_response_writes_nothing,
            invalid_durations_rejected_before_io,
            complete_after_expiry_is_stale,
            steps_are_recorded_and_read_back,
            a_takeover_claim_carries_the_steps,
            a_stale_owner_cannot_record_a_step,
            release_keeps_recorded_steps,
            complete_drops_the_steps,
            expiry_drops_the_steps,
            renew_keeps_the_steps,
            recording_a_step_twice_is_idempotent,
            step_limits_refuse_and_write_nothing,
            a_stale_owner_racing_a_takeover_records_nothing_after_it,
            concurrent_random_ops_never_two_live_claims,
            sequential_ops_match_model
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    ($factory:path, $enabled:path; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                if $enabled() {
                    $crate::conformance::$case(&$factory)
                }
            }
        )*
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_array {
    (; $($case:ident),* $(,)?) => {
        &[$((stringify!($case), $crate::conformance::$case as $crate::conformance::Case)),*]
    };
}

/// Every case of the suite by name, in the order [`conformance!`] lists them.
pub const CASES: &[(&str, Case)] = crate::__conformance_cases!(__conformance_array;);

/// One case of the suite: runs against a store factory, panics on a failure.
pub type Case = fn(Make<'_>);

/// A case that failed in [`run_all`]: its name and its panic message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The case's name (a function in this module).
    pub case: &'static str,
    /// What the case's assertion said.
    pub message: String,
}

/// Runs every case against `make` in this thread, one after another, and
/// returns the cases that failed (empty: the store conforms). For a test
/// that expects a store to fail (a deliberately broken variant), or a tool
/// that reports; a crate's own tests should use [`conformance!`], which
/// makes one `#[test]` per case.
///
/// ```
/// use idemstore::MemoryStore;
/// use idemstore_testkit::conformance::{run_all, Subject};
///
/// assert_eq!(run_all(&|| Subject::new(MemoryStore::new(), ())), vec![]);
/// ```
pub fn run_all(make: Make<'_>) -> Vec<Failure> {
    let mut failures = Vec::new();
    for &(case, run) in CASES {
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(make))) {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "a panic without a message".to_owned());
            failures.push(Failure { case, message });
        }
    }
    failures
}

/// The `when:` of backends that always run.
pub fn always() -> bool {
    true
}

/// A store factory: each call opens a fresh, empty store.
pub type Make<'a> = &'a dyn Fn() -> Subject;

/// 2026-10-19T04:00:00Z: the base time of every case (a manual clock starts here).
pub const T0: Timestamp = Timestamp::from_millis(1_760_846_400_000);
const SEC: Duration = Duration::from_secs(1);
const HOUR: Duration = Duration::from_secs(3600);

fn key(id: &str) -> Key {
    Key::new("tenant-42", id).expect("valid key")
}

fn claimed(b: Begin) -> Claim {
    match b {
        Begin::Claimed(c) => c,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// An in-test ledger (stock, reservations, charges): applies a reservation and a charge once per
/// idempotency key, however often it is called.
#[derive(Default)]
pub struct Ledger {
    inner: Mutex<LedgerState>,
}

/// The ledger's contents.
#[derive(Default, Debug)]
pub struct LedgerState {
    /// Units left.
    pub stock: i64,
    /// Units reserved, by order.
    pub reservations: HashMap<String, i64>,
    /// Cents charged, by order.
    pub charges: HashMap<String, i64>,
}

impl Ledger {
    /// A ledger holding `stock` units.
    pub fn new(stock: i64) -> Ledger {
        Ledger {
            inner: Mutex::new(LedgerState {
                stock,
                ..LedgerState::default()
            }),
        }
    }

    /// Reserves `qty` and charges `cents` for `key`, once.
    pub fn apply(&self, key: &str, qty: i64, cents: i64) -> Result<(), &'static str> {
        let mut s = self.inner.lock().unwrap();
        if s.reservations.contains_key(key) {
            return Ok(());
        }
        if s.stock < qty {
            return Err("OUT_OF_STOCK");
        }
        s.stock -= qty;
        s.reservations.insert(key.to_owned(), qty);
        s.charges.insert(key.to_owned(), cents);
        Ok(())
    }

    /// `(stock, reservations, charges)`.
    pub fn snapshot(&self) -> (i64, usize, usize) {
        let s = self.inner.lock().unwrap();
        (s.stock, s.reservations.len(), s.charges.len())
    }
}

/// The order handler of the seed scenarios: counts calls, sleeps, applies the ledger; a
/// deterministic OUT_OF_STOCK is an Ok 409 response, stored like any other.
fn order_handler<'a>(
    ledger: &'a Ledger,
    order: &'a str,
    calls: &'a AtomicU32,
    delay: Duration,
) -> impl FnOnce(&Claim) -> Result<Response, std::convert::Infallible> + 'a {
    move |_claim| {
        calls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(delay);
        Ok(match ledger.apply(order, 1, 1000) {
            Ok(()) => Response::new(200, "paid"),
            Err(e) => Response::new(409, e),
        })
    }
}

fn guard_on(store: Arc<dyn Store>, clock: &ManualClock) -> Guard<Arc<dyn Store>> {
    Guard::builder(store)
        .clock(clock.clone())
        .lease(SEC)
        .retention(HOUR)
        .build()
        .expect("valid config")
}

/// Seed scenario 1: 8 concurrent workers, same key and fingerprint, handler
/// sleeps 20 ms: one Executed, the others InFlight (or Replayed, for a
/// worker whose `begin` a loaded machine delays past the first's
/// completion: a duplicate's answer either way); stock 10 → 9.
pub fn seed_eight_concurrent_workers_execute_once(make: Make<'_>) {
    let subject = make();
    let clock = ManualClock::new(T0);
    let guard = guard_on(Arc::clone(&subject.store), &clock);
    let ledger = Ledger::new(10);
    let calls = AtomicU32::new(0);
    let k = key("order-1");
    let fp = Fingerprint::of(b"sku=A&qty=1");
    let barrier = Barrier::new(8);
    let outcomes: Vec<Outcome<std::convert::Infallible>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    guard.run(
                        &k,
                        &fp,
                        order_handler(&ledger, "order-1", &calls, Duration::from_millis(20)),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let executed = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Executed(_)))
        .count();
    let duplicates = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::InFlight { .. } | Outcome::Replayed(_)))
        .count();
    assert_eq!((executed, duplicates), (1, 7), "outcomes: {outcomes:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(ledger.snapshot(), (9, 1, 1));

    let out = guard.run(
        &k,
        &Fingerprint::of(b"sku=A&qty=2"),
        order_handler(&ledger, "order-1", &calls, Duration::ZERO),
    );
    assert!(matches!(out, Outcome::Conflicted), "{out:?}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "a conflict never runs the handler"
    );
}

/// Seed scenario 2: `complete` fails once; the retry inside the lease is
/// InFlight; after the lease a takeover executes again; the ledger absorbs
/// it; after retention it runs a third time; a dead store fails closed.
pub fn seed_complete_fails_then_takeover_then_window(make: Make<'_>) {
    let subject = make();
    let faulty = Arc::new(FaultyStore::new(Arc::clone(&subject.store)));
    let clock = ManualClock::new(T0);
    let guard = guard_on(faulty.clone(), &clock);
    let ledger = Ledger::new(10);
    let calls = AtomicU32::new(0);
    let k = key("order-2");
    let fp = Fingerprint::of(b"sku=A&qty=1");
    let h = || order_handler(&ledger, "order-2", &calls, Duration::ZERO);

    faulty.fail_next(Op::Complete, 1);
    let first = guard.run(&k, &fp, h());
    assert!(matches!(first, Outcome::NotStored { .. }), "{first:?}");
    let rec = subject
        .store
        .get(&k, clock.now())
        .unwrap()
        .expect("record kept");
    assert_eq!(
        rec.state(),
        State::Processing,
        "a failed complete leaves the record PROCESSING"
    );

    let inside = guard.run(&k, &fp, h());
    assert!(
        matches!(inside, Outcome::InFlight { lease_until } if lease_until == T0 + SEC),
        "{inside:?}"
    );

    clock.advance(2 * SEC);
    let after = guard.run(&k, &fp, h());
    assert!(
        matches!(after, Outcome::Executed(ref r) if r.body() == b"paid"),
        "{after:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        ledger.snapshot(),
        (9, 1, 1),
        "the ledger absorbed the second run"
    );
    assert_eq!(guard.stats().takeovers, 1);

    clock.advance(2 * HOUR);
    let window = guard.run(&k, &fp, h());
    assert!(matches!(window, Outcome::Executed(_)), "{window:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(ledger.snapshot(), (9, 1, 1));

    faulty.fail_all();
    let down = guard.run(&key("order-3"), &fp, h());
    assert!(matches!(down, Outcome::Unavailable(_)), "{down:?}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "fail closed: the handler did not run"
    );
    assert_eq!(guard.stats().unavailable, 1);
}

/// A key never seen is claimed: PROCESSING, lease and expiry from `now`, a token, attempt 1.
pub fn begin_claims_absent_key(make: Make<'_>) {
    let s = make().store_owned();
    let fp = Fingerprint::of(b"a");
    let c = claimed(s.begin(&key("k"), &fp, T0, SEC, HOUR).unwrap());
    assert!(!c.is_takeover());
    assert_eq!(c.attempt(), 1);
    assert_eq!(c.lease_until(), T0 + SEC);
    let rec = s.get(&key("k"), T0).unwrap().unwrap();
    assert_eq!(rec.state(), State::Processing);
    assert_eq!(rec.fingerprint(), &fp);
    assert_eq!(rec.token(), c.token());
    assert_eq!(rec.lease_until(), Some(T0 + SEC));
    assert_eq!(rec.expires_at(), T0 + HOUR);
    assert_eq!(rec.created_at(), T0);
    assert!(rec.response().is_none());
}

/// The same key with another fingerprint is `Conflict`, and the stored record is unchanged.
pub fn begin_conflict_leaves_record_untouched(make: Make<'_>) {
    let s = make().store_owned();
    let k = key("k");
    let c = claimed(s.begin(&k, &Fingerprint::of(b"a"), T0, SEC, HOUR).unwrap());
    let before = s.get(&k, T0).unwrap();
    // Even with the lease expired, a different fingerprint is a conflict, not a takeover.
    let later = T0 + 2 * SEC;
    assert_eq!(
        s.begin(&k, &Fingerprint::of(b"b"), later, SEC, HOUR)
            .unwrap(),
        Begin::Conflict
    );
    assert_eq!(s.get(&k, T0).unwrap(), before);
    s.complete(&k, &c, &Response::new(200, "x"), T0, HOUR)
        .unwrap();
    assert_eq!(
        s.begin(&k, &Fingerprint::of(b"b"), T0, SEC, HOUR).unwrap(),
        Begin::Conflict
    );
    assert_eq!(s.get(&k, T0).unwrap().unwrap().state(), State::Done);
}

/// A DONE record is replayed, byte for byte, to every retry.
pub fn begin_replays_done(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let resp = Response::new(201, vec![0u8, 1, 2, 255])
        .with_header("content-type", "application/octet-stream")
        .with_header("x-trace", vec![0xff, 0x00]);
    s.complete(&k, &c, &resp, T0 + SEC / 2, HOUR).unwrap();
    for t in [
        T0,
        T0 + 10 * SEC,
        T0 + SEC / 2 + HOUR - Duration::from_millis(1),
    ] {
        assert_eq!(
            s.begin(&k, &fp, t, SEC, HOUR).unwrap(),
            Begin::Replay(resp.clone())
        );
    }
    let rec = s.get(&k, T0).unwrap().unwrap();
    assert_eq!(rec.state(), State::Done);
    assert_eq!(rec.lease_until(), None, "complete clears the lease");
    assert_eq!(
        rec.expires_at(),
        T0 + SEC / 2 + HOUR,
        "complete moves the expiry to now + retention"
    );
    assert_eq!(rec.response(), Some(&resp));
}

/// A live PROCESSING record answers `InFlight` with its lease end.
pub fn begin_in_flight_inside_lease(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let _c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    assert_eq!(
        s.begin(&k, &fp, T0 + SEC / 2, SEC, HOUR).unwrap(),
        Begin::InFlight {
            lease_until: T0 + SEC
        }
    );
}

/// A PROCESSING record whose lease ran out is taken over under a new, larger token.
pub fn begin_takes_over_expired_lease(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let first = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let t = T0 + 5 * SEC;
    let second = claimed(s.begin(&k, &fp, t, SEC, HOUR).unwrap());
    assert!(second.is_takeover());
    assert_eq!(second.attempt(), 2);
    assert!(second.token() > first.token());
    assert_eq!(second.lease_until(), t + SEC);
    let rec = s.get(&k, t).unwrap().unwrap();
    assert_eq!(rec.token(), second.token());
    assert_eq!(rec.attempts(), 2);
    assert_eq!(rec.expires_at(), T0 + HOUR, "a takeover keeps the expiry");
    assert_eq!(rec.created_at(), T0);
}

/// The lease ends exactly at `lease_until`: one millisecond before is `InFlight`, at it a takeover.
pub fn lease_boundaries(make: Make<'_>) {
    let ms = Duration::from_millis(1);
    for (offset, expect_claim) in [(SEC - ms, false), (SEC, true), (SEC + ms, true)] {
        let s = make().store_owned();
        let (k, fp) = (key("k"), Fingerprint::of(b"a"));
        let _ = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
        let b = s.begin(&k, &fp, T0 + offset, SEC, HOUR).unwrap();
        if expect_claim {
            assert!(
                matches!(b, Begin::Claimed(ref c) if c.is_takeover()),
                "at lease{offset:?}: {b:?}"
            );
        } else {
            assert_eq!(
                b,
                Begin::InFlight {
                    lease_until: T0 + SEC
                },
                "at {offset:?}"
            );
        }
    }
}

/// The record expires exactly at `expires_at`: invisible from then on, and a new claim starts afresh.
pub fn expiry_boundaries(make: Make<'_>) {
    let ms = Duration::from_millis(1);
    for (offset, expect_fresh) in [(HOUR - ms, false), (HOUR, true), (HOUR + ms, true)] {
        let s = make().store_owned();
        let (k, fp) = (key("k"), Fingerprint::of(b"a"));
        let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
        s.complete(&k, &c, &Response::new(200, "done"), T0, HOUR)
            .unwrap();
        let t = T0 + offset;
        let visible = s.get(&k, t).unwrap();
        let b = s.begin(&k, &fp, t, SEC, HOUR).unwrap();
        if expect_fresh {
            assert!(visible.is_none(), "expired at {offset:?}");
            let fresh = claimed(b);
            assert!(
                !fresh.is_takeover(),
                "a claim over an expired record is fresh"
            );
            assert_eq!(fresh.attempt(), 1);
            assert!(fresh.token() > c.token());
        } else {
            assert!(visible.is_some());
            assert_eq!(
                b,
                Begin::Replay(Response::new(200, "done")),
                "at {offset:?}"
            );
        }
    }
}

/// After a takeover the old owner's `complete` and `release` are `StaleClaim` and change nothing.
pub fn stale_claim_rejected_after_takeover(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let old = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let new = claimed(s.begin(&k, &fp, T0 + 2 * SEC, SEC, HOUR).unwrap());
    let before = s.get(&k, T0 + 2 * SEC).unwrap();
    let r = s.complete(&k, &old, &Response::new(200, "late"), T0 + 2 * SEC, HOUR);
    assert!(matches!(r, Err(Error::StaleClaim)), "{r:?}");
    assert!(matches!(s.release(&k, &old), Err(Error::StaleClaim)));
    assert_eq!(
        s.get(&k, T0 + 2 * SEC).unwrap(),
        before,
        "a stale owner changes nothing"
    );
    s.complete(&k, &new, &Response::new(200, "new"), T0 + 2 * SEC, HOUR)
        .unwrap();
    // After DONE, the old claim and even the new one are stale.
    assert!(matches!(
        s.complete(&k, &new, &Response::new(200, "again"), T0 + 3 * SEC, HOUR),
        Err(Error::StaleClaim)
    ));
    assert!(matches!(s.release(&k, &new), Err(Error::StaleClaim)));
    assert_eq!(
        s.begin(&k, &fp, T0 + 3 * SEC, SEC, HOUR).unwrap(),
        Begin::Replay(Response::new(200, "new"))
    );
}

/// `release` deletes the claim, so a retry (even with another fingerprint) claims at once.
pub fn release_lets_a_retry_claim_at_once(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let first = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    s.release(&k, &first).unwrap();
    assert!(s.get(&k, T0).unwrap().is_none());
    let again = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    assert!(
        !again.is_takeover(),
        "after a release the retry is a fresh claim"
    );
    assert!(again.token() > first.token());
    assert!(matches!(s.release(&k, &first), Err(Error::StaleClaim)));
    // Released keys accept other parameters too: nothing was done under them.
    s.release(&k, &again).unwrap();
    assert!(matches!(
        s.begin(&k, &Fingerprint::of(b"other"), T0, SEC, HOUR)
            .unwrap(),
        Begin::Claimed(_)
    ));
}

/// `renew` moves the lease end to `now + lease` under the same token: a
/// retry inside the renewed lease is InFlight with the new end, and the
/// takeover comes one lease after the renewal. It never shortens a lease,
/// a lease that ran out but was not taken over may still be renewed, and a
/// lease under 1 ms is refused before any I/O.
pub fn renew_extends_the_lease_and_never_shortens_it(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let half = SEC / 2;
    let claim = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let renewed = s.renew(&k, &claim, T0 + half, SEC).unwrap();
    assert_eq!(renewed.token(), claim.token());
    assert_eq!(renewed.lease_until(), T0 + half + SEC);
    assert_eq!(
        s.get(&k, T0 + half).unwrap().and_then(|r| r.lease_until()),
        Some(T0 + half + SEC)
    );
    // Past the first lease, inside the renewed one.
    assert_eq!(
        s.begin(&k, &fp, T0 + SEC, SEC, HOUR).unwrap(),
        Begin::InFlight {
            lease_until: T0 + half + SEC
        }
    );
    // A shorter renewal leaves the lease where it is.
    let again = s
        .renew(&k, &renewed, T0 + half, Duration::from_millis(1))
        .unwrap();
    assert_eq!(again.lease_until(), T0 + half + SEC);
    assert!(matches!(
        s.renew(&k, &claim, T0 + half, Duration::ZERO),
        Err(Error::InvalidArgument { .. })
    ));
    // The lease runs out with nobody taking over: the owner may still renew.
    let late = s.renew(&k, &claim, T0 + 2 * SEC, SEC).unwrap();
    assert_eq!(late.lease_until(), T0 + 3 * SEC);
    assert!(matches!(
        s.begin(&k, &fp, T0 + 3 * SEC - Duration::from_millis(1), SEC, HOUR)
            .unwrap(),
        Begin::InFlight { .. }
    ));
    let next = claimed(s.begin(&k, &fp, T0 + 3 * SEC, SEC, HOUR).unwrap());
    assert!(next.is_takeover() && next.token() > claim.token());
    // The renewed claim completes as the original would have.
    assert!(matches!(
        s.complete(&k, &late, &Response::new(200, "late"), T0 + 3 * SEC, HOUR),
        Err(Error::StaleClaim)
    ));
}

/// After a takeover the old owner's renewal is `StaleClaim` and changes
/// nothing; the new owner renews.
pub fn renew_after_takeover_is_stale(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let old = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let new = claimed(s.begin(&k, &fp, T0 + SEC, SEC, HOUR).unwrap());
    let before = s.get(&k, T0 + SEC).unwrap();
    let r = s.renew(&k, &old, T0 + SEC, 10 * SEC);
    assert!(matches!(r, Err(Error::StaleClaim)), "{r:?}");
    assert_eq!(
        s.get(&k, T0 + SEC).unwrap(),
        before,
        "a stale renewal changes nothing"
    );
    let renewed = s.renew(&k, &new, T0 + SEC, 10 * SEC).unwrap();
    assert_eq!(renewed.lease_until(), T0 + 11 * SEC);
}

/// A completed or released claim renews nothing: the DONE record and the
/// free key stay as they are.
pub fn renew_of_a_completed_or_released_claim_is_stale(make: Make<'_>) {
    let s = make().store_owned();
    let fp = Fingerprint::of(b"a");
    let done = key("done");
    let claim = claimed(s.begin(&done, &fp, T0, SEC, HOUR).unwrap());
    s.complete(&done, &claim, &Response::new(201, "made"), T0, HOUR)
        .unwrap();
    assert!(matches!(
        s.renew(&done, &claim, T0, SEC),
        Err(Error::StaleClaim)
    ));
    assert_eq!(
        s.begin(&done, &fp, T0, SEC, HOUR).unwrap(),
        Begin::Replay(Response::new(201, "made"))
    );
    let gone = key("released");
    let claim = claimed(s.begin(&gone, &fp, T0, SEC, HOUR).unwrap());
    s.release(&gone, &claim).unwrap();
    assert!(matches!(
        s.renew(&gone, &claim, T0, SEC),
        Err(Error::StaleClaim)
    ));
    assert!(s.get(&gone, T0).unwrap().is_none(), "nothing was made");
    // A renewal after the record expired finds nothing to renew.
    let old = key("expired");
    let claim = claimed(s.begin(&old, &fp, T0, SEC, SEC).unwrap());
    assert!(matches!(
        s.renew(&old, &claim, T0 + SEC, SEC),
        Err(Error::StaleClaim)
    ));
}

/// An owner renewing just as its lease ran out, racing a retry's `begin`:
/// exactly one wins. Either the renewal stored a new lease (and the retry
/// is InFlight until it ends), or the retry took over (and the renewal is
/// `StaleClaim`).
pub fn renew_racing_a_takeover_has_one_winner(make: Make<'_>) {
    let s = make().store_owned();
    let fp = Fingerprint::of(b"a");
    let (mut renewals, mut takeovers) = (0, 0);
    for i in 0..24 {
        let k = key(&format!("race-{i}"));
        let claim = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
        let at = T0 + SEC; // the lease has just run out
        let barrier = Barrier::new(2);
        let (renewed, begun) = std::thread::scope(|scope| {
            let renewing = scope.spawn(|| {
                barrier.wait();
                s.renew(&k, &claim, at, SEC)
            });
            let retrying = scope.spawn(|| {
                barrier.wait();
                s.begin(&k, &fp, at, SEC, HOUR)
            });
            (renewing.join().unwrap(), retrying.join().unwrap())
        });
        match (&renewed, &begun) {
            (Ok(c), Ok(Begin::InFlight { lease_until })) => {
                assert_eq!(*lease_until, c.lease_until());
                assert_eq!(c.lease_until(), at + SEC);
                renewals += 1;
            }
            (Err(Error::StaleClaim), Ok(Begin::Claimed(c))) => {
                assert!(c.is_takeover() && c.token() > claim.token());
                takeovers += 1;
            }
            other => panic!("both or neither won: {other:?}"),
        }
    }
    assert_eq!(renewals + takeovers, 24);
}

/// A renewal past the record's retention moves its expiry with the lease:
/// the record stays visible (and unswept) while the lease holds.
pub fn renew_keeps_the_record_alive_past_its_retention(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    // Retention equal to the lease: without the renewal it expires at T0 + 1 s.
    let claim = claimed(s.begin(&k, &fp, T0, SEC, SEC).unwrap());
    let renewed = s.renew(&k, &claim, T0 + SEC / 2, 3 * SEC).unwrap();
    let at = T0 + 2 * SEC;
    let record = s.get(&k, at).unwrap().expect("still there");
    assert!(record.expires_at() >= renewed.lease_until());
    assert_eq!(s.sweep_expired(at, 10).unwrap(), 0);
    assert!(matches!(
        s.begin(&k, &fp, at, SEC, SEC).unwrap(),
        Begin::InFlight { .. }
    ));
    s.complete(&k, &renewed, &Response::new(200, "ok"), at, HOUR)
        .unwrap();
}

/// A guard renews its claim while the handler runs: a handler that runs
/// five leases long executes once, every retry meanwhile is InFlight (with
/// a lease end in the future: what `Retry-After` is made of), and a retry
/// after it replays. Real time (the renewals are a timer's): a lease of
/// 800 ms renewed every third of it leaves a renewal 500 ms to be late.
pub fn a_handler_five_leases_long_runs_once(make: Make<'_>) {
    const LEASE: Duration = Duration::from_millis(800);
    let subject = make();
    let guard = Guard::builder(Arc::clone(&subject.store))
        .clock(idemstore::SystemClock)
        .lease(LEASE)
        .retention(HOUR)
        .build()
        .expect("valid config");
    let (k, fp) = (key("long-export"), Fingerprint::of(b"all"));
    let calls = AtomicU32::new(0);
    let started = Barrier::new(2);
    let (owner, retries) = std::thread::scope(|s| {
        let owner = s.spawn(|| {
            guard.run(&k, &fp, |claim| {
                calls.fetch_add(1, Ordering::SeqCst);
                let first = claim.lease_until();
                started.wait();
                std::thread::sleep(5 * LEASE);
                assert!(claim.lease_until() > first, "the lease was renewed");
                assert!(!claim.lease_lost());
                Ok::<_, std::convert::Infallible>(Response::new(201, "exported"))
            })
        });
        started.wait();
        let mut retries = 0;
        while !owner.is_finished() {
            let now = idemstore::SystemClock.now();
            match guard.run(&k, &fp, |_| -> Result<Response, std::convert::Infallible> {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok(Response::new(500, "ran twice"))
            }) {
                Outcome::InFlight { lease_until } => assert!(lease_until > now),
                // The owner finished between the check and this retry.
                Outcome::Replayed(r) => assert_eq!(r.body(), b"exported"),
                other => panic!("a retry while the owner runs: {other:?}"),
            }
            retries += 1;
            std::thread::sleep(LEASE / 8);
        }
        (owner.join().unwrap(), retries)
    });
    assert!(matches!(owner, Outcome::Executed(_)), "{owner:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "executed once");
    assert!(retries >= 10, "{retries} retries");
    assert!(guard.stats().renewals >= 5, "{:?}", guard.stats());
    let after = guard.run(&k, &fp, |_| -> Result<Response, std::convert::Infallible> {
        unreachable!("replayed")
    });
    assert!(matches!(after, Outcome::Replayed(ref r) if r.body() == b"exported"));
}

/// The wall clock steps forward by 2 to 100 leases while a handler runs: a
/// retry of its key, through the same guard or another guard over the same
/// store, with renewal on or off, is InFlight and never runs the handler;
/// the owner's response is stored, and replayed after the run. (A lease is
/// a wall-clock time; a live run of this process is not judged by it.)
pub fn a_clock_step_never_runs_a_live_handler_twice(make: Make<'_>) {
    let subject = make();
    let clock = ManualClock::new(T0);
    let build = |renew: bool| {
        Guard::builder(Arc::clone(&subject.store))
            .clock(clock.clone())
            .lease(SEC)
            .retention(HOUR)
            .renew_leases(renew)
            .build()
            .expect("valid config")
    };
    let (renewing, plain) = (build(true), build(false));
    let calls = AtomicU32::new(0);
    let never = |_: &Claim| -> Result<Response, std::convert::Infallible> {
        calls.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(500, "ran twice"))
    };
    for (i, step) in [2, 10, 100].into_iter().enumerate() {
        for (owner, name) in [(&renewing, "renewal on"), (&plain, "renewal off")] {
            let (k, fp) = (key(&format!("step-{i}-{name}")), Fingerprint::of(b"x"));
            let out = owner.run(&k, &fp, |_| {
                calls.fetch_add(1, Ordering::SeqCst);
                clock.advance(step * SEC);
                for retry_by in [&renewing, &plain] {
                    let retry = retry_by.run(&k, &fp, never);
                    assert!(
                        matches!(retry, Outcome::InFlight { lease_until } if lease_until > clock.now()),
                        "{name}, a step of {step} leases: {retry:?}"
                    );
                }
                // Another fingerprint is still the store's answer.
                let other = owner.run(&k, &Fingerprint::of(b"y"), never);
                assert!(matches!(other, Outcome::Conflicted), "{other:?}");
                Ok::<_, std::convert::Infallible>(Response::new(201, "once"))
            });
            assert!(matches!(out, Outcome::Executed(_)), "{name}: {out:?}");
            assert_eq!(calls.swap(0, Ordering::SeqCst), 1, "{name}, step {step}");
            let after = plain.run(&k, &fp, never);
            assert!(
                matches!(after, Outcome::Replayed(ref r) if r.body() == b"once"),
                "{after:?}"
            );
        }
    }
}

/// The same id under two scopes is two keys.
pub fn scopes_isolate(make: Make<'_>) {
    let s = make().store_owned();
    let a = Key::new("tenant-a", "order-1").unwrap();
    let b = Key::new("tenant-b", "order-1").unwrap();
    let unscoped = Key::new("", "order-1").unwrap();
    let fp = Fingerprint::of(b"x");
    let ca = claimed(s.begin(&a, &fp, T0, SEC, HOUR).unwrap());
    s.complete(&a, &ca, &Response::new(200, "a's"), T0, HOUR)
        .unwrap();
    assert!(matches!(
        s.begin(&b, &fp, T0, SEC, HOUR).unwrap(),
        Begin::Claimed(_)
    ));
    assert!(matches!(
        s.begin(&unscoped, &Fingerprint::of(b"y"), T0, SEC, HOUR)
            .unwrap(),
        Begin::Claimed(_)
    ));
    // ("ab", "c") and ("a", "bc") are different keys.
    let k1 = Key::new("ab", "c").unwrap();
    let k2 = Key::new("a", "bc").unwrap();
    let _ = claimed(s.begin(&k1, &fp, T0, SEC, HOUR).unwrap());
    assert!(matches!(
        s.begin(&k2, &fp, T0, SEC, HOUR).unwrap(),
        Begin::Claimed(_)
    ));
    assert_eq!(
        s.get(&a, T0).unwrap().unwrap().response().unwrap().body(),
        b"a's"
    );
}

/// An expired record is invisible to `get` and `begin` before any sweep.
pub fn expired_records_invisible_before_sweep(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    s.complete(&k, &c, &Response::new(200, "x"), T0, HOUR)
        .unwrap();
    let late = T0 + HOUR;
    assert!(s.get(&k, late).unwrap().is_none());
    assert!(
        s.get(&k, T0).unwrap().is_some(),
        "the record is still stored, only invisible"
    );
    // A different fingerprint is not a conflict with an expired record.
    assert!(matches!(
        s.begin(&k, &Fingerprint::of(b"b"), late, SEC, HOUR)
            .unwrap(),
        Begin::Claimed(_)
    ));
}

/// `sweep_expired` deletes only expired records, oldest expiry first, at most `max` per call.
pub fn sweep_removes_only_expired_and_is_bounded(make: Make<'_>) {
    let s = make().store_owned();
    let fp = Fingerprint::of(b"a");
    // 10 records expiring at T0+1h..T0+1h+9s, and 5 that live for a day.
    for i in 0..10u32 {
        let c = claimed(
            s.begin(&key(&format!("short-{i}")), &fp, T0 + i * SEC, SEC, HOUR)
                .unwrap(),
        );
        s.complete(
            &key(&format!("short-{i}")),
            &c,
            &Response::new(200, ""),
            T0 + i * SEC,
            HOUR,
        )
        .unwrap();
    }
    for i in 0..5 {
        let _ = claimed(
            s.begin(&key(&format!("long-{i}")), &fp, T0, SEC, 24 * HOUR)
                .unwrap(),
        );
    }
    assert_eq!(s.sweep_expired(T0, 100).unwrap(), 0, "nothing is due yet");
    let now = T0 + HOUR + 5 * SEC; // short-0..=5 are due (expiry <= now)
    assert_eq!(s.sweep_expired(now, 4).unwrap(), 4, "bounded by max");
    for i in 0..6u32 {
        // Read at T0, when none has expired: what is left is still there.
        let left = s.get(&key(&format!("short-{i}")), T0).unwrap().is_some();
        assert_eq!(left, i >= 4, "oldest expiry first: short-{i}");
    }
    assert_eq!(s.sweep_expired(now, 100).unwrap(), 2);
    assert_eq!(s.sweep_expired(now, 100).unwrap(), 0);
    for i in 0..10u32 {
        let visible_later = s.get(&key(&format!("short-{i}")), T0).unwrap().is_some();
        assert_eq!(visible_later, i > 5, "short-{i}");
    }
    assert_eq!(
        s.sweep_expired(T0 + 2 * HOUR, 0).unwrap(),
        0,
        "max 0 deletes nothing"
    );
    assert_eq!(s.sweep_expired(T0 + 2 * HOUR, 100).unwrap(), 4);
    for i in 0..5 {
        assert!(
            s.get(&key(&format!("long-{i}")), T0 + 2 * HOUR)
                .unwrap()
                .is_some()
        );
    }
}

/// Records that expire at the same instant are swept in key order
/// (PostgreSQL's expiry index leaves the key out: the sort does this).
pub fn sweep_takes_equal_expiries_in_key_order(make: Make<'_>) {
    let s = make().store_owned();
    let fp = Fingerprint::of(b"a");
    for id in ["tie-c", "tie-a", "tie-d", "tie-b"] {
        let _ = claimed(s.begin(&key(id), &fp, T0, SEC, HOUR).unwrap());
    }
    let now = T0 + HOUR;
    let left = |s: &dyn Store| {
        ["tie-a", "tie-b", "tie-c", "tie-d"]
            .into_iter()
            .filter(|id| s.get(&key(id), T0).unwrap().is_some())
            .collect::<Vec<_>>()
    };
    assert_eq!(s.sweep_expired(now, 1).unwrap(), 1);
    assert_eq!(left(&*s), ["tie-b", "tie-c", "tie-d"]);
    assert_eq!(s.sweep_expired(now, 2).unwrap(), 2);
    assert_eq!(left(&*s), ["tie-d"]);
}

/// Fencing tokens increase across keys and claims.
pub fn tokens_increase_across_keys(make: Make<'_>) {
    let s = make().store_owned();
    let fp = Fingerprint::of(b"a");
    let mut last = 0;
    for i in 0..50u32 {
        let c = claimed(
            s.begin(
                &key(&format!("k{}", i % 7)),
                &fp,
                T0 + i * 2 * SEC,
                SEC,
                HOUR,
            )
            .unwrap(),
        );
        assert!(c.token() > last, "token {} after {last}", c.token());
        last = c.token();
    }
}

/// A clock that jumps forwards past the lease lets a second owner take over;
/// when the clock jumps back, the first owner's complete is still stale: the
/// fencing token decides, not the time.
pub fn clock_jumps_never_let_a_stale_owner_complete(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let owner = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let jumped = T0 + 10 * SEC;
    let usurper = claimed(s.begin(&k, &fp, jumped, SEC, HOUR).unwrap());
    let back = T0 + Duration::from_millis(100); // the clock steps back inside the old lease
    let r = s.complete(&k, &owner, &Response::new(200, "old"), back, HOUR);
    assert!(matches!(r, Err(Error::StaleClaim)), "{r:?}");
    // Even far in the past the current owner may still complete.
    s.complete(
        &k,
        &usurper,
        &Response::new(200, "new"),
        T0 - HOUR,
        2 * HOUR,
    )
    .unwrap();
    assert_eq!(
        s.begin(&k, &fp, T0, SEC, HOUR).unwrap(),
        Begin::Replay(Response::new(200, "new"))
    );
}

/// A response over the body limit is rejected and the claim is left as it was.
pub fn oversized_response_writes_nothing(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let big = Response::new(
        200,
        vec![0u8; idemstore::limits::DEFAULT_MAX_BODY_BYTES + 1],
    );
    assert!(matches!(
        s.complete(&k, &c, &big, T0, HOUR),
        Err(Error::ResponseTooLarge {
            what: "body bytes",
            ..
        })
    ));
    let mut many = Response::new(200, "");
    for i in 0..=idemstore::limits::MAX_HEADERS {
        many = many.with_header(format!("x-{i}"), "v");
    }
    assert!(matches!(
        s.complete(&k, &c, &many, T0, HOUR),
        Err(Error::ResponseTooLarge {
            what: "header count",
            ..
        })
    ));
    let rec = s.get(&k, T0).unwrap().unwrap();
    assert_eq!(rec.state(), State::Processing, "nothing was written");
    s.complete(
        &k,
        &c,
        &Response::new(200, vec![7u8; idemstore::limits::DEFAULT_MAX_BODY_BYTES]),
        T0,
        HOUR,
    )
    .unwrap();
}

/// A zero lease or a retention shorter than the lease is `InvalidArgument`, before any write.
pub fn invalid_durations_rejected_before_io(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    assert!(matches!(
        s.begin(&k, &fp, T0, Duration::ZERO, HOUR),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        s.begin(&k, &fp, T0, Duration::from_micros(999), HOUR),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        s.begin(&k, &fp, T0, HOUR, SEC),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(s.get(&k, T0).unwrap().is_none());
}

/// `complete` after the record expired is `StaleClaim`.
pub fn complete_after_expiry_is_stale(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let c = claimed(s.begin(&k, &fp, T0, SEC, 2 * SEC).unwrap());
    let r = s.complete(&k, &c, &Response::new(200, "late"), T0 + 2 * SEC, HOUR);
    assert!(
        matches!(r, Err(Error::StaleClaim)),
        "an expired record cannot be completed: {r:?}"
    );
    // Inside retention but past the lease, with nobody taking over, the owner may still finish.
    let k2 = key("k2");
    let c2 = claimed(s.begin(&k2, &fp, T0, SEC, HOUR).unwrap());
    s.complete(&k2, &c2, &Response::new(200, "slow"), T0 + 30 * SEC, HOUR)
        .unwrap();
}

fn step(name: &str, output: impl Into<Vec<u8>>) -> Step {
    Step::new(name, output.into()).expect("a valid step")
}

fn names(steps: &[Step]) -> Vec<&str> {
    steps.iter().map(Step::name).collect()
}

/// Steps recorded by the owner are on its record, in the order recorded,
/// with their outputs byte for byte; the record is otherwise unchanged (still
/// PROCESSING under the same token and lease), and a fresh claim has none.
pub fn steps_are_recorded_and_read_back(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    assert!(c.steps().is_empty(), "a fresh claim starts with no steps");
    let before = s.get(&k, T0).unwrap().unwrap();
    assert!(before.steps().is_empty());
    let charge = step("charge", b"ch_1".to_vec());
    let reserve = step("reserve", vec![0u8, 255, 7]);
    let empty = step("email", Vec::new());
    s.record_step(&k, &c, &charge, T0).unwrap();
    s.record_step(&k, &c, &reserve, T0 + SEC / 4).unwrap();
    s.record_step(&k, &c, &empty, T0 + SEC / 2).unwrap();
    let rec = s.get(&k, T0 + SEC / 2).unwrap().expect("kept");
    assert_eq!(rec.steps(), [charge, reserve, empty]);
    assert_eq!(rec.state(), State::Processing);
    assert_eq!(rec.token(), c.token());
    assert_eq!(rec.lease_until(), Some(T0 + SEC), "a step leaves the lease");
    assert_eq!(rec.expires_at(), before.expires_at());
    assert_eq!(rec.attempts(), 1);
    // The owner's claim value is what begin gave it: steps are the record's.
    assert!(c.steps().is_empty());
    // Another key is untouched.
    let other = claimed(s.begin(&key("other"), &fp, T0, SEC, HOUR).unwrap());
    assert!(other.steps().is_empty());
    assert!(
        s.get(&key("other"), T0)
            .unwrap()
            .unwrap()
            .steps()
            .is_empty()
    );
    // Still in flight for a retry inside the lease.
    assert_eq!(
        s.begin(&k, &fp, T0 + SEC / 2, SEC, HOUR).unwrap(),
        Begin::InFlight {
            lease_until: T0 + SEC
        }
    );
}

/// A takeover's claim carries the steps recorded under the key, and the
/// new owner records more after them.
pub fn a_takeover_claim_carries_the_steps(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let first = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let (charge, reserve) = (step("charge", "ch_1"), step("reserve", "r_1"));
    s.record_step(&k, &first, &charge, T0).unwrap();
    s.record_step(&k, &first, &reserve, T0).unwrap();
    let t = T0 + 2 * SEC;
    let second = claimed(s.begin(&k, &fp, t, SEC, HOUR).unwrap());
    assert!(second.is_takeover());
    assert_eq!(second.attempt(), 2);
    assert_eq!(second.steps(), [charge.clone(), reserve.clone()]);
    let email = step("email", "sent");
    s.record_step(&k, &second, &email, t).unwrap();
    let third = claimed(s.begin(&k, &fp, t + 2 * SEC, SEC, HOUR).unwrap());
    assert!(third.is_takeover());
    assert_eq!(third.attempt(), 3);
    assert_eq!(third.steps(), [charge, reserve, email]);
    assert_eq!(
        s.get(&k, t + 2 * SEC).unwrap().unwrap().steps(),
        third.steps()
    );
}

/// After a takeover the old owner's `record_step` is `StaleClaim` and
/// changes nothing, whether the step is new or one it recorded before.
pub fn a_stale_owner_cannot_record_a_step(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let old = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    s.record_step(&k, &old, &step("charge", "ch_1"), T0)
        .unwrap();
    let t = T0 + 2 * SEC;
    let new = claimed(s.begin(&k, &fp, t, SEC, HOUR).unwrap());
    let before = s.get(&k, t).unwrap();
    for late in [
        step("email", "late"),
        step("charge", "ch_1"),
        step("charge", "ch_2"),
    ] {
        let r = s.record_step(&k, &old, &late, t);
        assert!(matches!(r, Err(Error::StaleClaim)), "{late:?}: {r:?}");
        // Even at a time inside its old lease: the token decides.
        let r = s.record_step(&k, &old, &late, T0);
        assert!(matches!(r, Err(Error::StaleClaim)), "{late:?}: {r:?}");
    }
    assert_eq!(
        s.get(&k, t).unwrap(),
        before,
        "a stale owner changes nothing"
    );
    // The new owner records as usual.
    s.record_step(&k, &new, &step("email", "sent"), t).unwrap();
    assert_eq!(
        names(s.get(&k, t).unwrap().unwrap().steps()),
        ["charge", "email"]
    );
}

/// `release` with steps recorded keeps the record: PROCESSING, lease over
/// (`lease_until == EPOCH`), steps kept. The next `begin` with the same
/// fingerprint is claimed at once, not as a takeover, one attempt more,
/// with the steps; another fingerprint is `Conflict`. The released claim is
/// stale for `complete`, `renew`, `release` and `record_step`, before and
/// after the next claim. Without steps, release still deletes.
pub fn release_keeps_recorded_steps(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let first = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let charge = step("charge", "ch_1");
    s.record_step(&k, &first, &charge, T0).unwrap();
    s.release(&k, &first).unwrap();
    let kept = s.get(&k, T0).unwrap().expect("steps outlive a release");
    assert_eq!(kept.state(), State::Processing);
    assert_eq!(
        kept.lease_until(),
        Some(Timestamp::EPOCH),
        "the lease is over"
    );
    assert_eq!(kept.steps(), std::slice::from_ref(&charge));
    assert_eq!(kept.token(), first.token());
    assert_eq!(kept.expires_at(), T0 + HOUR);
    let stale_everywhere = |c: &Claim, at: Timestamp, when: &str| {
        let r = s.complete(&k, c, &Response::new(200, "late"), at, HOUR);
        assert!(
            matches!(r, Err(Error::StaleClaim)),
            "complete {when}: {r:?}"
        );
        let r = s.renew(&k, c, at, SEC);
        assert!(matches!(r, Err(Error::StaleClaim)), "renew {when}: {r:?}");
        let r = s.release(&k, c);
        assert!(matches!(r, Err(Error::StaleClaim)), "release {when}: {r:?}");
        for late in [step("email", "late"), charge.clone()] {
            let r = s.record_step(&k, c, &late, at);
            assert!(
                matches!(r, Err(Error::StaleClaim)),
                "record_step {when}: {r:?}"
            );
        }
    };
    stale_everywhere(&first, T0, "after the release");
    assert_eq!(
        s.get(&k, T0).unwrap().as_ref(),
        Some(&kept),
        "nothing changed"
    );
    // Another fingerprint: the side effects happened under this one.
    assert_eq!(
        s.begin(&k, &Fingerprint::of(b"b"), T0, SEC, HOUR).unwrap(),
        Begin::Conflict
    );
    assert_eq!(s.get(&k, T0).unwrap().as_ref(), Some(&kept));
    // The same fingerprint, at once (inside what was the lease).
    let at = T0 + SEC / 2;
    let second = claimed(s.begin(&k, &fp, at, SEC, HOUR).unwrap());
    assert!(
        !second.is_takeover(),
        "a release hands on, it is not a takeover"
    );
    assert_eq!(second.attempt(), 2);
    assert!(second.token() > first.token());
    assert_eq!(second.lease_until(), at + SEC);
    assert_eq!(second.steps(), std::slice::from_ref(&charge));
    let rec = s.get(&k, at).unwrap().unwrap();
    assert_eq!(rec.lease_until(), Some(at + SEC));
    assert_eq!((rec.token(), rec.attempts()), (second.token(), 2));
    // Now in flight under the new claim.
    assert_eq!(
        s.begin(&k, &fp, at, SEC, HOUR).unwrap(),
        Begin::InFlight {
            lease_until: at + SEC
        }
    );
    stale_everywhere(&first, at, "after the next claim");
    // The new owner finishes the run.
    s.record_step(&k, &second, &step("email", "sent"), at)
        .unwrap();
    s.complete(&k, &second, &Response::new(201, "done"), at, HOUR)
        .unwrap();
    assert_eq!(
        s.begin(&k, &fp, at, SEC, HOUR).unwrap(),
        Begin::Replay(Response::new(201, "done"))
    );
    // A release without steps deletes, as it always did.
    let k2 = key("k2");
    let bare = claimed(s.begin(&k2, &fp, T0, SEC, HOUR).unwrap());
    s.release(&k2, &bare).unwrap();
    assert!(s.get(&k2, T0).unwrap().is_none());
    assert!(matches!(
        s.begin(&k2, &Fingerprint::of(b"b"), T0, SEC, HOUR).unwrap(),
        Begin::Claimed(ref c) if !c.is_takeover() && c.attempt() == 1
    ));
}

/// `complete` drops the steps: the DONE record has none, the replay is the
/// response, and no claim can record on it.
pub fn complete_drops_the_steps(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    s.record_step(&k, &c, &step("charge", "ch_1"), T0).unwrap();
    s.complete(&k, &c, &Response::new(201, "paid"), T0, HOUR)
        .unwrap();
    let rec = s.get(&k, T0).unwrap().unwrap();
    assert_eq!(rec.state(), State::Done);
    assert!(
        rec.steps().is_empty(),
        "a DONE record has no steps: {rec:?}"
    );
    assert_eq!(
        s.begin(&k, &fp, T0 + SEC, SEC, HOUR).unwrap(),
        Begin::Replay(Response::new(201, "paid"))
    );
    let r = s.record_step(&k, &c, &step("email", "late"), T0);
    assert!(matches!(r, Err(Error::StaleClaim)), "{r:?}");
    assert!(s.get(&k, T0).unwrap().unwrap().steps().is_empty());
    // After the DONE record expires, a new claim starts with nothing.
    let late = T0 + 2 * HOUR;
    let fresh = claimed(s.begin(&k, &fp, late, SEC, HOUR).unwrap());
    assert!(!fresh.is_takeover());
    assert!(fresh.steps().is_empty());
}

/// Expiry drops the steps: the expired record is invisible, a new claim
/// (of either fingerprint) is fresh with none, and the old owner cannot
/// record on it, even before the new claim. A released record with steps
/// expires the same way.
pub fn expiry_drops_the_steps(make: Make<'_>) {
    let s = make().store_owned();
    let fp = Fingerprint::of(b"a");
    for released in [false, true] {
        let k = key(if released { "released" } else { "abandoned" });
        let c = claimed(s.begin(&k, &fp, T0, SEC, 2 * SEC).unwrap());
        s.record_step(&k, &c, &step("charge", "ch_1"), T0).unwrap();
        if released {
            s.release(&k, &c).unwrap();
        }
        let gone = T0 + 2 * SEC;
        assert!(s.get(&k, gone).unwrap().is_none(), "released={released}");
        let r = s.record_step(&k, &c, &step("email", "late"), gone);
        assert!(
            matches!(r, Err(Error::StaleClaim)),
            "released={released}: {r:?}"
        );
        // Another fingerprint claims it: nothing is left to conflict with.
        let other = Fingerprint::of(b"b");
        let fresh = claimed(s.begin(&k, &other, gone, SEC, HOUR).unwrap());
        assert!(!fresh.is_takeover(), "released={released}");
        assert_eq!(fresh.attempt(), 1);
        assert!(fresh.steps().is_empty(), "released={released}: {fresh:?}");
        assert!(s.get(&k, gone).unwrap().unwrap().steps().is_empty());
        let r = s.record_step(&k, &c, &step("email", "late"), gone);
        assert!(
            matches!(r, Err(Error::StaleClaim)),
            "released={released}: {r:?}"
        );
    }
    // A sweep removes an expired record with steps like any other.
    let k = key("swept");
    let c = claimed(s.begin(&k, &fp, T0, SEC, 2 * SEC).unwrap());
    s.record_step(&k, &c, &step("charge", "ch_1"), T0).unwrap();
    assert!(s.sweep_expired(T0 + 3 * SEC, 100).unwrap() >= 1);
    assert!(s.get(&k, T0).unwrap().is_none(), "swept");
    let fresh = claimed(s.begin(&k, &fp, T0 + 3 * SEC, SEC, HOUR).unwrap());
    assert!(fresh.steps().is_empty());
}

/// `renew` keeps the steps, and the owner keeps recording after it; a
/// takeover after the renewed lease carries them all.
pub fn renew_keeps_the_steps(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let charge = step("charge", "ch_1");
    s.record_step(&k, &c, &charge, T0).unwrap();
    let renewed = s.renew(&k, &c, T0 + SEC / 2, 2 * SEC).unwrap();
    assert_eq!(
        s.get(&k, T0 + SEC).unwrap().unwrap().steps(),
        std::slice::from_ref(&charge)
    );
    let email = step("email", "sent");
    s.record_step(&k, &renewed, &email, T0 + 2 * SEC).unwrap();
    // Renewing again, with the lease run out but nobody taking over.
    let again = s.renew(&k, &renewed, T0 + 3 * SEC, SEC).unwrap();
    assert_eq!(
        s.get(&k, T0 + 3 * SEC).unwrap().unwrap().steps(),
        [charge.clone(), email.clone()]
    );
    let t = again.lease_until();
    let next = claimed(s.begin(&k, &fp, t, SEC, HOUR).unwrap());
    assert!(next.is_takeover());
    assert_eq!(next.steps(), [charge, email]);
}

/// Recording the same step again (same name, same output: a retried call)
/// is `Ok` and adds nothing; the same name with another output is
/// `InvalidArgument` and changes nothing.
pub fn recording_a_step_twice_is_idempotent(make: Make<'_>) {
    let s = make().store_owned();
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let charge = step("charge", "ch_1");
    s.record_step(&k, &c, &charge, T0).unwrap();
    s.record_step(&k, &c, &charge, T0).unwrap();
    s.record_step(&k, &c, &charge, T0 + SEC / 2).unwrap();
    let once = s.get(&k, T0).unwrap().unwrap();
    assert_eq!(once.steps(), std::slice::from_ref(&charge));
    for other in [step("charge", "ch_2"), step("charge", Vec::new())] {
        let r = s.record_step(&k, &c, &other, T0);
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    }
    assert_eq!(s.get(&k, T0).unwrap().unwrap(), once, "nothing changed");
    // The next owner holds the same rule against the recorded output.
    let next = claimed(s.begin(&k, &fp, T0 + 2 * SEC, SEC, HOUR).unwrap());
    s.record_step(&k, &next, &charge, T0 + 2 * SEC).unwrap();
    let r = s.record_step(&k, &next, &step("charge", "ch_3"), T0 + 2 * SEC);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    assert_eq!(s.get(&k, T0 + 2 * SEC).unwrap().unwrap().steps(), [charge]);
}

/// Each step limit is refused and writes nothing: a record holds at most
/// `MAX_STEPS` steps and `MAX_STEPS_BYTES` of names and outputs (both
/// accepted exactly at the limit); a name or an output over its own limit
/// (and an empty name) fails in `Step::new`, before any store call.
pub fn step_limits_refuse_and_write_nothing(make: Make<'_>) {
    use idemstore::limits::{
        MAX_STEP_NAME_BYTES, MAX_STEP_OUTPUT_BYTES, MAX_STEPS, MAX_STEPS_BYTES,
    };
    let s = make().store_owned();
    let fp = Fingerprint::of(b"a");
    // Count.
    let k = key("many");
    let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    for i in 0..MAX_STEPS {
        s.record_step(&k, &c, &step(&format!("s{i}"), vec![1]), T0)
            .unwrap_or_else(|e| panic!("step {i} of {MAX_STEPS}: {e}"));
    }
    let full = s.get(&k, T0).unwrap().unwrap();
    assert_eq!(full.steps().len(), MAX_STEPS);
    let r = s.record_step(&k, &c, &step("one-more", Vec::new()), T0);
    assert!(
        matches!(r, Err(Error::StepLimit { what: "steps", size, limit })
            if size == MAX_STEPS + 1 && limit == MAX_STEPS),
        "{r:?}"
    );
    assert_eq!(s.get(&k, T0).unwrap().unwrap(), full, "nothing written");
    // A recorded one is still the same step again.
    s.record_step(&k, &c, &step("s0", vec![1]), T0).unwrap();
    let next = claimed(s.begin(&k, &fp, T0 + 2 * SEC, SEC, HOUR).unwrap());
    assert_eq!(next.steps(), full.steps());

    // Bytes: three full outputs, then exactly what is left, then one byte more.
    let k = key("heavy");
    let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    for name in ["0", "1", "2"] {
        s.record_step(&k, &c, &step(name, vec![7; MAX_STEP_OUTPUT_BYTES]), T0)
            .unwrap();
    }
    let used = 3 * (1 + MAX_STEP_OUTPUT_BYTES);
    let over = step("3", vec![8; MAX_STEP_OUTPUT_BYTES]);
    let r = s.record_step(&k, &c, &over, T0);
    assert!(
        matches!(r, Err(Error::StepLimit { what: "step bytes in the record", size, limit })
            if size == used + 1 + MAX_STEP_OUTPUT_BYTES && limit == MAX_STEPS_BYTES),
        "{r:?}"
    );
    assert_eq!(
        s.get(&k, T0).unwrap().unwrap().steps().len(),
        3,
        "nothing written"
    );
    let rest = step("4", vec![9; MAX_STEPS_BYTES - used - 1]);
    s.record_step(&k, &c, &rest, T0).unwrap();
    let at_limit = s.get(&k, T0).unwrap().unwrap();
    assert_eq!(at_limit.steps().len(), 4);
    assert_eq!(at_limit.steps()[3], rest);
    let r = s.record_step(&k, &c, &step("5", Vec::new()), T0);
    assert!(
        matches!(
            r,
            Err(Error::StepLimit {
                what: "step bytes in the record",
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(s.get(&k, T0).unwrap().unwrap(), at_limit, "nothing written");
    let next = claimed(s.begin(&k, &fp, T0 + 2 * SEC, SEC, HOUR).unwrap());
    assert_eq!(next.steps(), at_limit.steps(), "the big outputs round-trip");

    // Per step: refused by `Step::new`, so no store is ever asked.
    let name = "n".repeat(MAX_STEP_NAME_BYTES);
    assert!(Step::new(name.as_str(), Vec::new()).is_ok());
    assert!(matches!(
        Step::new(format!("{name}n"), Vec::new()),
        Err(Error::StepLimit {
            what: "name bytes",
            ..
        })
    ));
    assert!(matches!(
        Step::new("big", vec![0; MAX_STEP_OUTPUT_BYTES + 1]),
        Err(Error::StepLimit {
            what: "output bytes",
            ..
        })
    ));
    assert!(matches!(
        Step::new("", Vec::new()),
        Err(Error::InvalidArgument { .. })
    ));
    // The longest name is a step like any other.
    let k = key("long-name");
    let c = claimed(s.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let long = step(&name, vec![1, 2, 3]);
    s.record_step(&k, &c, &long, T0).unwrap();
    assert_eq!(s.get(&k, T0).unwrap().unwrap().steps(), [long]);
}

/// An old owner keeps recording steps while another thread, after the
/// lease ran out on a manual clock, takes the key over: every call the old
/// owner starts after the takeover's `begin` returned fails with
/// `StaleClaim`, once one fails none succeeds again, and the new claim
/// starts with exactly the steps whose `record_step` returned `Ok` (each
/// acknowledged step is there, and nothing else is).
pub fn a_stale_owner_racing_a_takeover_records_nothing_after_it(make: Make<'_>) {
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    let subject = make();
    let s = &subject.store;
    let clock = ManualClock::new(T0);
    let fp = Fingerprint::of(b"a");
    let mut raced = 0;
    for round in 0..16usize {
        let k = key(&format!("race-{round}"));
        let old = claimed(s.begin(&k, &fp, clock.now(), SEC, HOUR).unwrap());
        let (barrier, taken, oks) = (Barrier::new(2), AtomicBool::new(false), AtomicUsize::new(0));
        let (calls, new) = std::thread::scope(|scope| {
            let owner = scope.spawn(|| {
                barrier.wait();
                let mut calls: Vec<(String, bool, bool)> = Vec::new();
                let mut after = 0;
                for i in 0usize.. {
                    // Past MAX_STEPS names it re-records one: the same step
                    // again, `Ok` while it still owns the key.
                    let name = format!("s{}", i % (idemstore::limits::MAX_STEPS - 1));
                    let started_after = taken.load(Ordering::SeqCst);
                    let r = s.record_step(&k, &old, &step(&name, name.clone()), clock.now());
                    assert!(matches!(r, Ok(()) | Err(Error::StaleClaim)), "{r:?}");
                    if r.is_ok() {
                        oks.fetch_add(1, Ordering::SeqCst);
                    }
                    calls.push((name, started_after, r.is_ok()));
                    if started_after {
                        after += 1;
                        if after == 3 {
                            break;
                        }
                    }
                }
                calls
            });
            let usurper = scope.spawn(|| {
                barrier.wait();
                while oks.load(Ordering::SeqCst) < round % 4 {
                    std::thread::yield_now();
                }
                clock.advance(SEC);
                let new = claimed(s.begin(&k, &fp, clock.now(), SEC, HOUR).unwrap());
                taken.store(true, Ordering::SeqCst);
                new
            });
            (owner.join().unwrap(), usurper.join().unwrap())
        });
        assert!(new.is_takeover(), "round {round}");
        for (name, started_after, ok) in &calls {
            assert!(
                !(*started_after && *ok),
                "round {round}: `{name}` was recorded after the takeover"
            );
        }
        let first_err = calls.iter().position(|c| !c.2).unwrap_or(calls.len());
        assert!(
            calls.iter().skip(first_err).all(|c| !c.2),
            "round {round}: the old owner recorded again after a refusal: {calls:?}"
        );
        raced += usize::from(calls.iter().any(|c| !c.1 && !c.2));
        let mut acked: Vec<&str> = Vec::new();
        for (name, _, ok) in &calls {
            if *ok && !acked.contains(&name.as_str()) {
                acked.push(name);
            }
        }
        assert_eq!(
            names(new.steps()),
            acked,
            "round {round}: the new claim's steps are the acknowledged ones"
        );
        for st in new.steps() {
            assert_eq!(st.output(), st.name().as_bytes());
        }
        // Nothing the old owner tried after the takeover changed the record.
        assert_eq!(
            s.get(&k, clock.now()).unwrap().unwrap().steps(),
            new.steps()
        );
        let r = s.record_step(&k, &old, &step("late", "x"), clock.now());
        assert!(matches!(r, Err(Error::StaleClaim)), "{r:?}");
        s.record_step(&k, &new, &step("next", "y"), clock.now())
            .unwrap();
    }
    // Not asserted (scheduling decides), but worth seeing when it never happens.
    if raced == 0 {
        eprintln!("no round raced a record_step against the takeover's begin");
    }
}

/// 64 threads run random begin/complete/release on 16 keys while a shared
/// manual clock moves forward: a key never has two live claims. Checked
/// after the run, in token order (the store's serialisation order): each
/// claim on a key starts at or after the previous claim's lease end, unless
/// the previous owner released the key.
pub fn concurrent_random_ops_never_two_live_claims(make: Make<'_>) {
    struct Event {
        token: u64,
        at: Timestamp,
        lease_until: Timestamp,
        released: bool,
    }
    let subject = make();
    let store = &subject.store;
    let clock = ManualClock::new(T0);
    const THREADS: u64 = 64;
    const OPS: u64 = 40;
    let events: Vec<Mutex<Vec<Event>>> = (0..16).map(|_| Mutex::new(Vec::new())).collect();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (clock, events) = (&clock, &events);
            s.spawn(move || {
                let mut rng = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut next = || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                for _ in 0..OPS {
                    let ki = (next() % 16) as usize;
                    let k = Key::new("race", format!("k{ki}")).unwrap();
                    let fp = Fingerprint::of([(ki % 2) as u8]);
                    if next() % 4 == 0 {
                        clock.advance(Duration::from_millis(next() % 400));
                    }
                    let now = clock.now();
                    let lease = Duration::from_millis(200);
                    let c = match store.begin(&k, &fp, now, lease, 3 * lease) {
                        Ok(Begin::Claimed(c)) => c,
                        Ok(_) => continue,
                        Err(e) => panic!("begin failed: {e}"),
                    };
                    let mut released = false;
                    match next() % 3 {
                        0 => {
                            let r = store.complete(
                                &k,
                                &c,
                                &Response::new(200, "ok"),
                                clock.now(),
                                3 * lease,
                            );
                            assert!(matches!(r, Ok(()) | Err(Error::StaleClaim)), "{r:?}");
                        }
                        1 => {
                            let r = store.release(&k, &c);
                            assert!(matches!(r, Ok(()) | Err(Error::StaleClaim)), "{r:?}");
                            released = r.is_ok();
                        }
                        _ => {} // abandon: the lease runs out
                    }
                    events[ki].lock().unwrap().push(Event {
                        token: c.token(),
                        at: now,
                        lease_until: c.lease_until(),
                        released,
                    });
                }
            });
        }
    });
    let mut claims = 0;
    for (ki, list) in events.into_iter().enumerate() {
        let mut list = list.into_inner().unwrap();
        list.sort_by_key(|e| e.token);
        claims += list.len();
        for pair in list.windows(2) {
            let (prev, next) = (&pair[0], &pair[1]);
            assert!(
                prev.released || next.at >= prev.lease_until,
                "key {ki}: token {} claimed at {} while token {} held a lease until {}",
                next.token,
                next.at,
                prev.token,
                prev.lease_until
            );
        }
    }
    assert!(claims > 16, "the race exercised claims ({claims})");
}

/// Random sequences of operations, applied one at a time to the store and to
/// the independent model in `crate::model`, give the same answers.
pub fn sequential_ops_match_model(make: Make<'_>) {
    crate::model::check_against_model(make, 24, 60);
}

trait SubjectExt {
    fn store_owned(self) -> OwnedStore;
}

/// A subject used by one test: derefs to the store and keeps the rest alive.
pub struct OwnedStore(Subject);

impl std::ops::Deref for OwnedStore {
    type Target = dyn Store;
    fn deref(&self) -> &(dyn Store + 'static) {
        &*self.0.store
    }
}

impl SubjectExt for Subject {
    fn store_owned(self) -> OwnedStore {
        OwnedStore(self)
    }
}
