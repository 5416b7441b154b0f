//! The page log (`<file>-pages`, [`RedbStoreBuilder::page_log`]): the store
//! file behind a redo log of redb's page writes, so that a durable redb
//! commit is one sequential append and one `fdatasync` of the log instead
//! of a write of every dirty page and an `fdatasync` of the store file.
//! The inbox commits a batch this way; the request path's own write-ahead
//! log (record_log/) is unchanged above it.
//!
//! [`PageLog`] is a redb [`StorageBackend`] over the store file and the log:
//!
//! - `write` and `set_len` land in memory: the latest image of every page
//!   written since the last checkpoint (reads see them), and the operations
//!   in order;
//! - `sync_data` appends the operations since the last sync as one frame to
//!   the log and syncs the log, nothing else;
//! - when a frame would not fit in the log ([`PAGE_LOG_BYTES`]), a
//!   checkpoint instead writes every page image into the store file, syncs
//!   it, and starts a new run of the log with a marker frame at its start;
//! - `close` (redb's last call, after a clean stop) checkpoints.
//!
//! # Durability reasoning
//!
//! redb's contract is that what was written before a `sync_data` that
//! returned is durable. Here it is durable in the log: the frame holding
//! those writes was synced before `sync_data` returned. The store file is
//! written only by a checkpoint, with pages whose frames are durable (or, in
//! a checkpoint that stands in for a frame, with the pending writes too,
//! made durable by the file's own sync before `sync_data` returns).
//!
//! Frames: `IDPG`, epoch, sequence number, payload length, CRC-32 (of all
//! that and the payload), payload (`1, offset, len, bytes` for a write,
//! `2, len` for a `set_len`). A run of the log starts with a marker (an
//! empty frame, sequence 0) at offset 0 and continues with frames of the
//! same epoch and consecutive sequence numbers. Replay (at every open, and
//! in memory for a read-only view) applies the run's frames in order to the
//! store file and stops at the first frame that does not verify: a torn
//! last frame was never acknowledged.
//!
//! A new run begins only after the store file holds everything (a
//! checkpoint synced it, or a replay applied and synced the old run), and
//! its marker is synced before any frame follows it. So the frames a
//! replay applies are always a whole run from its start: either the run
//! the store file already holds (replaying it again rewrites the same
//! images: nothing changes), or the current one. A marker torn at a crash
//! reads as no run at all, which is right: the file already holds
//! everything. The old run's frames after a new marker are never read:
//! their epoch differs.
//!
//! [`RedbStoreBuilder::page_log`]: super::RedbStoreBuilder::page_log

use super::page_images::Pages;
use crate::error::{Error, Result};
use ::redb::{BackendError, StorageBackend};
use std::io::{Error as IoError, ErrorKind};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The page log's size (`<file>-pages`, preallocated): a commit whose
/// frame would not fit makes a checkpoint of the store file instead, so the
/// pages kept in memory are at most about this much.
pub const PAGE_LOG_BYTES: u64 = 32 << 20;

const MAGIC: &[u8; 4] = b"IDPG";
/// Magic, epoch, sequence number, payload length, CRC-32.
const HEADER: usize = 4 + 8 + 8 + 4 + 4;
const OP_WRITE: u8 = 1;
const OP_SET_LEN: u8 = 2;

/// The page log's path beside the store file: `<name>-pages`.
pub(super) fn pages_path(store: &Path) -> PathBuf {
    let mut name = store.file_name().unwrap_or_default().to_os_string();
    name.push("-pages");
    store.with_file_name(name)
}

/// The store file behind a page log. See the module docs.
pub(super) struct PageLog {
    file: Box<dyn StorageBackend>,
    log: Box<dyn StorageBackend>,
    capacity: u64,
    state: Mutex<State>,
    /// Held through a `sync_data`: one frame or checkpoint at a time.
    syncing: Mutex<()>,
}

struct State {
    /// The length redb sees.
    len: u64,
    /// The store file's length on disk.
    file_len: u64,
    /// Bytes at or past this offset that no page image covers read as
    /// zeros: redb cut the file there since the last checkpoint.
    zero_from: u64,
    /// The latest image of every page written since the last checkpoint.
    pages: Pages,
    /// Operations since the last sync, encoded, after [`HEADER`] bytes
    /// reserved for their frame's header (empty when there are none).
    pending: Vec<u8>,
    /// Where the next frame goes.
    at: u64,
    epoch: u64,
    seq: u64,
}

