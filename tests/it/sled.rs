//! The conformance suite and sled-specific tests on `SledStore`.

use crate::conformance::{Subject, T0};
use idemstore::{
    Begin, Error, Fingerprint, Key, Response, SLED_BLOB_THRESHOLD_BYTES, SledStore, State, Store,
};
use std::time::Duration;

fn subject() -> Subject {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path().join("store")).unwrap();
    Subject::new(store, dir)
}

conformance_suite!(subject);
