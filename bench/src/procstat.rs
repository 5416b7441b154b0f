//! This process's resources, from `/proc/self` (Linux; zeros elsewhere):
//! peak RSS, the thread count sampled while a load runs, the CPU time spent
//! (by the whole process, and by the threads whose names start with a
//! prefix), and the file-descriptor limit a load with thousands of sockets
//! needs.

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

/// Clock ticks per second of `/proc`'s CPU times (`USER_HZ`: 100 on every
/// Linux the kernel's ABI supports).
const USER_HZ: f64 = 100.0;

/// User plus system CPU time in a `stat` line, in seconds: fields 14 and 15,
/// counted after the `)` that ends the (thread) name.
fn stat_cpu_seconds(stat: &str) -> Option<f64> {
    let rest = stat.rsplit_once(')')?.1;
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / USER_HZ)
}

/// CPU seconds this process has used so far, threads that ended included
/// (0 where `/proc` is missing).
pub fn process_cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| stat_cpu_seconds(&s))
        .unwrap_or(0.0)
}

/// CPU seconds used so far by this process's live threads whose name
/// starts with `prefix` (names are cut to 15 bytes by the kernel).
pub fn threads_cpu_seconds(prefix: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("stat")).ok())
        .filter(|stat| {
            stat.split_once('(')
                .is_some_and(|(_, name)| name.starts_with(prefix))
        })
        .filter_map(|stat| stat_cpu_seconds(&stat))
        .sum()
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
