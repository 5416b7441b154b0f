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
        steps: Vec::new(),
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
    /// Requests that may wait in a store's commit line.
    pub const WRITE_QUEUE_DEPTH: usize = crate::redb::WRITE_QUEUE_DEPTH;
    /// The log file's default size (bytes).
    pub const WAL_BYTES: u64 = crate::redb::WAL_BYTES;
    /// The smallest log file the builder accepts (bytes).
    pub const MIN_WAL_BYTES: u64 = crate::redb::MIN_WAL_BYTES;
}

/// sled's fixed sizes, for the sled store's tests.
#[cfg(feature = "sled")]
pub mod sled {
    /// The size above which sled 0.34.7 writes a log item (a page: a whole
    /// tree node, or one update to it) to its own file under `blobs/`: a
    /// quarter of the 512 KiB segment, less the segment and message headers
    /// (`pagecache/logger.rs`, `reserve_inner`). sled never fsyncs blob
    /// files; the store does, and its tests cross this size to show it.
    pub const BLOB_THRESHOLD_BYTES: usize = 512 * 1024 / 4 - 20 - 32;
}
