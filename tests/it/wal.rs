//! `RedbStore`'s write-ahead log: batches acknowledged from the log alone
//! survive power loss, a torn or damaged log ends the replay where a crash
//! could have, and writes outside the writer retire the log.

use idemstore::redb::{Delivery, Inbox};
use idemstore::{
    Begin, Claim, Error, Fingerprint, Key, ManualClock, RedbStore, Response, State, Store,
};
use idemstore_testkit::conformance::T0;
use idemstore_testkit::crash::{CrashBackend, CrashImage};
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(3600);
/// Long enough that no time-based checkpoint happens during a test: what
/// survives a power loss is then owed to the log alone.
const NO_CHECKPOINT: Duration = Duration::from_secs(3600);

fn key(id: &str) -> Key {
    Key::new("tenant-1", id).unwrap()
}

fn fp(id: &str) -> Fingerprint {
    Fingerprint::of(id.as_bytes())
}

/// A store on a simulated disk: the store file, and its log as a sibling.
fn open(disk: &CrashBackend) -> RedbStore {
    let log = disk.file(1).unwrap_or_else(|| disk.sibling());
    RedbStore::builder()
        .checkpoint_interval(NO_CHECKPOINT)
        .open_backend(disk.clone(), log)
        .unwrap()
}

fn reopen(image: &CrashImage) -> RedbStore {
    open(&image.restore())
}

fn claim(store: &RedbStore, id: &str) -> Claim {
    match store.begin(&key(id), &fp(id), T0, LEASE, KEEP).unwrap() {
        Begin::Claimed(c) => c,
        other => panic!("expected Claimed for {id}, got {other:?}"),
    }
}

fn complete(store: &RedbStore, id: &str, c: &Claim) {
    let response = Response::new(201, format!("done {id}"));
    store.complete(&key(id), c, &response, T0, KEEP).unwrap();
}

#[test]
fn batches_acknowledged_from_the_log_alone_survive_power_loss() {
    // The failure this catches: an acknowledged claim or completion that
    // lived only in redb's in-memory commit (no checkpoint yet) and was
    // lost with the power because the log did not carry it.
    let disk = CrashBackend::new();
    let store = open(&disk);
    let checkpoints_at_open = store.stats().durable_commits;
    for i in 0..20 {
        let id = format!("k{i}");
        let c = claim(&store, &id);
        if i % 2 == 0 {
            complete(&store, &id, &c);
        }
    }
    let stats = store.stats();
    assert_eq!(stats.durable_commits, checkpoints_at_open, "{stats:?}");
    assert_eq!(stats.logged_commits, 30, "{stats:?}");
    for seed in 0..16 {
        let image = disk.power_loss_all(seed);
        let reopened = reopen(&image);
        assert!(reopened.stats().frames_replayed_on_open >= 30);
        for i in 0..20 {
            let id = format!("k{i}");
            let got = reopened.get(&key(&id), T0).unwrap().unwrap();
            let want = if i % 2 == 0 {
                State::Done
            } else {
                State::Processing
            };
            assert_eq!(got.state(), want, "seed {seed}, {id}");
        }
        // Tokens never go back: the high-water mark came back with the log.
        assert!(matches!(
            reopened.begin(&key("fresh"), &fp("fresh"), T0, LEASE, KEEP).unwrap(),
            Begin::Claimed(c) if c.token() == 21
        ));
    }
    drop(store);
}

#[test]
fn a_second_crash_after_recovery_loses_nothing() {
    // The failure this catches: recovery that replays the log into memory
    // but does not make it durable before new frames overwrite the log.
    let disk = CrashBackend::new();
    let store = open(&disk);
    let c = claim(&store, "a");
    complete(&store, "a", &c);
    let first = disk.power_loss_all(1);
    drop(store);
    let disk = first.restore();
    let store = open(&disk);
    claim(&store, "b");
    let second = disk.power_loss_all(2);
    drop(store);
    let store = reopen(&second);
    assert_eq!(
        store.get(&key("a"), T0).unwrap().unwrap().state(),
        State::Done
    );
    assert_eq!(
        store.get(&key("b"), T0).unwrap().unwrap().state(),
        State::Processing
    );
}

