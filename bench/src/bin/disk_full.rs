//! The disk-full run: a `RedbStore` on a small filesystem, claim + complete
//! cycles with 2 KiB responses until the disk is full, then what an
//! operator sees and what the store does.
//!
//! ```text
//! scripts/disk-full-run            # mounts a 24 MiB tmpfs (root), runs this, unmounts
//! cargo run --release -p idemstore-bench --bin disk_full -- DIR [--response-bytes N]
//! ```
//!
//! DIR must be on a small filesystem of its own. Two ballast files are
//! written first; the run frees the first to let the store heal and the
//! second before the final reopen. It reports: the first error a caller
//! got, the process's CPU over 3 idle seconds after the failure, the time
//! from freeing space to the first successful write, the drop's time while
//! the disk is full again, and the acknowledged completions a reopen finds
//! (it exits 1 when one is missing or a bound is missed).

use idemstore::redb::Health;
use idemstore::{Begin, Fingerprint, Key, RedbStore, Response, Store, Timestamp};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(24 * 3600);
const BALLAST_BYTES: usize = 3 << 20;

/// This process's CPU time (user + system) so far.
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat
        .rfind(')')
        .and_then(|i| stat.get(i + 2..))
        .unwrap_or("");
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Duration::from_millis(10 * (ticks(11) + ticks(12)))
}

fn ballast(dir: &Path, n: u32) -> PathBuf {
    let path = dir.join(format!("ballast-{n}"));
    std::fs::write(&path, vec![0xA5u8; BALLAST_BYTES]).expect("the ballast fits");
    path
}

/// Writes a file in `dir` until the filesystem is full.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut file = std::fs::File::create(&path).expect("create the filler");
    let chunk = vec![0x5Au8; 64 << 10];
    while file
        .write_all(&chunk)
        .and_then(|()| file.sync_data())
        .is_ok()
    {}
    path
}

/// One claim + complete; `Ok(true)` when both were acknowledged.
fn cycle(store: &RedbStore, i: u64, body: &[u8], now: Timestamp) -> idemstore::Result<bool> {
    let key = Key::new("disk-full", format!("k{i}"))?;
    let fp = Fingerprint::of(&i.to_be_bytes());
    match store.begin(&key, &fp, now, LEASE, KEEP)? {
        Begin::Claimed(claim) => {
            store.complete(&key, &claim, &Response::new(201, body.to_vec()), now, KEEP)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .expect("usage: disk_full DIR [--response-bytes N]"),
    );
    let mut response_bytes = 2048;
    while let Some(arg) = args.next() {
        if arg == "--response-bytes" {
            response_bytes = args.next().and_then(|n| n.parse().ok()).expect("a number");
        }
    }
    let body = vec![b'r'; response_bytes];
    let first = ballast(&dir, 1);
    let second = ballast(&dir, 2);
    let path = dir.join("s.idem");
    let store = RedbStore::open(&path).expect("open");
    let now = Timestamp::from_millis(1_700_000_000_000);
    let mut acked = Vec::new();
    let mut i = 0u64;
    let error = loop {
        match cycle(&store, i, &body, now) {
            Ok(true) => acked.push(i),
            Ok(false) => {}
            Err(e) => break e,
        }
        i += 1;
    };
    println!(
        "acknowledged before the failure: {} completions",
        acked.len()
    );
    println!("first error: {error}");
    println!("  io kind: {:?}", error.io_kind());
    let later = cycle(&store, u64::MAX, &body, now).expect_err("refused while full");
    println!("a later write: {later}");
    println!("health: {:?}", store.health().name());
    // A replay still answers.
    let replayed = acked.first().map(|&k| {
        let key = Key::new("disk-full", format!("k{k}")).unwrap_or_else(|e| panic!("{e}"));
        store.begin(&key, &Fingerprint::of(&k.to_be_bytes()), now, LEASE, KEEP)
    });
    println!(
        "a replay while full: {:?}",
        replayed.map(|r| r.map(|b| matches!(b, Begin::Replay(_))))
    );
    std::thread::sleep(Duration::from_millis(200));
    let cpu = process_cpu();
    let idle = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    let idle_cpu = process_cpu().saturating_sub(cpu).as_secs_f64() / idle.elapsed().as_secs_f64();
    println!(
        "idle CPU after the failure: {:.1}% of a core",
        idle_cpu * 100.0
    );

    std::fs::remove_file(&first).expect("free space");
    let freed = Instant::now();
    let mut healed_in = None;
    while freed.elapsed() < Duration::from_secs(10) {
        if matches!(store.health(), Health::Healthy) {
            match cycle(&store, i, &body, now) {
                Ok(true) => {
                    acked.push(i);
                    healed_in = Some(freed.elapsed());
                    break;
                }
                Ok(false) => {}
                Err(_) => {}
            }
            i += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    println!("space freed → first successful write: {healed_in:?}");
    // A hundred more, then the disk is filled by another file and the
    // store dropped while it is full (its closing commit fails).
    let mut more = 0;
    while more < 100 {
        if let Ok(true) = cycle(&store, i, &body, now) {
            acked.push(i);
            more += 1;
        }
        i += 1;
    }
    let filler = fill(&dir);
    let dropping = Instant::now();
    drop(store);
    let drop_took = dropping.elapsed();
    println!("drop while full: {drop_took:?}");
    std::fs::remove_file(&filler).expect("free space");
    std::fs::remove_file(&second).expect("free space");
    let store = RedbStore::open(&path).expect("reopen after freeing space");
    let lost = acked
        .iter()
        .filter(|&&k| {
            let key = Key::new("disk-full", format!("k{k}")).unwrap_or_else(|e| panic!("{e}"));
            !matches!(store.get(&key, now), Ok(Some(r)) if r.response().is_some_and(|r| r.body() == body.as_slice()))
        })
        .count();
    println!(
        "acknowledged completions lost after a reopen: {lost} of {}",
        acked.len()
    );
    let ok = error.io_kind() == Some(std::io::ErrorKind::StorageFull)
        && idle_cpu < 0.05
        && healed_in.is_some_and(|d| d < Duration::from_secs(2))
        && drop_took < Duration::from_secs(1)
        && lost == 0;
    println!("{}", if ok { "PASS" } else { "FAIL" });
    std::process::exit(if ok { 0 } else { 1 });
}
