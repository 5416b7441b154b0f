//! The on-disk format: record envelope, key layout, expiry-index layout.
//!
//! A record value is an envelope around a postcard 1.x payload:
//!
//! ```text
//! magic "IDEM" (4) | format version u16 BE (2) | crc32 of payload u32 BE (4) | payload
//! ```
//!
//! postcard's wire format is frozen for 1.x, and every field of the payload is
//! listed in [`RecordV2`]; a new field means a new format version, read by a
//! new arm in [`decode_record`]. Keys and index entries use fixed big-endian
//! layouts, not a serializer, so their order on disk is their byte order:
//!
//! ```text
//! key:   scope_len u8 | scope | id
//! index: expires_at_ms u64 BE | key
//! ```
//!
//! Golden-byte fixtures under `tests/fixtures/` pin all three.

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::{Record, State};
use crate::response::Response;
use crate::step::Step;
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// The envelope's magic bytes.
pub(crate) const MAGIC: [u8; 4] = *b"IDEM";
/// The record format this build writes, and the only one it reads
/// (format 1, before steps, was never released).
pub(crate) const RECORD_FORMAT_VERSION: u16 = 2;
/// Bytes before the payload.
pub(crate) const HEADER_BYTES: usize = 10;

// Borrowed when encoding (nothing is copied to serialise a record),
// owned or borrowed from the input when decoding.
#[derive(Serialize, Deserialize)]
struct RecordV2<'a> {
    fingerprint: [u8; 32],
    state: u8,
    lease_until_ms: Option<u64>,
    expires_at_ms: u64,
    created_at_ms: u64,
    token: u64,
    attempts: u32,
    #[serde(borrow)]
    response: Option<ResponseV1<'a>>,
    #[serde(borrow)]
    steps: Vec<StepV2<'a>>,
}

#[derive(Serialize, Deserialize)]
struct StepV2<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(borrow, with = "serde_bytes")]
    output: Cow<'a, [u8]>,
}

#[derive(Serialize, Deserialize)]
struct ResponseV1<'a> {
    status: u16,
    #[serde(borrow)]
    headers: Vec<HeaderV1<'a>>,
    #[serde(borrow, with = "serde_bytes")]
    body: Cow<'a, [u8]>,
}

#[derive(Serialize, Deserialize)]
struct HeaderV1<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(borrow, with = "serde_bytes")]
    value: Cow<'a, [u8]>,
}

const STATE_PROCESSING: u8 = 1;
const STATE_DONE: u8 = 2;

/// Encodes a record. Checks the record's invariants first: a record that
/// breaks them is a bug and must never reach the disk.
pub(crate) fn encode_record(record: &Record) -> Result<Vec<u8>> {
    if let Err(why) = record.check() {
        return Err(Error::invalid_argument(format!(
            "refusing to write a record that breaks an invariant: {why}"
        )));
    }
    let payload = RecordV2 {
        fingerprint: *record.fingerprint.as_bytes(),
        state: match record.state {
            State::Processing => STATE_PROCESSING,
            State::Done => STATE_DONE,
        },
        lease_until_ms: record.lease_until.map(Timestamp::as_millis),
        expires_at_ms: record.expires_at.as_millis(),
        created_at_ms: record.created_at.as_millis(),
        token: record.token,
        attempts: record.attempts,
        response: record.response.as_ref().map(|r| ResponseV1 {
            status: r.status,
            headers: r
                .headers
                .iter()
                .map(|(name, value)| HeaderV1 {
                    name: Cow::Borrowed(name),
                    value: Cow::Borrowed(value),
                })
                .collect(),
            body: Cow::Borrowed(&r.body),
        }),
        steps: record
            .steps
            .iter()
            .map(|s| StepV2 {
                name: Cow::Borrowed(&s.name),
                output: Cow::Borrowed(&s.output),
            })
            .collect(),
    };
    // Enough for the fixed fields and each length's varint: never regrown.
    let lengths = record.response.iter().flat_map(|r| {
        let headers = r.headers.iter().map(|(n, v)| n.len() + v.len());
        std::iter::once(r.body.len()).chain(headers)
    });
    let steps = record.steps.iter().map(|s| s.name.len() + s.output.len());
    let mut out = Vec::with_capacity(
        HEADER_BYTES + 128 + lengths.chain(steps).map(|n| n + 10).sum::<usize>(),
    );
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&RECORD_FORMAT_VERSION.to_be_bytes());
    out.extend_from_slice(&[0; 4]);
    let mut out = postcard::to_extend(&payload, out)
        .map_err(|e| Error::invalid_argument(format!("record does not serialise: {e}")))?;
    let crc = crc32fast::hash(out.get(HEADER_BYTES..).unwrap_or_default());
    if let Some(slot) = out.get_mut(6..10) {
        slot.copy_from_slice(&crc.to_be_bytes());
    }
    Ok(out)
}