impl std::fmt::Debug for PageLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageLog")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// What a replay found: frames applied (the marker not counted) and the
/// run's epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Replayed {
    pub(crate) frames: u64,
    pub(crate) epoch: Option<u64>,
}

/// Applies the log's current run to `target` in order, then syncs
/// `target` when anything was applied. Reads `log` only.
pub(crate) fn replay(log: &dyn StorageBackend, target: &dyn StorageBackend) -> Result<Replayed> {
    let log_len = log.len()?;
    let mut at = 0u64;
    let mut out = Replayed::default();
    let mut expect_seq = 0u64;
    while let Some((epoch, seq, payload)) = read_frame(log, log_len, at)? {
        if out.epoch.is_some_and(|e| e != epoch) || seq != expect_seq {
            break;
        }
        out.epoch = Some(epoch);
        apply(target, &payload)?;
        at += (HEADER + payload.len()) as u64;
        expect_seq += 1;
        if seq > 0 {
            out.frames += 1;
        }
    }
    if out.frames > 0 {
        target.sync_data()?;
    }
    Ok(out)
}

/// Replays the page log beside `store`, if there is one, into `target`
/// (an in-memory overlay of a read-only view): the log is opened read-only
/// and, with `lock`, shared-locked, so a writer is [`Error::Locked`].
pub(super) fn replay_beside(
    store: &Path,
    target: &dyn StorageBackend,
    lock: bool,
) -> Result<Replayed> {
    let path = pages_path(store);
    let file = match std::fs::File::open(&path) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Replayed::default()),
        other => other?,
    };
    if lock {
        super::file::try_lock(&file, super::file::Lock::Shared, store, &path)?;
    }
    let log = ::redb::backends::FileBackend::new(file)
        .map_err(|e| Error::Io(IoError::other(e.to_string())))?;
    replay(&log, target)
}

/// The frame at `at`, if one verifies there.
fn read_frame(
    log: &dyn StorageBackend,
    log_len: u64,
    at: u64,
) -> Result<Option<(u64, u64, Vec<u8>)>> {
    if at + HEADER as u64 > log_len {
        return Ok(None);
    }
    let mut header = [0u8; HEADER];
    log.read(at, &mut header)?;
    let field = |from: usize, to: usize| header.get(from..to).unwrap_or_default();
    if field(0, 4) != MAGIC {
        return Ok(None);
    }
    let u64_at =
        |from: usize| u64::from_le_bytes(field(from, from + 8).try_into().unwrap_or_default());
    let epoch = u64_at(4);
    let seq = u64_at(12);
    let len = u32::from_le_bytes(field(20, 24).try_into().unwrap_or_default());
    let crc = u32::from_le_bytes(field(24, 28).try_into().unwrap_or_default());
    if at + HEADER as u64 + u64::from(len) > log_len {
        return Ok(None);
    }
    let mut payload = vec![0u8; len as usize];
    log.read(at + HEADER as u64, &mut payload)?;
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(field(0, 24));
    hasher.update(&payload);
    if hasher.finalize() != crc {
        return Ok(None);
    }
    Ok(Some((epoch, seq, payload)))
}

/// Applies one frame's operations. A payload that does not parse after its
/// checksum verified is a bug or a foreign file: refused, nothing guessed.
fn apply(target: &dyn StorageBackend, mut payload: &[u8]) -> Result<()> {
    let malformed = || {
        Error::corrupt(
            None,
            "a page log frame's operations do not parse".to_owned(),
        )
    };
    let take = |p: &mut &[u8], n: usize| -> Result<Vec<u8>> {
        let (head, rest) = p.split_at_checked(n).ok_or_else(malformed)?;
        *p = rest;
        Ok(head.to_vec())
    };
    let take_u64 = |p: &mut &[u8]| -> Result<u64> {
        let bytes = take(p, 8)?;
        Ok(u64::from_le_bytes(
            bytes.try_into().map_err(|_| malformed())?,
        ))
    };
    while let Some((&op, rest)) = payload.split_first() {
        payload = rest;
        match op {
            OP_WRITE => {
                let offset = take_u64(&mut payload)?;
                let len = usize::try_from(take_u64(&mut payload)?).map_err(|_| malformed())?;
                let data = take(&mut payload, len)?;
                target.write(offset, &data)?;
            }
            OP_SET_LEN => {
                let len = take_u64(&mut payload)?;
                target.set_len(len)?;
            }
            _ => return Err(malformed()),
        }
    }
    Ok(())
}

