//! [`Db`]: the redb engine behind its lock, the read path's kept snapshot,
//! and the store's health (poisoned or not, why, and what a heal needs to
//! reopen the engine).

use super::config::Config;
use super::health::{self, On};
use super::snapshot::Snapshot;
use super::{RecoveryPolicy, file};
use crate::error::{Cause, Error, Result};
use crate::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use crate::time::Clock;
use ::redb::Database;
use std::path::{Path, PathBuf};

pub(super) struct Db {
    /// The kept redb snapshot and the count of redb commits (snapshot.rs);
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
    /// The engine for exclusive use (a heal, a compaction, the verifier's
    /// in-place check): every transaction waited out, the kept snapshot
    /// dropped and the use counted as a commit (redb compacts and checks
    /// only with no live read, and a heal may change the files).
    pub(super) fn write_db(&self) -> RwLockWriteGuard<'_, Engine> {
        let engine = self.engine.write().unwrap_or_else(|p| p.into_inner());
        self.snapshot.committed();
        engine
    }

    pub(super) fn is_poisoned(&self) -> bool {
        self.health.is_poisoned()
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

    /// `Err(Poisoned)` while poisoned, never without the cause (`HealthCell`).
    pub(super) fn check_healthy(&self) -> Result<()> {
        self.health.refusal().map_or(Ok(()), Err)
    }

    /// Poisoned by a cause that may go away: the background thread heals.
    pub(super) fn heals(&self) -> bool {
        self.is_poisoned() && self.health.cause().is_none_or(|c| c.heals())
    }

    pub(super) fn healthy_again(&self) {
        if let Some(fault) = self.health.clear() {
            let since = fault.since.until(self.clock.now());
            crate::observability::healed("redb", &fault.cause, since);
            crate::observability::health("redb", 0);
        }
    }

    fn file_name(&self, on: On) -> String {
        match (&self.path, on) {
            (Some(path), On::Store) => path.display().to_string(),
            (Some(path), On::Log) => super::file::log_path(path).display().to_string(),
            (None, On::Store) => file::BACKEND.to_owned(),
            (None, On::Log) => "<log backend>".to_owned(),
        }
    }
}
