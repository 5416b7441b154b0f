//! No silent loss: a store's files damaged, misplaced or half-copied
//! outside a crash end in a clear error at open, never in an `Ok` that has
//! quietly dropped acknowledged writes. Each test is a row of the table in
//! `docs/operations.md` ("When the files are damaged"); each would pass
//! silently, with writes missing, if its check were removed.
//!
//! A torn last frame after a crash is not damage: it stays a silent end of
//! the log (`wal::a_damaged_log_tail_ends_the_replay_at_the_last_whole_frame`
//! and the power-loss suite in `crash.rs`).

use idemstore::{Begin, Error, Fingerprint, Key, RedbStore, Store};
use idemstore_testkit::conformance::T0;
use idemstore_testkit::crash::{CrashBackend, CrashImage};
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(3600);
/// No time-based checkpoint during a test: the writes live in the log.
const NO_CHECKPOINT: Duration = Duration::from_secs(3600);

fn key(id: &str) -> Key {
    Key::new("tenant-1", id).unwrap()
}

/// A store on a simulated disk (store file + log sibling), with `ids`
/// claimed, one frame each, and the image a power loss right after the
/// last answer would leave (every frame synced).
fn logged_image(ids: &[&str]) -> CrashImage {
    let disk = CrashBackend::new();
    let log = disk.sibling();
    let store = RedbStore::builder()
        .checkpoint_interval(NO_CHECKPOINT)
        .open_backend(disk.clone(), log)
        .unwrap();
    for id in ids {
        let got = store
            .begin(&key(id), &Fingerprint::of(id.as_bytes()), T0, LEASE, KEEP)
            .unwrap();
        assert!(matches!(got, Begin::Claimed(_)), "{id}: {got:?}");
    }
    let image = disk.power_loss_all(0);
    drop(store);
    image
}

/// Where each frame of a log image starts (4 KiB-aligned, back to back).
fn frame_starts(log: &[u8]) -> Vec<usize> {
    let align = idemstore::unstable::redb::FRAME_ALIGN as usize;
    let mut starts = Vec::new();
    let mut at = 0;
    while log.len() >= at + 20 && log[at..at + 4] == *b"IDWL" {
        starts.push(at);
        let len = u32::from_be_bytes(log[at + 12..at + 16].try_into().unwrap()) as usize;
        at = (at + 20 + len).div_ceil(align) * align;
    }
    starts
}

fn reopen(image: &CrashImage) -> idemstore::Result<RedbStore> {
    let disk = image.restore();
    RedbStore::builder()
        .checkpoint_interval(NO_CHECKPOINT)
        .open_backend(disk.clone(), disk.file(1).unwrap())
}

/// The image opens, and holds every claim.
fn assert_all_there(image: &CrashImage, ids: &[&str]) {
    let store = reopen(image).unwrap();
    for id in ids {
        assert!(store.get(&key(id), T0).unwrap().is_some(), "{id} lost");
    }
}

/// Damages byte `offset` of frame `frame` of the log, and expects the open
/// to fail with `Corrupt` saying `says`.
fn damaged_frame_is_corrupt(frame: usize, offset: usize, says: &str) {
    let ids = ["a", "b", "c", "d"];
    let image = logged_image(&ids);
    assert_all_there(&image, &ids);
    let mut damaged = image.clone();
    let starts = frame_starts(&damaged.siblings[0]);
    assert_eq!(starts.len(), ids.len());
    damaged.siblings[0][starts[frame] + offset] ^= 0x10;
    let err = reopen(&damaged).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains(says), "{err}");
    // Accepting the loss: every frame that verifies is replayed, the
    // damaged one is skipped and reported.
    let disk = damaged.restore();
    let store = RedbStore::builder()
        .checkpoint_interval(NO_CHECKPOINT)
        .accept_loss(true)
        .open_backend(disk.clone(), disk.file(1).unwrap())
        .unwrap();
    let report = store.loss_report().expect("a report").clone();
    assert_eq!(report.frames_skipped, 1, "{report}");
    assert_eq!(report.frames_replayed, ids.len() as u64 - 1, "{report}");
    for (i, id) in ids.iter().enumerate() {
        let found = store.get(&key(id), T0).unwrap().is_some();
        assert_eq!(found, i != frame, "{id}: {report}");
    }
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert_eq!(json["frames_skipped"], 1);
}

