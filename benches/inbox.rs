//! The transactional inbox on redb:
//!
//! - `inbox/redb/handle_new`: a new message; the handler updates a balance
//!   row, and that row and the DONE record commit in one transaction (one fsync);
//! - `inbox/redb/handle_new_4_threads`: the same from 4 consumer threads
//!   (the inbox's transactions do not group: expect about the same rate);
//! - `inbox/redb/redelivery`: a message already handled, answered from a
//!   read transaction;
//! - `inbox/redb/batch_{10,100,1000}`: `handle_batch` of that many new
//!   messages (one commit each; throughput in messages), and
//!   `inbox/redb/batch_100_one_phase` with `quick_repair(false)`. The
//!   same-run table against PostgreSQL is `inbox_compare`
//!   (`bench/src/bin/inbox_compare.rs`).
//!
//! Every ID starts with `inbox/`, this file's subject, so its saved
//! baselines never mix with `store`'s, `redb`'s or `sled`'s.
//!
//! Every loop asserts its answer. Durable: the figures are the disk's fsync
//! rate as much as ours.
//!
//! ```text
//! cargo bench --bench inbox
//! ```
#![allow(
    missing_docs,
    clippy::unwrap_used,
    reason = "a bench binary: a panic is a failed run"
)]

use criterion::{Criterion, Throughput, black_box};
use idemstore::redb::Message;
use idemstore::redb::engine::{ReadableTable, TableDefinition};
use idemstore::redb::{Delivery, Inbox};
use idemstore::{BoxError, Fingerprint, Key, RedbStore, Response};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const BALANCES: TableDefinition<&str, u64> = TableDefinition::new("bench.balances");

static NEXT: AtomicU64 = AtomicU64::new(0);

fn fresh_key() -> Key {
    Key::new(
        "queue",
        format!("m{}", NEXT.fetch_add(1, Ordering::Relaxed)),
    )
    .unwrap()
}

fn handle(inbox: &Inbox, key: &Key) -> Delivery {
    inbox
        .handle(key, &Fingerprint::of(b"+1"), |txn, _| {
            let mut t = txn.open_table(BALANCES)?;
            let new = t.get("acct")?.map_or(0, |v| v.value()) + 1;
            t.insert("acct", new)?;
            Ok::<_, BoxError>(Response::new(200, new.to_string()))
        })
        .unwrap()
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::new(RedbStore::open(dir.path().join("bench.idem")).unwrap());
    let mut g = c.benchmark_group("inbox/redb");
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    g.bench_function("handle_new", |b| {
        b.iter(|| assert!(matches!(handle(&inbox, &fresh_key()), Delivery::Handled(_))))
    });
    g.bench_function("handle_new_4_threads", |b| {
        b.iter_custom(|iters| {
            let per = iters.div_ceil(4);
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..4 {
                    s.spawn(|| {
                        for _ in 0..per {
                            assert!(matches!(handle(&inbox, &fresh_key()), Delivery::Handled(_)));
                        }
                    });
                }
            });
            // Per message: `per * 4` messages took this long.
            start.elapsed().mul_f64(iters as f64 / (per * 4) as f64)
        })
    });
    let seen = fresh_key();
    handle(&inbox, &seen);
    g.bench_function("redelivery", |b| {
        b.iter(|| {
            assert!(matches!(
                handle(&inbox, black_box(&seen)),
                Delivery::Duplicate(_)
            ))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("inbox/redb");
    g.sample_size(10).measurement_time(Duration::from_secs(4));
    for (batch, quick_repair) in [(10, true), (100, true), (1_000, true), (100, false)] {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::builder()
            .open(dir.path().join("batch.idem"))
            .unwrap();
        let inbox = Inbox::new(store).quick_repair(quick_repair);
        let id = if quick_repair {
            format!("batch_{batch}")
        } else {
            format!("batch_{batch}_one_phase")
        };
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_function(id, |b| {
            b.iter(|| {
                let messages: Vec<Message<()>> = (0..batch)
                    .map(|_| Message::new(fresh_key(), Fingerprint::of(b"+1"), ()))
                    .collect();
                let answers = inbox
                    .handle_batch(&messages, |txn, _, _| {
                        let mut t = txn.open_table(BALANCES)?;
                        let new = t.get("acct")?.map_or(0, |v| v.value()) + 1;
                        t.insert("acct", new)?;
                        Ok::<_, BoxError>(Response::new(200, ""))
                    })
                    .unwrap();
                assert!(
                    answers
                        .iter()
                        .all(|a| matches!(a, Ok(Delivery::Handled(_))))
                );
            })
        });
    }
    g.finish();
    c.final_summary();
}
