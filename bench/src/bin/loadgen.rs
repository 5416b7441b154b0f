//! Load generator: the cycle workload (a durable claim plus a durable
//! completion of one key, 200-byte response, 32-byte fingerprint) on one
//! backend, with a table or one JSON object as output.
//!
//! ```text
//! cargo run --release -p idemstore-bench --bin loadgen -- --backend redb --clients 64 --duration 10
//! cargo run --release -p idemstore-bench --bin loadgen -- --backend sqlite --clients 8 --json
//! cargo run --release -p idemstore-bench --features postgres --bin loadgen -- --backend postgres --pg-url postgres://u@host/db
//! cargo run --release -p idemstore-bench --bin loadgen -- --backend redis --redis-url redis://127.0.0.1:PORT
//! ```
//!
//! Options: `--backend memory|redb|sled|sqlite|redb-raw|postgres|postgres-hand|redis|redis-everysec`
//! (`postgres-hand`: the request path written by hand on the same server as
//! `postgres`, a peer), `--clients N`,
//! `--keys N` (records loaded before measuring), `--dup-ratio F` (share of
//! requests that re-send a completed key), `--response-bytes N`,
//! `--durability immediate|relaxed|periodic:MS`, `--prefill-durability ...`
//! (for the `--keys` fill only), `--duration SECONDS`, `--dir PATH`
//! (default: a fresh temp dir), `--json`, `--pg-url URL` (for `postgres`,
//! which needs the `postgres` feature; default `IDEMSTORE_PG_URL`; the run
//! uses a fresh table and drops it at the end, so `--keys` does not apply),
//! `--redis-url URL` (for `redis`, default `IDEMSTORE_REDIS_URL`, and
//! `redis-everysec`, default `IDEMSTORE_REDIS_EVERYSEC_URL`: a throwaway
//! server from `scripts/redis-test-server start DIR [everysec]`; the server's
//! `appendfsync` decides durability; the run writes under a fresh key
//! prefix and deletes its keys at the end, so `--keys` does not apply).

use idemstore_bench::{peers, workload};
use peers::{BoxResult, open_backend};
use std::time::Duration;

struct Args {
    backend: String,
    clients: usize,
    keys: u64,
    dup_ratio: f64,
    response_bytes: usize,
    durability: String,
    prefill_durability: String,
    duration: f64,
    dir: Option<String>,
    json: bool,
    pg_url: Option<String>,
    redis_url: Option<String>,
}

fn parse() -> BoxResult<Args> {
    let mut a = Args {
        backend: "redb".into(),
        clients: 64,
        keys: 0,
        dup_ratio: 0.0,
        response_bytes: 200,
        durability: "immediate".into(),
        prefill_durability: "immediate".into(),
        duration: 5.0,
        dir: None,
        json: false,
        pg_url: None,
        redis_url: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => a.backend = value()?,
            "--clients" => a.clients = value()?.parse()?,
            "--keys" => a.keys = value()?.parse()?,
            "--dup-ratio" => a.dup_ratio = value()?.parse()?,
            "--response-bytes" => a.response_bytes = value()?.parse()?,
            "--durability" => a.durability = value()?,
            "--prefill-durability" => a.prefill_durability = value()?,
            "--duration" => a.duration = value()?.parse()?,
            "--dir" => a.dir = Some(value()?),
            "--json" => a.json = true,
            "--pg-url" => a.pg_url = Some(value()?),
            "--redis-url" => a.redis_url = Some(value()?),
            "-h" | "--help" => {
                println!("see the doc comment at the top of bench/src/bin/loadgen.rs");
                std::process::exit(0);
            }
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if a.backend == "postgres" && a.keys > 0 {
        return Err(
            "--keys does not apply to --backend postgres (each open is a fresh table)".into(),
        );
    }
    if a.backend.starts_with("redis") && a.keys > 0 {
        return Err(format!(
            "--keys does not apply to --backend {} (each open is a fresh key prefix)",
            a.backend
        )
        .into());
    }
    if !(0.0..=1.0).contains(&a.dup_ratio) || a.clients == 0 {
        return Err("--dup-ratio must be in 0..=1 and --clients at least 1".into());
    }
    Ok(a)
}

fn main() -> BoxResult<()> {
    let a = parse()?;
    if let Some(url) = &a.redis_url {
        let _ = peers::REDIS_URL.set(url.clone());
    }
    #[cfg(feature = "postgres")]
    if let Some(url) = &a.pg_url {
        let _ = peers::PG_URL.set(url.clone());
    }
    #[cfg(not(feature = "postgres"))]
    if a.pg_url.is_some() || a.backend == "postgres" {
        return Err("--backend postgres needs the postgres feature: cargo run --release -p idemstore-bench --features postgres --bin loadgen -- ...".into());
    }
    let tmp = tempfile::tempdir()?;
    let dir = a
        .dir
        .as_deref()
        .map_or_else(|| tmp.path().to_owned(), Into::into);
    std::fs::create_dir_all(&dir)?;
    if a.keys > 0 {
        // The fill is set-up, not the measurement: it may run at another
        // durability (`--prefill-durability relaxed` skips the per-batch
        // fsync), then the store is closed and reopened as measured.
        let t = std::time::Instant::now();
        let filler = open_backend(&a.backend, &dir, &a.prefill_durability)?;
        workload::prefill(&*filler, a.keys, a.clients.max(16), a.response_bytes)?;
        drop(filler);
        if !a.json {
            println!("prefilled {} records in {:.1?}", a.keys, t.elapsed());
        }
    }
    let backend = open_backend(&a.backend, &dir, &a.durability)?;
    // Peak RSS from here on: the fill's own peak is not what is asked.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let params = workload::Params {
        clients: a.clients,
        dup_ratio: a.dup_ratio,
        response_bytes: a.response_bytes,
        duration: Duration::from_secs_f64(a.duration),
    };
    let r = workload::run(&*backend, &params)?;
    if a.json {
        println!("{}", r.json());
    } else {
        println!("backend          {}", r.backend);
        println!("clients          {}", r.clients);
        println!("cycles/s         {:.0}", r.cycles_per_sec);
        println!("claims/s         {:.0}", r.claims_per_sec);
        println!("claim p50        {:.0} µs", r.claim_p50_us);
        println!("claim p99        {:.0} µs", r.claim_p99_us);
        println!("replays/s        {:.0}", r.replay_per_sec);
        println!(
            "avg batch        {}",
            r.avg_batch.map_or("-".into(), |b| format!("{b:.1}"))
        );
        println!("file bytes       {}", r.file_bytes);
        println!(
            "peak RSS         {:.1} MiB",
            r.peak_rss_bytes as f64 / 1048576.0
        );
    }
    Ok(())
}
