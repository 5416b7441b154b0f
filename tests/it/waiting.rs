//! Waiting duplicates (`GuardBuilder::wait_for_duplicates`), on `MemoryStore`.

use idemstore::guard::OnHandlerError;
use idemstore::{Error, Fingerprint, Guard, Key, MemoryStore, Outcome, Response};
use idemstore_testkit::BlockingOnly;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::Duration;

const DUPLICATES: usize = 16;
const LONG: Duration = Duration::from_secs(20);

fn waiting_guard(max_wait: Duration) -> Guard<MemoryStore> {
    Guard::builder(MemoryStore::new())
        .lease(Duration::from_secs(30))
        .wait_for_duplicates(max_wait)
        .build()
        .unwrap()
}

fn kf() -> (Key, Fingerprint) {
    (Key::new("t", "order-1").unwrap(), Fingerprint::of(b"qty=1"))
}

#[test]
fn sixteen_threads_one_execution_all_get_the_response() {
    let guard = waiting_guard(LONG);
    let (key, fp) = kf();
    let runs = AtomicUsize::new(0);
    let start = Barrier::new(DUPLICATES);
    let outcomes: Vec<Outcome<Infallible>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..DUPLICATES)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    guard.run(&key, &fp, |claim| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        // Long enough that every duplicate arrives while it runs.
                        std::thread::sleep(Duration::from_millis(100));
                        Ok(Response::new(201, format!("order #{}", claim.token())))
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let executed = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Executed(_)))
        .count();
    assert_eq!(executed, 1);
    for o in &outcomes {
        assert!(
            matches!(o.response(), Some(r) if r.body() == b"order #1"),
            "{o:?}"
        );
    }
    let stats = guard.stats();
    assert_eq!(stats.in_flight, 0);
    assert_eq!(stats.replayed, (DUPLICATES - 1) as u64);
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_tasks_one_execution_all_get_the_response() {
    let guard = waiting_guard(LONG);
    let runs = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(tokio::sync::Barrier::new(DUPLICATES));
    let tasks: Vec<_> = (0..DUPLICATES)
        .map(|_| {
            let (guard, runs, start) = (guard.clone(), Arc::clone(&runs), Arc::clone(&start));
            tokio::spawn(async move {
                let (key, fp) = kf();
                start.wait().await;
                guard
                    .run_async(&key, &fp, |claim| async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        Ok::<_, Infallible>(Response::new(201, format!("#{}", claim.token())))
                    })
                    .await
            })
        })
        .collect();
    let mut executed = 0;
    for t in tasks {
        let o = t.await.unwrap();
        executed += usize::from(matches!(o, Outcome::Executed(_)));
        assert!(
            matches!(o.response(), Some(r) if r.body() == b"#1"),
            "{o:?}"
        );
    }
    assert_eq!((runs.load(Ordering::SeqCst), executed), (1, 1));
    assert_eq!(guard.stats().waited, (DUPLICATES - 1) as u64);
}

#[test]
fn deadline_passed_answers_in_flight() {
    let guard = waiting_guard(Duration::from_millis(20));
    let (key, fp) = kf();
    let (started_tx, started_rx) = mpsc::channel();
    let (finish_tx, finish_rx) = mpsc::channel::<()>();
    let finish_rx = std::sync::Mutex::new(finish_rx); // shared with a scoped thread
    std::thread::scope(|s| {
        let owner = s.spawn(|| {
            guard.run(&key, &fp, |_| {
                started_tx.send(()).unwrap();
                finish_rx.lock().unwrap().recv().unwrap();
                Ok::<_, Infallible>(Response::new(200, "late"))
            })
        });
        started_rx.recv().unwrap();
        let dup = guard.run(&key, &fp, |_| -> Result<Response, Infallible> {
            unreachable!()
        });
        assert!(matches!(dup, Outcome::InFlight { .. }), "{dup:?}");
        finish_tx.send(()).unwrap();
        assert!(matches!(owner.join().unwrap(), Outcome::Executed(_)));
    });
    assert_eq!((guard.stats().in_flight, guard.stats().waited), (1, 0));
}

#[test]
fn owner_in_another_process_answers_in_flight_without_waiting() {
    // Guards on two store objects over the same records share no flights,
    // like two processes: the duplicate must not wait for an owner it
    // cannot hear from. The owner only finishes after the duplicate has
    // answered, so a duplicate that waited would see the owner's stored
    // response instead of InFlight.
    let here = waiting_guard(LONG);
    // `BlockingOnly` forwards every call but `Store::instance`.
    let there = Guard::new(BlockingOnly(Arc::clone(here.store())));
    let (key, fp) = kf();
    let (started_tx, started_rx) = mpsc::channel();
    let (finish_tx, finish_rx) = mpsc::channel::<()>();
    let finish_rx = std::sync::Mutex::new(finish_rx); // shared with a scoped thread
    std::thread::scope(|s| {
        let owner = s.spawn(|| {
            there.run(&key, &fp, |_| {
                started_tx.send(()).unwrap();
                let _ = finish_rx
                    .lock()
                    .unwrap()
                    .recv_timeout(Duration::from_secs(5));
                Ok::<_, Infallible>(Response::new(200, "done"))
            })
        });
        started_rx.recv().unwrap();
        let dup = here.run(&key, &fp, |_| -> Result<Response, Infallible> {
            unreachable!()
        });
        assert!(matches!(dup, Outcome::InFlight { .. }), "{dup:?}");
        finish_tx.send(()).unwrap();
        assert!(matches!(owner.join().unwrap(), Outcome::Executed(_)));
    });
}

