//! The write-ahead log: how a group becomes durable with one small append
//! and one `fdatasync`, instead of one redb commit that rewrites every
//! B-tree page the group touched.
//!
//! Why: idempotency keys are random, so every claim lands on its own leaf
//! page; a durable redb commit of a 60-request batch rewrote ~375 KiB
//! (copy-on-write leaves and branches) to store ~20 KiB of records, and the
//! disk's write bandwidth, not its fsync rate, set the ceiling. The log
//! writes what changed (the records), nothing else; the B-tree pages are
//! written by checkpoints, where many records share each commit.
//!
//! How (`Durability::Immediate`, the default; see `commit.rs` and
//! `checkpoint.rs` for the two sides):
//!
//! 1. A group's leader decides its requests and records each record put or
//!    delete, and the new fencing-token high-water mark, in a [`Journal`].
//! 2. The journal goes to the log as one [`frame`](Wal::append), on a
//!    [`FRAME_ALIGN`] boundary, and the log is `fdatasync`ed; only then are
//!    the records published to the memtable and the callers answered, so
//!    nothing is visible before it is durable.
//! 3. The file is two segments. Frames of epoch `e` go to segment `e % 2`.
//!    When the memtable is handed to the checkpointer (its segment is
//!    full, it is larger than [`MEMTABLE_BYTES`](super::MEMTABLE_BYTES),
//!    or older than [`CHECKPOINT_INTERVAL`]), the log moves to epoch `e + 1`
//!    in the other segment, and commits go on there while the checkpoint
//!    writes epoch `e`'s records into redb. The checkpoint's durable commit
//!    stores `e + 1` as the durable epoch (a meta entry): that one commit
//!    retires every frame of `e`, with no truncation and no second write.
//!    A segment is written again only after the epoch it held is retired
//!    (a new freeze waits for the running checkpoint).
//! 4. Opening a store replays the frames of the durable epoch `E` (segment
//!    `E % 2`) and then of `E + 1` (the other), each from the start of its
//!    segment, commits durably, and starts writing epoch `E + 2`.
//!
//! Replay is a redo (put or remove a record with its full value, moving
//! its expiry-index entry; set a meta entry), so replaying frames whose
//! records are already in the file changes nothing. What replay does at
//! each offset ([`walk`]):
//!
//! - a frame of this epoch that verifies: applied.
//! - anything else (zeros, another magic, an older epoch's bytes, a header
//!   cut short, a length running past the segment, a frame of this epoch
//!   whose CRC-32 fails): the end of the epoch's frames, unless a later
//!   block of the segment holds a frame of this epoch that verifies. A
//!   frame is written only after the previous one was synced, so a crash
//!   can damage only the last frame written and leaves nothing after it:
//!   a verifying frame after the stop means the stop is damage, and the
//!   open fails with [`Error::Corrupt`] naming both offsets.
//! - a damaged last frame of one block, when the machine has not restarted
//!   since the open that wrote it (a process crash, which writes such a
//!   frame whole or not at all): [`Error::Corrupt`]. After a reboot it is
//!   a write torn by a power cut: the end.
//! - a frame that verifies but whose payload does not decode (an entry cut
//!   short, an unknown tag, a record that does not decode): damage no
//!   crash can cause; the open fails with [`Error::Corrupt`] and nothing
//!   is committed.
//!
//! With [`accept_loss`](super::RedbStoreBuilder::accept_loss) each
//! `Corrupt` but the last becomes a skip: replay goes on at the next frame
//! that verifies, and the [`LossReport`] says what was skipped.
//!
//! Because a frame starts on a fresh 4 KiB block, an append never writes a
//! sector holding acknowledged bytes: a device that tears a sector into
//! garbage during a power cut can damage only the frame being written.
//!
//! Every write transaction outside the line (the inbox, the admin evict
//! and import, `compact`, a group too large for a segment) first takes in
//! the memtable and then moves the epoch on (see
//! [`Shared::direct`](super::Shared)), since replaying older frames over
//! its writes would undo them.
//!
//! A format-2 log (before this layout) is one region of back-to-back
//! frames that also carry index entries; it is replayed as such once, at
//! the open that upgrades the store to format 3.
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
use super::loss::LossReport;
use super::tables::{META, WriteTables};
use crate::error::{Error, Result};
use ::redb::{StorageBackend, WriteTransaction};
use std::fmt;
use std::ops::ControlFlow;
use std::path::Path;
use std::time::Duration;

