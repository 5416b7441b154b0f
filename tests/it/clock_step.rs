//! A wall-clock step while a handler runs never runs it twice in this
//! process: the async run, the HTTP layer, waiting duplicates, and the end
//! of a run (panic, dropped future) on `MemoryStore` and `RedbStore`; an
//! owner in another process is judged by the wall clock. The synchronous
//! run on every backend is the conformance case
//! `a_clock_step_never_runs_a_live_handler_twice`.

use crate::tower::{fetch, serve};
use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::Full;
use idemstore::redb::RedbStore;
use idemstore::tower::IdempotencyLayer;
use idemstore::{
    Claim, Clock, Fingerprint, Guard, Key, ManualClock, MemoryStore, Outcome, Response, Store,
};
use idemstore_testkit::BlockingOnly;
use idemstore_testkit::conformance::T0;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(30);

fn kf(id: &str) -> (Key, Fingerprint) {
    (Key::new("t", id).unwrap(), Fingerprint::of(b"qty=1"))
}

fn guard<S: Store>(store: S, clock: &ManualClock) -> Guard<S> {
    Guard::builder(store)
        .clock(clock.clone())
        .lease(LEASE)
        .build()
        .unwrap()
}

fn never(_: &Claim) -> Result<Response, Infallible> {
    panic!("a retry ran the handler")
}

/// `run_async` on `store`: the clock steps `leases` leases inside the
/// handler; a retry through a second guard over the same store is InFlight.
async fn async_run_survives_a_step(store: Arc<dyn Store>, clock: &ManualClock, leases: u32) {
    let (owner, other) = (guard(Arc::clone(&store), clock), guard(store, clock));
    let (key, fp) = kf(&format!("async-{leases}"));
    let runs = AtomicUsize::new(0);
    let out = owner
        .run_async(&key, &fp, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            clock.advance(leases * LEASE);
            tokio::task::yield_now().await;
            let retry = other
                .run_async(&key, &fp, |_| async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Infallible>(Response::new(500, "twice"))
                })
                .await;
            assert!(
                matches!(retry, Outcome::InFlight { lease_until } if lease_until > clock.now()),
                "{retry:?}"
            );
            Ok::<_, Infallible>(Response::new(201, "once"))
        })
        .await;
    assert!(matches!(out, Outcome::Executed(_)), "{out:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let after = other
        .run_async(&key, &fp, |claim| async move { never(&claim) })
        .await;
    assert!(matches!(after, Outcome::Replayed(ref r) if r.body() == b"once"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_runs_survive_steps_of_2_to_100_leases() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let stores: [Arc<dyn Store>; 2] = [
        Arc::new(MemoryStore::with_clock(clock.clone())),
        Arc::new(
            RedbStore::builder()
                .clock(clock.clone())
                .open(dir.path().join("s.idem"))
                .unwrap(),
        ),
    ];
    for store in stores {
        for leases in [2, 10, 100] {
            async_run_survives_a_step(Arc::clone(&store), &clock, leases).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_answers_409_after_a_step_and_replays_after_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = RedbStore::builder()
        .clock(clock.clone())
        .open(dir.path().join("s.idem"))
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let stepped = Arc::new(tokio::sync::Notify::new());
    let finish = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (runs, clock) = (Arc::clone(&runs), clock.clone());
        let (stepped, finish) = (Arc::clone(&stepped), Arc::clone(&finish));
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            clock.advance(100 * LEASE);
            stepped.notify_one();
            finish.notified().await;
            (http::StatusCode::CREATED, "created")
        }
    };
    let app = Router::new()
        .route("/orders", post(handler))
        .layer(IdempotencyLayer::new(guard(store, &clock)));
    let (addr, client) = serve(app).await;
    let request = || {
        http::Request::post(format!("http://{addr}/orders"))
            .header("idempotency-key", "order-1")
            .body(Full::new(Bytes::from_static(b"qty=1")))
            .unwrap()
    };
    let first = tokio::spawn({
        let (client, req) = (client.clone(), request());
        async move { fetch(&client, req).await }
    });
    stepped.notified().await;
    // A retry that ran the handler again would wait in it for ever.
    let retry = tokio::time::timeout(Duration::from_secs(10), fetch(&client, request()))
        .await
        .expect("the retry is answered without running the handler");
    assert_eq!(retry.status, http::StatusCode::CONFLICT, "{retry:?}");
    let after: u64 = retry.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(after >= 1, "{retry:?}");
    finish.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.status, http::StatusCode::CREATED, "{first:?}");
    let replay = fetch(&client, request()).await;
    assert_eq!(replay.status, http::StatusCode::CREATED);
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn a_waiting_duplicate_gets_the_response_after_a_step() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let owner = guard(Arc::clone(&store), &clock);
    let waiting = Guard::builder(store)
        .clock(clock.clone())
        .lease(LEASE)
        .wait_for_duplicates(Duration::from_secs(20))
        .build()
        .unwrap();
    let (key, fp) = kf("waits");
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let first = s.spawn(|| {
            owner.run(&key, &fp, |_| {
                clock.advance(10 * LEASE);
                started_tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(50));
                Ok::<_, Infallible>(Response::new(201, "created"))
            })
        });
        started_rx.recv().unwrap();
        let dup = waiting.run(&key, &fp, never);
        assert!(
            matches!(dup, Outcome::Replayed(ref r) if r.body() == b"created"),
            "{dup:?}"
        );
        assert!(matches!(first.join().unwrap(), Outcome::Executed(_)));
    });
}

