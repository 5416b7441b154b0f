//! `RedbStore` benches (issue 3 "Speed"), all on one disk in one run:
//!
//! - `redb/claim_new`: one client, a durable claim of a fresh key;
//! - `redb/replay_hit`: a `begin` answered `Replay` (the read fast path);
//! - `redb/group_commit/store_claim_new/64_clients` vs
//!   `redb/group_commit/raw_txn_per_claim/64_clients`: group commit against
//!   one redb write transaction per claim, 64 threads;
//! - `redb/probe/append_fdatasync_256`: the disk's floor, a 256-byte append + fdatasync.
//!
//! Every ID starts with `redb/`, this file's subject, so its saved
//! baselines never mix with `store`'s, `sled`'s or `inbox`'s.
//!
//! After criterion's report it prints the medians and the ratios the issue
//! sets targets for, plus per-operation p50s measured here.
//!
//! ```text
//! cargo bench --bench redb    # IDEMSTORE_BENCH_DIR=/path to pick the disk
//! ```
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "a bench binary: a panic is a failed run"
)]

use criterion::{BenchmarkId, Criterion, Throughput};
use idemstore::redb::engine::{
    ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};
use idemstore::{Begin, Fingerprint, Key, RedbStore, Response, Store, Timestamp};
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

const CLIENTS: usize = 64;
const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(24 * 3600);
const NOW: Timestamp = Timestamp::from_millis(1_760_846_400_000);

/// Per-operation latencies (ns) recorded by the one-client benches.
static LATENCIES: Mutex<Vec<(&'static str, Vec<u64>)>> = Mutex::new(Vec::new());

fn record_latency(name: &'static str, ns: Vec<u64>) {
    let mut all = LATENCIES.lock().unwrap();
    match all.iter_mut().find(|(n, _)| *n == name) {
        Some((_, v)) => v.extend(ns),
        None => all.push((name, ns)),
    }
}

fn bench_dir() -> tempfile::TempDir {
    match std::env::var_os("IDEMSTORE_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir).unwrap(),
        None => tempfile::tempdir().unwrap(),
    }
}

fn key(id: u64) -> Key {
    Key::new("bench", format!("order-{id}")).unwrap()
}

/// A 256-byte append + fdatasync on `file`; returns its latency in ns.
fn probe_op(file: &mut File) -> u64 {
    let record = [0x42u8; 256];
    let t = Instant::now();
    file.write_all(&record).unwrap();
    file.sync_data().unwrap();
    t.elapsed().as_nanos() as u64
}

fn probe_file(path: &Path) -> File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap()
}

fn claim_new(c: &mut Criterion, dir: &Path) {
    let store = RedbStore::open(dir.join("claim_new.idem")).unwrap();
    // The disk's latency drifts when other work shares it, so the floor is
    // also measured interleaved with the claims: one probe after each claim,
    // outside the timed part, giving two p50s taken in the same conditions.
    let mut probe = probe_file(&dir.join("interleaved-probe.log"));
    let next = AtomicU64::new(0);
    let fp = Fingerprint::of(b"sku=A&qty=1");
    let mut group = c.benchmark_group("redb");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Elements(1));
    group.bench_function("claim_new", |b| {
        b.iter_custom(|iters| {
            let mut claims = Vec::with_capacity(iters as usize);
            let mut probes = Vec::with_capacity(iters as usize);
            let mut elapsed = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                let k = key(next.fetch_add(1, Ordering::Relaxed));
                let answer = store.begin(&k, &fp, NOW, LEASE, KEEP).unwrap();
                assert!(matches!(answer, Begin::Claimed(_)));
                let took = t.elapsed();
                elapsed += took;
                claims.push(took.as_nanos() as u64);
                probes.push(probe_op(&mut probe));
            }
            record_latency("redb/claim_new", claims);
            record_latency("probe interleaved with claim_new", probes);
            elapsed
        })
    });
    group.finish();
}