/// One frame: header (magic, epoch, sequence number, payload length,
/// CRC-32 of those and the payload) and payload (the fuzz harness's; the
/// log seals its frames in place).
#[cfg(feature = "unstable-internals")]
pub(crate) fn encode_frame(epoch: u64, seq: u64, payload: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut frame = vec![0u8; HEADER];
    frame.extend_from_slice(payload);
    seal(&mut frame, epoch, seq)?;
    Ok(frame)
}

/// Fills the header of `frame`, whose first [`HEADER`] bytes are reserved
/// for it and the rest is the payload: the payload is never copied.
fn seal(frame: &mut [u8], epoch: u64, seq: u64) -> std::io::Result<()> {
    let (header, payload) = frame
        .split_at_mut_checked(HEADER)
        .ok_or_else(|| IoError::from(ErrorKind::InvalidInput))?;
    let len = u32::try_from(payload.len()).map_err(|_| IoError::from(ErrorKind::InvalidInput))?;
    let mut fields = Vec::with_capacity(HEADER);
    fields.extend_from_slice(MAGIC);
    fields.extend_from_slice(&epoch.to_le_bytes());
    fields.extend_from_slice(&seq.to_le_bytes());
    fields.extend_from_slice(&len.to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&fields);
    crc.update(payload);
    fields.extend_from_slice(&crc.finalize().to_le_bytes());
    header.copy_from_slice(&fields);
    Ok(())
}

/// The state's pending operations, with their frame's header reserved.
fn pending(s: &mut State) -> &mut Vec<u8> {
    if s.pending.is_empty() {
        s.pending.resize(HEADER, 0);
    }
    &mut s.pending
}

/// Appends a write of `data` at `offset` to a frame's payload.
pub(crate) fn encode_write(payload: &mut Vec<u8>, offset: u64, data: &[u8]) {
    payload.push(OP_WRITE);
    payload.extend_from_slice(&offset.to_le_bytes());
    payload.extend_from_slice(&(data.len() as u64).to_le_bytes());
    payload.extend_from_slice(data);
}

/// Appends a `set_len(len)` to a frame's payload.
pub(crate) fn encode_set_len(payload: &mut Vec<u8>, len: u64) {
    payload.push(OP_SET_LEN);
    payload.extend_from_slice(&len.to_le_bytes());
}

/// An epoch no frame left in the log has: above the last run's (0 when
/// none was readable) and the clock's nanoseconds.
fn next_epoch(last: u64) -> u64 {
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    last.wrapping_add(1).max(clock)
}

impl PageLog {
    /// Replays `log`'s current run into `file` (see [`replay`]), makes
    /// sure `log` is [`PAGE_LOG_BYTES`] long, and starts a new run.
    pub(super) fn open(
        file: Box<dyn StorageBackend>,
        log: Box<dyn StorageBackend>,
    ) -> Result<PageLog> {
        PageLog::with_capacity(file, log, PAGE_LOG_BYTES)
    }

