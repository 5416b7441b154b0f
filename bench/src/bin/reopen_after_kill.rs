//! Reopen time after a SIGKILL under load: the number a crash-restart
//! pays before the store answers again.
//!
//! Each round spawns this binary as a child (`--child`) that opens the
//! store and runs the cycle workload (`--clients` threads, each claiming a
//! fresh key durably and completing it durably with a 200-byte response)
//! until it is killed. The parent waits a random `--load-ms` after the
//! child reports its store open, kills it with SIGKILL (`Child::kill`),
//! reaps it, then times `RedbStore::open` (wall time of the call) and
//! records how many log frames the open replayed. The store is then
//! dropped cleanly (its time is reported too) and the next round starts.
//!
//! ```text
//! # fill a store first (relaxed durability for the fill, like loadgen's
//! # prefill), then 20 kills:
//! cargo run --release -p idemstore-bench --bin reopen_after_kill -- \
//!     --path /tmp/k/store.idem --keys 100000 --kills 20
//! # an existing store (e.g. one loadgen filled: <dir>/loadgen.idem):
//! cargo run --release -p idemstore-bench --bin reopen_after_kill -- \
//!     --path /work/big5m/loadgen.idem --kills 20 --clients 64 --load-ms 1000..3000 --json
//! ```
//!
//! Options: `--path FILE` (required), `--keys N` (fill N records into a
//! new file at `--path` first; refused if the file exists), `--kills K`
//! (default 20), `--clients C` (default 64), `--load-ms MIN..MAX` (default
//! `1000..3000`), `--json` (one summary line at the end). The reopen runs
//! with the file in the OS page cache, as after a process crash (not a
//! machine crash). Numbers for notes, never assertions.

use idemstore::redb::Durability;
use idemstore::{Clock, Fingerprint, Key, RedbStore, Response, SystemClock};
use idemstore_bench::{peers, workload};
use peers::{BoxResult, Claimed, StoreBackend};
use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RESPONSE_BYTES: usize = 200;

struct Args {
    path: String,
    keys: u64,
    kills: usize,
    clients: usize,
    load_ms: (u64, u64),
    json: bool,
    child: bool,
}

