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
