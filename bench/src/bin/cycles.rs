//! A fixed number of cycles on `RedbStore` from one thread (a claim and a
//! completion of a fresh key, 201 with a header and a 50-byte body; every
//! tenth key begun again, a replay), so that an instruction count tells two
//! builds apart where wall time is noise:
//!
//! ```text
//! cargo build --release -p idemstore-bench --bin cycles
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out target/release/cycles 2000
//! ```
//!
//! One thread makes every group one request, so each run commits the same
//! groups. The count is the whole process's (open, threads, the checkpoint
//! at drop), and checkpoints follow the clock, so counts move a little
//! between runs of one build: take the median of three (docs/performance.md,
//! "Copies out of the commit path").

use idemstore::{Begin, Clock, Fingerprint, Key, RedbStore, Response, Store, SystemClock};
use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let count: u64 = std::env::args().nth(1).map_or(Ok(2_000), |c| c.parse())?;
    let dir = tempfile::tempdir()?;
    let store = RedbStore::open(dir.path().join("cycles.idem"))?;
    let ttl = Duration::from_secs(60);
    let response =
        Response::new(201, vec![b'x'; 50]).with_header("content-type", "application/json");
    for i in 0..count {
        let key = Key::new("cycles", format!("k{i}"))?;
        let fingerprint = Fingerprint::of(i.to_be_bytes());
        let now = SystemClock.now();
        let Begin::Claimed(claim) = store.begin(&key, &fingerprint, now, ttl, ttl)? else {
            return Err(format!("{key} was not fresh").into());
        };
        store.complete(&key, &claim, &response, now, ttl)?;
        if i % 10 == 0 {
            let Begin::Replay(_) = store.begin(&key, &fingerprint, now, ttl, ttl)? else {
                return Err(format!("{key} was not replayed").into());
            };
        }
    }
    Ok(())
}
