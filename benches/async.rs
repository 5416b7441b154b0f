//! `Guard::run_async` on `RedbStore`, its native async entry against
//! tokio's blocking pool (the path every store without one takes, forced
//! here with `idemstore_testkit::BlockingOnly`):
//!
//! - `async/redb/run_async/{native,blocking_pool}/{64,1024}_tasks`
//!
//! One iteration is a wave of N concurrent `run_async` (a durable claim
//! and a durable completion each, fresh keys) on a 2-worker runtime,
//! started together and awaited; throughput is in elements (cycles). The
//! peak number of the runtime's threads (workers and blocking pool) during
//! the measurement is printed beside each bench.
//!
//! ```text
//! cargo bench --bench async -- --quick
//! ```
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "a bench binary: a panic is a failed run"
)]

use criterion::{Criterion, Throughput};
use idemstore::{Fingerprint, Guard, Key, Outcome, RedbStore, Response, Store};
use idemstore_testkit::BlockingOnly;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static NEXT: AtomicU64 = AtomicU64::new(0);

/// Threads of this process named `prefix*` (the runtime's, by its `thread_name`).
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |tasks| {
        tasks
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| name.starts_with(prefix))
            .count()
    })
}

/// N concurrent guarded cycles, each asserting it executed.
async fn wave<S: Store + 'static>(guard: &Guard<S>, n: usize) {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let guard = guard.clone();
            let key = Key::new(
                "bench",
                format!("k{}", NEXT.fetch_add(1, Ordering::Relaxed)),
            )
            .unwrap();
            tokio::spawn(async move {
                guard
                    .run_async(&key, &Fingerprint::of(b"sku=A"), |claim| async move {
                        Ok::<_, Infallible>(Response::new(201, claim.token().to_string()))
                    })
                    .await
            })
        })
        .collect();
    for task in tasks {
        assert!(matches!(task.await.unwrap(), Outcome::Executed(_)));
    }
}

fn bench_path<S: Store + 'static>(c: &mut Criterion, path: &str, store: S, n: usize) {
    const NAME: &str = "bench-async-rt";
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(NAME)
        .enable_all()
        .build()
        .unwrap();
    let guard = Guard::new(store);
    let (stop, peak) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let sampler = {
        let (stop, peak) = (Arc::clone(&stop), Arc::clone(&peak));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(threads_named(NAME), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let mut group = c.benchmark_group(format!("async/redb/run_async/{path}"));
    group.throughput(Throughput::Elements(n as u64));
    group.sample_size(10);
    group.bench_function(format!("{n}_tasks"), |b| {
        b.iter_custom(|iters| {
            let started = Instant::now();
            for _ in 0..iters {
                rt.block_on(wave(&guard, n));
            }
            started.elapsed()
        });
    });
    group.finish();
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    eprintln!(
        "async/redb/run_async/{path}/{n}_tasks: peak runtime threads {}",
        peak.load(Ordering::Relaxed)
    );
}

fn benches(c: &mut Criterion) {
    for n in [64, 1_024] {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(dir.path().join("native.idem")).unwrap();
        bench_path(c, "native", store, n);
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(dir.path().join("blocking.idem")).unwrap();
        bench_path(c, "blocking_pool", BlockingOnly(store), n);
    }
}

criterion::criterion_group!(group, benches);
criterion::criterion_main!(group);
