//! The record log's bytes, as docs/format.md lays them out: magic "IDWL" |
//! epoch u64 | payload length u32 | CRC-32 u32 | payload of entries (tag u8
//! | len u32 | bytes [| len u32 | bytes]). The CRC also covers the store's
//! id (not stored), so a log beside another store never verifies.

use super::super::damage::Damage;
use crate::error::{Error, Result};
use ::redb::StorageBackend;

pub(super) const MAGIC: [u8; 4] = *b"IDWL";
pub(super) const FRAME_HEADER: u64 = 20;

const TAG_RECORD_PUT: u8 = 1;
const TAG_RECORD_DEL: u8 = 2;
const TAG_META_PUT: u8 = 5;

/// Frames start on multiples of this from their segment's start, so an
/// append never rewrites a sector holding acknowledged bytes.
pub(crate) const FRAME_ALIGN: u64 = 4096;

pub(super) fn align_up(n: u64) -> u64 {
    n.div_ceil(FRAME_ALIGN) * FRAME_ALIGN
}

/// Each of the two segments of a log of `len` bytes, in whole blocks.
pub(super) fn segment_bytes(len: u64) -> u64 {
    len / 2 / FRAME_ALIGN * FRAME_ALIGN
}

/// Where the frames of one epoch are laid out in the file.
#[derive(Clone, Debug)]
pub(in crate::redb) struct Layout {
    pub(super) epoch: u64,
    pub(super) region: std::ops::Range<u64>,
}

impl Layout {
    /// `epoch`'s segment (`epoch % 2`) of a log file of `len` bytes.
    pub(in crate::redb) fn segment(len: u64, epoch: u64) -> Layout {
        let seg = segment_bytes(len);
        let start = (epoch % 2) * seg;
        let region = start..start + seg;
        Layout { epoch, region }
    }
}

/// One group's table writes, in order, laid out as a frame whose header
/// [`LogWriter::append`](super::LogWriter::append) fills in (no second copy).
#[derive(Debug)]
pub(in crate::redb) struct FrameBuf {
    bytes: Vec<u8>,
}

impl Default for FrameBuf {
    fn default() -> FrameBuf {
        let mut bytes = Vec::with_capacity(FRAME_ALIGN as usize); // a group's usual size
        bytes.resize(FRAME_HEADER as usize, 0);
        FrameBuf { bytes }
    }
}

impl FrameBuf {
    pub(in crate::redb) fn record_put(&mut self, key: &[u8], value: &[u8]) {
        self.entry(TAG_RECORD_PUT, key, Some(value));
    }
    pub(in crate::redb) fn record_del(&mut self, key: &[u8]) {
        self.entry(TAG_RECORD_DEL, key, None);
    }
    pub(in crate::redb) fn meta_put(&mut self, name: &str, value: &[u8]) {
        self.entry(TAG_META_PUT, name.as_bytes(), Some(value));
    }

    /// Bytes recorded so far (the payload, without the header's room).
    pub(in crate::redb) fn len(&self) -> usize {
        self.bytes.len() - FRAME_HEADER as usize
    }

    /// Fills in the header for `store_id` and `epoch` and returns the frame.
    pub(super) fn seal(&mut self, store_id: &[u8; 16], epoch: u64) -> Result<&[u8]> {
        let len = u32::try_from(self.len())
            .map_err(|_| Error::backend("a group too large for the log"))?;
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
        for field in std::iter::once(a).chain(b) {
            // Key and Response limits keep lengths far below 4 GiB.
            let len = u32::try_from(field.len()).unwrap_or(u32::MAX);
            self.bytes.extend_from_slice(&len.to_be_bytes());
            self.bytes.extend_from_slice(field);
        }
    }
}

/// What lies at one offset of the log.
pub(super) enum Frame {
    /// A frame of the current epoch that verifies; the next starts at `next`.
    Whole { payload: Vec<u8>, next: u64 },
    /// A frame header of the current epoch whose checksum fails (torn by a
    /// crash, or damaged); where the next frame would start.
    Damaged { next: u64 },
    /// Anything else: zeros, an older epoch's bytes, a cut-off header.
    End,
}