#[test]
fn a_flipped_epoch_in_a_middle_frame_is_corrupt() {
    // Before: the replay stopped at the frame as if the log ended there,
    // and the two frames after it were dropped without a word.
    damaged_frame_is_corrupt(1, 11, "a later frame of the same epoch");
}

#[test]
fn a_flipped_length_in_a_middle_frame_is_corrupt() {
    // A length running past the segment looked like the end of the log.
    damaged_frame_is_corrupt(1, 12, "a later frame of the same epoch");
}

#[test]
fn a_flipped_magic_in_the_first_frame_is_corrupt() {
    // Before: 0 frames replayed, every write since the checkpoint gone.
    damaged_frame_is_corrupt(0, 0, "ends at offset 0");
}

#[test]
fn a_middle_frame_overwritten_with_zeros_is_corrupt() {
    let ids = ["a", "b", "c"];
    let mut image = logged_image(&ids);
    let starts = frame_starts(&image.siblings[0]);
    let block = idemstore::unstable::redb::FRAME_ALIGN as usize;
    image.siblings[0][starts[1]..starts[1] + block].fill(0);
    let err = reopen(&image).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(
        err.to_string().contains("a later frame of the same epoch"),
        "{err}"
    );
}

/// A store at `dir/s.idem` with `ids` claimed (in its log only: no
/// checkpoint yet) and still open, as a process that is about to be killed
/// leaves it. Returns the open store.
fn open_store_with_unchecked_writes(dir: &std::path::Path, ids: &[&str]) -> RedbStore {
    let store = RedbStore::builder()
        .checkpoint_interval(NO_CHECKPOINT)
        .open(dir.join("s.idem"))
        .unwrap();
    for id in ids {
        let got = store
            .begin(&key(id), &Fingerprint::of(id.as_bytes()), T0, LEASE, KEEP)
            .unwrap();
        assert!(matches!(got, Begin::Claimed(_)), "{id}: {got:?}");
    }
    store
}

/// Copies the store file (and, when `with_log`, its log) out of `from`
/// into a new directory, as a backup or a move taken from a running (or
/// killed) process would.
fn copy_out(from: &std::path::Path, with_log: bool) -> tempfile::TempDir {
    let to = tempfile::tempdir().unwrap();
    std::fs::copy(from.join("s.idem"), to.path().join("s.idem")).unwrap();
    if with_log {
        std::fs::copy(from.join("s.idem-wal"), to.path().join("s.idem-wal")).unwrap();
    }
    to
}

fn assert_unclean_refusal(err: &Error, says: &str) {
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("was not closed cleanly"), "{text}");
    assert!(text.contains(says), "{text}");
    assert!(text.contains("s.idem-wal"), "names the log: {text}");
}

#[test]
fn a_store_copied_without_its_log_after_an_unclean_stop_is_refused() {
    // Before: Ok, with every write since the last checkpoint gone.
    let dir = tempfile::tempdir().unwrap();
    let store = open_store_with_unchecked_writes(dir.path(), &["a", "b", "c"]);
    let both = copy_out(dir.path(), true);
    let alone = copy_out(dir.path(), false);
    drop(store);
    let err = RedbStore::open(alone.path().join("s.idem"))
        .map(|_| ())
        .unwrap_err();
    assert_unclean_refusal(&err, "missing or empty");
    // The refused open leaves no empty log behind to be mistaken for it.
    assert!(!alone.path().join("s.idem-wal").exists());
    // The read-only check says the same, and writes nothing either.
    let before = std::fs::read(alone.path().join("s.idem")).unwrap();
    let check = RedbStore::check_log(alone.path().join("s.idem")).unwrap();
    assert!(
        !check.present && check.clean_stop == Some(false),
        "{check:?}"
    );
    assert!(check.problems[0].contains("missing or empty"), "{check:?}");
    assert_eq!(std::fs::read(alone.path().join("s.idem")).unwrap(), before);
    assert!(!alone.path().join("s.idem-wal").exists());
    // Accepting the loss opens it, says so, and the writes are gone.
    let accepted = RedbStore::builder()
        .accept_loss(true)
        .open(alone.path().join("s.idem"))
        .unwrap();
    let report = accepted.loss_report().expect("a report");
    assert!(report.findings[0].contains("missing or empty"), "{report}");
    assert!(accepted.get(&key("a"), T0).unwrap().is_none());
    drop(accepted);
    // Accepted once: the store was closed cleanly and opens plainly.
    let again = RedbStore::open(alone.path().join("s.idem")).unwrap();
    assert!(again.loss_report().is_none());
    drop(again);
    // Copied with its log, the same store has every write.
    let store = RedbStore::open(both.path().join("s.idem")).unwrap();
    for id in ["a", "b", "c"] {
        assert!(store.get(&key(id), T0).unwrap().is_some(), "{id} lost");
    }
}

