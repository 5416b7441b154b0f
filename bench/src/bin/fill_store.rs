//! Fills a store file with synthetic records through the library, for
//! trying the `idemstore` CLI on a large store:
//!
//! ```text
//! cargo run --release -p idemstore-bench --bin fill_store -- /tmp/big.idem 1000000
//! ```
//!
//! Of every 10 keys: 7 are DONE and live, 1 is PROCESSING with a live lease,
//! 1 is PROCESSING whose lease has passed (a dead owner), and 1 is DONE but
//! already expired (waiting for a sweep). 64 threads write at once, so the
//! group-commit writer batches them. Scopes are `tenant-0` .. `tenant-99`.

use idemstore::{
    Begin, Clock, Fingerprint, Key, RedbStore, Response, Store, SystemClock, Timestamp,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const THREADS: u64 = 64;
const LEASE: Duration = Duration::from_secs(3600);
const RETENTION: Duration = Duration::from_secs(24 * 3600);
const SHORT: Duration = Duration::from_secs(3600);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: fill_store PATH [COUNT]")?;
    let count: u64 = args.next().map_or(Ok(1_000_000), |c| c.parse())?;
    let store = Arc::new(RedbStore::open(&path)?);
    let now = SystemClock.now();
    let two_hours_ago = Timestamp::from_millis(now.as_millis() - 2 * 3600 * 1000);
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..THREADS)
        .map(|_| {
            let (store, next) = (Arc::clone(&store), Arc::clone(&next));
            std::thread::spawn(move || -> idemstore::Result<()> {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        return Ok(());
                    }
                    let key = Key::new(format!("tenant-{}", i % 100), format!("order-{i:08}"))?;
                    let fp = Fingerprint::of(i.to_be_bytes());
                    let body = format!(
                        "{{\"order\":{i},\"status\":\"charged\",\"amount_cents\":{}}}",
                        i % 10_000
                    );
                    let response =
                        Response::new(201, body).with_header("content-type", "application/json");
                    match i % 10 {
                        // Claimed two hours ago with a one-hour retention: expired.
                        9 => {
                            let c = claimed(store.begin(&key, &fp, two_hours_ago, LEASE, SHORT)?);
                            store.complete(&key, &c, &response, two_hours_ago, SHORT)?;
                        }
                        // A dead owner: claimed two hours ago, its one-hour lease passed.
                        8 => {
                            let _ = store.begin(&key, &fp, two_hours_ago, LEASE, RETENTION)?;
                        }
                        7 => {
                            let _ = store.begin(&key, &fp, now, LEASE, RETENTION)?;
                        }
                        _ => {
                            let c = claimed(store.begin(&key, &fp, now, LEASE, RETENTION)?);
                            store.complete(&key, &c, &response, now, RETENTION)?;
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().map_err(|_| "worker panicked")??;
    }
    let elapsed = started.elapsed();
    let stats = store.stats();
    println!(
        "{count} keys in {:.1}s ({:.0} keys/s), {} commits, mean batch {:.1}",
        elapsed.as_secs_f64(),
        count as f64 / elapsed.as_secs_f64(),
        stats.commits,
        stats.mean_group()
    );
    Ok(())
}

fn claimed(begin: Begin) -> idemstore::Claim {
    match begin {
        Begin::Claimed(c) => c,
        other => panic!("a fresh key was not claimed: {other:?}"),
    }
}
