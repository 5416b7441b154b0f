//! The issue-6 bench set, one name scheme for every backend:
//!
//! - `store/{memory,redb,sled}/{claim_new, complete, replay_hit, in_flight, conflict}`
//! - `store/memory/fill_200k` (a store filled from empty, growth included)
//! - `store/guard/{redb,sled}/run_executed`
//! - `store/sweep/redb/{10k,100k}_expired`
//! - `store/codec/{encode,decode}`
//!
//! Every ID starts with `store/`, this file's subject, so its saved
//! baselines never mix with `redb`'s, `sled`'s or `inbox`'s (those files
//! measure other cases under `redb/`, `sled/` and `inbox/`).
//!
//! Every loop asserts its answer, so the optimiser cannot skip the work.
//! Durable benches fsync: their figures are the disk's as much as ours.
//!
//! ```text
//! cargo bench --all-features --bench store                # all
//! cargo bench --all-features --bench store -- store/redb # one group
//! ```
//! The HTML report is in `target/criterion/report/index.html`.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "a bench binary: a panic is a failed run"
)]

use criterion::{BatchSize, Criterion, black_box};
use idemstore::redb::Durability;
use idemstore::{
    Begin, Fingerprint, Guard, Key, MemoryStore, RedbStore, Response, Store, Timestamp,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(24 * 3600);
const NOW: Timestamp = Timestamp::from_millis(1_760_846_400_000);

static NEXT: AtomicU64 = AtomicU64::new(0);

fn fresh_key() -> Key {
    Key::new(
        "bench",
        format!("k{}", NEXT.fetch_add(1, Ordering::Relaxed)),
    )
    .unwrap()
}

fn fp() -> Fingerprint {
    Fingerprint::of(b"sku=A&qty=1")
}

fn response() -> Response {
    Response::new(201, vec![b'r'; 200])
}

fn claim(store: &dyn Store, key: &Key) -> idemstore::Claim {
    match store.begin(key, &fp(), NOW, LEASE, KEEP).unwrap() {
        Begin::Claimed(c) => c,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// The five store operations on one backend.
fn store_ops(c: &mut Criterion, name: &str, store: Arc<dyn Store>, durable: bool) {
    let mut g = c.benchmark_group(format!("store/{name}"));
    if durable {
        g.sample_size(20).measurement_time(Duration::from_secs(4));
    }
    g.bench_function("claim_new", |b| {
        b.iter(|| {
            let key = fresh_key();
            assert!(matches!(
                store.begin(&key, &fp(), NOW, LEASE, KEEP).unwrap(),
                Begin::Claimed(_)
            ));
        })
    });
    g.bench_function("complete", |b| {
        b.iter_batched(
            || {
                let key = fresh_key();
                let c = claim(&*store, &key);
                (key, c)
            },
            |(key, c)| store.complete(&key, &c, &response(), NOW, KEEP).unwrap(),
            BatchSize::SmallInput,
        )
    });
    let done = fresh_key();
    let c = claim(&*store, &done);
    store.complete(&done, &c, &response(), NOW, KEEP).unwrap();
    g.bench_function("replay_hit", |b| {
        b.iter(|| {
            assert!(matches!(
                store
                    .begin(black_box(&done), &fp(), NOW, LEASE, KEEP)
                    .unwrap(),
                Begin::Replay(_)
            ))
        })
    });
    let busy = fresh_key();
    let _held = claim(&*store, &busy);
    g.bench_function("in_flight", |b| {
        b.iter(|| {
            assert!(matches!(
                store
                    .begin(black_box(&busy), &fp(), NOW, LEASE, KEEP)
                    .unwrap(),
                Begin::InFlight { .. }
            ))
        })
    });
    let other = Fingerprint::of(b"sku=B");
    g.bench_function("conflict", |b| {
        b.iter(|| {
            assert_eq!(
                store
                    .begin(black_box(&done), &other, NOW, LEASE, KEEP)
                    .unwrap(),
                Begin::Conflict
            )
        })
    });
    g.finish();
}

fn guard_run(c: &mut Criterion, name: &str, store: Arc<dyn Store>) {
    let guard = Guard::new(store);
    let mut g = c.benchmark_group(format!("store/guard/{name}"));
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    g.bench_function("run_executed", |b| {
        b.iter(|| {
            let out = guard.run(&fresh_key(), &fp(), |claim| {
                Ok::<_, std::convert::Infallible>(Response::new(201, claim.token().to_string()))
            });
            assert!(matches!(out, idemstore::Outcome::Executed(_)));
        })
    });
    g.finish();
}

/// Time to sweep `n` expired records from a redb store. The records are
/// written with relaxed durability (the fill is not what is measured),
/// then the store is reopened with the default durability and swept.
fn sweep_redb(c: &mut Criterion, n: u64, label: &str) {
    let mut g = c.benchmark_group("store/sweep/redb");
    g.sample_size(10);
    g.bench_function(label, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let dir = tempfile::tempdir().unwrap();
                let path = dir.path().join("sweep.idem");
                {
                    let store = Arc::new(
                        RedbStore::builder()
                            .durability(Durability::Periodic {
                                max_loss: Duration::from_secs(60),
                            })
                            .open(&path)
                            .unwrap(),
                    );
                    fill_expiring(&store, n);
                }
                let store = RedbStore::open(&path).unwrap();
                let later = NOW + Duration::from_secs(7200);
                let start = Instant::now();
                let mut swept = 0;
                loop {
                    let k = store
                        .sweep_expired(later, idemstore::limits::MAX_SWEEP_BATCH)
                        .unwrap();
                    swept += k as u64;
                    if k < idemstore::limits::MAX_SWEEP_BATCH {
                        break;
                    }
                }
                total += start.elapsed();
                assert_eq!(swept, n);
            }
            total
        })
    });
    g.finish();
}

