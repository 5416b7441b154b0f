//! Simulated power loss (DESIGN.md §4, invariant 2): the file a crash would
//! leave — synced bytes plus a seeded subset of the unsynced writes, torn at
//! 512-byte sectors — is reopened and checked, at thousands of crash points.
//!
//! `IDEMSTORE_CRASH_POINTS=N` raises the number of crash points for a soak
//! (the default keeps CI well under a minute).
//!
//! By default a sector is written atomically (old or new). The garbage-sector
//! tests run the same workload on a disk where a sector being written may
//! read back as garbage ([`TornSectors::Garbage`]). With garbage on the log
//! only, every acknowledged write survives (frames are 4 KiB-aligned). With
//! garbage on the store file too, redb loses its header sector: that test is
//! `#[ignore]`d (see its reason):
//! `cargo test --all-features --test it crash -- --ignored --nocapture`.

use idemstore_testkit::crash::{
    FailedPoint, RunConfig, RunReport, SyncMode, TornSectors, raw_redb_run,
    raw_redb_run_all_points, store_run, store_run_all_points,
};

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
/// execution of the side effect inside the lease). A small write-ahead
/// log, so runs cross many log-full checkpoints.
#[test]
fn redb_store_survives_power_loss_at_every_point() {
    let want = crash_points(2_000) as u64;
    let mut total = RunReport::default();
    let mut seed = 0;
    while total.crash_points < want {
        let cfg = RunConfig {
            seed,
            ..RunConfig::default()
        };
        total += store_run(&cfg).unwrap();
        seed += 1;
    }
    eprintln!("redb store: {seed} runs, {total:?}");
    assert!(total.inflight_checked > 0 && total.replays_checked > 0 && total.takeovers_checked > 0);
}

/// The main test with each step slowed between reading the shared clock
/// and its call, so that sweeps on other threads often run at a later time
/// than a step in flight and delete records that step sees as unexpired:
/// the run's own checks must tell that from a lost record.
#[test]
fn redb_store_sweeps_later_than_a_step_in_flight() {
    let mut total = RunReport::default();
    for seed in 0..16 {
        let cfg = RunConfig {
            seed,
            threads: 8,
            stride: 20,
            step_delay: std::time::Duration::from_millis(3),
            ..RunConfig::default()
        };
        total += store_run(&cfg).unwrap();
    }
    eprintln!("redb store, slowed steps: {total:?}");
    assert!(total.swept_in_flight > 0, "no sweep overtook a step");
    assert!(total.crash_points > 0 && total.acked_checked > 0);
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

/// The main test's runs for `want` crash points, on a disk whose sectors
/// being written read back as `store_file` and `log_file` say, every point
/// checked. Prints what passed and each failure; returns the failures.
fn torn_sector_runs(want: u64, store_file: TornSectors, log_file: TornSectors) -> Vec<FailedPoint> {
    let mut passed = RunReport::default();
    let mut failed: Vec<FailedPoint> = Vec::new();
    let mut seed = 0;
    while passed.crash_points + (failed.len() as u64) < want {
        let cfg = RunConfig {
            seed,
            torn_store_file: store_file,
            torn_log: log_file,
            ..RunConfig::default()
        };
        let (run, failures) = store_run_all_points(&cfg).unwrap();
        passed += run;
        failed.extend(failures);
        seed += 1;
    }
    let points = passed.crash_points + failed.len() as u64;
    let refused = failed
        .iter()
        .filter(|f| f.error.contains("refused the image"))
        .count();
    eprintln!(
        "store file {store_file:?}, log {log_file:?}: {seed} runs, {} of {points} crash points \
         failed ({refused} were images the store refused to open, the others lost acknowledged \
         writes); passed: {passed:?}",
        failed.len()
    );
    for f in failed.iter().take(12) {
        eprintln!("  {f}");
    }
    assert!(passed.crash_points > 0 && passed.acked_checked > 0);
    failed
}

/// The main power-loss test on a disk that does not write a sector
/// atomically ([`TornSectors::Garbage`] on both files): at a crash, any
/// sector touched by a write since the last sync may read back as garbage,
/// also the bytes of it the write did not cover. Same runs (three in four
/// with the log), same checks, as many crash points; every point is
/// checked, and the failure message counts the points that failed.
///
/// Ignored: no store on redb 4.x can pass it. redb rewrites its 320-byte
/// header (magic number, god byte, both commit slots) in place, in sector
/// 0, at every durable commit; a garbled sector 0 is a file no one can
/// open. redb documents that it assumes sector writes that never change
/// bytes outside the write ("powersafe overwrite"), which this mode breaks
/// on purpose. See [`raw_redb_loses_its_header_to_a_garbage_sector`] and,
/// for the log on its own, [`redb_store_log_survives_garbage_sectors`].
#[test]
#[ignore = "redb 4.x rewrites its header (magic number and both commit slots) in sector 0 at every \
            durable commit: a garbled sector 0 loses the store file (the log alone passes: \
            redb_store_log_survives_garbage_sectors)"]
fn redb_store_survives_power_loss_with_garbage_sectors() {
    let failed = torn_sector_runs(
        crash_points(2_000) as u64,
        TornSectors::Garbage,
        TornSectors::Garbage,
    );
    assert!(failed.is_empty(), "{} crash points failed", failed.len());
}

/// The log's share of the contract: with the store file written as redb
/// assumes (a sector old or new) and the write-ahead log on sectors that
/// may read back as garbage ([`TornSectors::Garbage`]), every acknowledged
/// write survives. A frame must never share a sector with an acknowledged
/// frame before it, nor anything else the log needs after a crash. As
/// many crash points as the main test.
/// Frames start on 4 KiB boundaries ([`idemstore::unstable::redb::FRAME_ALIGN`]); with
/// the format-2 log, whose frames followed each other, 11 % of crash
/// points lost acknowledged writes here.
#[test]
fn redb_store_log_survives_garbage_sectors() {
    let failed = torn_sector_runs(
        crash_points(2_000) as u64,
        TornSectors::OldOrNew,
        TornSectors::Garbage,
    );
    assert!(failed.is_empty(), "{} crash points failed", failed.len());
}

/// Why the store-wide garbage test cannot pass on redb 4.x (a record of
/// redb's behaviour; if it fails, redb changed and that test may pass): on
/// plain redb, garbage sectors cost acknowledged durable commits, and every
/// image lost is one whose header sector (sector 0: magic number, god byte,
/// both commit slots) was being rewritten, which redb then refuses.
#[test]
fn raw_redb_loses_its_header_to_a_garbage_sector() {
    let (mut lost, mut passed) = (0, 0);
    for seed in 0..4 {
        let (run, failures) =
            raw_redb_run_all_points(seed, 60, 50, SyncMode::Honest, TornSectors::Garbage).unwrap();
        passed += run.crash_points;
        for f in &failures {
            assert!(f.contains("magic number mismatch"), "{f}");
        }
        lost += failures.len();
    }
    eprintln!(
        "raw redb, garbage sectors: {lost} of {} images refused",
        lost + passed as usize
    );
    assert!(lost > 0 && passed > 0);
}
