//! HTTP load benchmark of `idemstore::tower::IdempotencyLayer`: an axum
//! service (`POST /orders`, 201 with a small JSON body) behind the layer on
//! each store, driven over loopback by a hyper client with one keep-alive
//! connection per concurrent client, fresh `Idempotency-Key`s and a share of
//! re-sent ones (replays). Variants, compared in one run:
//!
//! - `none`: the same app without the layer;
//! - `memory`: the layer on `MemoryStore`;
//! - `redb`: the layer on `RedbStore` in a temp dir (default durability:
//!   every claim and completion durable);
//! - `postgres`: the layer on `PostgresStore`, when `IDEMSTORE_PG_URL` names
//!   a server and the `postgres` feature is on ("skipped" otherwise;
//!   `--require-postgres` fails instead).
//! - `pg-mw`: the idempotency middleware as users write it by hand on
//!   PostgreSQL, on the same server and under the same conditions as
//!   `postgres`: a table of its own (`key text PRIMARY KEY`, state, status,
//!   body, expiry; dropped at the end of the cell), `INSERT .. ON CONFLICT
//!   DO NOTHING RETURNING 1` to claim, `UPDATE` for the result, `SELECT`
//!   for a replay, each statement autocommit and prepared once per
//!   connection, on tokio-postgres over a pool of `PostgresStore`'s size
//!   in the bench (64); no fingerprint, no fencing token;
//! - `redis-mw`: the idempotency middleware as users write it by hand on
//!   Redis (`SET NX PX` to claim, `SET XX PX` for the result, `GET` for a
//!   replay; no fingerprint, no fencing token), when `IDEMSTORE_REDIS_URL`
//!   names a server (CI's and `scripts/redis-test-server`'s default run
//!   `appendfsync always`), "skipped" otherwise;
//! - `redb-relaxed` (only when listed): the layer on `RedbStore` with
//!   `Durability::Periodic` (its log synced every 100 ms), which shows
//!   how much of `redb`'s cost is the disk and how much the commit line.
//!
//! The `group` column is the store's mean requests per commit group
//! (warm-up included), where it has groups.
//!
//! ```text
//! cargo run --release -p idemstore-bench --all-features --bin http_load             # 3 rounds × (2 s warm-up + 5 s) per cell
//! cargo run --release -p idemstore-bench --all-features --bin http_load -- --smoke  # CI: one short round
//! cargo run --release -p idemstore-bench --bin http_load -- --variants none,redb --connections 1024 --json
//! ```
//!
//! Options: `--variants LIST` (default `none,memory,redb,postgres,pg-mw,redis-mw`),
//! `--connections LIST` (default `64,1024,4096`), `--duration SECONDS` per
//! cell (default 5), `--warmup SECONDS` (default 2), `--rounds N` (default
//! 3; cells interleaved round by round, medians printed), `--dup F` (share
//! of requests that re-send a recent key, default 0.1), `--server-workers N`
//! and `--client-workers N` (tokio worker threads of each runtime, default
//! the cores), `--max-blocking-threads N` (the server runtime's blocking
//! pool, default tokio's 512), `--json` (one object per cell, medians),
//! `--svg FILE` (also a chart of requests/s against connections),
//! `--require-postgres` (fail instead of skipping `postgres` and `pg-mw`),
//! `--smoke` (one round, 0.3 s + 0.1 s warm-up per cell, 16 and 64
//! connections).
//!
//! `--serve VARIANT [--port P] [--serve-seconds S]` runs only the server
//! (default port 8080, 60 s, then it stops by itself) for a load client of
//! your own; with `wrk`, `bench/wrk/idempotency.lua` sends every request
//! with a fresh `Idempotency-Key` and re-sends a recent one for a share of
//! them (docs/performance.md, "Method"):
//!
//! ```text
//! cargo run --release -p idemstore-bench --bin http_load -- --serve redb --port 8080 --serve-seconds 30 &
//! wrk -t2 -c64 -d10s -s bench/wrk/idempotency.lua http://127.0.0.1:8080/orders
//! ```
//!
//! Each cell (one variant at one concurrency) runs in a child process (this
//! binary with `--cell`), so that its peak thread count and peak RSS are its
//! own: the server runtime, its blocking pool, the store, and the client
//! runtime, which shares the machine's cores with the server. The run fails
//! (exit 1, after the table) when any response failed its check.

