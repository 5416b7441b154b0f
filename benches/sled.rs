//! `SledStore` benches (issue 4), all on one disk in one run:
//!
//! - `sled/claim_new`: one client, a durable claim of a fresh key
//!   (sled flush + fdatasync before the answer);
//! - `sled/replay_hit`: a `begin` answered `Replay` (the read fast path);
//! - `sled/claim_new_64_clients`: 64 threads claiming fresh keys, so
//!   concurrent claims share flushes;
//! - `sled/claim_new_os_buffered`: one client at
//!   `SledDurability::OsBuffered` (sled flush, no fdatasync), to show
//!   what the fsync costs.
//!
//! Every ID starts with `sled/`, this file's subject, so its saved
//! baselines never mix with `store`'s, `redb`'s or `inbox`'s.
//!
//! After criterion's report it prints claims/s at 1 and 64 clients, their
//! ratio, and the fsyncs per claim counted by `SledStore::stats`.
//!
//! ```text
//! cargo bench --features sled --bench sled    # IDEMSTORE_BENCH_DIR=/path to pick the disk
//! ```
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "a bench binary: a panic is a failed run"
)]

use criterion::{Criterion, Throughput};
use idemstore::sled::{Durability as SledDurability, SledStats};
use idemstore::{Begin, Fingerprint, Key, Response, SledStore, Store, Timestamp};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

const CLIENTS: usize = 64;
const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(24 * 3600);
const NOW: Timestamp = Timestamp::from_millis(1_760_846_400_000);

/// (bench name, claims, elapsed, stats delta) of every measured batch.
static RUNS: Mutex<Vec<(&'static str, u64, Duration, SledStats)>> = Mutex::new(Vec::new());

fn bench_dir() -> tempfile::TempDir {
    match std::env::var_os("IDEMSTORE_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir).unwrap(),
        None => tempfile::tempdir().unwrap(),
    }
}

fn key(id: u64) -> Key {
    Key::new("bench", format!("order-{id}")).unwrap()
}

fn delta(before: SledStats, after: SledStats) -> SledStats {
    let mut d = after;
    d.commits -= before.commits;
    d.flushes -= before.flushes;
    d.data_fsyncs -= before.data_fsyncs;
    d.blob_fsyncs -= before.blob_fsyncs;
    d.flush_micros -= before.flush_micros;
    d.fsync_micros -= before.fsync_micros;
    d
}

fn record(name: &'static str, claims: u64, elapsed: Duration, stats: SledStats) {
    RUNS.lock().unwrap().push((name, claims, elapsed, stats));
}

/// Claims `iters` fresh keys on `clients` threads; returns the wall time.
fn claim_fresh(store: &SledStore, next: &AtomicU64, clients: usize, iters: u64) -> Duration {
    let fp = Fingerprint::of(b"sku=A&qty=1");
    let barrier = Barrier::new(clients + 1);
    std::thread::scope(|s| {
        for client in 0..clients {
            let barrier = &barrier;
            s.spawn(move || {
                let mine =
                    iters / clients as u64 + u64::from((client as u64) < iters % clients as u64);
                barrier.wait();
                for _ in 0..mine {
                    let k = key(next.fetch_add(1, Ordering::Relaxed));
                    let answer = store.begin(&k, &fp, NOW, LEASE, KEEP).unwrap();
                    assert!(matches!(answer, Begin::Claimed(_)));
                }
            });
        }
        barrier.wait();
        let start = Instant::now();
        // Scoped threads are joined when the scope ends; time until then.
        start
    })
    .elapsed()
}

fn claims(c: &mut Criterion, dir: &Path) {
    let cases: [(&'static str, usize, SledDurability); 3] = [
        ("claim_new", 1, SledDurability::Immediate),
        ("claim_new_64_clients", CLIENTS, SledDurability::Immediate),
        ("claim_new_os_buffered", 1, SledDurability::OsBuffered),
    ];
    let mut group = c.benchmark_group("sled");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Elements(1));
    for (name, clients, durability) in cases {
        let store = SledStore::builder()
            .durability(durability)
            .open(dir.join(name))
            .unwrap();
        let next = AtomicU64::new(0);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let before = store.stats();
                let elapsed = claim_fresh(&store, &next, clients, iters);
                record(name, iters, elapsed, delta(before, store.stats()));
                elapsed
            })
        });
    }
    group.finish();
}

fn replay_hit(c: &mut Criterion, dir: &Path) {
    let store = SledStore::open(dir.join("replay")).unwrap();
    let fp = Fingerprint::of(b"sku=A&qty=1");
    let k = key(1);
    let Begin::Claimed(claim) = store.begin(&k, &fp, NOW, LEASE, KEEP).unwrap() else {
        panic!("fresh store")
    };
    store
        .complete(&k, &claim, &Response::new(200, vec![b'x'; 200]), NOW, KEEP)
        .unwrap();
    let mut group = c.benchmark_group("sled");
    group.throughput(Throughput::Elements(1));
    group.bench_function("replay_hit", |b| {
        b.iter(|| {
            let answer = store.begin(&k, &fp, NOW, LEASE, KEEP).unwrap();
            assert!(matches!(&answer, Begin::Replay(r) if r.body().len() == 200));
            answer
        })
    });
    group.finish();
}

fn summary() {
    let runs = RUNS.lock().unwrap();
    let rate = |name: &str| {
        let mut sum = SledStats::default();
        let (mut n, mut t) = (0u64, Duration::ZERO);
        for (_, claims, elapsed, stats) in runs.iter().filter(|r| r.0 == name) {
            n += claims;
            t += *elapsed;
            sum.commits += stats.commits;
            sum.flushes += stats.flushes;
            sum.data_fsyncs += stats.data_fsyncs;
            sum.flush_micros += stats.flush_micros;
            sum.fsync_micros += stats.fsync_micros;
        }
        let per_sec = n as f64 / t.as_secs_f64().max(1e-9);
        let rounds = sum.flushes.max(1) as f64;
        println!(
            "{name:>22}: {per_sec:>7.0} claims/s; {} commits, {} flush rounds ({:.1} commits/round), {} data fsyncs ({:.3}/claim); per round: sled flush {:.0} us, fsyncs {:.0} us",
            sum.commits,
            sum.flushes,
            sum.commits as f64 / rounds,
            sum.data_fsyncs,
            sum.data_fsyncs as f64 / sum.commits.max(1) as f64,
            sum.flush_micros as f64 / rounds,
            sum.fsync_micros as f64 / rounds,
        );
        per_sec
    };
    println!("\nsled summary (all measured batches):");
    let one = rate("claim_new");
    let many = rate("claim_new_64_clients");
    let _ = rate("claim_new_os_buffered");
    println!("{CLIENTS} clients vs 1: {:.1}x claims/s", many / one);
}

fn main() {
    let dir = bench_dir();
    let mut c = Criterion::default().configure_from_args();
    claims(&mut c, dir.path());
    replay_hit(&mut c, dir.path());
    c.final_summary();
    summary();
}
