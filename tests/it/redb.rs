//! `RedbStore`: the conformance suite on a real file, plus reopen, group
//! commit, poisoning, sweeper and open-time refusal tests.

use idemstore::redb::{Durability, RecoveryPolicy};
use idemstore::{
    Begin, Claim, Error, Fingerprint, Guard, Key, ManualClock, Outcome, RedbStore, Response, State,
    Store, SweeperConfig,
};
use idemstore_testkit::conformance::{Subject, T0};
use redb::StorageBackend;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

fn subject() -> Subject {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path().join("conformance.idem")).unwrap();
    Subject::new(store, dir)
}

idemstore_testkit::conformance!(subject);

fn open_for_kill(dir: &Path) -> idemstore::Result<Arc<dyn Store>> {
    Ok(Arc::new(RedbStore::open(dir.join("kill.idem"))?))
}

idemstore_testkit::kill_suite!(open_for_kill);

const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(3600);

fn key(id: &str) -> Key {
    Key::new("tenant-1", id).unwrap()
}

fn claim(store: &impl Store, k: &Key) -> Claim {
    match store
        .begin(k, &Fingerprint::of(b"fp"), T0, LEASE, KEEP)
        .unwrap()
    {
        Begin::Claimed(c) => c,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

#[test]
fn done_replays_and_processing_keeps_its_lease_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let fp = Fingerprint::of(b"fp");
    let (done, open) = (key("done"), key("open"));
    let (first_token, lease_until) = {
        let store = RedbStore::open(&path).unwrap();
        let c = claim(&store, &done);
        store
            .complete(&done, &c, &Response::new(201, "paid"), T0, KEEP)
            .unwrap();
        let o = claim(&store, &open);
        (o.token(), o.lease_until())
    };
    let store = RedbStore::open(&path).unwrap();
    assert_eq!(
        store.begin(&done, &fp, T0, LEASE, KEEP).unwrap(),
        Begin::Replay(Response::new(201, "paid"))
    );
    assert_eq!(
        store.begin(&open, &fp, T0, LEASE, KEEP).unwrap(),
        Begin::InFlight { lease_until }
    );
    // Tokens keep increasing across the restart.
    let next = claim(&store, &key("new"));
    assert!(
        next.token() > first_token,
        "{} <= {first_token}",
        next.token()
    );
    assert_eq!(store.stats().leases_expired_on_open, 0);
}

#[test]
fn expire_leases_policy_makes_dead_claims_claimable_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let k = key("order-1");
    let old = {
        let store = RedbStore::open(&path).unwrap();
        claim(&store, &k)
    };
    let store = RedbStore::builder()
        .recovery(RecoveryPolicy::ExpireLeases)
        .clock(ManualClock::new(T0))
        .open(&path)
        .unwrap();
    assert_eq!(store.stats().leases_expired_on_open, 1);
    let taken = claim(&store, &k);
    assert!(taken.is_takeover());
    assert!(taken.token() > old.token());
    // The dead owner is fenced off.
    assert!(matches!(
        store.complete(&k, &old, &Response::new(200, ""), T0, KEEP),
        Err(Error::StaleClaim)
    ));
}

