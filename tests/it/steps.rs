//! Steps through the async guard and the HTTP layer: `Claim::step_async`
//! and `step_json_async` on `RedbStore` (its native async entry) and on
//! `BlockingOnly` (tokio's blocking pool), and an axum handler that records
//! a step through its `Extension<Claim>`. The sync forms are in guard.rs,
//! the store contract in the conformance suite.

use idemstore::{
    Begin, Clock, Error, Fingerprint, Guard, Key, ManualClock, MemoryStore, Outcome, RedbStore,
    Response, State, Store,
};
use idemstore_testkit::BlockingOnly;
use idemstore_testkit::conformance::T0;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const SEC: Duration = Duration::from_secs(1);

fn key() -> Key {
    Key::new("t", "order-1").unwrap()
}

fn guard_on<S: Store + 'static>(store: S, clock: &ManualClock) -> Guard<S> {
    Guard::builder(store)
        .clock(clock.clone())
        .lease(SEC)
        .retention(60 * SEC)
        .renew_leases(false)
        .build()
        .unwrap()
}

/// The async crash-and-retry run on any store: two steps recorded, the
/// handler "dies" (KeepClaim); inside the lease the retry is in flight;
/// after it the retry replays both (the raw one and the JSON one) without
/// running them, runs the third, and a name used twice is refused.
async fn crash_then_retry<S: Store + 'static>(store: Arc<S>) {
    let clock = ManualClock::new(T0);
    let guard = guard_on(Arc::clone(&store), &clock);
    let fp = Fingerprint::of(b"qty=1");
    let counters = [
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    ];
    let [charges, reserves, emails] = &counters;
    let first = guard
        .run_async(&key(), &fp, |claim| async move {
            let charge = claim
                .step_async("charge", |step_key| async move {
                    charges.fetch_add(1, Ordering::SeqCst);
                    assert_eq!(step_key, key().step_key("charge"));
                    Ok::<_, Error>(b"ch_1".to_vec())
                })
                .await?;
            assert_eq!(charge, b"ch_1");
            let units: u32 = claim
                .step_json_async("reserve", |_| async move {
                    reserves.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(3)
                })
                .await?;
            assert_eq!(units, 3);
            let twice = claim
                .step_async("charge", |_| async move {
                    charges.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(b"ch_2".to_vec())
                })
                .await;
            assert!(
                matches!(twice, Err(Error::InvalidArgument { .. })),
                "{twice:?}"
            );
            Err::<Response, _>(Error::backend("the process died here"))
        })
        .await;
    assert!(matches!(first, Outcome::HandlerFailed(_)), "{first:?}");
    let kept = store.get(&key(), clock.now()).unwrap().unwrap();
    let names: Vec<&str> = kept.steps().iter().map(|s| s.name()).collect();
    assert_eq!(names, ["charge", "reserve"]);
    let inside = guard
        .run_async(&key(), &fp, |_| async {
            panic!("in flight: must not run");
            #[allow(unreachable_code)]
            Ok::<_, Error>(Response::new(500, ""))
        })
        .await;
    assert!(matches!(inside, Outcome::InFlight { .. }), "{inside:?}");
    clock.advance(SEC);
    let retry = guard
        .run_async(&key(), &fp, |claim| async move {
            assert!(claim.is_takeover());
            assert_eq!(claim.steps().len(), 2);
            let charge = claim
                .step_async("charge", |_| async move {
                    charges.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(b"ch_2".to_vec())
                })
                .await?;
            let units: u32 = claim
                .step_json_async("reserve", |_| async move {
                    reserves.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(4)
                })
                .await?;
            let email = claim
                .step_async("email", |_| async move {
                    emails.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(b"sent".to_vec())
                })
                .await?;
            let body = format!(
                "{} {units} {}",
                String::from_utf8_lossy(&charge),
                String::from_utf8_lossy(&email)
            );
            Ok::<_, Error>(Response::new(201, body))
        })
        .await;
    assert!(
        matches!(retry, Outcome::Executed(ref r) if r.body() == b"ch_1 3 sent"),
        "{retry:?}"
    );
    let counts = counters.each_ref().map(|c| c.load(Ordering::SeqCst));
    assert_eq!(counts, [1, 1, 1], "each step ran once");
    let done = store.get(&key(), clock.now()).unwrap().unwrap();
    assert_eq!(done.state(), State::Done);
    assert!(done.steps().is_empty());
}

