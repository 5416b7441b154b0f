//! `RedbStore::builder().open_read_only`: an inspection that writes nothing, sees
//! what a writer's open would (log frames included), refuses every write,
//! and never takes a file for a store that is not one.

use idemstore::redb::admin::{export_line, parse_line};
use idemstore::redb::{Inbox, RecoveryPolicy};
use idemstore::{Begin, Error, Fingerprint, Key, RedbStore, Response, State, Store, Timestamp};
use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(3600);
const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);

fn key(id: &str) -> Key {
    Key::new("t", id).unwrap()
}

/// Every file in `dir` with its bytes.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                PathBuf::from(e.file_name()),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// A copy (in a new directory) of a store killed with `done` completed
/// and `open` claimed, both only in its log: what a crashed service leaves.
fn killed_store(done: &str, open: &str) -> tempfile::TempDir {
    let live = tempfile::tempdir().unwrap();
    let store = RedbStore::builder()
        .checkpoint_interval(Duration::from_secs(3600))
        .open(live.path().join("s.idem"))
        .unwrap();
    let fp = Fingerprint::of(b"x");
    let Begin::Claimed(c) = store.begin(&key(done), &fp, T0, LEASE, KEEP).unwrap() else {
        panic!("claimed")
    };
    store
        .complete(&key(done), &c, &Response::new(201, "charged"), T0, KEEP)
        .unwrap();
    let running = store.begin(&key(open), &fp, T0, LEASE, KEEP).unwrap();
    assert!(matches!(running, Begin::Claimed(_)), "{running:?}");
    let copy = tempfile::tempdir().unwrap();
    for name in ["s.idem", "s.idem-wal"] {
        std::fs::copy(live.path().join(name), copy.path().join(name)).unwrap();
    }
    drop(store);
    copy
}

#[test]
fn a_view_of_a_killed_store_sees_its_log_and_writes_nothing() {
    let dir = killed_store("paid", "running");
    let path = dir.path().join("s.idem");
    let before = files(dir.path());
    {
        // ExpireLeases would end the running lease at a writer's open; a
        // view shows the record as stored.
        let view = RedbStore::builder()
            .recovery(RecoveryPolicy::ExpireLeases)
            .open_read_only(&path)
            .unwrap();
        assert!(view.stats().frames_replayed_on_open >= 1);
        assert_eq!(view.stats().leases_expired_on_open, 0);
        let paid = view.get(&key("paid"), T0).unwrap().unwrap();
        assert_eq!(paid.response(), Some(&Response::new(201, "charged")));
        let running = view.admin().get_raw(&key("running")).unwrap().unwrap();
        assert_eq!(running.state(), State::Processing);
        assert_eq!(running.lease_until(), Some(T0 + LEASE));
        // The reads a view exists for.
        assert_eq!(view.admin().facts().unwrap().records, 2);
        let mut scanned = 0;
        view.admin()
            .scan(|_, r| {
                scanned += u32::from(r.is_ok());
                ControlFlow::Continue(())
            })
            .unwrap();
        assert_eq!(scanned, 2);
        assert!(view.admin().verify(|_| {}).unwrap().is_clean());
        assert_eq!(
            view.begin(&key("paid"), &Fingerprint::of(b"x"), T0, LEASE, KEEP)
                .unwrap(),
            Begin::Replay(Response::new(201, "charged")),
            "an answer that writes nothing is given"
        );
    }
    assert_eq!(files(dir.path()), before, "a view changed a file");
    // The writer's open afterwards replays the same frames: nothing was
    // taken from the log.
    let store = RedbStore::open(&path).unwrap();
    assert!(store.stats().frames_replayed_on_open >= 1);
    assert!(store.get(&key("paid"), T0).unwrap().is_some());
}