#[test]
fn a_thousand_concurrent_claims_on_a_hundred_keys_make_a_hundred_winners_in_few_commits() {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path().join("s.idem")).unwrap();
    const THREADS: usize = 100;
    const PER_THREAD: usize = 10;
    let barrier = Barrier::new(THREADS);
    let answers: Vec<Begin> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (store, barrier) = (&store, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    (0..PER_THREAD)
                        .map(|i| {
                            // Every key is asked for by ten threads.
                            let k = key(&format!("k{}", (t + i * 7) % 100));
                            store
                                .begin(&k, &Fingerprint::of(b"fp"), T0, LEASE, KEEP)
                                .unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    assert_eq!(answers.len(), THREADS * PER_THREAD);
    let winners = answers
        .iter()
        .filter(|a| matches!(a, Begin::Claimed(_)))
        .count();
    let in_flight = answers
        .iter()
        .filter(|a| matches!(a, Begin::InFlight { .. }))
        .count();
    assert_eq!((winners, in_flight), (100, 900));
    let stats = store.stats();
    eprintln!("{stats:?} mean batch {:.1}", stats.mean_group());
    // The claims go through the writer; the InFlight answers to keys
    // already claimed and committed come from read transactions.
    assert_eq!(stats.requests + stats.fast_refusals, 1_000, "{stats:?}");
    assert!(stats.commits <= 100, "{stats:?}");
    assert!(stats.groups < 500, "group commit did not group: {stats:?}");
    assert!(stats.largest_group > 1, "{stats:?}");
}

/// A redb backend over shared memory whose `sync_data` fails while armed:
/// a disk that reports fsync errors until the cause is gone.
#[derive(Debug, Clone)]
pub struct FlakySync {
    pub inner: Arc<redb::backends::InMemoryBackend>,
    pub failing_sync: Arc<AtomicBool>,
}

impl FlakySync {
    /// A file in memory whose syncs fail while `failing_sync` is set.
    pub fn new(failing_sync: Arc<AtomicBool>) -> FlakySync {
        FlakySync {
            inner: Arc::new(redb::backends::InMemoryBackend::new()),
            failing_sync,
        }
    }

    /// Another file on the same disk (a store's log): its syncs fail
    /// together with this one's.
    pub fn sibling(&self) -> FlakySync {
        FlakySync::new(Arc::clone(&self.failing_sync))
    }
}

impl StorageBackend for FlakySync {
    fn len(&self) -> Result<u64, std::io::Error> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> Result<(), std::io::Error> {
        if self.failing_sync.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("injected fsync failure"));
        }
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        self.inner.write(offset, data)
    }
}