fn replay_hit(c: &mut Criterion, dir: &Path) {
    let store = RedbStore::open(dir.join("replay.idem")).unwrap();
    let fp = Fingerprint::of(b"sku=A&qty=1");
    let k = key(1);
    let Begin::Claimed(claim) = store.begin(&k, &fp, NOW, LEASE, KEEP).unwrap() else {
        panic!("fresh store")
    };
    let body = vec![b'x'; 200];
    store
        .complete(&k, &claim, &Response::new(200, body), NOW, KEEP)
        .unwrap();
    let mut group = c.benchmark_group("redb");
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

/// A replay of a record already checkpointed into the store file (a
/// lookup in the read path's kept redb snapshot): 10,000 completed keys,
/// replayed in turn.
fn replay_checkpointed(c: &mut Criterion, dir: &Path) {
    const KEYS: u64 = 10_000;
    let store = RedbStore::builder()
        .checkpoint_interval(Duration::from_millis(10))
        .open(dir.join("replay-checkpointed.idem"))
        .unwrap();
    let fp = Fingerprint::of(b"sku=A&qty=1");
    for id in 0..KEYS {
        let Begin::Claimed(claim) = store.begin(&key(id), &fp, NOW, LEASE, KEEP).unwrap() else {
            panic!("fresh store")
        };
        let response = Response::new(200, vec![b'x'; 200]);
        store
            .complete(&key(id), &claim, &response, NOW, KEEP)
            .unwrap();
    }
    // Until the checkpointer has been idle for a while: every record is in
    // the store file.
    let mut seen = store.stats().checkpoints;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = store.stats().checkpoints;
        if now == seen {
            break;
        }
        seen = now;
    }
    let mut group = c.benchmark_group("redb");
    group.throughput(Throughput::Elements(1));
    let mut next = 0;
    group.bench_function("replay_checkpointed", |b| {
        b.iter(|| {
            next = (next + 1) % KEYS;
            let answer = store.begin(&key(next), &fp, NOW, LEASE, KEEP).unwrap();
            assert!(matches!(&answer, Begin::Replay(r) if r.body().len() == 200));
            answer
        })
    });
    group.finish();
}

/// Runs `op(client, i)` `iters` times in all, spread over `CLIENTS` threads.
fn on_clients(iters: u64, op: impl Fn(usize, u64) + Sync) -> Duration {
    let barrier = Barrier::new(CLIENTS + 1);
    std::thread::scope(|s| {
        for client in 0..CLIENTS {
            let (op, barrier) = (&op, &barrier);
            s.spawn(move || {
                barrier.wait();
                let mine =
                    iters / CLIENTS as u64 + u64::from((client as u64) < iters % CLIENTS as u64);
                for i in 0..mine {
                    op(client, i);
                }
            });
        }
        barrier.wait();
        let start = Instant::now();
        // The scope joins every client before returning.
        start
    })
    .elapsed()
}

const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("records");
const EXPIRY: TableDefinition<&[u8], ()> = TableDefinition::new("expiry");

fn group_commit_vs_raw(c: &mut Criterion, dir: &Path) {
    let mut group = c.benchmark_group("redb/group_commit");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(8))
        .warm_up_time(Duration::from_secs(1));
    group.throughput(Throughput::Elements(1));

    let store = Arc::new(RedbStore::open(dir.join("group.idem")).unwrap());
    let next = AtomicU64::new(0);
    let fp = Fingerprint::of(b"sku=A&qty=1");
    group.bench_function(BenchmarkId::new("store_claim_new", "64_clients"), |b| {
        b.iter_custom(|iters| {
            on_clients(iters, |_, _| {
                let k = key(next.fetch_add(1, Ordering::Relaxed));
                let answer = store.begin(&k, &fp, NOW, LEASE, KEEP).unwrap();
                assert!(matches!(answer, Begin::Claimed(_)));
            })
        })
    });
    let stats = store.stats();
    eprintln!(
        "group commit: {} requests in {} batches (mean {:.1}, largest {}), {} commits",
        stats.requests,
        stats.groups,
        stats.mean_group(),
        stats.largest_group,
        stats.commits
    );
    drop(store);

    // The same claim, the way one would write it on redb without group
    // commit: read, write record + index entry, one durable commit each.
    let db = idemstore::redb::engine::Database::create(dir.join("raw.redb")).unwrap();
    let txn = db.begin_write().unwrap();
    txn.open_table(RECORDS).unwrap();
    txn.open_table(EXPIRY).unwrap();
    txn.commit().unwrap();
    let value = vec![7u8; 80];
    let before = next.load(Ordering::Relaxed);
    group.bench_function(BenchmarkId::new("raw_txn_per_claim", "64_clients"), |b| {
        b.iter_custom(|iters| {
            on_clients(iters, |_, _| {
                let id = next.fetch_add(1, Ordering::Relaxed);
                let k = format!("\x05benchorder-{id}").into_bytes();
                let txn = db.begin_write().unwrap();
                {
                    let mut records = txn.open_table(RECORDS).unwrap();
                    assert!(records.get(k.as_slice()).unwrap().is_none());
                    records.insert(k.as_slice(), value.as_slice()).unwrap();
                    let mut index_key = 1_760_846_400_000u64.to_be_bytes().to_vec();
                    index_key.extend_from_slice(&k);
                    txn.open_table(EXPIRY)
                        .unwrap()
                        .insert(index_key.as_slice(), ())
                        .unwrap();
                }
                txn.commit().unwrap();
            })
        })
    });
    // Checks the raw path wrote what it claimed (unless a filter skipped it).
    let ran = next.load(Ordering::Relaxed) > before;
    let read = db.begin_read().unwrap();
    assert!(!ran || read.open_table(RECORDS).unwrap().len().unwrap() > 0);
    group.finish();
}

