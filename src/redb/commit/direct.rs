//! A write transaction of its own, outside the line but under the commit
//! lock ([`Shared::direct`]), and the wait for a running checkpoint
//! ([`Shared::wait_checkpointed`]) that it and a freeze make first.

use super::super::health::On;
use super::super::log::Core;
use super::super::shared::Shared;
use super::super::tables::{WriteTables, commit};
use crate::error::{Error, Result};
use crate::sync::atomic::Ordering;

impl Shared {
    /// Runs `f` in a durable write transaction of its own (the inbox, the
    /// admin evict and import, compaction, a close, a group too large for
    /// the log). It first takes in the memtable (after any running
    /// checkpoint), so `f` reads the current state, then retires the log's
    /// frames (a new epoch): replaying them over `f`'s writes would undo
    /// them. `f` gets the token high-water mark to hand out tokens from.
    /// An error from `f` aborts everything; a failed commit poisons the
    /// store.
    pub(in crate::redb) fn direct<T, E: From<Error>>(
        &self,
        f: impl FnOnce(&mut WriteTables<'_>, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        let mut core = self.log.lock();
        self.direct_locked(&mut core, true, f)
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
        self.check_writable()?;
        self.db.check_healthy()?;
        self.wait_checkpointed()?;
        let db = self.db.write_ready_db()?;
        let mut hwm = core.token_hwm;
        // An I/O error of the engine's in this transaction's own writes
        // poisons the store (redb refuses the engine until it is reopened).
        let own = |e| self.engine_failed("commit", e);
        let committed = commit(&db, quick_repair, |tables| {
            // The memtable first, so that `f` reads the current state.
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
        // Before the active memtable is cleared (snapshot.rs).
        self.db.snapshot.committed();
        core.token_hwm = hwm;
        {
            let mut mem = self.memory.write_mem();
            mem.active.clear();
            mem.active_bytes = 0;
        }
        core.writer.rotate();
        self.memory.start_memtable_clock();
        self.stats.commits.fetch_add(1, Ordering::Relaxed);
        self.stats.durable_commits.fetch_add(1, Ordering::Relaxed);
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
