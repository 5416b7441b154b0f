//! The record log's reader: the walk over one epoch's frames ([`walk`]),
//! what it hands a replay's transaction ([`applier`]), and what it saw of
//! whose frames they are ([`Seen`]).
//!
//! Replay is a redo (full values), so replaying frames already in the file
//! changes nothing. At each offset:
//!
//! - a frame of this epoch that verifies: applied;
//! - anything else: the end, unless a later block holds a verifying frame
//!   of this epoch. A frame is written only after the previous one was
//!   synced, so a crash damages only the last frame and leaves nothing
//!   after it: a verifying frame after the stop is damage, [`Error::Corrupt`];
//! - a damaged last frame of one block with no reboot since it was written
//!   (a process crash writes it whole or not at all): [`Error::Corrupt`];
//!   after a reboot it is a torn write, the end;
//! - a frame that verifies but does not decode: damage no crash causes,
//!   [`Error::Corrupt`], nothing committed.
//!
//! With [`accept_loss`](crate::redb::RedbStoreBuilder::accept_loss) each
//! `Corrupt` but the last is a skip, written in the [`LossReport`].

use super::super::damage::{Damage, LossReport, Stop};
use super::super::meta::fixed;
use super::super::tables::{META_TOKEN_HWM, WriteTables};
use super::FRAME_ALIGN;
use super::frame::{Entry, FRAME_HEADER, Frame, Layout, MAGIC, entries, keys_in, read_frame};
use crate::error::{Error, Result};
use ::redb::StorageBackend;
use std::ops::ControlFlow;

/// What replay does with a whole frame's payload: writes its entries
/// through `tables` (hand it to [`walk`] as `on_frame`), and keeps the
/// token high-water mark the last frame carried in `token_hwm`. A record
/// put or delete also moves the record's expiry-index entry (the old
/// expiry is read from the record it replaces), so frames carry no index
/// entries. A payload that does not decode is [`Error::Corrupt`]; the
/// caller commits nothing.
pub(in crate::redb) fn applier<'a>(
    tables: &'a mut WriteTables<'_>,
    token_hwm: &'a mut u64,
) -> impl FnMut(u64, &[u8]) -> Result<()> + 'a {
    move |at, payload: &[u8]| {
        entries(at, payload, |entry| match entry {
            Entry::Put(key, value, expires_at) => {
                tables.apply_encoded(key, Some((value, expires_at)))
            }
            Entry::Del(key) => tables.apply_encoded(key, None),
            Entry::Meta(name, value) => {
                if name == META_TOKEN_HWM {
                    *token_hwm = u64::from_be_bytes(fixed(name, value)?);
                }
                tables.set_meta(name, value)
            }
        })
    }
}

/// Walks every frame of `epoch` (rules in the module docs), handing each
/// whole frame's offset and payload to `on_frame`; returns how many.
///
/// `no_reboot` (same boot id as the writer's open): the stop was a process
/// crash. The kernel copies a write into the page cache a page at a time
/// and a fatal signal is noticed between pages, so a one-block frame lands
/// whole or not at all: one that fails its checksum was damaged after it
/// was written. A longer last frame may be cut by the kill: a torn tail.
///
/// With `loss`, each `Corrupt` is written there and the walk goes on.
/// Every frame header the walk reads is counted in `seen`.
pub(in crate::redb) fn walk(
    file: &dyn StorageBackend,
    store_id: &[u8; 16],
    layout: &Layout,
    no_reboot: bool,
    mut loss: Option<&mut LossReport>,
    seen: &mut Seen,
    mut on_frame: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<u64> {
    let epoch = layout.epoch;
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
                // A verifying frame after the stop: the stop is damage to
                // synced data, and ending here would drop acknowledged writes.
                let (how, damaged_end) = match stop {
                    Frame::Damaged { next } => (Stop::Damaged, Some(next)),
                    _ => (Stop::Ends, None),
                };
                let later = find_later(file, store_id, epoch, at, end, seen)?;
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
        seen.headers += 1;
        seen.ours += 1;
        on_frame(at, &payload)?;
        frames += 1;
        at = next;
    }
    Ok(frames)
}

/// The first block after `at` holding a verifying frame of `epoch` (none
/// after a true end), counting in `seen` every frame header from `at` on.
/// A header of another epoch is verified only while none verified for this
/// store, so a clean open reads each live segment once.
fn find_later(
    file: &dyn StorageBackend,
    store_id: &[u8; 16],
    epoch: u64,
    at: u64,
    end: u64,
    seen: &mut Seen,
) -> Result<Option<u64>> {
    let mut found = None;
    scan_headers(file, at..end, |block, frame_epoch| {
        seen.headers += 1;
        let this_epoch = frame_epoch == epoch;
        if (this_epoch || seen.ours == 0)
            && matches!(
                read_frame(file, store_id, frame_epoch, block, end)?,
                Frame::Whole { .. }
            )
        {
            seen.ours += 1;
            // `at` itself is where the walk stopped: never whole here.
            if this_epoch {
                found = Some(block);
                return Ok(ControlFlow::Break(()));
            }
        }
        Ok(ControlFlow::Continue(()))
    })?;
    Ok(found)
}

/// The frame headers a walk read, and how many of those frames verify for
/// the store under their own epoch. A log of this store has frames that
/// verify (or none at all); another store's has frames and none that do.
#[derive(Debug, Default)]
pub(in crate::redb) struct Seen {
    pub(in crate::redb) headers: u64,
    pub(in crate::redb) ours: u64,
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
