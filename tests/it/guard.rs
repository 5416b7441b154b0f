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

/// Counts how often each step's closure ran, and the step keys it got.
#[derive(Default)]
struct Effects {
    runs: std::sync::Mutex<Vec<(String, String)>>,
}

impl Effects {
    /// A step closure for `name` that records its run and returns `output`.
    fn step<'a>(
        &'a self,
        name: &'a str,
        output: &'a str,
    ) -> impl FnOnce(&str) -> Result<Vec<u8>, Error> + 'a {
        move |step_key| {
            self.runs
                .lock()
                .unwrap()
                .push((name.to_owned(), step_key.to_owned()));
            Ok(output.as_bytes().to_vec())
        }
    }
    fn count(&self, name: &str) -> usize {
        self.runs
            .lock()
            .unwrap()
            .iter()
            .filter(|(n, _)| n == name)
            .count()
    }
    fn total(&self) -> usize {
        self.runs.lock().unwrap().len()
    }
}

fn step_names(steps: &[idemstore::Step]) -> Vec<&str> {
    steps.iter().map(idemstore::Step::name).collect()
}

/// A handler records two steps and "dies" (returns `Err` under the default
/// KeepClaim). Inside the lease a retry is in flight; after it, the retry
/// takes over, replays the two recorded steps without running them (each
/// gives back its recorded output) and runs the third. Every step got its
/// stable step key; the DONE record has no steps.
#[test]
fn a_retry_after_a_crash_replays_recorded_steps_and_runs_the_rest() {
    let (guard, store, clock) = setup(|b| b);
    let fp = Fingerprint::of(b"x");
    let effects = Effects::default();
    let first = guard.run(&key(), &fp, |claim| {
        assert!(claim.steps().is_empty());
        let charge = claim.step("charge", effects.step("charge", "ch_1"))?;
        assert_eq!(charge, b"ch_1");
        claim.step("reserve", effects.step("reserve", "r_1"))?;
        Err::<Response, _>(Error::backend("the process died here"))
    });
    assert!(matches!(first, Outcome::HandlerFailed(_)), "{first:?}");
    let kept = store.get(&key(), clock.now()).unwrap().unwrap();
    assert_eq!(step_names(kept.steps()), ["charge", "reserve"]);
    assert!(matches!(
        guard.run(&key(), &fp, never()),
        Outcome::InFlight { .. }
    ));
    clock.advance(SEC);
    let retry = guard.run(&key(), &fp, |claim| {
        assert!(claim.is_takeover());
        assert_eq!(claim.attempt(), 2);
        assert_eq!(step_names(claim.steps()), ["charge", "reserve"]);
        let charge = claim.step("charge", |_| -> Result<Vec<u8>, Error> {
            panic!("a recorded step must not run again")
        })?;
        let reserve = claim.step("reserve", |_| -> Result<Vec<u8>, Error> {
            panic!("a recorded step must not run again")
        })?;
        let email = claim.step("email", effects.step("email", "sent"))?;
        let body = [charge, reserve, email].join(&b'|');
        Ok::<_, Error>(Response::new(201, body))
    });
    assert!(
        matches!(retry, Outcome::Executed(ref r) if r.body() == b"ch_1|r_1|sent"),
        "{retry:?}"
    );
    assert_eq!(
        (
            effects.count("charge"),
            effects.count("reserve"),
            effects.count("email")
        ),
        (1, 1, 1)
    );
    for (name, step_key) in effects.runs.lock().unwrap().iter() {
        assert_eq!(step_key, &key().step_key(name), "{name}");
    }
    let done = store.get(&key(), clock.now()).unwrap().unwrap();
    assert_eq!(done.state(), idemstore::State::Done);
    assert!(done.steps().is_empty());
    assert!(matches!(
        guard.run(&key(), &fp, never()),
        Outcome::Replayed(ref r) if r.body() == b"ch_1|r_1|sent"
    ));
}

