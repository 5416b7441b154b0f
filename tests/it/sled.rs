//! The conformance suite and sled-specific tests on `SledStore`.

use idemstore::unstable::sled::BLOB_THRESHOLD_BYTES as SLED_BLOB_THRESHOLD_BYTES;
use idemstore::{Begin, Error, Fingerprint, Key, Response, SledStore, State, Store};
use idemstore_testkit::conformance::{Subject, T0};
use std::time::Duration;

fn subject() -> Subject {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path().join("store")).unwrap();
    Subject::new(store, dir)
}

idemstore_testkit::conformance!(subject);

fn open_for_kill(dir: &std::path::Path) -> idemstore::Result<std::sync::Arc<dyn Store>> {
    Ok(std::sync::Arc::new(SledStore::open(dir)?))
}

idemstore_testkit::kill_suite!(open_for_kill);

const SEC: Duration = Duration::from_secs(1);
const HOUR: Duration = Duration::from_secs(3600);

fn key(id: &str) -> Key {
    Key::new("t", id).unwrap()
}

fn claim(store: &SledStore, id: &str, now: idemstore::Timestamp) -> idemstore::Claim {
    match store
        .begin(&key(id), &Fingerprint::of(id), now, SEC, HOUR)
        .unwrap()
    {
        Begin::Claimed(c) => c,
        other => panic!("{id}: expected Claimed, got {other:?}"),
    }
}

/// Opens the raw sled database of a closed store, to inspect or damage it,
/// once the store's sled has let go of its file lock (as `SledStore::open`
/// waits, a plain `sled::open` does not).
fn raw(dir: &std::path::Path) -> Raw {
    let db_file = dir.join("db");
    wait_for_sled_lock(&db_file);
    Raw(Some(::sled::open(dir).unwrap()), db_file)
}

/// Waits (up to 10 s) until nobody holds sled's lock on `db_file`: sled's
/// own threads can hold the database a moment after the last handle goes.
fn wait_for_sled_lock(db_file: &std::path::Path) {
    let Ok(file) = std::fs::File::open(db_file) else {
        return;
    };
    for _ in 0..1_000 {
        if file.try_lock().is_ok() {
            let _ = file.unlock();
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The sled database under a store, opened directly. Dropped, it waits
/// until sled has let go of its file lock, so that a store opened next is
/// not (rightly) `Locked`.
struct Raw(Option<::sled::Db>, std::path::PathBuf);

impl std::ops::Deref for Raw {
    type Target = ::sled::Db;
    fn deref(&self) -> &::sled::Db {
        self.0.as_ref().unwrap()
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        drop(self.0.take());
        wait_for_sled_lock(&self.1);
    }
}

/// A reopened store must replay what was DONE, keep PROCESSING leases as
/// they were, and hand out tokens above every token given before.
#[test]
fn reopen_keeps_done_processing_and_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (done_token, busy_token) = {
        let s = SledStore::open(dir.path()).unwrap();
        let c = claim(&s, "done", T0);
        s.complete(&key("done"), &c, &Response::new(201, "paid"), T0, HOUR)
            .unwrap();
        let busy = claim(&s, "busy", T0);
        (c.token(), busy.token())
    };
    let s = SledStore::open(dir.path()).unwrap();
    assert_eq!(
        s.begin(&key("done"), &Fingerprint::of("done"), T0, SEC, HOUR)
            .unwrap(),
        Begin::Replay(Response::new(201, "paid"))
    );
    assert_eq!(
        s.begin(
            &key("busy"),
            &Fingerprint::of("busy"),
            T0 + SEC / 2,
            SEC,
            HOUR
        )
        .unwrap(),
        Begin::InFlight {
            lease_until: T0 + SEC
        }
    );
    let fresh = claim(&s, "fresh", T0);
    assert!(fresh.token() > done_token.max(busy_token));
    // The lease of the dead owner ends as stored: then a takeover.
    let taken = claim(&s, "busy", T0 + SEC);
    assert!(taken.is_takeover());
    assert!(taken.token() > fresh.token());
}

/// Tokens stay monotonic over many open/close cycles, each of which
/// claims a little: the high-water mark moves with every claim.
#[test]
fn tokens_monotonic_across_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let mut last = 0;
    for round in 0..5 {
        let s = SledStore::open(dir.path()).unwrap();
        for i in 0..3 {
            let c = claim(&s, &format!("r{round}-{i}"), T0);
            assert!(
                c.token() > last,
                "round {round}: {} after {last}",
                c.token()
            );
            last = c.token();
        }
    }
}

#[test]
fn second_open_is_locked_until_the_first_closes() {
    let dir = tempfile::tempdir().unwrap();
    let first = SledStore::open(dir.path()).unwrap();
    let err = SledStore::open(dir.path()).unwrap_err();
    assert!(matches!(err, Error::Locked { .. }), "{err:?}");
    assert!(err.to_string().contains("locked"), "{err}");
    drop(first);
    SledStore::open(dir.path()).unwrap();
}

/// Opening a directory full of someone else's files must refuse, and must
/// not create a store among them.
#[test]
fn foreign_directory_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
    let err = SledStore::open(dir.path()).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
    assert!(err.to_string().contains("not an idemstore store"), "{err}");
    assert!(err.to_string().contains("notes.txt"), "{err}");
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("notes.txt")]);

    let file = dir.path().join("notes.txt");
    let err = SledStore::open(&file).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
}

