//! Store files written by format 2 (the first format with the write-ahead
//! log `<file>-wal`; today's is 3) open with every record intact: the
//! fixtures pin real format-2 files, written by a format-2 build.
//!
//! # The fixtures (`tests/fixtures/`)
//!
//! * `format2-clean.idem` + `format2-clean.idem-wal`: a store closed cleanly.
//!   Everything is in the store file; the log beside it holds only frames of
//!   retired epochs (a real format-2 store always has its log), so opening
//!   it replays nothing.
//! * `format2-crashed.idem` + `format2-crashed.idem-wal`: the same writes,
//!   but the process exited without closing the store after its second
//!   session: the 11 batches of that session were acknowledged from the log
//!   alone, and the store file's durable state is the first session's.
//!   Opening it must replay the log.
//!
//! Both were written by the same script (`session_one`, then `session_two`)
//! with a 4 KiB log and a 24 h checkpoint interval, so no checkpoint ran
//! inside a session. Every timestamp is fixed (the store takes `now` from
//! its caller), so the records are the same in both files; only the store
//! ids (random) and the place of each write (store file or log) differ.
//!
//! Session one (closed cleanly: a durable checkpoint at close), claims with
//! a 1 h lease and a 1 day retention unless said otherwise:
//!
//! | token | key (scope / id) | at | |
//! |---|---|---|---|
//! | 1 | tenant-a / `done-small` | BASE | |
//! | 2 | tenant-a / `done-empty` | BASE | |
//! | 3 | tenant-b / `done-1k` | BASE | |
//! | 4 | tenant-a / `shared-id` | BASE | |
//! | 5 | tenant-b / `shared-id` | BASE | (another fingerprint; stays PROCESSING) |
//! | 6 | tenant-a / `processing-live` | BASE | |
//! | 7 | tenant-a / `lease-lapsed` | BASE − 10 min | lease 1 min |
//! | 8 | tenant-a / `taken-over` | BASE − 10 min | lease 1 min |
//! | 9 | tenant-b / `expired-done` | BASE − 2 h | lease 1 min, retention 1 h |
//! | 10 | tenant-a / `released` | BASE | |
//!
//! Session two (in the crashed fixture: logged only, never checkpointed),
//! one batch, so one log frame, each:
//!
//! 1. complete `done-small` (201, header `content-type: text/plain`, body
//!    `charged`), `done-empty` (204, empty body), `done-1k` (200, 1024
//!    bytes `(i * 7 + 3) as u8`) and tenant-a `shared-id` (200, `scope a's
//!    answer`), each at BASE + 1 s with a 30 day retention;
//! 2. claim tenant-b / `ff fe 00 69 64 c3 28` (an id that is not UTF-8) at
//!    BASE: token 11;
//! 3. take over `taken-over` at BASE (its lease lapsed): token 12, attempt 2;
//! 4. complete `expired-done` (200, `old`) at BASE − 2 h + 1 s, retention 1 h;
//! 5. claim tenant-b / `expired-processing` at BASE − 2 h, lease 1 min,
//!    retention 1 h: token 13;
//! 6. release `released` (token 10), claim it again at BASE (token 14) and
//!    release that too: the key is absent and the token high-water mark, 14,
//!    is held by the meta entry alone, by no record.
//!
//! [`expected`] lists the 11 records that result, field by field. At CHECK
//! (BASE + 1 min) two of them are expired (`expired-done`,
//! `expired-processing`), `lease-lapsed` can be taken over, and four hold a
//! live lease. The crashed store file alone (without its log) holds the
//! state after session one: the 10 claims, all PROCESSING, high-water mark 10.
//!
//! # Regenerating
//!
//! Only with a build whose store format is 2 (the generator checks the
//! `format_version` meta entry it wrote):
//!
//! ```text
//! IDEMSTORE_FORMAT2_FIXTURE_DIR=$PWD/tests/fixtures \
//!     cargo test --test it upgrade::generate_format2_fixtures -- --ignored --exact
//! git add tests/fixtures/format2-*
//! ```
//!
//! The generator writes in a temporary directory, runs session two of the
//! crashed store in a child process (this test binary, re-invoked on
//! `format2_crash_child`) that calls `std::process::exit` without dropping
//! the store, checks both stores exactly as the tests do (and that the
//! crashed one replays exactly 11 frames), and only then copies the four
//! files into the directory named by `IDEMSTORE_FORMAT2_FIXTURE_DIR`
//! (without it, it is a dry run). The store ids are random, so the bytes
//! differ at every regeneration; the records do not. The tests compare the
//! fixtures with git's index, so `git add` regenerated files before running them.
//!
//! The tests open copies in a temporary directory, never the committed
//! files, and check afterwards that those are byte-identical to git's.

