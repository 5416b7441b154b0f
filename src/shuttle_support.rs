//! The model checker's runner, shared by the scenarios of the redb commit
//! line (`src/redb/shuttle_tests.rs`) and of the guard's renewal timer
//! (`src/guard/renew.rs`): how many schedules, the step bound, the stack,
//! the watchdog, and the replay of a failing schedule. Built only with
//! `--cfg shuttle` (`scripts/shuttle-tests`; docs/testing.md).

use shuttle::scheduler::{PctScheduler, RandomScheduler, Scheduler};
use shuttle::{Config, MaxSteps, Runner};
use std::io::Write;
use std::sync::{Arc, mpsc};
use std::time::Duration;

/// Schedules per scheduler and scenario, unless `IDEMSTORE_SHUTTLE_SCHEDULES`
/// says otherwise.
const DEFAULT_SCHEDULES: usize = 100;
/// PCT's bug depth: the ordering constraints a bug may need (PCT places
/// one priority change fewer in each schedule).
const PCT_DEPTH: usize = 3;
/// Scheduling points one run may take. A run of these scenarios takes
/// fewer than 1,000; a thread that loops without blocking reaches the bound.
const MAX_STEPS: usize = 20_000;
/// Each Shuttle thread's stack (the default 60 KiB is too little for redb
/// under an unoptimised build of this crate).
const STACK_BYTES: usize = 1 << 20;
/// Wall-clock time one scheduler's runs of a scenario may take, unless
/// `IDEMSTORE_SHUTTLE_WATCHDOG_SECS` says otherwise, before the watchdog
/// aborts the test binary: a run that blocks inside redb, outside
/// Shuttle's control, would otherwise hang (src/sync.rs).
const WATCHDOG: Duration = Duration::from_secs(300);

pub(crate) fn schedules() -> usize {
    std::env::var("IDEMSTORE_SHUTTLE_SCHEDULES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(DEFAULT_SCHEDULES)
}

fn watchdog() -> Duration {
    std::env::var("IDEMSTORE_SHUTTLE_WATCHDOG_SECS")
        .ok()
        .and_then(|n| n.parse().ok())
        .map_or(WATCHDOG, Duration::from_secs)
}

fn config() -> Config {
    let mut config = Config::new();
    config.max_steps = MaxSteps::FailAfter(MAX_STEPS);
    config.stack_size = STACK_BYTES;
    // Shuttle warns that its atomics are sequentially consistent whatever
    // the ordering asked (the write path relies on no weaker one: its
    // atomics are flags and a timestamp beside its locks) and that lazy
    // statics are dropped after each run (the virtual clock should be).
    config.silence_warnings = true;
    config
}

/// Runs `f` under `schedules()` random schedules, then as many PCT ones
/// (`shuttle::check_random` and `check_pct`, with this module's stack
/// size and step bound, under a watchdog); or, when
/// `IDEMSTORE_SHUTTLE_REPLAY` names a file holding a failing schedule (the
/// string a failure prints), that schedule alone.
pub(crate) fn explore(name: &str, f: impl Fn() + Send + Sync + 'static) {
    let n = schedules();
    let f = Arc::new(f);
    if let Ok(path) = std::env::var("IDEMSTORE_SHUTTLE_REPLAY") {
        let scheduler =
            shuttle::scheduler::ReplayScheduler::new_from_file(path).expect("a schedule");
        Runner::new(scheduler, config()).run(move || f());
        return;
    }
    let run = |scheduler: Box<dyn Scheduler + Send>, label: &str| {
        let (done, watched) = mpsc::channel::<()>();
        let what = format!("{name} ({label})");
        let limit = watchdog();
        let watchdog = std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = watched.recv_timeout(limit) {
                // Past the test harness's capture, which an abort loses.
                let _ = writeln!(
                    std::io::stderr(),
                    "{what}: no answer in {limit:?}: a run blocked outside the model \
                     checker's control (a std lock in redb or a backend?)"
                );
                std::process::abort();
            }
        });
        let f = Arc::clone(&f);
        Runner::new(scheduler, config()).run(move || f());
        let _ = done.send(());
        let _ = watchdog.join();
    };
    run(Box::new(RandomScheduler::new(n)), "random");
    run(Box::new(PctScheduler::new(PCT_DEPTH, n)), "PCT");
}