#[test]
fn a_damaged_log_tail_ends_the_replay_at_the_last_whole_frame() {
    // A crash tears the frame being written: the frames before it are
    // replayed, the torn one and anything after it are not.
    let disk = CrashBackend::new();
    let store = open(&disk);
    claim(&store, "first");
    claim(&store, "second");
    let image = disk.power_loss_all(0);
    drop(store);
    let mut damaged = image.clone();
    let ends = frame_ends(&damaged.siblings[0]);
    assert_eq!(ends.len(), 2);
    // Flip the last byte of the second frame: its CRC no longer matches.
    damaged.siblings[0][ends[1] - 1] ^= 0x40;
    let store = reopen(&damaged);
    assert_eq!(store.stats().frames_replayed_on_open, 1);
    assert!(store.get(&key("first"), T0).unwrap().is_some());
    assert!(store.get(&key("second"), T0).unwrap().is_none());
    drop(store);
    // The untouched image has both.
    let store = reopen(&image);
    assert_eq!(store.stats().frames_replayed_on_open, 2);
    assert!(store.get(&key("second"), T0).unwrap().is_some());
}

#[test]
fn a_damaged_frame_before_a_whole_one_is_corrupt_not_a_silent_stop() {
    // No crash damages a frame that has a synced frame after it: that is
    // damage to the medium. Stopping the replay there would drop the
    // acknowledged writes in the later frames without a word.
    let disk = CrashBackend::new();
    let store = open(&disk);
    claim(&store, "first");
    claim(&store, "second");
    claim(&store, "third");
    let mut image = disk.power_loss_all(0);
    drop(store);
    let ends = frame_ends(&image.siblings[0]);
    assert_eq!(ends.len(), 3);
    // Flip the last byte of the second frame; the third still verifies.
    image.siblings[0][ends[1] - 1] ^= 0x01;
    let disk = image.restore();
    let err = RedbStore::builder()
        .open_backend(disk.clone(), disk.file(1).unwrap())
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(
        err.to_string().contains("a later frame of the same epoch"),
        "{err}"
    );
}

/// Where each frame of a log image ends (frames start at 0; a frame is a
/// 20-byte header, whose bytes 12..16 are the payload length, and the payload).
fn frame_ends(log: &[u8]) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut at = 0;
    // Frames start on 4 KiB boundaries (idemstore::unstable::redb::FRAME_ALIGN).
    let align = idemstore::unstable::redb::FRAME_ALIGN as usize;
    while log.len() >= at + 20 && log[at..at + 4] == *b"IDWL" {
        let len = u32::from_be_bytes(log[at + 12..at + 16].try_into().unwrap()) as usize;
        let end = at + 20 + len;
        ends.push(end);
        at = end.div_ceil(align) * align;
    }
    ends
}

#[test]
fn a_frame_that_verifies_but_does_not_decode_is_corrupt_not_skipped() {
    // No crash writes a whole frame with a correct CRC and a bad payload:
    // that is damage or a bug, and silently dropping it would lose
    // acknowledged writes. The open must refuse with a typed error.
    let disk = CrashBackend::new();
    let store = open(&disk);
    let store_id = store.store_id();
    claim(&store, "a");
    let image = disk.power_loss_all(0);
    drop(store);
    let mut forged = image.clone();
    let log = &mut forged.siblings[0];
    let epoch: [u8; 8] = log[4..12].try_into().unwrap();
    let payload = [9u8, 0, 0, 0, 1, b'x']; // tag 9 does not exist
    let mut frame = b"IDWL".to_vec();
    frame.extend_from_slice(&epoch);
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    // The CRC covers the store's id first (see src/redb/record_log/frame.rs).
    let mut crc = crc32fast::Hasher::new();
    crc.update(&store_id.to_be_bytes());
    crc.update(&frame);
    crc.update(&payload);
    frame.extend_from_slice(&crc.finalize().to_be_bytes());
    frame.extend_from_slice(&payload);
    log[..frame.len()].copy_from_slice(&frame);
    let disk = forged.restore();
    let err = RedbStore::builder()
        .open_backend(disk.clone(), disk.file(1).unwrap())
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("unknown entry tag 9"), "{err}");
}

#[test]
fn another_stores_log_is_never_replayed() {
    // The failure this catches: a log left beside a different store (a
    // store deleted and created again, two stores' files mixed up in a
    // copy) whose frames happen to carry the current epoch, replayed into
    // the wrong store.
    let disk_a = CrashBackend::new();
    let a = open(&disk_a);
    claim(&a, "only-in-a");
    let image_a = disk_a.power_loss_all(0);
    drop(a);
    let disk_b = CrashBackend::new();
    let b = open(&disk_b);
    claim(&b, "only-in-b");
    let mut image_b = disk_b.power_loss_all(0);
    drop(b);
    // Both logs hold frames of epoch 1; B's store file gets A's log.
    assert_eq!(image_a.siblings[0][4..12], image_b.siblings[0][4..12]);
    image_b.siblings = image_a.siblings.clone();
    let mixed = reopen(&image_b);
    assert_eq!(mixed.stats().frames_replayed_on_open, 0);
    assert!(mixed.get(&key("only-in-a"), T0).unwrap().is_none());
}

