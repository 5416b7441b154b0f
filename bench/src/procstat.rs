//! This process's resources, from `/proc/self` (Linux; zeros elsewhere):
//! peak RSS, the thread count sampled while a load runs, and the
//! file-descriptor limit a load with thousands of sockets needs.

use crate::peers::BoxResult;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often [`ThreadSampler`] reads `/proc/self/status`.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// A numeric field of `/proc/self/status` (`Threads`, `VmRSS`, `VmHWM`, ...);
/// sizes are in KiB there.
pub fn status_field(name: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|line| {
        let (field, value) = line.split_once(':')?;
        (field == name)
            .then(|| value.split_whitespace().next()?.parse().ok())
            .flatten()
    })
}

/// Peak resident set size of this process (Linux `VmHWM`), 0 elsewhere.
pub fn peak_rss_bytes() -> u64 {
    status_field("VmHWM").map_or(0, |kb| kb * 1024)
}

/// This process's threads now, 0 where `/proc` is missing.
pub fn threads() -> u64 {
    status_field("Threads").unwrap_or(0)
}

/// Samples [`threads`] every [`SAMPLE_EVERY`] on a thread of its own (which
/// it counts) until [`ThreadSampler::stop`], and keeps the peak.
pub struct ThreadSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl ThreadSampler {
    /// Starts sampling.
    pub fn start() -> BoxResult<ThreadSampler> {
        let (peak, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (p, s) = (Arc::clone(&peak), Arc::clone(&stop));
        let handle = std::thread::Builder::new()
            .name("thread-sampler".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    p.fetch_max(threads(), Ordering::Relaxed);
                    std::thread::sleep(SAMPLE_EVERY);
                }
            })?;
        Ok(ThreadSampler {
            peak,
            stop,
            handle: Some(handle),
        })
    }

    /// The peak so far.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Stops sampling; returns the peak.
    pub fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.peak()
    }
}

/// Makes room for `needed` open files: raises the soft `RLIMIT_NOFILE` up to
/// the hard limit when it is lower, and says clearly when even the hard limit
/// is too low. Returns the soft limit in force.
pub fn ensure_open_files(needed: u64) -> BoxResult<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    if soft >= needed {
        return Ok(soft);
    }
    let hard = limit.maximum.unwrap_or(u64::MAX);
    if hard < needed {
        return Err(format!(
            "this run needs about {needed} open files, and RLIMIT_NOFILE allows {hard} \
             (hard limit); raise it (ulimit -Hn, /etc/security/limits.conf) or use fewer connections"
        )
        .into());
    }
    setrlimit(
        Resource::Nofile,
        rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        },
    )
    .map_err(|e| format!("raising RLIMIT_NOFILE from {soft} to {hard}: {e}"))?;
    Ok(hard)
}
