//! Same-run comparison: the cycle workload (durable claim + durable
//! completion, 200-byte response) on idemstore's stores and on what a user
//! would pick instead, at 1, 8, 64 and 256 clients, interleaved round by
//! round so that every backend sees the same disk weather. Prints medians
//! and ratios.
//!
//! ```text
//! cargo run --release -p idemstore-bench --bin compare                 # 3 rounds × 3 s per cell
//! cargo run --release -p idemstore-bench --all-features --bin compare  # with SledStore too
//! # ... and PostgresStore when IDEMSTORE_PG_URL names a server
//! cargo run --release -p idemstore-bench --bin compare -- --smoke       # CI: one short round
//! cargo run --release -p idemstore-bench --bin compare -- --rounds 5 --seconds 5
//! cargo run --release -p idemstore-bench --features postgres --bin compare -- --only postgres,postgres-hand
//! ```
//!
//! `--only NAME,..` runs only the named rows (`postgres,postgres-hand`
//! for the PostgreSQL pair); `--clients N,..` only those client counts;
//! `--svg FILE` also writes the medians as a chart (cycles/s against clients).
//!
//! Redis joins as a peer when IDEMSTORE_REDIS_URL (a server with
//! `appendfsync always`) and/or IDEMSTORE_REDIS_EVERYSEC_URL (one with
//! `appendfsync everysec`) name servers; each row is labelled with what
//! its server reports (`CONFIG GET appendfsync`), and the servers' versions
//! are printed. `--require-redis` fails the run when either is missing (CI).
//!
//! ```text
//! dir=$(mktemp -d)
//! eval "$(scripts/redis-test-server start "$dir/always")"
//! eval "$(scripts/redis-test-server start "$dir/everysec" everysec)"
//! cargo run --release -p idemstore-bench --bin compare -- --smoke --require-redis
//! scripts/redis-test-server stop "$dir/always"; scripts/redis-test-server stop "$dir/everysec"
//! ```

use idemstore_bench::{peers, plot, workload};
use peers::{Backend, BoxResult, RedisInfo, fdatasync_probe};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

const CLIENTS: [usize; 4] = [1, 8, 64, 256];

/// The Redis peers, each where its variable names a server.
const REDIS: [&str; 2] = ["redis-always", "redis-everysec"];

