//! The write-ahead log: how a batch becomes durable with one small append
//! and one `fdatasync`, instead of one redb commit that rewrites every
//! B-tree page the batch touched.
//!
//! Why: idempotency keys are random, so every claim lands on its own leaf
//! page; a durable redb commit of a 60-request batch rewrote ~375 KiB
//! (copy-on-write leaves and branches) to store ~20 KiB of records, and the
//! disk's write bandwidth, not its fsync rate, set the ceiling. The log
//! writes what changed (the record bytes and index entries), nothing else.
//!
//! How (`Durability::Immediate`, the default):
//!
//! 1. The writer applies a batch in a redb write transaction as before, and
//!    [`Journal`] records each table write it makes.
//! 2. The journal goes to the log as one [`frame`](Wal::append) and the log
//!    is `fdatasync`ed; then the transaction commits with
//!    `redb::Durability::None` (in memory, no I/O). Callers are answered
//!    after both, so nothing is visible before it is durable.
//! 3. Every [`CHECKPOINT_INTERVAL`], or when the log is full
//!    ([`WAL_BYTES`]), a batch commits durably instead, and that commit
//!    also moves the *log epoch* (a meta entry) on. Frames carry the epoch
//!    they were written in, so one durable commit retires the whole log:
//!    no truncation, no second write.
//! 4. Opening a store replays, in order, the frames of the current epoch
//!    that verify (magic, epoch, length, CRC-32) up to the first that does
//!    not (a torn tail), then commits durably with a new epoch.
//!
//! Replay is a redo of table writes (put or remove a record, index entry or
//! meta entry, each with its full value), so replaying a prefix of frames
//! that is already in the file changes nothing. A frame is written only
//! after the previous one was synced, so a frame that does not verify ends
//! the log: nothing after it was ever acknowledged.
//!
//! Every write transaction outside the writer (the inbox, the CLI's evict
//! and import, `compact`) commits durably and moves the epoch on when the
//! log holds frames (see [`Shared::direct_commit`](super::Shared)), since
//! replaying older frames over its writes would undo them.
//!
//! Frame layout (all integers big-endian):
//!
//! ```text
//! magic "IDWL" (4) | epoch u64 (8) | payload length u32 (4) | crc32 u32 (4) | payload
//! payload: entries, each  tag u8 | len u32 | bytes [| len u32 | bytes]
//! ```
//!
//! The CRC covers the store's 16-byte id (not stored in the frame), magic,
//! epoch, length and payload: a log left beside another store (a store
//! file deleted and created again, a copy that mixed two stores' files)
//! never verifies, so it is never replayed into the wrong store.

use super::errors::engine;
use super::tables::{EXPIRY, META, META_WAL_EPOCH, RECORDS};
use crate::error::{Error, Result};
use ::redb::{StorageBackend, WriteTransaction};
use std::fmt;
use std::path::Path;
use std::time::{Duration, Instant};

/// Size of a store's write-ahead log file (`<file>-wal`): it is written
/// with zeros at creation (so appends never change the file's size or
/// allocation, and `fdatasync` has no metadata to write), then reused from
/// the start at every checkpoint. A batch whose changes do not fit in the
/// rest of the log is a checkpoint itself.
///
/// ```
/// assert_eq!(idemstore::WAL_BYTES, 8 << 20);
/// ```
pub const WAL_BYTES: u64 = 8 * 1024 * 1024;

/// Smallest log the builder accepts (`wal_bytes`): one small batch must fit.
///
/// ```
/// assert_eq!(idemstore::MIN_WAL_BYTES, 4096);
/// ```
pub const MIN_WAL_BYTES: u64 = 4096;

/// Longest time between durable commits of the store file while writes
/// are logged. It bounds the work of a replay after a crash and the memory
/// redb holds for commits that are only in the log.
///
/// ```
/// assert_eq!(idemstore::CHECKPOINT_INTERVAL.as_millis(), 500);
/// ```
pub const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(500);

const MAGIC: [u8; 4] = *b"IDWL";
const FRAME_HEADER: u64 = 20;