/// Waits (bounded) until `store` writes again after a failure went away.
pub fn wait_healthy(store: &RedbStore) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !matches!(store.health(), idemstore::redb::Health::Healthy) {
        assert!(
            std::time::Instant::now() < deadline,
            "not healed after 10 s: {:?}",
            store.health()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_failed_fsync_poisons_the_store_until_it_heals() {
    // Reproduces a disk whose fsync fails: the claim in that commit may
    // or may not be on disk, so the store must refuse every later write
    // rather than carry on as if nothing happened, until the disk works
    // again and the store has reopened its engine.
    let backend = FlakySync::new(Arc::new(AtomicBool::new(false)));
    let log = backend.sibling();
    let store = Arc::new(
        RedbStore::builder()
            .open_backend(backend.clone(), log.clone())
            .unwrap(),
    );
    let fp = Fingerprint::of(b"fp");
    claim(&store, &key("before"));
    backend.failing_sync.store(true, Ordering::SeqCst);
    let failed = store.begin(&key("a"), &fp, T0, LEASE, KEEP);
    assert!(matches!(failed, Err(Error::Io(_))), "{failed:?}");
    let failed = failed.unwrap_err().to_string();
    assert!(
        failed.contains("injected fsync failure") && failed.contains("log append failed"),
        "the operation and the cause: {failed}"
    );
    assert!(store.is_poisoned(), "{failed:?}");
    assert!(matches!(
        store.health(),
        idemstore::redb::Health::Degraded { cause, .. } if cause.message().contains("injected")
    ));
    assert!(matches!(
        store.begin(&key("b"), &fp, T0, LEASE, KEEP),
        Err(Error::Poisoned { .. })
    ));
    assert!(matches!(
        store.sweep_expired(T0, 10),
        Err(Error::Poisoned { .. })
    ));
    assert!(matches!(store.compact(), Err(Error::Poisoned { .. })));
    // The guard fails closed: the handler does not run.
    let guard = Guard::new(Arc::clone(&store));
    let outcome = guard.run(&key("c"), &fp, |_| -> Result<Response, std::io::Error> {
        panic!("the handler must not run on a poisoned store")
    });
    assert!(
        matches!(outcome, Outcome::Unavailable(Error::Poisoned { .. })),
        "{outcome:?}"
    );
    drop(guard);
    // The same store value writes again once the disk does.
    backend.failing_sync.store(false, Ordering::SeqCst);
    wait_healthy(&store);
    claim(&store, &key("healed"));
    drop(store);
    // Reopened, the store works, and the claims made before are intact.
    let store = RedbStore::builder().open_backend(backend, log).unwrap();
    assert!(!store.is_poisoned());
    assert!(store.get(&key("healed"), T0).unwrap().is_some());
    assert_eq!(
        store.get(&key("before"), T0).unwrap().map(|r| r.state()),
        Some(State::Processing)
    );
    claim(&store, &key("after"));
}

#[test]
fn second_open_of_a_held_file_is_locked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let store = RedbStore::open(&path).unwrap();
    let err = RedbStore::open(&path).unwrap_err();
    assert!(
        matches!(&err, Error::Locked { path: p, .. } if p.contains("s.idem")),
        "{err}"
    );
    // On Linux the holder is named: here, this very process.
    #[cfg(target_os = "linux")]
    assert!(
        matches!(&err, Error::Locked { holder: Some(h), .. } if h == "this process"),
        "{err:?}"
    );
    // A read-only view is refused while the writer holds the file...
    let view = RedbStore::builder().open_read_only(&path).unwrap_err();
    assert!(matches!(view, Error::Locked { .. }), "{view}");
    drop(store);
    // ...and a writer while a view does.
    let view = RedbStore::builder().open_read_only(&path).unwrap();
    let err = RedbStore::open(&path).unwrap_err();
    assert!(matches!(err, Error::Locked { .. }), "{err}");
    // Two views at once are fine.
    let second = RedbStore::builder().open_read_only(&path).unwrap();
    drop((view, second));
    RedbStore::open(&path).unwrap();
}

/// Opens `path`, expects a refusal, and checks that the file's bytes did
/// not change.
fn assert_refused_untouched(path: &Path, expect: impl Fn(&Error) -> bool) -> Error {
    let before = std::fs::read(path).unwrap();
    let err = assert_refused(path, expect);
    assert!(
        std::fs::read(path).unwrap() == before,
        "a refused open changed the file"
    );
    err
}

/// Opens `path` and expects a refusal. (redb itself updates its own header
/// bookkeeping when it opens and closes a redb file, so for redb files the
/// tests check the data instead of the bytes.)
fn assert_refused(path: &Path, expect: impl Fn(&Error) -> bool) -> Error {
    let err = RedbStore::open(path).unwrap_err();
    assert!(expect(&err), "unexpected error: {err}");
    err
}

#[test]
fn foreign_files_are_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(
        &text,
        "these are not the records you are looking for\n".repeat(100),
    )
    .unwrap();
    let err = assert_refused_untouched(&text, |e| matches!(e, Error::Corrupt { .. }));
    assert!(err.to_string().contains("not an idemstore store"), "{err}");

    let tiny = dir.path().join("tiny");
    std::fs::write(&tiny, b"re").unwrap();
    assert_refused_untouched(&tiny, |e| matches!(e, Error::Corrupt { .. }));

    // A redb database of someone else's: no meta table.
    let other = dir.path().join("other.redb");
    {
        let db = redb::Database::create(&other).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(redb::TableDefinition::<u64, u64>::new("users"))
            .unwrap()
            .insert(1, 2)
            .unwrap();
        txn.commit().unwrap();
    }
    let err = assert_refused(&other, |e| matches!(e, Error::Corrupt { .. }));
    assert!(err.to_string().contains("meta table"), "{err}");
    // Their data is intact and no table of ours was added.
    let db = redb::Database::open(&other).unwrap();
    let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
    let users = txn
        .open_table(redb::TableDefinition::<u64, u64>::new("users"))
        .unwrap();
    assert_eq!(
        redb::ReadableTable::get(&users, 1)
            .unwrap()
            .unwrap()
            .value(),
        2
    );
    assert_eq!(txn.list_tables().unwrap().count(), 1);
}

