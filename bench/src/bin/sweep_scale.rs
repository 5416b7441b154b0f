//! Sweep and compaction at scale: fills a `RedbStore` with `EXPIRED`
//! records that expire in an hour and `LIVE` records that live a day,
//! then (with the default durability) sweeps everything due, compacts, and
//! reports time, rate and file sizes.
//!
//! ```text
//! cargo run --release -p idemstore-bench --bin sweep_scale -- 1000000 100000   # expired, live
//! ```
//! The fill uses relaxed durability (it is set-up, not the measurement).

use idemstore::limits::MAX_SWEEP_BATCH;
use idemstore::redb::Durability;
use idemstore::{Begin, Fingerprint, Key, RedbStore, Response, Store, Timestamp};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const NOW: Timestamp = Timestamp::from_millis(1_760_846_400_000);

fn fill(
    store: &RedbStore,
    prefix: &str,
    n: u64,
    retention: Duration,
) -> Result<(), idemstore::Error> {
    let next = AtomicU64::new(0);
    let response = Response::new(200, vec![b'r'; 200]);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..16)
            .map(|_| {
                s.spawn(|| -> Result<(), idemstore::Error> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            return Ok(());
                        }
                        let key = Key::new(prefix, i.to_be_bytes())?;
                        let fp = Fingerprint::of(i.to_be_bytes());
                        let lease = Duration::from_secs(30);
                        if let Begin::Claimed(c) = store.begin(&key, &fp, NOW, lease, retention)? {
                            store.complete(&key, &c, &response, NOW, retention)?;
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().unwrap_or_else(|_| Err(idemstore::Error::Closed)))
    })
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1048576.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let expired: u64 = args.next().map_or(Ok(1_000_000), |a| a.parse())?;
    let live: u64 = args.next().map_or(Ok(100_000), |a| a.parse())?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("sweep.idem");
    let t = Instant::now();
    {
        let relaxed = Durability::Periodic {
            max_loss: Duration::from_secs(60),
        };
        let store = RedbStore::builder().durability(relaxed).open(&path)?;
        fill(&store, "expiring", expired, Duration::from_secs(3600))?;
        fill(&store, "live", live, Duration::from_secs(24 * 3600))?;
    }
    let filled = std::fs::metadata(&path)?.len();
    println!(
        "filled {expired} expiring + {live} live records in {:.1?}: file {:.1} MiB",
        t.elapsed(),
        mib(filled)
    );

    let store = RedbStore::open(&path)?;
    let later = NOW + Duration::from_secs(7200);
    let t = Instant::now();
    let mut swept = 0u64;
    let mut calls = 0u64;
    loop {
        let n = store.sweep_expired(later, MAX_SWEEP_BATCH)?;
        swept += n as u64;
        calls += 1;
        if n < MAX_SWEEP_BATCH {
            break;
        }
    }
    let sweep_time = t.elapsed();
    let after_sweep = std::fs::metadata(&path)?.len();
    println!(
        "swept {swept} in {sweep_time:.2?} ({calls} calls of {MAX_SWEEP_BATCH}): {:.0} records/s, {:.2} µs per record; file {:.1} MiB",
        swept as f64 / sweep_time.as_secs_f64(),
        sweep_time.as_secs_f64() * 1e6 / swept.max(1) as f64,
        mib(after_sweep)
    );
    assert_eq!(swept, expired, "every expired record swept, no live one");
    let t = Instant::now();
    store.compact()?;
    let after_compact = std::fs::metadata(&path)?.len();
    println!(
        "compacted in {:.2?}: file {:.1} MiB",
        t.elapsed(),
        mib(after_compact)
    );

    // The live data, as a fresh store holding only the live records.
    let fresh_path = dir.path().join("fresh.idem");
    {
        let relaxed = Durability::Periodic {
            max_loss: Duration::from_secs(60),
        };
        let fresh = RedbStore::builder().durability(relaxed).open(&fresh_path)?;
        fill(&fresh, "live", live, Duration::from_secs(24 * 3600))?;
        fresh.compact()?;
    }
    let fresh = std::fs::metadata(&fresh_path)?.len();
    println!(
        "a fresh compacted store with only the {live} live records: {:.1} MiB (compacted file is {:.2}× that)",
        mib(fresh),
        after_compact as f64 / fresh as f64
    );
    let live_visible = (0..live.min(1000)).all(|i| {
        let key = Key::new("live", i.to_be_bytes()).expect("valid");
        matches!(store.get(&key, later), Ok(Some(_)))
    });
    assert!(live_visible, "live records survive sweep and compaction");
    Ok(())
}