const TAG_RECORD_PUT: u8 = 1;
const TAG_RECORD_DEL: u8 = 2;
const TAG_INDEX_PUT: u8 = 3;
const TAG_INDEX_DEL: u8 = 4;
const TAG_META_PUT: u8 = 5;

/// The table writes of one batch, in the order they were made, already
/// laid out as a frame: the header's room comes first and is filled in by
/// [`Wal::append`], so the batch is never copied into a second buffer.
#[derive(Debug)]
pub(super) struct Journal {
    bytes: Vec<u8>,
}

impl Default for Journal {
    fn default() -> Journal {
        Journal {
            bytes: vec![0; FRAME_HEADER as usize],
        }
    }
}

impl Journal {
    pub(super) fn record_put(&mut self, key: &[u8], value: &[u8]) {
        self.entry(TAG_RECORD_PUT, key, Some(value));
    }
    pub(super) fn record_del(&mut self, key: &[u8]) {
        self.entry(TAG_RECORD_DEL, key, None);
    }
    pub(super) fn index_put(&mut self, index_key: &[u8]) {
        self.entry(TAG_INDEX_PUT, index_key, None);
    }
    pub(super) fn index_del(&mut self, index_key: &[u8]) {
        self.entry(TAG_INDEX_DEL, index_key, None);
    }
    pub(super) fn meta_put(&mut self, name: &str, value: &[u8]) {
        self.entry(TAG_META_PUT, name.as_bytes(), Some(value));
    }

    /// Bytes recorded so far (the payload, without the header's room).
    pub(super) fn len(&self) -> usize {
        self.bytes.len() - FRAME_HEADER as usize
    }

    /// Fills in the header for `store_id` and `epoch` and returns the frame.
    fn seal(&mut self, store_id: &[u8; 16], epoch: u64) -> Result<&[u8]> {
        let len = u32::try_from(self.len())
            .map_err(|_| Error::backend("a write batch too large for the log"))?;
        let (header, payload) = self.bytes.split_at_mut(FRAME_HEADER as usize);
        let (fixed, crc_field) = header.split_at_mut(16);
        fixed.copy_from_slice(&[&MAGIC[..], &epoch.to_be_bytes(), &len.to_be_bytes()].concat());
        let mut crc = crc32fast::Hasher::new();
        crc.update(store_id);
        crc.update(fixed);
        crc.update(payload);
        crc_field.copy_from_slice(&crc.finalize().to_be_bytes());
        Ok(&self.bytes)
    }

    fn entry(&mut self, tag: u8, a: &[u8], b: Option<&[u8]>) {
        self.bytes.push(tag);
        // Keys and values are bounded far below 4 GiB (Key and Response
        // limits), so the length always fits.
        self.bytes
            .extend_from_slice(&u32::try_from(a.len()).unwrap_or(u32::MAX).to_be_bytes());
        self.bytes.extend_from_slice(a);
        if let Some(b) = b {
            self.bytes
                .extend_from_slice(&u32::try_from(b.len()).unwrap_or(u32::MAX).to_be_bytes());
            self.bytes.extend_from_slice(b);
        }
    }
}

/// The log file and where the next frame goes.
pub(super) struct Wal {
    file: Box<dyn StorageBackend>,
    /// The epoch of the durable state: frames of this epoch are replayed.
    epoch: u64,
    /// Where the next frame is written.
    offset: u64,
    last_checkpoint: Instant,
    interval: Duration,
    /// The file's size: frames go below it.
    capacity: u64,
    /// Every frame's CRC covers it, so no other store's frames verify here.
    store_id: [u8; 16],
}

impl fmt::Debug for Wal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wal")
            .field("epoch", &self.epoch)
            .field("offset", &self.offset)
            .finish_non_exhaustive()
    }
}

impl Wal {
    /// A log whose durable epoch is `epoch` and which holds no frame of it.
    pub(super) fn new(
        file: Box<dyn StorageBackend>,
        store_id: [u8; 16],
        epoch: u64,
        interval: Duration,
        capacity: u64,
    ) -> Wal {
        Wal {
            file,
            epoch,
            offset: 0,
            last_checkpoint: Instant::now(),
            interval,
            capacity,
            store_id,
        }
    }

