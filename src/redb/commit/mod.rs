//! Group commit: one group under the commit lock is decided (`decide.rs`),
//! appended as one log frame, `fdatasync`ed, then published into the
//! memtable; `leader.rs` says who leads and who is answered. Also the
//! direct transaction ([`Shared::direct`]): a redb write transaction of its
//! own under the commit lock, outside the line.
//!
//! What must hold:
//! - nobody is answered and no reader sees a group before its frame is
//!   durable (the memtable is published after the `fdatasync`);
//! - a frame that cannot be written or synced may be on disk or not: the
//!   whole group gets the error, nothing is published, and the store is
//!   poisoned until it heals (heal.rs replays the log as an open would);
//! - a request that fails while being decided fails alone, writing nothing;
//! - a panic while leading poisons the store and answers the whole group.

mod decide;
mod leader;

use super::health::On;
use super::memtable::MEMTABLE_BYTES;
use super::shared::Core;
use super::shared::{Op, Reply};
use super::tables::{META_TOKEN_HWM, WriteTables, commit};
use super::{Durability, Shared};
use crate::error::{Error, Result};
use crate::sync::Instant;
use crate::sync::atomic::Ordering::{Relaxed, SeqCst};
use decide::decide;

impl Shared {
    /// One group, under the commit lock: an answer per op.
    fn commit_group(&self, ops: &[Op]) -> Vec<Result<Reply>> {
        let n = ops.len() as u64;
        self.stats.groups.fetch_add(1, Relaxed);
        self.stats.requests.fetch_add(n, Relaxed);
        self.stats.largest_group.fetch_max(n, Relaxed);
        let mut core = self.log.lock();
        let committed = self
            .db
            .check_healthy()
            .and_then(|()| self.commit_logged(&mut core, ops));
        match committed {
            Ok(answers) => {
                // An I/O error of the engine's while deciding leaves redb
                // refusing every use until it is reopened: the store heals.
                if let Some(Err(e)) = answers.iter().find(|a| matches!(a, Err(Error::Io(_)))) {
                    self.fail("read", On::Store, e.replicate());
                }
                answers
            }
            Err(error) => ops.iter().map(|_| Err(error.replicate())).collect(),
        }
    }

    /// Decides against memtable + redb, appends one frame, publishes.
    fn commit_logged(&self, core: &mut Core, ops: &[Op]) -> Result<Vec<Result<Reply>>> {
        let mut hwm = core.token_hwm;
        let decided = {
            // The memtable, then the count (db.rs).
            let mem = self.memory.read_mem();
            let counted = self.db.snapshot.count();
            self.db
                .read_tables(counted, |base| decide(ops, &mem, base, &mut hwm))
                .map_err(|e| self.engine_failed("read", e))?
        };
        if decided.writes.is_empty() {
            return Ok(decided.answers);
        }
        let mut frame = decided.frame;
        if hwm != core.token_hwm {
            frame.meta_put(META_TOKEN_HWM, &hwm.to_be_bytes());
        }
        let sync = self.log.durability == Durability::Immediate;
        if !core.writer.fits_at_all(frame.len()) {
            // Larger than a whole segment: straight into redb, durably.
            let writes = decided.writes;
            self.direct_locked(core, true, |tables, token_hwm| {
                tables.take_in(&writes)?;
                *token_hwm = (*token_hwm).max(hwm);
                Ok::<_, Error>(())
            })?;
            return Ok(decided.answers);
        }
        if !core.writer.fits(frame.len()) {
            self.freeze(core)?;
        }
        let appending = Instant::now();
        if let Err(e) = core.writer.append(&mut frame, sync) {
            // The frame may be on disk: its tokens are never handed out
            // again (a heal replays what reached the log).
            core.token_hwm = hwm;
            return Err(self.fail("log append", On::Log, e));
        }
        let (log_sync, log_fill) = (appending.elapsed(), core.writer.fill());
        if !sync {
            self.log.unsynced.store(true, SeqCst);
        }
        let (bytes, first) = {
            let mut mem = self.memory.write_mem();
            let first = mem.active.is_empty();
            mem.publish(decided.writes);
            (mem.active_bytes, first)
        };
        if first {
            // The memtable's age counts from its first record; wake the
            // background thread (asleep with nothing in memory) to time it.
            self.memory.start_memtable_clock();
            self.memory.wake_background();
        }
        core.token_hwm = hwm;
        self.stats.commits.fetch_add(1, Relaxed);
        self.stats.logged_commits.fetch_add(1, Relaxed);
        self.stats.swept.fetch_add(decided.swept as u64, Relaxed);
        crate::observability::group_committed(ops.len(), log_sync, bytes, log_fill);
        crate::observability::swept("redb", decided.swept);
        // Freeze when large or old enough and the checkpointer is free;
        // past twice the budget, wait for it (back-pressure on memory).
        let free = self.memory.read_mem().frozen.is_none();
        let due = bytes >= MEMTABLE_BYTES || self.memory.checkpoint_due();
        if (due && free) || bytes >= 2 * MEMTABLE_BYTES {
            self.freeze(core)?;
        }
        Ok(decided.answers)
    }

