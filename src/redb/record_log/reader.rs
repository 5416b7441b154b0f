//! The record log's reader: the walk over one epoch's frames that a
//! replay and a check make ([`walk`]), what it hands a replay's
//! transaction ([`applier`]), and whether a log's frames are this store's
//! at all ([`frames_seen`]).
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
//! With [`accept_loss`](crate::redb::RedbStoreBuilder::accept_loss) each
//! `Corrupt` but the last becomes a skip: replay goes on at the next frame
//! that verifies, and the [`LossReport`] says what was skipped.

use super::super::damage::{Damage, Stop};
use super::super::loss::LossReport;
use super::super::tables::WriteTables;
use super::FRAME_ALIGN;
use super::frame::{
    Entry, FRAME_HEADER, Frame, Layout, MAGIC, entries, keys_in, read_frame, segment_range,
};
use crate::error::{Error, Result};
use ::redb::StorageBackend;
use std::ops::ControlFlow;

/// What replay does with a whole frame's payload: writes its entries
/// through `tables` (hand it to [`walk`] as `on_frame`). A record put or
/// delete also moves the record's expiry-index entry (the old expiry is
/// read from the record it replaces), so the frames need not carry index
/// entries. A frame that verifies but whose payload does not decode is
/// damage no crash can cause: [`Error::Corrupt`], and the caller commits
/// nothing.
pub(in crate::redb) fn applier<'a>(
    tables: &'a mut WriteTables<'_>,
) -> impl FnMut(u64, &[u8]) -> Result<()> + 'a {
    move |at, payload: &[u8]| {
        entries(at, payload, |entry| match entry {
            Entry::Put(key, value, expires_at) => {
                tables.apply_encoded(key, Some((value, expires_at)))
            }
            Entry::Del(key) => tables.apply_encoded(key, None),
            Entry::Meta(name, value) => tables.set_meta(name, value),
        })
    }
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
pub(in crate::redb) fn walk(
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
        layout.region.start + from.div_ceil(FRAME_ALIGN) * FRAME_ALIGN
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
                let (how, damaged_end) = match stop {
                    Frame::Damaged { next } => (Stop::Damaged, Some(next)),
                    _ => (Stop::Ends, None),
                };
                let later = find_later(file, store_id, epoch, at, end)?;
                // After a process crash (no reboot), a last frame of one
                // block cannot have been torn (see the docs above).
                let damaged_last = later.is_none()
                    && no_reboot
                    && damaged_end.is_some_and(|next| next - at <= FRAME_ALIGN);
                if later.is_none() && !damaged_last {
                    break;
                }
                let damage = match later {
                    Some(later) => Damage::FrameGap {
                        stop: how,
                        at,
                        later,
                    },
                    None => Damage::LastFrameDamaged { at },
                };
                let Some(loss) = loss.as_deref_mut() else {
                    return Err(damage.into());
                };
                loss.frames_skipped += 1;
                if let Some(next) = damaged_end {
                    loss.keys_possibly_lost
                        .extend(keys_in(file, at + FRAME_HEADER, next.min(end)));
                }
                loss.findings.push(damage.finding(epoch));
                match later {
                    // The walk goes on at the next frame that verifies.
                    Some(x) => {
                        at = x;
                        continue;
                    }
                    None => break,
                }
            }
        };
        on_frame(at, &payload)?;
        frames += 1;
        at = next;
    }
    Ok(frames)
}

/// The first block after `at` in the epoch's segment that holds a frame
/// of the epoch that verifies. Frames of an epoch are written one after
/// the other, each once the one before it is durable, so there is none
/// after the true end of the log or a torn last write; one found means the
/// stop at `at` is damage (a flipped magic, epoch or length field; a frame
/// overwritten).
///
/// The segment is read in large chunks and only a block whose header
/// names this epoch is verified, so a clean open reads each of the two
/// live segments once.
fn find_later(
    file: &dyn StorageBackend,
    store_id: &[u8; 16],
    epoch: u64,
    at: u64,
    end: u64,
) -> Result<Option<u64>> {
    let mut found = None;
    scan_headers(file, at + FRAME_ALIGN..end, |block, frame_epoch| {
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
pub(in crate::redb) fn frames_seen(
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
