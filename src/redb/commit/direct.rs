//! A write transaction of its own, outside the line but under the commit
//! lock ([`Shared::direct`]): the inbox's passes, the admin's evict and
//! import, compaction, a clean close, a group too large for the log. It
//! takes in the memtable first and retires the log's frames after, so what
//! it writes is never undone by a replay. Also the wait for a running
//! checkpoint ([`Shared::wait_checkpointed`]) that a freeze and a direct
//! transaction make first.

use super::super::errors::engine_error;
use super::super::health::On;
use super::super::shared::{Core, Shared};
use super::super::tables::{META, META_TOKEN_HWM, META_WAL_EPOCH, WriteTables};
use crate::error::{Error, Result};
use crate::sync::atomic::Ordering;
use ::redb::WriteTransaction;

impl Shared {
    /// Runs `f` in a durable write transaction of its own (the inbox, the
    /// admin evict and import, compaction, a group too large for the log),
    /// outside the line but under the commit lock.
    ///
    /// The transaction first takes in every record the memtable holds (it
    /// waits for a running checkpoint), so `f` reads the current state;
    /// then it retires the log's frames (a new epoch), since replaying
    /// older frames over `f`'s writes would undo them. `f` gets the token
    /// high-water mark to hand out tokens from. An error from `f` aborts
    /// everything; a failed commit poisons the store.
    pub(in crate::redb) fn direct<T, E: From<Error>>(
        &self,
        f: impl FnOnce(&WriteTransaction, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        let mut core = self.lock_core();
        self.direct_locked(&mut core, f)
    }

    /// [`direct`](Self::direct) with the commit lock already held.
    pub(in crate::redb) fn direct_locked<T, E: From<Error>>(
        &self,
        core: &mut Core,
        f: impl FnOnce(&WriteTransaction, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        self.direct_locked_with(core, true, f)
    }

    /// [`direct_locked`](Self::direct_locked), choosing redb's quick-repair
    /// for the commit. On (every caller but an inbox that switched it off):
    /// redb saves its allocator state with the commit and commits in two
    /// phases (two fsyncs), so an open after a crash does not walk the
    /// file. Off: one fsync (redb's one-phase commit with checksums, as
    /// durable), and an open after a crash that follows it walks the file
    /// (redb's full repair).
    pub(in crate::redb) fn direct_locked_with<T, E: From<Error>>(
        &self,
        core: &mut Core,
        quick_repair: bool,
        f: impl FnOnce(&WriteTransaction, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        self.check_writable()?;
        self.check_healthy()?;
        self.wait_checkpointed()?;
        let db = self.write_ready_db()?;
        let mut txn = db
            .begin_write()
            .map_err(|e| self.engine_failed("commit", engine_error(e)))?;
        txn.set_durability(::redb::Durability::Immediate)
            .map_err(engine_error)?;
        txn.set_quick_repair(quick_repair);
        {
            let mem = self.read_mem();
            let mut tables = WriteTables::open(&txn)?;
            for (key, entry) in &mem.active {
                tables.apply(key, entry.as_ref())?;
            }
        }
        let mut hwm = core.token_hwm;
        let out = f(&txn, &mut hwm)?;
        let hwm = hwm.max(core.token_hwm);
        {
            let mut meta = txn.open_table(META).map_err(engine_error)?;
            meta.insert(META_TOKEN_HWM, hwm.to_be_bytes().as_slice())
                .map_err(engine_error)?;
            let next = core.wal.epoch().wrapping_add(1);
            meta.insert(META_WAL_EPOCH, next.to_be_bytes().as_slice())
                .map_err(engine_error)?;
        }
        if let Err(e) = txn.commit() {
            return Err(self.fail("commit", On::Store, engine_error(e)).into());
        }
        // Before the active memtable is cleared (snapshot.rs).
        self.snapshot.committed();
        core.token_hwm = hwm;
        {
            let mut mem = self.write_mem();
            mem.active.clear();
            mem.active_bytes = 0;
        }
        core.wal.rotate();
        self.start_memtable_clock();
        self.stats.commits.fetch_add(1, Ordering::Relaxed);
        self.stats.durable_commits.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }

    /// Waits until no frozen memtable is waiting for its checkpoint.
    pub(in crate::redb) fn wait_checkpointed(&self) -> Result<()> {
        let mut bg = self.lock_bg();
        loop {
            self.check_healthy()?;
            if self.read_mem().frozen.is_none() {
                return Ok(());
            }
            bg = self.bg_cv.wait(bg).unwrap_or_else(|p| p.into_inner());
        }
    }
}