/// The length of `payload`'s canonical encoding.
fn encoded_len(payload: &RecordV2<'_>) -> Option<usize> {
    postcard::serialize_with_flavor(payload, postcard::ser_flavors::Size::default()).ok()
}

/// Decodes and verifies a record stored under `key_bytes` (used only to
/// name the key in errors). Never panics, whatever the bytes.
pub(crate) fn decode_record(key_bytes: &[u8], bytes: &[u8]) -> Result<Record> {
    let corrupt = |detail: String| Error::corrupt(Some(printable_key(key_bytes)), detail);
    let (header, payload) = bytes.split_first_chunk::<HEADER_BYTES>().ok_or_else(|| {
        corrupt(format!(
            "record is {} bytes, shorter than its header",
            bytes.len()
        ))
    })?;
    let [m0, m1, m2, m3, v0, v1, c0, c1, c2, c3] = *header;
    if [m0, m1, m2, m3] != MAGIC {
        return Err(corrupt(format!("bad magic {:02x?}", [m0, m1, m2, m3])));
    }
    let version = u16::from_be_bytes([v0, v1]);
    if version != RECORD_FORMAT_VERSION {
        return Err(Error::UnsupportedFormat {
            found: u32::from(version),
            supported: u32::from(RECORD_FORMAT_VERSION),
        });
    }
    let stored_crc = u32::from_be_bytes([c0, c1, c2, c3]);
    let actual_crc = crc32fast::hash(payload);
    if stored_crc != actual_crc {
        return Err(corrupt(format!(
            "checksum mismatch (stored {stored_crc:08x}, computed {actual_crc:08x})"
        )));
    }
    let (v2, rest): (RecordV2, &[u8]) = postcard::take_from_bytes(payload)
        .map_err(|e| corrupt(format!("payload does not decode: {e}")))?;
    if !rest.is_empty() {
        return Err(corrupt(format!(
            "{} trailing bytes after the payload",
            rest.len()
        )));
    }
    // postcard accepts over-long varints; a checksummed record we wrote never
    // has one. Rejecting them makes decoding injective: whatever decodes
    // re-encodes to the same bytes (the fuzz target `record_decode` checks it).
    if encoded_len(&v2) != Some(payload.len()) {
        return Err(corrupt("payload is not in canonical encoding".to_owned()));
    }
    let state = match v2.state {
        STATE_PROCESSING => State::Processing,
        STATE_DONE => State::Done,
        other => return Err(corrupt(format!("unknown state tag {other}"))),
    };
    let record = Record {
        fingerprint: Fingerprint::from_bytes(v2.fingerprint),
        state,
        response: v2.response.map(|r| Response {
            status: r.status,
            headers: r
                .headers
                .into_iter()
                .map(|h| (h.name.into_owned(), h.value.into_owned()))
                .collect(),
            body: r.body.into_owned(),
        }),
        lease_until: v2.lease_until_ms.map(Timestamp::from_millis),
        expires_at: Timestamp::from_millis(v2.expires_at_ms),
        created_at: Timestamp::from_millis(v2.created_at_ms),
        token: v2.token,
        attempts: v2.attempts,
        steps: v2
            .steps
            .into_iter()
            .map(|s| Step {
                name: s.name.into_owned(),
                output: s.output.into_owned(),
            })
            .collect(),
    };
    record.check().map_err(|why| corrupt(why.to_string()))?;
    Ok(record)
}

/// `scope_len u8 | scope | id`.
pub(crate) fn encode_key(key: &Key) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + key.scope().len() + key.id().len());
    // Key::new bounds the scope to 255 bytes, so the length fits a u8.
    out.push(u8::try_from(key.scope().len()).unwrap_or(u8::MAX));
    out.extend_from_slice(key.scope());
    out.extend_from_slice(key.id());
    out
}

/// Inverse of [`encode_key`].
pub(crate) fn decode_key(bytes: &[u8]) -> Result<Key> {
    let bad = |detail: &str| Error::corrupt(None, format!("stored key {}: {detail}", hex(bytes)));
    let (len, rest) = bytes.split_first().ok_or_else(|| bad("empty"))?;
    let (scope, id) = rest
        .split_at_checked(usize::from(*len))
        .ok_or_else(|| bad("scope length runs past the end"))?;
    Key::new(scope, id).map_err(|e| bad(&e.to_string()))
}

/// `expires_at_ms u64 BE | key`.
pub(crate) fn encode_index(expires_at: Timestamp, key_bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + key_bytes.len());
    out.extend_from_slice(&expires_at.as_millis().to_be_bytes());
    out.extend_from_slice(key_bytes);
    out
}