    pub(super) fn with_capacity(
        file: Box<dyn StorageBackend>,
        log: Box<dyn StorageBackend>,
        capacity: u64,
    ) -> Result<PageLog> {
        let replayed = replay(&*log, &*file)?;
        let capacity = super::record_log::preallocate(&*log, capacity)?;
        let file_len = file.len()?;
        let paged = PageLog {
            file,
            log,
            capacity,
            syncing: Mutex::new(()),
            state: Mutex::new(State {
                len: file_len,
                file_len,
                zero_from: file_len,
                pages: Pages::default(),
                pending: Vec::new(),
                at: 0,
                epoch: replayed.epoch.unwrap_or(0),
                seq: 0,
            }),
        };
        {
            let mut s = paged.lock();
            paged.marker(&mut s)?;
        }
        Ok(paged)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fills `out` from the store file at `offset`: zeros at and past
    /// `valid` (its length, or a cut since the last checkpoint).
    fn read_file(&self, valid: u64, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let n = valid.saturating_sub(offset).min(out.len() as u64) as usize;
        let (head, tail) = out.split_at_mut(n);
        if !head.is_empty() {
            self.file.read(offset, head)?;
        }
        tail.fill(0);
        Ok(())
    }

    /// Appends an empty frame (a marker) as the run's next and syncs the log.
    fn frame(&self, s: &mut State) -> std::io::Result<()> {
        let mut at_seq = (s.at, s.epoch, s.seq);
        self.write_frame(&mut at_seq, &mut [0u8; HEADER])?;
        (s.at, s.seq) = (at_seq.0, at_seq.2);
        Ok(())
    }

    /// Seals `frame` (header reserved, then payload) as frame `(epoch, seq)`,
    /// writes it at `at` and syncs the log; on success `at` and `seq` move
    /// past it.
    fn write_frame(
        &self,
        (at, epoch, seq): &mut (u64, u64, u64),
        frame: &mut [u8],
    ) -> std::io::Result<()> {
        seal(frame, *epoch, *seq)?;
        self.log.write(*at, frame)?;
        self.log.sync_data()?;
        *at += frame.len() as u64;
        *seq += 1;
        Ok(())
    }

    /// A new run: its marker at the log's start, synced. Only once the
    /// store file holds everything the old run held.
    fn marker(&self, s: &mut State) -> std::io::Result<()> {
        s.epoch = next_epoch(s.epoch);
        s.seq = 0;
        s.at = 0;
        self.frame(s)
    }

    /// Every page image (and the pending writes) into the store file,
    /// synced; then a new run.
    fn checkpoint(&self, s: &mut State) -> std::io::Result<()> {
        if s.zero_from < s.file_len {
            self.file.set_len(s.zero_from)?;
        }
        if s.zero_from.min(s.file_len) != s.len {
            self.file.set_len(s.len)?;
        }
        for (at, page) in s.pages.in_order() {
            if at >= s.len {
                continue;
            }
            let n = (s.len - at).min(page.len() as u64) as usize;
            self.file.write(at, page.get(..n).unwrap_or_default())?;
        }
        self.file.sync_data()?;
        s.pages.clear();
        s.pending.clear();
        s.file_len = s.len;
        s.zero_from = s.len;
        self.marker(s)
    }
}

impl StorageBackend for PageLog {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.lock().len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let s = self.lock();
        if offset + out.len() as u64 > s.len {
            return Err(ErrorKind::UnexpectedEof.into());
        }
        let valid = s.file_len.min(s.zero_from);
        s.pages
            .read(offset, out, |at, to| self.read_file(valid, at, to))
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        let mut s = self.lock();
        if len < s.len {
            s.zero_from = s.zero_from.min(len);
            s.pages.cut(len);
        }
        s.len = len;
        encode_set_len(pending(&mut s), len);
        Ok(())
    }

    fn sync_data(&self) -> std::io::Result<()> {
        // One sync at a time; reads and writes go on meanwhile (the state
        // lock is not held while the frame is written and synced).
        let _syncing = self.syncing.lock().unwrap_or_else(|p| p.into_inner());
        let (mut frame, mut at_seq) = {
            let mut s = self.lock();
            if s.pending.is_empty() {
                return Ok(());
            }
            if s.at + s.pending.len() as u64 > self.capacity {
                return self.checkpoint(&mut s);
            }
            let frame = std::mem::take(&mut s.pending);
            (frame, (s.at, s.epoch, s.seq))
        };
        match self.write_frame(&mut at_seq, &mut frame) {
            Ok(()) => {
                let mut s = self.lock();
                (s.at, s.seq) = (at_seq.0, at_seq.2);
                Ok(())
            }
            Err(e) => {
                // Not durable: put back in front of anything written since,
                // so that a retried sync writes it again, in order.
                let mut s = self.lock();
                let later = std::mem::replace(&mut s.pending, frame);
                s.pending
                    .extend_from_slice(later.get(HEADER..).unwrap_or_default());
                Err(e)
            }
        }
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let mut s = self.lock();
        let valid = s.file_len.min(s.zero_from);
        s.pages
            .write(offset, data, |at, to| self.read_file(valid, at, to))?;
        s.len = s.len.max(offset + data.len() as u64);
        encode_write(pending(&mut s), offset, data);
        Ok(())
    }

