//! `RedbStoreBuilder::page_log`: redb's commits through `<file>-pages`.
//! What the inbox commits is there after a clean close, after a crash
//! image (the store file without the pages only the log holds), through a
//! read-only view (in memory, nothing written), and after an open without
//! the option (which replays the log into the file and removes it).
//! Power cuts of the page log itself are the unit tests in
//! `src/redb/page_log/backend.rs` (a simulated disk, a lying one, torn writes).

use idemstore::redb::engine::{ReadableTable, TableDefinition, WriteTransaction};
use idemstore::redb::{Delivery, Inbox, Message};
use idemstore::{BoxError, Claim, Fingerprint, Key, RedbStore, Response};
use std::path::Path;
use std::time::Duration;

const BALANCES: TableDefinition<u64, u64> = TableDefinition::new("it.page_log.balances");

fn credit(txn: &WriteTransaction, _claim: &Claim, m: &Message<u64>) -> Result<Response, BoxError> {
    let mut t = txn.open_table(BALANCES)?;
    let account = m.payload % 10;
    let new = t.get(account)?.map_or(0, |v| v.value()) + m.payload;
    t.insert(account, new)?;
    Ok(Response::new(200, new.to_string()))
}

fn batch(ids: std::ops::Range<u64>) -> Vec<Message<u64>> {
    ids.map(|id| {
        Message::new(
            Key::new("pay", format!("p-{id}")).unwrap(),
            Fingerprint::of(id.to_be_bytes()),
            id,
        )
    })
    .collect()
}

/// The sum of the balances the inbox wrote.
fn total(store: RedbStore) -> u64 {
    total_of(&Inbox::new(store))
}

fn total_of(inbox: &Inbox) -> u64 {
    inbox
        .read(|txn| {
            let Ok(t) = txn.open_table(BALANCES) else {
                return Ok::<_, BoxError>(0);
            };
            Ok(t.iter()?.map(|e| e.map_or(0, |(_, v)| v.value())).sum())
        })
        .unwrap()
}

fn paged(path: &Path) -> RedbStore {
    RedbStore::builder()
        .page_log(true)
        // No background checkpoint of the (empty) memtable meanwhile.
        .checkpoint_interval(Duration::from_secs(3600))
        .open(path)
        .unwrap()
}

/// Handles ids `0..n` in batches of 100, all new.
fn run(inbox: &Inbox, n: u64) {
    run_from(inbox, 0, n);
}

fn run_from(inbox: &Inbox, from: u64, n: u64) {
    for start in (from..n).step_by(100) {
        let answers = inbox
            .handle_batch(&batch(start..(start + 100).min(n)), credit)
            .unwrap();
        assert!(
            answers
                .iter()
                .all(|a| matches!(a, Ok(Delivery::Handled(_))))
        );
    }
}

fn sum_to(n: u64) -> u64 {
    n * (n - 1) / 2
}

fn copy_store(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

#[test]
fn the_inbox_commits_through_the_page_log_and_a_clean_close_leaves_the_file_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let inbox = Inbox::new(paged(&path));
    run(&inbox, 1_000);
    // A redelivery is a duplicate, through the same log.
    let again = inbox.handle_batch(&batch(990..1_010), credit).unwrap();
    assert_eq!(
        again
            .iter()
            .filter(|a| matches!(a, Ok(Delivery::Duplicate(_))))
            .count(),
        10
    );
    // Preallocated to its full size at open: appends never grow it.
    let pages = std::fs::metadata(dir.path().join("s.idem-pages")).unwrap();
    assert_eq!(pages.len(), idemstore::unstable::redb::PAGE_LOG_BYTES);
    drop(inbox);
    // Closed cleanly: the store file alone holds everything.
    let copy = tempfile::tempdir().unwrap();
    std::fs::copy(&path, copy.path().join("s.idem")).unwrap();
    let store = RedbStore::open(copy.path().join("s.idem")).unwrap();
    assert_eq!(total(store), sum_to(1_010));
    assert!(!copy.path().join("s.idem-pages").exists());
    // And the page-logged store reopens with it.
    assert_eq!(total(paged(&path)), sum_to(1_010));
}

/// A copy of the files while the store is open is what a crash leaves:
/// the batches since the last page checkpoint are only in the page log.
/// Every way of opening it sees them all.
#[test]
fn a_crash_image_opens_whole_every_way() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let inbox = Inbox::new(paged(&path));
    run(&inbox, 2_000);
    let image = tempfile::tempdir().unwrap();
    copy_store(dir.path(), image.path());
    drop(inbox);
    let copied = image.path().join("s.idem");
    // The store file alone misses batches: the log is needed.
    let alone = tempfile::tempdir().unwrap();
    std::fs::copy(&copied, alone.path().join("s.idem")).unwrap();
    let lost = RedbStore::open(alone.path().join("s.idem")).map(total);
    assert!(
        !matches!(lost, Ok(t) if t == sum_to(2_000)),
        "the image must need its page log"
    );

    // A read-only view replays it in memory and writes nothing.
    let before = snapshot(image.path());
    {
        let view = RedbStore::open_read_only(&copied).unwrap();
        assert_eq!(total(view), sum_to(2_000));
    }
    assert_eq!(snapshot(image.path()), before, "an inspection wrote");

    // A writer with the page log replays it too, and goes on.
    let second = tempfile::tempdir().unwrap();
    copy_store(image.path(), second.path());
    {
        let inbox = Inbox::new(paged(&second.path().join("s.idem")));
        assert_eq!(total_of(&inbox), sum_to(2_000));
        run_from(&inbox, 2_000, 2_100);
        assert_eq!(total_of(&inbox), sum_to(2_100));
    }

    // A writer without it replays it into the file and removes it.
    let store = RedbStore::open(&copied).unwrap();
    assert!(!image.path().join("s.idem-pages").exists());
    assert_eq!(total(store), sum_to(2_000));
    assert_eq!(total(RedbStore::open(&copied).unwrap()), sum_to(2_000));
}

/// A second writer is refused while the page-logged one is open, whether
/// or not it asks for the page log, and so is a read-only view.
#[test]
fn a_page_logged_store_is_locked_against_every_other_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let _store = paged(&path);
    assert!(matches!(
        RedbStore::open(&path),
        Err(idemstore::Error::Locked { .. })
    ));
    assert!(matches!(
        RedbStore::builder().page_log(true).open(&path),
        Err(idemstore::Error::Locked { .. })
    ));
    assert!(matches!(
        RedbStore::open_read_only(&path),
        Err(idemstore::Error::Locked { .. })
    ));
}

/// A page log beside the store that cannot be opened (here a symbolic
/// link to itself) fails a view with the I/O error: it is never taken for
/// a store without a page log, whose view would miss its commits.
#[cfg(unix)]
#[test]
fn a_page_log_that_cannot_be_opened_fails_a_view() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    drop(RedbStore::open(&path).unwrap());
    std::os::unix::fs::symlink("s.idem-pages", dir.path().join("s.idem-pages")).unwrap();
    let err = RedbStore::open_read_only(&path).unwrap_err();
    assert!(matches!(err, idemstore::Error::Io(_)), "{err}");
}