#[test]
fn an_empty_log_after_an_unclean_stop_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store_with_unchecked_writes(dir.path(), &["a"]);
    let copy = copy_out(dir.path(), false);
    drop(store);
    std::fs::File::create(copy.path().join("s.idem-wal")).unwrap();
    let err = RedbStore::open(copy.path().join("s.idem"))
        .map(|_| ())
        .unwrap_err();
    assert_unclean_refusal(&err, "missing or empty");
}

#[test]
fn a_log_cut_short_after_an_unclean_stop_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store_with_unchecked_writes(dir.path(), &["a", "b"]);
    let copy = copy_out(dir.path(), true);
    drop(store);
    let log = std::fs::OpenOptions::new()
        .write(true)
        .open(copy.path().join("s.idem-wal"))
        .unwrap();
    let len = log.metadata().unwrap().len();
    log.set_len(len / 2).unwrap();
    let err = RedbStore::open(copy.path().join("s.idem"))
        .map(|_| ())
        .unwrap_err();
    assert_unclean_refusal(&err, "cut short");
}

#[test]
fn after_a_clean_close_the_store_file_alone_is_enough() {
    // The close put everything into the file and marked the log closed:
    // the store opens without it (and makes a new one), nothing missing.
    let dir = tempfile::tempdir().unwrap();
    drop(open_store_with_unchecked_writes(dir.path(), &["a", "b"]));
    let copy = copy_out(dir.path(), false);
    let store = RedbStore::open(copy.path().join("s.idem")).unwrap();
    for id in ["a", "b"] {
        assert!(store.get(&key(id), T0).unwrap().is_some(), "{id} lost");
    }
    assert!(copy.path().join("s.idem-wal").exists());
}

#[test]
fn an_empty_store_file_beside_its_log_is_refused_not_recreated() {
    // Before: a brand-new empty store, and the old log overwritten by it.
    let dir = tempfile::tempdir().unwrap();
    let store = open_store_with_unchecked_writes(dir.path(), &["a", "b"]);
    let copy = copy_out(dir.path(), true);
    drop(store);
    std::fs::File::create(copy.path().join("s.idem")).unwrap(); // truncated to 0
    let log_before = std::fs::read(copy.path().join("s.idem-wal")).unwrap();
    let err = RedbStore::open(copy.path().join("s.idem"))
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("is empty, but its write-ahead log"),
        "{err}"
    );
    // Nothing was written: the log is as it was.
    assert_eq!(
        std::fs::read(copy.path().join("s.idem-wal")).unwrap(),
        log_before
    );
}

#[test]
fn a_missing_store_file_beside_its_log_is_refused_not_recreated() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store_with_unchecked_writes(dir.path(), &["a"]);
    let copy = copy_out(dir.path(), true);
    drop(store);
    std::fs::remove_file(copy.path().join("s.idem")).unwrap();
    let err = RedbStore::open(copy.path().join("s.idem"))
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("is missing, but its write-ahead log"),
        "{err}"
    );
    assert!(!copy.path().join("s.idem").exists(), "no store was created");
    // Accepting the loss moves the log aside, never over it.
    let log = std::fs::read(copy.path().join("s.idem-wal")).unwrap();
    let store = RedbStore::builder()
        .accept_loss(true)
        .open(copy.path().join("s.idem"))
        .unwrap();
    let report = store.loss_report().expect("a report");
    assert!(report.findings[0].contains("s.idem-wal.lost"), "{report}");
    assert_eq!(
        std::fs::read(copy.path().join("s.idem-wal.lost")).unwrap(),
        log
    );
}

