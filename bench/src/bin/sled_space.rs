//! How much disk a `SledStore` gives back after 90% of its records are
//! deleted (sled has no explicit compaction; its background segment cleaner
//! rewrites the live pages of mostly-empty segments and reuses them).
//!
//! Fills a store with N completed records from 64 clients (durable, the
//! default), sweeps 90% of them away, and prints the directory's size and
//! sled's own count at each step, then refills to see whether freed space is
//! reused.
//!
//! ```text
//! cargo run --release -p idemstore-bench --features sled --bin sled_space -- [records, default 20000]
//! IDEMSTORE_BENCH_DIR=/path picks the disk.
//! ```
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "a measurement tool: a panic is a failed run"
)]

use idemstore::{Begin, Fingerprint, Key, Response, SledStore, Store, Timestamp};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CLIENTS: u64 = 64;
const BODY_BYTES: usize = 512;
const LEASE: Duration = Duration::from_secs(30);
const SHORT: Duration = Duration::from_secs(3600);
const LONG: Duration = Duration::from_secs(48 * 3600);
const T0: Timestamp = Timestamp::from_millis(1_760_846_400_000);

/// (apparent bytes, allocated bytes) of every file under `dir`.
fn dir_size(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut total = (0, 0);
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = entry.metadata().unwrap();
        if meta.is_dir() {
            let (a, b) = dir_size(&entry.path());
            total = (total.0 + a, total.1 + b);
        } else {
            total = (total.0 + meta.len(), total.1 + meta.blocks() * 512);
        }
    }
    total
}

fn report(step: &str, dir: &Path, store: Option<&SledStore>) {
    let (apparent, allocated) = dir_size(dir);
    let sled = store.map_or(String::from("-"), |s| {
        format!("{:.1}", s.size_on_disk().unwrap() as f64 / 1e6)
    });
    println!(
        "{step:<44} files {:>8.1} MB  allocated {:>8.1} MB  sled size_on_disk {:>7} MB",
        apparent as f64 / 1e6,
        allocated as f64 / 1e6,
        sled
    );
}

/// Claims and completes `n` keys from `first` on, every tenth kept for
/// LONG and the rest for SHORT.
fn fill(store: &SledStore, first: u64, n: u64) {
    let next = AtomicU64::new(first);
    let body = vec![b'r'; BODY_BYTES];
    std::thread::scope(|s| {
        for _ in 0..CLIENTS {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= first + n {
                        return;
                    }
                    let key = Key::new("space", format!("order-{i:08}")).unwrap();
                    let fp = Fingerprint::of(i.to_be_bytes());
                    let keep = if i.is_multiple_of(10) { LONG } else { SHORT };
                    let Begin::Claimed(c) = store.begin(&key, &fp, T0, LEASE, keep).unwrap() else {
                        panic!("fresh key")
                    };
                    store
                        .complete(&key, &c, &Response::new(200, body.clone()), T0, keep)
                        .unwrap();
                }
            });
        }
    });
}

fn sweep_all(store: &SledStore, now: Timestamp) -> usize {
    let mut total = 0;
    loop {
        let n = store.sweep_expired(now, 10_000).unwrap();
        total += n;
        if n < 10_000 {
            return total;
        }
    }
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .map_or(20_000, |a| a.parse().expect("a record count"));
    let base = match std::env::var_os("IDEMSTORE_BENCH_DIR") {
        Some(d) => tempfile::tempdir_in(d).unwrap(),
        None => tempfile::tempdir().unwrap(),
    };
    let dir = base.path().join("space.sled");
    let store = SledStore::open(&dir).unwrap();
    println!("{n} records, {BODY_BYTES}-byte responses, {CLIENTS} clients, durable (default)");
    report("empty", &dir, Some(&store));
    let t = Instant::now();
    fill(&store, 0, n);
    let fill_secs = t.elapsed().as_secs_f64();
    report("after fill", &dir, Some(&store));
    let swept = sweep_all(&store, T0 + 2 * SHORT);
    report(&format!("after sweeping {swept} (90%)"), &dir, Some(&store));
    std::thread::sleep(Duration::from_secs(5));
    report("5 s later (sled's cleaner ran)", &dir, Some(&store));
    drop(store);
    report("closed", &dir, None);
    let store = SledStore::open(&dir).unwrap();
    report("reopened", &dir, Some(&store));
    fill(&store, n, n / 10 * 9);
    report("refilled with as many new records", &dir, Some(&store));
    let s = store.stats();
    println!(
        "fill: {:.0} records/s; since reopen: {} commits, {} data fsyncs",
        n as f64 / fill_secs,
        s.commits,
        s.data_fsyncs
    );
}
