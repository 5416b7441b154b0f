//! Internals for idemstore's own testkit, fuzz targets and benches
//! (feature `unstable-internals`; hidden from the docs).
//!
//! **Not a stable API.** Anything here may change or disappear in any
//! release, patch releases included. It exists so that the codec round-trip
//! fuzzer, the crash checker (which reads a store file below the store's
//! API) and the codec benches run against the real code rather than a copy.
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

/// A key's stored form (`scope_len u8 | scope | id`).
pub fn encode_key(key: &Key) -> Vec<u8> {
    codec::encode_key(key)
}

/// Decodes a key's stored form.
pub fn decode_key(bytes: &[u8]) -> Result<Key> {
    codec::decode_key(bytes)
}

/// An expiry-index entry (`expires_at_ms u64 BE | key`).
pub fn encode_index(expires_at: Timestamp, key_bytes: &[u8]) -> Vec<u8> {
    codec::encode_index(expires_at, key_bytes)
}

/// Decodes an expiry-index entry into its expiry and key bytes.
pub fn decode_index(bytes: &[u8]) -> Result<(Timestamp, &[u8])> {
    codec::decode_index(bytes)
}

/// A stored key as text for messages (`scope/id`, escaped).
pub fn printable_key(key_bytes: &[u8]) -> String {
    codec::printable_key(key_bytes)
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

/// The redb store's table and meta-key names: the ones the store itself
/// uses, so a checker reading a file below the API cannot drift from them.
#[cfg(feature = "redb")]
pub mod redb_tables {
    use ::redb::TableDefinition;

    /// Records by stored key.
    pub const RECORDS: TableDefinition<'static, &'static [u8], &'static [u8]> =
        crate::redb::tables::RECORDS;
    /// The expiry index: `expires_at | key` → `()`.
    pub const EXPIRY: TableDefinition<'static, &'static [u8], ()> = crate::redb::tables::EXPIRY;
    /// Store-wide facts (format version, store id, token mark, log epoch).
    pub const META: TableDefinition<'static, &'static str, &'static [u8]> =
        crate::redb::tables::META;
    /// The meta key of the largest fencing token ever handed out (u64 BE).
    pub const META_TOKEN_HWM: &str = crate::redb::tables::META_TOKEN_HWM;
}