    /// Frames were written since the last durable commit.
    pub(super) fn is_dirty(&self) -> bool {
        self.offset > 0
    }

    /// A batch with this much journal must commit durably instead: the log
    /// is full, or the last durable commit is too long ago.
    pub(super) fn needs_checkpoint(&self, journal_bytes: usize) -> bool {
        self.offset + FRAME_HEADER + journal_bytes as u64 > self.capacity
            || self.checkpoint_wait() == Some(Duration::ZERO)
    }

    /// How long the idle writer may wait before it must checkpoint; `None`
    /// when the log holds no frame.
    pub(super) fn checkpoint_wait(&self) -> Option<Duration> {
        self.is_dirty()
            .then(|| self.interval.saturating_sub(self.last_checkpoint.elapsed()))
    }

    /// The epoch the next durable commit must store (in the same
    /// transaction) to retire the frames written so far.
    pub(super) fn next_epoch(&self) -> u64 {
        self.epoch.wrapping_add(1)
    }

    /// Writes the epoch that retires the current frames into `txn`.
    pub(super) fn stamp(&self, txn: &WriteTransaction) -> Result<()> {
        let mut meta = txn.open_table(META).map_err(engine)?;
        meta.insert(META_WAL_EPOCH, self.next_epoch().to_be_bytes().as_slice())
            .map_err(engine)?;
        Ok(())
    }

    /// A durable commit that carried [`stamp`](Self::stamp) succeeded: the
    /// log starts over.
    pub(super) fn checkpointed(&mut self) {
        self.epoch = self.next_epoch();
        self.offset = 0;
        self.last_checkpoint = Instant::now();
    }

    /// Appends `journal` as one frame and makes it durable. An error leaves
    /// the frame's fate unknown: the caller must not commit the batch and
    /// must poison the store.
    pub(super) fn append(&mut self, journal: &mut Journal) -> Result<()> {
        let frame = journal.seal(&self.store_id, self.epoch)?;
        self.file.write(self.offset, frame).map_err(Error::Io)?;
        self.file.sync_data().map_err(Error::Io)?;
        self.offset += frame.len() as u64;
        Ok(())
    }
}

/// Makes sure the log file is `capacity` bytes long, writing zeros over
/// any part that is missing (a new file, or one cut short), and syncs it.
/// Returns the size frames may use: `capacity`, or more if the file is
/// already larger (a log made with a larger `wal_bytes`).
pub(super) fn preallocate(file: &dyn StorageBackend, capacity: u64) -> Result<u64> {
    let len = file.len().map_err(Error::Io)?;
    if len >= capacity {
        return Ok(len);
    }
    // Grown first (some backends write only within their length), then
    // written: a sparse tail would make every later append allocate blocks,
    // and each fdatasync write that metadata too.
    file.set_len(capacity).map_err(Error::Io)?;
    const CHUNK: usize = 1024 * 1024;
    let zeros = vec![0u8; CHUNK];
    let mut at = len;
    while at < capacity {
        let n = (capacity - at).min(CHUNK as u64) as usize;
        file.write(at, zeros.get(..n).unwrap_or_default())
            .map_err(Error::Io)?;
        at += n as u64;
    }
    file.sync_data().map_err(Error::Io)?;
    Ok(capacity)
}

