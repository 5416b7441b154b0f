//! Internals for idemstore's own testkit, fuzz targets and benches
//! (feature `unstable-internals`; hidden from the docs).
//!
//! **Not a stable API.** Anything here may change or disappear in any
//! release, patch releases included. It exists so that the codec round-trip
//! fuzzer and the codec benches run against the real code rather than a
//! copy.
//! Applications must not enable this feature.

use crate::codec;
use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::{Record, State};
use crate::response::Response;
use crate::time::Timestamp;

/// Bytes of the record envelope's header (magic, version, checksum).
pub const HEADER_BYTES: usize = codec::HEADER_BYTES;

/// The stored bytes of `record` (envelope and payload).
pub fn encode_record(record: &Record) -> Result<Vec<u8>> {
    codec::encode_record(record)
}

/// Decodes and verifies a stored record; `key_bytes` only names it in errors.
pub fn decode_record(key_bytes: &[u8], bytes: &[u8]) -> Result<Record> {
    codec::decode_record(key_bytes, bytes)
}

/// Decodes a key's stored form.
pub fn decode_key(bytes: &[u8]) -> Result<Key> {
    codec::decode_key(bytes)
}

/// Decodes an expiry-index entry into its expiry and key bytes.
pub fn decode_index(bytes: &[u8]) -> Result<(Timestamp, &[u8])> {
    codec::decode_index(bytes)
}

/// A DONE record with a `body_bytes` response, as the codec benches use it.
pub fn sample_record(body_bytes: usize) -> Record {
    let t0 = Timestamp::from_millis(1_760_846_400_000);
    Record {
        fingerprint: Fingerprint::of(b"sku=A&qty=1"),
        state: State::Done,
        response: Some(
            Response::new(201, vec![b'x'; body_bytes])
                .with_header("content-type", "application/json"),
        ),
        lease_until: None,
        expires_at: t0 + std::time::Duration::from_secs(86_400),
        created_at: t0,
        token: 42,
        attempts: 1,
    }
}

/// One operation of a page log frame: a write `(offset, bytes)`, or a
/// `set_len` (`Err(len)`).
#[cfg(feature = "redb")]
pub type PageOp = std::result::Result<(u64, Vec<u8>), u64>;

/// A page log run for the `page_log_replay` fuzz target: a marker and one
/// frame per entry of `frames`, in the page log's format (docs/format.md).
#[cfg(feature = "redb")]
pub fn page_log_run(epoch: u64, frames: &[Vec<PageOp>]) -> Vec<u8> {
    use crate::redb::page_log;
    let mut log = page_log::encode_frame(epoch, 0, &[]).unwrap_or_default();
    for (seq, ops) in (1u64..).zip(frames) {
        let mut payload = Vec::new();
        for op in ops {
            match op {
                Ok((offset, data)) => page_log::encode_write(&mut payload, *offset, data),
                Err(len) => page_log::encode_set_len(&mut payload, *len),
            }
        }
        log.extend(page_log::encode_frame(epoch, seq, &payload).unwrap_or_default());
    }
    log
}

/// Replays the page log `log` onto a store file holding `base`, as an open
/// does, and returns the file's bytes after it and the frames applied.
#[cfg(feature = "redb")]
pub fn replay_page_log(log: &[u8], base: &[u8]) -> Result<(Vec<u8>, u64)> {
    let log = FileImage(std::sync::Mutex::new(log.to_vec()));
    let target = FileImage(std::sync::Mutex::new(base.to_vec()));
    let replayed = crate::redb::page_log::replay(&log, &target)?;
    let out = target.0.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok((out, replayed.frames))
}

/// A file's bytes in memory, with a file's semantics: a write past the end
/// extends it.
#[cfg(feature = "redb")]
#[derive(Debug)]
struct FileImage(std::sync::Mutex<Vec<u8>>);

#[cfg(feature = "redb")]
impl ::redb::StorageBackend for FileImage {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.0.lock().map_or(0, |b| b.len() as u64))
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let b = self
            .0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?;
        let start = usize::try_from(offset).map_err(std::io::Error::other)?;
        let src = start
            .checked_add(out.len())
            .and_then(|end| b.get(start..end))
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        out.copy_from_slice(src);
        Ok(())
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        let len = usize::try_from(len).map_err(std::io::Error::other)?;
        if len > 1 << 24 {
            return Err(std::io::Error::other("larger than a fuzz input's file"));
        }
        let mut b = self
            .0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?;
        b.resize(len, 0);
        Ok(())
    }

    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let start = usize::try_from(offset).map_err(std::io::Error::other)?;
        let end = start
            .checked_add(data.len())
            .filter(|&end| end <= 1 << 24)
            .ok_or_else(|| std::io::Error::other("larger than a fuzz input's file"))?;
        let mut b = self
            .0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?;
        if b.len() < end {
            b.resize(end, 0);
        }
        if let Some(dst) = b.get_mut(start..end) {
            dst.copy_from_slice(data);
        }
        Ok(())
    }
}

/// The redb store's fixed sizes, for tests of its file format and its
/// commit line. Not configurable; `docs/format.md` and `docs/design.md`
/// give their values.
///
/// ```
/// assert_eq!(idemstore::unstable::redb::FRAME_ALIGN, 4096);
/// assert_eq!(idemstore::unstable::redb::MEMTABLE_BYTES, 4 << 20);
/// ```
#[cfg(feature = "redb")]
pub mod redb {
    /// Record log frames start on multiples of this (bytes) from the start
    /// of their segment.
    pub const FRAME_ALIGN: u64 = crate::redb::FRAME_ALIGN;
    /// The memtable's budget (bytes of records) before it is frozen.
    pub const MEMTABLE_BYTES: usize = crate::redb::MEMTABLE_BYTES;
    /// The page log's preallocated size (bytes).
    pub const PAGE_LOG_BYTES: u64 = crate::redb::PAGE_LOG_BYTES;
    /// Requests that may wait in a store's commit line.
    pub const WRITE_QUEUE_DEPTH: usize = crate::redb::WRITE_QUEUE_DEPTH;
}

/// `PostgresStore`'s schema, for the crate's own upgrade tests.
///
/// ```
/// let ddl = idemstore::unstable::postgres::ddl_v1("t");
/// assert!(ddl.contains("schema version 1"));
/// ```
#[cfg(feature = "postgres")]
pub mod postgres {
    /// The DDL of schema version 1 (every record invariant a CHECK
    /// constraint) for a table named `table`, as releases before version 2
    /// created it.
    pub fn ddl_v1(table: &str) -> String {
        crate::postgres::ddl_v1(table)
    }
}
