//! `RedbStore`: the conformance suite on a real file, plus reopen, group
//! commit, poisoning and open-time refusal tests.

use crate::conformance::{Subject, T0};
use idemstore::{
    Begin, Claim, Error, Fingerprint, Key, RecoveryPolicy, RedbStore, Response, State, Store,
};
use std::time::Duration;

fn subject() -> Subject {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path().join("conformance.idem")).unwrap();
    Subject::new(store, dir)
}

conformance_suite!(subject);