/// Replays into `txn` every frame of `epoch` from the start of the log up
/// to the first that does not verify. Returns how many frames it applied.
///
/// A frame that verifies but whose payload does not decode is damage no
/// crash can cause: that is [`Error::Corrupt`], and nothing is committed.
pub(super) fn replay(
    file: &dyn StorageBackend,
    store_id: &[u8; 16],
    epoch: u64,
    txn: &WriteTransaction,
) -> Result<u64> {
    let len = file.len().map_err(Error::Io)?;
    let mut at = 0u64;
    let mut frames = 0u64;
    let mut records = txn.open_table(RECORDS).map_err(engine)?;
    let mut expiry = txn.open_table(EXPIRY).map_err(engine)?;
    let mut meta = txn.open_table(META).map_err(engine)?;
    loop {
        let (payload, next) = match read_frame(file, store_id, epoch, at, len)? {
            Frame::Whole { payload, next } => (payload, next),
            Frame::End => break,
            Frame::Damaged { next } => {
                // A frame is written only once the one before it is synced,
                // so a crash damages the last frame only. One that fails its
                // checksum with a whole frame after it is damage to synced
                // data: stopping here would drop acknowledged writes.
                if matches!(
                    read_frame(file, store_id, epoch, next, len)?,
                    Frame::Whole { .. }
                ) {
                    return Err(Error::corrupt(
                        None,
                        format!(
                            "write-ahead log frame at offset {at} fails its checksum, but the frame \
                             after it verifies: the log is damaged, and replaying only up to it \
                             would lose acknowledged writes"
                        ),
                    ));
                }
                break;
            }
        };
        let damaged = |detail: &str| {
            Error::corrupt(
                None,
                format!("write-ahead log frame at offset {at} verifies but {detail}"),
            )
        };
        let mut cursor = payload.as_slice();
        while let Some((&tag, rest)) = cursor.split_first() {
            cursor = rest;
            let a = take(&mut cursor).ok_or_else(|| damaged("an entry is cut short"))?;
            match tag {
                TAG_RECORD_PUT => {
                    let b = take(&mut cursor).ok_or_else(|| damaged("an entry is cut short"))?;
                    records.insert(a, b).map_err(engine)?;
                }
                TAG_RECORD_DEL => {
                    records.remove(a).map_err(engine)?;
                }
                TAG_INDEX_PUT => {
                    expiry.insert(a, ()).map_err(engine)?;
                }
                TAG_INDEX_DEL => {
                    expiry.remove(a).map_err(engine)?;
                }
                TAG_META_PUT => {
                    let b = take(&mut cursor).ok_or_else(|| damaged("an entry is cut short"))?;
                    let name =
                        std::str::from_utf8(a).map_err(|_| damaged("a meta name is not UTF-8"))?;
                    meta.insert(name, b).map_err(engine)?;
                }
                other => return Err(damaged(&format!("has an unknown entry tag {other}"))),
            }
        }
        frames += 1;
        at = next;
    }
    Ok(frames)
}

/// What lies at one offset of the log.
enum Frame {
    /// A frame of the current epoch that verifies; the next starts at `next`.
    Whole { payload: Vec<u8>, next: u64 },
    /// A frame header of the current epoch whose checksum fails (torn by a
    /// crash, or damaged); where the next frame would start.
    Damaged { next: u64 },
    /// Anything else: zeros, an older epoch's bytes, a cut-off header.
    End,
}

fn read_frame(
    file: &dyn StorageBackend,
    store_id: &[u8; 16],
    epoch: u64,
    at: u64,
    len: u64,
) -> Result<Frame> {
    if at + FRAME_HEADER > len {
        return Ok(Frame::End);
    }
    let mut header = [0u8; FRAME_HEADER as usize];
    file.read(at, &mut header).map_err(Error::Io)?;
    let (magic, rest) = header.split_at(4);
    let (frame_epoch, rest) = rest.split_at(8);
    let (payload_len, crc) = rest.split_at(4);
    let frame_epoch = u64::from_be_bytes(frame_epoch.try_into().unwrap_or_default());
    let payload_len = u64::from(u32::from_be_bytes(
        payload_len.try_into().unwrap_or_default(),
    ));
    let next = at + FRAME_HEADER + payload_len;
    if magic != MAGIC || frame_epoch != epoch || next > len {
        return Ok(Frame::End);
    }
    let mut payload = vec![0u8; payload_len as usize];
    file.read(at + FRAME_HEADER, &mut payload)
        .map_err(Error::Io)?;
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(store_id);
    hasher.update(header.get(..16).unwrap_or_default());
    hasher.update(&payload);
    if hasher.finalize().to_be_bytes() != crc {
        return Ok(Frame::Damaged { next });
    }
    Ok(Frame::Whole { payload, next })
}

/// Splits a `len u32 | bytes` field off the front of `cursor`.
fn take<'a>(cursor: &mut &'a [u8]) -> Option<&'a [u8]> {
    let (len, rest) = cursor.split_first_chunk::<4>()?;
    let len = u32::from_be_bytes(*len) as usize;
    if rest.len() < len {
        return None;
    }
    let (bytes, rest) = rest.split_at(len);
    *cursor = rest;
    Some(bytes)
}