/// `n` completed records that expire an hour after `NOW`, from 16 threads.
fn fill_expiring(store: &Arc<RedbStore>, n: u64) {
    let next = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return;
                    }
                    let key = Key::new("sweep", i.to_be_bytes()).unwrap();
                    let hour = Duration::from_secs(3600);
                    let Begin::Claimed(c) = store.begin(&key, &fp(), NOW, LEASE, hour).unwrap()
                    else {
                        panic!()
                    };
                    store.complete(&key, &c, &response(), NOW, hour).unwrap();
                }
            });
        }
    });
}

fn codec(c: &mut Criterion) {
    let record = idemstore::unstable::sample_record(200);
    let bytes = idemstore::unstable::encode_record(&record).unwrap();
    let mut g = c.benchmark_group("store/codec");
    g.bench_function("encode", |b| {
        b.iter(|| {
            assert_eq!(
                idemstore::unstable::encode_record(black_box(&record))
                    .unwrap()
                    .len(),
                bytes.len()
            )
        })
    });
    g.bench_function("decode", |b| {
        b.iter(|| {
            assert_eq!(
                idemstore::unstable::decode_record(b"bench", black_box(&bytes))
                    .unwrap()
                    .token(),
                42
            )
        })
    });
    g.finish();
}

/// A `MemoryStore` filled from empty: `FILL` fresh keys claimed and
/// completed, in a new store each iteration. `claim_new` above grows one
/// store for the whole measurement, so its mean depends on how many
/// iterations criterion picks (a faster store runs more, into a larger
/// table); this bench is the same work at a fixed size, growth included.
fn memory_fill(c: &mut Criterion) {
    const FILL: u64 = 200_000;
    let mut g = c.benchmark_group("store/memory");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(6))
        .throughput(criterion::Throughput::Elements(FILL));
    g.bench_function("fill_200k", |b| {
        b.iter_batched(
            || {
                let keys: Vec<Key> = (0..FILL)
                    .map(|i| Key::new("bench", format!("c{}-{i}", i % 64)).unwrap())
                    .collect();
                (MemoryStore::new(), keys)
            },
            |(store, keys)| {
                let response = response();
                for key in &keys {
                    let claim = claim(&store, key);
                    store.complete(key, &claim, &response, NOW, KEEP).unwrap();
                }
                assert_eq!(store.len() as u64, FILL);
                store
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    codec(&mut c);
    store_ops(&mut c, "memory", Arc::new(MemoryStore::new()), false);
    memory_fill(&mut c);

    let redb_dir = tempfile::tempdir().unwrap();
    let redb: Arc<dyn Store> =
        Arc::new(RedbStore::open(redb_dir.path().join("bench.idem")).unwrap());
    store_ops(&mut c, "redb", Arc::clone(&redb), true);
    guard_run(&mut c, "redb", redb);

    #[cfg(feature = "sled")]
    {
        let sled_dir = tempfile::tempdir().unwrap();
        let sled: Arc<dyn Store> =
            Arc::new(idemstore::SledStore::open(sled_dir.path().join("bench.sled")).unwrap());
        store_ops(&mut c, "sled", Arc::clone(&sled), true);
        guard_run(&mut c, "sled", sled);
    }

    sweep_redb(&mut c, 10_000, "10k_expired");
    sweep_redb(&mut c, 100_000, "100k_expired");
    c.final_summary();
}