fn append_fdatasync(c: &mut Criterion, dir: &Path) {
    let mut file = probe_file(&dir.join("probe.log"));
    let mut group = c.benchmark_group("redb/probe");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Elements(1));
    group.bench_function("append_fdatasync_256", |b| {
        b.iter_custom(|iters| {
            let mut lat = Vec::with_capacity(iters as usize);
            for _ in 0..iters {
                lat.push(probe_op(&mut file));
            }
            let elapsed = Duration::from_nanos(lat.iter().sum());
            record_latency("redb/probe/append_fdatasync_256", lat);
            elapsed
        })
    });
    group.finish();
}

/// criterion's median (ns per operation) for a bench id, from its report.
fn criterion_median(id: &str) -> Option<f64> {
    // Where criterion writes: CRITERION_HOME, else the target directory's
    // `criterion/` (the workspace's target, one level above this package).
    let home = std::env::var_os("CRITERION_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
                .join("criterion")
        });
    // criterion's directories: the group and bench names with '/' as '_'.
    let path = home.join(id).join("new/estimates.json");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    json["median"]["point_estimate"].as_f64()
}

fn p50(v: &mut [u64]) -> f64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0) as f64
}

fn summary() {
    let m = |id: &str| criterion_median(id);
    let mut out: HashMap<&str, f64> = HashMap::new();
    println!("\n== same-run summary (criterion medians, ns/op) ==");
    for (label, id) in [
        ("claim_new 1 client", "redb/claim_new"),
        ("replay_hit", "redb/replay_hit"),
        (
            "group commit 64",
            "redb_group_commit/store_claim_new/64_clients",
        ),
        (
            "raw txn/claim 64",
            "redb_group_commit/raw_txn_per_claim/64_clients",
        ),
        ("append+fdatasync", "redb_probe/append_fdatasync_256"),
    ] {
        if let Some(ns) = m(id) {
            println!("{label:>22}: {ns:>12.0} ns/op  {:>10.0} op/s", 1e9 / ns);
            out.insert(label, ns);
        }
    }
    if let (Some(g), Some(r)) = (out.get("group commit 64"), out.get("raw txn/claim 64")) {
        println!(
            "group commit / raw redb at 64 clients: {:.1}x (target >= 8x)",
            r / g
        );
    }
    if let Some(r) = out.get("replay_hit") {
        println!(
            "replay: {:.0}/s on one thread (target >= 300000/s)",
            1e9 / r
        );
    }
    let mut lat = LATENCIES.lock().unwrap();
    let mut p = HashMap::new();
    for (name, v) in lat.iter_mut() {
        let v50 = p50(v);
        println!("{name:>30}: p50 {:.1} us over {} ops", v50 / 1e3, v.len());
        p.insert(*name, v50);
    }
    if let (Some(cl), Some(pr)) = (
        p.get("redb/claim_new"),
        p.get("probe interleaved with claim_new"),
    ) {
        println!(
            "1-client claim p50 / interleaved append+fdatasync p50: {:.2}x (target <= 1.5x)",
            cl / pr
        );
    }
}

fn main() {
    let dir = bench_dir();
    let mut c = Criterion::default().configure_from_args();
    append_fdatasync(&mut c, dir.path());
    claim_new(&mut c, dir.path());
    replay_hit(&mut c, dir.path());
    replay_checkpointed(&mut c, dir.path());
    group_commit_vs_raw(&mut c, dir.path());
    c.final_summary();
    summary();
}
