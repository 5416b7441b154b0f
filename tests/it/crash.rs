//! Simulated power loss (DESIGN.md §4, invariant 2): the file a crash would
//! leave — synced bytes plus a seeded subset of the unsynced writes, torn at
//! 512-byte sectors — is reopened and checked, at thousands of crash points.
//!
//! `IDEMSTORE_CRASH_POINTS=N` raises the number of crash points for a soak
//! (the default keeps CI well under a minute).

use idemstore::crash::{SyncMode, raw_redb_run};

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