use idemstore_bench::http_load::{
    CellParams, CellReport, EXTRA_VARIANTS, VARIANTS, run_cell, serve,
};
use idemstore_bench::peers::{BoxResult, median};
use idemstore_bench::plot;
use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

struct Args {
    variants: Vec<String>,
    connections: Vec<usize>,
    duration: f64,
    warmup: f64,
    rounds: usize,
    dup: f64,
    server_workers: usize,
    client_workers: usize,
    max_blocking_threads: Option<usize>,
    json: bool,
    svg: Option<String>,
    require_postgres: bool,
    /// Set in a child: run this one variant at `connections[0]` and print its JSON.
    cell: Option<String>,
    /// `--serve VARIANT`: only the server, for an outside load client.
    serve: Option<String>,
    /// `--port P` for `--serve` (0: any free port).
    port: u16,
    /// `--serve-seconds S`: how long `--serve` runs before it stops by itself.
    serve_seconds: f64,
}

fn list<T: std::str::FromStr>(s: &str) -> BoxResult<Vec<T>>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    Ok(s.split(',')
        .map(|x| x.trim().replace('_', "").parse::<T>())
        .collect::<Result<_, _>>()?)
}

fn parse() -> BoxResult<Args> {
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    let mut a = Args {
        variants: VARIANTS.iter().map(|v| (*v).to_owned()).collect(),
        connections: vec![64, 1024, 4096],
        duration: 5.0,
        warmup: 2.0,
        rounds: 3,
        dup: 0.1,
        server_workers: cores,
        client_workers: cores,
        max_blocking_threads: None,
        json: false,
        svg: None,
        require_postgres: false,
        cell: None,
        serve: None,
        port: 8080,
        serve_seconds: 60.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--variants" => a.variants = list(&value()?)?,
            "--connections" => a.connections = list(&value()?)?,
            "--duration" => a.duration = value()?.parse()?,
            "--warmup" => a.warmup = value()?.parse()?,
            "--rounds" => a.rounds = value()?.parse()?,
            "--dup" => a.dup = value()?.parse()?,
            "--server-workers" => a.server_workers = value()?.parse()?,
            "--client-workers" => a.client_workers = value()?.parse()?,
            "--max-blocking-threads" => a.max_blocking_threads = Some(value()?.parse()?),
            "--json" => a.json = true,
            "--svg" => a.svg = Some(value()?),
            "--require-postgres" => a.require_postgres = true,
            "--smoke" => {
                a.connections = vec![16, 64];
                a.duration = 0.3;
                a.warmup = 0.1;
                a.rounds = 1;
            }
            "--cell" => a.cell = Some(value()?),
            "--serve" => a.serve = Some(value()?),
            "--port" => a.port = value()?.parse()?,
            "--serve-seconds" => a.serve_seconds = value()?.parse()?,
            "-h" | "--help" => {
                println!("see the doc comment at the top of bench/src/bin/http_load.rs");
                std::process::exit(0);
            }
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if let Some(v) = a
        .variants
        .iter()
        .find(|v| !VARIANTS.contains(&v.as_str()) && !EXTRA_VARIANTS.contains(&v.as_str()))
    {
        return Err(format!(
            "unknown variant {v} (known: {},{})",
            VARIANTS.join(","),
            EXTRA_VARIANTS.join(",")
        )
        .into());
    }
    if !(0.0..=1.0).contains(&a.dup)
        || a.connections.contains(&0)
        || a.rounds == 0
        || a.duration <= 0.0
    {
        return Err(
            "--dup must be in 0..=1, connections and --rounds at least 1, --duration above 0"
                .into(),
        );
    }
    Ok(a)
}

fn params(a: &Args, variant: &str, connections: usize) -> CellParams {
    CellParams {
        variant: variant.to_owned(),
        connections,
        warmup: Duration::from_secs_f64(a.warmup),
        duration: Duration::from_secs_f64(a.duration),
        dup_ratio: a.dup,
        server_workers: a.server_workers,
        client_workers: a.client_workers,
        max_blocking_threads: a.max_blocking_threads,
    }
}

/// Runs one cell in a child process and reads its JSON line.
fn run_child(a: &Args, variant: &str, connections: usize) -> BoxResult<CellReport> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["--cell", variant])
        .args(["--connections", &connections.to_string()])
        .args(["--duration", &a.duration.to_string()])
        .args(["--warmup", &a.warmup.to_string()])
        .args(["--dup", &a.dup.to_string()])
        .args(["--server-workers", &a.server_workers.to_string()])
        .args(["--client-workers", &a.client_workers.to_string()]);
    if let Some(n) = a.max_blocking_threads {
        cmd.args(["--max-blocking-threads", &n.to_string()]);
    }
    let out = cmd.stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        return Err(format!("{variant} at {connections} connections: {}", out.status).into());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| format!("{variant} at {connections}: no report from the child"))?;
    CellReport::from_json(&serde_json::from_str(line)?)
}

