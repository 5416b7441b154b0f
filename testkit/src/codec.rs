//! The codec property the `record_decode` fuzz target checks: arbitrary
//! bytes never panic the decoders, and what decodes re-encodes exactly.
//!
//! It reads idemstore's codec through the hidden `unstable-internals`
//! feature: the envelope is idemstore's own format, not part of its API.

use idemstore::unstable;

/// Arbitrary bytes never panic the decoders, and whatever decodes as a
/// record re-encodes to exactly the same bytes. The input is tried twice:
/// as given, and with its checksum fixed up so the payload decoder is
/// reached.
pub fn record_decode(data: &[u8]) {
    let _ = unstable::decode_key(data);
    let _ = unstable::decode_index(data);
    check_round_trip(data);
    if data.len() >= unstable::HEADER_BYTES {
        let mut fixed = data.to_vec();
        let crc = crc32fast::hash(fixed.get(unstable::HEADER_BYTES..).unwrap_or_default());
        if let Some(slot) = fixed.get_mut(6..10) {
            slot.copy_from_slice(&crc.to_be_bytes());
        }
        check_round_trip(&fixed);
    }
}

fn check_round_trip(bytes: &[u8]) {
    if let Ok(record) = unstable::decode_record(b"\0fuzz", bytes) {
        let again = unstable::encode_record(&record).expect("a decoded record re-encodes");
        assert_eq!(again, bytes, "decode is not injective: {record:?}");
    }
}

/// The property the `page_log_replay` fuzz target checks: replaying any
/// bytes as a page log never panics, and replay is a redo: replaying the
/// same log again onto its own result changes nothing (an open that
/// crashes after replaying, before the new run's marker, replays it
/// again).
///
/// The first byte picks the input's shape: arbitrary bytes as the log, or
/// (odd) a well-formed run built from the rest (writes and lengths taken
/// from the bytes), cut or flipped at a position the bytes also choose, so
/// that the parser's deep paths are reached.
///
/// Returns the frames the first replay applied.
#[cfg(feature = "redb")]
pub fn page_log_replay(data: &[u8]) -> u64 {
    let Some((&mode, rest)) = data.split_first() else {
        return 0;
    };
    let log = if mode % 2 == 0 {
        rest.to_vec()
    } else {
        let mut frames = Vec::new();
        let mut ops = Vec::new();
        for chunk in rest.chunks(7) {
            let offset = u64::from(chunk.first().copied().unwrap_or(0)) * 97;
            match chunk.get(1).copied().unwrap_or(0) % 4 {
                0 => ops.push(Err(offset)),
                1 => {
                    frames.push(std::mem::take(&mut ops));
                }
                _ => ops.push(Ok((offset, chunk.get(2..).unwrap_or_default().to_vec()))),
            }
        }
        frames.push(ops);
        let mut log = unstable::page_log_run(u64::from(mode), &frames);
        let at = usize::from(rest.first().copied().unwrap_or(0)) * 13;
        match mode % 8 {
            1 => log.truncate(at),
            3 => {
                if let Some(b) = log.get_mut(at) {
                    *b ^= 0x40;
                }
            }
            _ => {}
        }
        log
    };
    let base = b"base file bytes that a replay may overwrite".repeat(3);
    let Ok((once, frames)) = unstable::replay_page_log(&log, &base) else {
        return 0;
    };
    let (twice, _) =
        unstable::replay_page_log(&log, &once).expect("a log replayed once replays again");
    assert_eq!(once, twice, "replaying a page log again changed the file");
    frames
}
