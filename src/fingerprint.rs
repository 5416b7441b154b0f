//! [`Fingerprint`]: a 32-byte digest of the request parameters.

use crate::json_pointer::JsonPointer;
use sha2::{Digest, Sha256};
use std::fmt;

/// The 32-byte SHA-256 digest of what a request asks for.
///
/// Two requests with the same key and the same fingerprint are one intent
/// (a retry); the same key with a different fingerprint is a conflict and is
/// never answered with the stored response.
///
/// The constructors are domain-separated, so the same bytes hashed by two
/// of them give two fingerprints. Each one's layout is fixed (stored records
/// hold its digests): a new layout gets a new constructor and domain.
///
/// ```
/// use idemstore::Fingerprint;
///
/// let a = Fingerprint::of(b"sku=A&qty=1");
/// assert_eq!(a, Fingerprint::of(b"sku=A&qty=1"));
/// assert_ne!(a, Fingerprint::of(b"sku=A&qty=2"));
///
/// // Parts are length-prefixed: ("ab", "c") is not ("a", "bc").
/// assert_ne!(Fingerprint::of_parts(["ab", "c"]), Fingerprint::of_parts(["a", "bc"]));
///
/// // JSON object keys are sorted first: field order does not matter.
/// let x: serde_json::Value = serde_json::from_str(r#"{"sku":"A","qty":1}"#)?;
/// let y: serde_json::Value = serde_json::from_str(r#"{"qty":1,"sku":"A"}"#)?;
/// assert_eq!(Fingerprint::of_json(&x), Fingerprint::of_json(&y));
///
/// // Only the fields that identify the request: a retry's new trace id is
/// // still the same request.
/// let fields = [idemstore::JsonPointer::new("/sku")?, idemstore::JsonPointer::new("/qty")?];
/// let retry: serde_json::Value = serde_json::from_str(r#"{"qty":1,"sku":"A","trace":"t-2"}"#)?;
/// assert_eq!(Fingerprint::of_json_fields(&x, &fields), Fingerprint::of_json_fields(&retry, &fields));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; 32]);

const DOMAIN_BYTES: &[u8] = b"idemstore/fp/bytes/v1\0";
const DOMAIN_PARTS: &[u8] = b"idemstore/fp/parts/v1\0";
const DOMAIN_JSON: &[u8] = b"idemstore/fp/json/v1\0";
const DOMAIN_JSON_FIELDS: &[u8] = b"idemstore/fp/json-fields/v1\0";
const DOMAIN_HTTP_JSON_FIELDS: &[u8] = b"idemstore/fp/http-json-fields/v1\0";

/// In [`Fingerprint::of_json_fields`]: the field is absent, or present
/// (then its canonical JSON follows, length-prefixed).
const FIELD_ABSENT: u8 = 0;
const FIELD_PRESENT: u8 = 1;

impl Fingerprint {
    /// Digest of one byte string.
    pub fn of(bytes: impl AsRef<[u8]>) -> Fingerprint {
        let mut h = Sha256::new();
        h.update(DOMAIN_BYTES);
        h.update(bytes.as_ref());
        Fingerprint(h.finalize().into())
    }

