//! Opening a store file: owner-only creation, refusing foreign, damaged and
//! newer files with a typed error (never a panic, never an empty store),
//! the engine reopened for a heal, and the recovery policy.

use super::damage::Damage;
use super::errors::engine_error;
use super::file::{FILE_MODE, check_foreign, open_owner_only, sync_parent, try_lock_shared};
use super::loss::LossReport;
use super::meta::{MetaEntries, init_meta, read_meta};
use super::overlay::Overlay;
use super::record_log::{self, FileLog, LogWriter};
use super::recovery::{Found, boot_id, recover_log};
use super::tables::commit;
use super::witness::{IoWitness, Witnessed};
use super::{Config, RecoveryPolicy};
use crate::error::{Error, Result};
use crate::record::State;
use ::redb::{Database, DatabaseError, StorageBackend};
use std::path::Path;
use std::sync::Arc;

/// What an open found.
pub(super) struct Opened {
    pub(super) db: Database,
    pub(super) token_hwm: u64,
    pub(super) store_id: [u8; 16],
    pub(super) leases_expired: u64,
    /// The write-ahead log, recovered and empty.
    pub(super) wal: LogWriter,
    pub(super) frames_replayed: u64,
    /// What an open with `accept_loss` gave up (empty otherwise).
    pub(super) loss: LossReport,
    /// Where a heal reopens the engine from (none for a read-only view).
    pub(super) source: super::source::Origin,
    /// Sees the engine's I/O errors; a heal reuses it.
    pub(super) witness: Arc<IoWitness>,
}

/// Opens the store file at `path`, creating it (mode 0600) when it does
/// not exist.
///
/// A new store is built as `<name>.creating`, its meta table committed
/// durably, and only then linked into place: a crash during creation never
/// leaves a half-written file at `path` (one without redb's magic would be
/// refused as foreign).
///
/// A store is never created over evidence of one: a missing or empty store
/// file beside a log with frames is [`Error::Corrupt`], since a new store
/// would overwrite that log, the only copy of its writes.
pub(super) fn open_path(path: &Path, config: &Config) -> Result<Opened> {
    let mut found = Vec::new();
    let mut opened = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            refuse_over_log(path, "is missing", config, &mut found)?;
            create_then_open(path, config)
        }
        Ok(meta) if meta.len() == 0 => {
            refuse_over_log(path, "is empty", config, &mut found)?;
            open_file(path, config)
        }
        _ => open_file(path, config),
    }?;
    if !found.is_empty() {
        found.append(&mut opened.loss.findings);
        opened.loss.findings = found;
    }
    Ok(opened)
}

/// [`Error::Corrupt`] when the log beside `path` holds anything but zeros
/// (a new log is all zeros until its first frame).
/// With `accept_loss` the log is renamed to `<log>.lost` (a free name),
/// never overwritten, and that is written down in `found`.
fn refuse_over_log(
    path: &Path,
    what: &'static str,
    config: &Config,
    found: &mut Vec<String>,
) -> Result<()> {
    if !log_holds_frames(path)? {
        return Ok(());
    }
    let log = record_log::log_path(path);
    if config.accept_loss {
        let aside = free_name(&log, "lost");
        std::fs::rename(&log, &aside)?;
        sync_parent(path)?;
        found.push(format!(
            "{} {what} beside a log with frames of another store file: the log was \
             moved to {} (its frames cannot be replayed without that store's id) and a \
             new store was made",
            path.display(),
            aside.display()
        ));
        return Ok(());
    }
    Err(store_lost_beside_log(path, what))
}

/// [`Error::Corrupt`]: the store file at `path` `what` ("is missing", "is
/// empty") while its log holds frames.
fn store_lost_beside_log(path: &Path, what: &'static str) -> Error {
    Damage::StoreLostBesideLog {
        store: path.to_path_buf(),
        log: record_log::log_path(path),
        what,
    }
    .into()
}

/// Whether the log beside `path` holds anything but zeros (a new log is
/// all zeros until its first frame). Reads only.
fn log_holds_frames(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut file = match std::fs::File::open(record_log::log_path(path)) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    let mut chunk = vec![0u8; 1024 * 1024];
    loop {
        let n = file.read(&mut chunk)?;
        if n == 0 {
            return Ok(false);
        }
        if chunk.get(..n).is_some_and(|c| c.iter().any(|&b| b != 0)) {
            return Ok(true);
        }
    }
}