pub(super) fn read_frame(
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
    let (fixed, crc) = header.split_at(16);
    let payload_len = fixed
        .last_chunk()
        .map_or(0, |n| u64::from(u32::from_be_bytes(*n)));
    let next = at + FRAME_HEADER + payload_len;
    if header_epoch(&header) != Some(epoch) || next > len {
        return Ok(Frame::End);
    }
    let mut payload = vec![0u8; payload_len as usize];
    file.read(at + FRAME_HEADER, &mut payload)
        .map_err(Error::Io)?;
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(store_id);
    hasher.update(fixed);
    hasher.update(&payload);
    if hasher.finalize().to_be_bytes() != crc {
        return Ok(Frame::Damaged { next });
    }
    Ok(Frame::Whole { payload, next })
}

/// The epoch in the frame header that `bytes` start with; `None` without
/// the magic.
pub(super) fn header_epoch(bytes: &[u8]) -> Option<u64> {
    let (magic, rest) = bytes.split_first_chunk::<4>()?;
    let epoch = rest.first_chunk()?;
    (*magic == MAGIC).then(|| u64::from_be_bytes(*epoch))
}

/// One entry of a frame's payload.
pub(in crate::redb) enum Entry<'a> {
    /// A record put: stored key, stored value, the record's expiry.
    Put(&'a [u8], &'a [u8], crate::time::Timestamp),
    /// A record delete.
    Del(&'a [u8]),
    /// A meta entry.
    Meta(&'a str, &'a [u8]),
}

/// Parses the payload of the verified frame at `at` into entries, in order;
/// a payload that does not parse is damage no crash causes, [`Error::Corrupt`].
pub(in crate::redb) fn entries<'a>(
    at: u64,
    payload: &'a [u8],
    mut f: impl FnMut(Entry<'a>) -> Result<()>,
) -> Result<()> {
    let damaged = |detail: String| Error::from(Damage::FrameEntries { at, detail });
    let mut cursor = payload;
    while let Some(entry) = next_entry(&mut cursor) {
        let (tag, a, b) = entry.map_err(damaged)?;
        match tag {
            TAG_RECORD_PUT => {
                let expires_at = crate::codec::decode_record(a, b)
                    .map_err(|_| damaged("holds a record that does not decode".into()))?
                    .expires_at;
                f(Entry::Put(a, b, expires_at))?;
            }
            TAG_RECORD_DEL => f(Entry::Del(a))?,
            _ => {
                let name = std::str::from_utf8(a)
                    .map_err(|_| damaged("a meta name is not UTF-8".into()))?;
                f(Entry::Meta(name, b))?;
            }
        }
    }
    Ok(())
}

/// Tag, first field, second field (empty for a delete).
type RawEntry<'a> = (u8, &'a [u8], &'a [u8]);

/// Splits the next entry off the front of `cursor`; `Err` says what is wrong.
fn next_entry<'a>(cursor: &mut &'a [u8]) -> Option<std::result::Result<RawEntry<'a>, String>> {
    let (&tag, rest) = cursor.split_first()?;
    *cursor = rest;
    let cut = || "an entry is cut short".to_owned();
    let Some(a) = take(cursor) else {
        return Some(Err(cut()));
    };
    Some(match tag {
        TAG_RECORD_PUT | TAG_META_PUT => take(cursor).map(|b| (tag, a, b)).ok_or_else(cut),
        TAG_RECORD_DEL => Ok((tag, a, &[][..])),
        other => Err(format!("has an unknown entry tag {other}")),
    })
}

/// Splits a `len u32 | bytes` field off the front of `cursor`.
fn take<'a>(cursor: &mut &'a [u8]) -> Option<&'a [u8]> {
    let (len, rest) = cursor.split_first_chunk::<4>()?;
    let (bytes, rest) = rest.split_at_checked(u32::from_be_bytes(*len) as usize)?;
    *cursor = rest;
    Some(bytes)
}

/// The record keys a damaged frame's payload (`from..to`) names, as far as
/// its entries parse.
pub(super) fn keys_in(file: &dyn StorageBackend, from: u64, to: u64) -> Vec<String> {
    let Some(len) = to.checked_sub(from).filter(|&n| n <= MAX_FRAME_READ) else {
        return Vec::new();
    };
    let mut payload = vec![0u8; len as usize];
    if file.read(from, &mut payload).is_err() {
        return Vec::new();
    }
    let mut cursor = payload.as_slice();
    std::iter::from_fn(|| next_entry(&mut cursor)?.ok())
        .filter(|&(tag, ..)| tag != TAG_META_PUT)
        .map(|(_, key, _)| crate::codec::printable_key(key))
        .collect()
}

