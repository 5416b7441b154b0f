//! Simulated power loss for the redb backend (feature `test-util`; hidden:
//! test support, not a stable API).
//!
//! - `backend.rs`: [`CrashBackend`], a redb storage backend that keeps the
//!   file as last synced plus the writes since, and yields the file a power
//!   loss would leave (synced + a seeded subset of the unsynced writes, torn
//!   at 512-byte sectors);
//! - `raw.rs`: the same checks against plain redb, which proves the
//!   backend and the checks before they judge idemstore;
//! - `rng.rs`: the seeded generator behind every choice.
//!
//! The crash tests under `tests/it/crash.rs` and the `crash_recovery` fuzz
//! target call the same functions.

mod backend;
mod raw;
mod rng;

pub use backend::{CrashBackend, CrashImage, SECTOR_BYTES, SyncMode};
pub use raw::{RawRun, raw_redb_run};
pub use rng::Rng;
