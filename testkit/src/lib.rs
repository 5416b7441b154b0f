#![doc = include_str!("../README.md")]
//!
//! # Modules
//!
//! - [`conformance`](mod@conformance): the contract, case by case; [`conformance!`] makes one
//!   `#[test]` per case for your store, [`conformance::run_all`] runs them
//!   all and reports.
//! - [`model`]: an independent model of the contract and a checker that runs
//!   operation sequences (proptest strategies included) on a store and on
//!   the model side by side.
//! - [`kill`]: the process-kill test ([`kill_suite!`]): a child process runs
//!   guarded requests and is killed with SIGKILL; nothing acknowledged may be
//!   lost.
//! - `crash` (feature `redb`, default): a redb `StorageBackend` that
//!   simulates power loss (torn and garbage sectors, lying fsyncs), and the
//!   `RedbStore` workloads and checkers built on it.
//! - [`FaultyStore`]: any store, with chosen operations ([`Op`]) failing
//!   on demand, as a store whose database is down would.
//! - [`BlockingOnly`]: a store with its native async entry hidden, to
//!   compare `Guard::run_async` on tokio's blocking pool with the native path.
//! - [`codec`]: the record decoder's round-trip property (idemstore's own
//!   format; for its fuzz target).
//!
//! Everything here panics with a description when a property fails, so a
//! `#[test]` and a libFuzzer target report the same thing.
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "test support: a panic is a failure with a location"
)]

mod blocking;
pub mod codec;
pub mod conformance;
#[cfg(feature = "redb")]
pub mod crash;
mod faulty;
pub mod kill;
pub mod model;

pub use blocking::BlockingOnly;
pub use faulty::{FaultyStore, Op};