#[test]
fn a_log_of_zeros_is_no_evidence_and_a_new_store_is_made() {
    // A log that never held a frame (all zeros, as preallocated) is
    // nothing to protect: the store is created beside it and uses it.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("s.idem-wal"), vec![0u8; 64 * 1024]).unwrap();
    let store = RedbStore::open(dir.path().join("s.idem")).unwrap();
    assert!(matches!(
        store
            .begin(&key("a"), &Fingerprint::of(b"a"), T0, LEASE, KEEP)
            .unwrap(),
        Begin::Claimed(_)
    ));
}

/// The offset and length of the last frame of the newest epoch in a log
/// file's bytes (frames start on 4 KiB blocks).
fn last_frame(log: &[u8]) -> (usize, usize) {
    let align = idemstore::unstable::redb::FRAME_ALIGN as usize;
    let mut best: Option<(u64, usize, usize)> = None;
    for at in (0..log.len().saturating_sub(20)).step_by(align) {
        if log[at..at + 4] != *b"IDWL" {
            continue;
        }
        let epoch = u64::from_be_bytes(log[at + 4..at + 12].try_into().unwrap());
        let len = 20 + u32::from_be_bytes(log[at + 12..at + 16].try_into().unwrap()) as usize;
        if best.is_none_or(|(e, a, _)| (epoch, at) > (e, a)) {
            best = Some((epoch, at, len));
        }
    }
    let (_, at, len) = best.expect("the log holds a frame");
    (at, len)
}

#[cfg(target_os = "linux")]
#[test]
fn a_damaged_last_frame_after_a_process_crash_is_corrupt() {
    // The writer answered the completion and was killed: its frame was
    // written whole (no power loss: the same boot). A byte of it flipped
    // since is damage to an acknowledged write, not a torn tail. Before:
    // Ok, with the completion silently gone.
    let dir = tempfile::tempdir().unwrap();
    let store = open_store_with_unchecked_writes(dir.path(), &["a"]);
    let claim = match store
        .begin(&key("b"), &Fingerprint::of(b"b"), T0, LEASE, KEEP)
        .unwrap()
    {
        Begin::Claimed(c) => c,
        other => panic!("{other:?}"),
    };
    let done = idemstore::Response::new(201, "paid");
    store.complete(&key("b"), &claim, &done, T0, KEEP).unwrap();
    let intact = copy_out(dir.path(), true);
    let damaged = copy_out(dir.path(), true);
    drop(store);
    // Intact, the copy replays the completion.
    let store = RedbStore::open(intact.path().join("s.idem")).unwrap();
    assert_eq!(
        store.get(&key("b"), T0).unwrap().unwrap().response(),
        Some(&done)
    );
    drop(store);
    let log_path = damaged.path().join("s.idem-wal");
    let mut log = std::fs::read(&log_path).unwrap();
    let (at, len) = last_frame(&log);
    assert!(len <= idemstore::unstable::redb::FRAME_ALIGN as usize);
    log[at + len - 1] ^= 0x01;
    std::fs::write(&log_path, &log).unwrap();
    let err = RedbStore::open(damaged.path().join("s.idem"))
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("has not restarted"), "{err}");
}

#[test]
fn another_stores_log_in_place_after_an_unclean_stop_is_refused() {
    // Two stores' files mixed up in a copy: B's store file (not closed
    // cleanly, writes in its log) beside A's log of the same size. Before:
    // Ok, A's frames silently ignored and B's writes gone.
    let a_dir = tempfile::tempdir().unwrap();
    let b_dir = tempfile::tempdir().unwrap();
    let a = open_store_with_unchecked_writes(a_dir.path(), &["a1", "a2"]);
    let b = open_store_with_unchecked_writes(b_dir.path(), &["b1"]);
    let mixed = copy_out(b_dir.path(), false);
    std::fs::copy(
        a_dir.path().join("s.idem-wal"),
        mixed.path().join("s.idem-wal"),
    )
    .unwrap();
    drop((a, b));
    let err = RedbStore::open(mixed.path().join("s.idem"))
        .map(|_| ())
        .unwrap_err();
    assert_unclean_refusal(&err, "verifies for this store");
    // Accepting the loss opens it and says so.
    let store = RedbStore::builder()
        .accept_loss(true)
        .open(mixed.path().join("s.idem"))
        .unwrap();
    let report = store.loss_report().expect("a report");
    assert!(
        report.findings[0].contains("belongs to another store"),
        "{report}"
    );
    assert!(store.get(&key("b1"), T0).unwrap().is_none());
    assert!(store.get(&key("a1"), T0).unwrap().is_none());
}