fn parse() -> BoxResult<Args> {
    let mut a = Args {
        path: String::new(),
        keys: 0,
        kills: 20,
        clients: 64,
        load_ms: (1000, 3000),
        json: false,
        child: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--path" => a.path = value()?,
            "--keys" => a.keys = value()?.parse()?,
            "--kills" => a.kills = value()?.parse()?,
            "--clients" => a.clients = value()?.parse()?,
            "--load-ms" => {
                let v = value()?;
                let (lo, hi) = v.split_once("..").ok_or("--load-ms MIN..MAX")?;
                a.load_ms = (lo.parse()?, hi.parse()?);
            }
            "--json" => a.json = true,
            "--child" => a.child = true,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if a.path.is_empty() || a.clients == 0 || a.load_ms.0 > a.load_ms.1 {
        return Err(
            "--path is required; --clients >= 1; --load-ms MIN..MAX with MIN <= MAX".into(),
        );
    }
    Ok(a)
}

fn main() -> BoxResult<()> {
    let a = parse()?;
    if a.child {
        return child(&a);
    }
    let path = Path::new(&a.path);
    if a.keys > 0 {
        if path.exists() {
            return Err(format!("{} exists: --keys fills a new store", path.display()).into());
        }
        let t = Instant::now();
        let store = RedbStore::builder()
            .durability(Durability::Periodic {
                max_loss: Duration::from_millis(100),
            })
            .open(path)?;
        let filler = backend(store);
        workload::prefill(&filler, a.keys, a.clients.max(16), RESPONSE_BYTES)?;
        drop(filler);
        println!("filled {} records in {:.1?}", a.keys, t.elapsed());
    }
    let file_bytes = std::fs::metadata(path)?.len();
    println!("store {} ({file_bytes} bytes)", path.display());
    // xorshift seeded from the clock: the load times differ run to run.
    let mut rng = SystemClock.now().as_millis() | 1;
    let (mut reopen_ms, mut frames) = (Vec::new(), Vec::new());
    for round in 1..=a.kills {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--child", "--path", &a.path, "--clients"])
            .arg(a.clients.to_string())
            .stdout(Stdio::piped())
            .spawn()?;
        // The child says "ready" once its store is open and the load starts.
        let mut line = String::new();
        let stdout = child.stdout.take().ok_or("no child stdout")?;
        std::io::BufReader::new(stdout).read_line(&mut line)?;
        if line.trim() != "ready" {
            let status = child.wait()?;
            return Err(format!("the child did not start ({status}): {line:?}").into());
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let load = a.load_ms.0 + rng % (a.load_ms.1 - a.load_ms.0 + 1);
        std::thread::sleep(Duration::from_millis(load));
        child.kill()?; // SIGKILL: no destructor, no flush
        child.wait()?;
        let t = Instant::now();
        let store = RedbStore::open(path)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let replayed = store.stats().frames_replayed_on_open;
        let t = Instant::now();
        drop(store);
        let drop_ms = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "kill {round:>3}: load {load:>4} ms  reopen {ms:>8.1} ms  frames {replayed:>5}  (clean drop {drop_ms:.1} ms)"
        );
        reopen_ms.push(ms);
        frames.push(replayed as f64);
    }
    let file_bytes = std::fs::metadata(path)?.len();
    let q = |v: &mut Vec<f64>, q: f64| peers::percentile(v, q);
    let (min, p50, p90, max) = (
        q(&mut reopen_ms, 0.0),
        q(&mut reopen_ms, 0.5),
        q(&mut reopen_ms, 0.9),
        q(&mut reopen_ms, 1.0),
    );
    let (fmin, fp50, fmax) = (
        q(&mut frames, 0.0),
        q(&mut frames, 0.5),
        q(&mut frames, 1.0),
    );
    println!(
        "reopen ms: min {min:.1}  p50 {p50:.1}  p90 {p90:.1}  max {max:.1}  over {} kills",
        a.kills
    );
    println!("frames replayed: min {fmin:.0}  p50 {fp50:.0}  max {fmax:.0}");
    println!("store file {file_bytes} bytes");
    if a.json {
        println!(
            "{{\"kills\":{},\"clients\":{},\"reopen_ms_min\":{min:.2},\"reopen_ms_p50\":{p50:.2},\"reopen_ms_p90\":{p90:.2},\"reopen_ms_max\":{max:.2},\"frames_min\":{fmin:.0},\"frames_p50\":{fp50:.0},\"frames_max\":{fmax:.0},\"file_bytes\":{file_bytes}}}",
            a.kills, a.clients
        );
    }
    Ok(())
}

fn backend(store: RedbStore) -> StoreBackend {
    StoreBackend {
        name: "redb".into(),
        store: Arc::new(store),
        dir: None,
        batch: None,
        steps: 0,
    }
}

/// The child: the cycle workload on fresh keys (a scope of its own pid),
/// durable claim and completion (the default `Durability::Immediate`),
/// until killed.
fn child(a: &Args) -> BoxResult<()> {
    let store = backend(RedbStore::open(&a.path)?);
    let scope = format!("kill{}", std::process::id());
    let response = Response::new(200, vec![b'x'; RESPONSE_BYTES]);
    std::thread::scope(|s| -> BoxResult<()> {
        let handles: Vec<_> = (0..a.clients)
            .map(|t| {
                let (store, scope, response) = (&store, &scope, &response);
                s.spawn(move || -> BoxResult<()> {
                    let mut client = peers::Backend::client(store)?;
                    for n in 0u64.. {
                        let key = Key::new(scope.as_str(), format!("c{t}-{n}"))?;
                        let fp = Fingerprint::of(n.to_be_bytes());
                        if let Claimed::Owned(ticket) =
                            client.claim(&key, &fp, SystemClock.now())?
                        {
                            client.complete(&key, ticket, response, SystemClock.now())?;
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        println!("ready");
        for h in handles {
            h.join().map_err(|_| "load thread panicked")??;
        }
        Ok(())
    })
}
