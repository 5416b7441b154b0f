//! What the layer reads from a request's body before the handler runs: the
//! key from a JSON field when there is no header
//! ([`key_from_json`](super::IdempotencyLayer::key_from_json)), and the
//! fingerprint, of the whole body or of JSON fields
//! ([`fingerprint_json_fields`](super::IdempotencyLayer::fingerprint_json_fields)).

use super::config::Config;
use super::header::check_id;
use crate::fingerprint::Fingerprint;
use crate::json_pointer::JsonPointer;
use bytes::Bytes;
use http::{HeaderValue, request};
use serde_json::Value;
use std::cell::OnceCell;

/// A request body read into memory, parsed as JSON at most once and only
/// when the configuration asks for a JSON field.
pub(crate) struct ReadBody {
    bytes: Bytes,
    json: OnceCell<Result<Value, String>>,
}

impl ReadBody {
    pub(crate) fn new(bytes: Bytes) -> ReadBody {
        ReadBody {
            bytes,
            json: OnceCell::new(),
        }
    }

    pub(crate) fn into_bytes(self) -> Bytes {
        self.bytes
    }

    /// The body as JSON, or why it is not.
    fn json(&self) -> Result<&Value, &str> {
        self.json
            .get_or_init(|| {
                serde_json::from_slice(&self.bytes)
                    .map_err(|e| format!("the request body is not JSON ({e})"))
            })
            .as_ref()
            .map_err(String::as_str)
    }
}

/// The key from the body's JSON field that the layer is configured to read
/// (`Ok(None)` when it reads none, the body is not JSON, or the field is
/// absent or `null`), or why the field is not a key (not a string, or not
/// 1..=255 bytes of visible ASCII, as a header's key must be).
pub(crate) fn key_from_body(config: &Config, body: &ReadBody) -> Result<Option<Vec<u8>>, String> {
    let (Some(pointer), Ok(doc)) = (&config.key_from_json, body.json()) else {
        return Ok(None);
    };
    let what = format!("the key field {pointer}");
    match pointer.get(doc) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(id)) => check_id(id.as_bytes().to_vec(), &what).map(Some),
        Some(other) => Err(format!("{what} is {}, not a string", json_type(other))),
    }
}