/// Whether the PostgreSQL variants (`postgres`, `pg-mw`) can run; says
/// why not for those listed, or fails under `--require-postgres`.
fn postgres_available(a: &Args) -> BoxResult<bool> {
    let why_not = if !cfg!(feature = "postgres") {
        Some("built without the postgres feature (--features postgres)")
    } else if std::env::var_os("IDEMSTORE_PG_URL").is_none() {
        Some("IDEMSTORE_PG_URL not set (scripts/pg-test-cluster start DIR)")
    } else {
        None
    };
    match why_not {
        None => Ok(true),
        Some(why) if a.require_postgres => Err(format!("--require-postgres: {why}").into()),
        Some(why) => {
            let listed: Vec<&str> = a
                .variants
                .iter()
                .map(String::as_str)
                .filter(|v| PG_VARIANTS.contains(v))
                .collect();
            if !a.json && !listed.is_empty() {
                println!("{}: skipped, {why}", listed.join(", "));
            }
            Ok(false)
        }
    }
}

/// The variants on the PostgreSQL server `IDEMSTORE_PG_URL` names.
const PG_VARIANTS: [&str; 2] = ["postgres", "pg-mw"];

/// The medians of one variant at one concurrency over the rounds.
struct Cell {
    rounds: Vec<CellReport>,
}

impl Cell {
    fn median(&self, f: impl Fn(&CellReport) -> f64) -> f64 {
        median(&mut self.rounds.iter().map(f).collect::<Vec<_>>())
    }
    fn rps(&self) -> f64 {
        self.median(CellReport::requests_per_sec)
    }
    fn errors(&self) -> BTreeMap<String, u64> {
        let mut all = BTreeMap::new();
        for r in &self.rounds {
            for (kind, n) in &r.errors {
                *all.entry(kind.clone()).or_default() += n;
            }
        }
        all
    }
    fn json(&self, variant: &str, connections: usize, vs_none: Option<f64>) -> serde_json::Value {
        let rps: Vec<f64> = self
            .rounds
            .iter()
            .map(CellReport::requests_per_sec)
            .collect();
        serde_json::json!({
            "variant": variant,
            "connections": connections,
            "rounds": self.rounds.len(),
            "requests_per_sec": self.rps().round(),
            "requests_per_sec_rounds": rps.iter().map(|x| x.round()).collect::<Vec<_>>(),
            "vs_none": vs_none.map(|r| (r * 1000.0).round() / 1000.0),
            "p50_us": self.median(|r| r.p50_us).round(),
            "p99_us": self.median(|r| r.p99_us).round(),
            "p999_us": self.median(|r| r.p999_us).round(),
            "replays_per_sec": self.median(|r| r.replays as f64 / r.seconds.max(f64::MIN_POSITIVE)).round(),
            "errors": self.errors(),
            "threads_at_start": self.median(|r| r.threads_at_start as f64),
            "peak_threads": self.median(|r| r.peak_threads as f64),
            "peak_rss_bytes": self.median(|r| r.peak_rss_bytes as f64),
            "server_cpu_us_per_request": (self.median(|r| r.server_cpu_us) * 10.0).round() / 10.0,
            "client_cpu_us_per_request": (self.median(|r| r.client_cpu_us) * 10.0).round() / 10.0,
            "mean_group": self.rounds.iter().any(|r| r.mean_group.is_some())
                .then(|| (self.median(|r| r.mean_group.unwrap_or(0.0)) * 10.0).round() / 10.0),
        })
    }
}

fn ms(us: f64) -> String {
    format!("{:.2}", us / 1000.0)
}

