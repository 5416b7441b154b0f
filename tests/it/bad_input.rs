//! The bad-input catalog: each bad input gets a clear typed error, raised
//! before any write, and loses nothing. Backend-specific entries (damaged
//! files, full disks, read-only directories) live with their backend.

use idemstore::limits::{MAX_HEADER_BYTES, MAX_HEADERS, MAX_ID_BYTES, MAX_SCOPE_BYTES};
use idemstore::{Begin, Error, Fingerprint, Key, MemoryStore, Response, Store, Timestamp};
use std::time::Duration;

const D: Duration = Duration::from_secs(1);

fn message(r: Result<Key, Error>) -> String {
    match r {
        Err(e @ Error::InvalidKey { .. }) => e.to_string(),
        other => panic!("expected InvalidKey, got {other:?}"),
    }
}

/// An empty id is refused: it would make every keyless request one intent.
#[test]
fn empty_id_is_invalid_key() {
    assert_eq!(
        message(Key::new("t", "")),
        "invalid idempotency key: the id is empty (1..=255 bytes required)"
    );
}

/// An id over 255 bytes is refused rather than truncated (truncation could merge two intents).
#[test]
fn oversized_id_is_invalid_key() {
    let m = message(Key::new("t", vec![b'x'; MAX_ID_BYTES + 1]));
    assert!(m.contains("256 bytes"), "{m}");
}

/// A scope over 255 bytes is refused.
#[test]
fn oversized_scope_is_invalid_key() {
    let m = message(Key::new(vec![b's'; MAX_SCOPE_BYTES + 1], "id"));
    assert!(m.contains("scope"), "{m}");
}

/// Non-UTF-8 bytes are valid keys and print as hex.
#[test]
fn binary_keys_are_valid_and_printable() {
    let k = Key::new([0u8, 255], [1u8]).unwrap();
    assert_eq!(k.to_string(), "0x00ff/0x01");
}

/// An oversized response is refused and the claim stays intact, so the
/// owner can still store a smaller answer or release.
#[test]
fn oversized_response_and_headers_lose_nothing() {
    let store = MemoryStore::with_max_body_bytes(16).unwrap();
    let key = Key::new("t", "k").unwrap();
    let now = Timestamp::from_millis(0);
    let Begin::Claimed(claim) = store
        .begin(&key, &Fingerprint::of(b"x"), now, D, D)
        .unwrap()
    else {
        panic!()
    };
    let too_big = Response::new(200, vec![0; 17]);
    let err = store.complete(&key, &claim, &too_big, now, D).unwrap_err();
    assert_eq!(
        err.to_string(),
        "response too large: 17 body bytes exceeds the limit of 16; nothing was stored"
    );
    let fat = Response::new(200, "").with_header("x", vec![b'v'; MAX_HEADER_BYTES]);
    assert!(matches!(
        store.complete(&key, &claim, &fat, now, D),
        Err(Error::ResponseTooLarge {
            what: "header bytes",
            ..
        })
    ));
    let mut many = Response::new(200, "");
    for i in 0..=MAX_HEADERS {
        many = many.with_header(format!("h{i}"), "");
    }
    assert!(matches!(
        store.complete(&key, &claim, &many, now, D),
        Err(Error::ResponseTooLarge {
            what: "header count",
            ..
        })
    ));
    store
        .complete(&key, &claim, &Response::new(200, vec![0; 16]), now, D)
        .unwrap();
}

/// A body limit above the hard cap is a configuration error, not a silent clamp.
#[test]
fn body_limit_above_hard_cap_is_rejected() {
    let r = MemoryStore::with_max_body_bytes(idemstore::limits::MAX_BODY_BYTES_HARD_CAP + 1);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })));
}

/// A zero lease or a retention shorter than the lease is refused before any write.
#[test]
fn nonsensical_durations_are_rejected() {
    let store = MemoryStore::new();
    let key = Key::new("t", "k").unwrap();
    let fp = Fingerprint::of(b"x");
    let now = Timestamp::from_millis(0);
    assert!(matches!(
        store.begin(&key, &fp, now, Duration::ZERO, D),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        store.begin(&key, &fp, now, 2 * D, D),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(store.is_empty());
}

/// Times at the ends of the range saturate instead of wrapping around to
/// the past (which would make a fresh record look expired).
#[test]
fn extreme_times_saturate() {
    let store = MemoryStore::new();
    let key = Key::new("t", "k").unwrap();
    let fp = Fingerprint::of(b"x");
    let end = Timestamp::MAX - Duration::from_millis(10);
    let Begin::Claimed(c) = store.begin(&key, &fp, end, D, Duration::MAX).unwrap() else {
        panic!()
    };
    assert_eq!(c.lease_until(), Timestamp::MAX);
    assert!(matches!(
        store.begin(&key, &fp, end, D, Duration::MAX).unwrap(),
        Begin::InFlight { .. }
    ));
}