use idemstore::{Begin, Claim, Fingerprint, Key, RedbStore, Response, State, Store, Timestamp};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// 2026-10-19T04:00:00Z: every write of the script is at a fixed time
/// around it.
const BASE: Timestamp = Timestamp::from_millis(1_760_846_400_000);
/// The tests' "now": one minute after BASE.
const CHECK: Timestamp = Timestamp::from_millis(BASE.as_millis() + 60_000);
/// Before every write and every expiry: every stored record is visible.
const BEFORE_ALL: Timestamp = Timestamp::from_millis(BASE.as_millis() - 3 * 3_600_000);

const SEC: Duration = Duration::from_secs(1);
const MIN: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);
const MONTH: Duration = Duration::from_secs(30 * 24 * 3600);

/// The largest token the script hands out (held by no record).
const HWM: u64 = 14;
/// The token high-water mark of the crashed store file alone.
const HWM_AFTER_SESSION_ONE: u64 = 10;
/// Batches of session two: the frames only the crashed store's log holds.
const SESSION_TWO_BATCHES: u64 = 11;
/// The script's log size when the fixtures were written: the smallest the
/// format-2 builder accepted; session two's 11 frames take 2794 bytes of
/// it. Today's builder refuses it (`MIN_WAL_BYTES` is 16 KiB): the fixtures
/// are regenerated only by a format-2 build, never by this one.
const SCRIPT_WAL_BYTES: u64 = 4096;
/// No checkpoint by time inside a session.
const NO_CHECKPOINT: Duration = Duration::from_secs(24 * 3600);

const CLEAN: &str = "format2-clean.idem";
const CRASHED: &str = "format2-crashed.idem";

const ENV_FIXTURE_DIR: &str = "IDEMSTORE_FORMAT2_FIXTURE_DIR";
const ENV_CHILD_STORE: &str = "IDEMSTORE_FORMAT2_CRASH_CHILD_STORE";
/// The child's exit status after session two: not a test harness status.
const CHILD_EXIT: i32 = 42;

const A: &[u8] = b"tenant-a";
const B: &[u8] = b"tenant-b";
/// Not UTF-8 (`ff`, `fe`, and `c3` followed by a non-continuation byte),
/// with a zero byte inside.
const NON_UTF8_ID: &[u8] = &[0xff, 0xfe, 0x00, b'i', b'd', 0xc3, 0x28];

fn key(scope: &[u8], id: &[u8]) -> Key {
    Key::new(scope, id).unwrap()
}

/// The request fingerprint of a key's requests (scope and id).
fn fp(scope: &[u8], id: &[u8]) -> Fingerprint {
    Fingerprint::of([scope, b"|", id].concat())
}

fn body_1k() -> Vec<u8> {
    (0..1024u32).map(|i| (i * 7 + 3) as u8).collect()
}

fn resp_small() -> Response {
    Response::new(201, "charged").with_header("content-type", "text/plain")
}
fn resp_empty() -> Response {
    Response::new(204, Vec::new())
}
fn resp_1k() -> Response {
    Response::new(200, body_1k())
}
fn resp_shared() -> Response {
    Response::new(200, "scope a's answer")
}
fn resp_old() -> Response {
    Response::new(200, "old")
}

