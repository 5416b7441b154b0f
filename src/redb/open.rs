//! Opening a store file: owner-only creation, refusing foreign, damaged and
//! newer files with a typed error (never a panic, never an empty store), the
//! meta table, and the recovery policy.

use super::errors::engine;
use super::file::{
    FILE_MODE, Lock, check_foreign, not_ours, open_owner_only, sync_parent, try_lock,
};
use super::loss::LossReport;
use super::overlay::Overlay;
use super::pages::{self, PageLog};
use super::tables::{
    EXPIRY, META, META_FORMAT_VERSION, META_STORE_ID, META_TOKEN_HWM, META_WAL_BOOT,
    META_WAL_BYTES, META_WAL_EPOCH, META_WAL_STATE, RECORDS, WAL_CLOSED, WAL_OPEN, WriteTables,
};
use super::wal::{self, FileLog, Wal};
use super::witness::{IoWitness, Witnessed};
use super::{Config, RecoveryPolicy};
use crate::error::{Error, Result};
use crate::record::State;
use ::redb::{Database, DatabaseError, ReadableDatabase, StorageBackend, TableError, TableHandle};
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::Arc;

/// The store format this build writes, and the newest it opens. It covers
/// the table layout, the meta entries and the write-ahead log; the record
/// envelope has its own version inside every value.
///
/// 2 added the write-ahead log (`<file>-wal`, the `wal_epoch` meta entry);
/// 3 changed the log to two segments of 4 KiB-aligned frames that carry no
/// index entries (docs/format.md). A version 1 or 2 store opens (a version 2 log is replayed
/// in its own layout) and is marked 3 at its first open by this build, so
/// that an older build, which would misread the log, refuses it.
pub(super) const STORE_FORMAT_VERSION: u32 = 3;

/// What an open found.
pub(super) struct Opened {
    pub(super) db: Database,
    pub(super) token_hwm: u64,
    pub(super) store_id: [u8; 16],
    pub(super) leases_expired: u64,
    /// The write-ahead log, recovered and empty; `None` without one.
    pub(super) wal: Option<Wal>,
    pub(super) frames_replayed: u64,
    /// What an open with `accept_loss` gave up (empty otherwise).
    pub(super) loss: LossReport,
    /// Where a heal reopens the engine from: set by the open's caller
    /// (none for a read-only view, which never writes).
    pub(super) source: super::source::Source,
    /// What sees the engine's I/O errors (witness.rs); a heal reopens the
    /// engine with the same one.
    pub(super) witness: Arc<IoWitness>,
}

