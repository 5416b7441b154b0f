//! Simulated power loss (DESIGN.md §4, invariant 2): the file a crash would
//! leave — synced bytes plus a seeded subset of the unsynced writes, torn at
//! 512-byte sectors — is reopened and checked, at thousands of crash points.
//!
//! `IDEMSTORE_CRASH_POINTS=N` raises the number of crash points for a soak
//! (the default keeps CI well under a minute).

use idemstore::crash::{RunConfig, RunReport, SyncMode, raw_redb_run, store_run};

/// Crash points per test, from `IDEMSTORE_CRASH_POINTS` (a soak) or `default`.
fn crash_points(default: usize) -> usize {
    std::env::var("IDEMSTORE_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A power loss must never cost plain redb an acknowledged durable commit,
/// nor leave half a commit: if redb itself failed this, no store on it could
/// be crash-safe, and the simulation would be wrong.
#[test]
fn raw_redb_keeps_every_acknowledged_commit() {
    let points = crash_points(300);
    let mut total = 0;
    for seed in 0..(points as u64).div_ceil(50) {
        let run = raw_redb_run(seed, 60, 50, SyncMode::Honest).unwrap();
        total += run.crash_points;
        assert!(run.acked_checked > 0);
    }
    eprintln!("raw redb: {total} crash points");
}

/// The test of the test: a disk whose fsync lies (redb acknowledges commits
/// that are not durable) must be caught by the same checks.
#[test]
fn raw_redb_on_a_lying_fsync_is_caught() {
    let caught = (0..4)
        .filter(|&seed| raw_redb_run(seed, 60, 50, SyncMode::Lies).is_err())
        .count();
    assert_eq!(caught, 4, "a lost acknowledged commit went unnoticed");
}

/// An acknowledged claim or completion must survive a power loss at any
/// instant, the write in flight must be all or nothing, and a retry after
/// reopening must not claim a key whose claim was acknowledged (a second
/// execution of the side effect inside the lease). Three runs in four use
/// the write-ahead log (the default; a small log, so runs cross many
/// log-full checkpoints), one in four a durable redb commit per batch.
#[test]
fn redb_store_survives_power_loss_at_every_point() {
    let want = crash_points(2_000) as u64;
    let mut total = RunReport::default();
    let mut logged = RunReport::default();
    let mut seed = 0;
    while total.crash_points < want {
        let cfg = RunConfig {
            seed,
            log: seed % 4 != 3,
            ..RunConfig::default()
        };
        let run = store_run(&cfg).unwrap();
        if cfg.log {
            logged += run;
        }
        total += run;
        seed += 1;
    }
    eprintln!("redb store: {seed} runs, {total:?}; with the log: {logged:?}");
    assert!(total.inflight_checked > 0 && total.replays_checked > 0 && total.takeovers_checked > 0);
    assert!(logged.crash_points > 0 && logged.crash_points < total.crash_points);
}

/// The test of the test: a store that acknowledges before its data is
/// durable must fail the power-loss checks, on every seed tried — whether
/// its fsync persists nothing, or persists one commit late. With the token
/// check left out, the per-key check must still catch lost writes.
#[test]
fn redb_store_acknowledging_before_fsync_is_caught() {
    let mut per_key_catches = 0;
    for sync in [SyncMode::Lies, SyncMode::Lags] {
        for (seed, skip_token_check) in [(0, false), (1, false), (2, true), (3, true), (4, true)] {
            let cfg = RunConfig {
                seed,
                threads: 1, // deterministic: one client, batches of one
                steps_per_thread: 40,
                sync,
                skip_token_check,
                log: seed != 1, // both ways of making a batch durable
                ..RunConfig::default()
            };
            let err = store_run(&cfg).expect_err("acknowledged writes were lost unnoticed");
            eprintln!("{sync:?} caught: {err}");
            if err.contains("last acknowledged write") {
                per_key_catches += 1;
            }
        }
    }
    assert!(
        per_key_catches >= 2,
        "the per-key check alone caught {per_key_catches}"
    );
}