/// Inverse of [`encode_index`]: (expires_at, key bytes).
pub(crate) fn decode_index(bytes: &[u8]) -> Result<(Timestamp, &[u8])> {
    let (ts, key) = bytes.split_first_chunk::<8>().ok_or_else(|| {
        Error::corrupt(
            None,
            format!("index entry {} is shorter than 8 bytes", hex(bytes)),
        )
    })?;
    Ok((Timestamp::from_millis(u64::from_be_bytes(*ts)), key))
}

/// The printable form of stored key bytes, for error messages.
pub(crate) fn printable_key(key_bytes: &[u8]) -> String {
    match decode_key(key_bytes) {
        Ok(key) => key.to_string(),
        Err(_) => hex(key_bytes),
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(2 + bytes.len() * 2);
    s.push_str("0x");
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Bytes that are not a key are named in hex in errors (found by
    /// mutation testing: no test read the printed form).
    #[test]
    fn undecodable_key_bytes_print_as_hex() {
        assert_eq!(hex(&[0x00, 0xab, 0x10]), "0x00ab10");
        assert_eq!(hex(&[]), "0x");
        assert_eq!(printable_key(&[0xff]), "0xff");
        let key = Key::new("s", "k").unwrap();
        assert_eq!(printable_key(&encode_key(&key)), key.to_string());
    }

    pub(crate) fn sample_done() -> Record {
        Record {
            fingerprint: Fingerprint::from_bytes([0xab; 32]),
            state: State::Done,
            response: Some(
                Response::new(201, b"paid".to_vec()).with_header("content-type", "text/plain"),
            ),
            lease_until: None,
            expires_at: Timestamp::from_millis(1_700_000_086_400_000),
            created_at: Timestamp::from_millis(1_700_000_000_000),
            token: 42,
            attempts: 1,
            steps: Vec::new(),
        }
    }

    fn sample_processing() -> Record {
        Record {
            fingerprint: Fingerprint::from_bytes([0x11; 32]),
            state: State::Processing,
            response: None,
            lease_until: Some(Timestamp::from_millis(1_700_000_030_000)),
            expires_at: Timestamp::from_millis(1_700_000_086_400_000),
            created_at: Timestamp::from_millis(1_700_000_000_000),
            token: 7,
            attempts: 2,
            steps: vec![
                Step::new("charge", b"ch_1".to_vec()).expect("valid"),
                Step::new("reserve", Vec::new()).expect("valid"),
            ],
        }
    }

    /// The format is frozen: these bytes were written by format version 2
    /// and must decode to the same records forever. `IDEMSTORE_BLESS=1`
    /// rewrites them, which is only right together with a version bump.
    #[test]
    fn golden_fixtures_decode() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let key = Key::new("tenant-42", "order-1").expect("valid");
        let cases: [(&str, Vec<u8>); 4] = [
            (
                "record_v2_done.bin",
                encode_record(&sample_done()).expect("encodes"),
            ),
            (
                "record_v2_processing.bin",
                encode_record(&sample_processing()).expect("encodes"),
            ),
            ("key_v1.bin", encode_key(&key)),
            (
                "index_v1.bin",
                encode_index(
                    Timestamp::from_millis(1_700_000_086_400_000),
                    &encode_key(&key),
                ),
            ),
        ];
        if std::env::var_os("IDEMSTORE_BLESS").is_some() {
            std::fs::create_dir_all(&dir).expect("mkdir");
            for (name, bytes) in &cases {
                std::fs::write(dir.join(name), bytes).expect("write fixture");
            }
        }
        for (name, fresh) in &cases {
            let stored = std::fs::read(dir.join(name)).expect("fixture present");
            assert_eq!(
                &stored, fresh,
                "{name}: encoding changed; bump the format version"
            );
        }
        let read = |name: &str| std::fs::read(dir.join(name)).expect("fixture");
        assert_eq!(
            decode_record(b"", &read("record_v2_done.bin")).expect("decodes"),
            sample_done()
        );
        assert_eq!(
            decode_record(b"", &read("record_v2_processing.bin")).expect("decodes"),
            sample_processing()
        );
        assert_eq!(decode_key(&read("key_v1.bin")).expect("decodes"), key);
        let index = read("index_v1.bin");
        let (at, k) = decode_index(&index).expect("decodes");
        assert_eq!(
            (at.as_millis(), decode_key(k).expect("key")),
            (1_700_000_086_400_000, key)
        );
        // The header layout, byte by byte.
        let done = read("record_v2_done.bin");
        assert_eq!(&done[..6], b"IDEM\x00\x02");
        assert_eq!(&read("key_v1.bin")[..1], &[9]);
    }

    #[test]
    fn bit_flip_is_corrupt_with_key_named() {
        let key = encode_key(&Key::new("t", "order-1").expect("valid"));
        let mut bytes = encode_record(&sample_done()).expect("encodes");
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        let err = decode_record(&key, &bytes).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }));
        assert!(err.to_string().contains("t/order-1"), "{err}");
        assert!(err.to_string().contains("checksum"), "{err}");
    }

    #[test]
    fn overlong_varint_is_corrupt() {
        // A varint padded with a continuation byte (0x81 0x00 instead of 0x01)
        // decodes to the same value under postcard; with a valid checksum it
        // must still be refused, or decode would not be injective.
        let r = Record {
            attempts: 1,
            ..sample_done()
        };
        let bytes = encode_record(&r).expect("encodes");
        let mut payload = bytes[HEADER_BYTES..].to_vec();
        // fingerprint (32) | state (1) | lease None (1) | expires varint ... find attempts=1 after token=42.
        let at = payload
            .windows(2)
            .position(|w| w == [42, 1])
            .expect("token then attempts")
            + 1;
        payload.splice(at..=at, [0x81, 0x00]);
        let mut forged = bytes[..HEADER_BYTES].to_vec();
        forged[6..10].copy_from_slice(&crc32fast::hash(&payload).to_be_bytes());
        forged.extend_from_slice(&payload);
        let err = decode_record(b"\0k", &forged).expect_err("over-long varint");
        assert!(err.to_string().contains("canonical"), "{err}");
    }

    #[test]
    fn other_versions_are_unsupported() {
        // A newer release's record, and format 1 (before steps, never released).
        for (version, found) in [(3, 3), (1, 1)] {
            let mut bytes = encode_record(&sample_done()).expect("encodes");
            bytes[5] = version;
            assert!(matches!(
                decode_record(b"\0k", &bytes),
                Err(Error::UnsupportedFormat { found: f, supported: 2 }) if f == found
            ));
        }
    }

    #[test]
    fn invariant_breaking_record_is_never_encoded() {
        let mut r = sample_done();
        r.lease_until = Some(Timestamp::EPOCH);
        assert!(matches!(
            encode_record(&r),
            Err(Error::InvalidArgument { .. })
        ));
    }

    #[test]
    fn index_orders_by_expiry_then_key() {
        let a = encode_index(Timestamp::from_millis(1), b"\0z");
        let b = encode_index(Timestamp::from_millis(256), b"\0a");
        assert!(a < b);
        assert_eq!(
            decode_index(&b).expect("decodes"),
            (Timestamp::from_millis(256), &b"\0a"[..])
        );
    }

    fn arb_record() -> impl Strategy<Value = Record> {
        (
            any::<[u8; 32]>(),
            any::<bool>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            1..u64::MAX,
            1..u32::MAX,
            any::<u16>(),
            proptest::collection::vec(
                (
                    "[a-z-]{1,12}",
                    proptest::collection::vec(any::<u8>(), 0..16),
                ),
                0..4,
            ),
            proptest::collection::vec(any::<u8>(), 0..300),
            proptest::collection::vec(
                ("[a-z]{0,8}", proptest::collection::vec(any::<u8>(), 0..16)),
                0..4,
            ),
        )
            .prop_map(
                |(fp, done, lease, exp, created, token, attempts, status, headers, body, steps)| {
                    let response = Response {
                        status,
                        headers,
                        body,
                    };
                    Record {
                        fingerprint: Fingerprint::from_bytes(fp),
                        state: if done { State::Done } else { State::Processing },
                        response: done.then_some(response),
                        lease_until: (!done).then_some(Timestamp::from_millis(lease)),
                        expires_at: Timestamp::from_millis(exp),
                        created_at: Timestamp::from_millis(created),
                        token,
                        attempts,
                        // Unique names (the index first); DONE has none.
                        steps: steps
                            .into_iter()
                            .enumerate()
                            .filter(|_| !done)
                            .map(|(i, (name, output))| Step {
                                name: format!("{i}{name}"),
                                output,
                            })
                            .collect(),
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn record_round_trips(r in arb_record()) {
            let bytes = encode_record(&r).expect("encodes");
            prop_assert_eq!(decode_record(b"\0k", &bytes).expect("decodes"), r);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_record(b"\0k", &bytes);
            let _ = decode_key(&bytes);
            let _ = decode_index(&bytes);
        }

        #[test]
        fn keys_round_trip(scope in proptest::collection::vec(any::<u8>(), 0..=255),
                           id in proptest::collection::vec(any::<u8>(), 1..=255)) {
            let key = Key::new(&scope, &id).expect("valid");
            prop_assert_eq!(decode_key(&encode_key(&key)).expect("decodes"), key);
        }
    }
}