#[test]
fn every_write_through_a_view_is_read_only_and_changes_nothing() {
    let dir = killed_store("paid", "running");
    let path = dir.path().join("s.idem");
    let before = files(dir.path());
    let view = RedbStore::builder().open_read_only(&path).unwrap();
    let read_only = |r: idemstore::Result<()>, what: &str| {
        let err = r.expect_err(what);
        assert!(matches!(err, Error::ReadOnly { .. }), "{what}: {err}");
        assert!(!err.is_transient(), "{what}");
        assert!(err.to_string().contains("s.idem"), "{what}: {err}");
    };
    let fp = Fingerprint::of(b"x");
    read_only(
        view.begin(&key("new"), &fp, T0, LEASE, KEEP).map(drop),
        "a claim",
    );
    // A takeover after the lease is a write too.
    read_only(
        view.begin(&key("running"), &fp, T0 + KEEP / 2, LEASE, KEEP)
            .map(drop),
        "a takeover",
    );
    read_only(view.sweep_expired(T0 + KEEP * 2, 10).map(drop), "a sweep");
    read_only(view.compact().map(drop), "compact");
    read_only(view.admin().evict(&key("paid")).map(drop), "evict");
    let (k, r) = parse_line(&export_line(
        &key("paid"),
        &view.admin().get_raw(&key("paid")).unwrap().unwrap(),
    ))
    .unwrap();
    read_only(view.admin().import([Ok((k, r))]).map(drop), "import");
    read_only(
        view.admin().raise_token_high_water_mark(u64::MAX).map(drop),
        "raising the token mark",
    );
    // Nothing to write: a checkpoint of a view is a no-op, not an error.
    view.admin().checkpoint().unwrap();
    let inbox = Inbox::new(view);
    let delivered = inbox.handle(&key("m1"), &fp, |_, _| {
        Ok::<_, idemstore::BoxError>(Response::new(200, "x"))
    });
    let err = delivered.expect_err("an inbox writes");
    assert!(
        matches!(err.downcast_ref::<Error>(), Some(Error::ReadOnly { .. })),
        "{err:?}"
    );
    drop(inbox);
    assert_eq!(files(dir.path()), before);
}

#[test]
fn a_view_is_never_of_a_file_that_is_not_a_store() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.idem");
    let err = RedbStore::builder().open_read_only(&missing).unwrap_err();
    assert!(
        matches!(&err, Error::Io(e) if e.kind() == std::io::ErrorKind::NotFound),
        "{err}"
    );
    assert!(err.to_string().contains("never creates"), "{err}");
    let empty = dir.path().join("empty.idem");
    std::fs::write(&empty, b"").unwrap();
    let err = RedbStore::builder().open_read_only(&empty).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("empty (0 bytes)"), "{err}");
    let foreign = dir.path().join("foreign.idem");
    std::fs::write(&foreign, vec![b'x'; 8192]).unwrap();
    let err = RedbStore::builder().open_read_only(&foreign).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    // A plain redb database is not a store either.
    let plain = dir.path().join("plain.redb");
    drop(redb::Database::create(&plain).unwrap());
    let err = RedbStore::builder().open_read_only(&plain).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    let names: Vec<_> = files(dir.path()).into_keys().collect();
    assert_eq!(
        names,
        [
            PathBuf::from("empty.idem"),
            PathBuf::from("foreign.idem"),
            PathBuf::from("plain.redb")
        ],
        "no file was created"
    );
    assert!(std::fs::read(&empty).unwrap().is_empty());
}

#[test]
fn a_view_refuses_what_an_open_refuses_and_accepts_loss_in_memory() {
    let dir = killed_store("paid", "running");
    let path = dir.path().join("s.idem");
    // The log lost after an unclean stop: a writer's open refuses it...
    std::fs::write(dir.path().join("s.idem-wal"), b"").unwrap();
    let before = files(dir.path());
    let err = RedbStore::builder().open_read_only(&path).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("missing or empty"), "{err}");
    // ...and a view that accepts the loss opens on what the file holds,
    // saying what was given up, without writing the acceptance down.
    let view = RedbStore::builder()
        .accept_loss(true)
        .open_read_only(&path)
        .unwrap();
    let report = view.loss_report().expect("a loss was accepted");
    assert!(!report.findings.is_empty(), "{report}");
    drop(view);
    assert_eq!(files(dir.path()), before);
    assert!(
        RedbStore::open(&path).is_err(),
        "the store still needs `recover`"
    );
}
