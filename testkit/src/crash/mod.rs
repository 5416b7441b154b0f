//! Simulated power loss for the redb backend (feature `test-util`; hidden:
//! test support, not a stable API).
//!
//! - `backend.rs`: [`CrashBackend`], a redb storage backend that keeps the
//!   file as last synced plus the writes since, and yields the file a power
//!   loss would leave (synced + a seeded subset of the unsynced writes, torn
//!   at 512-byte sectors; with [`TornSectors::Garbage`], sectors being
//!   written may also read back as garbage), and fails calls on demand
//!   (the n-th read, write, sync or resize of a file, once or from then on:
//!   [`Injection`], with the call counts a sweep needs in [`IoCounts`]);
//! - `raw.rs`: the same kind of check against plain redb, which proves the
//!   backend and the checking before they judge idemstore;
//! - `workload.rs`: logged begin/complete/release/sweep threads on the real
//!   `RedbStore`; `recovery.rs`: crash images of a run, reopened and checked
//!   (the store file by idemstore's own verifier, `redb::admin`);
//! - `ops.rs`: the `store_ops` model property on `RedbStore`, each reopen
//!   a power loss;
//! - `case.rs`: the `crash_recovery` fuzz target's input and entry point;
//! - `rng.rs`: the seeded generator behind every choice.
//!
//! The crash tests in `tests/it/crash.rs` and the `crash_recovery` fuzz
//! target call the same functions.

mod backend;
mod case;
mod ops;
mod raw;
mod recovery;
mod rng;
mod workload;

pub use backend::{
    CrashBackend, CrashImage, Fault, FaultOn, Injection, IoCounts, SECTOR_BYTES, SyncMode,
    TornSectors,
};
pub use case::{CrashCase, MAX_CASE_POINTS, MAX_CASE_STEPS, crash_recovery};
pub use ops::store_ops_power_loss;
pub use raw::{RawRun, raw_redb_run, raw_redb_run_all_points};
pub use recovery::{
    FailedPoint, RunConfig, RunReport, TEST_WAL_BYTES, store_run, store_run_all_points,
    store_run_steps,
};
pub use rng::Rng;
pub use workload::{LEASE, LONG_RETENTION, MAX_KEYS_PER_THREAD, SHORT_RETENTION, Step, T0};