/// Size of a store's write-ahead log file (`<file>-wal`): two segments of
/// half this size each. It is written with zeros at creation (so appends
/// never change the file's size or allocation, and `fdatasync` has no
/// metadata to write), then each segment is reused from its start once the
/// checkpoint of the frames it held is durable. A group's frame takes whole
/// [`FRAME_ALIGN`] blocks; a group too large for a whole segment commits
/// straight into the store file (durably) instead.
///
/// ```
/// assert_eq!(idemstore::redb::WAL_BYTES, 8 << 20);
/// ```
pub const WAL_BYTES: u64 = 8 * 1024 * 1024;

/// Smallest log the builder accepts (`wal_bytes`): two segments of two
/// aligned blocks each.
///
/// ```
/// assert_eq!(idemstore::redb::MIN_WAL_BYTES, 4 * idemstore::redb::FRAME_ALIGN);
/// ```
pub const MIN_WAL_BYTES: u64 = 4 * FRAME_ALIGN;

/// Longest time a logged write stays only in the memtable and the log
/// before the background checkpointer starts writing it into the store
/// file (an idle store is checkpointed too). It bounds the work of a
/// replay after a crash.
///
/// ```
/// assert_eq!(idemstore::redb::CHECKPOINT_INTERVAL.as_millis(), 500);
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

/// Every frame starts on a multiple of this many bytes from the start of
/// its segment (the previous frame's last block is left padded), so an
/// append never writes a sector that holds acknowledged bytes: a device
/// that tears a sector into garbage during a power cut can only damage the
/// frame being written, never one already acknowledged.
///
/// ```
/// assert_eq!(idemstore::redb::FRAME_ALIGN, 4096);
/// ```
pub const FRAME_ALIGN: u64 = 4096;

/// Rounds `n` up to the next multiple of [`FRAME_ALIGN`].
pub(super) fn align_up(n: u64) -> u64 {
    n.div_ceil(FRAME_ALIGN) * FRAME_ALIGN
}

/// The size of each of the log's two segments for a log file of `len`
/// bytes: half of it, in whole aligned blocks.
pub(super) fn segment_bytes(len: u64) -> u64 {
    len / 2 / FRAME_ALIGN * FRAME_ALIGN
}

/// Where the frames of `epoch` live: segment `epoch % 2`.
pub(super) fn segment_range(len: u64, epoch: u64) -> std::ops::Range<u64> {
    let seg = segment_bytes(len);
    let start = (epoch % 2) * seg;
    start..start + seg
}

/// The log file and where the next frame goes.
///
/// The file is two segments. The frames of epoch `e` go to segment
/// `e % 2`: while a checkpoint writes the frozen memtable (whose frames are
/// in one segment) into redb, new groups append to the other segment. The
/// durable epoch stored in redb (`META_WAL_EPOCH`) is the oldest epoch
/// whose frames are not all in redb yet; at most it and the next one hold
/// live frames, and a segment is reused only after the checkpoint that
/// retires its epoch is durable.
pub(super) struct Wal {
    file: std::sync::Arc<dyn StorageBackend>,
    /// The epoch new frames are written in.
    epoch: u64,
    /// Where the next frame goes, from the start of the epoch's segment.
    offset: u64,
    /// The file's size when opened: it fixes the segments.
    len: u64,
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
    /// A log whose next frames are of `epoch`, from the start of its segment.
    pub(super) fn new(
        file: std::sync::Arc<dyn StorageBackend>,
        store_id: [u8; 16],
        epoch: u64,
        len: u64,
    ) -> Wal {
        Wal {
            file,
            epoch,
            offset: 0,
            len,
            store_id,
        }
    }