#[test]
fn a_damaged_header_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    {
        let store = RedbStore::open(&path).unwrap();
        claim(&store, &key("k"));
    }
    let mut bytes = std::fs::read(&path).unwrap();
    // Keep redb's magic; scramble the rest of the header page.
    for b in &mut bytes[9..4096] {
        *b = !*b;
    }
    std::fs::write(&path, &bytes).unwrap();
    let result = RedbStore::open(&path);
    let err = result.expect_err("a damaged file opened as a store");
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    eprintln!("damaged header: {err}");
}

/// Writes `version` as the store format of the (closed) store at `path`.
fn set_format_version(path: &Path, version: u32) {
    let db = redb::Database::open(path).unwrap();
    let txn = db.begin_write().unwrap();
    txn.open_table(redb::TableDefinition::<&str, &[u8]>::new("idemstore.meta"))
        .unwrap()
        .insert("format_version", version.to_be_bytes().as_slice())
        .unwrap();
    txn.commit().unwrap();
}

/// A store of a newer format, or of an older one (1 and 2 were written by
/// pre-release builds only), is refused with the version found and the one
/// this build reads, by a writer's open and by a read-only view alike, and
/// its records are still there for the build that reads it.
#[test]
fn an_older_or_newer_format_version_is_unsupported() {
    for (version, says) in [
        (1, "pre-release"),
        (2, "pre-release"),
        (4, "upgrade idemstore"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.idem");
        {
            let store = RedbStore::open(&path).unwrap();
            claim(&store, &key("kept"));
        }
        set_format_version(&path, version);
        let unsupported = |e: &Error| matches!(e, Error::UnsupportedFormat { found, supported: 3 } if *found == version);
        let err = assert_refused(&path, unsupported);
        assert!(err.to_string().contains(says), "{err}");
        let err = RedbStore::builder().open_read_only(&path).unwrap_err();
        assert!(unsupported(&err), "{err}");
        set_format_version(&path, 3);
        let store = RedbStore::open(&path).unwrap();
        assert!(store.get(&key("kept"), T0).unwrap().is_some());
    }
}

#[cfg(unix)]
#[test]
fn a_new_store_file_is_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    drop(RedbStore::open(&path).unwrap());
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
}

#[test]
fn background_sweeper_deletes_expired_records() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = RedbStore::builder()
        .clock(clock.clone())
        .sweeper(SweeperConfig::default().interval(Duration::from_millis(5)))
        .open(dir.path().join("s.idem"))
        .unwrap();
    let k = key("k");
    let c = claim(&store, &k);
    store
        .complete(&k, &c, &Response::new(200, "ok"), T0, KEEP)
        .unwrap();
    clock.advance(KEEP);
    // Invisible before any sweep; then the sweeper deletes it.
    assert_eq!(store.get(&k, T0 + KEEP).unwrap(), None);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while store.stats().swept == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the sweeper never swept"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(store.stats().swept, 1);
    assert_eq!(store.sweep_expired(T0 + KEEP, 100).unwrap(), 0);
    drop(store); // stops the sweeper, then the writer
}

#[test]
fn sweep_then_compact_shrinks_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let store = RedbStore::open(&path).unwrap();
    let body = vec![7u8; 4096];
    for i in 0..500 {
        let k = key(&format!("k{i}"));
        let c = claim(&store, &k);
        store
            .complete(&k, &c, &Response::new(200, body.clone()), T0, KEEP)
            .unwrap();
    }
    let full = std::fs::metadata(&path).unwrap().len();
    let mut swept = 0;
    loop {
        let n = store.sweep_expired(T0 + KEEP, 100).unwrap();
        swept += n;
        if n < 100 {
            break;
        }
    }
    assert_eq!(swept, 500);
    while store.compact().unwrap() {}
    let compacted = std::fs::metadata(&path).unwrap().len();
    assert!(compacted < full, "{compacted} >= {full}");
    // The store still works after compaction.
    claim(&store, &key("after"));
}

