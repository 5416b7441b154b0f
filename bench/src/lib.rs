//! idemstore's measurement tools, as a library their binaries share:
//! the backends one workload drives ([`peers`]: idemstore's stores and the
//! peers a user would pick instead), the workload itself ([`workload`]),
//! the message-side workload ([`inbox`]), the HTTP load benchmark's server
//! and client ([`http_load`]), the process's own resources
//! ([`procstat`]: threads, RSS, open-file limit), and the charts of
//! `docs/performance.md` ([`plot`]).
//!
//! The binaries (`src/bin/`): `loadgen` (one backend, many knobs, `--json`),
//! `compare` (the same-run comparison), `http_load` (the tower layer under
//! HTTP load), `inbox_compare` (the inbox against PostgreSQL), `fill_store`,
//! `sled_space`, `sweep_scale`, `reopen_after_kill`. The criterion benches are in
//! `benches/`. Run them from the workspace root:
//!
//! ```text
//! cargo run --release -p idemstore-bench --bin loadgen -- --backend redb --clients 64
//! cargo run --release -p idemstore-bench --bin compare -- --smoke
//! cargo run --release -p idemstore-bench --bin http_load -- --smoke
//! cargo bench -p idemstore-bench --all-features --bench store
//! ```
//!
//! Not published; nothing here is idemstore's API.

pub mod http_load;
pub mod inbox;
pub mod peers;
pub mod plot;
pub mod procstat;
pub mod workload;
