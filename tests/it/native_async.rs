//! The native async entry (`Store::begin_async` and friends): no thread per
//! waiting request, the same answers as the blocking calls, cancellation at
//! every await point, and a poisoned store, a long line and a store
//! dropped with releases still queued.

use idemstore::logic::StoreFuture;
use idemstore::{
    Begin, Claim, Error, Fingerprint, Guard, Key, MemoryStore, Outcome, Record, RedbStore,
    Response, State, Store,
};
use idemstore_testkit::BlockingOnly;
use idemstore_testkit::conformance::T0;
use idemstore_testkit::crash::CrashBackend;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(3600);
const FP: Fingerprint = Fingerprint::from_bytes([7; 32]);

fn key(id: impl std::fmt::Display) -> Key {
    Key::new("t", id.to_string()).unwrap()
}

fn fp() -> Fingerprint {
    Fingerprint::of(b"qty=1")
}

fn redb(dir: &tempfile::TempDir) -> RedbStore {
    RedbStore::open(dir.path().join("s.idem")).unwrap()
}

/// Threads of this process whose name starts with `prefix` (a runtime's
/// workers and blocking threads share its `thread_name`); other tests run
/// in parallel in this process, so the whole count would mean nothing.
fn threads_named(prefix: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// Runs 1,000 concurrent `run_async` over `store` on a 2-worker runtime
/// named `name` and returns the peak number of that runtime's threads.
pub fn peak_threads_for(store: impl Store + 'static, name: &'static str) -> usize {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(name)
        .enable_all()
        .build()
        .unwrap();
    let guard = Guard::new(store);
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (stop, peak) = (Arc::clone(&stop), Arc::clone(&peak));
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                peak.fetch_max(threads_named(name), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let executed = rt.block_on(async {
        let tasks: Vec<_> = (0..1_000)
            .map(|i| {
                let guard = guard.clone();
                tokio::spawn(async move {
                    guard
                        .run_async(&key(i), &fp(), |claim| async move {
                            tokio::task::yield_now().await;
                            Ok::<_, Infallible>(Response::new(201, claim.token().to_string()))
                        })
                        .await
                })
            })
            .collect();
        let mut executed = 0;
        for task in tasks {
            assert!(matches!(task.await.unwrap(), Outcome::Executed(_)));
            executed += 1;
        }
        executed
    });
    stop.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    drop(rt);
    assert_eq!(executed, 1_000);
    peak.load(Ordering::SeqCst)
}

/// The case: 1,000 concurrent requests took up to 1,000 of tokio's
/// 512 blocking threads. With the native entry the runtime keeps its two
/// workers (the store adds its one committer thread, not counted here).
#[test]
fn a_thousand_concurrent_runs_need_no_thread_each() {
    let dir = tempfile::tempdir().unwrap();
    let native = peak_threads_for(redb(&dir), "nat-async-rt");
    assert!(native <= 4, "native: {native} runtime threads at peak");
    // The test of the test: through the blocking pool the count grows.
    let dir = tempfile::tempdir().unwrap();
    let blocking = peak_threads_for(BlockingOnly(redb(&dir)), "blk-async-rt");
    assert!(blocking > 8, "blocking pool: {blocking} threads at peak");
    eprintln!("runtime threads at peak: native {native}, blocking pool {blocking}");
}

/// Polls `future` at most `n` times and drops it after the `n`th poll that
/// returned `Pending`: `None` when it was dropped unfinished.
async fn poll_at_most<F: Future>(future: F, n: usize) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut polls = 0;
    std::future::poll_fn(move |cx| {
        if polls == n {
            return Poll::Ready(None);
        }
        polls += 1;
        match future.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(Some(out)),
            Poll::Pending if polls == n => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// The record of `key` once it has settled: a dropped future's claim may be
/// released just after the drop (the release is queued), so PROCESSING is
/// re-read for a while before it counts.
async fn settled(store: &dyn Store, key: &Key) -> Option<Record> {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let record = store.get(key, T0).unwrap();
        let processing = record
            .as_ref()
            .is_some_and(|r| r.state() == State::Processing);
        if !processing || Instant::now() > until {
            return record;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// `run_async` dropped after 0, 1, 2, ... polls until one run completes.
/// After each drop the store holds nothing the policy does not allow:
///
/// - the handler had not started: no claim stays. A `begin` whose group
///   was committing when its future was dropped may have claimed, and its
///   release is queued behind it, so a retry may briefly see InFlight, but
///   the claim goes and a retry then runs;
/// - the handler had started: the claim stays PROCESSING until its lease
///   (a retry gets InFlight), or the response was stored (Replayed).
async fn drop_at_every_await_point<S: Store + 'static>(store: S) -> usize {
    let guard = Guard::builder(store)
        .lease(LEASE)
        .retention(KEEP)
        .clock(idemstore::ManualClock::new(T0))
        .build()
        .unwrap();
    let retry = |k: Key| {
        let guard = guard.clone();
        async move {
            guard
                .run_async(&k, &FP, |_| async {
                    Ok::<_, Infallible>(Response::new(200, "retry"))
                })
                .await
        }
    };
    for n in 0.. {
        let k = key(format!("drop-{n}"));
        let started = Arc::new(AtomicBool::new(false));
        let run = guard.run_async(&k, &FP, |claim| {
            let started = Arc::clone(&started);
            async move {
                started.store(true, Ordering::SeqCst);
                tokio::task::yield_now().await;
                tokio::task::yield_now().await;
                Ok::<_, Infallible>(Response::new(201, claim.token().to_string()))
            }
        });
        if let Some(out) = poll_at_most(run, n).await {
            assert!(matches!(out, Outcome::Executed(_)), "{n}: {out:?}");
            return n;
        }
        if started.load(Ordering::SeqCst) {
            let again = retry(k.clone()).await;
            assert!(
                matches!(again, Outcome::InFlight { .. })
                    || matches!(again, Outcome::Replayed(ref r) if r.status() == 201),
                "{n}: {again:?}"
            );
            continue;
        }
        let record = settled(guard.store().as_ref(), &k).await;
        assert!(record.is_none(), "{n}: a claim nobody saw: {record:?}");
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            match retry(k.clone()).await {
                Outcome::Executed(r) => {
                    assert_eq!(r.body(), b"retry");
                    break;
                }
                Outcome::InFlight { .. } if Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                other => panic!("{n}: {other:?}"),
            }
        }
    }
    unreachable!()
}

#[tokio::test]
async fn memory_dropped_at_every_await_point_leaves_nothing_unseen() {
    let polls = drop_at_every_await_point(MemoryStore::new()).await;
    // begin and complete answer inline: only the handler's two yields wait.
    assert_eq!(polls, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redb_dropped_at_every_await_point_leaves_nothing_unseen() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(redb(&dir));
    let polls = drop_at_every_await_point(Arc::clone(&store)).await;
    // begin and complete each wait for a group, besides the handler.
    assert!(polls >= 3, "{polls}");
    assert!(store.admin().verify(|_| {}).unwrap().is_clean());
}

/// A `begin_async` dropped unpolled, after one poll, or after it was
/// answered but before its answer was read: no claim stays behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_begin_never_leaves_a_claim() {
    let dir = tempfile::tempdir().unwrap();
    let store = redb(&dir);
    for i in 0..60 {
        let k = key(i);
        let mut begun = store.begin_async(&k, &FP, T0, LEASE, KEEP).unwrap();
        match i % 3 {
            0 => {}
            1 => {
                if let Some(answer) = poll_at_most(&mut begun, 1).await {
                    // Committed before its first poll: the caller saw it.
                    let Ok(Begin::Claimed(claim)) = answer else {
                        panic!("{answer:?}")
                    };
                    store.release(&k, &claim).unwrap();
                }
            }
            // Answered (a group takes well under this), not read.
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
        drop(begun);
        assert!(settled(&store, &k).await.is_none(), "{i}");
    }
    assert!(store.admin().verify(|_| {}).unwrap().is_clean());
}

/// The same operations through the blocking calls and the async entry give
/// the same answers, tokens included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_answers_match_the_blocking_calls() {
    let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (sync_store, async_store) = (redb(&dirs.0), redb(&dirs.1));
    let memory = MemoryStore::new();
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut claims: Vec<Option<Claim>> = vec![None; 4];
    for step in 0..300 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let slot = usize::try_from(seed % 4).unwrap();
        let k = key(format!("eq-{slot}"));
        let now = T0 + Duration::from_millis(step * 700);
        let fingerprint = Fingerprint::of([u8::from(seed.is_multiple_of(5))]);
        let lease = Duration::from_secs(2);
        let response = Response::new(200, format!("r{step}"));
        let answers: Vec<String> = match (seed >> 8) % 3 {
            0 => {
                let a = sync_store.begin(&k, &fingerprint, now, lease, KEEP);
                let b = async_store
                    .begin_async(&k, &fingerprint, now, lease, KEEP)
                    .unwrap()
                    .await;
                let c = memory
                    .begin_async(&k, &fingerprint, now, lease, KEEP)
                    .unwrap()
                    .await;
                if let Ok(Begin::Claimed(claim)) = &a {
                    claims[slot] = Some(claim.clone());
                }
                vec![format!("{a:?}"), format!("{b:?}"), format!("{c:?}")]
            }
            1 => match &claims[slot] {
                Some(claim) => {
                    let a = sync_store.complete(&k, claim, &response, now, KEEP);
                    let b = async_store.complete_async(&k, claim, &response, now, KEEP);
                    let c = memory.complete_async(&k, claim, &response, now, KEEP);
                    vec![
                        format!("{a:?}"),
                        format!("{:?}", b.unwrap().await),
                        format!("{:?}", c.unwrap().await),
                    ]
                }
                None => continue,
            },
            _ => match claims[slot].take() {
                Some(claim) => {
                    let a = sync_store.release(&k, &claim);
                    let b = async_store.release_async(&k, &claim).unwrap().await;
                    let c = memory.release_async(&k, &claim).unwrap().await;
                    vec![format!("{a:?}"), format!("{b:?}"), format!("{c:?}")]
                }
                None => continue,
            },
        };
        assert_eq!(answers[0], answers[1], "step {step}: redb sync vs async");
        assert_eq!(answers[0], answers[2], "step {step}: redb vs memory");
    }
}

/// A poisoned store refuses the async entry as it refuses the blocking
/// calls, and the guard fails closed.
#[tokio::test]
async fn a_poisoned_store_refuses_the_async_entry() {
    let disk = CrashBackend::new();
    let log = disk.sibling();
    let store = RedbStore::builder()
        .open_backend(disk.clone(), log.clone())
        .unwrap();
    // A full disk that stays full: the store stays poisoned.
    disk.set_disk_full(true);
    let failed = store
        .begin_async(&key("a"), &fp(), T0, LEASE, KEEP)
        .unwrap()
        .await;
    assert!(failed.is_err());
    assert!(store.is_poisoned());
    let refused = store
        .begin_async(&key("b"), &fp(), T0, LEASE, KEEP)
        .unwrap()
        .await;
    assert!(matches!(refused, Err(Error::Poisoned { .. })));
    let guard = Guard::new(store);
    let out = guard
        .run_async(&key("c"), &fp(), |_| async {
            panic!("fail closed");
            #[allow(unreachable_code)]
            Ok::<_, Infallible>(Response::new(200, ""))
        })
        .await;
    assert!(matches!(out, Outcome::Unavailable(Error::Poisoned { .. })));
}

/// More futures than the line holds (`WRITE_QUEUE_DEPTH`) on one runtime
/// thread: those that find it full wait for room without blocking the
/// thread (the full line itself is pinned by a unit test in
/// `src/redb/native.rs`), and every one is answered once, with its own
/// token.
#[tokio::test]
async fn more_futures_than_the_line_holds_all_complete() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(redb(&dir));
    let n = idemstore::unstable::redb::WRITE_QUEUE_DEPTH + 1_000;
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let k = key(format!("line-{i}"));
                store.begin_async(&k, &fp(), T0, LEASE, KEEP).unwrap().await
            })
        })
        .collect();
    let mut tokens = Vec::with_capacity(n);
    for task in tasks {
        match task.await.unwrap() {
            Ok(Begin::Claimed(claim)) => tokens.push(claim.token()),
            other => panic!("{other:?}"),
        }
    }
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), n);
    // Grouped: far fewer groups than requests.
    assert!(store.stats().groups < n as u64 / 4, "{:?}", store.stats());
}

