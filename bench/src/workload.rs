//! The cycle workload: each client claims a fresh key durably, completes it
//! durably with a response, and (with `dup_ratio`) re-sends a key it already
//! completed, which must replay.

use crate::peers::{Backend, BoxResult, Claimed, percentile};
use crate::procstat::peak_rss_bytes;
use idemstore::{Clock, Fingerprint, Key, Response, SystemClock};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// One run of the cycle workload.
#[derive(Clone, Debug)]
pub struct Params {
    /// Load threads, one client each.
    pub clients: usize,
    /// The share (0..=1) of requests that re-send a completed key.
    pub dup_ratio: f64,
    /// The size of each stored response body.
    pub response_bytes: usize,
    /// How long the load runs.
    pub duration: Duration,
}

/// What a run measured; its fields are `loadgen --json`'s, in this order.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// The backend's label ([`Backend::name`]).
    pub backend: String,
    /// Load threads.
    pub clients: usize,
    /// Completed cycles (claim + completion) per second.
    pub cycles_per_sec: f64,
    /// Claims of fresh keys per second.
    pub claims_per_sec: f64,
    /// Median claim latency, µs.
    pub claim_p50_us: f64,
    /// 99th-percentile claim latency, µs.
    pub claim_p99_us: f64,
    /// Re-sent keys answered as replays, per second.
    pub replay_per_sec: f64,
    /// Average requests per commit, where the backend batches.
    pub avg_batch: Option<f64>,
    /// Bytes on disk at the end.
    pub file_bytes: u64,
    /// The process's peak resident set size ([`peak_rss_bytes`]).
    pub peak_rss_bytes: u64,
    /// Completed cycles in all.
    pub cycles: u64,
    /// The run's length.
    pub seconds: f64,
}

impl Report {
    /// One JSON line (`loadgen --json`; other tools read these fields).
    pub fn json(&self) -> String {
        let batch = self
            .avg_batch
            .map_or("null".to_owned(), |b| format!("{b:.2}"));
        format!(
            "{{\"backend\":\"{}\",\"clients\":{},\"cycles_per_sec\":{:.1},\"claims_per_sec\":{:.1},\"claim_p50_us\":{:.1},\"claim_p99_us\":{:.1},\"replay_per_sec\":{:.1},\"avg_batch\":{},\"file_bytes\":{},\"peak_rss_bytes\":{},\"cycles\":{},\"seconds\":{:.3}}}",
            self.backend.replace('"', "'"),
            self.clients,
            self.cycles_per_sec,
            self.claims_per_sec,
            self.claim_p50_us,
            self.claim_p99_us,
            self.replay_per_sec,
            batch,
            self.file_bytes,
            self.peak_rss_bytes,
            self.cycles,
            self.seconds
        )
    }
}

static RUN: AtomicU64 = AtomicU64::new(0);

/// Fills the backend with `keys` completed records (the scale test's live data).
pub fn prefill(
    backend: &dyn Backend,
    keys: u64,
    clients: usize,
    response_bytes: usize,
) -> BoxResult<()> {
    let next = AtomicU64::new(0);
    let response = Response::new(200, vec![b'r'; response_bytes]);
    std::thread::scope(|s| -> BoxResult<()> {
        let handles: Vec<_> = (0..clients.max(1))
            .map(|_| {
                s.spawn(|| -> BoxResult<()> {
                    let mut client = backend.client()?;
                    loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        if n >= keys {
                            return Ok(());
                        }
                        let key = Key::new("prefill", format!("p{n}"))?;
                        let now = SystemClock.now();
                        if let Claimed::Owned(t) =
                            client.claim(&key, &Fingerprint::of(n.to_be_bytes()), now)?
                        {
                            client.complete(&key, t, &response, now)?;
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "prefill thread panicked")??;
        }
        Ok(())
    })
}

/// Runs the cycle workload and measures it.
pub fn run(backend: &dyn Backend, p: &Params) -> BoxResult<Report> {
    let run_id = RUN.fetch_add(1, Ordering::Relaxed);
    let response = Response::new(200, vec![b'x'; p.response_bytes]);
    let barrier = Barrier::new(p.clients + 1);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let per_thread = std::thread::scope(|s| -> BoxResult<Vec<(Vec<f64>, u64, u64)>> {
        let handles: Vec<_> = (0..p.clients)
            .map(|t| {
                let (barrier, stop, response) = (&barrier, Arc::clone(&stop), &response);
                s.spawn(move || -> BoxResult<(Vec<f64>, u64, u64)> {
                    let mut client = backend.client()?;
                    let mut rng = (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ run_id;
                    let mut latencies = Vec::with_capacity(1 << 16);
                    let (mut cycles, mut replays) = (0u64, 0u64);
                    let mut done: Vec<u64> = Vec::new();
                    barrier.wait();
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let dup =
                            !done.is_empty() && (rng % 10_000) as f64 / 10_000.0 < p.dup_ratio;
                        let id = if dup {
                            done.get((rng as usize / 7) % done.len())
                                .copied()
                                .unwrap_or(0)
                        } else {
                            n += 1;
                            n
                        };
                        let key = Key::new(format!("run{run_id}"), format!("c{t}-{id}"))?;
                        let fp = Fingerprint::of(id.to_be_bytes());
                        let now = SystemClock.now();
                        let started = Instant::now();
                        match client.claim(&key, &fp, now)? {
                            Claimed::Owned(ticket) => {
                                latencies.push(started.elapsed().as_secs_f64() * 1e6);
                                client.complete(&key, ticket, response, SystemClock.now())?;
                                cycles += 1;
                                if done.len() < 4096 {
                                    done.push(id);
                                }
                            }
                            Claimed::Replay => replays += 1,
                            Claimed::Busy => {
                                return Err(format!("key {key} unexpectedly busy").into());
                            }
                        }
                    }
                    Ok((latencies, cycles, replays))
                })
            })
            .collect();
        barrier.wait();
        let started = Instant::now();
        std::thread::sleep(p.duration);
        stop.store(true, Ordering::Relaxed);
        let mut out = Vec::new();
        for h in handles {
            out.push(h.join().map_err(|_| "load thread panicked")??);
        }
        let _ = started;
        Ok(out)
    })?;
    let seconds = p.duration.as_secs_f64();
    let mut latencies: Vec<f64> = per_thread
        .iter()
        .flat_map(|(l, _, _)| l.iter().copied())
        .collect();
    let cycles: u64 = per_thread.iter().map(|(_, c, _)| c).sum();
    let replays: u64 = per_thread.iter().map(|(_, _, r)| r).sum();
    Ok(Report {
        backend: backend.name(),
        clients: p.clients,
        cycles_per_sec: cycles as f64 / seconds,
        claims_per_sec: latencies.len() as f64 / seconds,
        claim_p50_us: percentile(&mut latencies, 0.50),
        claim_p99_us: percentile(&mut latencies, 0.99),
        replay_per_sec: replays as f64 / seconds,
        avg_batch: backend.avg_batch(),
        file_bytes: backend.file_bytes(),
        peak_rss_bytes: peak_rss_bytes(),
        cycles,
        seconds,
    })
}