#[test]
fn released_claim_lets_one_waiter_run_the_handler() {
    // The owner's handler fails and releases the claim: a waiter must not
    // hang until its deadline nor answer InFlight; it asks the store again,
    // claims, and runs the handler itself.
    let guard = Guard::builder(MemoryStore::new())
        .on_handler_error(OnHandlerError::Release)
        .wait_for_duplicates(LONG)
        .build()
        .unwrap();
    let (key, fp) = kf();
    let (started_tx, started_rx) = mpsc::channel();
    let (finish_tx, finish_rx) = mpsc::channel::<()>();
    let finish_rx = std::sync::Mutex::new(finish_rx); // shared with a scoped thread
    std::thread::scope(|s| {
        let owner = s.spawn(|| {
            guard.run(&key, &fp, |_| {
                started_tx.send(()).unwrap();
                finish_rx.lock().unwrap().recv().unwrap();
                Err::<Response, _>("payment provider down")
            })
        });
        started_rx.recv().unwrap();
        let dup = s.spawn(|| {
            guard.run(&key, &fp, |_| {
                Ok::<_, &str>(Response::new(201, "second try worked"))
            })
        });
        // Let the duplicate reach its wait before the owner fails.
        std::thread::sleep(Duration::from_millis(50));
        finish_tx.send(()).unwrap();
        assert!(matches!(owner.join().unwrap(), Outcome::HandlerFailed(_)));
        let dup = dup.join().unwrap();
        assert!(
            matches!(dup, Outcome::Executed(ref r) if r.status() == 201),
            "{dup:?}"
        );
    });
}

#[test]
fn kept_claim_answers_in_flight_once_the_owner_gives_up() {
    let guard = waiting_guard(LONG);
    let (key, fp) = kf();
    let (started_tx, started_rx) = mpsc::channel();
    let (finish_tx, finish_rx) = mpsc::channel::<()>();
    let finish_rx = std::sync::Mutex::new(finish_rx); // shared with a scoped thread
    std::thread::scope(|s| {
        let owner = s.spawn(|| {
            guard.run(&key, &fp, |_| {
                started_tx.send(()).unwrap();
                finish_rx.lock().unwrap().recv().unwrap();
                Err::<Response, _>("crashed halfway")
            })
        });
        started_rx.recv().unwrap();
        let dup =
            s.spawn(|| guard.run(&key, &fp, |_| -> Result<Response, &str> { unreachable!() }));
        std::thread::sleep(Duration::from_millis(50));
        finish_tx.send(()).unwrap();
        assert!(matches!(owner.join().unwrap(), Outcome::HandlerFailed(_)));
        // The record stays PROCESSING (KeepClaim): the lease protects it.
        assert!(matches!(dup.join().unwrap(), Outcome::InFlight { .. }));
    });
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_owner_wakes_its_waiters() {
    // An HTTP server drops the handler future when the client disconnects:
    // the waiters must hear that no result is coming, not sleep to the deadline.
    let guard = waiting_guard(LONG);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let owner = {
        let guard = guard.clone();
        tokio::spawn(async move {
            let (key, fp) = kf();
            guard
                .run_async(&key, &fp, |_| async move {
                    started_tx.send(()).unwrap();
                    std::future::pending::<Result<Response, Infallible>>().await
                })
                .await
        })
    };
    started_rx.await.unwrap();
    let dup = {
        let guard = guard.clone();
        tokio::spawn(async move {
            let (key, fp) = kf();
            guard
                .run_async(&key, &fp, |_| async {
                    unreachable!() as Result<Response, Infallible>
                })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    owner.abort();
    let dup = tokio::time::timeout(LONG / 2, dup).await;
    let dup = dup.expect("the waiter was woken").unwrap();
    assert!(matches!(dup, Outcome::InFlight { .. }), "{dup:?}");
}

#[test]
fn wait_longer_than_the_lease_is_refused() {
    let built = Guard::builder(MemoryStore::new())
        .lease(Duration::from_secs(1))
        .wait_for_duplicates(Duration::from_secs(2))
        .build();
    assert!(matches!(built, Err(Error::InvalidArgument { .. })));
    let zero = Guard::builder(MemoryStore::new())
        .wait_for_duplicates(Duration::ZERO)
        .build();
    assert!(matches!(zero, Err(Error::InvalidArgument { .. })));
}

#[test]
fn waiting_off_answers_in_flight() {
    let guard = Guard::new(MemoryStore::new());
    let (key, fp) = kf();
    let (started_tx, started_rx) = mpsc::channel();
    let (finish_tx, finish_rx) = mpsc::channel::<()>();
    let finish_rx = std::sync::Mutex::new(finish_rx); // shared with a scoped thread
    std::thread::scope(|s| {
        let owner = s.spawn(|| {
            guard.run(&key, &fp, |_| {
                started_tx.send(()).unwrap();
                finish_rx.lock().unwrap().recv().unwrap();
                Ok::<_, Infallible>(Response::new(200, "x"))
            })
        });
        started_rx.recv().unwrap();
        let dup = guard.run(&key, &fp, |_| -> Result<Response, Infallible> {
            unreachable!()
        });
        assert!(matches!(dup, Outcome::InFlight { .. }));
        finish_tx.send(()).unwrap();
        owner.join().unwrap();
    });
}
