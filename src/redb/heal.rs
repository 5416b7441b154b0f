//! Healing: after a failed write the store writes again once the cause is
//! gone. redb refuses a database after its own I/O error, so a heal does
//! what an open does, under the commit lock and the engine's write lock:
//! (1) reopen the engine from its `file::Origin`; (2) replay the log's live
//! frames into it with a new epoch and empty the memtable, which holds
//! exactly those frames. A frame whose write failed may be replayed or not:
//! its callers were told it failed. If (1) fails, a view that writes nothing
//! (`overlay::open_view_of`) keeps reads going; if (2) fails, the memtable
//! is kept; the background thread tries again after its back-off.

use super::damage::LossReport;
use super::file::{BACKEND, engine_error};
use super::health::Attempts;
use super::memtable::Mem;
use super::meta::MetaEntries;
use super::recovery::{Found, Recovered, boot_id, recover_log};
use super::{Engine, Shared, Usable};
use crate::error::Result;
use crate::sync::Instant;
use crate::sync::atomic::Ordering;
use ::redb::backends::InMemoryBackend;
use ::redb::{Database, StorageBackend};

/// Free space a full disk must gain before the next attempt to heal.
const FREED_BYTES: u64 = 64 * 1024;

/// Longest wait for free space to grow before a full disk's heal is tried.
const RETRY_ANYWAY: std::time::Duration = std::time::Duration::from_secs(30);

impl Shared {
    /// One attempt to heal a poisoned store (see the module docs).
    pub(super) fn heal(&self) -> Result<()> {
        // Lock order: the commit lock, the memtable, the database. Reads
        // wait for one reopen and one replay.
        let mut core = self.log.lock();
        let mut mem = self.memory.write_mem();
        let mut engine = self.db.write_db();
        let mut attempts = self.db.attempts.lock().unwrap_or_else(|p| p.into_inner());
        if !self.worth_an_attempt(&mut attempts) {
            return Err(self.db.poisoned_error());
        }
        let replayed = self.reopen_and_replay(&mut engine, core.writer.file());
        let recovered = replayed.inspect_err(|_| {
            attempts.last = Some(Instant::now());
            attempts.free_at_last = self.db.path.as_deref().and_then(free_bytes);
        })?;
        *attempts = Attempts::default();
        core.token_hwm = core.token_hwm.max(recovered.token_hwm);
        core.writer = recovered.wal;
        // Every record the memtable held is in the store file now.
        *mem = Mem::default();
        self.log.unsynced.store(false, Ordering::SeqCst);
        drop(engine);
        drop(mem);
        self.db.healthy_again();
        Ok(())
    }

    /// After a full disk, an attempt is worth making only once the
    /// filesystem has [`FREED_BYTES`] more room than at the last failed one
    /// (one `statvfs`, not a replay that fails again), or after
    /// [`RETRY_ANYWAY`] (quotas, reserved blocks); always for other causes.
    fn worth_an_attempt(&self, state: &mut Attempts) -> bool {
        let full = self.db.health.cause().and_then(|c| c.io_kind())
            == Some(std::io::ErrorKind::StorageFull);
        let path = self.db.path.as_deref().filter(|_| full);
        let Some(free) = path.and_then(free_bytes) else {
            return true;
        };
        let grew = state
            .free_at_last
            .is_none_or(|before| free > before.saturating_add(FREED_BYTES));
        let stale = state.last.is_none_or(|at| at.elapsed() >= RETRY_ANYWAY);
        grew || stale
    }

    /// Steps 1 and 2; after a failed replay (which redb then refuses) the
    /// engine is opened once more, for reads.
    fn reopen_and_replay(
        &self,
        engine: &mut Engine,
        log: std::sync::Arc<dyn StorageBackend>,
    ) -> Result<Recovered> {
        let meta = self.reopen(engine)?;
        let name = self.db.path.clone().unwrap_or_else(|| BACKEND.into());
        let boot = boot_id();
        let found = Found {
            meta: &meta,
            boot: boot.as_deref(),
            name: &name,
            heal: true,
        };
        let config = &self.db.heal_config;
        recover_log(&engine.db, log, &found, config, &mut LossReport::default()).inspect_err(|_| {
            let _ = self.reopen(engine);
        })
    }

    /// Closes the engine and reopens it, returning the meta entries; failing
    /// that, a view that writes nothing takes its place for reads, or the
    /// stand-in stays, marked unusable.
    fn reopen(&self, engine: &mut Engine) -> Result<MetaEntries> {
        // An empty engine holds the closed one's place.
        let stand_in = Database::builder().create_with_backend(InMemoryBackend::new());
        engine.db = stand_in.map_err(engine_error)?;
        engine.usable = Usable::No;
        match super::open::reopen_engine(&self.db.source, &self.db.heal_config, &self.db.witness) {
            Ok((db, meta)) => {
                engine.db = db;
                engine.usable = Usable::Yes;
                Ok(meta)
            }
            Err(e) => {
                if let Ok(view) = super::overlay::open_view_of(&self.db.source) {
                    engine.db = view;
                    engine.usable = Usable::ForReads;
                }
                Err(e)
            }
        }
    }
}

/// Bytes an unprivileged writer may still use on `path`'s filesystem.
#[cfg(unix)]
fn free_bytes(path: &std::path::Path) -> Option<u64> {
    let fs = rustix::fs::statvfs(super::file::parent_dir(path)).ok()?;
    Some(fs.f_bavail.saturating_mul(fs.f_frsize))
}

#[cfg(not(unix))]
fn free_bytes(_path: &std::path::Path) -> Option<u64> {
    None
}