/// Opens the store file at `path` for reading only: the contract is
/// [`RedbStore::open_read_only`](super::RedbStore::open_read_only)'s. redb's
/// recovery and the log's replay happen in an in-memory [`Overlay`]; a
/// shared lock keeps writers out.
pub(super) fn open_read_only(path: &Path, config: &Config) -> Result<Opened> {
    let meta = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::Io(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "no store at {} (a read-only open never creates one)",
                    path.display()
                ),
            )));
        }
        other => other?,
    };
    if meta.len() == 0 {
        if log_holds_frames(path)? {
            return Err(store_lost_beside_log(path, "is empty"));
        }
        return Err(Damage::EmptyStoreFile {
            store: path.to_path_buf(),
        }
        .into());
    }
    let file = std::fs::File::open(path)?;
    try_lock_shared(&file, path)?;
    let overlay = Overlay::new(file)?;
    // A missing log reads as an empty one: after a clean stop it holds
    // nothing; after an unclean one the plan refuses it, as an open would.
    let log: Box<dyn StorageBackend> = match FileLog::open_read_only(path)? {
        Some(log) => Box::new(log),
        None => Box::new(::redb::backends::InMemoryBackend::new()),
    };
    open_backend(overlay, log, boot_id().as_deref(), config, path)
}

fn open_file(path: &Path, config: &Config) -> Result<Opened> {
    let file = open_owner_only(path)?;
    let backend = ::redb::backends::FileBackend::new(file).map_err(|e| map_open(e, path))?;
    // Opened after the store file: its lock keeps other processes out of
    // both.
    let wal_existed = record_log::log_path(path).exists();
    let log = Box::new(FileLog::open(path)?);
    // Every open syncs the directory, not only the creating one: a crash
    // before a creator's directory fsync would leave an entry no later open
    // syncs, and a power cut could then drop the whole file.
    sync_parent(path)?;
    let opened = open_backend(backend, log, boot_id().as_deref(), config, path);
    if opened.is_err() && !wal_existed {
        // Refused (a log that must exist does not): the empty file this
        // open made is not left behind as if it were the log.
        let _ = std::fs::remove_file(record_log::log_path(path));
    }
    let mut opened = opened?;
    opened.source = super::source::Origin::Path(path.to_path_buf());
    Ok(opened)
}

/// The temporary name a new store is built under.
pub(super) fn creating_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".creating");
    path.with_file_name(name)
}

fn create_then_open(path: &Path, config: &Config) -> Result<Opened> {
    let temp = creating_path(path);
    {
        let file = open_owner_only(&temp)?;
        // A leftover keeps the mode it was created with: set ours.
        #[cfg(unix)]
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(FILE_MODE))?;
        // The engine's file lock: a concurrent creator holds it (Locked);
        // otherwise the file is what a crashed creator left, never
        // acknowledged to anyone, and is started over.
        let backend = ::redb::backends::FileBackend::new(file).map_err(|e| map_open(e, path))?;
        backend
            .set_len(0)
            .map_err(|e| engine_error(::redb::StorageError::from(e)))?;
        let (created, ..) = open_engine(backend, config, path)?;
        drop(created); // closes the database and releases the lock
    }
    std::fs::File::open(&temp)?.sync_all()?;
    // A hard link never replaces an existing name: if another process
    // created the store meanwhile, theirs wins and ours is discarded.
    match std::fs::hard_link(&temp, path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e.into()),
    }
    std::fs::remove_file(&temp)?;
    sync_parent(path)?;
    open_file(path, config)
}

/// Opens or creates a store over any redb backend, with its write-ahead
/// log on `log`; `name` names it in errors. `boot` is the machine's boot id
/// for a real file ([`boot_id`]); `None` for storage backends.
pub(super) fn open_backend(
    backend: impl StorageBackend,
    log: Box<dyn StorageBackend>,
    boot: Option<&str>,
    config: &Config,
    name: &Path,
) -> Result<Opened> {
    let (db, meta, witness) = open_engine(backend, config, name)?;
    let mut token_hwm = meta.token_hwm;
    let mut loss = LossReport::default();
    let found = Found {
        store_id: meta.store_id,
        boot,
        name,
        heal: false,
    };
    let (wal, frames_replayed) = recover_log(&db, Arc::from(log), &found, config, &mut loss)?;
    if frames_replayed > 0 {
        // The frames carry the high-water mark of their claims.
        token_hwm = read_meta(&db)?.map_or(token_hwm, |m| m.token_hwm);
    }
    // A read-only view shows the records as stored: no lease is ended.
    let leases_expired = match config.recovery {
        _ if config.read_only => 0,
        RecoveryPolicy::WaitForLease => 0,
        RecoveryPolicy::ExpireLeases => expire_leases(&db, config)?,
    };
    Ok(Opened {
        db,
        token_hwm,
        store_id: meta.store_id,
        leases_expired,
        wal,
        frames_replayed,
        loss,
        source: super::source::Origin::None,
        witness,
    })
}