/// The backends compared, in table order; ours first, then the peers.
fn backends(redis: &[&'static str]) -> Vec<&'static str> {
    let mut v = Vec::new();
    v.extend(ours());
    v.extend(peers(redis));
    v
}

fn peers(redis: &[&'static str]) -> Vec<&'static str> {
    let mut v = vec!["sqlite", "redb-raw"];
    v.extend_from_slice(redis);
    // The request path written by hand on the same PostgreSQL server as
    // the `postgres` row (one statement per call, a pool of the same size).
    if with_postgres() {
        v.push("postgres-hand");
    }
    v
}

fn with_postgres() -> bool {
    cfg!(feature = "postgres") && std::env::var_os("IDEMSTORE_PG_URL").is_some()
}

fn ours() -> Vec<&'static str> {
    // `redb-3step`: a cycle with three steps between claim and completion.
    let mut v = vec!["redb", "redb-3step"];
    if cfg!(feature = "sled") {
        v.push("sled");
    }
    // PostgresStore when a server is named (a throwaway one:
    // scripts/pg-test-cluster start DIR).
    if with_postgres() {
        v.push("postgres");
    }
    v
}

/// Every row `compare` knows, whatever the build: [`backends`] holds those
/// this build and environment can run.
const ROWS: [&str; 9] = [
    "redb",
    "redb-3step",
    "sled",
    "postgres",
    "sqlite",
    "redb-raw",
    "redis-always",
    "redis-everysec",
    "postgres-hand",
];

/// Why the row `name`, named by `--only`, cannot run in this build and
/// environment (`None`: it can). A Redis row without its server is
/// skipped with a message instead, as in a full run.
fn unavailable(name: &str) -> Option<String> {
    if backends(&REDIS).contains(&name) {
        return None;
    }
    let feature = |f: &str| format!("this build has no `{f}` feature (add `--features {f}`)");
    Some(match name {
        "sled" => feature("sled"),
        "postgres" | "postgres-hand" if !cfg!(feature = "postgres") => feature("postgres"),
        "postgres" | "postgres-hand" => {
            "IDEMSTORE_PG_URL is not set (scripts/pg-test-cluster start DIR)".to_owned()
        }
        other => format!("no such row `{other}` (rows: {})", ROWS.join(", ")),
    })
}

fn open(name: &str, dir: &Path) -> BoxResult<Box<dyn Backend>> {
    // The defaults: group commit with an fsync per batch.
    peers::open_backend(name, dir, "immediate")
}

fn median(mut v: Vec<f64>) -> f64 {
    peers::median(&mut v)
}

fn cell(map: &BTreeMap<(String, usize), Vec<f64>>, name: &str, clients: usize) -> f64 {
    median(
        map.get(&(name.to_owned(), clients))
            .cloned()
            .unwrap_or_default(),
    )
}

fn main() -> BoxResult<()> {
    let mut rounds = 3usize;
    let mut seconds = 3.0f64;
    let mut require_redis = false;
    let mut only: Option<Vec<String>> = None;
    let mut clients_list: Vec<usize> = CLIENTS.to_vec();
    let mut svg: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--smoke" => {
                rounds = 1;
                seconds = 0.3;
            }
            "--rounds" => rounds = args.next().ok_or("--rounds N")?.parse()?,
            "--seconds" => seconds = args.next().ok_or("--seconds S")?.parse()?,
            "--require-redis" => require_redis = true,
            "--svg" => svg = Some(args.next().ok_or("--svg FILE")?),
            "--clients" => {
                let list = args.next().ok_or("--clients N,N..")?;
                clients_list = list.split(',').map(str::parse).collect::<Result<_, _>>()?;
            }
            "--only" => {
                let list = args.next().ok_or("--only NAME,NAME..")?;
                only = Some(list.split(',').map(str::to_owned).collect());
            }
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    // A named row that cannot run is an error, not an empty table.
    if let Some(why) = only.iter().flatten().find_map(|n| unavailable(n)) {
        return Err(format!("--only: {why}").into());
    }
    let chosen = |name: &str| only.as_ref().is_none_or(|o| o.iter().any(|n| n == name));
    let duration = Duration::from_secs_f64(seconds);
    let root = tempfile::tempdir()?;
    println!(
        "compare: {rounds} round(s) × {seconds} s per cell, clients {clients_list:?}, dir {}",
        root.path().display()
    );

    // Redis: the servers named, what each says it is, and the row labels.
    let mut labels: BTreeMap<&str, String> = BTreeMap::new();
    let mut redis = Vec::new();
    for name in REDIS {
        let var = peers::redis_env(name);
        let Ok(url) = std::env::var(var) else {
            if require_redis {
                return Err(format!(
                    "--require-redis: {var} is not set (scripts/redis-test-server start DIR{})",
                    if name == "redis-everysec" {
                        " everysec"
                    } else {
                        ""
                    }
                )
                .into());
            }
            println!("{name}: skipped, {var} not set");
            continue;
        };
        let info = RedisInfo::of(&url).map_err(|e| format!("{var}={url}: {e}"))?;
        println!(
            "{name}: Redis {} at {url}: appendonly {}, appendfsync {}, save '{}'{}",
            info.version,
            info.appendonly,
            info.appendfsync,
            info.save,
            info.aof_dir
                .as_deref()
                .map_or(String::new(), |d| format!(", AOF in {}", d.display()))
        );
        let wanted = name.trim_start_matches("redis-");
        if info.appendonly != "yes" || info.appendfsync != wanted {
            println!(
                "  note: {var} was meant for appendfsync {wanted}; the row shows what the server runs"
            );
        }
        labels.insert(name, info.label());
        redis.push(name);
    }
    let label = |name: &str| labels.get(name).cloned().unwrap_or_else(|| name.to_owned());

    let mut cycles: BTreeMap<(String, usize), Vec<f64>> = BTreeMap::new();
    let mut p99: BTreeMap<(String, usize), Vec<f64>> = BTreeMap::new();
    let mut floor = Vec::new();
    let mut floor_p50 = Vec::new();
    for round in 0..rounds {
        let (ops, p50) = fdatasync_probe(root.path(), duration)?;
        floor.push(ops);
        floor_p50.push(p50);
        for &clients in &clients_list {
            for name in backends(&redis).into_iter().filter(|n| chosen(n)) {
                // A fresh store per cell: no cell inherits another's file size.
                let dir = root.path().join(format!("{name}-{clients}-{round}"));
                std::fs::create_dir_all(&dir)?;
                let backend = open(name, &dir)?;
                let params = workload::Params {
                    clients,
                    dup_ratio: 0.0,
                    response_bytes: 200,
                    duration,
                };
                let r = workload::run(&*backend, &params)?;
                cycles
                    .entry((name.to_owned(), clients))
                    .or_default()
                    .push(r.cycles_per_sec);
                p99.entry((name.to_owned(), clients))
                    .or_default()
                    .push(r.claim_p99_us);
                drop(backend);
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }

    let floor_ops = median(floor);
    let floor_cycles = floor_ops / 2.0;
    println!();
    println!(
        "disk floor: 256-byte append + fdatasync {floor_ops:.0}/s (p50 {:.0} µs) → {floor_cycles:.0} cycles/s on one client",
        median(floor_p50)
    );
    println!();
    print!("{:<34}", "cycles/s (median)");
    for &c in &clients_list {
        print!(
            "{:>12}",
            format!("{c} client{}", if c == 1 { "" } else { "s" })
        );
    }
    println!("{:>14}", "p99 claim @64");
    for name in backends(&redis).into_iter().filter(|n| chosen(n)) {
        print!("{:<34}", label(name));
        for &c in &clients_list {
            print!("{:>12.0}", cell(&cycles, name, c));
        }
        println!("{:>11.0} µs", cell(&p99, name, 64));
    }
    if let Some(file) = &svg {
        let series: Vec<plot::Series> = backends(&redis)
            .into_iter()
            .filter(|n| chosen(n))
            .map(|name| plot::Series {
                label: label(name),
                ys: clients_list
                    .iter()
                    .map(|&c| cell(&cycles, name, c))
                    .collect(),
            })
            .collect();
        let xs: Vec<f64> = clients_list.iter().map(|&c| c as f64).collect();
        let title = format!("Durable claim + completion, medians of {rounds} round(s)");
        std::fs::write(
            file,
            plot::line_chart(&title, "client threads", "cycles/s", &xs, &series),
        )?;
        println!("chart: {file}");
    }
    println!();
    for ours in ours().into_iter().filter(|n| chosen(n)) {
        for &c in &clients_list {
            let mine = cell(&cycles, ours, c);
            let mut line = format!("{ours} @{c}: {:.1}× disk floor", mine / floor_cycles);
            for peer in peers(&redis).into_iter().filter(|n| chosen(n)) {
                let theirs = cell(&cycles, peer, c);
                line.push_str(&format!(
                    ", {:.1}× {peer}",
                    mine / theirs.max(f64::MIN_POSITIVE)
                ));
            }
            println!("{line}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row a full run can show is a row `--only` accepts by name
    /// (when its feature and server are there), and a name that is no row
    /// is refused.
    #[test]
    fn only_accepts_the_rows_and_refuses_other_names() {
        for name in backends(&REDIS) {
            assert!(ROWS.contains(&name), "{name} missing from ROWS");
            assert_eq!(unavailable(name), None, "{name}");
        }
        let why = unavailable("redis").expect("not a row");
        assert!(why.contains("no such row `redis`"), "{why}");
        for (name, feature) in [("sled", "sled"), ("postgres-hand", "postgres")] {
            let flag = format!("--features {feature}");
            match unavailable(name) {
                Some(why) => assert!(why.contains(&flag) || why.contains("IDEMSTORE_PG_URL")),
                None => assert!(backends(&REDIS).contains(&name), "{name} not in a full run"),
            }
        }
        if cfg!(feature = "postgres") && !with_postgres() {
            let why = unavailable("postgres").expect("no server");
            assert!(why.contains("IDEMSTORE_PG_URL"), "{why}");
        }
        if !cfg!(feature = "postgres") {
            let why = unavailable("postgres").expect("no feature");
            assert!(why.contains("--features postgres"), "{why}");
        }
    }
}
