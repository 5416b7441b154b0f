//! The `Idempotency-Key` request header: which values are keys.

use crate::key::MAX_ID_BYTES;
use http::HeaderMap;

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header set on a replay.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The key in `headers`: `Ok(None)` when there is none, `Err(why)` when the
/// header is there but is not a key.
///
/// Accepted: a structured-field string (`"abc"`, RFC 8941, with `\"` and
/// `\\` escapes) or a bare value, either way 1..=[`MAX_ID_BYTES`] bytes of
/// visible ASCII once unquoted. Bare values are not held to the sf-token
/// grammar, because the keys clients send in practice (UUIDs) start with a
/// digit, which sf-token forbids.
pub(crate) fn parse_key(headers: &HeaderMap) -> Result<Option<Vec<u8>>, String> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err("more than one Idempotency-Key header".into());
    }
    parse_value(value.as_bytes()).map(Some)
}

fn parse_value(raw: &[u8]) -> Result<Vec<u8>, String> {
    let key = match raw.split_first() {
        Some((b'"', rest)) => unquote(rest)?,
        _ => raw.to_vec(),
    };
    check_id(key, "the Idempotency-Key")
}

/// `key` if it is 1..=[`MAX_ID_BYTES`] bytes of visible ASCII, else why not,
/// naming it as `what` (`the Idempotency-Key`, `the key field /request_id`):
/// a key from a JSON body field is held to the header's rules, so a client
/// that moves its key from one to the other keeps it.
pub(crate) fn check_id(key: Vec<u8>, what: &str) -> Result<Vec<u8>, String> {
    if key.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if key.len() > MAX_ID_BYTES {
        return Err(format!(
            "{what} is {} bytes; at most {MAX_ID_BYTES} are allowed",
            key.len()
        ));
    }
    if let Some(pos) = key.iter().position(|b| !b.is_ascii_graphic()) {
        return Err(format!(
            "{what} has a byte that is not visible ASCII at offset {pos}"
        ));
    }
    Ok(key)
}

/// The content of an sf-string whose opening quote is already consumed.
fn unquote(rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(rest.len());
    let mut bytes = rest.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err("the Idempotency-Key string has a bad escape".into()),
            },
            b'"' if bytes.as_slice().is_empty() => return Ok(out),
            b'"' => {
                return Err("the Idempotency-Key string has text after its closing quote".into());
            }
            _ => out.push(b),
        }
    }
    Err("the Idempotency-Key string has no closing quote".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: &[u8]) -> Result<Vec<u8>, String> {
        parse_value(v)
    }

    #[test]
    fn accepts_sf_strings_and_bare_values() {
        assert_eq!(key(b"\"abc-1\"").unwrap(), b"abc-1");
        assert_eq!(key(b"\"a\\\"b\\\\c\"").unwrap(), b"a\"b\\c");
        assert_eq!(
            key(b"8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap(),
            b"8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(key(&[b'x'; MAX_ID_BYTES]).unwrap().len(), MAX_ID_BYTES);
    }

    #[test]
    fn refuses_what_is_not_a_key() {
        for bad in [
            &b""[..],
            b"\"\"",
            b"\"abc",
            b"\"ab\"c",
            b"\"a\\nb\"",
            b"a b",
            b"\"a b\"",
            b"caf\xc3\xa9",
            b"\"abc\";p=1",
        ] {
            assert!(key(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(key(&[b'x'; MAX_ID_BYTES + 1]).is_err());
    }

    #[test]
    fn two_headers_are_refused() {
        let mut h = HeaderMap::new();
        assert_eq!(parse_key(&h), Ok(None));
        h.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
        assert_eq!(parse_key(&h), Ok(Some(b"a".to_vec())));
        h.append(IDEMPOTENCY_KEY, "b".parse().unwrap());
        assert!(parse_key(&h).is_err());
    }
}
