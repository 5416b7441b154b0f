//! The `store_ops` property on `RedbStore`, where every reopen is a power
//! loss: the model in [`crate::model`] knows nothing of crashes, so with
//! `Durability::Immediate` a crash between two operations must be
//! invisible to it.

use super::backend::{CrashBackend, SyncMode};
use super::rng::Rng;
use crate::model::{decode_ops, run_ops};
use idemstore::RedbStore;
use idemstore::Store;
use std::sync::Arc;

/// Runs `data` (decoded as in the `store_ops` fuzz target) against the
/// independent model on a `RedbStore` over a [`CrashBackend`]. Each
/// `Reopen` loses power while the old store is still open (the surviving
/// file is chosen by a seed from `seed`), and opens the store again on
/// what survived. Returns the first divergence. With a lying `sync`
/// ([`SyncMode::Lies`]) the model must notice lost writes.
pub fn store_ops_power_loss(data: &[u8], seed: u64, sync: SyncMode) -> Result<(), String> {
    let ops = decode_ops(data);
    let mut rng = Rng::new(seed);
    let mut backend = CrashBackend::new();
    backend.set_sync_mode(sync);
    let mut live: Option<Arc<RedbStore>> = None;
    let mut failure: Option<String> = None;
    let mut open = || -> Arc<dyn Store> {
        if let Some(old) = live.take() {
            // Power fails with the old store still running; it is dropped
            // afterwards, writing only to the old (lost) machine's disk.
            let image = backend.power_loss_all(rng.next_u64());
            drop(old);
            backend = image.restore();
            backend.set_sync_mode(sync);
        }
        // With its write-ahead log: the disk's second file.
        let store = match super::recovery::open_disk(RedbStore::builder(), &backend) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                failure.get_or_insert(format!("reopen after a power loss: {e}"));
                // Keep going on a fresh store: the divergence it causes is
                // reported, but the open error is the cause.
                Arc::new(
                    RedbStore::builder()
                        .open_backend(CrashBackend::new(), CrashBackend::new())
                        .unwrap_or_else(|e| panic!("a fresh store failed to open: {e}")),
                )
            }
        };
        live = Some(Arc::clone(&store));
        store
    };
    let result = run_ops(&mut open, true, &ops);
    match failure {
        Some(f) => Err(f),
        None => result,
    }
}