fn main() -> BoxResult<()> {
    let a = parse()?;
    if let Some(variant) = &a.serve {
        return serve(&params(&a, variant, 1), a.port, a.serve_seconds);
    }
    if let Some(variant) = &a.cell {
        let connections = a.connections.first().copied().ok_or("--connections")?;
        let report = run_cell(&params(&a, variant, connections))?;
        println!("{}", report.json());
        return Ok(());
    }
    let pg = postgres_available(&a)?;
    // The hand-written Redis middleware peer, where a server is named.
    let redis = std::env::var_os("IDEMSTORE_REDIS_URL").is_some();
    if !redis && !a.json && a.variants.iter().any(|v| v == "redis-mw") {
        println!(
            "redis-mw: skipped, IDEMSTORE_REDIS_URL not set (scripts/redis-test-server start DIR)"
        );
    }
    let variants: Vec<&str> = a
        .variants
        .iter()
        .map(String::as_str)
        .filter(|v| !PG_VARIANTS.contains(v) || pg)
        .filter(|v| *v != "redis-mw" || redis)
        .collect();
    if !a.json {
        println!(
            "http_load: {} round(s) × ({} s warm-up + {} s) per cell, connections {:?}, dup {}, \
             server workers {}, client workers {}, blocking pool {}, {} cores shared by client and server",
            a.rounds,
            a.warmup,
            a.duration,
            a.connections,
            a.dup,
            a.server_workers,
            a.client_workers,
            a.max_blocking_threads
                .map_or("tokio default (512)".to_owned(), |n| n.to_string()),
            std::thread::available_parallelism().map_or(0, usize::from),
        );
    }
    let mut cells: BTreeMap<(usize, &str), Cell> = BTreeMap::new();
    for _ in 0..a.rounds {
        for &connections in &a.connections {
            for &variant in &variants {
                let report = run_child(&a, variant, connections)?;
                cells
                    .entry((connections, variant))
                    .or_insert(Cell { rounds: Vec::new() })
                    .rounds
                    .push(report);
            }
        }
    }

    if !a.json {
        println!();
        println!(
            "{:>6} {:<12} {:>9} {:>7} {:>8} {:>8} {:>8} {:>10} {:>8} {:>8} {:>9} {:>6} {:>10} {:>10}",
            "conns",
            "variant",
            "req/s",
            "× none",
            "p50 ms",
            "p99 ms",
            "p999 ms",
            "replays/s",
            "errors",
            "threads",
            "RSS MiB",
            "group",
            "srv µs/req",
            "cli µs/req"
        );
    }
    let mut failed = 0u64;
    for &connections in &a.connections {
        let none = cells.get(&(connections, "none")).map(Cell::rps);
        for &variant in &variants {
            let Some(cell) = cells.get(&(connections, variant)) else {
                continue;
            };
            let vs_none = none.map(|n| cell.rps() / n.max(f64::MIN_POSITIVE));
            let errors = cell.errors();
            failed += errors.values().sum::<u64>();
            let v = cell.json(variant, connections, vs_none);
            if a.json {
                println!("{v}");
                continue;
            }
            let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
            println!(
                "{:>6} {:<12} {:>9.0} {:>7} {:>8} {:>8} {:>8} {:>10.0} {:>8} {:>8.0} {:>9.1} {:>6} {:>10.1} {:>10.1}",
                connections,
                variant,
                cell.rps(),
                vs_none.map_or("-".to_owned(), |r| format!("{r:.2}")),
                ms(num("p50_us")),
                ms(num("p99_us")),
                ms(num("p999_us")),
                num("replays_per_sec"),
                errors.values().sum::<u64>(),
                num("peak_threads"),
                num("peak_rss_bytes") / 1_048_576.0,
                v.get("mean_group")
                    .and_then(serde_json::Value::as_f64)
                    .map_or("-".to_owned(), |g| format!("{g:.1}")),
                num("server_cpu_us_per_request"),
                num("client_cpu_us_per_request"),
            );
            for (kind, n) in &errors {
                println!("{:>16} {n} × {kind}", "");
            }
        }
    }
    if let Some(file) = &a.svg {
        let series: Vec<plot::Series> = variants
            .iter()
            .map(|&variant| plot::Series {
                label: variant.to_owned(),
                ys: a
                    .connections
                    .iter()
                    .map(|&c| cells.get(&(c, variant)).map_or(f64::NAN, Cell::rps))
                    .collect(),
            })
            .collect();
        let xs: Vec<f64> = a.connections.iter().map(|&c| c as f64).collect();
        let title = format!(
            "HTTP, {:.0} % re-sent keys, medians of {} round(s)",
            a.dup * 100.0,
            a.rounds
        );
        std::fs::write(
            file,
            plot::line_chart(&title, "connections", "requests/s", &xs, &series),
        )?;
        if !a.json {
            println!("chart: {file}");
        }
    }
    if failed > 0 {
        return Err(format!("{failed} response(s) failed their check (see the table)").into());
    }
    Ok(())
}
