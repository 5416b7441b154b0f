//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`) under
//! stable `cargo test`, through the same functions the fuzz targets call,
//! so CI exercises every saved input without nightly.

use idemstore::Store;
use idemstore_testkit::codec::record_decode;
use idemstore_testkit::model::{decode_ops, run_ops};
use std::path::PathBuf;
use std::sync::Arc;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} has no corpus", dir.display());
    files
        .into_iter()
        .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
        .collect()
}

#[test]
fn record_decode_corpus() {
    for (path, bytes) in corpus("record_decode") {
        let r = std::panic::catch_unwind(|| record_decode(&bytes));
        assert!(r.is_ok(), "{} fails", path.display());
    }
}

#[test]
fn store_ops_corpus_on_memory() {
    for (path, bytes) in corpus("store_ops") {
        let ops = decode_ops(&bytes);
        let mut open = || -> Arc<dyn Store> { Arc::new(idemstore::MemoryStore::new()) };
        if let Err(d) = run_ops(&mut open, false, &ops) {
            panic!("{}: {d}", path.display());
        }
    }
}

/// The store_ops corpus was re-encoded when `Op::Step` joined the enum (a
/// derived `Arbitrary` picks a variant by scaling a `u32` to the variant
/// count): the pre-step files decode to the operations they always meant
/// (faults included: `Fault.op` went from `% 6` to `% 7`), and steps are
/// among the operations.
#[test]
fn store_ops_corpus_decodes_to_every_kind_of_op() {
    use idemstore_testkit::model::Op;
    let mut kinds = std::collections::BTreeSet::new();
    for (_, bytes) in corpus("store_ops") {
        let ops = decode_ops(&bytes);
        kinds.extend(ops.iter().map(|op| match op {
            Op::Begin { .. } => "begin",
            Op::Complete { .. } => "complete",
            Op::Release { .. } => "release",
            Op::Renew { .. } => "renew",
            Op::Get { .. } => "get",
            Op::Sweep { .. } => "sweep",
            Op::Advance { .. } => "advance",
            Op::Fault { .. } => "fault",
            Op::Reopen => "reopen",
            Op::Step { .. } => "step",
        }));
    }
    assert_eq!(kinds.len(), 10, "{kinds:?}");
}

#[cfg(feature = "redb")]
#[test]
fn crash_recovery_corpus() {
    let mut total = idemstore_testkit::crash::RunReport::default();
    for (path, bytes) in corpus("crash_recovery") {
        let r = std::panic::catch_unwind(|| idemstore_testkit::crash::crash_recovery(&bytes));
        total += r.unwrap_or_else(|_| panic!("{} fails", path.display()));
    }
    eprintln!("crash_recovery corpus: {total:?}");
    assert!(total.crash_points > 0 && total.acked_checked > 0);
}

/// The store_ops corpus on `RedbStore` where every reopen is a power loss
/// (tests/it/redb.rs replays it with clean reopens), with two seeds for
/// which unsynced writes survive. The same corpus on a disk whose fsync
/// lies must diverge from the model: the reopens do lose power.
#[cfg(feature = "redb")]
#[test]
fn store_ops_corpus_on_redb_with_power_loss_reopens() {
    use idemstore_testkit::crash::{SyncMode, store_ops_power_loss};
    let mut caught = 0;
    for (path, bytes) in corpus("store_ops") {
        for seed in 0..2 {
            if let Err(d) = store_ops_power_loss(&bytes, seed, SyncMode::Honest) {
                panic!("{} (seed {seed}): {d}", path.display());
            }
        }
        caught += usize::from(store_ops_power_loss(&bytes, 0, SyncMode::Lies).is_err());
    }
    assert!(caught > 0, "no corpus input noticed a lying fsync");
    eprintln!("lying fsync caught on {caught} inputs");
}