/// The `detail` of a 400 for a request without a key, naming where the
/// layer looks for one.
pub(crate) fn missing_key(config: &Config) -> String {
    match &config.key_from_json {
        None => "this request needs an Idempotency-Key header".to_owned(),
        Some(pointer) => format!(
            "this request needs an Idempotency-Key header, or a JSON body with the string \
             field {pointer}"
        ),
    }
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The fingerprint of a request: method, path and query, the body (its
/// bytes, or the configured JSON fields), then each configured header as
/// (name, number of values, values...), so that moving a value from one
/// header to another changes it. `Err` when JSON fields are configured
/// and the body is not JSON: the fingerprint cannot be computed.
pub(crate) fn fingerprint(
    parts: &request::Parts,
    body: &ReadBody,
    config: &Config,
) -> Result<Fingerprint, String> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let names = &config.fingerprint_headers;
    let values: Vec<Vec<&[u8]>> = names
        .iter()
        .map(|n| {
            parts
                .headers
                .get_all(n)
                .iter()
                .map(HeaderValue::as_bytes)
                .collect()
        })
        .collect();
    let headers: Vec<(&str, &[&[u8]])> = names
        .iter()
        .zip(&values)
        .map(|(n, v)| (n.as_str(), v.as_slice()))
        .collect();
    let method = parts.method.as_str();
    Ok(match &config.json_fields {
        None => Fingerprint::of_http(method, path, &body.bytes, &headers),
        Some(fields) => {
            let doc = body.json().map_err(|why| {
                format!(
                    "{why}: this route's requests are identified by the JSON fields {}",
                    list(fields)
                )
            })?;
            Fingerprint::of_http_json_fields(method, path, doc, fields, &headers)
        }
    })
}

/// `/a, /b`.
pub(crate) fn list(pointers: &[JsonPointer]) -> String {
    let names: Vec<&str> = pointers.iter().map(JsonPointer::as_str).collect();
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderName;

    fn config(change: impl FnOnce(&mut Config)) -> Config {
        let mut c = Config::default();
        change(&mut c);
        c
    }

    fn pointer(p: &str) -> JsonPointer {
        JsonPointer::new(p).unwrap()
    }

    fn body(text: &str) -> ReadBody {
        ReadBody::new(Bytes::from(text.to_owned()))
    }

    #[test]
    fn header_values_move_the_fingerprint() {
        let name = HeaderName::from_static("x-a");
        let with_header = config(|c| c.fingerprint_headers = vec![name.clone()]);
        let req = |v: &[&str]| {
            let mut b = http::Request::builder().method("POST").uri("/o?x=1");
            for v in v {
                b = b.header("x-a", *v);
            }
            b.body(()).unwrap().into_parts().0
        };
        let fp = |v: &[&str]| fingerprint(&req(v), &body("{}"), &with_header).unwrap();
        assert_eq!(fp(&["1"]), fp(&["1"]));
        assert_ne!(fp(&["1"]), fp(&["2"]));
        assert_ne!(fp(&["1", "2"]), fp(&["12"]));
        let plain = Config::default();
        assert_ne!(
            fingerprint(&req(&[]), &body(""), &plain).unwrap(),
            fingerprint(&req(&[]), &body("x"), &plain).unwrap()
        );
    }

    #[test]
    fn json_fields_are_the_fingerprint_of_the_body_and_need_json() {
        let fields = vec![pointer("/amount")];
        let c = config(|c| c.json_fields = Some(fields.clone()));
        let parts = http::Request::post("/p").body(()).unwrap().into_parts().0;
        let fp = fingerprint(&parts, &body(r#"{"amount": 5, "ts": 1}"#), &c).unwrap();
        let doc = serde_json::json!({"amount": 5});
        assert_eq!(
            fp,
            Fingerprint::of_http_json_fields("POST", "/p", &doc, &fields, &[])
        );
        assert_eq!(
            fp,
            fingerprint(&parts, &body(r#"{"ts": 2,  "amount":5}"#), &c).unwrap()
        );
        let why = fingerprint(&parts, &body("amount=5"), &c).unwrap_err();
        assert!(why.contains("not JSON") && why.contains("/amount"), "{why}");
        assert!(fingerprint(&parts, &body(""), &c).is_err());
    }

    #[test]
    fn a_key_field_is_held_to_the_headers_rules() {
        let c = config(|c| c.key_from_json = Some(pointer("/request_id")));
        let key = |text: &str| key_from_body(&c, &body(text));
        assert_eq!(key(r#"{"request_id": "r-1"}"#), Ok(Some(b"r-1".to_vec())));
        // No key: absent, null, or not JSON at all.
        for none in [r#"{"id": "r-1"}"#, r#"{"request_id": null}"#, "r-1", ""] {
            assert_eq!(key(none), Ok(None), "{none}");
        }
        for (bad, why) in [
            (r#"{"request_id": 7}"#, "is a number, not a string"),
            (r#"{"request_id": ""}"#, "is empty"),
            (r#"{"request_id": "a b"}"#, "not visible ASCII"),
        ] {
            let err = key(bad).unwrap_err();
            assert!(err.contains("/request_id") && err.contains(why), "{err}");
        }
        let long = format!(r#"{{"request_id": "{}"}}"#, "x".repeat(256));
        assert!(key(&long).is_err());
        // Without the option, the body is never read for a key.
        assert_eq!(
            key_from_body(&Config::default(), &body(r#"{"request_id": "r-1"}"#)),
            Ok(None)
        );
    }
}
