//! The export line format (`idemstore export`, JSON lines), drawn at
//! [`export_line`]: records as stored, read back unchanged by import.

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::{Record, State};
use crate::response::{MAX_BODY_BYTES_HARD_CAP, Response};
use crate::step::Step;
use crate::time::Timestamp;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Map, Value, json};

/// The line format version (`v`) this build writes and reads.
pub(crate) const LINE_VERSION: u64 = 1;

/// One record as one export line (JSON, no newline), read back by
/// [`parse_line`]: the fields are `docs/format.md`'s ("The export format").
/// Byte strings are JSON text when valid UTF-8, else base64 under the name
/// with `_b64` appended; times are Unix milliseconds; recorded steps are
/// under `"steps"`, in order: `[{"name":"charge","output":"ch_1"}]`.
///
/// ```
/// use idemstore::redb::admin::{export_line, parse_line};
/// use idemstore::{Fingerprint, Key, MemoryStore, Store, Timestamp};
///
/// let (store, key) = (MemoryStore::new(), Key::new("tenant-42", "order-1")?);
/// let hour = std::time::Duration::from_secs(3600);
/// store.begin(&key, &Fingerprint::of(b"x"), Timestamp::EPOCH, hour, hour)?;
/// let record = store.get(&key, Timestamp::EPOCH)?.expect("claimed");
///
/// let line = export_line(&key, &record);
/// assert!(line.contains(r#""scope":"tenant-42","#) && line.contains(r#""state":"PROCESSING","#), "{line}");
/// assert_eq!(parse_line(&line)?, (key, record));
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn export_line(key: &Key, record: &Record) -> String {
    to_json(key, record).to_string()
}

fn to_json(key: &Key, record: &Record) -> Value {
    let mut line = json!({
        "v": LINE_VERSION,
        "state": record.state.to_string(),
        "fingerprint": record.fingerprint.to_hex(),
        "token": record.token,
        "attempts": record.attempts,
        "created_at_ms": record.created_at.as_millis(),
        "expires_at_ms": record.expires_at.as_millis(),
        "lease_until_ms": record.lease_until.map(Timestamp::as_millis),
        "response": record.response.as_ref().map(response_json),
    });
    put_bytes(&mut line, "scope", key.scope());
    put_bytes(&mut line, "id", key.id());
    if !record.steps.is_empty() {
        let steps = record.steps.iter();
        let steps = steps.map(|s| named(&s.name, "output", &s.output)).collect();
        if let Some(map) = line.as_object_mut() {
            map.insert("steps".to_owned(), steps);
        }
    }
    line
}

fn response_json(r: &Response) -> Value {
    let headers = r.headers.iter().map(|(n, v)| named(n, "value", v));
    let mut out = json!({ "status": r.status, "headers": headers.collect::<Vec<_>>() });
    put_bytes(&mut out, "body", &r.body);
    out
}

/// A step or a header: `{"name": .., <field>: bytes}`.
fn named(name: &str, field: &str, bytes: &[u8]) -> Value {
    let mut out = json!({ "name": name });
    put_bytes(&mut out, field, bytes);
    out
}

/// Text under `name` when valid UTF-8, else base64 under `<name>_b64`.
fn put_bytes(object: &mut Value, name: &str, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(text) => object[name] = json!(text),
        Err(_) => object[format!("{name}_b64")] = json!(STANDARD.encode(bytes)),
    }
}

fn bad(detail: impl std::fmt::Display) -> Error {
    Error::invalid_argument(format!("export line: {detail}"))
}

fn take_bytes(map: &Map<String, Value>, name: &str) -> Result<Vec<u8>> {
    if let Some(v) = map.get(name) {
        return v
            .as_str()
            .map(|s| s.as_bytes().to_vec())
            .ok_or_else(|| bad(format!("{name:?} is not a string")));
    }
    let b64 = format!("{name}_b64");
    let s = map
        .get(&b64)
        .ok_or_else(|| bad(format!("neither {name:?} nor {b64:?} is present")))?
        .as_str()
        .ok_or_else(|| bad(format!("{b64:?} is not a string")))?;
    STANDARD
        .decode(s)
        .map_err(|e| bad(format!("{b64:?} is not base64: {e}")))
}

