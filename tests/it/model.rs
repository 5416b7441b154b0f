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