/// Most bytes [`keys_in`] reads (a damaged length may be huge).
const MAX_FRAME_READ: u64 = 64 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame that ends exactly where its region ends is whole; one byte
    /// less of region and it is the end.
    #[test]
    fn a_frame_may_end_exactly_at_its_regions_end() {
        let mut j = FrameBuf::default();
        j.record_del(b"\0k");
        let frame = j.seal(&[9; 16], 3).unwrap().to_vec();
        let file = ::redb::backends::InMemoryBackend::new();
        let len = frame.len() as u64;
        file.set_len(len).unwrap();
        file.write(0, &frame).unwrap();
        assert!(matches!(
            read_frame(&file, &[9; 16], 3, 0, len).unwrap(),
            Frame::Whole { next, .. } if next == len
        ));
        assert!(matches!(
            read_frame(&file, &[9; 16], 3, 0, len - 1).unwrap(),
            Frame::End
        ));
    }

    /// A frame with no entries is its header alone: it verifies when the
    /// header ends exactly where the region does.
    #[test]
    fn a_header_only_frame_may_end_exactly_at_its_regions_end() {
        let mut j = FrameBuf::default();
        let frame = j.seal(&[9; 16], 3).unwrap().to_vec();
        assert_eq!(frame.len() as u64, FRAME_HEADER);
        let file = ::redb::backends::InMemoryBackend::new();
        file.set_len(FRAME_HEADER).unwrap();
        file.write(0, &frame).unwrap();
        assert!(matches!(
            read_frame(&file, &[9; 16], 3, 0, FRAME_HEADER).unwrap(),
            Frame::Whole { payload, next } if payload.is_empty() && next == FRAME_HEADER
        ));
    }

    /// A damaged frame's entries are read as far as they parse, for the
    /// loss report: the record keys it names (puts and deletions, not the
    /// meta table's), up to a cut, and nothing for a range that cannot be
    /// a frame. The payload is over a MiB: a large response's frame.
    #[test]
    fn a_damaged_frames_keys_are_read_as_far_as_its_entries_parse() {
        let mut j = FrameBuf::default();
        j.record_put(b"\0big", &vec![1u8; 2 << 20]);
        j.meta_put("token_hwm", &[0; 8]);
        j.record_del(b"\0gone");
        let file = ::redb::backends::InMemoryBackend::new();
        let len = j.bytes.len() as u64;
        file.set_len(len).unwrap();
        file.write(0, &j.bytes).unwrap();
        let key = |k: &[u8]| crate::codec::printable_key(k);
        assert_eq!(
            keys_in(&file, FRAME_HEADER, len),
            vec![key(b"\0big"), key(b"\0gone")]
        );
        // Cut inside the deletion: the put alone.
        assert_eq!(keys_in(&file, FRAME_HEADER, len - 2), vec![key(b"\0big")]);
        assert!(keys_in(&file, len, FRAME_HEADER).is_empty());
        assert!(
            keys_in(&file, FRAME_HEADER, len + 1).is_empty(),
            "past the file"
        );
    }

    #[test]
    fn take_splits_length_prefixed_fields_and_refuses_short_ones() {
        let mut j = FrameBuf::default();
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
        let mut j = FrameBuf::default();
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
    fn segments_are_aligned_halves_and_epochs_alternate() {
        assert_eq!(align_up(0), 0);
        assert_eq!(align_up(1), FRAME_ALIGN);
        assert_eq!(align_up(FRAME_ALIGN), FRAME_ALIGN);
        assert_eq!(align_up(FRAME_ALIGN + 1), 2 * FRAME_ALIGN);
        let len = 8 * FRAME_ALIGN + 100; // a ragged tail is never used
        assert_eq!(segment_bytes(len), 4 * FRAME_ALIGN);
        let segment_range = |epoch| Layout::segment(len, epoch).region;
        assert_eq!(segment_range(6), 0..4 * FRAME_ALIGN);
        assert_eq!(segment_range(7), 4 * FRAME_ALIGN..8 * FRAME_ALIGN);
        assert_eq!(segment_range(8), segment_range(6));
    }
}