/// A name is used once per run: the second use is `InvalidArgument` and
/// does not run; so is an empty name, and a name over its limit is
/// `StepLimit`, both before the closure runs. An output over its limit is
/// refused after the closure ran, and nothing is recorded.
#[test]
fn a_step_name_used_twice_in_one_run_is_refused() {
    let (guard, store, clock) = setup(|b| b);
    let fp = Fingerprint::of(b"x");
    let effects = Effects::default();
    let out = guard.run(&key(), &fp, |claim| {
        claim.step("charge", effects.step("charge", "ch_1"))?;
        let again = claim.step("charge", effects.step("charge", "ch_2"));
        assert!(
            matches!(again, Err(Error::InvalidArgument { ref reason }) if reason.contains("charge")),
            "{again:?}"
        );
        let empty = claim.step("", effects.step("", "x"));
        assert!(matches!(empty, Err(Error::InvalidArgument { .. })), "{empty:?}");
        let long = "n".repeat(idemstore::limits::MAX_STEP_NAME_BYTES + 1);
        let r = claim.step(&long, effects.step("long", "x"));
        assert!(
            matches!(r, Err(Error::StepLimit { what: "name bytes", .. })),
            "{r:?}"
        );
        assert_eq!(effects.total(), 1, "refused names never run");
        let big = claim.step("big", |_| {
            Ok::<_, Error>(vec![0; idemstore::limits::MAX_STEP_OUTPUT_BYTES + 1])
        });
        assert!(
            matches!(big, Err(Error::StepLimit { what: "output bytes", .. })),
            "{big:?}"
        );
        let rec = store.get(&key(), clock.now()).unwrap().unwrap();
        assert_eq!(step_names(rec.steps()), ["charge"], "only the first is recorded");
        Ok::<_, Error>(Response::new(200, "ok"))
    });
    assert!(matches!(out, Outcome::Executed(_)), "{out:?}");
    // A claim that is not a guard's run cannot run steps.
    let Begin::Claimed(bare) = store
        .begin(
            &Key::new("t", "bare").unwrap(),
            &fp,
            clock.now(),
            SEC,
            60 * SEC,
        )
        .unwrap()
    else {
        panic!("claimed")
    };
    let r = bare.step("charge", effects.step("charge", "x"));
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    assert_eq!(effects.count("charge"), 1);
}

/// A run whose lease ran out and was taken over while it ran: its next
/// step's side effect happens (the closure cannot know), but recording it
/// is `StaleClaim` and the new owner's record does not get it.
#[test]
fn a_step_in_a_run_taken_over_fails_with_stale_claim() {
    let (guard, store, clock) = setup(|b| b);
    let fp = Fingerprint::of(b"x");
    let effects = Effects::default();
    let mut usurper = None;
    let out = guard.run(&key(), &fp, |claim| {
        claim.step("charge", effects.step("charge", "ch_1"))?;
        clock.advance(2 * SEC);
        let Begin::Claimed(taken) = store
            .begin(&key(), &fp, clock.now(), SEC, 60 * SEC)
            .unwrap()
        else {
            panic!("takeover expected")
        };
        assert_eq!(step_names(taken.steps()), ["charge"]);
        usurper = Some(taken);
        let email = claim.step("email", effects.step("email", "sent"));
        assert!(matches!(email, Err(Error::StaleClaim)), "{email:?}");
        email?;
        Ok::<_, Error>(Response::new(200, "unreachable"))
    });
    assert!(
        matches!(out, Outcome::HandlerFailed(Error::StaleClaim)),
        "{out:?}"
    );
    assert_eq!(effects.count("email"), 1, "the side effect happened");
    let usurper = usurper.unwrap();
    let rec = store.get(&key(), clock.now()).unwrap().unwrap();
    assert_eq!(rec.token(), usurper.token());
    assert_eq!(step_names(rec.steps()), ["charge"], "nothing recorded");
}