    /// Hands the active memtable to the checkpointer (after the previous
    /// checkpoint) and moves the log to the next epoch (the other segment).
    /// Nothing to do when nothing was logged since the last checkpoint.
    pub(super) fn freeze(&self, core: &mut Core) -> Result<()> {
        self.wait_checkpointed()?;
        {
            let mut mem = self.memory.write_mem();
            if mem.active.is_empty() && !core.writer.is_dirty() {
                return Ok(());
            }
            mem.freeze(core.writer.epoch(), core.token_hwm);
        }
        core.writer.rotate();
        self.memory.start_memtable_clock();
        self.memory.wake_background();
        Ok(())
    }

    /// Runs `f` in a durable redb write transaction of its own. It first
    /// takes in the memtable (after any running checkpoint), so `f` reads
    /// the current state, then retires the log's frames (a new epoch):
    /// replaying them over `f`'s writes would undo them. `f` gets the token
    /// high-water mark. An error from `f` aborts everything; a failed
    /// commit poisons the store.
    pub(in crate::redb) fn direct<T, E: From<Error>>(
        &self,
        f: impl FnOnce(&mut WriteTables<'_>, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        self.direct_locked(&mut self.log.lock(), true, f)
    }

    /// [`direct`](Self::direct) with the commit lock already held, choosing
    /// redb's quick-repair for the commit (see [`commit`]; on for every
    /// caller but an inbox that switched it off).
    pub(in crate::redb) fn direct_locked<T, E: From<Error>>(
        &self,
        core: &mut Core,
        quick_repair: bool,
        f: impl FnOnce(&mut WriteTables<'_>, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        self.check_submit()?;
        self.wait_checkpointed()?;
        let db = self.db.write_ready_db()?;
        let mut hwm = core.token_hwm;
        // An I/O error in this transaction's own writes poisons the store.
        let own = |e| self.engine_failed("commit", e);
        let committed = commit(&db, quick_repair, |tables| {
            tables
                .take_in(&self.memory.read_mem().active)
                .map_err(own)?;
            let out = f(tables, &mut hwm)?;
            hwm = hwm.max(core.token_hwm);
            let next = core.writer.epoch().wrapping_add(1);
            tables.retire(hwm, next).map_err(own)?;
            Ok::<_, E>(out)
        });
        let out = committed.map_err(|e| self.fail("commit", On::Store, e))??;
        // Before the active memtable is cleared (db.rs).
        self.db.snapshot.committed();
        core.token_hwm = hwm;
        {
            let mut mem = self.memory.write_mem();
            mem.active.clear();
            mem.active_bytes = 0;
        }
        core.writer.rotate();
        self.memory.start_memtable_clock();
        self.stats.commits.fetch_add(1, Relaxed);
        self.stats.durable_commits.fetch_add(1, Relaxed);
        Ok(out)
    }

    /// Waits until no frozen memtable is waiting for its checkpoint.
    pub(in crate::redb) fn wait_checkpointed(&self) -> Result<()> {
        let mut bg = self.memory.lock_bg();
        loop {
            self.db.check_healthy()?;
            if self.memory.read_mem().frozen.is_none() {
                return Ok(());
            }
            bg = self
                .memory
                .bg_cv
                .wait(bg)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::record::Begin;
    use crate::redb::RedbStoreBuilder;
    use crate::redb::open;
    use crate::sync::Arc;
    use crate::sync::atomic::Ordering;
    use crate::time::Timestamp;
    use std::path::Path;
    use std::time::Duration;

    pub(super) const T: Timestamp = Timestamp::from_millis(1_000_000);
    pub(super) const D: Duration = Duration::from_secs(10);

    pub(super) fn begin(id: &[u8]) -> Op {
        Op::Begin {
            key: id.to_vec(),
            fingerprint: Fingerprint::of(b"fp"),
            now: T,
            lease: D,
            retention: D,
        }
    }

    /// A store's shared state on in-memory backends, with no thread
    /// started: the tests lead groups themselves.
    pub(in crate::redb) fn shared() -> Arc<Shared> {
        shared_with(RedbStoreBuilder::default())
    }

    /// A shared state on in-memory backends opened with `builder`'s
    /// configuration.
    pub(in crate::redb) fn shared_with(builder: RedbStoreBuilder) -> Arc<Shared> {
        let config = builder.config;
        let log = Box::new(::redb::backends::InMemoryBackend::new());
        let backend = ::redb::backends::InMemoryBackend::new();
        let opened = open::open_backend(backend, log, None, &config, Path::new("memory")).unwrap();
        Shared::new(opened, &config, None)
    }

    /// Under `Durability::Periodic` a group's frame is appended without a
    /// sync, and the store marks the log for the background thread's sync
    /// within the loss window; under `Immediate` the frame is synced
    /// before the answer and nothing is left to sync.
    #[test]
    fn an_unsynced_append_is_left_to_the_background_sync() {
        let periodic = crate::redb::Durability::Periodic {
            max_loss: Duration::from_millis(50),
        };
        for (durability, unsynced) in [
            (crate::redb::Durability::Immediate, false),
            (periodic, true),
        ] {
            let shared = shared_with(RedbStoreBuilder::default().durability(durability));
            let answers = shared.commit_group(&[begin(b"a")]);
            assert!(matches!(
                answers.as_slice(),
                [Ok(Reply::Begin(Begin::Claimed(_)))]
            ));
            assert_eq!(
                shared.log.unsynced.load(Ordering::SeqCst),
                unsynced,
                "{durability:?}"
            );
        }
    }

    /// A memtable that reaches its budget (`MEMTABLE_BYTES`) is handed to
    /// the checkpointer at the next group, however long before the
    /// checkpoint interval ends.
    #[test]
    fn a_full_memtable_is_frozen_before_the_interval_ends() {
        let shared =
            shared_with(RedbStoreBuilder::default().checkpoint_interval(Duration::from_secs(3600)));
        shared.commit_group(&[begin(b"a")]);
        assert!(
            shared.memory.read_mem().frozen.is_none(),
            "small and young: kept"
        );
        // A deletion whose key alone fills the budget.
        let big = vec![7u8; crate::redb::MEMTABLE_BYTES];
        shared.memory.write_mem().publish([(big, None)]);
        shared.commit_group(&[begin(b"b")]);
        assert!(shared.memory.read_mem().frozen.is_some(), "full: frozen");
    }

    /// `op`'s group committed on a thread of its own; its answers come on
    /// the channel.
    fn commit_aside(shared: &Arc<Shared>, op: Op) -> std::sync::mpsc::Receiver<Vec<Result<Reply>>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::clone(shared);
        std::thread::spawn(move || {
            let _ = tx.send(shared.commit_group(&[op]));
        });
        rx
    }

    /// While the checkpointer writes a frozen memtable, the active one may
    /// grow to twice the budget without anyone waiting; past that, a group
    /// waits for the checkpoint (back-pressure on memory) and then freezes
    /// the full memtable. A freeze never replaces a frozen memtable that
    /// is not written yet: its records would exist nowhere but in the log.
    #[test]
    fn past_twice_the_budget_a_group_waits_for_the_checkpoint() {
        const WAIT: Duration = Duration::from_secs(10);
        let shared =
            shared_with(RedbStoreBuilder::default().checkpoint_interval(Duration::from_secs(3600)));
        shared
            .memory
            .write_mem()
            .publish([(b"first".to_vec(), None)]);
        shared.freeze(&mut shared.log.lock()).unwrap();
        assert!(shared.memory.read_mem().frozen.is_some());
        // Over the budget, under twice it: no wait.
        let budget = crate::redb::MEMTABLE_BYTES;
        shared
            .memory
            .write_mem()
            .publish([(vec![7u8; budget + 1024], None)]);
        let answers = commit_aside(&shared, begin(b"a")).recv_timeout(WAIT);
        assert!(matches!(answers.as_deref(), Ok([Ok(_)])), "{answers:?}");
        // Past twice the budget: the group waits for the checkpoint.
        shared
            .memory
            .write_mem()
            .publish([(vec![8u8; budget], None)]);
        let waiting = commit_aside(&shared, begin(b"b"));
        assert!(
            waiting.recv_timeout(Duration::from_millis(200)).is_err(),
            "waits while the frozen memtable is not written"
        );
        assert!(
            shared.memory.read_mem().get(b"first").is_some(),
            "the frozen memtable is still there"
        );
        // What the checkpointer does once its commit is durable.
        {
            let _bg = shared.memory.lock_bg();
            shared.memory.write_mem().frozen = None;
            shared.memory.bg_cv.notify_all();
        }
        let answers = waiting.recv_timeout(WAIT);
        assert!(matches!(answers.as_deref(), Ok([Ok(_)])), "{answers:?}");
        let mem = shared.memory.read_mem();
        assert!(
            mem.frozen.is_some() && mem.active.is_empty(),
            "frozen in turn"
        );
    }

    /// A freeze with nothing logged since the last one (an idle store's
    /// timed checkpoint) does nothing: no empty memtable for the
    /// checkpointer, no new log epoch.
    #[test]
    fn a_freeze_with_nothing_logged_does_nothing() {
        let shared = shared();
        let mut core = shared.log.lock();
        let epoch = core.writer.epoch();
        shared.freeze(&mut core).unwrap();
        assert!(shared.memory.read_mem().frozen.is_none());
        assert_eq!(core.writer.epoch(), epoch);
    }

    /// The checkpointer's timed freeze, when a leader froze the memtable
    /// just before: it must return (the frozen table is its own to write),
    /// not wait for that table holding the commit lock, which would stop
    /// every writer behind it.
    #[test]
    fn a_timed_freeze_never_waits_for_the_checkpoint_it_must_write() {
        let shared =
            shared_with(RedbStoreBuilder::default().checkpoint_interval(Duration::from_millis(1)));
        let answers = shared.commit_group(&[begin(b"a")]);
        assert!(matches!(
            answers.as_slice(),
            [Ok(Reply::Begin(Begin::Claimed(_)))]
        ));
        {
            let mut core = shared.log.lock();
            shared.freeze(&mut core).unwrap();
        }
        assert!(shared.memory.read_mem().frozen.is_some());
        // Due again: the (1 ms) interval has passed since the freeze.
        std::thread::sleep(Duration::from_millis(20));
        assert!(shared.memory.checkpoint_due());
        let (tx, rx) = std::sync::mpsc::channel();
        let ticking = Arc::clone(&shared);
        std::thread::spawn(move || {
            let _ = tx.send(super::super::checkpoint::tick(
                &ticking,
                &mut Instant::now(),
            ));
        });
        let ticked = rx.recv_timeout(Duration::from_secs(10));
        assert!(
            matches!(ticked, Ok(Ok(super::super::checkpoint::Tick::Done))),
            "the tick hung: {ticked:?}"
        );
        // The commit lock is free: a writer gets through.
        assert!(shared.log.try_lock().is_some());
    }
}
