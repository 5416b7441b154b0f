//! A durable, embedded idempotency store.
//!
//! Put every mutating request (or consumed message) through idemstore, and a
//! retry of the same intent gets the first result back instead of causing a
//! second side effect: a double click, a client timeout, a gateway retry or
//! a redelivered message charges a card once.
//!
//! ```
//! use idemstore::{Fingerprint, Guard, Key, MemoryStore, Outcome, Response};
//!
//! let guard = Guard::new(MemoryStore::new());
//! let key = Key::new("tenant-42", "order-1")?;          // (scope, Idempotency-Key)
//! let fp = Fingerprint::of(b"sku=A&qty=1");             // what the request asks for
//!
//! for attempt in 0..3 {
//!     let outcome = guard.run(&key, &fp, |claim| {
//!         // The side effect runs once; claim.token() is a fencing token to
//!         // pass downstream as the payment provider's idempotency key.
//!         Ok::<_, std::convert::Infallible>(Response::new(201, "charged"))
//!     });
//!     match outcome {
//!         Outcome::Executed(r) => assert_eq!(attempt, 0),
//!         Outcome::Replayed(r) => assert_eq!(r.body(), b"charged"),
//!         other => panic!("{other:?}"),
//!     }
//! }
//! # Ok::<(), idemstore::Error>(())
//! ```
//!
//! # The contract
//!
//! A record per [`Key`] holds the request [`Fingerprint`], a [`State`]
//! (PROCESSING or DONE), the [`Response`], a lease deadline, an expiry
//! deadline and a fencing token. [`Store::begin`] answers in one atomic step
//! with one of five cases (see its docs); [`Store::complete`] stores the
//! response, and only the holder of the current [`Claim`] may do it.
//! [`Guard`] wraps this into claim → execute → store, failing closed when the
//! store is down.
//!
//! # Limits
//!
//! | what | limit |
//! |---|---|
//! | key id | 1..=[`MAX_ID_BYTES`] bytes |
//! | key scope | 0..=[`MAX_SCOPE_BYTES`] bytes |
//! | response body | [`DEFAULT_MAX_BODY_BYTES`], configurable up to [`MAX_BODY_BYTES_HARD_CAP`] |
//! | response headers | [`MAX_HEADERS`] headers, [`MAX_HEADER_BYTES`] bytes in all |
//! | one sweep | [`MAX_SWEEP_BATCH`] records |
//!
//! # Features
//!
//! - `redb` (default): [`RedbStore`], the durable on-disk store on redb 4.x
//!   (group commit, expiry index, sweeper, poisoning, recovery on open).
//! - `redb` also gives [`Inbox`]: a message consumer's writes to its own tables
//!   commit in the same transaction as the message id's dedup record.
//! - `sled`: `SledStore`, the store on sled 0.34.7, fsynced for real.
//! - `postgres`: `PostgresStore`, the same contract in a PostgreSQL table shared by
//!   several replicas (one statement per call, fencing tokens from a sequence).
//! - `tokio`: [`Guard::run_async`].
//! - `tower`: HTTP middleware (`Idempotency-Key`), in [`tower`] (behaviour and status codes in its docs).
//! - `cli`: the `idemstore` operator binary (stats, get, list, evict, sweep,
//!   compact, verify, export, import); its entry point is [`cli::main`].
//! - `test-util`: [`ManualClock`], [`FaultyStore`] and the [`MemoryStore`] fault hook;
//!   with `redb`, also the (hidden, unstable) `crash` module: a redb storage
//!   backend that simulates power loss, used by the crash tests and fuzz targets.

#[cfg(feature = "cli")]
pub mod cli;
#[cfg_attr(
    not(feature = "redb"),
    allow(
        dead_code,
        reason = "the on-disk backends use the codec; a build without redb may use part of it"
    )
)]
mod codec;
#[cfg(all(feature = "test-util", feature = "redb"))]
#[doc(hidden)]
pub mod crash;
mod error;
mod fingerprint;
#[cfg(feature = "test-util")]
#[doc(hidden)]
pub mod fuzzing;
mod guard;
mod key;
mod logic;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
mod record;
#[cfg(feature = "redb")]
mod redb;
mod response;
#[cfg(feature = "sled")]
mod sled_store;
mod store;
mod sweeper;
#[cfg(feature = "test-util")]
mod testing;
mod time;
#[cfg(feature = "tower")]
pub mod tower;

#[cfg(feature = "redb")]
pub use crate::redb::{
    CHECKPOINT_INTERVAL, DEFAULT_CACHE_BYTES, Durability, FRAME_ALIGN, MAX_WRITE_BATCH,
    MEMTABLE_BYTES, MIN_WAL_BYTES, RecoveryPolicy, RedbStats, RedbStore, RedbStoreBuilder,
    WAL_BYTES, WRITE_QUEUE_DEPTH,
};
#[cfg(feature = "redb")]
pub use crate::redb::{Delivery, Inbox};
/// The redb crate the store is built on, for an [`Inbox`] handler's own
/// tables (`TableDefinition`, `ReadableTable`, `WriteTransaction`): the same
/// version as the store's, whatever the caller's own dependency says.
#[cfg(feature = "redb")]
pub use ::redb as redb_engine;
pub use error::{BoxError, Error, Result};
pub use fingerprint::Fingerprint;
pub use guard::{
    DEFAULT_LEASE, DEFAULT_RETENTION, Guard, GuardBuilder, GuardStats, OnHandlerError, Outcome,
    TakeoverPolicy,
};
pub use key::{Key, MAX_ID_BYTES, MAX_SCOPE_BYTES};
pub use memory::{MemoryStore, Op};
#[cfg(feature = "postgres")]
pub use postgres::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_POOL_SIZE, DEFAULT_STATEMENT_TIMEOUT, DEFAULT_TABLE,
    MAX_BEGIN_ATTEMPTS, MAX_POOL_SIZE, MAX_TABLE_NAME_BYTES, PostgresStore, PostgresStoreBuilder,
};
pub use record::{Begin, Claim, Record, State};
pub use response::{
    DEFAULT_MAX_BODY_BYTES, MAX_BODY_BYTES_HARD_CAP, MAX_HEADER_BYTES, MAX_HEADERS, Response,
};
#[cfg(feature = "sled")]
pub use sled_store::{
    SLED_BLOB_THRESHOLD_BYTES, SledDurability, SledStats, SledStore, SledStoreBuilder,
};
pub use store::{MAX_SWEEP_BATCH, Store};
pub use sweeper::{
    DEFAULT_SWEEP_BATCH, DEFAULT_SWEEP_INTERVAL, SWEEPER_JOIN_TIMEOUT, Sweeper, SweeperConfig,
};
#[cfg(feature = "test-util")]
pub use testing::FaultyStore;
#[cfg(any(test, feature = "test-util"))]
pub use time::ManualClock;
pub use time::{Clock, SystemClock, Timestamp};

/// The README's examples are compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