/// `step_json` records its value as JSON and a replay decodes it; a
/// recorded output that does not decode as the type asked is `Corrupt`,
/// and the step does not run again.
#[test]
fn step_json_round_trips_and_an_undecodable_output_is_corrupt() {
    let (guard, _, clock) = setup(|b| b);
    let fp = Fingerprint::of(b"x");
    let effects = Effects::default();
    let first = guard.run(&key(), &fp, |claim| {
        let charge: (String, u64) = claim.step_json("charge", |_| {
            effects.step("charge", "")("")?;
            Ok::<_, Error>(("ch_9".to_owned(), 500))
        })?;
        assert_eq!(charge, ("ch_9".to_owned(), 500));
        claim.step("raw", effects.step("raw", "not json"))?;
        Err::<Response, _>(Error::backend("died"))
    });
    assert!(matches!(first, Outcome::HandlerFailed(_)), "{first:?}");
    clock.advance(SEC);
    let retry = guard.run(&key(), &fp, |claim| {
        assert_eq!(claim.steps()[0].output(), br#"["ch_9",500]"#);
        let charge: (String, u64) = claim.step_json("charge", |_| -> Result<_, Error> {
            panic!("replayed, not run")
        })?;
        assert_eq!(charge, ("ch_9".to_owned(), 500));
        let raw = claim.step_json::<u64, Error>("raw", |_| panic!("replayed, not run"));
        assert!(matches!(raw, Err(Error::Corrupt { .. })), "{raw:?}");
        Ok::<_, Error>(Response::new(200, charge.0))
    });
    assert!(matches!(retry, Outcome::Executed(_)), "{retry:?}");
    assert_eq!((effects.count("charge"), effects.count("raw")), (1, 1));
}

/// A run that failed open (the store is down) runs its steps and records
/// nothing: the next fail-open run runs them again. Names are still unique
/// within a run.
#[test]
fn a_fail_open_run_executes_steps_without_recording() {
    let (guard, store, clock) = setup(|b| b.fail_open(true));
    let fp = Fingerprint::of(b"x");
    let effects = Effects::default();
    store.fail_all();
    for run in 1..=2 {
        let out = guard.run(&key(), &fp, |claim| {
            assert!(claim.is_unprotected());
            let charge = claim.step("charge", effects.step("charge", "ch_1"))?;
            assert_eq!(charge, b"ch_1");
            let again = claim.step("charge", effects.step("charge", "ch_2"));
            assert!(
                matches!(again, Err(Error::InvalidArgument { .. })),
                "{again:?}"
            );
            Ok::<_, Error>(Response::new(200, charge))
        });
        assert!(matches!(out, Outcome::FailedOpen(Ok(_))), "{out:?}");
        assert_eq!(effects.count("charge"), run);
    }
    store.clear_fault();
    assert!(
        store.get(&key(), clock.now()).unwrap().is_none(),
        "nothing recorded"
    );
}

/// Under `OnHandlerError::Release` a failed run that recorded steps
/// releases its claim but keeps the steps: the retry runs at once (not a
/// takeover), starts with them and does not run them again; a request
/// with other parameters is a conflict meanwhile.
#[test]
fn the_release_policy_keeps_steps_for_the_retry() {
    let (guard, store, clock) = setup(|b| b.on_handler_error(OnHandlerError::Release));
    let fp = Fingerprint::of(b"x");
    let effects = Effects::default();
    let first = guard.run(&key(), &fp, |claim| {
        claim.step("charge", effects.step("charge", "ch_1"))?;
        Err::<Response, _>(Error::backend("the next step failed"))
    });
    assert!(matches!(first, Outcome::HandlerFailed(_)), "{first:?}");
    let kept = store.get(&key(), clock.now()).unwrap().expect("kept");
    assert_eq!(kept.state(), idemstore::State::Processing);
    assert_eq!(kept.lease_until(), Some(idemstore::Timestamp::EPOCH));
    assert_eq!(step_names(kept.steps()), ["charge"]);
    assert!(matches!(
        guard.run(&key(), &Fingerprint::of(b"other"), never()),
        Outcome::Conflicted
    ));
    let retry = guard.run(&key(), &fp, |claim| {
        assert!(!claim.is_takeover());
        assert_eq!(claim.attempt(), 2);
        let charge = claim.step("charge", |_| -> Result<Vec<u8>, Error> {
            panic!("recorded before the release")
        })?;
        claim.step("email", effects.step("email", "sent"))?;
        Ok::<_, Error>(Response::new(201, charge))
    });
    assert!(
        matches!(retry, Outcome::Executed(ref r) if r.body() == b"ch_1"),
        "{retry:?}"
    );
    assert_eq!((effects.count("charge"), effects.count("email")), (1, 1));
    // Without steps, the release policy still deletes the record.
    let other = Key::new("t", "no-steps").unwrap();
    let _ = guard.run(&other, &fp, |_| Err::<Response, _>("boom"));
    assert!(store.get(&other, clock.now()).unwrap().is_none());
}

/// Under `TakeoverPolicy::Reconcile` the retry after a crash does not run
/// the handler: `Outcome::Unknown(claim)` hands the caller the recorded
/// steps to reconcile with, and the caller completes the claim.
#[test]
fn reconcile_hands_over_the_recorded_steps() {
    let (guard, store, clock) = setup(|b| b.takeover(TakeoverPolicy::Reconcile));
    let fp = Fingerprint::of(b"x");
    let effects = Effects::default();
    let _ = guard.run(&key(), &fp, |claim| {
        claim.step("charge", effects.step("charge", "ch_1"))?;
        claim.step("reserve", effects.step("reserve", "r_1"))?;
        Err::<Response, _>(Error::backend("crashed"))
    });
    clock.advance(2 * SEC);
    let Outcome::Unknown(claim) = guard.run(&key(), &fp, never()) else {
        panic!("expected Unknown")
    };
    assert!(claim.is_takeover());
    let recorded: Vec<(&str, &[u8])> = claim
        .steps()
        .iter()
        .map(|s| (s.name(), s.output()))
        .collect();
    assert_eq!(
        recorded,
        [("charge", &b"ch_1"[..]), ("reserve", &b"r_1"[..])]
    );
    // The caller found the charge and the reservation made: it completes.
    guard
        .complete(&key(), &claim, &Response::new(201, "reconciled"))
        .unwrap();
    assert!(
        store
            .get(&key(), clock.now())
            .unwrap()
            .unwrap()
            .steps()
            .is_empty()
    );
    assert!(matches!(
        guard.run(&key(), &fp, never()),
        Outcome::Replayed(ref r) if r.body() == b"reconciled"
    ));
    assert_eq!(effects.total(), 2);
}

/// A duplicate waiting on a run of this process (`wait_for_duplicates`)
/// whose handler fails under the release policy after recording a step:
/// the waiter claims the released key at once, not as a takeover, and
/// replays the step instead of running it again.
#[test]
fn a_waiting_duplicate_continues_a_released_run_from_its_steps() {
    let (guard, _, _) = setup(|b| {
        b.on_handler_error(OnHandlerError::Release)
            .wait_for_duplicates(SEC)
    });
    let fp = Fingerprint::of(b"x");
    let effects = Effects::default();
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (first, second) = std::thread::scope(|s| {
        let owner = s.spawn(|| {
            guard.run(&key(), &fp, |claim| {
                claim.step("charge", effects.step("charge", "ch_1"))?;
                started_tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(100));
                Err::<Response, _>(Error::backend("the next step failed"))
            })
        });
        started_rx.recv().unwrap();
        let waiter = s.spawn(|| {
            guard.run(&key(), &fp, |claim| {
                assert!(!claim.is_takeover());
                assert_eq!(claim.attempt(), 2);
                let charge = claim.step("charge", |_| -> Result<Vec<u8>, Error> {
                    panic!("recorded by the first run")
                })?;
                Ok::<_, Error>(Response::new(201, charge))
            })
        });
        (owner.join().unwrap(), waiter.join().unwrap())
    });
    assert!(matches!(first, Outcome::HandlerFailed(_)), "{first:?}");
    assert!(
        matches!(second, Outcome::Executed(ref r) if r.body() == b"ch_1"),
        "{second:?}"
    );
    assert_eq!(effects.count("charge"), 1);
}
