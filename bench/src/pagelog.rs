//! A measuring prototype, not a store format: redb's store file behind a
//! page-level redo log, to learn what an inbox batch would cost if a redb
//! commit were one sequential append and one `fdatasync` (as a PostgreSQL
//! commit is) instead of a `pwrite` per dirty page and an `fdatasync` of
//! the store file.
//!
//! [`PageLogged`] is a redb `StorageBackend` over the store file and a log
//! file beside it:
//!
//! - `write` and `set_len` land in memory: the latest image of every page
//!   written since the last checkpoint, and the operations in order;
//! - `sync_data` appends the operations since the last sync as one frame
//!   (epoch, sequence number, CRC-32) to the preallocated log and syncs the
//!   log, nothing else;
//! - when a frame would not fit, a checkpoint writes every page image into
//!   the store file, syncs it, and starts a new epoch with a marker frame at
//!   the log's start (synced), which makes the old frames unreadable;
//! - `close` checkpoints, so a closed file is complete.
//!
//! It does the I/O a real implementation would do on the commit path, so
//! its figures are honest for the bench. What it lacks for users is the
//! other half: the replay of the log's frames at open (after a crash the
//! store file alone is the last checkpoint), the read-only view and the
//! operator tools reading through the log, and crash tests. The bench
//! never crashes a store and reopens it. See `docs/known-limitations.md`.

use redb::backends::FileBackend;
use redb::{BackendError, StorageBackend};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Error as IoError, ErrorKind};
use std::ops::Bound;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

/// The page unit of the in-memory images (redb's pages are multiples).
const PAGE: u64 = 4096;
/// The log's size: a frame that would not fit makes a checkpoint.
pub const CAPACITY: u64 = 32 << 20;
const MAGIC: &[u8; 4] = b"IDPG";
/// magic, epoch, sequence number, payload length, CRC-32.
const HEADER: usize = 4 + 8 + 8 + 4 + 4;

/// The store file behind a page-level redo log. See the module docs.
pub struct PageLogged {
    file: FileBackend,
    log: File,
    state: Mutex<State>,
}

struct State {
    /// The length redb sees.
    len: u64,
    /// The store file's length on disk.
    file_len: u64,
    /// Bytes at or past this offset that no page image covers read as
    /// zeros: the file was cut there since the last checkpoint.
    zero_from: u64,
    /// The latest image of every page written since the last checkpoint.
    pages: HashMap<u64, Box<[u8]>>,
    /// Operations since the last sync, encoded.
    pending: Vec<u8>,
    /// Where the next frame goes.
    at: u64,
    epoch: u64,
    seq: u64,
    /// Frames appended and checkpoints made, for the bench's report.
    frames: u64,
    checkpoints: u64,
}

impl std::fmt::Debug for PageLogged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageLogged").finish_non_exhaustive()
    }
}

impl PageLogged {
    /// A new store file `path` (which must not exist) with its log at
    /// `path` + `-pages`, preallocated to [`CAPACITY`].
    pub fn create(path: &Path) -> std::io::Result<PageLogged> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        let mut log_path = path.as_os_str().to_owned();
        log_path.push("-pages");
        let log = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(log_path)?;
        let zeros = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < CAPACITY {
            log.write_all_at(&zeros, at)?;
            at += zeros.len() as u64;
        }
        log.sync_all()?;
        let file = FileBackend::new(file).map_err(|e| IoError::other(e.to_string()))?;
        let logged = PageLogged {
            file,
            log,
            state: Mutex::new(State {
                len: 0,
                file_len: 0,
                zero_from: 0,
                pages: HashMap::new(),
                pending: Vec::new(),
                at: 0,
                epoch: 1,
                seq: 0,
                frames: 0,
                checkpoints: 0,
            }),
        };
        {
            let mut s = logged.lock();
            logged.marker(&mut s)?;
        }
        Ok(logged)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// (frames appended, checkpoints made) so far.
    pub fn counts(&self) -> (u64, u64) {
        let s = self.lock();
        (s.frames, s.checkpoints)
    }

    /// Fills `out` from the store file at `offset`: zeros past its length
    /// or past a cut since the last checkpoint.
    fn read_file(&self, s: &State, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let valid = s.file_len.min(s.zero_from);
        let n = valid.saturating_sub(offset).min(out.len() as u64) as usize;
        let (head, tail) = out.split_at_mut(n);
        if !head.is_empty() {
            self.file.read(offset, head)?;
        }
        tail.fill(0);
        Ok(())
    }

    fn page(&self, s: &State, index: u64) -> std::io::Result<Box<[u8]>> {
        if let Some(page) = s.pages.get(&index) {
            return Ok(page.clone());
        }
        let mut page = vec![0u8; PAGE as usize].into_boxed_slice();
        self.read_file(s, index * PAGE, &mut page)?;
        Ok(page)
    }

    /// Writes the frame `(seq, payload)` of the current epoch at `s.at`.
    fn frame(&self, s: &mut State, payload: &[u8]) -> std::io::Result<()> {
        let mut frame = Vec::with_capacity(HEADER + payload.len());
        frame.extend_from_slice(MAGIC);
        frame.extend_from_slice(&s.epoch.to_le_bytes());
        frame.extend_from_slice(&s.seq.to_le_bytes());
        let n = u32::try_from(payload.len()).map_err(|_| IoError::from(ErrorKind::InvalidInput))?;
        frame.extend_from_slice(&n.to_le_bytes());
        let mut crc = crc32fast::Hasher::new();
        crc.update(&frame);
        crc.update(payload);
        frame.extend_from_slice(&crc.finalize().to_le_bytes());
        frame.extend_from_slice(payload);
        self.log.write_all_at(&frame, s.at)?;
        self.log.sync_data()?;
        s.at += frame.len() as u64;
        s.seq += 1;
        Ok(())
    }

