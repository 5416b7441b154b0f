//! A fixed number of cycles from one thread, so that an instruction count
//! tells two builds apart where wall time is noise:
//!
//! - `cycles N`: on `RedbStore`, a claim and a completion of a fresh key,
//!   201 with a header and a 50-byte body; every tenth key begun again, a
//!   replay;
//! - `cycles --layer N`: `POST /orders` with a fresh key through
//!   `IdempotencyLayer` on `MemoryStore` in front of `http_load`'s app, on
//!   a current-thread runtime (no socket: the layer's own work).
//!
//! ```text
//! cargo build --release -p idemstore-bench --bin cycles
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out target/release/cycles 2000
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out target/release/cycles --layer 20000
//! ```
//!
//! One thread makes every group one request, so each run commits the same
//! groups. The count is the whole process's (open, threads, the checkpoint
//! at drop), and checkpoints follow the clock, so counts move a little
//! between runs of one build: take the median of three (docs/performance.md,
//! "Copies out of the commit path").

use idemstore::tower::IdempotencyLayer;
use idemstore::{
    Begin, Clock, Fingerprint, Guard, Key, MemoryStore, RedbStore, Response, Store, SystemClock,
};
use idemstore_bench::http_load::{Front, app};
use std::time::Duration;
use tower::ServiceExt;

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn main() -> BoxResult<()> {
    let mut args = std::env::args().skip(1).peekable();
    let layer = args.next_if(|a| a == "--layer").is_some();
    let count: u64 = args.next().map_or(Ok(2_000), |c| c.parse())?;
    if layer {
        through_layer(count)
    } else {
        on_redb(count)
    }
}

fn on_redb(count: u64) -> BoxResult<()> {
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

fn through_layer(count: u64) -> BoxResult<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let layer = IdempotencyLayer::new(Guard::new(MemoryStore::new()));
        let app = app(Front::Layer(layer)).await?;
        for i in 0..count {
            let req = http::Request::post("/orders")
                .header("idempotency-key", format!("k{i}"))
                .body(axum::body::Body::from("{\"qty\":1}"))?;
            let res = app.clone().oneshot(req).await?;
            if res.status() != http::StatusCode::CREATED {
                return Err(format!("k{i}: {}", res.status()).into());
            }
            axum::body::to_bytes(res.into_body(), 1 << 20).await?;
        }
        Ok(())
    })
}
