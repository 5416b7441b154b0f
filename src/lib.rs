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
//! store is down. A handler with several side effects runs each as a
//! [`Step`] ([`Claim::step`]): recorded on the key as it finishes, so a retry
//! after a crash resumes after the last one ([`Store::record_step`]).
//!
//! # Limits
//!
//! | what | limit |
//! |---|---|
//! | key id | 1..=[`MAX_ID_BYTES`](limits::MAX_ID_BYTES) bytes |
//! | key scope | 0..=[`MAX_SCOPE_BYTES`](limits::MAX_SCOPE_BYTES) bytes |
//! | response body | [`DEFAULT_MAX_BODY_BYTES`](limits::DEFAULT_MAX_BODY_BYTES), configurable up to [`MAX_BODY_BYTES_HARD_CAP`](limits::MAX_BODY_BYTES_HARD_CAP) |
//! | response headers | [`MAX_HEADERS`](limits::MAX_HEADERS) headers, [`MAX_HEADER_BYTES`](limits::MAX_HEADER_BYTES) bytes in all |
//! | steps of one record | [`MAX_STEPS`](limits::MAX_STEPS) steps, names of [`MAX_STEP_NAME_BYTES`](limits::MAX_STEP_NAME_BYTES) bytes, outputs of [`MAX_STEP_OUTPUT_BYTES`](limits::MAX_STEP_OUTPUT_BYTES), [`MAX_STEPS_BYTES`](limits::MAX_STEPS_BYTES) in all |
//! | one sweep | [`MAX_SWEEP_BATCH`](limits::MAX_SWEEP_BATCH) records |
//! | JSON fields in a fingerprint | [`MAX_JSON_FIELDS`](limits::MAX_JSON_FIELDS) pointers of at most [`MAX_POINTER_BYTES`](limits::MAX_POINTER_BYTES) bytes |
//!
//! # Where things are
//!
//! The root holds the contract ([`Store`] and its types), [`Guard`], the
//! clock, [`MemoryStore`], the [`Sweeper`] and the three store types. The rest
//! is in modules:
//!
//! - [`guard`]: the guard's builder, its policies and its counters;
//! - [`sweeper`]: the background sweeper and its error count;
//! - [`limits`]: every limit and default of the contract;
//! - [`logic`]: the state machine every backend decides with, and the
//!   native async entry's future type, public for backends written outside
//!   this crate (test them with the `idemstore-testkit` crate's conformance
//!   suite and its `FaultyStore`);
//! - `redb`, `sled`, `postgres`: each backend's builder, durability or
//!   options, statistics and limits (`redb` also has the `Inbox` and the
//!   `engine` re-export);
//! - `tower`: the HTTP middleware;
//! - [`observability`]: the metric names, and what the `tracing` and
//!   `metrics` features report.
//!
//! # Features
//!
//! - `redb` (default): `RedbStore`, the durable on-disk store on redb 4.x
//!   (group commit, expiry index, sweeper, poisoning, recovery on open).
//! - `redb` also gives `Inbox`: a message consumer's writes to its own tables
//!   commit in the same transaction as the message id's dedup record, a
//!   batch of messages per commit (`Inbox::handle_batch`).
//! - `sled`: `SledStore`, the store on sled 0.34.7, fsynced for real.
//! - `postgres`: `PostgresStore`, the same contract in a PostgreSQL table shared by
//!   several replicas (one statement per call, fencing tokens from a sequence).
//! - `tokio`: `Guard::run_async` (a store's native async entry where it has
//!   one, [`Store::begin_async`]; tokio's blocking pool otherwise).
//! - `tower`: HTTP middleware (`Idempotency-Key`), in `tower` (behaviour and status codes in its docs).
//! - `tracing`, `metrics`: spans and events, and counters, histograms and
//!   gauges, through those facades ([`observability`]).
//! - `test-util`: `ManualClock`. The conformance suite, the model,
//!   `FaultyStore`, the power-loss storage backend and the kill-test driver
//!   are in the `idemstore-testkit` crate.
//!
//! The `idemstore` operator binary (read-only inspection, explain, evict,
//! sweep, compact, verify, salvage, export, import) is a package of its
//! own, `idemstore-cli`, built on the public `redb::admin` API alone.

#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg_attr(
    not(feature = "redb"),
    allow(
        dead_code,
        reason = "the on-disk backends use the codec; a build without redb may use part of it"
    )
)]
mod codec;
#[cfg(any(feature = "redb", feature = "postgres"))]
mod delivery;
mod error;
mod fingerprint;
pub mod guard;
#[cfg(any(feature = "redb", feature = "sled"))]
mod holder;
mod json_pointer;
mod key;
pub mod limits;
pub mod logic;
mod memory;
pub mod observability;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
mod record;
#[cfg(feature = "redb")]
#[cfg_attr(docsrs, doc(cfg(feature = "redb")))]
pub mod redb;
mod response;
#[cfg(all(test, shuttle))]
mod shuttle_support;
#[cfg(feature = "sled")]
#[cfg_attr(docsrs, doc(cfg(feature = "sled")))]
pub mod sled;
mod step;
mod store;
pub mod sweeper;
// The locks, condvars, atomics and threads of the redb write path and the
// guard's renewal timer: std's, or the Shuttle model checker's under
// `--cfg shuttle` in tests.
mod sync;
mod time;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod tower;
#[cfg(feature = "unstable-internals")]
#[doc(hidden)]
pub mod unstable;

#[cfg(feature = "postgres")]
pub use crate::postgres::PostgresStore;
#[cfg(feature = "redb")]
pub use crate::redb::RedbStore;
#[cfg(feature = "sled")]
pub use crate::sled::SledStore;
pub use error::{BoxError, Cause, Error, Result};
pub use fingerprint::Fingerprint;
pub use guard::{Guard, Outcome};
pub use json_pointer::JsonPointer;
pub use key::Key;
pub use memory::MemoryStore;
pub use record::{Begin, Claim, Record, State};
pub use response::Response;
pub use step::Step;
pub use store::Store;
pub use sweeper::{Sweeper, SweeperConfig};
#[cfg(any(test, feature = "test-util"))]
pub use time::ManualClock;
pub use time::{Clock, SystemClock, Timestamp};

/// The README's examples are compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
