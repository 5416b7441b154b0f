//! Property test: random operation sequences (faults and reopen included)
//! applied to `MemoryStore` and to the testkit's independent model give the
//! same answers. The same checker runs under the `store_ops` fuzz target;
//! every backend runs the plain sequences in the conformance suite.

use idemstore::Store;
use idemstore_testkit::model::{any_op, run_ops};
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::sync::Arc;

#[test]
fn memory_store_with_faults_matches_model() {
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&proptest::collection::vec(any_op(), 1..80), |ops| {
            let mut open = || -> Arc<dyn Store> { Arc::new(idemstore::MemoryStore::new()) };
            run_ops(&mut open, false, &ops).map_err(TestCaseError::fail)
        })
        .unwrap();
}

/// A sweep bounded to fewer records than share the oldest expiry takes
/// them by key, as the model (and every backend) does: the store's expiry
/// index orders ties by fencing token, and once took the newer key first
/// (proptest found it).
#[test]
fn a_bounded_sweep_takes_an_expiry_tie_by_key() {
    use idemstore_testkit::model::Op;
    let ops = [
        Op::Begin { key: 3, fp: 0 },
        Op::Begin { key: 2, fp: 0 },
        Op::Advance { ms: 1373 },
        Op::Advance { ms: 1627 },
        Op::Sweep { max: 1 },
        Op::Begin { key: 2, fp: 0 },
        Op::Sweep { max: 1 },
    ];
    let mut open = || -> Arc<dyn Store> { Arc::new(idemstore::MemoryStore::new()) };
    run_ops(&mut open, false, &ops).expect("no divergence");
}

/// Steps through reopens, against the model: recorded steps, a release that
/// keeps them (PROCESSING, lease over), the claim after it, a takeover and
/// a completion, each followed by a reopen, on the durable backends. The
/// released record is stored with `lease_until == EPOCH`, so its encoding
/// must round-trip too.
fn steps_across_reopens() -> Vec<idemstore_testkit::model::Op> {
    use idemstore_testkit::model::Op;
    let step = |key, name, output, stale| Op::Step {
        key,
        stale,
        name,
        output,
    };
    vec![
        Op::Begin { key: 0, fp: 0 },
        step(0, 0, 0, false),
        step(0, 1, 1, false),
        Op::Reopen,
        Op::Get { key: 0 },
        step(0, 1, 0, false), // other output: refused
        Op::Release {
            key: 0,
            stale: false,
        },
        Op::Reopen,
        Op::Get { key: 0 },
        Op::Begin { key: 0, fp: 1 }, // conflict
        step(0, 2, 0, false),        // the released claim is stale
        Op::Renew {
            key: 0,
            stale: false,
        },
        Op::Begin { key: 0, fp: 0 }, // claimed at once, with the steps
        Op::Reopen,
        Op::Get { key: 0 },
        step(0, 2, 1, false),
        step(0, 2, 1, true), // the first claim: stale
        Op::Advance { ms: 1_000 },
        Op::Begin { key: 0, fp: 0 }, // takeover, three steps
        Op::Reopen,
        Op::Get { key: 0 },
        Op::Complete {
            key: 0,
            stale: false,
            body: 3,
        },
        Op::Reopen,
        Op::Get { key: 0 },
        Op::Begin { key: 1, fp: 0 },
        step(1, 0, 1, false),
        Op::Advance { ms: 1_999 },
        Op::Advance { ms: 1_999 },
        Op::Reopen,
        Op::Get { key: 1 }, // expired with its steps
        Op::Begin { key: 1, fp: 1 },
        Op::Get { key: 1 },
    ]
}

#[test]
fn steps_across_reopens_on_memory() {
    let mut open = || -> Arc<dyn Store> { Arc::new(idemstore::MemoryStore::new()) };
    run_ops(&mut open, false, &steps_across_reopens()).expect("no divergence");
}

#[cfg(feature = "redb")]
#[test]
fn steps_across_reopens_on_redb() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let mut open = || -> Arc<dyn Store> { Arc::new(idemstore::RedbStore::open(&path).unwrap()) };
    run_ops(&mut open, true, &steps_across_reopens()).expect("no divergence");
}

#[cfg(feature = "sled")]
#[test]
fn steps_across_reopens_on_sled() {
    let dir = tempfile::tempdir().unwrap();
    let mut open =
        || -> Arc<dyn Store> { Arc::new(idemstore::SledStore::open(dir.path()).unwrap()) };
    run_ops(&mut open, true, &steps_across_reopens()).expect("no divergence");
}
