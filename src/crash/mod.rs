//! Simulated power loss for the redb backend (feature `test-util`; hidden:
//! test support, not a stable API).
//!
//! - `backend.rs`: [`CrashBackend`], a redb storage backend that keeps the
//!   file as last synced plus the writes since, and yields the file a power
//!   loss would leave (synced + a seeded subset of the unsynced writes, torn
//!   at 512-byte sectors);
//! - `raw.rs`: the same kind of check against plain redb, which proves the
//!   backend and the checking before they judge idemstore;
//! - `workload.rs`: logged begin/complete/release/sweep threads on the real
//!   `RedbStore`; `recovery.rs`: crash images of a run, reopened and checked;
//! - `inspect.rs`: a store file read below the API (records verified,
//!   record table and expiry index compared);
//! - `rng.rs`: the seeded generator behind every choice.
//!
//! The crash tests in `tests/it/crash.rs` and the `crash_recovery` fuzz
//! target call the same functions.

mod backend;
mod inspect;
mod raw;
mod recovery;
mod rng;
mod workload;

pub use backend::{CrashBackend, CrashImage, SECTOR_BYTES, SyncMode};
pub use inspect::{Inspection, inspect};
pub use raw::{RawRun, raw_redb_run};
pub use recovery::{RunConfig, RunReport, store_run, store_run_steps};
pub use rng::Rng;
pub use workload::{LEASE, LONG_RETENTION, MAX_KEYS_PER_THREAD, SHORT_RETENTION, Step, T0};