/// One record the fixtures hold, field by field.
#[derive(Debug)]
struct Want {
    scope: &'static [u8],
    id: &'static [u8],
    state: State,
    response: Option<Response>,
    lease_until: Option<Timestamp>,
    created_at: Timestamp,
    expires_at: Timestamp,
    token: u64,
    attempts: u32,
}

impl Want {
    fn key(&self) -> Key {
        key(self.scope, self.id)
    }
    fn name(&self) -> String {
        format!(
            "{}/{}",
            String::from_utf8_lossy(self.scope),
            String::from_utf8_lossy(self.id)
        )
    }
}

fn done(scope: &'static [u8], id: &'static [u8], response: Response, token: u64) -> Want {
    Want {
        scope,
        id,
        state: State::Done,
        response: Some(response),
        lease_until: None,
        created_at: BASE,
        expires_at: BASE + SEC + MONTH,
        token,
        attempts: 1,
    }
}

fn live(scope: &'static [u8], id: &'static [u8], token: u64) -> Want {
    Want {
        scope,
        id,
        state: State::Processing,
        response: None,
        lease_until: Some(BASE + HOUR),
        created_at: BASE,
        expires_at: BASE + DAY,
        token,
        attempts: 1,
    }
}

/// Every record of both fixtures (once opened: the crashed one after its
/// log is replayed). `tenant-a/released` is absent.
fn expected() -> Vec<Want> {
    vec![
        done(A, b"done-small", resp_small(), 1),
        done(A, b"done-empty", resp_empty(), 2),
        done(B, b"done-1k", resp_1k(), 3),
        done(A, b"shared-id", resp_shared(), 4),
        live(B, b"shared-id", 5),
        live(A, b"processing-live", 6),
        Want {
            lease_until: Some(BASE - 10 * MIN + MIN),
            created_at: BASE - 10 * MIN,
            expires_at: BASE - 10 * MIN + DAY,
            ..live(A, b"lease-lapsed", 7)
        },
        Want {
            created_at: BASE - 10 * MIN,
            // A takeover never moves the expiry earlier.
            expires_at: BASE - 10 * MIN + DAY,
            attempts: 2,
            ..live(A, b"taken-over", 12)
        },
        Want {
            created_at: BASE - 2 * HOUR,
            expires_at: BASE - 2 * HOUR + SEC + HOUR,
            ..done(B, b"expired-done", resp_old(), 9)
        },
        live(B, NON_UTF8_ID, 11),
        Want {
            lease_until: Some(BASE - 2 * HOUR + MIN),
            created_at: BASE - 2 * HOUR,
            expires_at: BASE - 2 * HOUR + HOUR,
            ..live(B, b"expired-processing", 13)
        },
    ]
}

const RELEASED: &[u8] = b"released";

/// Checks every record exactly, the released key's absence and which
/// records are visible at CHECK.
fn check_records(store: &RedbStore) {
    let want = expected();
    for w in &want {
        let name = w.name();
        let got = store
            .get(&w.key(), BEFORE_ALL)
            .unwrap()
            .unwrap_or_else(|| panic!("{name} is missing"));
        assert_eq!(got.fingerprint(), &fp(w.scope, w.id), "{name}");
        assert_eq!(got.state(), w.state, "{name}");
        assert_eq!(got.response(), w.response.as_ref(), "{name}");
        assert_eq!(got.lease_until(), w.lease_until, "{name}");
        assert_eq!(got.created_at(), w.created_at, "{name}");
        assert_eq!(got.expires_at(), w.expires_at, "{name}");
        assert_eq!(got.token(), w.token, "{name}");
        assert_eq!(got.attempts(), w.attempts, "{name}");
        let visible = store.get(&w.key(), CHECK).unwrap().is_some();
        assert_eq!(visible, w.expires_at > CHECK, "{name} at CHECK");
    }
    assert_eq!(want.iter().filter(|w| w.expires_at <= CHECK).count(), 2);
    assert!(store.get(&key(A, RELEASED), BEFORE_ALL).unwrap().is_none());
    // The response bodies really are the edge cases they are named after.
    assert!(
        store
            .get(&key(A, b"done-empty"), CHECK)
            .unwrap()
            .unwrap()
            .response()
            .unwrap()
            .body()
            .is_empty()
    );
    assert_eq!(
        store
            .get(&key(B, b"done-1k"), CHECK)
            .unwrap()
            .unwrap()
            .response()
            .unwrap()
            .body()
            .len(),
        1024
    );
}