    /// The log file (the background thread syncs it under relaxed durability).
    pub(super) fn file(&self) -> std::sync::Arc<dyn StorageBackend> {
        std::sync::Arc::clone(&self.file)
    }

    /// The epoch new frames are written in.
    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How full the current epoch's segment is, 0..=1 (a metric).
    pub(super) fn fill(&self) -> f64 {
        let segment = segment_bytes(self.len);
        if segment == 0 {
            return 0.0;
        }
        self.offset as f64 / segment as f64
    }

    /// Frames were written in the current epoch.
    pub(super) fn is_dirty(&self) -> bool {
        self.offset > 0
    }

    /// A frame with this much journal fits in what is left of the segment.
    pub(super) fn fits(&self, journal_bytes: usize) -> bool {
        self.offset + align_up(FRAME_HEADER + journal_bytes as u64) <= segment_bytes(self.len)
    }

    /// A frame with this much journal fits in an empty segment.
    pub(super) fn fits_at_all(&self, journal_bytes: usize) -> bool {
        align_up(FRAME_HEADER + journal_bytes as u64) <= segment_bytes(self.len)
    }

    /// The current epoch's frames are all durable elsewhere (a checkpoint
    /// took them, or will before it retires them): new frames go to the
    /// next epoch, in the other segment.
    pub(super) fn rotate(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        self.offset = 0;
    }

    /// Appends `journal` as one frame, on an aligned offset, and makes it
    /// durable when `sync`. An error leaves the frame's fate unknown: the
    /// caller must not publish the group and must poison the store.
    pub(super) fn append(&mut self, journal: &mut Journal, sync: bool) -> Result<()> {
        let start = segment_range(self.len, self.epoch).start + self.offset;
        let frame = journal.seal(&self.store_id, self.epoch)?;
        let framed = align_up(frame.len() as u64);
        self.file.write(start, frame).map_err(Error::Io)?;
        if sync {
            self.file.sync_data().map_err(Error::Io)?;
        }
        self.offset += framed;
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

/// How the frames of one epoch are laid out in the file.
#[derive(Clone, Debug)]
pub(super) struct Layout {
    /// The bytes the epoch's frames may occupy.
    pub(super) region: std::ops::Range<u64>,
    /// Frames start at multiples of this from `region.start` (1 for a
    /// format-2 log, whose frames follow each other with no padding).
    pub(super) align: u64,
}

impl Layout {
    /// A format-2 log: one region, the whole file, frames back to back.
    pub(super) fn v2(len: u64) -> Layout {
        Layout {
            region: 0..len,
            align: 1,
        }
    }

    /// This format's log: `epoch`'s segment, aligned frames.
    pub(super) fn segment(len: u64, epoch: u64) -> Layout {
        Layout {
            region: segment_range(len, epoch),
            align: FRAME_ALIGN,
        }
    }
}

/// What replay does with a whole frame's payload: writes its entries into
/// `txn` (hand it to [`walk`] as `on_frame`). A record put or delete also
/// moves the record's expiry-index entry (the old expiry is read from the
/// record it replaces), so the frames need not carry index entries; a
/// format-2 frame's explicit index entries are applied as they are, which
/// agrees. A frame that verifies but whose payload does not decode is
/// damage no crash can cause: [`Error::Corrupt`], and the caller commits
/// nothing.
pub(super) fn applier<'t>(
    txn: &'t WriteTransaction,
) -> Result<impl FnMut(u64, &[u8]) -> Result<()> + 't> {
    let mut tables = WriteTables::open(txn)?;
    let mut meta = txn.open_table(META).map_err(engine)?;
    Ok(move |at, payload: &[u8]| {
        entries(at, payload, |entry| match entry {
            Entry::Put(key, value, expires_at) => {
                tables.apply_encoded(key, Some((value, expires_at)))
            }
            Entry::Del(key) => tables.apply_encoded(key, None),
            // Format 2 wrote index entries explicitly; apply_encoded
            // already made the same moves, so these change nothing.
            Entry::IndexPut(entry) => tables.index(entry),
            Entry::IndexDel(entry) => tables.unindex(entry),
            Entry::Meta(name, value) => meta.insert(name, value).map(|_| ()).map_err(engine),
        })
    })
}

