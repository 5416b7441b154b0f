//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`) under
//! stable `cargo test`, through the same functions the fuzz targets call,
//! so CI exercises every saved input without nightly.

use idemstore::Store;
use idemstore::fuzzing::{decode_ops, record_decode, run_ops};
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