fn take_u64(map: &Map<String, Value>, name: &str) -> Result<u64> {
    map.get(name)
        .and_then(Value::as_u64)
        .ok_or_else(|| bad(format!("{name:?} is missing or not an unsigned integer")))
}

/// Refuses a field not in `known` (each also allowed as `<name>_b64`): a
/// newer writer's line is not imported without what it says.
fn only_known(map: &Map<String, Value>, what: &str, known: &[&str]) -> Result<()> {
    let unknown = map
        .keys()
        .find(|k| !known.contains(&k.strip_suffix("_b64").unwrap_or(k)));
    unknown.map_or(Ok(()), |field| {
        Err(bad(format!(
            "unknown field {field:?} in {what} (this build reads line format v{LINE_VERSION})"
        )))
    })
}

const LINE_FIELDS: &[&str] = &[
    "v",
    "scope",
    "id",
    "state",
    "fingerprint",
    "token",
    "attempts",
    "created_at_ms",
    "expires_at_ms",
    "lease_until_ms",
    "response",
    "steps",
];
const RESPONSE_FIELDS: &[&str] = &["status", "headers", "body"];

fn object<'a>(v: &'a Value, what: &str) -> Result<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| bad(format!("{what} is not a JSON object")))
}

/// Inverse of [`Fingerprint::to_hex`].
fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Parses one line written by [`export_line`], checking the key, the
/// record's invariants and the response limits (at their widest); a bad
/// line is [`Error::InvalidArgument`] naming the field (or
/// [`Error::InvalidKey`], [`Error::ResponseTooLarge`]).
///
/// ```
/// use idemstore::redb::admin::parse_line;
/// use idemstore::{Error, State};
///
/// let line = r#"{"v":1,"scope":"t","id":"o-1","state":"DONE",
///     "fingerprint":"0000000000000000000000000000000000000000000000000000000000000000",
///     "token":7,"attempts":1,"created_at_ms":1000,"expires_at_ms":2000,"lease_until_ms":null,
///     "response":{"status":201,"headers":[],"body":"charged"}}"#;
/// let (key, record) = parse_line(line)?;
/// assert_eq!(key.to_string(), "t/o-1");
/// assert_eq!((record.state(), record.token()), (State::Done, 7));
/// assert_eq!(record.response().map(|r| r.body()), Some(b"charged".as_slice()));
///
/// let err = parse_line(&line.replace(r#""token":7"#, r#""token":"7""#)).unwrap_err();
/// assert!(matches!(err, Error::InvalidArgument { .. }) && err.to_string().contains("token"));
/// // A line of a newer format version is refused by name.
/// let err = parse_line(r#"{"v":2}"#).unwrap_err();
/// assert!(err.to_string().contains("this build reads v1"), "{err}");
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn parse_line(line: &str) -> Result<(Key, Record)> {
    let value: Value = serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = object(&value, "the line")?;
    let v = take_u64(map, "v")?;
    if v != LINE_VERSION {
        return Err(bad(format!(
            "line format v{v}; this build reads v{LINE_VERSION}"
        )));
    }
    only_known(map, "the line", LINE_FIELDS)?;
    let key = Key::new(take_bytes(map, "scope")?, take_bytes(map, "id")?)?;
    let state = match map.get("state").and_then(Value::as_str) {
        Some("PROCESSING") => State::Processing,
        Some("DONE") => State::Done,
        other => return Err(bad(format!("unknown state {other:?}"))),
    };
    let fp = map
        .get("fingerprint")
        .and_then(Value::as_str)
        .and_then(unhex)
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
        .ok_or_else(|| bad("\"fingerprint\" is not 64 hex digits"))?;
    let lease_until = match map.get("lease_until_ms") {
        None | Some(Value::Null) => None,
        Some(_) => Some(Timestamp::from_millis(take_u64(map, "lease_until_ms")?)),
    };
    let response = match map.get("response") {
        None | Some(Value::Null) => None,
        Some(r) => Some(response_from(object(r, "\"response\"")?)?),
    };
    let attempts =
        u32::try_from(take_u64(map, "attempts")?).map_err(|_| bad("\"attempts\" is too large"))?;
    let steps = named_list(map, "steps", "a step", "output")?.into_iter();
    let steps: Vec<Step> = steps
        .map(|(name, out)| Step::new(name, out))
        .collect::<Result<_>>()?;
    let record = Record {
        fingerprint: Fingerprint::from_bytes(fp),
        state,
        response,
        lease_until,
        expires_at: Timestamp::from_millis(take_u64(map, "expires_at_ms")?),
        created_at: Timestamp::from_millis(take_u64(map, "created_at_ms")?),
        token: take_u64(map, "token")?,
        attempts,
        steps,
    };
    record
        .check()
        .map_err(|why| bad(format!("record for {key}: {why}")))?;
    Ok((key, record))
}