/// Another program's sled database is not an idemstore store.
#[test]
fn foreign_sled_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = raw(dir.path());
        db.open_tree("users").unwrap().insert("u1", "x").unwrap();
        db.flush().unwrap();
    }
    let err = SledStore::open(dir.path()).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
    assert!(
        err.to_string().contains("trees: __sled__default, users"),
        "{err}"
    );
    let db = raw(dir.path());
    assert!(
        !db.tree_names().iter().any(|n| n.starts_with(b"idemstore")),
        "no idemstore tree was created in the foreign database"
    );
}

#[test]
fn newer_format_is_unsupported() {
    let dir = tempfile::tempdir().unwrap();
    drop(SledStore::open(dir.path()).unwrap());
    {
        let db = raw(dir.path());
        let meta = db.open_tree("idemstore/meta").unwrap();
        meta.insert("format_version", &2u32.to_be_bytes()).unwrap();
        db.flush().unwrap();
    }
    let err = SledStore::open(dir.path()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnsupportedFormat {
                found: 2,
                supported: 1
            }
        ),
        "{err:?}"
    );
}

/// A damaged record is an error, never a replay and never a fresh claim.
#[test]
fn damaged_record_is_corrupt_not_replayed() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = SledStore::open(dir.path()).unwrap();
        let c = claim(&s, "k", T0);
        s.complete(&key("k"), &c, &Response::new(200, "paid"), T0, HOUR)
            .unwrap();
    }
    {
        let db = raw(dir.path());
        let records = db.open_tree("idemstore/records").unwrap();
        let (k, v) = records.first().unwrap().unwrap();
        let mut v = v.to_vec();
        *v.last_mut().unwrap() ^= 0x40;
        records.insert(k, v).unwrap();
        db.flush().unwrap();
    }
    let s = SledStore::open(dir.path()).unwrap();
    let fp = Fingerprint::of("k");
    let begin = s.begin(&key("k"), &fp, T0, SEC, HOUR);
    assert!(matches!(begin, Err(Error::Corrupt { .. })), "{begin:?}");
    assert!(matches!(s.get(&key("k"), T0), Err(Error::Corrupt { .. })));
}

/// After a failed fsync nothing may be acknowledged: the failing write
/// gets the I/O error, every later write Poisoned, until a reopen.
#[test]
fn failed_fsync_poisons_until_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let s = SledStore::open(dir.path()).unwrap();
    let ok = claim(&s, "before", T0);
    s.fail_next_syncs(1);
    let r = s.begin(&key("k"), &Fingerprint::of("k"), T0, SEC, HOUR);
    assert!(matches!(r, Err(Error::Io(_))), "{r:?}");
    assert!(s.is_poisoned());
    for r in [
        s.begin(&key("k2"), &Fingerprint::of("k2"), T0, SEC, HOUR)
            .map(|_| ()),
        s.complete(&key("before"), &ok, &Response::new(200, ""), T0, HOUR),
        s.release(&key("before"), &ok),
        s.sweep_expired(T0 + 2 * HOUR, 10).map(|_| ()),
    ] {
        assert!(matches!(r, Err(Error::Poisoned { .. })), "{r:?}");
    }
    drop(s);
    let s = SledStore::open(dir.path()).unwrap();
    assert!(!s.is_poisoned());
    s.complete(&key("before"), &ok, &Response::new(200, "x"), T0, HOUR)
        .unwrap();
}

