//! Property test: random operation sequences applied to a store and to the
//! independent model in `idemstore::fuzzing` give the same answers. The
//! same checker runs under the `store_ops` fuzz target.

use crate::conformance::Make;
use idemstore::Store;
use idemstore::fuzzing::{Op, run_ops};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::sync::Arc;

/// Operations without faults or reopen: the conformance suite checks the
/// plain contract; fault and reopen sequences run per backend.
pub fn plain_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..4u8, 0..2u8).prop_map(|(key, fp)| Op::Begin { key, fp }),
        3 => (0..4u8, any::<bool>(), any::<u8>()).prop_map(|(key, stale, body)| Op::Complete { key, stale, body }),
        1 => (0..4u8, any::<bool>()).prop_map(|(key, stale)| Op::Release { key, stale }),
        2 => (0..4u8).prop_map(|key| Op::Get { key }),
        1 => (0..8u8).prop_map(|max| Op::Sweep { max }),
        2 => (0..2_000u16).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// Any operation, faults and reopen included.
pub fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => plain_op(),
        1 => any::<u8>().prop_map(|op| Op::Fault { op }),
        1 => Just(Op::Reopen),
    ]
}

/// Runs `cases` random sequences of up to `len` operations, each on a fresh store.
pub fn check_against_model(make: Make<'_>, cases: u32, len: usize) {
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&proptest::collection::vec(plain_op(), 1..len), |ops| {
            let subject = make();
            let store = Arc::clone(&subject.store);
            let mut open = || -> Arc<dyn Store> { Arc::clone(&store) };
            run_ops(&mut open, false, &ops).map_err(TestCaseError::fail)
        })
        .unwrap();
}

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
