//! [`Db`]: the redb engine behind its lock, the read path's kept snapshot,
//! and the store's health (poisoned or not, why, and what a heal needs to
//! reopen the engine).
//!
//! The kept snapshot is one read transaction's tables, kept from one redb
//! commit to the next, so a read (the fast path, the committer's group) does not
//! open a transaction. Never stale: every redb commit bumps
//! [`Snapshot::committed`] after it commits and before its writer lets go
//! of what it wrote in memory. A reader reads the memtable, then the count,
//! and uses a snapshot kept under that count or a later one: a commit it
//! misses is either not counted yet (its records are in the memtable just
//! read) or counted. A kept snapshot pins its commit's pages, so every
//! commit drops it, and so does taking the engine for exclusive use.

use super::file::engine_error;
use super::health::{self, On};
use super::tables::ReadTables;
use super::{Config, RecoveryPolicy, file};
use crate::error::{Cause, Error, Result};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use crate::time::Clock;
use ::redb::{Database, ReadableDatabase};
use std::path::{Path, PathBuf};

pub(super) struct Db {
    /// The kept redb snapshot and the count of redb commits (module docs);
    /// declared before `engine` so that it is dropped first.
    pub(super) snapshot: Snapshot,
    /// A read lock for every transaction; a compaction and a heal take the
    /// write lock, which is how they wait out every live transaction.
    engine: RwLock<Engine>,
    pub(super) health: health::HealthCell,
    pub(super) source: file::Origin,
    pub(super) witness: Arc<file::IoWitness>,
    pub(super) attempts: Mutex<health::Attempts>,
    /// The options a heal reopens with (no lease ended, nothing verified).
    pub(super) heal_config: Config,
    pub(super) clock: Arc<dyn Clock>,
    /// The store file, in errors (`None` for a storage backend).
    pub(super) path: Option<PathBuf>,
}

pub(super) struct Engine {
    pub(super) db: Database,
    pub(super) usable: Usable,
}

/// What the engine may be used for, from least to most.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Usable {
    /// A heal cannot open the files: an empty stand-in; reads fail.
    No,
    /// A heal cannot open them for writing: a view that writes nothing
    /// (`overlay::open_view_of`); reads go on.
    ForReads,
    /// The store's files, opened for writing.
    Yes,
}

/// A read lock on a usable engine (see [`Db::read_db`]).
pub(super) struct DbRead<'a>(RwLockReadGuard<'a, Engine>);

impl std::ops::Deref for DbRead<'_> {
    type Target = Database;
    fn deref(&self) -> &Database {
        &self.0.db
    }
}

impl Db {
    pub(super) fn new(
        db: Database,
        source: file::Origin,
        witness: Arc<file::IoWitness>,
        config: &Config,
        path: Option<&Path>,
    ) -> Db {
        Db {
            snapshot: Snapshot::default(),
            engine: RwLock::new(Engine {
                db,
                usable: Usable::Yes,
            }),
            health: health::HealthCell::default(),
            source,
            witness,
            attempts: Mutex::new(health::Attempts::default()),
            heal_config: Config {
                recovery: RecoveryPolicy::WaitForLease,
                verify_on_open: false,
                accept_loss: false,
                sweeper: None,
                ..config.clone()
            },
            clock: Arc::clone(&config.clock),
            path: path.map(Path::to_path_buf),
        }
    }