/// The engine over `backend` and its meta entries, written now for a new
/// store: all that creating a store needs, and where an open starts.
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
            return Err(Damage::NoTables {
                store: name.to_path_buf(),
            }
            .into());
        }
        None => init_meta(&db, config)?,
    };
    Ok((db, meta, witness))
}

/// The engine over `backend`, as an open and a heal start: a foreign file
/// refused before redb sees it, and a panic of redb's over a damaged file
/// turned into [`Error::Corrupt`].
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
    // redb documents that a plain open may panic on a file damaged outside
    // redb. A panic must not reach the caller: it becomes Error::Corrupt.
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        builder.create_with_backend(backend)
    }));
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(e)) => Err(map_open(e, name)),
        Err(_) => Err(Damage::Unreadable {
            store: name.to_path_buf(),
        }
        .into()),
    }
}

/// A heal's first step: the engine over the store's files again, and its
/// meta entries. Nothing is written but redb's own recovery; the log is
/// replayed by [`recover_log`](super::recovery::recover_log).
pub(super) fn reopen_engine(
    source: &super::source::Origin,
    config: &Config,
    witness: &Arc<IoWitness>,
) -> Result<(Database, MetaEntries)> {
    use super::source::{Origin, SharedBackend};
    let (db, name) = match source {
        Origin::Path(path) => {
            let file = open_owner_only(path)?;
            let backend =
                ::redb::backends::FileBackend::new(file).map_err(|e| map_open(e, path))?;
            (engine_open(backend, config, path, witness)?, path.as_path())
        }
        Origin::Backend(store) => {
            let name = Path::new("<storage backend>");
            let backend = SharedBackend(std::sync::Arc::clone(store));
            (engine_open(backend, config, name, witness)?, name)
        }
        Origin::None => {
            return Err(Error::backend("a read-only view is never reopened"));
        }
    };
    match read_meta(&db)? {
        Some(meta) => Ok((db, meta)),
        None => Err(Damage::TablesLost {
            store: name.to_path_buf(),
        }
        .into()),
    }
}

/// `<path>.<suffix>`, or `<path>.<suffix>.N` for the first free `N`.
fn free_name(path: &Path, suffix: &str) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(format!(".{suffix}"));
    let mut candidate = std::path::PathBuf::from(&name);
    let mut n = 1u32;
    while candidate.exists() {
        let mut numbered = name.clone();
        numbered.push(format!(".{n}"));
        candidate = std::path::PathBuf::from(numbered);
        n += 1;
    }
    candidate
}

fn map_open(err: DatabaseError, path: &Path) -> Error {
    match err {
        DatabaseError::DatabaseAlreadyOpen => Error::Locked {
            path: path.display().to_string(),
            holder: crate::holder::lock_holder(path),
        },
        // Read past the end: the file is shorter than its header says,
        // damage a retry cannot fix.
        DatabaseError::Storage(::redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            Damage::Truncated {
                store: path.to_path_buf(),
            }
            .into()
        }
        other => engine_error(other),
    }
}

/// [`RecoveryPolicy::ExpireLeases`]: one process holds the file, so every
/// PROCESSING record found at open belongs to a dead process. Its lease is
/// ended now (its expiry is untouched), so a retry takes it over at once,
/// with a new fencing token. Reads every record: O(records) at open.
fn expire_leases(db: &Database, config: &Config) -> Result<u64> {
    let now = config.clock.now();
    commit(db, true, |tables| {
        let mut expired = 0u64;
        for (key_bytes, record) in tables.all()? {
            let live_lease = match (record.state, record.lease_until) {
                (State::Processing, Some(lease_until)) => lease_until > now,
                _ => false,
            };
            if !live_lease {
                continue;
            }
            let ended = crate::record::Record {
                lease_until: Some(now),
                ..record.clone()
            };
            tables.apply(&key_bytes, Some(&ended))?;
            expired += 1;
        }
        Ok::<_, Error>(expired)
    })?
}
