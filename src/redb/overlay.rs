//! [`Overlay`]: a store file read through private in-memory pages, so that
//! nothing redb does on it (recovery, repair, replay) reaches the file: for
//! read-only opens, `check_log`, `verify` and a heal's read-only view.

use super::file::{Origin, check_foreign, file_backend};
use crate::error::{Error, Result};
use ::redb::{Database, StorageBackend};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The store file at `path` as a redb database through an [`Overlay`];
/// `Ok(Err(detail))` when redb refuses the file or panics on it.
pub(in crate::redb) fn open_overlay(path: &Path) -> Result<std::result::Result<Database, String>> {
    let file = file_backend(std::fs::File::open(path)?)?;
    engine_over(Overlay::new(Arc::new(file))?)
}

/// A database over a store's files that writes nothing to them: what a heal
/// leaves in the engine's place when it cannot open them for writing, so
/// reads go on.
pub(in crate::redb) fn open_view_of(source: &Origin) -> Result<Database> {
    let opened = match source {
        Origin::Path(path) => open_overlay(path)?,
        Origin::Backend(store) => engine_over(Overlay::new(Arc::clone(store))?)?,
        Origin::None => return Err(Error::backend("a read-only view has no files to view")),
    };
    opened.map_err(|detail| Error::corrupt(None, detail))
}

/// The engine over `overlay`, once its header is redb's.
fn engine_over(overlay: Overlay) -> Result<std::result::Result<Database, String>> {
    check_foreign(&overlay)?;
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Database::builder().create_with_backend(overlay)
    }));
    Ok(match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the storage engine could not read it".to_owned()),
    })
}

/// A file read through an in-memory overlay: writes land in memory, whole
/// pages at a time. The file's length is read once: the reader holds the
/// file so that no writer changes it meanwhile, or reads a copy.
pub(in crate::redb) struct Overlay {
    /// A file, or a caller's backend shared with the store: only read here.
    base: Arc<dyn StorageBackend>,
    file_len: u64,
    state: Mutex<OverlayState>,
}

struct OverlayState {
    /// The length as redb sees it (a `set_len` changes only this).
    len: u64,
    /// The latest bytes of every page written, by index.
    pages: HashMap<u64, Box<[u8]>>,
}

impl Overlay {
    pub(in crate::redb) fn new(base: Arc<dyn StorageBackend>) -> std::io::Result<Overlay> {
        let file_len = base.len()?;
        let state = Mutex::new(OverlayState {
            len: file_len,
            pages: HashMap::new(),
        });
        Ok(Overlay {
            base,
            file_len,
            state,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OverlayState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Zeros past the file's end.
    fn read_file(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let in_file = self.file_len.saturating_sub(offset).min(out.len() as u64) as usize;
        let (head, tail) = out.split_at_mut(in_file);
        if !head.is_empty() {
            self.base.read(offset, head)?;
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
        if state.pages.is_empty() {
            return self.read_file(offset, out);
        }
        let mut done = 0usize;
        while done < out.len() {
            let at = offset + done as u64;
            let from = (at % PAGE) as usize;
            let n = (PAGE as usize - from).min(out.len() - done);
            let to = out.get_mut(done..done + n).unwrap_or_default();
            match state.pages.get(&(at / PAGE)) {
                Some(page) => to.copy_from_slice(page.get(from..from + n).unwrap_or_default()),
                None => self.read_file(at, to)?,
            }
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

    /// A page written in part starts from its current bytes.
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let mut state = self.lock();
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let index = at / PAGE;
            let from = (at % PAGE) as usize;
            let n = (PAGE as usize - from).min(data.len() - done);
            let mut page = match state.pages.remove(&index) {
                Some(page) => page,
                None => {
                    let mut page = vec![0u8; PAGE as usize].into_boxed_slice();
                    // A whole page needs nothing of the old one.
                    if n < PAGE as usize {
                        self.read_file(index * PAGE, &mut page)?;
                    }
                    page
                }
            };
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

/// The unit of the images: redb's pages are multiples of it.
const PAGE: u64 = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_land_in_memory_and_reads_see_them() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 5000]).expect("write");
        let file = file_backend(std::fs::File::open(&path).expect("open")).expect("backend");
        let overlay = Overlay::new(Arc::new(file)).expect("overlay");
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
