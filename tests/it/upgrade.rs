//! A store file of format 2, written by a pre-release build (the first
//! format with the write-ahead log `<file>-wal`; this build's is 3), is
//! refused with a clear error, never opened as an empty or partial store.
//!
//! The fixture (`tests/fixtures/format2-crashed.idem` and its `-wal`) was
//! written by a format-2 build whose process exited without closing the
//! store: 11 acknowledged batches are in its log only, in format 2's
//! layout (one region of back-to-back frames). An open that read the file
//! and ignored or misread the log would lose them silently.
//!
//! The test opens copies in a temporary directory, never the committed
//! files.

use idemstore::{Error, RedbStore};
use std::path::{Path, PathBuf};

const CRASHED: &str = "format2-crashed.idem";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn with_log(name: &str) -> String {
    format!("{name}-wal")
}

#[test]
fn a_format2_store_is_refused_and_its_log_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    for name in [CRASHED.to_owned(), with_log(CRASHED)] {
        std::fs::copy(fixtures().join(&name), dir.path().join(&name)).unwrap();
    }
    let path = dir.path().join(CRASHED);
    let log = dir.path().join(with_log(CRASHED));
    let log_before = std::fs::read(&log).unwrap();
    let unsupported = |e: &Error| {
        matches!(
            e,
            Error::UnsupportedFormat {
                found: 2,
                supported: 3
            }
        )
    };
    let err = RedbStore::open(&path).map(|_| ()).unwrap_err();
    assert!(unsupported(&err), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("version 2") && text.contains("version 3"),
        "names both versions: {text}"
    );
    let err = RedbStore::builder()
        .open_read_only(&path)
        .map(|_| ())
        .unwrap_err();
    assert!(unsupported(&err), "{err}");
    let err = idemstore::RedbStore::check_log(&path)
        .map(|_| ())
        .unwrap_err();
    assert!(unsupported(&err), "{err}");
    assert_eq!(
        std::fs::read(&log).unwrap(),
        log_before,
        "a refused open changed the log"
    );
}
