//! Guard policies beyond the conformance suite, on `MemoryStore`.

use idemstore::guard::{GuardBuilder, OnHandlerError, TakeoverPolicy};
use idemstore::{
    Begin, Clock, Error, Fingerprint, Guard, Key, ManualClock, MemoryStore, Outcome, Response,
    Store,
};
use idemstore_testkit::FaultyStore;
use idemstore_testkit::conformance::T0;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

const SEC: Duration = Duration::from_secs(1);

type Faulty = Arc<FaultyStore<MemoryStore>>;

fn setup(
    configure: impl FnOnce(GuardBuilder<Faulty>) -> GuardBuilder<Faulty>,
) -> (Guard<Faulty>, Faulty, ManualClock) {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let clock = ManualClock::new(T0);
    let builder = Guard::builder(Arc::clone(&store))
        .clock(clock.clone())
        .lease(SEC)
        .retention(60 * SEC);
    (configure(builder).build().unwrap(), store, clock)
}

fn key() -> Key {
    Key::new("t", "k").unwrap()
}

fn ok(body: &'static str) -> impl FnOnce(&idemstore::Claim) -> Result<Response, Infallible> {
    move |_| Ok(Response::new(200, body))
}

fn never() -> impl FnOnce(&idemstore::Claim) -> Result<Response, Infallible> {
    |_| panic!("the handler must not run")
}

#[test]
fn handler_error_keeps_claim_until_lease_ends_by_default() {
    let (guard, store, clock) = setup(|b| b);
    let fp = Fingerprint::of(b"x");
    let out = guard.run(&key(), &fp, |_| Err::<Response, _>("boom"));
    assert!(matches!(out, Outcome::HandlerFailed("boom")));
    assert!(matches!(
        guard.run(&key(), &fp, never()),
        Outcome::InFlight { .. }
    ));
    clock.advance(SEC);
    assert!(matches!(
        guard.run(&key(), &fp, ok("second")),
        Outcome::Executed(_)
    ));
    assert_eq!(
        store
            .get(&key(), idemstore::Clock::now(&clock))
            .unwrap()
            .unwrap()
            .attempts(),
        2
    );
}

#[test]
fn handler_error_releases_at_once_when_configured() {
    let (guard, store, clock) = setup(|b| b.on_handler_error(OnHandlerError::Release));
    let fp = Fingerprint::of(b"x");
    let out = guard.run(&key(), &fp, |_| Err::<Response, _>("boom"));
    assert!(matches!(out, Outcome::HandlerFailed(_)));
    assert!(
        store
            .get(&key(), idemstore::Clock::now(&clock))
            .unwrap()
            .is_none(),
        "released"
    );
    let again = guard.run(&key(), &fp, ok("retry"));
    assert!(matches!(again, Outcome::Executed(ref r) if r.body() == b"retry"));
    assert_eq!(
        guard.stats().takeovers,
        0,
        "a released key is claimed fresh"
    );
}

#[test]
fn deterministic_failure_is_stored_and_replayed() {
    let (guard, _, _) = setup(|b| b);
    let fp = Fingerprint::of(b"x");
    let out = guard.run(&key(), &fp, |_| {
        Ok::<_, Infallible>(Response::new(409, "OUT_OF_STOCK"))
    });
    assert!(matches!(out, Outcome::Executed(ref r) if r.status() == 409));
    let again = guard.run(&key(), &fp, never());
    assert!(
        matches!(again, Outcome::Replayed(ref r) if r.status() == 409 && r.body() == b"OUT_OF_STOCK")
    );
}

#[test]
fn reconcile_policy_answers_unknown_instead_of_rerunning() {
    let (guard, _, clock) = setup(|b| b.takeover(TakeoverPolicy::Reconcile));
    let fp = Fingerprint::of(b"x");
    let _ = guard.run(&key(), &fp, |_| Err::<Response, _>("crashed"));
    clock.advance(2 * SEC);
    let Outcome::Unknown(claim) = guard.run(&key(), &fp, never()) else {
        panic!("expected Unknown")
    };
    assert!(claim.is_takeover());
    // The caller checked the authoritative system: nothing happened, so it releases.
    guard.release(&key(), &claim).unwrap();
    assert!(matches!(
        guard.run(&key(), &fp, ok("ran")),
        Outcome::Executed(_)
    ));
    assert_eq!(guard.stats().takeovers, 1);
}