/// Durability is real: one client's every acknowledged write is followed by
/// its own fdatasync of the data file.
#[test]
fn every_acknowledged_write_is_fsynced() {
    let dir = tempfile::tempdir().unwrap();
    let s = SledStore::open(dir.path()).unwrap();
    let before = s.stats();
    for i in 0..20 {
        let c = claim(&s, &format!("k{i}"), T0);
        s.complete(
            &key(&format!("k{i}")),
            &c,
            &Response::new(200, ""),
            T0,
            HOUR,
        )
        .unwrap();
    }
    let after = s.stats();
    assert_eq!(after.commits - before.commits, 40);
    assert_eq!(after.data_fsyncs - before.data_fsyncs, 40);
    // Replays write nothing and, once everything is durable, fsync nothing.
    for i in 0..20 {
        let id = format!("k{i}");
        let b = s.begin(&key(&id), &Fingerprint::of(&id), T0, SEC, HOUR);
        assert!(matches!(b, Ok(Begin::Replay(_))), "{b:?}");
    }
    assert_eq!(s.stats().data_fsyncs, after.data_fsyncs);
}

/// 64 concurrent clients share flushes: far fewer fsyncs than writes, and
/// every acknowledged claim is there after a reopen.
#[test]
fn concurrent_writers_share_fsyncs() {
    let dir = tempfile::tempdir().unwrap();
    let s = SledStore::open(dir.path()).unwrap();
    let before = s.stats();
    std::thread::scope(|scope| {
        for t in 0..64 {
            let s = &s;
            scope.spawn(move || {
                for i in 0..10 {
                    let _ = claim(s, &format!("t{t}-{i}"), T0);
                }
            });
        }
    });
    let after = s.stats();
    assert_eq!(after.commits - before.commits, 640);
    let fsyncs = after.data_fsyncs - before.data_fsyncs;
    assert!(fsyncs < 640, "{fsyncs} fsyncs for 640 claims: no grouping");
    drop(s);
    let s = SledStore::open(dir.path()).unwrap();
    for t in 0..64 {
        for i in 0..10 {
            let r = s.get(&key(&format!("t{t}-{i}")), T0).unwrap();
            assert_eq!(r.map(|r| r.state()), Some(State::Processing));
        }
    }
}

#[test]
fn concurrent_claims_on_one_key_have_one_winner() {
    let dir = tempfile::tempdir().unwrap();
    let s = SledStore::open(dir.path()).unwrap();
    let barrier = std::sync::Barrier::new(64);
    let winners: usize = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..64)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    let b = s
                        .begin(&key("hot"), &Fingerprint::of("hot"), T0, SEC, HOUR)
                        .unwrap();
                    usize::from(matches!(b, Begin::Claimed(_)))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(winners, 1);
}

/// A response above sled's blob threshold goes to a blob file that sled
/// never fsyncs; the store fsyncs it, and it replays after a reopen.
#[test]
fn response_above_blob_threshold_is_fsynced_and_replays() {
    let dir = tempfile::tempdir().unwrap();
    let body: Vec<u8> = (0..2 * SLED_BLOB_THRESHOLD_BYTES)
        .map(|i| (i % 251) as u8)
        .collect();
    {
        let s = SledStore::open(dir.path()).unwrap();
        let c = claim(&s, "big", T0);
        s.complete(&key("big"), &c, &Response::new(200, body.clone()), T0, HOUR)
            .unwrap();
        assert!(s.stats().blob_fsyncs >= 1, "{:?}", s.stats());
        assert!(std::fs::read_dir(dir.path().join("blobs")).unwrap().count() >= 1);
    }
    let s = SledStore::open(dir.path()).unwrap();
    assert_eq!(
        s.begin(&key("big"), &Fingerprint::of("big"), T0, SEC, HOUR)
            .unwrap(),
        Begin::Replay(Response::new(200, body))
    );
}

