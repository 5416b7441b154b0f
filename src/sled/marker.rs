//! A small file beside sled's data, written at every open and clean close,
//! that lets a later open notice when sled has silently lost data.
//!
//! sled 0.34 recovers its log up to the first message that fails its
//! checksum and treats the rest as a torn write: a damaged `db` file opens
//! as an *empty* database, without an error. Without this file the store
//! would then start afresh and replay nothing: a retry of a completed
//! request would run its side effect again. A store never silently empties
//! itself; damage is refused with an error (`docs/design.md`, the contract).
//!
//! ```text
//! magic "IDEMSLED" (8) | format u32 BE | store id u128 BE | last token u64 BE | crc32 u32 BE
//! ```
//!
//! It is replaced atomically (write a temporary file, fsync, rename, fsync
//! the directory). It only proves what existed at the last open or clean
//! close; writes after that are protected by sled's own recovery alone.

use crate::error::{Error, Result};
use std::fs::File;
use std::io::Write;
use std::path::Path;

/// The marker's file name.
pub(crate) const MARKER_FILE: &str = "idemstore.meta";
/// The temporary name the marker is written under before the rename.
pub(crate) const MARKER_TMP: &str = "idemstore.meta.tmp";
const MAGIC: [u8; 8] = *b"IDEMSLED";
const BODY_BYTES: usize = 8 + 4 + 16 + 8;

/// What the marker records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Marker {
    pub(crate) format: u32,
    pub(crate) store_id: u128,
    pub(crate) last_token: u64,
}

impl Marker {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(BODY_BYTES + 4);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.format.to_be_bytes());
        out.extend_from_slice(&self.store_id.to_be_bytes());
        out.extend_from_slice(&self.last_token.to_be_bytes());
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_be_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Marker> {
        let (body, crc) = bytes.split_at_checked(BODY_BYTES)?;
        if crc != crc32fast::hash(body).to_be_bytes() || !body.starts_with(&MAGIC) {
            return None;
        }
        let rest = body.get(MAGIC.len()..)?;
        let (format, rest) = rest.split_first_chunk::<4>()?;
        let (store_id, rest) = rest.split_first_chunk::<16>()?;
        let (last_token, _) = rest.split_first_chunk::<8>()?;
        Some(Marker {
            format: u32::from_be_bytes(*format),
            store_id: u128::from_be_bytes(*store_id),
            last_token: u64::from_be_bytes(*last_token),
        })
    }
}

/// Reads the marker: `None` when there is none yet; [`Error::Corrupt`]
/// when it is damaged.
pub(crate) fn read(dir: &Path) -> Result<Option<Marker>> {
    match std::fs::read(dir.join(MARKER_FILE)) {
        Ok(bytes) => Marker::decode(&bytes).map(Some).ok_or_else(|| {
            Error::corrupt(
                None,
                format!("{MARKER_FILE} in {} is damaged", dir.display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Replaces the marker atomically and durably.
pub(crate) fn write(dir: &Path, marker: Marker) -> Result<()> {
    let tmp = dir.join(MARKER_TMP);
    let mut f = File::create(&tmp)?;
    f.write_all(&marker.encode())?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, dir.join(MARKER_FILE))?;
    File::open(dir)?.sync_all()?;
    Ok(())
}

fn lost(dir: &Path, what: String) -> Error {
    Error::corrupt(
        None,
        format!(
            "sled store {} lost data: {what}; its data file is damaged. \
             Refusing to open it (a fresh start would forget completed requests)",
            dir.display()
        ),
    )
}

/// The error for a directory whose marker names a store of which sled
/// recovered nothing.
pub(crate) fn lost_everything(dir: &Path, marker: Marker) -> Error {
    lost(
        dir,
        format!(
            "store {:032x} had handed out fencing tokens up to {}, but sled recovered no idemstore data",
            marker.store_id, marker.last_token
        ),
    )
}

/// Checks what sled recovered (store id, token mark) against the marker.
pub(crate) fn check(dir: &Path, marker: Marker, store_id: u128, last_token: u64) -> Result<()> {
    if store_id != marker.store_id {
        return Err(lost(
            dir,
            format!(
                "the data is store {store_id:032x}, but {MARKER_FILE} names store {:032x}",
                marker.store_id
            ),
        ));
    }
    if last_token < marker.last_token {
        return Err(lost(
            dir,
            format!(
                "sled recovered fencing tokens up to {last_token}, but {} had been handed out by the last open or close",
                marker.last_token
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_damage() {
        let m = Marker {
            format: 1,
            store_id: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
            last_token: 42,
        };
        let mut bytes = m.encode();
        assert_eq!(Marker::decode(&bytes), Some(m));
        bytes[20] ^= 1;
        assert_eq!(Marker::decode(&bytes), None);
        assert_eq!(Marker::decode(&bytes[..10]), None);
    }
}