#[test]
fn fail_closed_by_default_and_fail_open_counted() {
    let (guard, store, _) = setup(|b| b);
    store.fail_all();
    let calls = AtomicU32::new(0);
    let out = guard.run(&key(), &Fingerprint::of(b"x"), |_| {
        calls.fetch_add(1, Ordering::SeqCst);
        Ok::<_, Infallible>(Response::new(200, ""))
    });
    assert!(matches!(out, Outcome::Unavailable(Error::Backend(_))));
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    let (open, store, _) = setup(|b| b.fail_open(true));
    store.fail_all();
    let out = open.run(&key(), &Fingerprint::of(b"x"), |claim| {
        assert!(claim.is_unprotected());
        Ok::<_, Infallible>(Response::new(200, "unprotected"))
    });
    assert!(matches!(out, Outcome::FailedOpen(Ok(_))));
    assert_eq!(open.stats().fail_open, 1);
    assert_eq!(
        open.stats().executed,
        0,
        "fail-open runs are not counted as protected executions"
    );
}

#[test]
fn stale_completion_is_counted() {
    let (guard, store, clock) = setup(|b| b);
    let fp = Fingerprint::of(b"x");
    let out = guard.run(&key(), &fp, |_| {
        // While this owner runs, the clock jumps past the lease and a retry takes over.
        clock.advance(2 * SEC);
        let Begin::Claimed(_) = store
            .begin(&key(), &fp, idemstore::Clock::now(&clock), SEC, 60 * SEC)
            .unwrap()
        else {
            panic!("takeover expected")
        };
        Ok::<_, Infallible>(Response::new(200, "late"))
    });
    assert!(
        matches!(
            out,
            Outcome::NotStored {
                error: Error::StaleClaim,
                ..
            }
        ),
        "{out:?}"
    );
    assert_eq!(guard.stats().stale, 1);
}

#[test]
fn stats_count_every_outcome() {
    let (guard, store, _) = setup(|b| b);
    let fp = Fingerprint::of(b"x");
    let _ = guard.run(&key(), &fp, ok("a"));
    let _ = guard.run(&key(), &fp, never());
    let _ = guard.run(&key(), &Fingerprint::of(b"y"), never());
    let other = Key::new("t", "other").unwrap();
    let _ = store.begin(&other, &fp, T0, SEC, 60 * SEC).unwrap();
    let _ = guard.run(&other, &fp, never());
    store.fail_all();
    let _ = guard.run(&key(), &fp, never());
    let s = guard.stats();
    assert_eq!(
        (
            s.executed,
            s.replayed,
            s.conflicted,
            s.in_flight,
            s.unavailable,
            s.fail_open,
            s.takeovers,
            s.stale
        ),
        (1, 1, 1, 1, 1, 0, 0, 0)
    );
}