fn response_from(map: &Map<String, Value>) -> Result<Response> {
    only_known(map, "\"response\"", RESPONSE_FIELDS)?;
    let status =
        u16::try_from(take_u64(map, "status")?).map_err(|_| bad("\"status\" is not a u16"))?;
    let response = Response {
        status,
        headers: named_list(map, "headers", "a header", "value")?,
        body: take_bytes(map, "body")?,
    };
    // The same limits a store enforces on `complete`, at their widest.
    response.check_limits(MAX_BODY_BYTES_HARD_CAP)?;
    Ok(response)
}

/// The list of [`named`] objects under `list`, as (name, bytes) pairs.
fn named_list(
    map: &Map<String, Value>,
    list: &str,
    what: &str,
    field: &str,
) -> Result<Vec<(String, Vec<u8>)>> {
    let Some(items) = map.get(list) else {
        return Ok(Vec::new());
    };
    let items = items
        .as_array()
        .ok_or_else(|| bad(format!("{list:?} is not an array")))?;
    items
        .iter()
        .map(|item| {
            let item = object(item, what)?;
            only_known(item, what, &["name", field])?;
            let name = item.get("name").and_then(Value::as_str);
            let name = name.ok_or_else(|| bad(format!("{what} has no \"name\"")))?;
            Ok((name.to_owned(), take_bytes(item, field)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done() -> (Key, Record) {
        let key = Key::new(b"t\xff".as_slice(), "order-1").expect("key");
        let record = Record {
            fingerprint: Fingerprint::of(b"x"),
            state: State::Done,
            response: Some(
                Response::new(201, vec![0u8, 159, 146, 150])
                    .with_header("content-type", "application/octet-stream")
                    .with_header("x-raw", vec![0xffu8]),
            ),
            lease_until: None,
            expires_at: Timestamp::from_millis(2_000),
            created_at: Timestamp::from_millis(1_000),
            token: 7,
            attempts: 2,
            steps: Vec::new(),
        };
        (key, record)
    }

    #[test]
    fn lines_round_trip_text_and_binary() {
        let (key, record) = done();
        let line = to_json(&key, &record).to_string();
        assert!(line.contains("\"scope_b64\":\"dP8=\""), "{line}");
        assert!(line.contains("\"id\":\"order-1\""), "{line}");
        assert!(line.contains("\"body_b64\""), "{line}");
        assert_eq!(parse_line(&line).expect("parses"), (key, record));
        let processing = Record {
            state: State::Processing,
            response: None,
            lease_until: Some(Timestamp::from_millis(1_500)),
            ..done().1
        };
        let line = to_json(&done().0, &processing).to_string();
        assert_eq!(parse_line(&line).expect("parses").1, processing);
        // Steps, a text output and a binary one, in order.
        let stepped = Record {
            steps: vec![
                Step::new("charge", b"ch_1".to_vec()).expect("valid"),
                Step::new("reserve", vec![0xff, 0]).expect("valid"),
            ],
            ..processing
        };
        let line = to_json(&done().0, &stepped).to_string();
        assert!(
            line.contains(r#""steps":[{"name":"charge","output":"ch_1"},{"name":"reserve","output_b64":"/wA="}]"#),
            "{line}"
        );
        assert_eq!(parse_line(&line).expect("parses").1, stepped);
        // A step over its limits, or an unknown field in one, is refused.
        let long = line.replace("\"charge\"", &format!("\"{}\"", "c".repeat(65)));
        assert!(matches!(parse_line(&long), Err(Error::StepLimit { .. })));
        let odd = line.replace(r#""output":"ch_1""#, r#""output":"ch_1","at":1"#);
        assert!(matches!(
            parse_line(&odd),
            Err(Error::InvalidArgument { .. })
        ));
    }

    #[test]
    fn hex_digits_decode_in_pairs() {
        assert_eq!(unhex("ff0010"), Some(vec![0xff, 0x00, 0x10]));
        assert_eq!(unhex("f"), None);
        assert_eq!(unhex("zz"), None);
    }

    #[test]
    fn bad_lines_are_errors_naming_the_field() {
        let (key, record) = done();
        let mut v = to_json(&key, &record);
        v["fingerprint"] = json!("abc");
        let err = parse_line(&v.to_string()).expect_err("short fingerprint");
        assert!(err.to_string().contains("fingerprint"), "{err}");
        v = to_json(&key, &record);
        v["lease_until_ms"] = json!(5);
        let err = parse_line(&v.to_string()).expect_err("DONE with a lease");
        assert!(err.to_string().contains("DONE record"), "{err}");
        v = to_json(&key, &record);
        let many: Vec<Value> = (0..=crate::response::MAX_HEADERS)
            .map(|i| json!({"name": format!("h{i}"), "value": "v"}))
            .collect();
        v["response"]["headers"] = Value::Array(many);
        let err = parse_line(&v.to_string()).expect_err("over the header limit");
        assert!(matches!(err, Error::ResponseTooLarge { .. }), "{err}");
        v = to_json(&key, &record);
        v["v"] = json!(2);
        assert!(parse_line(&v.to_string()).is_err());
        assert!(parse_line("not json").is_err());
    }

    #[test]
    fn unknown_fields_are_refused_wherever_they_are() {
        let (key, record) = done();
        assert!(parse_line(&to_json(&key, &record).to_string()).is_ok());
        let mut v = to_json(&key, &record);
        v["tenant"] = json!("acme");
        let err = parse_line(&v.to_string()).expect_err("unknown top-level field");
        assert!(
            err.to_string()
                .contains(r#"unknown field "tenant" in the line"#),
            "{err}"
        );
        v = to_json(&key, &record);
        v["response"]["trailers"] = json!([]);
        let err = parse_line(&v.to_string()).expect_err("unknown response field");
        assert!(err.to_string().contains(r#""trailers""#), "{err}");
        v = to_json(&key, &record);
        v["response"]["headers"] = json!([{"name": "a", "value": "b", "x": 1}]);
        let err = parse_line(&v.to_string()).expect_err("unknown header field");
        assert!(err.to_string().contains("in a header"), "{err}");
        // The base64 forms of the byte fields are known ones.
        v = to_json(&key, &record);
        let obj = v.as_object_mut().expect("object");
        let id = obj.remove("id").expect("id");
        obj.insert(
            "id_b64".into(),
            json!(STANDARD.encode(id.as_str().expect("text"))),
        );
        assert!(parse_line(&v.to_string()).is_ok(), "{v}");
    }
}