    /// Digest of ordered parts, each prefixed with its length (u64 big-endian),
    /// so that no two different part lists collide by concatenation.
    ///
    /// ```
    /// use idemstore::Fingerprint;
    /// let fp = Fingerprint::of_parts([&b"POST"[..], b"/orders", b"{\"qty\":1}"]);
    /// assert_ne!(fp, Fingerprint::of_parts([&b"POST"[..], b"/orders"]));
    /// ```
    pub fn of_parts<I, P>(parts: I) -> Fingerprint
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        digest_parts(DOMAIN_PARTS, parts)
    }

    /// The fingerprint the HTTP layer ([`IdempotencyLayer`]) computes for a
    /// request: [`of_parts`](Self::of_parts) of the method, the path and
    /// query, the body, then for each header the layer is configured to
    /// include (`fingerprint_headers`, in that order) its lower-case name,
    /// the number of its values (u64 big-endian) and the values in the
    /// order received. Moving a value from one header to another changes
    /// it. `idemstore fingerprint` computes the same from the command line.
    ///
    /// ```
    /// use idemstore::Fingerprint;
    /// let body = br#"{"sku":"A","qty":1}"#;
    /// let plain = Fingerprint::of_http("POST", "/orders", body, &[]);
    /// let tenant = Fingerprint::of_http("POST", "/orders", body, &[("x-tenant", &[b"acme"])]);
    /// assert_ne!(plain, tenant);
    /// // A configured header that is absent still counts (zero values).
    /// assert_ne!(plain, Fingerprint::of_http("POST", "/orders", body, &[("x-tenant", &[])]));
    /// assert_ne!(plain, Fingerprint::of_http("POST", "/orders?dry=1", body, &[]));
    /// ```
    ///
    /// [`IdempotencyLayer`]: https://docs.rs/idemstore/latest/idemstore/tower/struct.IdempotencyLayer.html
    pub fn of_http(
        method: &str,
        path_and_query: &str,
        body: &[u8],
        headers: &[(&str, &[&[u8]])],
    ) -> Fingerprint {
        http_digest(DOMAIN_PARTS, method, path_and_query, body, headers)
    }

    /// The fingerprint the HTTP layer computes for a request when it is set
    /// to fingerprint JSON body fields (`fingerprint_json_fields`): the
    /// layout of [`of_http`](Self::of_http) under a domain of its own, with
    /// [`of_json_fields`](Self::of_json_fields)`(body, fields)` (32 bytes)
    /// where `of_http` has the body. `idemstore fingerprint --json-field`
    /// computes the same from the command line.
    ///
    /// ```
    /// use idemstore::{Fingerprint, JsonPointer};
    /// use serde_json::json;
    /// let fields = [JsonPointer::new("/amount")?, JsonPointer::new("/currency")?];
    /// let first = json!({"amount": 1250, "currency": "EUR", "sent_at": "10:00:00"});
    /// let retry = json!({"sent_at": "10:00:05", "currency": "EUR", "amount": 1250});
    /// let fp = |body: &serde_json::Value| Fingerprint::of_http_json_fields("POST", "/payments", body, &fields, &[]);
    /// assert_eq!(fp(&first), fp(&retry));
    /// assert_ne!(fp(&first), fp(&json!({"amount": 1251, "currency": "EUR"})));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn of_http_json_fields(
        method: &str,
        path_and_query: &str,
        body: &serde_json::Value,
        fields: &[JsonPointer],
        headers: &[(&str, &[&[u8]])],
    ) -> Fingerprint {
        let selected = Fingerprint::of_json_fields(body, fields);
        http_digest(
            DOMAIN_HTTP_JSON_FIELDS,
            method,
            path_and_query,
            selected.as_bytes(),
            headers,
        )
    }

    /// Digest of a JSON value in canonical form: object keys sorted (at every
    /// depth), no whitespace. Arrays keep their order.
    ///
    /// ```
    /// use idemstore::Fingerprint;
    /// use serde_json::json;
    /// assert_eq!(
    ///     Fingerprint::of_json(&json!({"a": {"y": 1, "x": 2}, "b": [1, 2]})),
    ///     Fingerprint::of_json(&json!({"b": [1, 2], "a": {"x": 2, "y": 1}})),
    /// );
    /// assert_ne!(Fingerprint::of_json(&json!([1, 2])), Fingerprint::of_json(&json!([2, 1])));
    /// ```
    pub fn of_json(value: &serde_json::Value) -> Fingerprint {
        let mut h = Sha256::new();
        h.update(DOMAIN_JSON);
        canonical_json(value, &mut h);
        Fingerprint(h.finalize().into())
    }

    /// Digest of the fields of a JSON document that identify a request,
    /// each named by a [`JsonPointer`], so that what a client changes on a
    /// retry (a timestamp, a trace id, the order of the members) does not
    /// turn the retry into a conflict.
    ///
    /// - The pointers are a set: their order and repeats do not matter.
    /// - A field that is absent counts as absent (which differs from every
    ///   value, `null` included); it is not an error.
    /// - Each value is taken in the canonical form of
    ///   [`of_json`](Self::of_json) (object keys sorted at every depth, no
    ///   whitespace), so key order and whitespace never matter. Numbers
    ///   are compared as written: `10` and `10.0` differ.
    ///
    /// The layout: SHA-256 of the domain `idemstore/fp/json-fields/v1\0`,
    /// the number of distinct pointers (u64 big-endian), then for each in
    /// byte order its length (u64 big-endian) and bytes, and either a `0`
    /// byte (absent) or a `1` byte, the canonical value's length (u64
    /// big-endian) and the value. Every piece is length-prefixed or of fixed
    /// size, so no two different selections share an encoding.
    ///
    /// ```
    /// use idemstore::{Fingerprint, JsonPointer};
    /// use serde_json::json;
    ///
    /// let fields = [JsonPointer::new("/amount")?, JsonPointer::new("/currency")?];
    /// let fp = |body: &serde_json::Value| Fingerprint::of_json_fields(body, &fields);
    /// let first = fp(&json!({"amount": 1250, "currency": "EUR", "trace_id": "a1"}));
    /// assert_eq!(first, fp(&json!({"trace_id": "b2", "currency": "EUR", "amount": 1250})));
    /// assert_ne!(first, fp(&json!({"amount": 1250, "currency": "USD"})));
    /// // Absent is not null.
    /// assert_ne!(fp(&json!({"amount": 1})), fp(&json!({"amount": 1, "currency": null})));
    /// // The pointers are a set.
    /// let reversed = [JsonPointer::new("/currency")?, JsonPointer::new("/amount")?];
    /// assert_eq!(first, Fingerprint::of_json_fields(&json!({"amount": 1250, "currency": "EUR"}), &reversed));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn of_json_fields(document: &serde_json::Value, fields: &[JsonPointer]) -> Fingerprint {
        let mut set: Vec<&JsonPointer> = fields.iter().collect();
        set.sort();
        set.dedup();
        let mut h = Sha256::new();
        h.update(DOMAIN_JSON_FIELDS);
        h.update((set.len() as u64).to_be_bytes());
        let mut value = Vec::new();
        for pointer in set {
            let pointer_bytes = pointer.as_str().as_bytes();
            h.update((pointer_bytes.len() as u64).to_be_bytes());
            h.update(pointer_bytes);
            match pointer.get(document) {
                None => h.update([FIELD_ABSENT]),
                Some(v) => {
                    value.clear();
                    canonical_json(v, &mut value);
                    h.update([FIELD_PRESENT]);
                    h.update((value.len() as u64).to_be_bytes());
                    h.update(&value);
                }
            }
        }
        Fingerprint(h.finalize().into())
    }

    /// A fingerprint from 32 bytes computed elsewhere (for example stored by
    /// an older system).
    ///
    /// ```
    /// let fp = idemstore::Fingerprint::from_bytes([7; 32]);
    /// assert_eq!(fp.as_bytes(), &[7; 32]);
    /// ```
    pub const fn from_bytes(bytes: [u8; 32]) -> Fingerprint {
        Fingerprint(bytes)
    }

    /// The 32 bytes.
    ///
    /// ```
    /// assert_eq!(idemstore::Fingerprint::of(b"x").as_bytes().len(), 32);
    /// ```
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex, 64 characters.
    ///
    /// ```
    /// assert_eq!(idemstore::Fingerprint::from_bytes([0xab; 32]).to_hex(), "ab".repeat(32));
    /// ```
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// SHA-256 of `domain` and `parts`, each part prefixed with its length (u64
/// big-endian): [`Fingerprint::of_parts`]'s layout.
fn digest_parts<I, P>(domain: &[u8], parts: I) -> Fingerprint
where
    I: IntoIterator<Item = P>,
    P: AsRef<[u8]>,
{
    let mut h = Sha256::new();
    h.update(domain);
    for part in parts {
        let part = part.as_ref();
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    Fingerprint(h.finalize().into())
}

/// [`Fingerprint::of_http`]'s parts (method, path and query, body, then
/// each header's name, number of values and values) under `domain`.
fn http_digest(
    domain: &[u8],
    method: &str,
    path_and_query: &str,
    body: &[u8],
    headers: &[(&str, &[&[u8]])],
) -> Fingerprint {
    let counts: Vec<[u8; 8]> = headers
        .iter()
        .map(|(_, values)| (values.len() as u64).to_be_bytes())
        .collect();
    let mut all: Vec<&[u8]> = vec![method.as_bytes(), path_and_query.as_bytes(), body];
    for ((name, values), count) in headers.iter().zip(&counts) {
        all.push(name.as_bytes());
        all.push(count);
        all.extend(values.iter().copied());
    }
    digest_parts(domain, all)
}

/// Where canonical JSON goes: straight into a digest, or into a buffer
/// when its length must come first.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Sha256 {
    fn put(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Writes the canonical serialisation of `value` to `h`. serde_json's own
/// string escaping is reused for strings and numbers, so the output is
/// valid compact JSON with sorted object keys.
fn canonical_json(value: &serde_json::Value, h: &mut impl Sink) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            h.put(b"{");
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    h.put(b",");
                }
                h.put(Value::String(k.clone()).to_string().as_bytes());
                h.put(b":");
                canonical_json(v, h);
            }
            h.put(b"}");
        }
        Value::Array(items) => {
            h.put(b"[");
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    h.put(b",");
                }
                canonical_json(v, h);
            }
            h.put(b"]");
        }
        scalar => h.put(scalar.to_string().as_bytes()),
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn constructors_are_domain_separated() {
        assert_ne!(Fingerprint::of(b"abc"), Fingerprint::of_parts(["abc"]));
        assert_ne!(Fingerprint::of(b"1"), Fingerprint::of_json(&json!(1)));
    }

    #[test]
    fn json_nested_keys_sorted_and_types_distinct() {
        assert_ne!(
            Fingerprint::of_json(&json!("1")),
            Fingerprint::of_json(&json!(1))
        );
        assert_ne!(
            Fingerprint::of_json(&json!({"a": "b,c"})),
            Fingerprint::of_json(&json!({"a": "b", "c": null}))
        );
    }

    #[test]
    fn digests_are_pinned() {
        // Stored fingerprints must not change under a refactor: these are
        // SHA-256 of the documented domain prefix and layout, computed independently.
        assert_eq!(
            Fingerprint::of(b"sku=A&qty=1").to_hex(),
            "c62e4347747184340881dfca22f7607d7e0771caea4adf5ec8b8c45e67fa399b"
        );
        assert_eq!(
            Fingerprint::of_parts(["ab", "c"]).to_hex(),
            "4e27e076353d00727dfddd56f2c570730d08254d2e0aebcee0130bf4f8415a57"
        );
        assert_eq!(
            Fingerprint::of_json(&json!({"b": null, "a": [1, "x"]})).to_hex(),
            "cb6823fbda3e69e2c51209cc9c7efe8d0bb91d62c38e44967092443de1e15e6b"
        );
        assert_eq!(
            Fingerprint::of_http(
                "POST",
                "/orders?dry=1",
                br#"{"qty":1}"#,
                &[("x-tenant", &[b"acme", b"beta"]), ("x-b", &[])]
            )
            .to_hex(),
            "64d4f24798ad5b1bc63809bb0c4c5840cfb697f47076791ff587bec25223d905"
        );
    }

    fn pointers(ps: &[&str]) -> Vec<JsonPointer> {
        ps.iter().map(|p| JsonPointer::new(*p).unwrap()).collect()
    }

    #[test]
    fn json_field_digests_are_pinned() {
        // The layout documented on `of_json_fields` and `of_http_json_fields`,
        // computed independently (Python's hashlib over the documented
        // bytes): a change of the format fails here, not in a stored record.
        let doc = json!({
            "amount": 1250, "currency": "EUR", "trace": "t-1",
            "meta": {"b": 1, "a": [true, null]}
        });
        let fields = pointers(&["/currency", "/amount", "/missing", "/meta", "/amount"]);
        assert_eq!(
            Fingerprint::of_json_fields(&doc, &fields).to_hex(),
            "571b419af133fe96f12ed7f8fc766cfaf4b7b9eef8be0ad44c33063d74c31259"
        );
        assert_eq!(
            Fingerprint::of_http_json_fields(
                "POST",
                "/payments?x=1",
                &doc,
                &fields,
                &[("x-tenant", &[b"acme"])]
            )
            .to_hex(),
            "4c0d88637bc43a53f8eb68c5e81b64cfe1d5ba6584f7c131fbf0168d075c7611"
        );
    }

    #[test]
    fn json_fields_are_domain_separated() {
        let doc = json!({"a": 1});
        let whole = pointers(&[""]);
        // The whole document through a pointer is not `of_json` of it.
        assert_ne!(
            Fingerprint::of_json_fields(&doc, &whole),
            Fingerprint::of_json(&doc)
        );
        // The HTTP form with fields is not `of_http` with the fields'
        // digest as the body, nor with the body itself.
        let fields = pointers(&["/a"]);
        let selected = Fingerprint::of_json_fields(&doc, &fields);
        let http = Fingerprint::of_http_json_fields("POST", "/p", &doc, &fields, &[]);
        assert_ne!(
            http,
            Fingerprint::of_http("POST", "/p", selected.as_bytes(), &[])
        );
        assert_ne!(http, Fingerprint::of_http("POST", "/p", br#"{"a":1}"#, &[]));
    }

    #[test]
    fn json_field_selections_never_collide_by_splitting() {
        // Two pointers and their values must not read as another split of
        // the same characters: ("/a", "/b") against ("/a/b") and ("/ab"),
        // a value that looks like the next entry, absent against null.
        let fp =
            |doc: serde_json::Value, ps: &[&str]| Fingerprint::of_json_fields(&doc, &pointers(ps));
        let both = fp(json!({"a": 1, "b": 2}), &["/a", "/b"]);
        assert_ne!(both, fp(json!({"a": {"b": 2}}), &["/a/b"]));
        assert_ne!(both, fp(json!({"ab": 12}), &["/ab"]));
        assert_ne!(both, fp(json!({"a": 1}), &["/a"]));
        assert_ne!(
            fp(json!({"a": "1\"/b\":2"}), &["/a"]),
            fp(json!({"a": "1", "b": 2}), &["/a", "/b"])
        );
        assert_ne!(fp(json!({}), &["/a"]), fp(json!({"a": null}), &["/a"]));
        assert_ne!(fp(json!({}), &["/a"]), fp(json!({}), &["/b"]));
        assert_ne!(fp(json!({}), &[]), fp(json!({}), &["/a"]));
        // Member names with `/` and `~` are escaped, so they are fields of their own.
        assert_ne!(
            fp(json!({"a/b": 1, "a": {"b": 2}}), &["/a~1b"]),
            fp(json!({"a/b": 1, "a": {"b": 2}}), &["/a/b"])
        );
    }

    #[test]
    fn json_fields_ignore_order_whitespace_and_repeats() {
        let fields = pointers(&["/order", "/qty"]);
        let a: serde_json::Value =
            serde_json::from_str(r#"{"qty": 2, "order": {"sku": "A", "note": null}, "ts": 1}"#)
                .unwrap();
        let b: serde_json::Value =
            serde_json::from_str(r#"{"ts":2,"order":{"note":null,"sku":"A"},"qty":2}"#).unwrap();
        assert_eq!(
            Fingerprint::of_json_fields(&a, &fields),
            Fingerprint::of_json_fields(&b, &fields)
        );
        let repeated = pointers(&["/qty", "/order", "/qty"]);
        assert_eq!(
            Fingerprint::of_json_fields(&a, &fields),
            Fingerprint::of_json_fields(&a, &repeated)
        );
        // Array order is part of the value.
        assert_ne!(
            Fingerprint::of_json_fields(&json!({"qty": [1, 2]}), &fields),
            Fingerprint::of_json_fields(&json!({"qty": [2, 1]}), &fields)
        );
    }
}