/// The store's own answers at CHECK over the upgraded records: tokens go
/// on above the high-water mark, leases and expiries are honoured.
fn check_answers(store: &RedbStore) {
    let probe = claim(store, A, b"probe", CHECK, HOUR, DAY);
    assert!(probe.token() > HWM, "token {} <= {HWM}", probe.token());
    // Exactly the two expired records are swept.
    assert_eq!(store.sweep_expired(CHECK, 1000).unwrap(), 2);
    for w in expected() {
        let (k, f, name) = (w.key(), fp(w.scope, w.id), w.name());
        let answer = store.begin(&k, &f, CHECK, HOUR, DAY).unwrap();
        if w.expires_at <= CHECK {
            assert!(
                matches!(&answer, Begin::Claimed(c) if !c.is_takeover() && c.attempt() == 1 && c.token() > HWM),
                "{name}: {answer:?}"
            );
        } else if let Some(response) = &w.response {
            assert_eq!(answer, Begin::Replay(response.clone()), "{name}");
        } else if w.lease_until.is_some_and(|l| l > CHECK) {
            assert_eq!(
                answer,
                Begin::InFlight {
                    lease_until: w.lease_until.unwrap()
                },
                "{name}"
            );
        } else {
            assert!(
                matches!(&answer, Begin::Claimed(c) if c.is_takeover() && c.attempt() == 2 && c.token() > HWM),
                "{name}: {answer:?}"
            );
        }
    }
    // Same id, other scope's fingerprint: a conflict, not the other's answer.
    let answer = store
        .begin(
            &key(A, b"shared-id"),
            &fp(B, b"shared-id"),
            CHECK,
            HOUR,
            DAY,
        )
        .unwrap();
    assert!(matches!(answer, Begin::Conflict), "{answer:?}");
    let answer = store
        .begin(&key(A, RELEASED), &fp(A, RELEASED), CHECK, HOUR, DAY)
        .unwrap();
    assert!(
        matches!(&answer, Begin::Claimed(c) if !c.is_takeover() && c.token() > HWM),
        "{answer:?}"
    );
}

// ---------------------------------------------------------------- the script

fn open_for_script(path: &Path) -> RedbStore {
    RedbStore::builder()
        .checkpoint_interval(NO_CHECKPOINT)
        .wal_bytes(SCRIPT_WAL_BYTES)
        .open(path)
        .unwrap()
}

fn claim(
    store: &RedbStore,
    scope: &[u8],
    id: &[u8],
    now: Timestamp,
    lease: Duration,
    retention: Duration,
) -> Claim {
    match store
        .begin(&key(scope, id), &fp(scope, id), now, lease, retention)
        .unwrap()
    {
        Begin::Claimed(c) => c,
        other => panic!("expected Claimed for {id:?}, got {other:?}"),
    }
}

/// The claims of session one that session two completes or releases.
struct SessionOne {
    done_small: Claim,
    done_empty: Claim,
    done_1k: Claim,
    shared: Claim,
    expired_done: Claim,
    released: Claim,
}