    /// The engine, or the cause while a heal could not reopen it for reads
    /// ([`write_ready_db`](Self::write_ready_db): for writes).
    pub(super) fn read_db(&self) -> Result<DbRead<'_>> {
        self.db_for(Usable::ForReads)
    }
    pub(super) fn write_ready_db(&self) -> Result<DbRead<'_>> {
        self.db_for(Usable::Yes)
    }
    fn db_for(&self, need: Usable) -> Result<DbRead<'_>> {
        let engine = self.engine.read().unwrap_or_else(|p| p.into_inner());
        if engine.usable < need {
            return Err(self.poisoned_error());
        }
        Ok(DbRead(engine))
    }
    /// Calls `f` with redb's tables as of at least commit count `seen`
    /// (read by the caller after the memtable): the kept snapshot when it
    /// is recent enough, otherwise a new one, which is then kept.
    pub(super) fn read_tables<T>(&self, seen: u64, f: impl FnOnce(&ReadTables) -> T) -> Result<T> {
        let (db, kept) = (self.read_db()?, &self.snapshot);
        {
            let slot = kept.slot.read().unwrap_or_else(|p| p.into_inner());
            if let Some(k) = slot.as_ref().filter(|k| k.commits >= seen) {
                return Ok(f(&k.tables));
            }
        }
        #[cfg(test)]
        kept.opened.fetch_add(1, Ordering::Relaxed);
        let txn = db.begin_read().map_err(engine_error)?;
        let tables = ReadTables::open(&txn)?;
        let out = f(&tables);
        // Kept even over a more recent one: its count is true of it.
        *kept.slot.write().unwrap_or_else(|p| p.into_inner()) = Some(Kept {
            commits: seen,
            tables,
        });
        Ok(out)
    }

    /// The engine for exclusive use (a heal, a compaction, the verifier's
    /// in-place check): every transaction waited out, the kept snapshot
    /// dropped and the use counted as a commit (redb compacts and checks
    /// only with no live read, and a heal may change the files).
    pub(super) fn write_db(&self) -> RwLockWriteGuard<'_, Engine> {
        let engine = self.engine.write().unwrap_or_else(|p| p.into_inner());
        self.snapshot.committed();
        engine
    }

    /// Poisons with `error` (met `during` an operation on `on`; the first
    /// failure stays the cause) and returns it, an I/O error keeping its
    /// kind and gaining the file and the operation. The engine's refusal
    /// after an earlier I/O error names none: the last I/O error its
    /// storage returned stands for it.
    pub(super) fn poison(&self, during: &'static str, on: On, error: Error) -> Error {
        let error = match error {
            e if super::file::is_latched(&e) => self.witness.last().map_or(e, Error::Io),
            e => e,
        };
        let path = self.file_name(on);
        let cause = Cause::new(during, Some(&path), &error);
        if self.health.poison(&cause, self.clock.now()) {
            crate::observability::poisoned("redb", &cause);
            crate::observability::health("redb", if cause.heals() { 1 } else { 2 });
        }
        match error {
            Error::Io(e) => Error::Io(std::io::Error::new(e.kind(), cause.to_string())),
            other => other,
        }
    }

    pub(super) fn poisoned_error(&self) -> Error {
        Error::Poisoned {
            cause: self.health.cause(),
        }
    }

    /// Poisoned by a cause that may go away: the background thread heals.
    pub(super) fn heals(&self) -> bool {
        self.health.is_poisoned() && self.health.cause().is_none_or(|c| c.heals())
    }

    pub(super) fn healthy_again(&self) {
        if let Some(fault) = self.health.clear() {
            let since = fault.since.until(self.clock.now());
            crate::observability::healed("redb", &fault.cause, since);
            crate::observability::health("redb", 0);
        }
    }

    /// The store file or the log, as errors name it.
    pub(super) fn file_name(&self, on: On) -> String {
        match (&self.path, on) {
            (Some(path), On::Store) => path.display().to_string(),
            (Some(path), On::Log) => super::file::log_path(path).display().to_string(),
            (None, On::Store) => file::BACKEND.to_owned(),
            (None, On::Log) => "<log backend>".to_owned(),
        }
    }
}

/// The redb commits counted so far, and the kept snapshot with the count
/// it was opened under.
#[derive(Default)]
pub(super) struct Snapshot {
    commits: AtomicU64,
    slot: RwLock<Option<Kept>>,
    #[cfg(test)]
    opened: std::sync::atomic::AtomicUsize,
}

struct Kept {
    commits: u64,
    tables: ReadTables,
}

impl Snapshot {
    /// The redb commits so far: read after the memtable, the `seen` of
    /// [`Db::read_tables`].
    pub(super) fn count(&self) -> u64 {
        self.commits.load(Ordering::Acquire)
    }

    /// Counts a redb commit and drops the kept snapshot: called after the
    /// commit and before its writer lets go of what it wrote in memory (see
    /// the module docs).
    pub(super) fn committed(&self) {
        self.commits.fetch_add(1, Ordering::Release);
        let old = self.slot.write().unwrap_or_else(|p| p.into_inner()).take();
        drop(old);
    }
}

#[cfg(test)]
mod tests {
    use super::Snapshot;
    use crate::redb::{RedbStore, RedbStoreBuilder};
    use crate::{Begin, Claim, Fingerprint, Key, Response, Store, Timestamp};
    use std::time::Duration;

    impl Snapshot {
        /// Drops the kept snapshot without counting a commit.
        fn clear(&self) {
            self.slot.write().unwrap().take();
        }

        pub(in crate::redb) fn opened(&self) -> usize {
            self.opened.load(std::sync::atomic::Ordering::Relaxed)
        }

        pub(in crate::redb) fn is_kept(&self) -> bool {
            self.slot.read().unwrap().is_some()
        }
    }

    const LEASE: Duration = Duration::from_secs(60);
    const KEEP: Duration = Duration::from_secs(3600);
    const NOW: Timestamp = Timestamp::from_millis(1_000_000);

    fn key() -> Key {
        Key::new("t", "k").unwrap()
    }

    /// A store in `dir` with a checkpoint interval of `interval`.
    fn store(dir: &tempfile::TempDir, interval: Duration) -> RedbStore {
        RedbStoreBuilder::default()
            .checkpoint_interval(interval)
            .open(dir.path().join("s.idem"))
            .unwrap()
    }

    fn begin(store: &RedbStore) -> Begin {
        store
            .begin(&key(), &Fingerprint::of(b"fp"), NOW, LEASE, KEEP)
            .unwrap()
    }

    fn claim(store: &RedbStore) -> Claim {
        match begin(store) {
            Begin::Claimed(claim) => claim,
            other => panic!("{other:?}"),
        }
    }

