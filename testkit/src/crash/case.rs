//! The `crash_recovery` fuzz target's input, shared with the corpus replay
//! under `cargo test`.

use super::backend::{SyncMode, TornSectors};
use super::recovery::{RunReport, store_run_steps};
use super::workload::Step;

/// Most steps one case runs (longer inputs are cut), to keep an execution fast.
pub const MAX_CASE_STEPS: usize = 96;
/// Most crash points one case takes.
pub const MAX_CASE_POINTS: usize = 4;

/// A power-loss case chosen by the fuzzer: crash points (as backend
/// mutation counts), the seeds that choose which unsynced writes survive,
/// the number of keys, and one thread's steps.
#[derive(Clone, Debug, arbitrary::Arbitrary)]
pub struct CrashCase {
    /// `(mutation count, survival seed)`; a count past the run's end is a
    /// crash after the store closed.
    pub points: Vec<(u16, u64)>,
    /// Keys (`1 + keys % MAX_KEYS_PER_THREAD`); its high bit puts the
    /// write-ahead log on a disk whose torn sectors read back as garbage
    /// ([`TornSectors::Garbage`]).
    pub keys: u8,
    /// The steps.
    pub steps: Vec<Step>,
}

/// Decodes `data` as a [`CrashCase`] (the same way in the fuzz target and
/// in the corpus replay), runs it on the real `RedbStore`, and checks every
/// crash image. Panics with a description on any failure. The store file's
/// sectors are written atomically ([`TornSectors::OldOrNew`]: redb keeps
/// its header and both commit slots in one sector); the log's are garbage
/// when the high bit of `keys` is set (bits the key count does not use, so
/// the committed corpus keeps its key counts).
pub fn crash_recovery(data: &[u8]) -> RunReport {
    use arbitrary::Arbitrary;
    let Ok(mut case) = CrashCase::arbitrary_take_rest(arbitrary::Unstructured::new(data)) else {
        return RunReport::default();
    };
    case.steps.truncate(MAX_CASE_STEPS);
    case.points.truncate(MAX_CASE_POINTS);
    if case.points.is_empty() {
        case.points.push((u16::MAX, 0));
    }
    let points: Vec<(u64, u64)> = case
        .points
        .iter()
        .map(|&(at, seed)| (u64::from(at), seed))
        .collect();
    let keys = 1 + case.keys % super::workload::MAX_KEYS_PER_THREAD;
    match store_run_steps(
        case.steps,
        keys,
        &points,
        SyncMode::Honest,
        (
            TornSectors::OldOrNew,
            if case.keys & 0x80 != 0 {
                TornSectors::Garbage
            } else {
                TornSectors::OldOrNew
            },
        ),
    ) {
        Ok(report) => report,
        Err(e) => panic!("crash_recovery: {e}"),
    }
}
