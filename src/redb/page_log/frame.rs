//! The page log's frames: how one is sealed ([`seal`]) and its operations
//! encoded ([`encode_write`], [`encode_set_len`]), and the replay of the
//! log's current run onto the store file ([`replay`]).
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
//! Its integers are little-endian, unlike the record log's frames and
//! every other integer idemstore writes (big-endian): a difference with no
//! reason in the formats themselves (the page log kept the byte order of
//! the bench prototype it grew out of). docs/format.md is the reference
//! for both.

use super::super::damage::Damage;
use crate::error::{Error, Result};
use ::redb::StorageBackend;
use std::io::{Error as IoError, ErrorKind};

// A frame, right after the one before it (a run's marker at offset 0);
// integers little-endian:
//
// offset  size  field
// ------  ----  ----------------------------------------------------------
//      0     4  magic "IDPG"                                        MAGIC
//      4     8  epoch u64: the run's
//     12     8  sequence number u64: 0 for the run's marker, then 1, 2, ...
//     20     4  payload length u32 (n)
//     24     4  CRC-32 of bytes 0..24 and the payload
//     28     n  payload                                       HEADER = 28
//
// The payload: operations in order, each
//
// size  field
// ----  ------------------------------------------------------------------
//    1  op: 1 a write, 2 a set_len                             OP_*
//    8  write: offset u64          set_len: the new length u64
//    8  write: length u64 (m)
//    m  write: the bytes

const MAGIC: &[u8; 4] = b"IDPG";
/// Magic, epoch, sequence number, payload length, CRC-32.
pub(super) const HEADER: usize = 4 + 8 + 8 + 4 + 4;
const OP_WRITE: u8 = 1;
const OP_SET_LEN: u8 = 2;

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
    let malformed = || Error::from(Damage::PageFrameMalformed);
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
pub(super) fn seal(frame: &mut [u8], epoch: u64, seq: u64) -> std::io::Result<()> {
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