/// Walks every frame of `epoch` laid out as `layout`, from the start of
/// its region to the end of the log or a torn last frame (the module docs
/// say what ends the log and what is refused), handing each whole frame's
/// payload and offset to `on_frame` ([`applier`] for a replay), and returns
/// how many it handed over.
///
/// `no_reboot`: the machine has not restarted since the open that wrote
/// these frames (the same boot id), so the stop was a process crash, not a
/// power loss. A killed process's write of a frame that fits in one
/// [`FRAME_ALIGN`] block lands whole or not at all (the kernel copies a
/// write into the page cache a page at a time, and a fatal signal is
/// noticed between pages), so such a last frame that fails its checksum
/// was damaged after it was written, maybe after it was acknowledged:
/// [`Error::Corrupt`] rather than a silent end. A longer last frame may
/// have been cut between pages by the kill, and stays a torn tail.
///
/// With `loss` (an open that accepts loss, or a check), each `Corrupt` of
/// the stop rules is written down there instead and the walk goes on at
/// the next frame that verifies.
pub(super) fn walk(
    file: &dyn StorageBackend,
    store_id: &[u8; 16],
    epoch: u64,
    layout: &Layout,
    no_reboot: bool,
    mut loss: Option<&mut LossReport>,
    mut on_frame: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<u64> {
    let end = layout.region.end.min(file.len().map_err(Error::Io)?);
    let mut at = layout.region.start;
    let mut frames = 0u64;
    let next_start = |next: u64| {
        let from = next - layout.region.start;
        layout.region.start + from.div_ceil(layout.align) * layout.align
    };
    loop {
        let (payload, next) = match read_frame(file, store_id, epoch, at, end)? {
            Frame::Whole { payload, next } => (payload, next_start(next)),
            stop => {
                // Where the frames of this epoch stop. A frame is written
                // only once the one before it is synced, so a crash can
                // damage the last frame only: a frame that verifies after
                // the stop means the stop is damage to synced data, and
                // replaying only up to it would drop acknowledged writes.
                let (what, damaged_end) = match stop {
                    Frame::Damaged { next } => ("fails its checksum", Some(next)),
                    _ => ("ends", None),
                };
                let later = find_later(file, store_id, epoch, layout, at, end)?;
                // After a process crash (no reboot), a last frame of one
                // block cannot have been torn (see the docs above).
                let damaged_last = later.is_none()
                    && no_reboot
                    && layout.align >= FRAME_ALIGN
                    && damaged_end.is_some_and(|next| next - at <= FRAME_ALIGN);
                if later.is_none() && !damaged_last {
                    break;
                }
                let Some(loss) = loss.as_deref_mut() else {
                    return Err(match later {
                        Some(x) => Error::corrupt(
                            None,
                            format!(
                                "the write-ahead log {what} at offset {at}, but a later frame of \
                                 the same epoch at offset {x} verifies: the log is damaged, and \
                                 replaying only up to offset {at} would lose acknowledged writes"
                            ),
                        ),
                        None => Error::corrupt(
                            None,
                            format!(
                                "the last write-ahead log frame, at offset {at}, fails its \
                                 checksum, and the machine has not restarted since the store was \
                                 opened: no power loss can have torn it, and a process killed \
                                 while writing a frame of one block leaves it whole or absent. \
                                 It was damaged after it was written and may hold acknowledged \
                                 writes"
                            ),
                        ),
                    });
                };
                loss.frames_skipped += 1;
                if let Some(next) = damaged_end {
                    loss.keys_possibly_lost
                        .extend(keys_in(file, at + FRAME_HEADER, next.min(end)));
                }
                match later {
                    Some(x) => {
                        loss.findings.push(format!(
                            "epoch {epoch}: the log {what} at offset {at}, but a later frame of \
                             the same epoch verifies at offset {x}: damage (with accept_loss, \
                             the bytes between are skipped and replay goes on)"
                        ));
                        at = x;
                        continue;
                    }
                    None => {
                        loss.findings.push(format!(
                            "epoch {epoch}: the last frame, at offset {at}, fails its checksum \
                             with no reboot since it was written: damage, not a torn write \
                             (with accept_loss, it is skipped)"
                        ));
                        break;
                    }
                }
            }
        };
        on_frame(at, &payload)?;
        frames += 1;
        at = next;
    }
    Ok(frames)
}

/// One entry of a frame's payload.
pub(super) enum Entry<'a> {
    /// A record put: stored key, stored value, the record's expiry.
    Put(&'a [u8], &'a [u8], crate::time::Timestamp),
    /// A record delete.
    Del(&'a [u8]),
    /// A format-2 explicit index put.
    IndexPut(&'a [u8]),
    /// A format-2 explicit index delete.
    IndexDel(&'a [u8]),
    /// A meta entry.
    Meta(&'a str, &'a [u8]),
}

/// Parses the payload of the frame at `at` (which verified) into entries,
/// in order. An entry cut short, an unknown tag, a record that does not
/// decode or a meta name that is not UTF-8 is damage no crash can cause:
/// [`Error::Corrupt`].
pub(super) fn entries<'a>(
    at: u64,
    payload: &'a [u8],
    mut f: impl FnMut(Entry<'a>) -> Result<()>,
) -> Result<()> {
    let damaged = |detail: &str| {
        Error::corrupt(
            None,
            format!("write-ahead log frame at offset {at} verifies but {detail}"),
        )
    };
    let mut cursor = payload;
    while let Some((&tag, rest)) = cursor.split_first() {
        cursor = rest;
        let a = take(&mut cursor).ok_or_else(|| damaged("an entry is cut short"))?;
        match tag {
            TAG_RECORD_PUT => {
                let b = take(&mut cursor).ok_or_else(|| damaged("an entry is cut short"))?;
                let expires_at = crate::codec::decode_record(a, b)
                    .map_err(|_| damaged("holds a record that does not decode"))?
                    .expires_at;
                f(Entry::Put(a, b, expires_at))?;
            }
            TAG_RECORD_DEL => f(Entry::Del(a))?,
            TAG_INDEX_PUT => f(Entry::IndexPut(a))?,
            TAG_INDEX_DEL => f(Entry::IndexDel(a))?,
            TAG_META_PUT => {
                let b = take(&mut cursor).ok_or_else(|| damaged("an entry is cut short"))?;
                let name =
                    std::str::from_utf8(a).map_err(|_| damaged("a meta name is not UTF-8"))?;
                f(Entry::Meta(name, b))?;
            }
            other => return Err(damaged(&format!("has an unknown entry tag {other}"))),
        }
    }
    Ok(())
}

/// The first block after `at` in the epoch's segment that holds a frame
/// of the epoch that verifies. Frames of an epoch are written one after
/// the other, each once the one before it is durable, so there is none
/// after the true end of the log or a torn last write; one found means the
/// stop at `at` is damage (a flipped magic, epoch or length field; a frame
/// overwritten).
///
/// Only for this format's aligned segments (a format-2 log's frames may
/// start at any byte). The segment is read in large chunks and only a
/// block whose header names this epoch is verified, so a clean open reads
/// each of the two live segments once.
fn find_later(
    file: &dyn StorageBackend,
    store_id: &[u8; 16],
    epoch: u64,
    layout: &Layout,
    at: u64,
    end: u64,
) -> Result<Option<u64>> {
    if layout.align < FRAME_ALIGN {
        return Ok(None);
    }
    let mut found = None;
    scan_headers(file, at + layout.align..end, |block, frame_epoch| {
        if frame_epoch == epoch
            && matches!(
                read_frame(file, store_id, epoch, block, end)?,
                Frame::Whole { .. }
            )
        {
            found = Some(block);
            return Ok(ControlFlow::Break(()));
        }
        Ok(ControlFlow::Continue(()))
    })?;
    Ok(found)
}

/// How many blocks of the log (laid out for `len`) start with a frame
/// header, and how many of those frames verify for `store_id` under their
/// own epoch. A log of this store has frames that verify (or none at all);
/// another store's has frames and none that do.
pub(super) fn frames_seen(
    file: &dyn StorageBackend,
    store_id: &[u8; 16],
    len: u64,
) -> Result<(u64, u64)> {
    let end = len.min(file.len().map_err(Error::Io)?);
    let (mut seen, mut ours) = (0u64, 0u64);
    for segment in 0..2u64 {
        let region = segment_range(len, segment);
        scan_headers(file, region.start..region.end.min(end), |block, epoch| {
            seen += 1;
            if matches!(
                read_frame(file, store_id, epoch, block, end)?,
                Frame::Whole { .. }
            ) {
                ours += 1;
            }
            Ok(ControlFlow::Continue(()))
        })?;
    }
    Ok((seen, ours))
}

/// Calls `f(offset, epoch)` for every [`FRAME_ALIGN`] block of `range`
/// (from its start) that begins with a frame's magic, in order, until `f`
/// breaks. Reads in large chunks: a whole segment costs a few reads, not
/// one per block.
fn scan_headers(
    file: &dyn StorageBackend,
    range: std::ops::Range<u64>,
    mut f: impl FnMut(u64, u64) -> Result<ControlFlow<()>>,
) -> Result<()> {
    const CHUNK: u64 = 1024 * 1024;
    let mut probe = range.start;
    let mut chunk = Vec::new();
    while probe + FRAME_HEADER <= range.end {
        let n = (range.end - probe).min(CHUNK);
        chunk.resize(n as usize, 0);
        file.read(probe, &mut chunk).map_err(Error::Io)?;
        let mut block = 0u64;
        while block + FRAME_HEADER <= n {
            let header = chunk
                .get(block as usize..(block + 12) as usize)
                .unwrap_or_default();
            if header.get(..4) == Some(&MAGIC[..]) {
                let epoch = header
                    .get(4..12)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u64::from_be_bytes);
                if f(probe + block, epoch)?.is_break() {
                    return Ok(());
                }
            }
            block += FRAME_ALIGN;
        }
        probe += n.div_ceil(FRAME_ALIGN) * FRAME_ALIGN;
    }
    Ok(())
}

/// The record keys a damaged frame's payload (`from..to`) names, read as
/// far as its entries parse: what a skipped frame may have written.
fn keys_in(file: &dyn StorageBackend, from: u64, to: u64) -> Vec<String> {
    let Some(len) = to.checked_sub(from).filter(|&n| n <= MAX_FRAME_READ) else {
        return Vec::new();
    };
    let mut payload = vec![0u8; len as usize];
    if file.read(from, &mut payload).is_err() {
        return Vec::new();
    }
    let mut keys = Vec::new();
    let mut cursor = payload.as_slice();
    while let Some((&tag, rest)) = cursor.split_first() {
        cursor = rest;
        let Some(a) = take(&mut cursor) else { break };
        match tag {
            TAG_RECORD_PUT | TAG_META_PUT => {
                if take(&mut cursor).is_none() {
                    break;
                }
            }
            TAG_RECORD_DEL | TAG_INDEX_PUT | TAG_INDEX_DEL => {}
            _ => break,
        }
        if matches!(tag, TAG_RECORD_PUT | TAG_RECORD_DEL) {
            keys.push(crate::codec::printable_key(a));
        }
    }
    keys
}

/// Most bytes [`keys_in`] reads from a damaged frame (its length field may
/// be damaged too).
const MAX_FRAME_READ: u64 = 64 * 1024 * 1024;

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
        let file = super::file::open_owner_only(&path)?;
        if !existed {
            file.sync_all()?;
            super::file::sync_parent(&path)?;
        }
        Ok(FileLog { file })
    }

    /// Opens the log beside `store` for reading only (`None` when there is
    /// none): every write through it fails, and nothing is created.
    pub(super) fn open_read_only(store: &Path) -> Result<Option<FileLog>> {
        match std::fs::File::open(wal_path(store)) {
            Ok(file) => Ok(Some(FileLog { file })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

/// Fills `out` from `file` at `offset` (positional: no shared cursor).
pub(super) fn read_at(file: &std::fs::File, out: &mut [u8], offset: u64) -> std::io::Result<()> {
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

impl StorageBackend for FileLog {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        read_at(&self.file, out, offset)
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

    #[test]
    fn segments_are_aligned_halves_and_epochs_alternate() {
        assert_eq!(align_up(0), 0);
        assert_eq!(align_up(1), FRAME_ALIGN);
        assert_eq!(align_up(FRAME_ALIGN), FRAME_ALIGN);
        assert_eq!(align_up(FRAME_ALIGN + 1), 2 * FRAME_ALIGN);
        let len = 8 * FRAME_ALIGN + 100; // a ragged tail is never used
        assert_eq!(segment_bytes(len), 4 * FRAME_ALIGN);
        assert_eq!(segment_range(len, 6), 0..4 * FRAME_ALIGN);
        assert_eq!(segment_range(len, 7), 4 * FRAME_ALIGN..8 * FRAME_ALIGN);
        assert_eq!(segment_range(len, 8), segment_range(len, 6));
    }

    #[test]
    fn appends_start_on_aligned_offsets_in_the_epochs_segment_and_rotate() {
        let file = std::sync::Arc::new(::redb::backends::InMemoryBackend::new());
        let len = 4 * FRAME_ALIGN;
        file.set_len(len).unwrap();
        let mut wal = Wal::new(file.clone(), [3; 16], 5, len);
        let journal = |n: usize| {
            let record = crate::record::Record {
                fingerprint: crate::fingerprint::Fingerprint::of(b"x"),
                state: crate::record::State::Done,
                response: Some(crate::response::Response::new(200, vec![7; n])),
                lease_until: None,
                expires_at: crate::time::Timestamp::from_millis(10),
                created_at: crate::time::Timestamp::from_millis(1),
                token: 1,
                attempts: 1,
            };
            let mut j = Journal::default();
            j.record_put(b"\0k", &crate::codec::encode_record(&record).unwrap());
            j
        };
        // Epoch 5 writes segment 1; each frame takes whole blocks.
        assert!(wal.fits(100) && !wal.is_dirty());
        wal.append(&mut journal(100), true).unwrap();
        assert!(wal.is_dirty());
        assert!(wal.fits(100));
        wal.append(&mut journal(100), true).unwrap();
        // The segment (two blocks) is full.
        assert!(!wal.fits(1) && wal.fits_at_all(1));
        assert!(!wal.fits_at_all(2 * FRAME_ALIGN as usize));
        let first = 2 * FRAME_ALIGN;
        let read = |at, epoch| read_frame(file.as_ref(), &[3; 16], epoch, at, len).unwrap();
        assert!(matches!(read(first, 5), Frame::Whole { .. }));
        assert!(matches!(read(first + FRAME_ALIGN, 5), Frame::Whole { .. }));
        assert!(matches!(read(0, 5), Frame::End));
        // The next epoch starts at the start of the other segment.
        wal.rotate();
        assert_eq!(wal.epoch(), 6);
        assert!(!wal.is_dirty());
        wal.append(&mut journal(10), false).unwrap();
        assert!(matches!(read(0, 6), Frame::Whole { .. }));
        // Replay follows the aligned starts and stops at the segment's end.
        let db = ::redb::Database::builder()
            .create_with_backend(::redb::backends::InMemoryBackend::new())
            .unwrap();
        let txn = db.begin_write().unwrap();
        let n = walk(
            file.as_ref(),
            &[3; 16],
            5,
            &Layout::segment(len, 5),
            false,
            None,
            applier(&txn).unwrap(),
        )
        .unwrap();
        assert_eq!(n, 2);
        let n = walk(
            file.as_ref(),
            &[3; 16],
            6,
            &Layout::segment(len, 6),
            false,
            None,
            applier(&txn).unwrap(),
        )
        .unwrap();
        assert_eq!(n, 1);
    }
}