/// Every record has exactly one expiry-index entry at its expiry, and every
/// index entry points at such a record, after a mix of claims, takeovers,
/// completions, releases and sweeps (the index moves in the same
/// transaction as the record).
#[test]
fn index_matches_records_after_mixed_ops() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = SledStore::open(dir.path()).unwrap();
        for i in 0..60u32 {
            let id = format!("k{}", i % 20);
            let now = T0 + i * SEC;
            if let Ok(Begin::Claimed(c)) = s.begin(&key(&id), &Fingerprint::of(&id), now, SEC, HOUR)
            {
                match i % 3 {
                    0 => s
                        .complete(&key(&id), &c, &Response::new(200, ""), now, 2 * HOUR)
                        .unwrap(),
                    1 => s.release(&key(&id), &c).unwrap(),
                    _ => {}
                }
            }
        }
        s.sweep_expired(T0 + HOUR + 30 * SEC, 1000).unwrap();
    }
    let index = raw_index(dir.path());
    assert!(!index.is_empty());
    let s = SledStore::open(dir.path()).unwrap();
    for (expires_at, k) in &index {
        let rec = s.get(k, T0).unwrap().expect("index entry without a record");
        assert_eq!(rec.expires_at(), *expires_at, "{k}");
    }
    // Sweeping everything empties both trees together.
    let swept = s.sweep_expired(T0 + 100 * HOUR, 10_000).unwrap();
    assert_eq!(swept, index.len());
    drop(s);
    assert!(raw_index(dir.path()).is_empty());
}

/// The expiry index of a closed store, decoded: (expires_at, key). Also
/// checks that the records tree has exactly as many entries.
fn raw_index(dir: &std::path::Path) -> Vec<(idemstore::Timestamp, Key)> {
    let db = raw(dir);
    let records = db.open_tree("idemstore/records").unwrap();
    let expiry = db.open_tree("idemstore/expiry").unwrap();
    assert_eq!(records.len(), expiry.len(), "one index entry per record");
    expiry
        .iter()
        .map(|entry| {
            let (ik, _) = entry.unwrap();
            let (ts, kb) = ik.split_at(8);
            let ts = u64::from_be_bytes(ts.try_into().unwrap());
            let (len, rest) = kb.split_first().unwrap();
            let (scope, id) = rest.split_at(usize::from(*len));
            assert!(records.contains_key(kb).unwrap());
            (
                idemstore::Timestamp::from_millis(ts),
                Key::new(scope, id).unwrap(),
            )
        })
        .collect()
}

/// The background sweeper (the one shared loop) deletes expired records
/// of a sled store, reading time from the store's clock.
#[test]
fn background_sweeper_deletes_expired_records() {
    let dir = tempfile::tempdir().unwrap();
    let clock = idemstore::ManualClock::new(T0);
    let s = SledStore::builder()
        .clock(clock.clone())
        .sweeper(idemstore::SweeperConfig::default().interval(Duration::from_millis(5)))
        .open(dir.path())
        .unwrap();
    for i in 0..10 {
        let _ = claim(&s, &format!("k{i}"), T0);
    }
    clock.advance(2 * HOUR);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.sweeper().map(|w| w.swept()) != Some(10) {
        assert!(std::time::Instant::now() < deadline, "sweeper never swept");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        s.get(&key("k0"), T0).unwrap().is_none(),
        "deleted, not just invisible"
    );
}

/// OsBuffered acknowledges after sled's flush alone: no fdatasync per write
/// (only the one at open), yet the data is in the OS and survives closing
/// and reopening.
#[test]
fn os_buffered_skips_fsync_but_keeps_data() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = SledStore::builder()
            .durability(idemstore::sled::Durability::OsBuffered)
            .open(dir.path())
            .unwrap();
        let opened = s.stats();
        let c = claim(&s, "k", T0);
        s.complete(&key("k"), &c, &Response::new(200, "x"), T0, HOUR)
            .unwrap();
        let stats = s.stats();
        assert_eq!(stats.data_fsyncs, opened.data_fsyncs, "{stats:?}");
        assert_eq!(stats.flushes, opened.flushes + 2, "{stats:?}");
    }
    let s = SledStore::open(dir.path()).unwrap();
    assert_eq!(
        s.get(&key("k"), T0).unwrap().unwrap().response(),
        Some(&Response::new(200, "x"))
    );
}