/// The log's path beside the store file: `<name>-wal`.
pub(super) fn wal_path(store: &Path) -> std::path::PathBuf {
    let mut name = store.file_name().unwrap_or_default().to_os_string();
    name.push("-wal");
    store.with_file_name(name)
}

/// The log on a real file: positional reads and writes, `fdatasync`. The
/// store file's lock (taken first) is what keeps a second process out.
#[derive(Debug)]
pub(super) struct FileLog {
    file: std::fs::File,
}

impl FileLog {
    /// Opens (creating, mode 0600) the log beside `store`, making a new
    /// directory entry durable.
    pub(super) fn open(store: &Path) -> Result<FileLog> {
        let path = wal_path(store);
        let existed = path.exists();
        let file = super::open::open_owner_only(&path)?;
        if !existed {
            file.sync_all()?;
            super::open::sync_parent(&path)?;
        }
        Ok(FileLog { file })
    }
}

impl StorageBackend for FileLog {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        #[cfg(unix)]
        {
            std::os::unix::fs::FileExt::read_exact_at(&self.file, out, offset)
        }
        #[cfg(windows)]
        {
            let mut done = 0;
            while let Some(rest) = out.get_mut(done..).filter(|r| !r.is_empty()) {
                let n = std::os::windows::fs::FileExt::seek_read(
                    &self.file,
                    rest,
                    offset + done as u64,
                )?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                done += n;
            }
            Ok(())
        }
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.file.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        #[cfg(unix)]
        {
            std::os::unix::fs::FileExt::write_all_at(&self.file, data, offset)
        }
        #[cfg(windows)]
        {
            let mut done = 0;
            while let Some(rest) = data.get(done..).filter(|r| !r.is_empty()) {
                let n = std::os::windows::fs::FileExt::seek_write(
                    &self.file,
                    rest,
                    offset + done as u64,
                )?;
                if n == 0 {
                    return Err(std::io::ErrorKind::WriteZero.into());
                }
                done += n;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_splits_length_prefixed_fields_and_refuses_short_ones() {
        let mut j = Journal::default();
        j.record_put(b"k", b"value");
        let bytes = j.bytes.clone();
        let mut cursor = bytes.get(FRAME_HEADER as usize + 1..).unwrap();
        assert_eq!(take(&mut cursor), Some(&b"k"[..]));
        assert_eq!(take(&mut cursor), Some(&b"value"[..]));
        assert!(cursor.is_empty());
        let mut short: &[u8] = &[0, 0, 0, 9, 1, 2];
        assert_eq!(take(&mut short), None);
    }

    #[test]
    fn frames_verify_only_whole_in_their_epoch_and_for_their_store() {
        let mut j = Journal::default();
        j.record_del(b"k");
        let id = [1; 16];
        let frame = j.seal(&id, 7).unwrap().to_vec();
        assert_eq!(frame.len() as u64, FRAME_HEADER + 6);
        assert_eq!(frame.get(..4), Some(&MAGIC[..]));
        let file = ::redb::backends::InMemoryBackend::new();
        file.set_len(64).unwrap();
        file.write(0, &frame).unwrap();
        let read = |id: &[u8; 16], epoch| read_frame(&file, id, epoch, 0, 64).unwrap();
        assert!(
            matches!(read(&id, 7), Frame::Whole { payload, next: 26 } if payload == b"\x02\0\0\0\x01k")
        );
        assert!(matches!(read(&id, 8), Frame::End));
        assert!(matches!(read(&[2; 16], 7), Frame::Damaged { next: 26 }));
        // Cut short: the frame runs past the end of the file.
        assert!(matches!(
            read_frame(&file, &id, 7, 0, 25).unwrap(),
            Frame::End
        ));
    }

    #[test]
    fn the_log_sits_beside_the_store() {
        assert_eq!(
            wal_path(Path::new("/srv/orders.idem")),
            Path::new("/srv/orders.idem-wal")
        );
    }
}
