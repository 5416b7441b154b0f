//! idemstore's measurement tools, as a library their binaries share:
//! the backends one workload drives ([`peers`]: idemstore's stores and the
//! peers a user would pick instead) and the workload itself ([`workload`]);
//! the message-side workload ([`inbox`]).
//!
//! The binaries (`src/bin/`): `loadgen` (one backend, many knobs, `--json`),
//! `compare` (the same-run comparison), `fill_store`, `sled_space`,
//! `sweep_scale`, `reopen_after_kill`, `inbox_compare` (the inbox against
//! PostgreSQL). The criterion benches are in
//! `benches/`. Run them from the workspace root:
//!
//! ```text
//! cargo run --release -p idemstore-bench --bin loadgen -- --backend redb --clients 64
//! cargo run --release -p idemstore-bench --bin compare -- --smoke
//! cargo bench -p idemstore-bench --all-features --bench store
//! ```
//!
//! Not published; nothing here is idemstore's API.

pub mod inbox;
pub mod peers;
pub mod workload;