    fn close(&self) -> std::io::Result<()> {
        let checkpointed = {
            let _syncing = self.syncing.lock().unwrap_or_else(|p| p.into_inner());
            let mut s = self.lock();
            self.checkpoint(&mut s)
        };
        let closed = self.file.close();
        checkpointed.and(closed)
    }

    fn try_lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<bool, BackendError> {
        self.file.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<bool, BackendError> {
        self.file.try_lock_shared_range(start, end)
    }

    fn lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<(), BackendError> {
        self.file.lock_range(start, end)
    }

    fn lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<(), BackendError> {
        self.file.lock_shared_range(start, end)
    }

    fn unlock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<(), BackendError> {
        self.file.unlock_range(start, end)
    }

    fn query_lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<bool, BackendError> {
        self.file.query_lock_range(start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::redb::{Database, ReadableDatabase, TableDefinition};
    use std::sync::Arc;

    const T: TableDefinition<u64, u64> = TableDefinition::new("t");

    /// A disk in memory: what was written (`live`) and what a power cut
    /// keeps (`durable`: the image at the last sync). A lying disk's syncs
    /// keep nothing; a tearing one keeps half of the last write after the
    /// last sync.
    #[derive(Debug, Default)]
    struct Disk {
        live: Vec<u8>,
        durable: Vec<u8>,
        /// The last write since the last sync, for a torn power cut.
        last: Option<(u64, Vec<u8>)>,
        lies: bool,
        /// The next sync fails (a full disk, an I/O error).
        fail_next_sync: bool,
    }

    #[derive(Clone, Debug, Default)]
    struct MemDisk(Arc<Mutex<Disk>>);

    impl MemDisk {
        fn lying() -> MemDisk {
            let d = MemDisk::default();
            d.0.lock().expect("disk").lies = true;
            d
        }

        /// The disk after a power cut: the durable image, and with `tear`
        /// the first half of the last unsynced write on top of it.
        fn power_cut(&self, tear: bool) -> MemDisk {
            let d = self.0.lock().expect("disk");
            let mut image = d.durable.clone();
            if tear && let Some((offset, data)) = &d.last {
                let half = data.get(..data.len() / 2).unwrap_or_default();
                let start = *offset as usize;
                if image.len() < start + half.len() {
                    image.resize(start + half.len(), 0);
                }
                if let Some(dst) = image.get_mut(start..start + half.len()) {
                    dst.copy_from_slice(half);
                }
            }
            MemDisk(Arc::new(Mutex::new(Disk {
                live: image.clone(),
                durable: image,
                last: None,
                lies: d.lies,
                fail_next_sync: false,
            })))
        }
    }

    impl StorageBackend for MemDisk {
        fn len(&self) -> std::io::Result<u64> {
            Ok(self.0.lock().expect("disk").live.len() as u64)
        }

        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            let d = self.0.lock().expect("disk");
            let start = offset as usize;
            let src = d
                .live
                .get(start..start + out.len())
                .ok_or_else(|| IoError::from(ErrorKind::UnexpectedEof))?;
            out.copy_from_slice(src);
            Ok(())
        }

        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.0.lock().expect("disk").live.resize(len as usize, 0);
            Ok(())
        }

        fn sync_data(&self) -> std::io::Result<()> {
            let mut d = self.0.lock().expect("disk");
            if std::mem::take(&mut d.fail_next_sync) {
                return Err(IoError::other("injected sync failure"));
            }
            if !d.lies {
                d.durable = d.live.clone();
            }
            d.last = None;
            Ok(())
        }

        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            let mut d = self.0.lock().expect("disk");
            let start = offset as usize;
            if d.live.len() < start + data.len() {
                d.live.resize(start + data.len(), 0);
            }
            if let Some(dst) = d.live.get_mut(start..start + data.len()) {
                dst.copy_from_slice(data);
            }
            d.last = Some((offset, data.to_vec()));
            Ok(())
        }
    }