#[test]
fn relaxed_durability_makes_writes_durable_at_clean_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let relaxed = Durability::Periodic {
        max_loss: Duration::from_secs(3600),
    };
    {
        let store = RedbStore::builder()
            .durability(relaxed)
            .open(&path)
            .unwrap();
        for i in 0..20 {
            claim(&store, &key(&format!("k{i}")));
        }
        let stats = store.stats();
        assert_eq!(stats.commits, 20);
        assert!(stats.durable_commits < 20, "{stats:?}");
    }
    let store = RedbStore::open(&path).unwrap();
    for i in 0..20 {
        assert!(store.get(&key(&format!("k{i}")), T0).unwrap().is_some());
    }
    assert!(matches!(
        RedbStore::builder()
            .durability(Durability::Periodic {
                max_loss: Duration::ZERO
            })
            .open(dir.path().join("zero.idem")),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn response_limit_is_configurable() {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::builder()
        .max_body_bytes(8)
        .open(dir.path().join("s.idem"))
        .unwrap();
    let k = key("k");
    let c = claim(&store, &k);
    assert!(matches!(
        store.complete(&k, &c, &Response::new(200, "123456789"), T0, KEEP),
        Err(Error::ResponseTooLarge { .. })
    ));
    store
        .complete(&k, &c, &Response::new(200, "12345678"), T0, KEEP)
        .unwrap();
}

#[test]
fn replays_are_answered_without_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::open(dir.path().join("s.idem")).unwrap();
    let k = key("k");
    let c = claim(&store, &k);
    store
        .complete(&k, &c, &Response::new(200, "ok"), T0, KEEP)
        .unwrap();
    let before = store.stats();
    for _ in 0..10 {
        assert!(matches!(
            store
                .begin(&k, &Fingerprint::of(b"fp"), T0, LEASE, KEEP)
                .unwrap(),
            Begin::Replay(_)
        ));
    }
    let after = store.stats();
    assert_eq!(after.requests, before.requests);
    assert_eq!(after.fast_replays, before.fast_replays + 10);
    // A different fingerprint is still a conflict (through the writer).
    assert_eq!(
        store
            .begin(&k, &Fingerprint::of(b"other"), T0, LEASE, KEEP)
            .unwrap(),
        Begin::Conflict
    );
}

#[test]
fn any_single_damaged_header_byte_is_an_error_or_a_clean_open() {
    // Reproduces bit rot in the header page: whichever byte is hit, opening
    // and reading must be an error or the intact data, never a panic.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    {
        let store = RedbStore::open(&path).unwrap();
        let c = claim(&store, &key("k"));
        store
            .complete(&key("k"), &c, &Response::new(200, "ok"), T0, KEEP)
            .unwrap();
    }
    let good = std::fs::read(&path).unwrap();
    let (mut refused, mut opened) = (0, 0);
    for offset in (0..320).step_by(3) {
        let mut bytes = good.clone();
        bytes[offset] ^= 0x5a;
        std::fs::write(&path, &bytes).unwrap();
        match RedbStore::open(&path) {
            Err(_) => refused += 1,
            Ok(store) => {
                opened += 1;
                match store.get(&key("k"), T0) {
                    Ok(Some(r)) => assert_eq!(r.response(), Some(&Response::new(200, "ok"))),
                    Ok(None) => panic!("byte {offset}: the record vanished"),
                    Err(_) => {}
                }
            }
        }
    }
    eprintln!("refused {refused}, opened {opened}");
    assert!(refused > 0);
}

#[test]
fn store_ops_corpus_on_redb_with_reopens() {
    // The fuzz corpus of operation sequences (with faults and reopens),
    // checked against the independent model, on a redb store whose storage
    // survives each reopen.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/store_ops");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty());
    for path in files {
        let ops = idemstore_testkit::model::decode_ops(&std::fs::read(&path).unwrap());
        let backend = FlakySync::new(Arc::new(AtomicBool::new(false)));
        let log = backend.sibling();
        let mut open = || -> Arc<dyn Store> {
            Arc::new(
                RedbStore::builder()
                    .open_backend(backend.clone(), log.clone())
                    .unwrap(),
            )
        };
        if let Err(d) = idemstore_testkit::model::run_ops(&mut open, true, &ops) {
            panic!("{}: {d}", path.display());
        }
    }
}

