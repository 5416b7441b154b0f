//! [`check_log`]: what an open would find in a store's write-ahead log,
//! without opening the store and without writing anything.

use super::super::errors::engine;
use super::super::loss::LossReport;
use super::super::open::{self, Found, check_foreign, read_meta_entries};
use super::super::wal::{self, FileLog};
use crate::error::{Error, Result};
use ::redb::backends::InMemoryBackend;
use ::redb::{Database, ReadableDatabase, StorageBackend};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// What [`check_log`] found: the log's state and every problem an open of
/// the store would refuse (all of them, not only the first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LogCheck {
    /// The log file (`<store>-wal`).
    pub path: PathBuf,
    /// The log file exists.
    pub present: bool,
    /// Its size in bytes (0 when missing).
    pub bytes: u64,
    /// Whether the store was last closed cleanly (`Some(true)`: the log
    /// holds nothing the store needs); `None` for a store no build with
    /// this record has opened with a log.
    pub clean_stop: Option<bool>,
    /// Frames an open would replay.
    pub frames: u64,
    /// What an open would refuse, one line each; empty when the log is
    /// fine.
    pub problems: Vec<String>,
}

impl LogCheck {
    /// An open would replay the log without refusing it.
    ///
    /// ```
    /// assert!(idemstore::redb::admin::LogCheck::default().is_clean());
    /// ```
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks the write-ahead log of the store at `store` the way an open
/// would replay it (the unclean-stop record, the log's size and owner,
/// every frame of the live epochs, damage anywhere in their segments, a
/// damaged last frame after a process crash, frames that verify but do
/// not decode), and reports every problem instead of stopping at the first.
///
/// Writes nothing, to either file: the store file is read through a
/// private in-memory overlay (so that redb's own recovery of an uncleanly
/// closed file happens in memory), and the log is only read. It takes no
/// lock either: run it on a store no process holds, or on a copy.
///
/// Errors: what an open would say about the store file itself (missing,
/// foreign, damaged), and I/O errors.
///
/// ```
/// use idemstore::redb::admin::check_log;
/// # let dir = tempfile::tempdir()?;
/// let path = dir.path().join("s.idem");
/// drop(idemstore::RedbStore::open(&path)?);
/// let check = check_log(&path)?;
/// assert!(check.is_clean());
/// assert_eq!(check.clean_stop, Some(true));
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn check_log(store: impl AsRef<Path>) -> Result<LogCheck> {
    let store = store.as_ref();
    let db = open_overlay(store)?.map_err(|detail| {
        Error::corrupt(None, format!("{} is damaged: {detail}", store.display()))
    })?;
    let meta = {
        let txn = db.begin_read().map_err(engine)?;
        read_meta_entries(&txn)?
    };
    let state = open::read_wal_state(&db)?;
    // A missing log reads as an empty one.
    let log: Box<dyn StorageBackend> = match FileLog::open_read_only(store)? {
        Some(log) => Box::new(log),
        None => Box::new(InMemoryBackend::new()),
    };
    let boot = open::boot_id();
    let found = Found {
        store_id: meta.store_id,
        format: meta.format_version,
        boot: boot.as_deref(),
        name: store,
    };
    let plan = open::plan_log(&db, log.as_ref(), &found)?;
    let mut check = LogCheck {
        path: log_path(store),
        present: log_path(store).exists(),
        bytes: plan.file_len,
        clean_stop: state.map(|s| !s.open),
        frames: 0,
        problems: plan.problems.iter().map(ToString::to_string).collect(),
    };
    // Every frame the open would replay, decoded but not applied; what it
    // would refuse is written down, and the walk goes on.
    let mut loss = LossReport::default();
    let mut undecodable = Vec::new();
    check.frames = open::walk_live(
        log.as_ref(),
        &found,
        &plan,
        Some(&mut loss),
        |at, payload| {
            if let Err(e) = wal::entries(at, payload, |_| Ok(())) {
                undecodable.push(e.to_string());
            }
            Ok(())
        },
    )?;
    check.problems.append(&mut loss.findings);
    check.problems.append(&mut undecodable);
    Ok(check)
}

/// The write-ahead log's path for the store file at `store`:
/// `<store>-wal`. The two are copied, moved and deleted together.
///
/// ```
/// use idemstore::redb::admin::log_path;
/// assert_eq!(log_path("/data/orders.idem"), std::path::Path::new("/data/orders.idem-wal"));
/// ```
pub fn log_path(store: impl AsRef<Path>) -> PathBuf {
    wal::wal_path(store.as_ref())
}

/// Opens the store file at `path` as a redb database through a private
/// [`Overlay`], so that nothing redb does (its recovery of an uncleanly
/// closed file, a repair) reaches the file. `Ok(Err(detail))` when redb
/// refuses the file or panics on it.
pub(super) fn open_overlay(path: &Path) -> Result<std::result::Result<Database, String>> {
    let overlay = Overlay::new(std::fs::File::open(path)?);
    check_foreign(&overlay)?;
    Ok(
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Database::builder().create_with_backend(overlay)
        })) {
            Ok(Ok(db)) => Ok(db),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("the storage engine could not read it".to_owned()),
        },
    )
}

/// A file read through an in-memory overlay: writes (redb's recovery of an
/// uncleanly closed file) land in memory, whole pages at a time, and the
/// file is never written.
struct Overlay {
    file: std::fs::File,
    state: Mutex<OverlayState>,
}

struct OverlayState {
    len: u64,
    pages: HashMap<u64, Vec<u8>>,
}

const PAGE: u64 = 4096;

impl Overlay {
    fn new(file: std::fs::File) -> Overlay {
        let len = file.metadata().map_or(0, |m| m.len());
        Overlay {
            file,
            state: Mutex::new(OverlayState {
                len,
                pages: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OverlayState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Page `index` as it reads now (overlay, else the file, zeros past its end).
    fn page(&self, state: &OverlayState, index: u64) -> std::io::Result<Vec<u8>> {
        if let Some(page) = state.pages.get(&index) {
            return Ok(page.clone());
        }
        let mut page = vec![0u8; PAGE as usize];
        let file_len = self.file.metadata()?.len();
        let start = index * PAGE;
        if start < file_len {
            let n = (file_len - start).min(PAGE) as usize;
            wal::read_at(&self.file, page.get_mut(..n).unwrap_or_default(), start)?;
        }
        Ok(page)
    }
}

impl std::fmt::Debug for Overlay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overlay").finish_non_exhaustive()
    }
}

impl StorageBackend for Overlay {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.lock().len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let state = self.lock();
        if offset + out.len() as u64 > state.len {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let mut done = 0usize;
        while done < out.len() {
            let at = offset + done as u64;
            let page = self.page(&state, at / PAGE)?;
            let from = (at % PAGE) as usize;
            let n = (PAGE as usize - from).min(out.len() - done);
            out.get_mut(done..done + n)
                .unwrap_or_default()
                .copy_from_slice(page.get(from..from + n).unwrap_or_default());
            done += n;
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.lock().len = len;
        Ok(())
    }

    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let mut state = self.lock();
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let index = at / PAGE;
            let mut page = self.page(&state, index)?;
            let from = (at % PAGE) as usize;
            let n = (PAGE as usize - from).min(data.len() - done);
            page.get_mut(from..from + n)
                .unwrap_or_default()
                .copy_from_slice(data.get(done..done + n).unwrap_or_default());
            state.pages.insert(index, page);
            done += n;
        }
        state.len = state.len.max(offset + data.len() as u64);
        Ok(())
    }
}