    /// A small log, so that the runs below cross several checkpoints.
    const SMALL: u64 = 256 * 1024;

    fn open(file: &MemDisk, log: &MemDisk) -> Database {
        let paged = PageLog::with_capacity(Box::new(file.clone()), Box::new(log.clone()), SMALL)
            .expect("page log");
        Database::builder()
            .create_with_backend(paged)
            .expect("redb")
    }

    /// Commits `keys` one durable transaction each, every value 1 KiB-ish
    /// apart in the tree, and returns how many were acknowledged.
    fn commit_each(db: &Database, keys: std::ops::Range<u64>) -> u64 {
        let mut acked = 0;
        for k in keys {
            let txn = db.begin_write().expect("txn");
            {
                let mut t = txn.open_table(T).expect("table");
                t.insert(k, k * 7).expect("insert");
            }
            txn.commit().expect("commit");
            acked += 1;
        }
        acked
    }

    /// Keys `0..n` missing or wrong after a reopen.
    fn missing(db: &Database, n: u64) -> Vec<u64> {
        let txn = db.begin_read().expect("read");
        let Ok(t) = txn.open_table(T) else {
            return (0..n).collect();
        };
        (0..n)
            .filter(|&k| t.get(k).ok().flatten().map(|v| v.value()) != Some(k * 7))
            .collect()
    }

    /// Power cuts after 1 to 600 acknowledged commits (across checkpoints
    /// of a 256 KiB log), with and without a torn last write: every
    /// acknowledged commit is there after the replay.
    #[test]
    fn every_acknowledged_commit_survives_a_power_cut() {
        for (n, tear) in [(1, false), (7, true), (90, false), (333, true), (600, true)] {
            let (file, log) = (MemDisk::default(), MemDisk::default());
            let db = open(&file, &log);
            let acked = commit_each(&db, 0..n);
            // A commit that was never synced (redb's Durability::None):
            // allowed to be lost, never to damage what came before.
            let txn = db.begin_write().expect("txn");
            {
                let mut t = txn.open_table(T).expect("table");
                t.insert(u64::MAX, 1).expect("insert");
            }
            let mut txn = txn;
            txn.set_durability(::redb::Durability::None)
                .expect("durability");
            txn.commit().expect("commit");
            let (file, log) = (file.power_cut(tear), log.power_cut(tear));
            std::mem::forget(db); // the process is gone: no close
            let db = open(&file, &log);
            assert_eq!(
                missing(&db, acked),
                Vec::<u64>::new(),
                "after {n} commits, tear {tear}"
            );
            // And it goes on: more commits, a clean close, a reopen.
            commit_each(&db, acked..acked + 50);
            drop(db);
            let db = open(&file, &log);
            assert_eq!(missing(&db, acked + 50), Vec::<u64>::new());
        }
    }

    /// The same run on a disk whose log syncs keep nothing loses
    /// acknowledged commits (a log large enough that no checkpoint syncs
    /// the store file meanwhile): the test above can fail.
    #[test]
    fn a_lying_log_loses_acknowledged_commits() {
        let (file, log) = (MemDisk::default(), MemDisk::lying());
        let big = 8 << 20;
        let paged = PageLog::with_capacity(Box::new(file.clone()), Box::new(log.clone()), big)
            .expect("page log");
        let db = Database::builder()
            .create_with_backend(paged)
            .expect("redb");
        let acked = commit_each(&db, 0..40);
        let (file, log) = (file.power_cut(false), log.power_cut(false));
        std::mem::forget(db);
        let lost = PageLog::with_capacity(Box::new(file), Box::new(log), big)
            .map_err(|e| e.to_string())
            .and_then(|p| {
                Database::builder()
                    .create_with_backend(p)
                    .map_err(|e| e.to_string())
            })
            .map_or(acked as usize, |db| missing(&db, acked).len());
        assert_eq!(
            lost, acked as usize,
            "a lying log loses every commit since the last checkpoint"
        );
    }

    /// A clean close leaves everything in the store file: it opens as a
    /// plain redb file, with no log at all.
    #[test]
    fn a_clean_close_leaves_a_complete_store_file() {
        let (file, log) = (MemDisk::default(), MemDisk::default());
        let db = open(&file, &log);
        commit_each(&db, 0..120);
        drop(db);
        let plain = Database::builder()
            .create_with_backend(file.power_cut(false))
            .expect("plain redb");
        assert_eq!(missing(&plain, 120), Vec::<u64>::new());
    }