#[test]
fn relaxed_durability_flushes_an_idle_store_within_its_window() {
    // The loss window must be bounded even when no further write arrives to
    // carry the durable commit: the writer flushes on its own.
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::builder()
        .durability(Durability::Periodic {
            max_loss: Duration::from_millis(500),
        })
        .open(dir.path().join("s.idem"))
        .unwrap();
    claim(&store, &key("k"));
    // Acknowledged at once, before any fsync...
    assert_eq!(store.stats().commits, 1);
    assert_eq!(store.stats().durable_commits, 0);
    // ...and made durable by the writer's own timer, with no further write.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while store.stats().durable_commits == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "an idle relaxed store never made its commits durable"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A redb backend that models a power cut: writes land in a live image, and
/// only `sync_data` copies them to the durable image that survives.
#[derive(Debug, Clone, Default)]
pub struct PowerCut {
    live: Arc<std::sync::Mutex<Vec<u8>>>,
    durable: Arc<std::sync::Mutex<Vec<u8>>>,
}

impl PowerCut {
    /// The storage as it is after the power comes back: the durable image.
    pub fn after_power_loss(&self) -> PowerCut {
        let image = self.durable.lock().unwrap().clone();
        PowerCut {
            live: Arc::new(std::sync::Mutex::new(image.clone())),
            durable: Arc::new(std::sync::Mutex::new(image)),
        }
    }
}

impl StorageBackend for PowerCut {
    fn len(&self) -> Result<u64, std::io::Error> {
        Ok(self.live.lock().unwrap().len() as u64)
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        let live = self.live.lock().unwrap();
        let start = offset as usize;
        let src = live
            .get(start..start + out.len())
            .ok_or_else(|| std::io::Error::other("read past the end"))?;
        out.copy_from_slice(src);
        Ok(())
    }
    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        self.live.lock().unwrap().resize(len as usize, 0);
        Ok(())
    }
    fn sync_data(&self) -> Result<(), std::io::Error> {
        let image = self.live.lock().unwrap().clone();
        *self.durable.lock().unwrap() = image;
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        let mut live = self.live.lock().unwrap();
        let end = offset as usize + data.len();
        if live.len() < end {
            live.resize(end, 0);
        }
        live[offset as usize..end].copy_from_slice(data);
        Ok(())
    }
}

