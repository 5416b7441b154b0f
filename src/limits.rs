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

pub use crate::guard::{DEFAULT_LEASE, DEFAULT_RETENTION};
pub use crate::json_pointer::{MAX_JSON_FIELDS, MAX_POINTER_BYTES};
pub use crate::key::{MAX_ID_BYTES, MAX_SCOPE_BYTES};
pub use crate::response::{
    DEFAULT_MAX_BODY_BYTES, MAX_BODY_BYTES_HARD_CAP, MAX_HEADER_BYTES, MAX_HEADERS,
};
pub use crate::store::MAX_SWEEP_BATCH;
pub use crate::sweeper::{DEFAULT_SWEEP_BATCH, DEFAULT_SWEEP_INTERVAL, SWEEPER_JOIN_TIMEOUT};