/// Session one: ten claims (tokens 1..=10), then a clean close.
fn session_one(path: &Path) -> SessionOne {
    let store = open_for_script(path);
    let s = SessionOne {
        done_small: claim(&store, A, b"done-small", BASE, HOUR, DAY),
        done_empty: claim(&store, A, b"done-empty", BASE, HOUR, DAY),
        done_1k: claim(&store, B, b"done-1k", BASE, HOUR, DAY),
        shared: claim(&store, A, b"shared-id", BASE, HOUR, DAY),
        expired_done: {
            claim(&store, B, b"shared-id", BASE, HOUR, DAY);
            claim(&store, A, b"processing-live", BASE, HOUR, DAY);
            claim(&store, A, b"lease-lapsed", BASE - 10 * MIN, MIN, DAY);
            claim(&store, A, b"taken-over", BASE - 10 * MIN, MIN, DAY);
            claim(&store, B, b"expired-done", BASE - 2 * HOUR, MIN, HOUR)
        },
        released: claim(&store, A, RELEASED, BASE, HOUR, DAY),
    };
    assert_eq!(s.done_small.token(), 1);
    assert_eq!(s.expired_done.token(), 9);
    assert_eq!(s.released.token(), HWM_AFTER_SESSION_ONE);
    assert_eq!(store.stats().logged_commits, 10);
    s
}

/// Session two: eleven batches, each logged (none checkpointed).
fn session_two(store: &RedbStore, s: &SessionOne) {
    let before = store.stats();
    let done = |scope: &[u8], id: &[u8], c: &Claim, r: Response| {
        store
            .complete(&key(scope, id), c, &r, BASE + SEC, MONTH)
            .unwrap();
    };
    done(A, b"done-small", &s.done_small, resp_small());
    done(A, b"done-empty", &s.done_empty, resp_empty());
    done(B, b"done-1k", &s.done_1k, resp_1k());
    done(A, b"shared-id", &s.shared, resp_shared());
    assert_eq!(claim(store, B, NON_UTF8_ID, BASE, HOUR, DAY).token(), 11);
    let taken = claim(store, A, b"taken-over", BASE, HOUR, DAY);
    assert!(taken.is_takeover() && taken.attempt() == 2 && taken.token() == 12);
    store
        .complete(
            &key(B, b"expired-done"),
            &s.expired_done,
            &resp_old(),
            BASE - 2 * HOUR + SEC,
            HOUR,
        )
        .unwrap();
    let expiring = claim(store, B, b"expired-processing", BASE - 2 * HOUR, MIN, HOUR);
    assert_eq!(expiring.token(), 13);
    store.release(&key(A, RELEASED), &s.released).unwrap();
    let again = claim(store, A, RELEASED, BASE, HOUR, DAY);
    assert_eq!(again.token(), HWM);
    store.release(&key(A, RELEASED), &again).unwrap();
    let after = store.stats();
    assert_eq!(
        after.logged_commits - before.logged_commits,
        SESSION_TWO_BATCHES,
        "{after:?}"
    );
    assert_eq!(after.durable_commits, before.durable_commits, "{after:?}");
}

/// The crashed fixture's writer: sessions one and two, then an exit
/// without dropping the store (no shutdown, no checkpoint).
#[test]
#[ignore = "the crashed fixture's writer process; started by generate_format2_fixtures"]
fn format2_crash_child() {
    let Some(path) = std::env::var_os(ENV_CHILD_STORE) else {
        return; // run by hand with --ignored: nothing to do
    };
    let path = PathBuf::from(path);
    let s = session_one(&path);
    let store = open_for_script(&path);
    session_two(&store, &s);
    std::process::exit(CHILD_EXIT);
}