#[test]
fn acknowledged_group_commits_survive_a_power_cut() {
    // Reproduces a power cut right after a burst of concurrent claims was
    // acknowledged: every acknowledged claim (and the token high-water mark)
    // must be in what reached the disk, whatever batch it was committed in.
    let (disk, log) = (PowerCut::default(), PowerCut::default());
    let store = RedbStore::builder()
        .open_backend(disk.clone(), log.clone())
        .unwrap();
    let claims: Vec<(Key, Claim)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..64)
            .map(|i| {
                let store = &store;
                s.spawn(move || {
                    let k = key(&format!("k{i}"));
                    let c = claim(store, &k);
                    (k, c)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(store.stats().groups < 64, "{:?}", store.stats());
    // Power cut now, with the store still running.
    let after = RedbStore::builder()
        .open_backend(disk.after_power_loss(), log.after_power_loss())
        .unwrap();
    for (k, c) in &claims {
        let r = after
            .get(k, T0)
            .unwrap()
            .expect("an acknowledged claim was lost");
        assert_eq!((r.state(), r.token()), (State::Processing, c.token()));
    }
    let max = claims.iter().map(|(_, c)| c.token()).max().unwrap();
    assert!(claim(&after, &key("new")).token() > max);
    drop(store);
}

/// A redb backend whose `sync_data` (once armed) holds until the test opens
/// the gate: an fsync that takes as long as the test wants.
#[cfg(feature = "tokio")]
#[derive(Debug, Clone, Default)]
struct GatedSync {
    inner: Arc<redb::backends::InMemoryBackend>,
    armed: Arc<AtomicBool>,
    entered: Arc<AtomicBool>,
    gate: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
}

#[cfg(feature = "tokio")]
impl GatedSync {
    fn open_gate(&self) {
        *self.gate.0.lock().unwrap() = true;
        self.gate.1.notify_all();
    }
}

#[cfg(feature = "tokio")]
impl StorageBackend for GatedSync {
    fn len(&self) -> Result<u64, std::io::Error> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> Result<(), std::io::Error> {
        if self.armed.load(Ordering::SeqCst) {
            self.entered.store(true, Ordering::SeqCst);
            let (open, wake) = &*self.gate;
            let _open = wake
                .wait_while(open.lock().unwrap(), |open| !*open)
                .unwrap();
        }
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        self.inner.write(offset, data)
    }
}

#[cfg(feature = "tokio")]
#[tokio::test(flavor = "current_thread")]
async fn async_guard_on_redb_keeps_the_runtime_worker_free() {
    // One runtime worker, and a claim whose fsync (of the log) does not
    // return until this test task says so: the test task can only run (and
    // open the gate) if the waiting claim does not hold the worker.
    let disk = GatedSync::default();
    let store = Arc::new(
        RedbStore::builder()
            .open_backend(redb::backends::InMemoryBackend::new(), disk.clone())
            .unwrap(),
    );
    let guard = Guard::builder(Arc::clone(&store))
        .lease(LEASE)
        .build()
        .unwrap();
    disk.armed.store(true, Ordering::SeqCst);
    // A watchdog so that a blocked worker fails the test instead of hanging it.
    let fired = Arc::new(AtomicBool::new(false));
    {
        let (disk, fired) = (disk.clone(), Arc::clone(&fired));
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(10));
            if !*disk.gate.0.lock().unwrap() {
                fired.store(true, Ordering::SeqCst);
                disk.open_gate();
            }
        });
    }
    let task = tokio::spawn(async move {
        guard
            .run_async(&key("k"), &Fingerprint::of(b"fp"), |c| async move {
                Ok::<_, std::convert::Infallible>(Response::new(201, c.token().to_string()))
            })
            .await
    });
    while !disk.entered.load(Ordering::SeqCst) {
        tokio::task::yield_now().await;
    }
    // The claim is inside its fsync, and this task is running.
    disk.open_gate();
    assert!(matches!(task.await.unwrap(), Outcome::Executed(_)));
    assert!(
        !fired.load(Ordering::SeqCst),
        "the claim's fsync held the only runtime worker"
    );
    assert!(store.stats().logged_commits >= 1);
}

/// A power loss while a new store file was being created used to leave a
/// file at the store's path without redb's magic number, which every later
/// open refused as foreign. Creation now happens under `<name>.creating`
/// and is linked into place only when durable: what a crashed creator left
/// is started over, and the store's path is never half-written.
#[test]
fn a_crashed_creation_never_blocks_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("orders.idem");
    let leftover = dir.path().join("orders.idem.creating");
    // What redb leaves when the power goes before it writes its header.
    std::fs::write(&leftover, vec![0u8; 4096]).unwrap();
    let store = RedbStore::open(&path).unwrap();
    assert!(!leftover.exists(), "the leftover was reused and removed");
    assert!(path.exists());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
    let key = Key::new("t", "k").unwrap();
    let fp = Fingerprint::of(b"x");
    assert!(matches!(
        store
            .begin(
                &key,
                &fp,
                T0,
                Duration::from_secs(1),
                Duration::from_secs(9)
            )
            .unwrap(),
        Begin::Claimed(_)
    ));
    drop(store);
    // Reopening the created store finds the claim.
    let again = RedbStore::open(&path).unwrap();
    assert!(again.get(&key, T0).unwrap().is_some());
}

/// Two processes creating one store at once must not both believe they own
/// it: while one holds the temporary file, the other is told it is locked.
#[test]
fn a_concurrent_creation_is_locked_not_split() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("orders.idem");
    let creating = RedbStore::open(dir.path().join("orders.idem.creating")).unwrap();
    let second = RedbStore::open(&path);
    assert!(matches!(second, Err(Error::Locked { .. })), "{second:?}");
    assert!(!path.exists());
    drop(creating);
}

