//! [`Fingerprint`]: a 32-byte digest of the request parameters.

use sha2::{Digest, Sha256};
use std::fmt;

/// The 32-byte SHA-256 digest of what a request asks for.
///
/// Two requests with the same key and the same fingerprint are one intent
/// (a retry); the same key with a different fingerprint is a conflict and is
/// never answered with the stored response.
///
/// The three constructors are domain-separated, so the same bytes hashed by
/// two of them give two fingerprints.
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
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; 32]);

const DOMAIN_BYTES: &[u8] = b"idemstore/fp/bytes/v1\0";
const DOMAIN_PARTS: &[u8] = b"idemstore/fp/parts/v1\0";
const DOMAIN_JSON: &[u8] = b"idemstore/fp/json/v1\0";

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
        let mut h = Sha256::new();
        h.update(DOMAIN_PARTS);
        for part in parts {
            let part = part.as_ref();
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        Fingerprint(h.finalize().into())
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
        Fingerprint::of_parts(all)
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

/// Feeds the canonical serialisation of `value` into `h`. serde_json's own
/// string escaping is reused for strings and numbers, so the output is
/// valid compact JSON with sorted object keys.
fn canonical_json(value: &serde_json::Value, h: &mut Sha256) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            h.update(b"{");
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                h.update(Value::String(k.clone()).to_string().as_bytes());
                h.update(b":");
                canonical_json(v, h);
            }
            h.update(b"}");
        }
        Value::Array(items) => {
            h.update(b"[");
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                canonical_json(v, h);
            }
            h.update(b"]");
        }
        scalar => h.update(scalar.to_string().as_bytes()),
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
    }
}