    /// A cut and a regrowth read zeros where the cut was, before and after
    /// a checkpoint, and the checkpointed file agrees.
    #[test]
    fn a_cut_file_reads_zeros_past_the_cut() {
        let (file, log) = (MemDisk::default(), MemDisk::default());
        let paged =
            PageLog::with_capacity(Box::new(file.clone()), Box::new(log), SMALL).expect("page log");
        paged.set_len(3 * 4096).expect("grow");
        paged.write(100, &[7u8; 9000]).expect("write");
        paged.sync_data().expect("sync");
        {
            let mut s = paged.lock();
            paged.checkpoint(&mut s).expect("checkpoint");
        }
        paged.set_len(4096 + 10).expect("cut");
        paged.set_len(3 * 4096).expect("regrow");
        let mut out = vec![1u8; 3 * 4096];
        paged.read(0, &mut out).expect("read");
        assert!(out.get(100..4106).expect("kept").iter().all(|&b| b == 7));
        assert!(out.get(4106..).expect("cut").iter().all(|&b| b == 0));
        paged.sync_data().expect("sync");
        {
            let mut s = paged.lock();
            paged.checkpoint(&mut s).expect("checkpoint");
        }
        let mut on_disk = vec![1u8; 3 * 4096];
        file.read(0, &mut on_disk).expect("file");
        assert_eq!(on_disk, out);
    }

    /// A sync that fails keeps what it held: the next sync writes it, in
    /// order before what came after, and the replay has both.
    #[test]
    fn a_failed_sync_keeps_its_writes_for_the_next() {
        let (file, log) = (MemDisk::default(), MemDisk::default());
        let paged =
            PageLog::with_capacity(Box::new(file), Box::new(log.clone()), SMALL).expect("page log");
        paged.set_len(8192).expect("len");
        paged.write(0, &[1u8; 100]).expect("write");
        log.0.lock().expect("disk").fail_next_sync = true;
        assert!(paged.sync_data().is_err());
        paged.write(50, &[2u8; 100]).expect("write");
        paged.sync_data().expect("sync");
        let target = MemDisk::default();
        assert_eq!(
            replay(&log.power_cut(false), &target)
                .expect("replay")
                .frames,
            1
        );
        let mut out = [0u8; 150];
        target.read(0, &mut out).expect("read");
        assert!(out.get(..50).expect("a").iter().all(|&b| b == 1));
        assert!(out.get(50..).expect("b").iter().all(|&b| b == 2));
    }

    /// Replay applies one run from its marker, in order, and stops at a
    /// frame that does not verify or belongs to another run.
    #[test]
    fn replay_stops_at_the_first_frame_that_does_not_follow() {
        let log = MemDisk::default();
        let file = MemDisk::default();
        let paged = PageLog::with_capacity(Box::new(file.clone()), Box::new(log.clone()), SMALL)
            .expect("page log");
        paged.set_len(8192).expect("len");
        paged.write(0, &[1u8; 100]).expect("write");
        paged.sync_data().expect("frame 1");
        paged.write(100, &[2u8; 100]).expect("write");
        paged.sync_data().expect("frame 2");
        let target = MemDisk::default();
        let r = replay(&log, &target).expect("replay");
        assert_eq!(r.frames, 2);
        let mut out = [0u8; 200];
        target.read(0, &mut out).expect("read");
        assert!(out.get(..100).expect("a").iter().all(|&b| b == 1));
        assert!(out.get(100..).expect("b").iter().all(|&b| b == 2));
        // Flip a byte of frame 2's payload: only frame 1 applies.
        let at = (HEADER + HEADER + 1 + 8 + 8 + 8 + 100 + HEADER + 20) as u64;
        let mut b = [0u8; 1];
        log.read(at, &mut b).expect("read");
        log.write(at, &[b[0] ^ 0xFF]).expect("flip");
        let target = MemDisk::default();
        assert_eq!(replay(&log, &target).expect("replay").frames, 1);
        // The store file itself was never written: frames only.
        assert_eq!(file.len().expect("len"), 0);
    }
}