/// Writes the four fixture files (see the module docs).
#[test]
#[ignore = "writes the format-2 fixtures into $IDEMSTORE_FORMAT2_FIXTURE_DIR; see tests/it/upgrade.rs"]
fn generate_format2_fixtures() {
    let work = tempfile::tempdir().unwrap();
    let clean = work.path().join(CLEAN);
    let s = session_one(&clean);
    let store = open_for_script(&clean);
    session_two(&store, &s);
    drop(store); // a clean close: a durable checkpoint

    let crashed = work.path().join(CRASHED);
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "upgrade::format2_crash_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENV_CHILD_STORE, &crashed)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        output.status.code(),
        Some(CHILD_EXIT),
        "the crash child failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    for name in [CLEAN, CRASHED] {
        let store = std::fs::metadata(work.path().join(name)).unwrap().len();
        // Both logs start with a session-two frame (of a retired epoch in
        // the clean store, of the durable one in the crashed store).
        let log = std::fs::read(work.path().join(format!("{name}-wal"))).unwrap();
        assert_eq!(log.len() as u64, SCRIPT_WAL_BYTES, "{name}");
        assert_eq!(&log[..4], b"IDWL", "{name}");
        eprintln!("{name}: {store} bytes, its log {} bytes", log.len());
    }

    verify_clean(work.path());
    assert_eq!(verify_crashed(work.path()), SESSION_TWO_BATCHES);

    match std::env::var_os(ENV_FIXTURE_DIR) {
        None => eprintln!("dry run: set {ENV_FIXTURE_DIR} to write the fixtures"),
        Some(dir) => {
            for name in [CLEAN, CRASHED] {
                for file in [name.to_owned(), format!("{name}-wal")] {
                    let to = Path::new(&dir).join(&file);
                    std::fs::copy(work.path().join(&file), &to).unwrap();
                    eprintln!("wrote {}", to.display());
                }
            }
        }
    }
}

// ---------------------------------------------------------------- the checks

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Copies `name` (and with `log`, `name-wal`) from `from` into a new
/// temporary directory; returns it and the store's path in it.
fn copy(from: &Path, name: &str, log: bool) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let to = dir.path().join(name);
    std::fs::copy(from.join(name), &to).unwrap();
    if log {
        let wal = format!("{name}-wal");
        std::fs::copy(from.join(&wal), dir.path().join(&wal)).unwrap();
    }
    (dir, to)
}

const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("idemstore.meta");
const RECORDS: redb::TableDefinition<&[u8], &[u8]> =
    redb::TableDefinition::new("idemstore.records");
const EXPIRY: redb::TableDefinition<&[u8], ()> = redb::TableDefinition::new("idemstore.expiry");

/// What the store file says in its own tables (read with redb alone, from
/// a copy): format version, log epoch, token high-water mark, records,
/// index entries.
fn raw_tables(from: &Path, name: &str) -> (u32, u64, u64, u64, u64) {
    use redb::{ReadableDatabase, ReadableTableMetadata};
    let (_dir, path) = copy(from, name, false);
    let db = redb::Database::open(&path).unwrap();
    let txn = db.begin_read().unwrap();
    let meta = txn.open_table(META).unwrap();
    let get = |name: &str| meta.get(name).unwrap().unwrap().value().to_vec();
    let version = u32::from_be_bytes(get("format_version").try_into().unwrap());
    let epoch = u64::from_be_bytes(get("wal_epoch").try_into().unwrap());
    let hwm = u64::from_be_bytes(get("token_high_water_mark").try_into().unwrap());
    let records = txn.open_table(RECORDS).unwrap().len().unwrap();
    let index = txn.open_table(EXPIRY).unwrap().len().unwrap();
    (version, epoch, hwm, records, index)
}

/// The epoch in the header of the log's first frame (format 2: magic
/// `IDWL`, then the epoch, u64 big-endian).
fn first_frame_epoch(from: &Path, name: &str) -> u64 {
    let log = std::fs::read(from.join(format!("{name}-wal"))).unwrap();
    assert_eq!(&log[..4], b"IDWL", "{name}-wal");
    u64::from_be_bytes(log[4..12].try_into().unwrap())
}