#[test]
fn body_limit_is_configurable_and_capped() {
    let dir = tempfile::tempdir().unwrap();
    let err = SledStore::builder()
        .max_body_bytes(idemstore::limits::MAX_BODY_BYTES_HARD_CAP + 1)
        .open(dir.path().join("a"))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    let s = SledStore::builder()
        .max_body_bytes(10)
        .open(dir.path().join("b"))
        .unwrap();
    let c = claim(&s, "k", T0);
    let r = s.complete(&key("k"), &c, &Response::new(200, vec![0; 11]), T0, HOUR);
    assert!(
        matches!(
            r,
            Err(Error::ResponseTooLarge {
                what: "body bytes",
                size: 11,
                limit: 10
            })
        ),
        "{r:?}"
    );
}

/// Random sequences with injected faults and reopens (close, reopen the
/// same directory) give the model's answers: nothing acknowledged is lost
/// or changed by closing the store.
#[test]
fn sled_store_with_faults_and_reopen_matches_model() {
    use idemstore_testkit::model::run_ops;
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let mut runner = TestRunner::new(Config {
        cases: 12,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(
            &proptest::collection::vec(idemstore_testkit::model::any_op(), 1..50),
            |ops| {
                let dir = tempfile::tempdir().unwrap();
                let mut open = || -> std::sync::Arc<dyn Store> {
                    std::sync::Arc::new(SledStore::open(dir.path()).unwrap())
                };
                run_ops(&mut open, true, &ops).map_err(TestCaseError::fail)
            },
        )
        .unwrap();
}

/// sled 0.34 recovers its log up to the first bad message and treats the
/// rest as a torn write, so a damaged data file opened as an *empty* store,
/// silently; it also asserts on some damage instead of returning an error.
/// Opening a damaged store must be `Corrupt`: never a panic, never a fresh
/// store that forgets completed requests.
#[test]
fn damaged_data_file_is_corrupt_not_empty_or_panic() {
    type Damage = fn(&mut Vec<u8>);
    let patterns: [(&str, Damage); 5] = [
        ("garbage over the start", |b| {
            for (i, x) in b.iter_mut().take(4096).enumerate() {
                *x = (i * 7 + 3) as u8;
            }
        }),
        ("garbage over the last 8 KiB", |b| {
            let n = b.len();
            for x in b.iter_mut().skip(n.saturating_sub(8192)) {
                *x = 0x5a;
            }
        }),
        ("truncated to 100 bytes", |b| b.truncate(100)),
        ("every 512th byte flipped", |b| {
            for x in b.iter_mut().step_by(512) {
                *x ^= 0xff;
            }
        }),
        ("zeroed", |b| b.iter_mut().for_each(|x| *x = 0)),
    ];
    for (what, damage) in patterns {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = SledStore::open(dir.path()).unwrap();
            for i in 0..50 {
                let c = claim(&s, &format!("k{i}"), T0);
                s.complete(
                    &key(&format!("k{i}")),
                    &c,
                    &Response::new(200, "x"),
                    T0,
                    HOUR,
                )
                .unwrap();
            }
        }
        let path = dir.path().join("db");
        let mut bytes = std::fs::read(&path).unwrap();
        damage(&mut bytes);
        std::fs::write(&path, &bytes).unwrap();
        let opened = std::panic::catch_unwind(|| SledStore::open(dir.path()));
        match opened.unwrap_or_else(|_| panic!("{what}: open panicked")) {
            Err(Error::Corrupt { detail, .. }) => {
                assert!(
                    detail.contains("lost data") || detail.contains("sled"),
                    "{what}: {detail}"
                );
            }
            Err(other) => panic!("{what}: expected Corrupt, got {other:?}"),
            // Damage that sled's checksums let through unharmed is fine
            // only if every record is intact.
            Ok(s) => {
                for i in 0..50 {
                    let r = s.get(&key(&format!("k{i}")), T0).unwrap().unwrap();
                    assert_eq!(r.response(), Some(&Response::new(200, "x")), "{what}: k{i}");
                }
            }
        }
        // A second attempt says the same: the refusal is not a one-off.
        if let Err(e) = SledStore::open(dir.path()) {
            assert!(matches!(e, Error::Corrupt { .. }), "{what}: {e:?}");
        }
    }
}

/// A store whose sled files were deleted (the marker survives) is refused,
/// not recreated empty.
#[test]
fn deleted_data_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    drop(SledStore::open(dir.path()).unwrap());
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == "db" || name.to_string_lossy().starts_with("snap.") {
            std::fs::remove_file(entry.path()).unwrap();
        }
    }
    let err = SledStore::open(dir.path()).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
    assert!(
        err.to_string().contains("recovered no idemstore data"),
        "{err}"
    );
}

