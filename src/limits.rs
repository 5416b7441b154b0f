//! Every limit and default of the contract, in one place.
//!
//! Backend-specific limits live with their backend (`idemstore::redb`,
//! `idemstore::sled`, `idemstore::postgres`).
//!
//! ```
//! use idemstore::limits::{MAX_ID_BYTES, MAX_SCOPE_BYTES};
//! use idemstore::Key;
//!
//! assert!(Key::new("t", "x".repeat(MAX_ID_BYTES)).is_ok());
//! assert!(Key::new("t", "x".repeat(MAX_ID_BYTES + 1)).is_err());
//! assert!(Key::new("s".repeat(MAX_SCOPE_BYTES + 1), "k").is_err());
//! ```

#[cfg(any(feature = "redb", feature = "postgres"))]
pub use crate::delivery::MAX_INBOX_BATCH;
pub use crate::json_pointer::{MAX_JSON_FIELDS, MAX_POINTER_BYTES};
pub use crate::key::{MAX_ID_BYTES, MAX_SCOPE_BYTES};
pub use crate::response::{
    DEFAULT_MAX_BODY_BYTES, MAX_BODY_BYTES_HARD_CAP, MAX_HEADER_BYTES, MAX_HEADERS,
};
pub use crate::step::{MAX_STEP_NAME_BYTES, MAX_STEP_OUTPUT_BYTES, MAX_STEPS, MAX_STEPS_BYTES};
pub use crate::store::MAX_SWEEP_BATCH;

use std::time::Duration;

/// Default lease: how long an owner may run before its claim can be taken
/// over.
///
/// ```
/// use idemstore::{Guard, MemoryStore, limits::DEFAULT_LEASE};
/// assert_eq!(Guard::new(MemoryStore::new()).lease(), DEFAULT_LEASE);
/// ```
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Default retention: how long duplicates are recognised (24 h, the longest
/// common client and gateway retry horizon).
///
/// ```
/// use idemstore::{Guard, MemoryStore, limits::DEFAULT_RETENTION};
/// assert_eq!(Guard::new(MemoryStore::new()).retention(), DEFAULT_RETENTION);
/// ```
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Default pause between a [`Sweeper`](crate::Sweeper)'s sweeps.
pub(crate) const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(60);
/// Default records deleted per `sweep_expired` call of a
/// [`Sweeper`](crate::Sweeper).
pub(crate) const DEFAULT_SWEEP_BATCH: usize = 1_000;