/// Regression: a guard over a `RedbStore` built with a `ManualClock` read
/// wall time unless given the clock again. Now the store's clock rules the
/// guard's leases, the sweeper and recovery at open alike.
#[test]
fn a_guard_over_a_redb_store_built_with_a_manual_clock_reads_that_clock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let clock = ManualClock::new(T0);
    let fp = Fingerprint::of(b"fp");
    {
        let store = RedbStore::builder()
            .clock(clock.clone())
            .sweeper(SweeperConfig::default().interval(Duration::from_millis(5)))
            .open(&path)
            .unwrap();
        let guard = Guard::builder(store)
            .lease(LEASE)
            .retention(KEEP)
            .build()
            .unwrap();
        assert_eq!(guard.now(), T0);
        let out = guard.run(&key("a"), &fp, |_| Err::<Response, _>("owner died"));
        assert!(matches!(out, Outcome::HandlerFailed(_)));
        // Leased on the manual time (T0 is long past on the wall clock).
        let record = guard.store().get(&key("a"), T0).unwrap().unwrap();
        assert_eq!(record.lease_until(), Some(T0 + LEASE));
        assert_eq!(record.expires_at(), T0 + KEEP);
        assert!(matches!(
            guard.run(&key("a"), &fp, |_| -> Result<Response, Error> {
                unreachable!()
            }),
            Outcome::InFlight { .. }
        ));
        // The sweeper leaves the record alone until the manual time passes
        // its expiry, then deletes it.
        std::thread::sleep(Duration::from_millis(50));
        assert!(guard.store().get(&key("a"), T0).unwrap().is_some());
        assert!(matches!(
            guard.run(&key("b"), &fp, |_| Ok::<_, Error>(Response::new(200, "b"))),
            Outcome::Executed(_)
        ));
        clock.advance(KEEP);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while guard.store().stats().swept < 2 {
            assert!(std::time::Instant::now() < deadline, "sweeper never swept");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    // Recovery at open reads the store's clock too: with ExpireLeases, a
    // lease that is live on the manual time is ended, and the guard's
    // retry takes it over at once.
    clock.set(T0);
    {
        let store = RedbStore::open(&path).unwrap();
        claim(&store, &key("c"));
    }
    let store = RedbStore::builder()
        .recovery(RecoveryPolicy::ExpireLeases)
        .clock(clock.clone())
        .open(&path)
        .unwrap();
    assert_eq!(store.stats().leases_expired_on_open, 1);
    let guard = Guard::new(store);
    assert!(matches!(
        guard.run(&key("c"), &Fingerprint::of(b"fp"), |_| Ok::<_, Error>(
            Response::new(200, "c")
        )),
        Outcome::Executed(_)
    ));
    assert_eq!(guard.stats().takeovers, 1);
}

/// A verify of a file store while checkpoints write the file reads whole
/// commits only: it reports no damage that is not there.
#[test]
fn a_verify_during_checkpoints_finds_the_file_clean() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(
        RedbStore::builder()
            .checkpoint_interval(Duration::from_millis(1))
            .open(dir.path().join("s.idem"))
            .unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (store, stop) = (Arc::clone(&store), Arc::clone(&stop));
        std::thread::spawn(move || {
            // 64 keys, each evicted after its completion: the file stays
            // small, so each verify costs the same however long the run.
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let k = key(&format!("k{}", i % 64));
                let c = claim(&*store, &k);
                let body = vec![b'x'; 2048];
                store
                    .complete(
                        &k,
                        &c,
                        &Response::new(200, body),
                        T0,
                        Duration::from_secs(60),
                    )
                    .unwrap();
                assert!(store.admin().evict(&k).unwrap().is_some());
                i += 1;
            }
        })
    };
    for _ in 0..100 {
        let report = store.admin().verify(|_| std::thread::yield_now()).unwrap();
        assert!(report.is_clean(), "{:?}", report.problems);
    }
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
}