/// An index entry whose record is gone or has moved on (which transactions
/// never leave behind, but a hand-edited or older store might) is removed
/// by the sweep without touching the record or counting it as swept.
#[test]
fn sweep_removes_stale_index_entries_only() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = SledStore::open(dir.path()).unwrap();
        let _ = claim(&s, "live", T0); // expires at T0 + 1 h
    }
    {
        let db = raw(dir.path());
        let expiry = db.open_tree("idemstore/expiry").unwrap();
        let at = |ms: u64, id: &str| {
            let mut k = (T0.as_millis() + ms).to_be_bytes().to_vec();
            k.push(1);
            k.push(b't');
            k.extend_from_slice(id.as_bytes());
            k
        };
        expiry.insert(at(1, "gone"), &[]).unwrap(); // no such record
        expiry.insert(at(2, "live"), &[]).unwrap(); // the record expires later
        db.flush().unwrap();
        assert_eq!(expiry.len(), 3);
    }
    let s = SledStore::open(dir.path()).unwrap();
    assert_eq!(
        s.sweep_expired(T0 + SEC, 100).unwrap(),
        0,
        "stale entries are not records"
    );
    assert_eq!(
        s.get(&key("live"), T0).unwrap().unwrap().expires_at(),
        T0 + HOUR
    );
    drop(s);
    let index = raw_index(dir.path());
    assert_eq!(index, vec![(T0 + HOUR, key("live"))]);
}

/// Regression: when a group's fsync failed, the caller that led the flush
/// got the I/O error (transient) and the callers waiting on the same flush
/// got Poisoned (not transient). Now a caller sees the failed flush's own
/// error if the flush covered its write, and Poisoned only if it did not:
/// never a third kind, and the same message and `is_transient()` for all
/// callers of the failed flush.
#[test]
fn every_caller_of_a_failed_group_flush_gets_the_same_error() {
    let dir = tempfile::tempdir().unwrap();
    let s = SledStore::open(dir.path()).unwrap();
    s.fail_next_syncs(1);
    let started = std::sync::Barrier::new(16);
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..16)
            .map(|t| {
                let (s, started) = (&s, &started);
                scope.spawn(move || {
                    let id = format!("t{t}");
                    started.wait();
                    s.begin(&key(&id), &Fingerprint::of(&id), T0, SEC, HOUR)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(s.is_poisoned());
    let mut flush_errors = Vec::new();
    for r in results {
        match r {
            Err(Error::Io(e)) => flush_errors.push(Error::Io(e)),
            Err(Error::Poisoned { .. }) => {}
            other => panic!("neither the failed flush's error nor Poisoned: {other:?}"),
        }
    }
    let first = flush_errors.first().expect("someone led the failed flush");
    for err in &flush_errors {
        assert_eq!(err.to_string(), first.to_string());
        assert_eq!(err.is_transient(), first.is_transient());
    }
}

/// Regression: a store dropped and opened again at once in the same
/// process was now and then `Locked` (CI, under load): sled's flusher held
/// sled's own file lock a moment after the last handle went. The open now
/// waits that moment out (`open_sled`).
#[test]
fn a_store_dropped_and_opened_again_at_once_opens() {
    let dir = tempfile::tempdir().unwrap();
    let fp = Fingerprint::of(b"x");
    for i in 0..30 {
        let store = SledStore::open(dir.path()).unwrap();
        let key = Key::new("reopen", format!("k{i}")).unwrap();
        assert!(matches!(
            store.begin(&key, &fp, T0, SEC, HOUR).unwrap(),
            Begin::Claimed(_)
        ));
    }
}
