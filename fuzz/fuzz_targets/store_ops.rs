//! Operation sequences (begin/complete/release/get/sweep/advance clock,
//! injected faults, reopen) against the independent model in
//! `idemstore_testkit::model`, on `MemoryStore` and on `RedbStore` (where each
//! reopen is a power loss: with immediate durability the model must not
//! notice); any divergence or panic is a failure.
#![no_main]

use idemstore::Store;
use idemstore_testkit::model::{decode_ops, run_ops};
use std::sync::Arc;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let ops = decode_ops(data);
    let mut open = || -> Arc<dyn Store> { Arc::new(idemstore::MemoryStore::new()) };
    if let Err(divergence) = run_ops(&mut open, false, &ops) {
        panic!("memory: {divergence}");
    }
    let seed = data.iter().fold(0u64, |h, &b| h.rotate_left(5) ^ u64::from(b));
    if let Err(divergence) = idemstore_testkit::crash::store_ops_power_loss(data, seed, idemstore_testkit::crash::SyncMode::Honest) {
        panic!("redb: {divergence}");
    }
});