/// The clean fixture in `from`: checked through redb alone, through the
/// store file alone, and with its log.
fn verify_clean(from: &Path) {
    // The log's frames are of epoch 3, the store file's epoch is 4: retired.
    assert_eq!(
        raw_tables(from, CLEAN),
        (2, 4, HWM, 11, 11),
        "format, log epoch, high-water mark, records, index entries"
    );
    assert_eq!(first_frame_epoch(from, CLEAN), 3);

    let (_dir, path) = copy(from, CLEAN, true);
    let store = RedbStore::open(&path).unwrap();
    let stats = store.stats();
    // Its log holds only frames of retired epochs.
    assert_eq!(stats.frames_replayed_on_open, 0, "{stats:?}");
    assert_eq!(stats.leases_expired_on_open, 0, "{stats:?}");
    check_records(&store);
    drop(store);
    reopen_and_check(&path);
}

/// The crashed fixture in `from`: its store file alone lacks session two,
/// and opened with its log it replays it. Returns the frames replayed.
fn verify_crashed(from: &Path) -> u64 {
    // The log's frames are of the store file's epoch, 3: to be replayed.
    assert_eq!(
        raw_tables(from, CRASHED),
        (2, 3, HWM_AFTER_SESSION_ONE, 10, 10),
        "format, log epoch, high-water mark, records, index entries of the store file alone"
    );
    assert_eq!(first_frame_epoch(from, CRASHED), 3);

    let (_dir, path) = copy(from, CRASHED, true);
    let store = RedbStore::open(&path).unwrap();
    let stats = store.stats();
    assert!(stats.frames_replayed_on_open > 0, "{stats:?}");
    assert_eq!(stats.leases_expired_on_open, 0, "{stats:?}");
    check_records(&store);
    drop(store);
    reopen_and_check(&path);
    stats.frames_replayed_on_open
}

/// A second open finds everything again, with nothing left to replay, and
/// the store answers from it.
fn reopen_and_check(path: &Path) {
    let store = RedbStore::open(path).unwrap();
    let stats = store.stats();
    assert_eq!(stats.frames_replayed_on_open, 0, "{stats:?}");
    check_records(&store);
    check_answers(&store);
}

/// The committed fixture files: read before a test, compared after it
/// with the files and with git's index (when git knows them).
struct Untouched(Vec<(String, Vec<u8>)>);

impl Untouched {
    fn snapshot(name: &str) -> Untouched {
        let files = [name.to_owned(), format!("{name}-wal")]
            .into_iter()
            .map(|file| {
                let bytes = std::fs::read(fixture_dir().join(&file))
                    .unwrap_or_else(|e| panic!("fixture {file}: {e}"));
                (file, bytes)
            })
            .collect();
        Untouched(files)
    }

    fn check(&self) {
        for (file, before) in &self.0 {
            let now = std::fs::read(fixture_dir().join(file)).unwrap();
            assert!(now == *before, "{file} was modified by the test");
            let git = Command::new("git")
                .arg("-C")
                .arg(env!("CARGO_MANIFEST_DIR"))
                .arg("show")
                .arg(format!(":tests/fixtures/{file}"))
                .stderr(Stdio::null())
                .output();
            match git {
                Ok(out) if out.status.success() => assert!(
                    out.stdout == *before,
                    "{file} differs from git's index (regenerated? `git add` it)"
                ),
                _ => eprintln!("{file}: not compared with git (no git, or not tracked)"),
            }
        }
    }
}

#[test]
fn a_cleanly_closed_format2_store_opens_with_every_record() {
    let untouched = Untouched::snapshot(CLEAN);
    verify_clean(&fixture_dir());
    untouched.check();
}

#[test]
fn a_crashed_format2_store_replays_the_acknowledged_writes_in_its_log() {
    let untouched = Untouched::snapshot(CRASHED);
    verify_crashed(&fixture_dir());
    untouched.check();
}
