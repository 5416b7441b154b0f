//! Opening a store: owner-only creation, refusing foreign, damaged and
//! newer files with a typed error (never a panic, never an empty store),
//! the engine reopened for a heal, and the recovery policy.

use super::damage::{Damage, LossReport};
use super::file::{
    BACKEND, FILE_MODE, IoWitness, Origin, SharedBackend, Witnessed, check_foreign, engine_error,
    file_backend, log_path, open_log, open_owner_only, sync_parent, try_lock_shared,
};
use super::meta::{MetaEntries, init_meta, read_meta};
use super::overlay::Overlay;
use super::recovery::{Found, Recovered, boot_id, recover_log};
use super::tables::commit;
use super::{Config, RecoveryPolicy};
use crate::error::{Error, Result};
use crate::record::{Record, State};
use ::redb::{Database, DatabaseError, StorageBackend};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(super) struct Opened {
    pub(super) db: Database,
    pub(super) store_id: [u8; 16],
    pub(super) leases_expired: u64,
    pub(super) recovered: Recovered,
    pub(super) loss: LossReport,
    pub(super) source: Origin,
    /// Sees the engine's I/O errors; a heal reuses it.
    pub(super) witness: Arc<IoWitness>,
}

/// Opens the store file at `path`, creating it when it does not exist, but
/// never over a log with frames (the only copy of their writes).
pub(super) fn open_path(path: &Path, config: &Config) -> Result<Opened> {
    let missing = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some("is missing"),
        Ok(meta) if meta.len() == 0 => Some("is empty"),
        _ => None,
    };
    let moved = missing.map(|what| refuse_over_log(path, what, config.accept_loss));
    let moved = moved.transpose()?.flatten();
    let mut opened = match missing {
        Some("is missing") => create_then_open(path, config)?,
        _ => open_file(path, config)?,
    };
    opened.loss.findings.splice(0..0, moved);
    Ok(opened)
}

/// [`Error::Corrupt`] when the log beside `path` holds frames; with
/// `accept_loss` it is renamed to a free `<log>.lost` (the finding returned).
fn refuse_over_log(path: &Path, what: &'static str, accept_loss: bool) -> Result<Option<String>> {
    if !log_holds_frames(path)? {
        return Ok(None);
    }
    if !accept_loss {
        let store = path.to_path_buf();
        return Err(Damage::StoreLostBesideLog { store, what }.into());
    }
    let log = log_path(path);
    let aside = free_name(&log, "lost");
    std::fs::rename(&log, &aside)?;
    sync_parent(path)?;
    let (path, aside) = (path.display(), aside.display());
    Ok(Some(format!(
        "{path} {what} beside a log with frames of another store file: the log was \
         moved to {aside} (its frames cannot be replayed without that store's id) and a \
         new store was made"
    )))
}

/// Whether the log beside `path` holds anything but zeros.
fn log_holds_frames(path: &Path) -> Result<bool> {
    const CHUNK: u64 = 1024 * 1024;
    let log = log_to_read(path)?;
    let len = log.len().map_err(Error::Io)?;
    let mut chunk = vec![0u8; CHUNK as usize];
    for at in (0..len).step_by(CHUNK as usize) {
        let part = chunk.get_mut(..(len - at).min(CHUNK) as usize);
        let part = part.unwrap_or_default();
        log.read(at, part).map_err(Error::Io)?;
        if part.iter().any(|&b| b != 0) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// [`RedbStoreBuilder::open_read_only`](super::RedbStoreBuilder::open_read_only):
/// recovery and replay happen in an [`Overlay`]; a shared lock keeps writers out.
pub(super) fn open_read_only(path: &Path, config: &Config) -> Result<Opened> {
    let meta = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let never = "(a read-only open never creates one)";
            let detail = format!("no store at {} {never}", path.display());
            return Err(std::io::Error::new(e.kind(), detail).into());
        }
        other => other?,
    };
    if meta.len() == 0 {
        refuse_over_log(path, "is empty", false)?;
        return Err(Damage::store(path, "is empty (0 bytes): not a store file"));
    }
    let file = std::fs::File::open(path)?;
    try_lock_shared(&file, path)?;
    let overlay = Overlay::new(Arc::new(file_backend(file)?))?;
    let log = log_to_read(path)?;
    open_backend(overlay, log, boot_id().as_deref(), config, path)
}

