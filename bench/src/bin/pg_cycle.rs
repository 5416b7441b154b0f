//! One client, cycle by cycle: the cycle workload's claim and completion on
//! two backends in turn from one thread (A, B, B, A, ...), so that both see
//! the same machine at every moment, and the medians of each call's wall
//! time and of the calling thread's CPU time (`/proc/thread-self/schedstat`:
//! with the calling thread's lane, the whole client side of a call). Made to tell a one-client gap apart from the noise of a shared
//! machine, where `compare`'s seconds-long cells drift.
//!
//! ```text
//! eval "$(scripts/pg-test-cluster start DIR)"
//! cargo run --release -p idemstore-bench --features postgres --bin pg_cycle -- --seconds 10
//! cargo run --release -p idemstore-bench --features postgres --bin pg_cycle -- --backends postgres,postgres-hand
//! ```

use idemstore::{Clock, Fingerprint, Key, Response, SystemClock};
use idemstore_bench::peers::{self, BoxResult, Claimed};
use std::time::{Duration, Instant};

fn main() -> BoxResult<()> {
    let mut seconds = 10.0f64;
    let mut names = vec!["postgres".to_owned(), "postgres-hand".to_owned()];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seconds" => seconds = args.next().ok_or("--seconds S")?.parse()?,
            "--backends" => {
                names = args
                    .next()
                    .ok_or("--backends A,B")?
                    .split(',')
                    .map(str::to_owned)
                    .collect();
            }
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    let root = tempfile::tempdir()?;
    let backends = names
        .iter()
        .map(|n| peers::open_backend(n, root.path(), "immediate"))
        .collect::<BoxResult<Vec<_>>>()?;
    let mut clients = backends
        .iter()
        .map(|b| b.client())
        .collect::<BoxResult<Vec<_>>>()?;
    let response = Response::new(200, vec![b'x'; 200]);
    let count = clients.len();
    let mut claims: Vec<Vec<f64>> = vec![Vec::new(); count];
    let mut completes: Vec<Vec<f64>> = vec![Vec::new(); count];
    let mut cycles: Vec<Vec<f64>> = vec![Vec::new(); count];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); count];
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let mut n = 0u64;
    while Instant::now() < end {
        n += 1;
        for turn in 0..count {
            // A, B, B, A: neither always goes first.
            let i = if n.is_multiple_of(2) {
                turn
            } else {
                count - 1 - turn
            };
            let (Some(client), Some(claim_us), Some(complete_us), Some(cycle_us), Some(cpu_us)) = (
                clients.get_mut(i),
                claims.get_mut(i),
                completes.get_mut(i),
                cycles.get_mut(i),
                cpu.get_mut(i),
            ) else {
                continue;
            };
            let key = Key::new("pg_cycle", format!("k{n}"))?;
            let fp = Fingerprint::of(n.to_be_bytes());
            let cpu_started = thread_cpu_ns();
            let started = Instant::now();
            let Claimed::Owned(ticket) = client.claim(&key, &fp, SystemClock.now())? else {
                return Err(format!("{key} was not fresh").into());
            };
            let claimed = Instant::now();
            client.complete(&key, ticket, &response, SystemClock.now())?;
            let done = Instant::now();
            let cpu_done = thread_cpu_ns();
            cpu_us.push(cpu_done.saturating_sub(cpu_started) as f64 / 1e3);
            claim_us.push((claimed - started).as_secs_f64() * 1e6);
            complete_us.push((done - claimed).as_secs_f64() * 1e6);
            cycle_us.push((done - started).as_secs_f64() * 1e6);
        }
    }
    println!("{n} cycles each, alternating, one thread; medians in µs");
    println!(
        "{:<16}{:>10}{:>10}{:>10}{:>10}{:>12}",
        "backend", "claim", "complete", "cycle", "mean", "thread CPU"
    );
    let mut medians = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let take = |v: &mut Vec<Vec<f64>>| v.get_mut(i).map_or(0.0, |v| peers::median(v));
        let mean = cycles
            .get(i)
            .map_or(0.0, |v| v.iter().sum::<f64>() / v.len().max(1) as f64);
        let (c, d, y) = (take(&mut claims), take(&mut completes), take(&mut cycles));
        let t = take(&mut cpu);
        println!("{name:<16}{c:>10.1}{d:>10.1}{y:>10.1}{mean:>10.1}{t:>12.1}");
        medians.push((y, mean));
    }
    if let ([(a, am), (b, bm)], [first, second]) = (&medians[..], &names[..]) {
        println!(
            "{first} / {second}: {:.2}× by median cycle, {:.2}× by mean (speed: higher is faster)",
            b / a.max(f64::MIN_POSITIVE),
            bm / am.max(f64::MIN_POSITIVE)
        );
    }
    Ok(())
}

/// The calling thread's time on a CPU so far, ns (0 where the kernel does
/// not say).
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
