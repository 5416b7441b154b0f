//! [`check_log`]: what an open would find in a store's write-ahead log,
//! without opening the store and without writing anything.

use super::super::errors::engine;
use super::super::loss::LossReport;
use super::super::open::{self, check_foreign, read_meta_entries};
use super::super::wal::{self, Layout};
use crate::error::{Error, Result};
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
    let file = std::fs::File::open(store)?;
    let overlay = Overlay::new(file);
    check_foreign(&overlay)?;
    let db = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Database::builder().create_with_backend(overlay)
    }))
    .map_err(|_| {
        Error::corrupt(
            None,
            format!(
                "{} is damaged: the storage engine could not read it",
                store.display()
            ),
        )
    })?
    .map_err(engine)?;
    let meta = {
        let txn = db.begin_read().map_err(engine)?;
        read_meta_entries(&txn)?
    };
    let epoch = open::read_wal_epoch(&db)?;
    let state = open::read_wal_state(&db)?;
    let unclean = state.filter(|s| s.open);
    let path = wal::wal_path(store);
    let mut check = LogCheck {
        present: path.exists(),
        clean_stop: state.map(|s| !s.open),
        ..LogCheck::default()
    };
    let log: Box<dyn StorageBackend> = match std::fs::File::open(&path) {
        Ok(file) => Box::new(ReadOnly(file)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Box::new(ReadOnly::empty()?),
        Err(e) => return Err(e.into()),
    };
    check.bytes = log.len().map_err(Error::Io)?;
    let mut layout_len = check.bytes;
    if let Some(s) = unclean {
        match s.bytes {
            Some(0) => {}
            _ if check.bytes == 0 => check.problems.push(format!(
                "the store was not closed cleanly and its log {} is missing or empty",
                path.display()
            )),
            Some(recorded) if check.bytes < recorded => {
                check.problems.push(format!(
                    "the store was not closed cleanly and its log is {} bytes where the store \
                     left it at {recorded}: cut short, or another file",
                    check.bytes
                ));
                layout_len = recorded;
            }
            Some(recorded) => layout_len = recorded,
            None => {}
        }
        if meta.format_version >= 3 {
            let (seen, ours) = wal::frames_seen(log.as_ref(), &meta.store_id, layout_len)?;
            if seen >= 2 && ours == 0 {
                check.problems.push(format!(
                    "none of the {seen} frames in the log verifies for this store: the log \
                     belongs to another store"
                ));
            }
        }
    }
    let no_reboot = match (open::boot_id(), open::read_wal_boot(&db)?) {
        (Some(now), Some(then)) => now == then,
        _ => false,
    };
    let layouts = if meta.format_version < 3 {
        vec![(epoch, Layout::v2(layout_len))]
    } else {
        let next = epoch.wrapping_add(1);
        vec![
            (epoch, Layout::segment(layout_len, epoch)),
            (next, Layout::segment(layout_len, next)),
        ]
    };
    let mut loss = LossReport::default();
    for (epoch, layout) in layouts {
        let mut undecodable = Vec::new();
        check.frames += wal::walk(
            log.as_ref(),
            &meta.store_id,
            epoch,
            &layout,
            no_reboot,
            Some(&mut loss),
            |at, payload| {
                if let Err(e) = wal::entries(at, payload, |_| Ok(())) {
                    undecodable.push(e.to_string());
                }
                Ok(())
            },
        )?;
        check.problems.append(&mut undecodable);
    }
    check.problems.append(&mut loss.findings);
    check.path = path;
    Ok(check)
}

/// A file read through an in-memory overlay: writes (redb's recovery of an
/// uncleanly closed file) land in memory, whole pages at a time, and the
/// file is never written.
pub(super) struct Overlay {
    file: std::fs::File,
    state: Mutex<OverlayState>,
}

struct OverlayState {
    len: u64,
    pages: HashMap<u64, Vec<u8>>,
}

const PAGE: u64 = 4096;

impl Overlay {
    pub(super) fn new(file: std::fs::File) -> Overlay {
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
            read_at(&self.file, page.get_mut(..n).unwrap_or_default(), start)?;
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

/// A log file opened for reading only; every write is refused.
#[derive(Debug)]
struct ReadOnly(std::fs::File);

impl ReadOnly {
    /// Stands for a missing log: no bytes.
    fn empty() -> Result<ReadOnly> {
        Ok(ReadOnly(empty_file()?))
    }
}

/// An empty, read-only stand-in file (a missing log reads as empty).
fn empty_file() -> Result<std::fs::File> {
    #[cfg(unix)]
    {
        Ok(std::fs::File::open("/dev/null")?)
    }
    #[cfg(not(unix))]
    {
        Ok(std::fs::File::open("NUL")?)
    }
}

impl StorageBackend for ReadOnly {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        read_at(&self.0, out, offset)
    }
    fn set_len(&self, _: u64) -> std::io::Result<()> {
        Err(read_only())
    }
    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
        Err(read_only())
    }
}

fn read_only() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        "check_log never writes",
    )
}

fn read_at(file: &std::fs::File, out: &mut [u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, out, offset)
    }
    #[cfg(windows)]
    {
        let mut done = 0;
        while let Some(rest) = out.get_mut(done..).filter(|r| !r.is_empty()) {
            let n = std::os::windows::fs::FileExt::seek_read(file, rest, offset + done as u64)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            done += n;
        }
        Ok(())
    }
}