/// The log beside `path`, to read only (every write through it fails); a
/// missing one reads as empty (the recovery refuses it after an unclean stop).
pub(super) fn log_to_read(path: &Path) -> Result<Box<dyn StorageBackend>> {
    match std::fs::File::open(log_path(path)) {
        Ok(file) => Ok(Box::new(file_backend(file)?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Ok(Box::new(::redb::backends::InMemoryBackend::new()))
        }
        Err(e) => Err(e.into()),
    }
}

fn open_file(path: &Path, config: &Config) -> Result<Opened> {
    let backend = file_backend(open_owner_only(path)?)?;
    // The store file's lock keeps other processes out of the log too.
    let (log, created) = open_log(path)?;
    // Every open syncs the directory: a creator may have crashed before
    // its own sync, and a power cut could then drop the whole file.
    sync_parent(path)?;
    let opened = open_backend(backend, Box::new(log), boot_id().as_deref(), config, path);
    if opened.is_err() && created {
        // The empty log this refused open made is not left behind.
        let _ = std::fs::remove_file(log_path(path));
    }
    let mut opened = opened?;
    opened.source = Origin::Path(path.to_path_buf());
    Ok(opened)
}

/// A new store is built as `<name>.creating` and linked into place once its
/// meta table is durable: a crash never leaves a half-written file at `path`.
fn create_then_open(path: &Path, config: &Config) -> Result<Opened> {
    let mut temp = path.file_name().unwrap_or_default().to_os_string();
    temp.push(".creating");
    let temp = path.with_file_name(temp);
    {
        let file = open_owner_only(&temp)?;
        // A leftover keeps the mode it was created with: set ours.
        #[cfg(unix)]
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(FILE_MODE))?;
        // A concurrent creator holds the engine's lock (Locked); otherwise
        // this is a crashed creator's file, never acknowledged: start over.
        let backend = file_backend(file)?;
        backend.set_len(0).map_err(Error::Io)?;
        drop(open_engine(backend, config, path)?); // closes the database, releases the lock
    }
    std::fs::File::open(&temp)?.sync_all()?;
    // A hard link never replaces a name: a concurrent creator's store wins.
    match std::fs::hard_link(&temp, path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e.into()),
    }
    std::fs::remove_file(&temp)?;
    sync_parent(path)?;
    open_file(path, config)
}

/// Opens or creates a store over any redb backend, with its log on `log`;
/// `boot` is [`boot_id`] for a real file.
pub(super) fn open_backend(
    backend: impl StorageBackend,
    log: Box<dyn StorageBackend>,
    boot: Option<&str>,
    config: &Config,
    name: &Path,
) -> Result<Opened> {
    let (db, meta, witness) = open_engine(backend, config, name)?;
    let mut loss = LossReport::default();
    let found = Found {
        meta: &meta,
        boot,
        name,
        heal: false,
    };
    let recovered = recover_log(&db, Arc::from(log), &found, config, &mut loss)?;
    // A read-only view shows the records as stored: no lease is ended.
    let leases_expired = match config.recovery {
        RecoveryPolicy::ExpireLeases if !config.read_only => expire_leases(&db, config)?,
        RecoveryPolicy::ExpireLeases | RecoveryPolicy::WaitForLease => 0,
    };
    Ok(Opened {
        db,
        store_id: meta.store_id,
        leases_expired,
        recovered,
        loss,
        source: Origin::None,
        witness,
    })
}

