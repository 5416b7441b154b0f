//! [`Overlay`]: a store file read through a private in-memory page
//! overlay, so that nothing redb does on it (its recovery of an uncleanly
//! closed file, a repair, a replay of the log, the commits of a read-only
//! store) reaches the file.
//!
//! Used by every reading that must not write: [`RedbStore::open_read_only`]
//! (the operator's inspections), `admin::check_log`, the engine check of
//! `Admin::verify`, and a heal that cannot reopen the files for writing
//! ([`open_view_of`]: the store goes on answering reads from them).
//!
//! [`RedbStore::open_read_only`]: crate::redb::RedbStore::open_read_only

use super::super::file::check_foreign;
use super::super::source::Source;
use super::page_images::Pages;
use crate::error::{Error, Result};
use ::redb::{Database, StorageBackend};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Opens the store file at `path` as a redb database through a private
/// [`Overlay`]. `Ok(Err(detail))` when redb refuses the file or panics on it.
pub(in crate::redb) fn open_overlay(path: &Path) -> Result<std::result::Result<Database, String>> {
    let overlay = Overlay::new(std::fs::File::open(path)?)?;
    // The caller holds the store (a view's shared lock, or a writer).
    super::replay_beside(path, &overlay, false)?;
    engine_over(overlay)
}

/// A database over a store's files (`source`) that writes nothing to
/// them: what a heal leaves in the engine's place when it cannot open the
/// files for writing (an open writes: redb repairs a file it did not
/// close), so that reads go on. The store file through an [`Overlay`],
/// with the page log's current run replayed into it when there is one.
pub(in crate::redb) fn open_view_of(source: &Source) -> Result<Database> {
    let opened = match source {
        Source::Path(path) => open_overlay(path)?,
        Source::Backend { store, pages } => {
            let overlay = Overlay::over_backend(Arc::clone(store))?;
            if let Some(pages) = pages {
                super::replay(pages.as_ref(), &overlay)?;
            }
            engine_over(overlay)?
        }
        Source::None => return Err(Error::backend("a read-only view has no files to view")),
    };
    opened.map_err(|detail| Error::corrupt(None, detail))
}

/// The engine over `overlay`, once its header is redb's.
fn engine_over(overlay: Overlay) -> Result<std::result::Result<Database, String>> {
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

/// A file read through an in-memory overlay: writes land in memory, whole
/// pages at a time, and the file is never written (it is opened read-only).
///
/// The file's length is read once: whoever reads through an overlay holds
/// the file so that no writer changes it meanwhile (a shared lock), or
/// reads a copy.
pub(in crate::redb) struct Overlay {
    base: Base,
    /// The file's length when the overlay was made.
    file_len: u64,
    state: Mutex<OverlayState>,
}

/// What an overlay reads from.
enum Base {
    File(std::fs::File),
    /// A caller's backend, shared with the store (only read here).
    Backend(Arc<dyn StorageBackend>),
}

struct OverlayState {
    /// The length as redb sees it (a `set_len` changes only this).
    len: u64,
    /// Pages written.
    pages: Pages,
}

impl Overlay {
    pub(in crate::redb) fn new(file: std::fs::File) -> std::io::Result<Overlay> {
        let file_len = file.metadata()?.len();
        Ok(Overlay::with_base(Base::File(file), file_len))
    }

    /// An overlay over a backend: its `read` and `len` only are called.
    fn over_backend(backend: Arc<dyn StorageBackend>) -> std::io::Result<Overlay> {
        let file_len = backend.len()?;
        Ok(Overlay::with_base(Base::Backend(backend), file_len))
    }

    fn with_base(base: Base, file_len: u64) -> Overlay {
        Overlay {
            base,
            file_len,
            state: Mutex::new(OverlayState {
                len: file_len,
                pages: Pages::default(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OverlayState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fills `out` from the file at `offset`, zeros past its end.
    fn read_file(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let in_file = self.file_len.saturating_sub(offset).min(out.len() as u64) as usize;
        let (head, tail) = out.split_at_mut(in_file);
        if !head.is_empty() {
            match &self.base {
                Base::File(file) => super::super::file::read_at(file, head, offset)?,
                Base::Backend(backend) => backend.read(offset, head)?,
            }
        }
        tail.fill(0);
        Ok(())
    }
}

impl std::fmt::Debug for Overlay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overlay")
            .field("file_len", &self.file_len)
            .finish_non_exhaustive()
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
        state
            .pages
            .read(offset, out, |at, to| self.read_file(at, to))
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
        state
            .pages
            .write(offset, data, |at, to| self.read_file(at, to))?;
        state.len = state.len.max(offset + data.len() as u64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_land_in_memory_and_reads_see_them() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 5000]).expect("write");
        let overlay = Overlay::new(std::fs::File::open(&path).expect("open")).expect("overlay");
        let mut out = vec![0u8; 5000];
        overlay.read(0, &mut out).expect("read");
        assert!(out.iter().all(|&b| b == 7));
        // Across a page boundary, past the file's end.
        overlay.write(4090, &[1u8; 20]).expect("write");
        assert_eq!(overlay.len().expect("len"), 5000);
        overlay.set_len(9000).expect("set_len");
        let mut out = vec![0u8; 9000];
        overlay.read(0, &mut out).expect("read");
        assert!(out.get(..4090).expect("head").iter().all(|&b| b == 7));
        assert!(out.get(4090..4110).expect("mid").iter().all(|&b| b == 1));
        assert!(out.get(4110..5000).expect("rest").iter().all(|&b| b == 7));
        assert!(out.get(5000..).expect("tail").iter().all(|&b| b == 0));
        let mut past = [0u8; 1];
        assert!(overlay.read(9000, &mut past).is_err());
        assert_eq!(
            std::fs::read(&path).expect("read"),
            vec![7u8; 5000],
            "the file is unchanged"
        );
    }
}