#[test]
fn once_the_run_has_ended_the_store_decides() {
    // A panicking handler (its claim is kept) and a dropped async run: the
    // flight is gone with the run, and a retry after the step takes the
    // key over as the wall clock says.
    let clock = ManualClock::new(T0);
    let guard = guard(MemoryStore::with_clock(clock.clone()), &clock);
    let (key, fp) = kf("panics");
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        guard.run(&key, &fp, |_| -> Result<Response, Infallible> {
            clock.advance(2 * LEASE);
            panic!("handler panics")
        })
    }));
    assert!(panicked.is_err());
    let retry = guard.run(&key, &fp, |claim| {
        assert!(claim.is_takeover());
        Ok::<_, Infallible>(Response::new(201, "second owner"))
    });
    assert!(matches!(retry, Outcome::Executed(_)), "{retry:?}");

    let (key, fp) = kf("dropped");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        let run = guard.run_async(&key, &fp, |_| async {
            clock.advance(2 * LEASE);
            std::future::pending::<Result<Response, Infallible>>().await
        });
        let timed_out = tokio::time::timeout(Duration::from_millis(20), run).await;
        assert!(
            timed_out.is_err(),
            "the run is dropped while its handler waits"
        );
    });
    let retry = guard.run(&key, &fp, |claim| {
        assert!(claim.is_takeover());
        Ok::<_, Infallible>(Response::new(201, "second owner"))
    });
    assert!(matches!(retry, Outcome::Executed(_)), "{retry:?}");
}

#[test]
fn an_owner_in_another_process_is_judged_by_the_wall_clock() {
    // What this process cannot know: a step past the lease of an owner
    // running elsewhere lets a retry take over (docs/operations.md, "Clocks").
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let here = guard(Arc::clone(&store), &clock);
    // Another store object over the same records, as a second process.
    let there = guard(BlockingOnly(store), &clock);
    let (key, fp) = kf("elsewhere");
    let out = there.run(&key, &fp, |_| {
        clock.advance(2 * LEASE);
        let retry = here.run(&key, &fp, |claim| {
            assert!(claim.is_takeover());
            Ok::<_, Infallible>(Response::new(201, "second"))
        });
        assert!(matches!(retry, Outcome::Executed(_)), "{retry:?}");
        Ok::<_, Infallible>(Response::new(201, "first"))
    });
    // Fencing refuses the first owner's completion (its lease was lost).
    assert!(
        matches!(out, Outcome::NotStored { .. } | Outcome::LeaseLost(_)),
        "{out:?}"
    );
}

#[test]
fn steps_are_measured_from_the_claim_without_renewal() {
    // Renewal off: the owner holds off retries for its lease of monotonic
    // time since its claim, then the wall clock decides again.
    let clock = ManualClock::new(T0);
    let guard = Guard::builder(MemoryStore::with_clock(clock.clone()))
        .clock(clock.clone())
        .lease(Duration::from_millis(50))
        .renew_leases(false)
        .build()
        .unwrap();
    let (key, fp) = kf("no-renewal");
    let out = guard.run(&key, &fp, |_| {
        clock.advance(Duration::from_secs(60));
        let early = guard.run(&key, &fp, never);
        assert!(matches!(early, Outcome::InFlight { .. }), "{early:?}");
        std::thread::sleep(Duration::from_millis(80));
        let late = guard.run(&key, &fp, |claim| {
            assert!(claim.is_takeover());
            Ok::<_, Infallible>(Response::new(201, "second"))
        });
        assert!(matches!(late, Outcome::Executed(_)), "{late:?}");
        Ok::<_, Infallible>(Response::new(201, "first"))
    });
    assert!(matches!(out, Outcome::NotStored { .. }), "{out:?}");
}

#[test]
fn the_next_renewal_stores_a_lease_from_the_stepped_time() {
    // After a step the store's lease has run out; the run's next renewal
    // (every third of the lease, on real time) stores one from the new
    // time, so that other processes see the claim live again too.
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let lease = Duration::from_millis(300);
    let guard = Guard::builder(Arc::clone(&store))
        .clock(clock.clone())
        .lease(lease)
        .build()
        .unwrap();
    let (key, fp) = kf("renewed");
    let out = guard.run(&key, &fp, |_| {
        clock.advance(100 * lease);
        let stepped = clock.now();
        let live = |store: &MemoryStore| {
            let record = store
                .get(&key, stepped)
                .unwrap()
                .expect("the claim's record");
            record.lease_until().is_some_and(|until| until > stepped)
        };
        assert!(!live(&store), "the step outran the stored lease");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !live(&store) {
            assert!(
                std::time::Instant::now() < deadline,
                "no renewal after the step"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok::<_, Infallible>(Response::new(201, "renewed"))
    });
    assert!(matches!(out, Outcome::Executed(_)), "{out:?}");
}