/// A store dropped while releases of dropped futures are still queued: the
/// drop does not hang, and the releases are committed before it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_store_commits_what_is_queued() {
    let dir = tempfile::tempdir().unwrap();
    let store = redb(&dir);
    let keys: Vec<Key> = (0..200).map(|i| key(format!("close-{i}"))).collect();
    {
        // Queued when made; never polled, so never read.
        let futures: Vec<StoreFuture<'_, Begin>> = keys
            .iter()
            .map(|k| store.begin_async(k, &FP, T0, LEASE, KEEP).unwrap())
            .collect();
        // Some answered, some in a group, some still in line.
        tokio::time::sleep(Duration::from_millis(5)).await;
        drop(futures);
    }
    let started = Instant::now();
    drop(store);
    assert!(started.elapsed() < Duration::from_secs(30));
    let store = redb(&dir);
    for k in &keys {
        assert!(store.get(k, T0).unwrap().is_none(), "{k:?}");
    }
}

/// The HTTP layer's guard holds its store as `Arc<dyn Store>`: the native
/// entry must survive the erasure (and `BlockingOnly` must hide it).
#[test]
fn the_native_entry_survives_arc_dyn_store() {
    let dir = tempfile::tempdir().unwrap();
    let (k, d) = (key("erased"), Duration::from_secs(1));
    let erased: Arc<dyn Store> = Arc::new(redb(&dir));
    assert!(erased.begin_async(&k, &FP, T0, d, d).is_some());
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    assert!(memory.begin_async(&k, &FP, T0, d, d).is_some());
    let hidden: Arc<dyn Store> = Arc::new(BlockingOnly(MemoryStore::new()));
    assert!(hidden.begin_async(&k, &FP, T0, d, d).is_none());
}