    /// A new epoch: its marker at the log's start, synced.
    fn marker(&self, s: &mut State) -> std::io::Result<()> {
        s.epoch += 1;
        s.seq = 0;
        s.at = 0;
        self.frame(s, &[])
    }

    /// Every page image into the store file, synced; then a new epoch.
    fn checkpoint(&self, s: &mut State) -> std::io::Result<()> {
        if s.zero_from < s.file_len {
            self.file.set_len(s.zero_from)?;
        }
        if s.file_len != s.len {
            self.file.set_len(s.len)?;
        }
        let mut indexes: Vec<u64> = s.pages.keys().copied().collect();
        indexes.sort_unstable();
        for index in indexes {
            let at = index * PAGE;
            if at >= s.len {
                continue;
            }
            if let Some(page) = s.pages.get(&index) {
                let n = (s.len - at).min(PAGE) as usize;
                self.file.write(at, page.get(..n).unwrap_or_default())?;
            }
        }
        self.file.sync_data()?;
        s.pages.clear();
        s.pending.clear();
        s.file_len = s.len;
        s.zero_from = s.len;
        s.checkpoints += 1;
        self.marker(s)
    }
}

impl StorageBackend for PageLogged {
    fn len(&self) -> Result<u64, IoError> {
        Ok(self.lock().len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), IoError> {
        let s = self.lock();
        if offset + out.len() as u64 > s.len {
            return Err(ErrorKind::UnexpectedEof.into());
        }
        if s.pages.is_empty() {
            return self.read_file(&s, offset, out);
        }
        let mut done = 0usize;
        while done < out.len() {
            let at = offset + done as u64;
            let index = at / PAGE;
            let from = (at % PAGE) as usize;
            let n = (PAGE as usize - from).min(out.len() - done);
            let to = out.get_mut(done..done + n).unwrap_or_default();
            match s.pages.get(&index) {
                Some(page) => to.copy_from_slice(page.get(from..from + n).unwrap_or_default()),
                None => self.read_file(&s, at, to)?,
            }
            done += n;
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), IoError> {
        let mut s = self.lock();
        if len < s.len {
            s.zero_from = s.zero_from.min(len);
            s.pages.retain(|&index, _| index * PAGE < len);
            let index = len / PAGE;
            let from = (len % PAGE) as usize;
            if let Some(page) = s.pages.get_mut(&index) {
                page.get_mut(from..).unwrap_or_default().fill(0);
            }
        }
        s.len = len;
        s.pending.push(2);
        s.pending.extend_from_slice(&len.to_le_bytes());
        Ok(())
    }

    fn sync_data(&self) -> Result<(), IoError> {
        let mut s = self.lock();
        if s.pending.is_empty() {
            return Ok(());
        }
        if s.at + (HEADER + s.pending.len()) as u64 > CAPACITY {
            return self.checkpoint(&mut s);
        }
        let payload = std::mem::take(&mut s.pending);
        self.frame(&mut s, &payload)?;
        s.frames += 1;
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), IoError> {
        let mut s = self.lock();
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let index = at / PAGE;
            let mut page = self.page(&s, index)?;
            let from = (at % PAGE) as usize;
            let n = (PAGE as usize - from).min(data.len() - done);
            page.get_mut(from..from + n)
                .unwrap_or_default()
                .copy_from_slice(data.get(done..done + n).unwrap_or_default());
            s.pages.insert(index, page);
            done += n;
        }
        s.len = s.len.max(offset + data.len() as u64);
        s.pending.push(1);
        s.pending.extend_from_slice(&offset.to_le_bytes());
        s.pending
            .extend_from_slice(&(data.len() as u64).to_le_bytes());
        s.pending.extend_from_slice(data);
        Ok(())
    }

    fn close(&self) -> Result<(), IoError> {
        {
            let mut s = self.lock();
            self.checkpoint(&mut s)?;
        }
        self.file.close()
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.file.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.query_lock_range(start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What redb wrote reads back, before and after a checkpoint, and the
    /// closed file holds it all.
    #[test]
    fn writes_read_back_through_checkpoints_and_close() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("s.redb");
        let b = PageLogged::create(&path).expect("create");
        b.set_len(3 * PAGE).expect("grow");
        b.write(100, &[7u8; 5000]).expect("write");
        b.sync_data().expect("sync");
        assert_eq!(b.counts(), (1, 0));
        let mut out = vec![0u8; 5000];
        b.read(100, &mut out).expect("read");
        assert!(out.iter().all(|&x| x == 7));
        {
            let mut s = b.lock();
            b.checkpoint(&mut s).expect("checkpoint");
        }
        // A cut and a regrowth read zeros where the cut was.
        b.set_len(PAGE).expect("cut");
        b.set_len(2 * PAGE).expect("regrow");
        let mut out = vec![1u8; PAGE as usize];
        b.read(PAGE, &mut out).expect("read");
        assert!(out.iter().all(|&x| x == 0));
        b.close().expect("close");
        let on_disk = std::fs::read(&path).expect("file");
        assert_eq!(on_disk.len() as u64, 2 * PAGE);
        assert!(
            on_disk
                .get(100..PAGE as usize)
                .expect("head")
                .iter()
                .all(|&x| x == 7)
        );
        assert!(
            on_disk
                .get(PAGE as usize..)
                .expect("tail")
                .iter()
                .all(|&x| x == 0)
        );
    }
}