/// An async step after the run was taken over: the closure ran, the record
/// is `StaleClaim`, and the new owner's record does not get it.
async fn a_step_after_a_takeover_is_stale<S: Store + 'static>(store: Arc<S>) {
    let clock = ManualClock::new(T0);
    let guard = guard_on(Arc::clone(&store), &clock);
    let fp = Fingerprint::of(b"qty=1");
    let k = Key::new("t", "taken").unwrap();
    let emails = &AtomicUsize::new(0);
    let (store_ref, clock_ref, k_ref) = (&*store, &clock, &k);
    let out = guard
        .run_async(&k, &fp, |claim| async move {
            claim
                .step_async("charge", |_| async { Ok::<_, Error>(b"ch_1".to_vec()) })
                .await?;
            clock_ref.advance(2 * SEC);
            let taken = store_ref
                .begin(k_ref, &fp, clock_ref.now(), SEC, 60 * SEC)
                .unwrap();
            assert!(
                matches!(taken, Begin::Claimed(ref c) if c.is_takeover() && c.steps().len() == 1)
            );
            claim
                .step_async("email", |_| async move {
                    emails.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(b"sent".to_vec())
                })
                .await?;
            Ok::<_, Error>(Response::new(200, "unreachable"))
        })
        .await;
    assert!(
        matches!(out, Outcome::HandlerFailed(Error::StaleClaim)),
        "{out:?}"
    );
    assert_eq!(emails.load(Ordering::SeqCst), 1);
    let rec = store.get(&k, clock.now()).unwrap().unwrap();
    let names: Vec<&str> = rec.steps().iter().map(|s| s.name()).collect();
    assert_eq!(names, ["charge"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_steps_on_redb_replay_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(RedbStore::open(dir.path().join("s.idem")).unwrap());
    crash_then_retry(Arc::clone(&store)).await;
    a_step_after_a_takeover_is_stale(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_steps_on_the_blocking_pool_replay_after_a_crash() {
    let store = Arc::new(BlockingOnly(MemoryStore::new()));
    crash_then_retry(Arc::clone(&store)).await;
    a_step_after_a_takeover_is_stale(store).await;
}

/// A redb store's steps outlive a reopen: the retry after a restart
/// replays them (through the async guard).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_recorded_on_redb_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let clock = ManualClock::new(T0);
    let fp = Fingerprint::of(b"qty=1");
    {
        // A sync run: an async one can leave the store open after its guard
        // is dropped (see the ignored test below).
        let guard = guard_on(RedbStore::open(&path).unwrap(), &clock);
        let out = guard.run(&key(), &fp, |claim| {
            claim.step("charge", |_| Ok::<_, Error>(b"ch_1".to_vec()))?;
            Err::<Response, _>(Error::backend("died"))
        });
        assert!(matches!(out, Outcome::HandlerFailed(_)), "{out:?}");
    }
    clock.advance(SEC);
    let guard = guard_on(RedbStore::open(&path).unwrap(), &clock);
    let out = guard
        .run_async(&key(), &fp, |claim| async move {
            let charge = claim
                .step_async("charge", |_| async {
                    panic!("recorded before the restart");
                    #[allow(unreachable_code)]
                    Ok::<_, Error>(Vec::new())
                })
                .await?;
            Ok::<_, Error>(Response::new(201, charge))
        })
        .await;
    assert!(
        matches!(out, Outcome::Executed(ref r) if r.body() == b"ch_1"),
        "{out:?}"
    );
}

/// An async run that failed open (the store is down) runs its steps on
/// the caller's task and records nothing; the next one runs them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_fail_open_run_executes_steps_without_recording() {
    let store = Arc::new(idemstore_testkit::FaultyStore::new(MemoryStore::new()));
    let clock = ManualClock::new(T0);
    let guard = Guard::builder(Arc::clone(&store))
        .clock(clock.clone())
        .lease(SEC)
        .fail_open(true)
        .build()
        .unwrap();
    store.fail_all();
    let charges = &AtomicUsize::new(0);
    for run in 1..=2 {
        let out = guard
            .run_async(&key(), &Fingerprint::of(b"x"), |claim| async move {
                assert!(claim.is_unprotected());
                let n: u32 = claim
                    .step_json_async("charge", |_| async move {
                        Ok::<_, Error>(charges.fetch_add(1, Ordering::SeqCst) as u32 + 1)
                    })
                    .await?;
                Ok::<_, Error>(Response::new(200, n.to_string()))
            })
            .await;
        assert!(
            matches!(out, Outcome::FailedOpen(Ok(ref r)) if r.body() == run.to_string().as_bytes()),
            "{out:?}"
        );
    }
    store.clear_fault();
    assert!(store.get(&key(), clock.now()).unwrap().is_none());
}

#[cfg(feature = "tower")]
mod over_http {
    use super::*;
    use crate::tower::{LiveRuns, fetch, serve};
    use axum::Router;
    use axum::extract::{Extension, State};
    use axum::http::StatusCode;
    use axum::routing::post;
    use bytes::Bytes;
    use http_body_util::Full;
    use idemstore::Claim;
    use idemstore::tower::IdempotencyLayer;

    #[derive(Clone, Default)]
    struct Payments {
        runs: Arc<AtomicUsize>,
        charges: Arc<AtomicUsize>,
        /// Runs of `pay` whose future the server has not dropped yet.
        live: LiveRuns,
    }

    /// Charges once per key through a step; on its first run the process
    /// "dies" after the charge (the handler hangs until the client gives
    /// up and the request is dropped).
    async fn pay(
        State(p): State<Payments>,
        Extension(claim): Extension<Claim>,
    ) -> Result<(StatusCode, String), (StatusCode, String)> {
        let run = p.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let _live = p.live.enter();
        let charges = Arc::clone(&p.charges);
        let charge = claim
            .step_async("charge", |step_key| async move {
                charges.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Error>(format!("ch_{}", &step_key[..8]).into_bytes())
            })
            .await
            .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        if run == 1 {
            std::future::pending::<()>().await;
        }
        Ok((
            StatusCode::CREATED,
            format!("{} on run {run}", String::from_utf8_lossy(&charge)),
        ))
    }

    /// Ships once per key through a step, then fails with 500 on its first
    /// run (after the shipment).
    async fn ship(
        State(p): State<Payments>,
        Extension(claim): Extension<Claim>,
    ) -> (StatusCode, String) {
        let run = p.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let charges = Arc::clone(&p.charges);
        let shipped = claim
            .step_async("ship", |_| async move {
                charges.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Error>(b"parcel-1".to_vec())
            })
            .await;
        match (run, shipped) {
            (_, Err(e)) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            (1, Ok(_)) => (
                StatusCode::BAD_GATEWAY,
                "the invoice service is down".into(),
            ),
            (_, Ok(p)) => (
                StatusCode::CREATED,
                format!("{} on run {run}", String::from_utf8_lossy(&p)),
            ),
        }
    }

    /// `StorePolicy::AllButServerErrors` releases the claim of a 5xx run;
    /// with a step recorded the release keeps it, so the retry (at once)
    /// does not ship again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_released_5xx_run_keeps_its_steps_for_the_retry() {
        let payments = Payments::default();
        let app = Router::new()
            .route("/ship", post(ship))
            .with_state(payments.clone())
            .layer(
                IdempotencyLayer::new(Guard::new(MemoryStore::new()))
                    .store_policy(idemstore::tower::StorePolicy::AllButServerErrors),
            );
        let (addr, client) = serve(app).await;
        let send = || {
            let req = ::http::Request::builder()
                .method("POST")
                .uri(format!("http://{addr}/ship"))
                .header("idempotency-key", "ship-1")
                .body(Full::new(Bytes::new()))
                .unwrap();
            fetch(&client, req)
        };
        let first = send().await;
        assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{first:?}");
        let retry = send().await;
        assert_eq!(
            (retry.status, retry.body.as_str(), retry.replayed()),
            (StatusCode::CREATED, "parcel-1 on run 2", false)
        );
        assert_eq!(payments.charges.load(Ordering::SeqCst), 1, "shipped once");
        assert!(send().await.replayed());
        assert_eq!(payments.runs.load(Ordering::SeqCst), 2);
    }

    /// Through the HTTP layer: the retry after a simulated crash takes the
    /// key over and the handler's `step_async` replays the recorded charge
    /// instead of charging again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_axum_handler_retried_after_a_crash_does_not_charge_twice() {
        let clock = ManualClock::new(T0);
        let guard = Guard::builder(MemoryStore::new())
            .clock(clock.clone())
            .lease(10 * SEC)
            .renew_leases(false)
            .build()
            .unwrap();
        let payments = Payments::default();
        let app = Router::new()
            .route("/pay", post(pay))
            .with_state(payments.clone())
            .layer(IdempotencyLayer::new(guard));
        let (addr, client) = serve(app).await;
        let send = || {
            let req = ::http::Request::builder()
                .method("POST")
                .uri(format!("http://{addr}/pay"))
                .header("idempotency-key", "pay-1")
                .body(Full::new(Bytes::from_static(b"cents=500")))
                .unwrap();
            fetch(&client, req)
        };
        let gave_up = tokio::time::timeout(Duration::from_millis(300), send()).await;
        assert!(gave_up.is_err(), "the first run hangs after its charge");
        // The first run charges, then the server drops its future once it
        // sees the connection closed ([`LiveRuns`]).
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while payments.charges.load(Ordering::SeqCst) == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the first run never charged"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        payments.live.until_none().await;
        assert_eq!(payments.charges.load(Ordering::SeqCst), 1);
        let inside = send().await;
        assert_eq!(inside.status, StatusCode::CONFLICT, "{inside:?}");
        clock.advance(11 * SEC);
        let retry = send().await;
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        let step_key = Key::new("", "pay-1").unwrap().step_key("charge");
        assert_eq!(retry.body, format!("ch_{} on run 2", &step_key[..8]));
        assert_eq!(payments.charges.load(Ordering::SeqCst), 1, "charged once");
        assert_eq!(payments.runs.load(Ordering::SeqCst), 2);
        let again = send().await;
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, retry.body);
        assert_eq!(payments.runs.load(Ordering::SeqCst), 2);
    }
}

/// A guard's claim must not own its store: the redb commit ops clone the
/// claim, and if the committer thread dropped the last owner, the store's
/// drop would join that thread from itself and never release the file (a
/// reopen in this process would be `Error::Locked`). A plain handler is
/// enough to show it.
#[test]
fn a_redb_store_is_closed_when_its_guard_is_dropped_after_an_async_run() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for round in 0..50 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.idem");
        {
            let guard = Guard::new(RedbStore::open(&path).unwrap());
            let out = rt.block_on(guard.run_async(&key(), &Fingerprint::of(b"x"), |_| async {
                Ok::<_, Error>(Response::new(200, "ok"))
            }));
            assert!(matches!(out, Outcome::Executed(_)), "{out:?}");
        }
        if let Err(e) = RedbStore::open(&path) {
            panic!("round {round}: the dropped store still holds its file: {e:?}");
        }
    }
}