/// The engine and its meta entries (written for a new store).
fn open_engine(
    backend: impl StorageBackend,
    config: &Config,
    name: &Path,
) -> Result<(Database, MetaEntries, Arc<IoWitness>)> {
    let witness = Arc::new(IoWitness::default());
    let db = engine_open(backend, config, name, &witness)?;
    let meta = match read_meta(&db)? {
        Some(meta) => meta,
        None if config.read_only => {
            return Err(Damage::store(
                name,
                "holds no idemstore tables (a store whose creation did not finish)",
            ));
        }
        None => init_meta(&db, config)?,
    };
    Ok((db, meta, witness))
}

/// The engine over `backend`: a foreign file is refused before redb sees
/// it; redb's panic over a damaged file, or a file shorter than its header,
/// becomes [`Error::Corrupt`], a file another open holds [`Error::Locked`].
fn engine_open(
    backend: impl StorageBackend,
    config: &Config,
    name: &Path,
    witness: &Arc<IoWitness>,
) -> Result<Database> {
    check_foreign(&backend)?;
    let backend = Witnessed::new(backend, Arc::clone(witness));
    let mut builder = Database::builder();
    builder
        .set_cache_size(config.cache_bytes)
        .set_check_integrity_on_open(config.verify_on_open);
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        builder.create_with_backend(backend)
    }));
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(DatabaseError::DatabaseAlreadyOpen)) => Err(Error::Locked {
            path: name.display().to_string(),
            holder: crate::holder::lock_holder(name),
        }),
        Ok(Err(DatabaseError::Storage(::redb::StorageError::Io(io))))
            if io.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            Err(Damage::store(
                name,
                "is truncated: shorter than its own header says",
            ))
        }
        Ok(Err(e)) => Err(engine_error(e)),
        Err(_) => Err(Damage::store(
            name,
            "is damaged: the storage engine could not read it",
        )),
    }
}

/// A heal's first step: the engine over the store's files again, and its
/// meta entries.
pub(super) fn reopen_engine(
    source: &Origin,
    config: &Config,
    witness: &Arc<IoWitness>,
) -> Result<(Database, MetaEntries)> {
    let (db, name) = match source {
        Origin::Path(path) => (
            engine_open(file_backend(open_owner_only(path)?)?, config, path, witness)?,
            path.as_path(),
        ),
        Origin::Backend(store) => {
            let (backend, name) = (SharedBackend(Arc::clone(store)), Path::new(BACKEND));
            (engine_open(backend, config, name, witness)?, name)
        }
        Origin::None => {
            return Err(Error::backend("a read-only view is never reopened"));
        }
    };
    match read_meta(&db)? {
        Some(meta) => Ok((db, meta)),
        None => Err(Damage::store(name, "lost its idemstore tables")),
    }
}

fn free_name(path: &Path, suffix: &str) -> PathBuf {
    let name = |n: u32| {
        let mut name = path.as_os_str().to_os_string();
        name.push(format!(".{suffix}"));
        if n > 0 {
            name.push(format!(".{n}"));
        }
        PathBuf::from(name)
    };
    (0..)
        .map(name)
        .find(|p| !p.exists())
        .unwrap_or_else(|| name(0))
}

/// [`RecoveryPolicy::ExpireLeases`]: every PROCESSING record found at open
/// belongs to a dead process, so its lease ends now (its expiry stays).
fn expire_leases(db: &Database, config: &Config) -> Result<u64> {
    let now = config.clock.now();
    commit(db, true, |tables| {
        let mut expired = 0u64;
        for (key_bytes, record) in tables.all()? {
            if record.state == State::Processing && record.lease_until.is_some_and(|l| l > now) {
                let ended = Record {
                    lease_until: Some(now),
                    ..record
                };
                tables.put(&key_bytes, &ended)?;
                expired += 1;
            }
        }
        Ok::<_, Error>(expired)
    })?
}