/// Opens the store file at `path`, creating it (mode 0600) when it does
/// not exist.
///
/// A new store is built under a temporary name (`<name>.creating`), its
/// meta table committed durably, and only then linked into place: a crash
/// during creation leaves at most the temporary file, never a half-written
/// file at `path` that no later open could accept. (A crash during redb's
/// own file initialisation leaves a file without redb's magic number, which
/// `check_foreign` must refuse, since it cannot tell it from a foreign file.)
///
/// A store is never created over evidence of one: when the store file is
/// missing or empty but a log with content is beside it, the store file
/// was lost or replaced, and a new store would overwrite that log (the
/// only copy of the writes it holds). That is [`Error::Corrupt`].
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
///
/// With `accept_loss` the log is renamed to `<log>.lost` (a free name),
/// never overwritten, and that is written down in `found`.
fn refuse_over_log(
    path: &Path,
    what: &str,
    config: &Config,
    found: &mut Vec<String>,
) -> Result<()> {
    if !log_holds_frames(path)? {
        return Ok(());
    }
    let log = wal::wal_path(path);
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
fn store_lost_beside_log(path: &Path, what: &str) -> Error {
    Error::corrupt(
        None,
        format!(
            "{} {what}, but its write-ahead log {} is beside it and holds frames: the \
             store file was lost or replaced, and a new store here would overwrite the \
             only copy of the writes in that log. Restore the store file that belongs \
             to the log, or move the log away to start a new store; see \
             docs/operations.md",
            path.display(),
            wal::wal_path(path).display()
        ),
    )
}

/// Whether the log beside `path` holds anything but zeros (a new log is
/// all zeros until its first frame). Reads only.
fn log_holds_frames(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut file = match std::fs::File::open(wal::wal_path(path)) {
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

/// Opens the store file at `path` for reading only (`config.read_only`):
/// no byte of the store file or its log changes and no file is created,
/// so it works on a file the caller may not write.
///
/// The store file is opened read-only and read through a private
/// in-memory [`Overlay`]: redb's recovery of an uncleanly closed file and
/// the replay of the log's frames (read-only too) happen in memory, so the
/// view holds everything a writer's open would, without writing it. A
/// shared lock on the file keeps writers out while the store is open (and
/// is refused, [`Error::Locked`], while a writer holds it).
///
/// A missing file is [`Error::Io`] (`NotFound`); an empty one is
/// [`Error::Corrupt`]: neither is a store, and nothing is created.
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
        return Err(Error::corrupt(
            None,
            format!("{} is empty (0 bytes): not a store file", path.display()),
        ));
    }
    let file = std::fs::File::open(path)?;
    try_lock(&file, Lock::Shared, path, path)?;
    let overlay = Overlay::new(file)?;
    // The page log's run, in memory, as a writer's open would replay it.
    pages::replay_beside(path, &overlay, true)?;
    // A missing log reads as an empty one: after a clean stop it holds
    // nothing; after an unclean one the plan refuses it, as an open would.
    let log: Box<dyn StorageBackend> = match FileLog::open_read_only(path)? {
        Some(log) => Box::new(log),
        None => Box::new(::redb::backends::InMemoryBackend::new()),
    };
    let mut opened = open_backend(overlay, Some(log), boot_id().as_deref(), config, path)?;
    // Nothing is ever written through it.
    opened.wal = None;
    Ok(opened)
}

fn open_file(path: &Path, config: &Config) -> Result<Opened> {
    let file = open_owner_only(path)?;
    let backend = ::redb::backends::FileBackend::new(file).map_err(|e| map_open(e, path))?;
    // Opened after the store file: its lock keeps other processes out of
    // both. A log left by an earlier open is recovered even when this open
    // does without one.
    let wal_existed = wal::wal_path(path).exists();
    let log: Option<Box<dyn StorageBackend>> = if config.write_ahead_log || wal_existed {
        Some(Box::new(FileLog::open(path)?))
    } else {
        None
    };
    // The page log, when this open uses one or an earlier one left one:
    // locked like the store (a second writer is Locked here, before
    // anything is replayed), and its run replayed into the store file.
    let pages_path = pages::pages_path(path);
    let pages_log = if config.page_log || pages_path.exists() {
        let pages_file = open_locked(&pages_path, path)?;
        Some(::redb::backends::FileBackend::new(pages_file).map_err(|e| map_open(e, path))?)
    } else {
        None
    };
    // Every open makes the directory entries durable, not only the open
    // that created them: a crash between creating (or linking) a file and
    // its directory's fsync would otherwise leave an entry that no later
    // open syncs, and a power cut could then drop the whole file.
    sync_parent(path)?;
    let boot = boot_id();
    let opened = match pages_log {
        Some(pages_log) if config.page_log => {
            let paged = PageLog::open(Box::new(backend), Box::new(pages_log))?;
            open_backend(paged, log, boot.as_deref(), config, path)
        }
        Some(pages_log) => {
            // Opened without the page log after an open with it: the run
            // goes into the store file (synced), then the log goes.
            pages::replay(&pages_log, &backend)?;
            // Removed while still locked: an open that waits for the lock
            // finds the name gone (see `open_locked`).
            std::fs::remove_file(&pages_path)?;
            drop(pages_log);
            sync_parent(path)?;
            open_backend(backend, log, boot.as_deref(), config, path)
        }
        None => open_backend(backend, log, boot.as_deref(), config, path),
    };
    if opened.is_err() && !wal_existed {
        // Refused (a log that must exist does not): the empty file this
        // open made is not left behind as if it were the log.
        let _ = std::fs::remove_file(wal::wal_path(path));
    }
    let mut opened = opened?;
    if !config.write_ahead_log {
        opened.wal = None;
    }
    opened.source = super::source::Source::Path(path.to_path_buf());
    Ok(opened)
}

/// Opens (creating it) and exclusively locks the page log at `pages`. A
/// page log is removed only by its lock's holder, so once the lock is ours
/// and the name still leads to the file we locked, it is the page log; a
/// file removed while we waited for its lock is let go and the name opened
/// again.
fn open_locked(pages: &Path, store: &Path) -> Result<std::fs::File> {
    for _ in 0..8 {
        let file = open_owner_only(pages)?;
        try_lock(&file, Lock::Exclusive, store, pages)?;
        if same_file(&file, pages)? {
            return Ok(file);
        }
    }
    Err(Error::Io(std::io::Error::other(format!(
        "{} keeps being replaced while it is opened",
        pages.display()
    ))))
}

/// Whether `path` names the file `file` has open.
fn same_file(file: &std::fs::File, path: &Path) -> Result<bool> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let held = file.metadata()?;
        match std::fs::metadata(path) {
            Ok(named) => Ok(held.dev() == named.dev() && held.ino() == named.ino()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (file, path);
        Ok(true)
    }
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
            .map_err(|e| engine(::redb::StorageError::from(e)))?;
        let created = open_backend(backend, None, None, config, path)?;
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
/// log if `log` is given; `name` names it in errors.
///
/// `boot` is the machine's boot id when the log is a real file (see
/// [`boot_id`]); `None` for storage backends, whose crashes the caller
/// simulates.
pub(super) fn open_backend(
    backend: impl StorageBackend,
    log: Option<Box<dyn StorageBackend>>,
    boot: Option<&str>,
    config: &Config,
    name: &Path,
) -> Result<Opened> {
    let witness = Arc::new(IoWitness::default());
    let db = engine_open(backend, config, name, &witness)?;
    let MetaEntries {
        format_version,
        store_id,
        mut token_hwm,
    } = match read_meta(&db)? {
        Some(meta) => meta,
        None if config.read_only => {
            return Err(Error::corrupt(
                None,
                format!(
                    "{} holds no idemstore tables (a store whose creation did not finish)",
                    name.display()
                ),
            ));
        }
        None => init_meta(&db, config)?,
    };
    let mut loss = LossReport::default();
    let (wal, frames_replayed) = match log {
        None => {
            if read_wal_state(&db)?.is_some_and(|s| s.open) {
                let err = log_missing(name, "it is being opened without its log");
                if !config.accept_loss {
                    return Err(err);
                }
                loss.findings.push(format!("accepted: {err}"));
            }
            (None, 0)
        }
        Some(file) => {
            let found = Found {
                store_id,
                format: format_version,
                boot,
                name,
                heal: false,
            };
            let file = std::sync::Arc::from(file);
            let (wal, frames) = recover_log(&db, file, &found, config, &mut loss)?;
            if frames > 0 {
                // The frames carry the high-water mark of their claims.
                token_hwm = read_meta(&db)?.map_or(token_hwm, |m| m.token_hwm);
            }
            (Some(wal), frames)
        }
    };
    // A read-only view shows the records as stored: no lease is ended.
    let leases_expired = match config.recovery {
        _ if config.read_only => 0,
        RecoveryPolicy::WaitForLease => 0,
        RecoveryPolicy::ExpireLeases => expire_leases(&db, config)?,
    };
    Ok(Opened {
        db,
        token_hwm,
        store_id,
        leases_expired,
        wal,
        frames_replayed,
        loss,
        source: super::source::Source::None,
        witness,
    })
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
        Err(_) => Err(Error::corrupt(
            None,
            format!(
                "{} is damaged: the storage engine could not read it",
                name.display()
            ),
        )),
    }
}

/// A heal's first step: the engine over the store's files again, and its
/// meta entries. Nothing is written (redb's own recovery of a file not
/// closed cleanly aside); the log is replayed by [`heal_log`].
pub(super) fn reopen_engine(
    source: &super::source::Source,
    config: &Config,
    witness: &Arc<IoWitness>,
) -> Result<(Database, MetaEntries)> {
    use super::source::{SharedBackend, Source};
    let (db, name) = match source {
        Source::Path(path) => {
            let file = open_owner_only(path)?;
            let backend =
                ::redb::backends::FileBackend::new(file).map_err(|e| map_open(e, path))?;
            let db = if config.page_log {
                let pages_file = open_locked(&pages::pages_path(path), path)?;
                let pages_log = ::redb::backends::FileBackend::new(pages_file)
                    .map_err(|e| map_open(e, path))?;
                let paged = PageLog::open(Box::new(backend), Box::new(pages_log))?;
                engine_open(paged, config, path, witness)?
            } else {
                engine_open(backend, config, path, witness)?
            };
            (db, path.as_path())
        }
        Source::Backend { store, pages } => {
            let name = Path::new("<storage backend>");
            let backend = SharedBackend(std::sync::Arc::clone(store));
            let db = match pages {
                Some(pages) => {
                    let pages = SharedBackend(std::sync::Arc::clone(pages));
                    engine_open(
                        PageLog::open(Box::new(backend), Box::new(pages))?,
                        config,
                        name,
                        witness,
                    )?
                }
                None => engine_open(backend, config, name, witness)?,
            };
            (db, name)
        }
        Source::None => {
            return Err(Error::backend("a read-only view is never reopened"));
        }
    };
    match read_meta(&db)? {
        Some(meta) => Ok((db, meta)),
        None => Err(Error::corrupt(
            None,
            format!("{} lost its idemstore tables", name.display()),
        )),
    }
}

/// A heal's second step: the log's live frames replayed into the reopened
/// engine and a durable commit with a new epoch, as an open does. A frame
/// damaged at the end of the log is the end (it is the one whose write
/// failed, never acknowledged), as after a power cut.
pub(super) fn heal_log(
    db: &Database,
    file: std::sync::Arc<dyn StorageBackend>,
    meta: &MetaEntries,
    config: &Config,
    name: &Path,
) -> Result<Wal> {
    let boot = boot_id();
    let found = Found {
        store_id: meta.store_id,
        format: meta.format_version,
        boot: boot.as_deref(),
        name,
        heal: true,
    };
    let mut loss = LossReport::default();
    recover_log(db, file, &found, config, &mut loss).map(|(wal, _)| wal)
}

/// Replays the log's frames of the current epoch, then commits durably with
/// a new epoch (retiring every frame found, whole or torn) and the current
/// format version, and makes sure the log file has its full size.
/// How the live frames of a store's log are to be read, and what is wrong
/// with the log before any frame is read: [`plan_log`].
pub(super) struct LogPlan {
    /// The log file's size.
    pub(super) file_len: u64,
    /// The durable epoch: its frames, then the next epoch's, are live.
    pub(super) epoch: u64,
    /// The size the frames were laid out for: the file's, unless the store
    /// recorded another.
    pub(super) layout_len: u64,
    /// No reboot since the open that wrote the frames (see `wal::walk`).
    pub(super) no_reboot: bool,
    /// What an open refuses (each an [`Error::Corrupt`]), in order.
    pub(super) problems: Vec<Error>,
}

/// Reads the log's record in the store file and checks the log against
/// it, without reading a frame. After an unclean stop the log is part of
/// the store: without it, cut short, or another store's, the replay would
/// find nothing (or only part) and the open would succeed without the
/// writes acknowledged since the last checkpoint. Shared by the open
/// ([`recover_log`]) and the read-only check (`admin::check_log`).
pub(super) fn plan_log(
    db: &Database,
    file: &dyn StorageBackend,
    found: &Found<'_>,
) -> Result<LogPlan> {
    let name = found.name;
    let len = file.len().map_err(Error::Io)?;
    let mut plan = LogPlan {
        file_len: len,
        epoch: read_wal_epoch(db)?,
        layout_len: len,
        // No reboot since the open that wrote these frames: no power loss
        // can have torn one, so a damaged last frame is damage.
        no_reboot: !found.heal
            && found.boot.is_some()
            && read_wal_boot(db)?.as_deref() == found.boot,
        problems: Vec::new(),
    };
    let Some(state) = read_wal_state(db)?.filter(|s| s.open) else {
        return Ok(plan);
    };
    match state.bytes {
        // The last open stopped before its log had a size: no frame was
        // ever written, nothing can be missing.
        Some(0) => {}
        _ if len == 0 => plan
            .problems
            .push(log_missing(name, "its log is missing or empty")),
        Some(recorded) if len < recorded => {
            plan.problems.push(Error::corrupt(
                None,
                format!(
                    "{} was not closed cleanly, and its write-ahead log {} is {len} bytes where \
                     the store left it at {recorded}: the log was cut short, or another file is \
                     in its place, so the writes acknowledged since the last checkpoint cannot \
                     all be found in it. Put back the log that belongs to this store (a store \
                     and its log are copied together); see docs/operations.md",
                    name.display(),
                    wal::wal_path(name).display()
                ),
            ));
            // What is left is read where it was written.
            plan.layout_len = recorded;
        }
        // A longer file (extended by hand) still holds the frames where
        // they were written.
        Some(recorded) => plan.layout_len = recorded,
        None => {}
    }
    // The log must be this store's: its frames verify under this store's
    // id. A log with frames of which none does (another store's, put in
    // its place) cannot hold this store's writes. One frame that does not
    // verify may be this store's first, torn by a crash: two or more
    // cannot all be.
    if found.format >= 3 {
        let (seen, ours) = wal::frames_seen(file, &found.store_id, plan.layout_len)?;
        if seen >= 2 && ours == 0 {
            plan.problems.push(Error::corrupt(
                None,
                format!(
                    "{} was not closed cleanly, and none of the {seen} frames in its \
                     write-ahead log {} verifies for this store: the log belongs to another \
                     store, so the writes acknowledged since the last checkpoint are not in \
                     it. Put back the log that belongs to this store; see docs/operations.md",
                    name.display(),
                    wal::wal_path(name).display()
                ),
            ));
        }
    }
    Ok(plan)
}

/// Walks the live frames as `plan` says (`wal::walk`): a format-2 log's
/// one region, or this format's durable epoch and then the next one (a
/// checkpoint may have been running). Returns the frames handed to
/// `on_frame`.
pub(super) fn walk_live(
    file: &dyn StorageBackend,
    found: &Found<'_>,
    plan: &LogPlan,
    mut loss: Option<&mut LossReport>,
    mut on_frame: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<u64> {
    let epochs = if found.format < 3 {
        vec![(plan.epoch, wal::Layout::v2(plan.layout_len))]
    } else {
        let next = plan.epoch.wrapping_add(1);
        vec![
            (
                plan.epoch,
                wal::Layout::segment(plan.layout_len, plan.epoch),
            ),
            (next, wal::Layout::segment(plan.layout_len, next)),
        ]
    };
    let mut frames = 0;
    for (epoch, layout) in epochs {
        frames += wal::walk(
            file,
            &found.store_id,
            epoch,
            &layout,
            plan.no_reboot,
            loss.as_deref_mut(),
            &mut on_frame,
        )?;
    }
    Ok(frames)
}

/// What the open found out before the log's recovery.
pub(super) struct Found<'a> {
    pub(super) store_id: [u8; 16],
    /// The store format the file was written in.
    pub(super) format: u32,
    /// This boot's id, for a log on a real file.
    pub(super) boot: Option<&'a str>,
    /// The store, in errors.
    pub(super) name: &'a Path,
    /// A heal in a running process: the log's last frame may be one whose
    /// write failed, so a damaged last frame is the end, as after a reboot.
    pub(super) heal: bool,
}

fn recover_log(
    db: &Database,
    file: std::sync::Arc<dyn StorageBackend>,
    found: &Found<'_>,
    config: &Config,
    loss: &mut LossReport,
) -> Result<(Wal, u64)> {
    let (store_id, boot) = (found.store_id, found.boot);
    let mut plan = plan_log(db, file.as_ref(), found)?;
    let len = plan.file_len;
    for problem in std::mem::take(&mut plan.problems) {
        if !config.accept_loss {
            return Err(problem);
        }
        loss.findings.push(format!("accepted: {problem}"));
    }
    let epoch = plan.epoch;
    let mut txn = db.begin_write().map_err(engine)?;
    txn.set_quick_repair(true);
    // Replayed with the layout the log was written in, before its size
    // may change below (a larger `wal_bytes` moves the segments).
    let frames = walk_live(
        file.as_ref(),
        found,
        &plan,
        config.accept_loss.then_some(&mut *loss),
        wal::applier(&txn)?,
    )?;
    // Both epochs are now retired; new frames start a fresh one.
    let fresh = epoch.wrapping_add(2);
    // Without the log this open's commits go straight to the file, so the
    // log will hold nothing needed: it is marked closed at once.
    let state = if config.write_ahead_log {
        WAL_OPEN
    } else {
        WAL_CLOSED
    };
    {
        let mut meta = txn.open_table(META).map_err(engine)?;
        meta.insert(META_WAL_EPOCH, fresh.to_be_bytes().as_slice())
            .map_err(engine)?;
        meta.insert(META_WAL_STATE, [state].as_slice())
            .map_err(engine)?;
        match boot {
            Some(boot) => meta.insert(META_WAL_BOOT, boot.as_bytes()).map(|_| ()),
            None => meta.remove(META_WAL_BOOT).map(|_| ()),
        }
        .map_err(engine)?;
        // The size as it is: a crash while `preallocate` grows the file
        // below leaves it longer than recorded, which is allowed (no frame
        // of the new epoch exists before the size is recorded again).
        meta.insert(META_WAL_BYTES, len.to_be_bytes().as_slice())
            .map_err(engine)?;
        meta.insert(
            META_FORMAT_VERSION,
            STORE_FORMAT_VERSION.to_be_bytes().as_slice(),
        )
        .map_err(engine)?;
    }
    txn.commit().map_err(engine)?;
    // A read-only open replayed into memory (an overlay) and leaves the
    // log file as it is.
    let new_len = if config.read_only {
        len
    } else {
        wal::preallocate(file.as_ref(), config.wal_bytes)?
    };
    if new_len != len {
        // The new size, durably, before any frame is laid out for it.
        let txn = db.begin_write().map_err(engine)?;
        {
            let mut meta = txn.open_table(META).map_err(engine)?;
            meta.insert(META_WAL_BYTES, new_len.to_be_bytes().as_slice())
                .map_err(engine)?;
        }
        txn.commit().map_err(engine)?;
    }
    Ok((Wal::new(file, store_id, fresh, new_len), frames))
}

/// [`META_WAL_STATE`] and [`META_WAL_BYTES`] as stored.
#[derive(Clone, Copy, Debug)]
pub(super) struct WalState {
    /// The log may hold acknowledged frames (the last stop was not clean).
    pub(super) open: bool,
    /// The log's size as the last open left it.
    pub(super) bytes: Option<u64>,
}

/// The log's state, or `None` when no open with this check has recorded it.
pub(super) fn read_wal_state(db: &Database) -> Result<Option<WalState>> {
    let txn = db.begin_read().map_err(engine)?;
    let meta = txn.open_table(META).map_err(table_error)?;
    let Some(state) = meta.get(META_WAL_STATE).map_err(engine)? else {
        return Ok(None);
    };
    let [state] = fixed::<1>(META_WAL_STATE, state.value())?;
    let bytes = match meta.get(META_WAL_BYTES).map_err(engine)? {
        Some(v) => Some(u64::from_be_bytes(fixed(META_WAL_BYTES, v.value())?)),
        None => None,
    };
    Ok(Some(WalState {
        open: state == WAL_OPEN,
        bytes,
    }))
}

/// The boot id the log's last open recorded ([`META_WAL_BOOT`]).
pub(super) fn read_wal_boot(db: &Database) -> Result<Option<String>> {
    let txn = db.begin_read().map_err(engine)?;
    let meta = txn.open_table(META).map_err(table_error)?;
    Ok(meta
        .get(META_WAL_BOOT)
        .map_err(engine)?
        .map(|v| String::from_utf8_lossy(v.value()).into_owned()))
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

/// This boot of the machine: Linux's random id, new at every boot. An
/// open after a process crash (the same boot) knows the page cache held
/// every write the process made, so no frame can have been torn by a power
/// loss. `None` where the system does not say.
pub(super) fn boot_id() -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .map(|id| id.trim().to_owned())
            .filter(|id| !id.is_empty())
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The store was not closed cleanly and its log is gone: the writes
/// acknowledged since the last checkpoint exist only in that log.
fn log_missing(name: &Path, what: &str) -> Error {
    Error::corrupt(
        None,
        format!(
            "{} was not closed cleanly, and {what} ({}): the writes acknowledged since its last \
             checkpoint are only in that log. Put back the log that belongs to this store (a \
             store and its log are copied together, with no process holding them); see \
             docs/operations.md",
            name.display(),
            wal::wal_path(name).display()
        ),
    )
}

pub(super) fn read_wal_epoch(db: &Database) -> Result<u64> {
    let txn = db.begin_read().map_err(engine)?;
    let meta = txn.open_table(META).map_err(table_error)?;
    match meta.get(META_WAL_EPOCH).map_err(engine)? {
        None => Ok(0),
        Some(v) => Ok(u64::from_be_bytes(fixed(META_WAL_EPOCH, v.value())?)),
    }
}

fn map_open(err: DatabaseError, path: &Path) -> Error {
    match err {
        DatabaseError::DatabaseAlreadyOpen => Error::Locked {
            path: path.display().to_string(),
            holder: crate::holder::lock_holder(path),
        },
        // The engine read past the end of the file while opening it: the
        // file is shorter than its own header says (cut short), which is
        // damage, not an I/O failure a retry could fix.
        DatabaseError::Storage(::redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            Error::corrupt(
                None,
                format!(
                    "{} is truncated: shorter than its own header says",
                    path.display()
                ),
            )
        }
        other => engine(other),
    }
}

fn table_error(err: TableError) -> Error {
    match err {
        TableError::TableTypeMismatch { .. } | TableError::TableIsMultimap(_) => {
            not_ours(format!("a table has a foreign layout ({err})"))
        }
        other => engine(other),
    }
}

/// The meta entries, or `None` for a file with no tables at all (new, or
/// created by redb just before a crash). A redb file with other tables but
/// no meta table is someone else's database.
fn read_meta(db: &Database) -> Result<Option<MetaEntries>> {
    let txn = db.begin_read().map_err(engine)?;
    let names: Vec<String> = txn
        .list_tables()
        .map_err(engine)?
        .map(|t| t.name().to_owned())
        .collect();
    if !names.iter().any(|n| n == META.name()) {
        if names.is_empty() {
            return Ok(None);
        }
        return Err(not_ours(format!(
            "a redb database without idemstore's meta table (tables: {})",
            names.join(", ")
        )));
    }
    let meta = read_meta_entries(&txn)?;
    if meta.format_version > STORE_FORMAT_VERSION {
        return Err(Error::UnsupportedFormat {
            found: meta.format_version,
            supported: STORE_FORMAT_VERSION,
        });
    }
    if meta.format_version == 0 {
        return Err(Error::corrupt(None, "meta format version is 0"));
    }
    // Opening the record tables proves they have our layout.
    txn.open_table(RECORDS).map_err(table_error)?;
    txn.open_table(EXPIRY).map_err(table_error)?;
    Ok(Some(meta))
}

/// The three meta entries, as stored (no version policy applied).
pub(super) struct MetaEntries {
    pub(super) format_version: u32,
    pub(super) store_id: [u8; 16],
    pub(super) token_hwm: u64,
}

/// Reads the meta entries; a missing or mis-sized entry is `Corrupt`.
/// Shared by open (which then checks the version) and `Admin::facts`.
pub(super) fn read_meta_entries(txn: &::redb::ReadTransaction) -> Result<MetaEntries> {
    let meta = txn.open_table(META).map_err(table_error)?;
    let get = |name: &str| -> Result<Vec<u8>> {
        match meta.get(name).map_err(engine)? {
            Some(v) => Ok(v.value().to_vec()),
            None => Err(Error::corrupt(
                None,
                format!("meta entry {name:?} is missing"),
            )),
        }
    };
    Ok(MetaEntries {
        format_version: u32::from_be_bytes(fixed(META_FORMAT_VERSION, &get(META_FORMAT_VERSION)?)?),
        store_id: fixed(META_STORE_ID, &get(META_STORE_ID)?)?,
        token_hwm: u64::from_be_bytes(fixed(META_TOKEN_HWM, &get(META_TOKEN_HWM)?)?),
    })
}

fn fixed<const N: usize>(name: &str, bytes: &[u8]) -> Result<[u8; N]> {
    bytes.try_into().map_err(|_| {
        Error::corrupt(
            None,
            format!("meta entry {name:?} is {} bytes, not {N}", bytes.len()),
        )
    })
}

/// Writes the meta table and the empty record tables of a new store.
fn init_meta(db: &Database, config: &Config) -> Result<MetaEntries> {
    let store_id = new_store_id(config);
    let mut txn = db.begin_write().map_err(engine)?;
    txn.set_quick_repair(true);
    {
        let mut meta = txn.open_table(META).map_err(engine)?;
        meta.insert(
            META_FORMAT_VERSION,
            STORE_FORMAT_VERSION.to_be_bytes().as_slice(),
        )
        .map_err(engine)?;
        meta.insert(META_STORE_ID, store_id.as_slice())
            .map_err(engine)?;
        meta.insert(META_TOKEN_HWM, 0u64.to_be_bytes().as_slice())
            .map_err(engine)?;
        txn.open_table(RECORDS).map_err(engine)?;
        txn.open_table(EXPIRY).map_err(engine)?;
    }
    txn.commit().map_err(engine)?;
    Ok(MetaEntries {
        format_version: STORE_FORMAT_VERSION,
        store_id,
        token_hwm: 0,
    })
}

/// 16 bytes unlikely to repeat: the std hasher's per-process random keys,
/// the time and the process id, through SHA-256 (no RNG dependency for this).
fn new_store_id(config: &Config) -> [u8; 16] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for _ in 0..2 {
        let mut r = std::collections::hash_map::RandomState::new().build_hasher();
        r.write_u64(config.clock.now().as_millis());
        h.update(r.finish().to_be_bytes());
    }
    h.update(std::process::id().to_be_bytes());
    h.update(config.clock.now().as_millis().to_be_bytes());
    let digest = h.finalize();
    let mut id = [0u8; 16];
    id.copy_from_slice(digest.get(..16).unwrap_or(&[0; 16]));
    id
}

/// [`RecoveryPolicy::ExpireLeases`]: one process holds the file, so every
/// PROCESSING record found at open belongs to a dead process. Its lease is
/// ended now (its expiry is untouched), so a retry takes it over at once,
/// with a new fencing token. Reads every record: O(records) at open.
fn expire_leases(db: &Database, config: &Config) -> Result<u64> {
    let now = config.clock.now();
    let mut txn = db.begin_write().map_err(engine)?;
    txn.set_quick_repair(true);
    let mut expired = 0u64;
    {
        let mut tables = WriteTables::open(&txn)?;
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
    }
    txn.commit().map_err(engine)?;
    Ok(expired)
}
