//! The one integration-test binary. Each backend module runs the shared
//! conformance suite through `idemstore_testkit::conformance!`, plus its own tests.
#![allow(unreachable_pub, reason = "test modules share helpers with `pub`")]
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "a panic in a test is a failure with a location"
)]

mod bad_input;
#[cfg(all(feature = "redb", feature = "tower"))]
mod clock_step;
#[cfg(feature = "redb")]
mod crash;
#[cfg(feature = "redb")]
mod damage;
#[cfg(feature = "redb")]
mod faults;
mod fuzz_corpus;
mod guard;
#[cfg(feature = "redb")]
mod inbox;
#[cfg(feature = "redb")]
mod inbox_batch;
#[cfg(feature = "redb")]
mod io_sweep;
mod memory;
mod model;
#[cfg(all(feature = "redb", feature = "tokio"))]
mod native_async;
#[cfg(all(feature = "metrics", feature = "tracing", feature = "redb"))]
mod observability;
#[cfg(all(feature = "redb", feature = "tower"))]
mod orders_service;
#[cfg(feature = "tower")]
mod payments_api;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "postgres")]
mod postgres_cuts;
#[cfg(feature = "postgres")]
mod postgres_group;
#[cfg(feature = "postgres")]
mod postgres_inbox;
#[cfg(feature = "postgres")]
mod postgres_inbox_batch;
#[cfg(feature = "postgres")]
mod postgres_inbox_set;
#[cfg(all(feature = "postgres", feature = "tokio"))]
mod postgres_runtime;
#[cfg(all(feature = "postgres", feature = "tokio"))]
mod postgres_tls;
#[cfg(feature = "redb")]
mod read_only;
#[cfg(feature = "redb")]
mod redb;
#[cfg(feature = "redb")]
mod redb_bad_input;
#[cfg(feature = "redb")]
mod renewal;
#[cfg(feature = "sled")]
mod sled;
#[cfg(all(feature = "redb", feature = "tokio"))]
mod steps;
#[cfg(feature = "redb")]
mod stream_consumer;
#[cfg(feature = "tower")]
mod tower;
#[cfg(feature = "tower")]
mod tower_json;
#[cfg(feature = "redb")]
mod upgrade;
mod waiting;
#[cfg(feature = "redb")]
mod wal;