    fn complete(store: &RedbStore, claim: &Claim) {
        store
            .complete(&key(), claim, &Response::new(201, "done"), NOW, KEEP)
            .unwrap();
    }

    /// Waits until the checkpointer has written both memtables into redb.
    fn checkpointed(store: &RedbStore) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !store.shared.memory.read_mem().is_empty() {
            assert!(std::time::Instant::now() < deadline, "no checkpoint");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Reads the claim from redb (keeping a snapshot that holds it in
    /// flight), completes it, moves the completion into redb with
    /// `to_redb`, and begins again: the answer must be the replay, not the
    /// in-flight claim the kept snapshot still holds.
    ///
    /// The snapshot kept by the claim's own read (before the claim) is
    /// dropped first, as any other commit would: one kept from before
    /// the record existed would only send the reads to the line, where
    /// the committer reads redb itself, and hide a stale snapshot.
    fn a_completion_written_to_redb_is_read(store: &RedbStore, to_redb: impl Fn(&RedbStore)) {
        let claim = claim(store);
        to_redb(store);
        store.shared.db.snapshot.clear();
        let fast = store.stats().fast_refusals;
        assert!(matches!(begin(store), Begin::InFlight { .. }));
        assert_eq!(store.stats().fast_refusals, fast + 1, "answered from redb");
        assert!(store.shared.db.snapshot.is_kept());
        complete(store, &claim);
        to_redb(store);
        let again = begin(store);
        assert!(
            matches!(&again, Begin::Replay(r) if r.body() == b"done"),
            "{again:?}"
        );
    }

    /// A checkpoint drops the kept snapshot before it retires its frozen
    /// memtable.
    #[test]
    fn a_read_after_a_checkpoint_sees_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir, Duration::from_millis(1));
        a_completion_written_to_redb_is_read(&store, checkpointed);
    }

    /// A direct transaction (here a flush) drops it before it clears the
    /// active memtable.
    #[test]
    fn a_read_after_a_direct_transaction_sees_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir, KEEP);
        a_completion_written_to_redb_is_read(&store, |s| s.shared.flush().unwrap());
    }

    /// A deletion in redb (an eviction, a direct transaction of its own)
    /// is seen too: the kept snapshot still holds the record.
    #[test]
    fn a_read_after_an_eviction_sees_no_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir, KEEP);
        let claim = claim(&store);
        complete(&store, &claim);
        store.shared.flush().unwrap();
        store.shared.db.snapshot.clear();
        assert!(matches!(begin(&store), Begin::Replay(_)));
        assert!(store.shared.db.snapshot.is_kept());
        assert!(store.admin().evict(&key()).unwrap().is_some());
        assert!(matches!(begin(&store), Begin::Claimed(_)));
    }

    /// Reads between two commits share one snapshot, and a snapshot kept
    /// from before a commit is not used after it.
    #[test]
    fn reads_between_commits_share_one_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStoreBuilder::default()
            .checkpoint_interval(Duration::from_secs(3600))
            .open(dir.path().join("s.idem"))
            .unwrap();
        let snapshot = &store.shared.db.snapshot;
        let other = |id: &str| Key::new("t", id).unwrap();
        let read = |id: &str| store.get(&other(id), NOW).unwrap();
        assert!(read("x").is_none());
        assert_eq!(snapshot.opened(), 1);
        assert!(read("y").is_none());
        assert!(read("x").is_none());
        assert_eq!(snapshot.opened(), 1);
        let _ = claim(&store);
        store.shared.flush().unwrap();
        assert!(!snapshot.is_kept());
        assert!(read("k").is_some());
        assert!(read("x").is_none());
        assert_eq!(snapshot.opened(), 2);
    }

    /// The verifier's in-place check of a caller's storage backend drops
    /// it first: redb checks only with no read transaction live (found in
    /// review: `verify` failed on such a store after one fresh key).
    #[test]
    fn a_kept_snapshot_does_not_stop_a_verify_of_a_backend_store() {
        let store = RedbStoreBuilder::default()
            .open_backend(
                ::redb::backends::InMemoryBackend::new(),
                ::redb::backends::InMemoryBackend::new(),
            )
            .unwrap();
        let _ = claim(&store);
        assert!(store.shared.db.snapshot.is_kept());
        let report = store.admin().verify(|_| ());
        assert!(report.as_ref().is_ok_and(|r| r.is_clean()), "{report:?}");
        assert!(matches!(begin(&store), Begin::InFlight { .. }));
    }

    /// A compaction drops it first: redb refuses to compact while a read
    /// transaction is live.
    #[test]
    fn a_kept_snapshot_does_not_stop_a_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStoreBuilder::default()
            .open(dir.path().join("s.idem"))
            .unwrap();
        let _ = claim(&store);
        store.shared.flush().unwrap();
        assert!(matches!(begin(&store), Begin::InFlight { .. }));
        assert!(store.shared.db.snapshot.is_kept());
        let compacted = store.compact();
        assert!(compacted.is_ok(), "{compacted:?}");
    }
}