#[test]
fn a_write_outside_the_writer_retires_the_logged_frames() {
    // The failure this catches: the inbox commits a key durably that a
    // logged (not yet checkpointed) batch also wrote; if the log were
    // replayed after a crash, its older frame would undo the inbox's write.
    let disk = CrashBackend::new();
    let store = open(&disk);
    // Logged: PROCESSING with a 1 ms retention, so it expires at once.
    let short = Duration::from_millis(1);
    assert!(matches!(
        store.begin(&key("m"), &fp("m"), T0, short, short).unwrap(),
        Begin::Claimed(_)
    ));
    assert_eq!(store.stats().logged_commits, 1);
    let later = T0 + Duration::from_secs(1);
    let inbox = Inbox::new(store).clock(ManualClock::new(later));
    let handled = inbox
        .handle(&key("m"), &fp("m"), |_, _| {
            Ok::<_, Error>(Response::new(200, "from the inbox"))
        })
        .unwrap();
    assert!(matches!(handled, Delivery::Handled(_)));
    let image = disk.power_loss_all(3);
    drop(inbox);
    let store = reopen(&image);
    let got = store.get(&key("m"), later).unwrap().unwrap();
    assert_eq!(got.state(), State::Done);
    assert_eq!(got.response().unwrap().body(), b"from the inbox");
}

#[test]
fn compaction_checkpoints_the_log_first() {
    let disk = CrashBackend::new();
    let store = open(&disk);
    for i in 0..10 {
        claim(&store, &format!("k{i}"));
    }
    store.compact().unwrap();
    let image = disk.power_loss_all(5);
    drop(store);
    let store = reopen(&image);
    // Everything is in the store file: nothing was left to replay.
    assert_eq!(store.stats().frames_replayed_on_open, 0);
    for i in 0..10 {
        assert!(store.get(&key(&format!("k{i}")), T0).unwrap().is_some());
    }
}

#[test]
fn a_batch_larger_than_the_log_is_committed_durably_on_its_own() {
    let disk = CrashBackend::new();
    let log = disk.sibling();
    let store = RedbStore::builder()
        .checkpoint_interval(NO_CHECKPOINT)
        .log_bytes(idemstore::unstable::redb::MIN_WAL_BYTES)
        .open_backend(disk.clone(), log)
        .unwrap();
    let c = claim(&store, "big");
    let before = store.stats();
    let body = vec![7u8; 3 * idemstore::unstable::redb::MIN_WAL_BYTES as usize];
    store
        .complete(&key("big"), &c, &Response::new(200, body.clone()), T0, KEEP)
        .unwrap();
    let after = store.stats();
    assert_eq!(after.durable_commits, before.durable_commits + 1);
    assert_eq!(after.logged_commits, before.logged_commits);
    let image = disk.power_loss_all(9);
    drop(store);
    let store = reopen(&image);
    let got = store.get(&key("big"), T0).unwrap().unwrap();
    assert_eq!(got.response().unwrap().body(), body.as_slice());
}

#[test]
fn the_log_is_owner_only_and_preallocated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let wal = dir.path().join("s.idem-wal");
    let store = RedbStore::open(&path).unwrap();
    let c = claim(&store, "a");
    complete(&store, "a", &c);
    let meta = std::fs::metadata(&wal).unwrap();
    assert_eq!(meta.len(), idemstore::unstable::redb::WAL_BYTES);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }
    assert!(store.stats().logged_commits >= 2);
}

#[test]
fn bad_log_options_are_refused_before_any_io() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let err = RedbStore::builder().log_bytes(100).open(&path).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let err = RedbStore::builder()
        .checkpoint_interval(Duration::ZERO)
        .open(&path)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(!path.exists());
}

