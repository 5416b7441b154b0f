//! The record log's reader: the walk over one epoch's frames ([`walk`]) and
//! what it hands a replay's transaction ([`applier`]). Replay is a redo
//! (full values), so replaying frames already in the file changes nothing;
//! the rules at each offset are docs/format.md's. A frame is written only
//! after the previous one was synced, so a crash damages only the last
//! frame: a verifying frame after the stop is damage, [`Error::Corrupt`]
//! (with `accept_loss`, a skip written in the [`LossReport`]).

use super::super::damage::{Damage, LossReport};
use super::super::meta::fixed;
use super::super::tables::{META_TOKEN_HWM, WriteTables};
use super::FRAME_ALIGN;
use super::frame::{
    Entry, FRAME_HEADER, Frame, Layout, align_up, entries, header_epoch, keys_in, read_frame,
};
use crate::error::{Error, Result};
use ::redb::StorageBackend;

/// [`walk`]'s `on_frame` for a replay: writes the frame's entries through
/// `tables` (which also moves the expiry index: frames carry no index
/// entries) and keeps the last token high-water mark in `token_hwm`.
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

/// Walks every frame of `epoch`, handing each whole frame's offset and
/// payload to `on_frame`; returns how many. With `loss`, each `Corrupt` is
/// written there and the walk goes on; every header read is counted in
/// `seen`.
///
/// `no_reboot`: the stop was a process crash, and the kernel copies a
/// write into the page cache a page at a time with fatal signals noticed
/// between pages, so a one-block last frame that fails its checksum was
/// damaged after it was written. A longer one may be a torn tail.
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
    let start = layout.region.start;
    loop {
        let (payload, next) = match read_frame(file, store_id, epoch, at, end)? {
            Frame::Whole { payload, next } => (payload, start + align_up(next - start)),
            stop => {
                let (stop, damaged_end) = match stop {
                    Frame::Damaged { next } => ("fails its checksum", Some(next)),
                    _ => ("ends", None),
                };
                let later = find_later(file, store_id, epoch, at, end, seen)?;
                let damage = match later {
                    Some(later) => Damage::FrameGap { stop, at, later },
                    None if no_reboot && damaged_end.is_some_and(|n| n - at <= FRAME_ALIGN) => {
                        Damage::LastFrameDamaged { at }
                    }
                    None => break,
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
                let Some(later) = later else { break };
                at = later;
                continue;
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

/// The first block after `at` holding a verifying frame of `epoch`,
/// counting in `seen` every header from `at` on (every [`FRAME_ALIGN`] block
/// that begins with a frame's magic, read in 1 MiB chunks). A header of
/// another epoch is verified only while none verified for this store.
fn find_later(
    file: &dyn StorageBackend,
    store_id: &[u8; 16],
    epoch: u64,
    at: u64,
    end: u64,
    seen: &mut Seen,
) -> Result<Option<u64>> {
    const CHUNK: u64 = 1024 * 1024;
    let mut probe = at;
    let mut chunk = Vec::new();
    while probe + FRAME_HEADER <= end {
        let n = (end - probe).min(CHUNK);
        chunk.resize(n as usize, 0);
        file.read(probe, &mut chunk).map_err(Error::Io)?;
        let mut block = 0u64;
        while block + FRAME_HEADER <= n {
            let header = chunk.get(block as usize..).unwrap_or_default();
            if let Some(frame_epoch) = header_epoch(header) {
                seen.headers += 1;
                let this_epoch = frame_epoch == epoch;
                let at = probe + block;
                if (this_epoch || seen.ours == 0)
                    && matches!(
                        read_frame(file, store_id, frame_epoch, at, end)?,
                        Frame::Whole { .. }
                    )
                {
                    seen.ours += 1;
                    if this_epoch {
                        return Ok(Some(at));
                    }
                }
            }
            block += FRAME_ALIGN;
        }
        probe += align_up(n);
    }
    Ok(None)
}

/// The frame headers a walk read, and how many verify for this store: a
/// log of another store has headers and none that do.
#[derive(Debug, Default)]
pub(in crate::redb) struct Seen {
    pub(in crate::redb) headers: u64,
    pub(in crate::redb) ours: u64,
}

#[cfg(test)]
mod tests {
    use super::super::frame::FrameBuf;
    use super::*;
    use ::redb::backends::InMemoryBackend;

    const OURS: [u8; 16] = [3; 16];

    /// One frame of `store`'s `epoch` deleting `key`, written at `at`.
    fn frame_at(file: &InMemoryBackend, store: &[u8; 16], epoch: u64, at: u64, key: &[u8]) {
        let mut j = FrameBuf::default();
        j.record_del(key);
        file.write(at, j.seal(store, epoch).unwrap()).unwrap();
    }

    fn walked(
        file: &InMemoryBackend,
        layout: &Layout,
        loss: Option<&mut LossReport>,
    ) -> (Result<u64>, Seen) {
        let mut seen = Seen::default();
        let walked = walk(file, &OURS, layout, false, loss, &mut seen, |_, _| Ok(()));
        (walked, seen)
    }

    /// A damaged frame with a verifying frame of its epoch after it is
    /// damage, found past the first MiB the search reads at a time (a
    /// header of another store in between verifies for nobody); with
    /// `accept_loss` the walk skips to the later frame. Every header read
    /// is counted, and those that verify for this store.
    #[test]
    fn a_verifying_frame_after_a_damaged_one_is_damage_found_past_the_first_chunk() {
        let later = (1 << 20) + 2 * FRAME_ALIGN;
        let layout = Layout {
            epoch: 4,
            region: 0..(1 << 20) + 4 * FRAME_ALIGN,
        };
        let file = InMemoryBackend::new();
        file.set_len(layout.region.end).unwrap();
        frame_at(&file, &OURS, 4, 0, b"\0a");
        frame_at(&file, &OURS, 4, FRAME_ALIGN, b"\0b");
        file.write(FRAME_ALIGN + FRAME_HEADER, &[9]).unwrap(); // its payload's tag
        frame_at(&file, &[7; 16], 4, 2 * FRAME_ALIGN, b"\0c");
        frame_at(&file, &OURS, 4, later, b"\0d");

        let (err, seen) = walked(&file, &layout, None);
        let err = err.unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "fails its checksum at offset {FRAME_ALIGN}, but a later frame of the same epoch at offset {later} verifies"
            )),
            "{err}"
        );
        assert_eq!((seen.headers, seen.ours), (4, 2));

        let mut loss = LossReport::default();
        let (frames, seen) = walked(&file, &layout, Some(&mut loss));
        assert_eq!(frames.unwrap(), 2, "the first frame and the later one");
        assert_eq!(loss.frames_skipped, 1);
        assert_eq!((seen.headers, seen.ours), (5, 3));
    }

    /// A walk that finds no frame of its epoch tells a log of another
    /// store (headers, none verifying) from this store's older epoch (its
    /// frames verify): the open refuses the first after an unclean stop.
    #[test]
    fn headers_of_another_epoch_verify_only_until_one_is_this_stores() {
        let layout = Layout {
            epoch: 4,
            region: 0..4 * FRAME_ALIGN,
        };
        let older = InMemoryBackend::new();
        older.set_len(layout.region.end).unwrap();
        frame_at(&older, &OURS, 2, 0, b"\0a");
        frame_at(&older, &OURS, 2, FRAME_ALIGN, b"\0b");
        let (frames, seen) = walked(&older, &layout, None);
        assert_eq!(frames.unwrap(), 0);
        assert_eq!((seen.headers, seen.ours), (2, 1), "the first verifies");

        let foreign = InMemoryBackend::new();
        foreign.set_len(layout.region.end).unwrap();
        frame_at(&foreign, &[7; 16], 4, 0, b"\0a");
        frame_at(&foreign, &[7; 16], 2, FRAME_ALIGN, b"\0b");
        let (frames, seen) = walked(&foreign, &layout, None);
        assert_eq!(frames.unwrap(), 0);
        assert_eq!((seen.headers, seen.ours), (2, 0));
    }
}