#[test]
fn invalid_guard_config_is_an_error() {
    let r = Guard::builder(MemoryStore::new())
        .lease(Duration::ZERO)
        .build();
    assert!(matches!(r, Err(Error::InvalidArgument { .. })));
    let r = Guard::builder(MemoryStore::new())
        .lease(SEC * 10)
        .retention(SEC)
        .build();
    assert!(matches!(r, Err(Error::InvalidArgument { .. })));
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_run_shares_the_core() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let guard = Guard::builder(Arc::clone(&store))
        .lease(SEC)
        .build()
        .unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (guard, calls) = (guard.clone(), Arc::clone(&calls));
        tasks.push(tokio::spawn(async move {
            guard
                .run_async(&key(), &Fingerprint::of(b"x"), |claim| async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Ok::<_, Infallible>(Response::new(201, claim.token().to_string()))
                })
                .await
        }));
    }
    let mut executed = 0;
    for t in tasks {
        match t.await.unwrap() {
            Outcome::Executed(_) => executed += 1,
            Outcome::InFlight { .. } | Outcome::Replayed(_) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((executed, calls.load(Ordering::SeqCst)), (1, 1));
    store.fail_all();
    let out = guard
        .run_async(
            &Key::new("t", "down").unwrap(),
            &Fingerprint::of(b"x"),
            |_| async {
                panic!("fail closed");
                #[allow(unreachable_code)]
                Ok::<_, Infallible>(Response::new(200, ""))
            },
        )
        .await;
    assert!(matches!(out, Outcome::Unavailable(_)));
}

/// Regression: a store, its guard and its sweeper each took their own clock,
/// so a test that gave a `ManualClock` to the store but not to the guard
/// silently got wall time for leases. Built with the clock, the store hands
/// it to the guard and the sweeper, with no `.clock(..)` on either.
#[test]
fn a_guard_over_a_store_built_with_a_manual_clock_reads_that_clock() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(FaultyStore::new(MemoryStore::with_clock(clock.clone())));
    assert_eq!(idemstore::Clock::now(&*store.clock()), T0);
    let guard = Guard::builder(Arc::clone(&store))
        .lease(SEC)
        .retention(60 * SEC)
        .build()
        .unwrap();
    assert_eq!(guard.now(), T0);
    let fp = Fingerprint::of(b"x");
    // The lease is decided on the manual time: T0 is long past on the wall
    // clock, so a guard on wall time would see the record expired already.
    let out = guard.run(&key(), &fp, |_| Err::<Response, _>("owner died"));
    assert!(matches!(out, Outcome::HandlerFailed("owner died")));
    assert_eq!(
        store.get(&key(), T0).unwrap().map(|r| r.lease_until()),
        Some(Some(T0 + SEC))
    );
    assert!(matches!(
        guard.run(&key(), &fp, never()),
        Outcome::InFlight { lease_until } if lease_until == T0 + SEC
    ));
    clock.advance(SEC);
    assert!(matches!(
        guard.run(&key(), &fp, ok("second")),
        Outcome::Executed(_)
    ));
    assert_eq!(guard.stats().takeovers, 1);
    let done = store.get(&key(), T0 + SEC).unwrap().unwrap();
    assert_eq!(done.expires_at(), T0 + SEC + 60 * SEC);
    // The sweeper over the store reads the same clock: nothing is due until
    // the manual time passes the expiry, however much wall time goes by.
    let sweeper = idemstore::Sweeper::spawn(
        Arc::clone(&store),
        idemstore::SweeperConfig::default().interval(Duration::from_millis(5)),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(sweeper.swept(), 0);
    assert_eq!(store.inner().len(), 1);
    clock.advance(60 * SEC);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while sweeper.swept() < 1 {
        assert!(std::time::Instant::now() < deadline, "sweeper never swept");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(store.inner().len(), 0);
}

/// A clock given to the guard's builder still wins over the store's.
#[test]
fn a_clock_given_to_the_guard_overrides_the_stores() {
    let store_clock = ManualClock::new(T0);
    let guard_clock = ManualClock::new(T0 + 5 * SEC);
    let guard = Guard::builder(MemoryStore::with_clock(store_clock))
        .clock(guard_clock)
        .build()
        .unwrap();
    assert_eq!(guard.now(), T0 + 5 * SEC);
    // Without a clock anywhere, both read the system clock.
    let wall = Guard::new(MemoryStore::new());
    assert!(wall.now() > T0);
    assert!(idemstore::Clock::now(&*wall.store().clock()) > T0);
}

/// Renewals that fail for a whole lease let a retry take the key over while
/// the first handler still runs; the next renewal that reaches the store
/// finds the claim stale: the handler sees `lease_lost()`, the run answers
/// `LeaseLost` and writes nothing over the new owner's record. Sync and
/// async runs alike.
#[test]
fn a_claim_taken_over_while_its_handler_runs_is_told_and_writes_nothing() {
    let lease = Duration::from_millis(150);
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let guard = Guard::builder(Arc::clone(&store))
        .clock(idemstore::SystemClock)
        .lease(lease)
        .build()
        .unwrap();
    let fp = Fingerprint::of(b"x");
    // Every renewal fails until the takeover is made.
    store.set_fault(|op| {
        (op == idemstore_testkit::Op::Renew).then(|| Error::backend("store unreachable"))
    });
    let run = |k: &Key| {
        guard.run(k, &fp, |claim| {
            let deadline = std::time::Instant::now() + 20 * SEC;
            while !claim.lease_lost() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert!(claim.lease_lost(), "told before committing");
            Ok::<_, Infallible>(Response::new(200, "late"))
        })
    };
    let k = key();
    let (out, taken) = std::thread::scope(|s| {
        let owner = s.spawn(|| run(&k));
        std::thread::sleep(lease + lease / 2);
        let now = idemstore::SystemClock.now();
        let taken = store.begin(&k, &fp, now, lease, SEC).unwrap();
        store.clear_fault();
        (owner.join().unwrap(), taken)
    });
    let Begin::Claimed(taken) = taken else {
        panic!("no takeover: {taken:?}")
    };
    assert!(taken.is_takeover());
    assert!(
        matches!(out, Outcome::LeaseLost(Ok(ref r)) if r.body() == b"late"),
        "{out:?}"
    );
    assert!(out.ran_handler());
    let record = store
        .get(&k, idemstore::SystemClock.now())
        .unwrap()
        .unwrap();
    assert_eq!(record.token(), taken.token(), "the new owner's record");
    assert_eq!(
        record.state(),
        idemstore::State::Processing,
        "nothing stored"
    );
    let stats = guard.stats();
    assert_eq!((stats.leases_lost, stats.stale), (1, 0), "{stats:?}");
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_run_is_renewed_and_stops_renewing_when_dropped() {
    let lease = Duration::from_millis(150);
    let store = Arc::new(MemoryStore::new());
    let guard = Guard::builder(Arc::clone(&store))
        .clock(idemstore::SystemClock)
        .lease(lease)
        .build()
        .unwrap();
    let (k, fp) = (key(), Fingerprint::of(b"x"));
    // Renewed while the handler future runs past its lease.
    let out = guard
        .run_async(&k, &fp, |claim| async move {
            let first = claim.lease_until();
            tokio::time::sleep(3 * lease).await;
            assert!(claim.lease_until() > first);
            Ok::<_, Infallible>(Response::new(201, "ok"))
        })
        .await;
    assert!(matches!(out, Outcome::Executed(_)), "{out:?}");
    let renewed = guard.stats().renewals;
    assert!(renewed >= 2, "{renewed}");
    // A run dropped mid-handler stops renewing: its claim ends with its lease.
    let other = Key::new("t", "dropped").unwrap();
    let dropped = tokio::time::timeout(
        lease,
        guard.run_async(&other, &fp, |_| async {
            tokio::time::sleep(60 * SEC).await;
            Ok::<_, Infallible>(Response::new(201, "never"))
        }),
    )
    .await;
    assert!(dropped.is_err(), "the run was cancelled");
    // An async drop does not wait: a renewal already in progress may still
    // land, but none starts after it.
    let after_drop = guard.stats().renewals;
    tokio::time::sleep(3 * lease).await;
    let renewals = guard.stats().renewals;
    assert!(
        renewals <= after_drop + 1,
        "renewed after the drop: {after_drop} then {renewals}"
    );
    let retry = store
        .begin(&other, &fp, idemstore::SystemClock.now(), lease, SEC)
        .unwrap();
    assert!(
        matches!(retry, Begin::Claimed(ref c) if c.is_takeover()),
        "{retry:?}"
    );
}