#[test]
fn a_full_disk_while_logging_poisons_and_loses_nothing_acknowledged() {
    let disk = CrashBackend::new();
    let store = open(&disk);
    let c = claim(&store, "a");
    disk.set_disk_full(true);
    let err = store
        .complete(&key("a"), &c, &Response::new(200, "x"), T0, KEEP)
        .unwrap_err();
    assert!(!matches!(err, Error::StaleClaim), "{err}");
    assert!(store.is_poisoned());
    assert!(matches!(
        store.begin(&key("b"), &fp("b"), T0, LEASE, KEEP),
        Err(Error::Poisoned { .. })
    ));
    disk.set_disk_full(false);
    let image = disk.power_loss_all(4);
    drop(store);
    let store = reopen(&image);
    assert_eq!(
        store.get(&key("a"), T0).unwrap().unwrap().state(),
        State::Processing
    );
}

#[test]
fn the_log_file_reads_back_what_the_store_wrote() {
    // The real-file log: a store reopened from its path finds its records
    // whether they reached the store file by a checkpoint or not.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let store = RedbStore::builder()
        .checkpoint_interval(NO_CHECKPOINT)
        .open(&path)
        .unwrap();
    for i in 0..50 {
        claim(&store, &format!("k{i}"));
    }
    drop(store);
    let store = RedbStore::open(&path).unwrap();
    // A clean close checkpoints: nothing to replay.
    assert_eq!(store.stats().frames_replayed_on_open, 0);
    assert!(store.get(&key("k49"), T0).unwrap().is_some());
}

#[test]
fn an_idle_store_is_checkpointed_after_the_interval_and_reads_move_to_the_file() {
    // The background thread freezes an old memtable on its own: an idle
    // store does not keep its records only in memory and the log.
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::builder()
        .checkpoint_interval(Duration::from_millis(20))
        .open(dir.path().join("s.idem"))
        .unwrap();
    let c = claim(&store, "a");
    complete(&store, "a", &c);
    wait_for_checkpoints(&store, 1);
    // Read back from the store file now.
    assert_eq!(
        store.get(&key("a"), T0).unwrap().unwrap().state(),
        State::Done
    );
    // And a later write starts a fresh log: the frames were retired.
    let stats = store.stats();
    assert_eq!(stats.logged_commits, 2);
    assert!(stats.durable_commits >= 1);
}

/// Waits until the background checkpointer has written `n` memtables.
fn wait_for_checkpoints(store: &RedbStore, n: u64) {
    assert!(
        checkpoints_reach(store, n, Duration::from_secs(20)),
        "no checkpoint"
    );
}

/// Whether the store has made `n` checkpoints, waiting up to `within`.
fn checkpoints_reach(store: &RedbStore, n: u64, within: Duration) -> bool {
    let deadline = std::time::Instant::now() + within;
    while store.stats().checkpoints < n {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

#[test]
fn a_checkpointed_replay_is_answered_from_the_store_file_and_never_goes_stale() {
    let dir = tempfile::tempdir().unwrap();
    let store = RedbStore::builder()
        .checkpoint_interval(Duration::from_millis(10))
        .open(dir.path().join("s.idem"))
        .unwrap();
    let (a, b) = (claim(&store, "a"), claim(&store, "b"));
    complete(&store, "a", &a);
    complete(&store, "b", &b);
    // A checkpoint, and a second one if it comes: the first may have
    // written a memtable frozen before the completions (the claims only);
    // the completions are then due 10 ms later.
    let done = store.stats().checkpoints;
    wait_for_checkpoints(&store, done + 1);
    checkpoints_reach(&store, done + 2, Duration::from_secs(1));
    let begin = |id: &str, at| store.begin(&key(id), &fp(id), at, LEASE, KEEP).unwrap();
    // In the store file now, and replayed from it.
    let Begin::Replay(r) = begin("a", T0) else {
        panic!("expected a replay")
    };
    assert_eq!(r.body(), b"done a");

    // The record expires and a new request claims the key: the claim (in
    // the memtable, then checkpointed) hides the stored response.
    let later = T0 + KEEP + Duration::from_millis(1);
    assert!(matches!(begin("a", later), Begin::Claimed(_)));
    assert!(matches!(begin("a", later), Begin::InFlight { .. }));
    let done = store.stats().checkpoints;
    wait_for_checkpoints(&store, done + 1);
    assert!(matches!(begin("a", later), Begin::InFlight { .. }));
    let raw = store.admin().get_raw(&key("a")).unwrap().unwrap();
    assert_eq!(raw.state(), State::Processing);

    // A write that bypasses the memtable (the admin's evict) is seen: the
    // evicted key is claimed again, not replayed.
    assert!(matches!(begin("b", T0), Begin::Replay(_)));
    assert!(store.admin().evict(&key("b")).unwrap().is_some());
    assert!(matches!(begin("b", T0), Begin::Claimed(_)));
}
