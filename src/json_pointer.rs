//! [`JsonPointer`]: an RFC 6901 JSON Pointer, checked once when it is made.

use crate::error::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// Longest JSON Pointer, in bytes (a field path, not data: a pointer this
/// long is a configuration mistake).
pub const MAX_POINTER_BYTES: usize = 1024;

/// Most JSON Pointers one fingerprint selects
/// ([`IdempotencyLayer::fingerprint_json_fields`], `idemstore fingerprint
/// --json-field`).
///
/// [`IdempotencyLayer::fingerprint_json_fields`]: https://docs.rs/idemstore/latest/idemstore/tower/struct.IdempotencyLayer.html#method.fingerprint_json_fields
pub const MAX_JSON_FIELDS: usize = 64;

/// A field of a JSON document, named by an RFC 6901 JSON Pointer: `""` (the
/// whole document) or `/`-separated reference tokens, with `~1` for a `/`
/// and `~0` for a `~` inside a member name (`/a~1b` is the member `"a/b"`).
/// A token selects an object member by name or an array element by index
/// (`/items/0/sku`).
///
/// The pointer is checked when it is made, so a mistake is found where the
/// configuration is written and never when a request arrives: it must be
/// empty or start with `/`, every `~` must be followed by `0` or `1`, and it
/// is at most [`MAX_POINTER_BYTES`]. A bad one is
/// [`Error::InvalidArgument`] saying why.
///
/// ```
/// use idemstore::{Error, JsonPointer};
/// use serde_json::json;
///
/// let amount = JsonPointer::new("/payment/amount")?;
/// let doc = json!({"payment": {"amount": 1250, "currency": "EUR"}, "trace_id": "t-9"});
/// assert_eq!(amount.get(&doc), Some(&json!(1250)));
/// assert_eq!(JsonPointer::new("/payment/fee")?.get(&doc), None); // absent
///
/// let err = JsonPointer::new("amount").unwrap_err(); // no leading "/"
/// assert!(matches!(err, Error::InvalidArgument { .. }));
/// assert!(err.to_string().contains("must be empty or start with \"/\""), "{err}");
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JsonPointer(Box<str>);

impl JsonPointer {
    /// Checks `pointer` (RFC 6901, in its JSON string form, not a URI
    /// fragment).
    ///
    /// ```
    /// use idemstore::JsonPointer;
    /// assert!(JsonPointer::new("").is_ok()); // the whole document
    /// assert!(JsonPointer::new("/a~1b/0").is_ok());
    /// assert!(JsonPointer::new("/a~2").is_err()); // `~` escapes only 0 and 1
    /// assert!(JsonPointer::new("#/a").is_err()); // a URI fragment, not a pointer
    /// ```
    pub fn new(pointer: impl Into<String>) -> Result<JsonPointer> {
        let pointer = pointer.into();
        check(&pointer)?;
        Ok(JsonPointer(pointer.into_boxed_str()))
    }

    /// The pointer as written (`/a~1b`).
    ///
    /// ```
    /// assert_eq!(idemstore::JsonPointer::new("/a~1b")?.as_str(), "/a~1b");
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The value this pointer selects in `document`, or `None` when the
    /// field is absent (a missing member, an index past the end or not a
    /// plain decimal such as `01` or `-`, or a token that goes into a
    /// string, number, boolean or null).
    ///
    /// ```
    /// use idemstore::JsonPointer;
    /// use serde_json::json;
    /// let doc = json!({"items": [{"sku": "A"}], "a/b": 1, "m~n": 2});
    /// assert_eq!(JsonPointer::new("/items/0/sku")?.get(&doc), Some(&json!("A")));
    /// assert_eq!(JsonPointer::new("/items/1/sku")?.get(&doc), None);
    /// assert_eq!(JsonPointer::new("/a~1b")?.get(&doc), Some(&json!(1)));
    /// assert_eq!(JsonPointer::new("/m~0n")?.get(&doc), Some(&json!(2)));
    /// assert_eq!(JsonPointer::new("")?.get(&doc), Some(&doc));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn get<'v>(&self, document: &'v serde_json::Value) -> Option<&'v serde_json::Value> {
        // serde_json implements RFC 6901 lookup (unescaping `~1` before
        // `~0`, array indices without leading zeros); the checks above
        // leave it no malformed pointer to guess about.
        document.pointer(&self.0)
    }
}

/// Why `pointer` is not an RFC 6901 JSON Pointer, if it is not one.
fn check(pointer: &str) -> Result<()> {
    let invalid = |why: String| {
        Err(Error::invalid_argument(format!(
            "{pointer:?} is not a JSON Pointer (RFC 6901): {why}"
        )))
    };
    if pointer.len() > MAX_POINTER_BYTES {
        return invalid(format!(
            "it is {} bytes; at most {MAX_POINTER_BYTES} are allowed",
            pointer.len()
        ));
    }
    if !pointer.is_empty() && !pointer.starts_with('/') {
        return invalid("it must be empty or start with \"/\"".to_owned());
    }
    let bytes = pointer.as_bytes();
    for (at, _) in pointer.match_indices('~') {
        if !matches!(bytes.get(at + 1), Some(b'0' | b'1')) {
            return invalid(format!(
                "the `~` at byte {at} is not followed by 0 or 1 (write `~0` for `~` and `~1` for `/`)"
            ));
        }
    }
    Ok(())
}

impl FromStr for JsonPointer {
    type Err = Error;

    /// [`JsonPointer::new`].
    ///
    /// ```
    /// let p: idemstore::JsonPointer = "/amount".parse()?;
    /// assert_eq!(p.as_str(), "/amount");
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    fn from_str(pointer: &str) -> Result<JsonPointer> {
        JsonPointer::new(pointer)
    }
}

impl TryFrom<&str> for JsonPointer {
    type Error = Error;

    fn try_from(pointer: &str) -> Result<JsonPointer> {
        JsonPointer::new(pointer)
    }
}

impl TryFrom<String> for JsonPointer {
    type Error = Error;

    fn try_from(pointer: String) -> Result<JsonPointer> {
        JsonPointer::new(pointer)
    }
}

impl AsRef<str> for JsonPointer {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JsonPointer({:?})", self.0)
    }
}

impl fmt::Display for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn accepts_what_rfc_6901_does_and_nothing_else() {
        for good in ["", "/", "/a", "/a/0", "/a~0b~1c", "//", "/ ", "/é"] {
            assert!(JsonPointer::new(good).is_ok(), "{good:?}");
        }
        for bad in ["a", "#/a", "~0", "/a~", "/a~2", "/~a", " /a"] {
            let err = JsonPointer::new(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{bad:?}");
            assert!(err.to_string().contains("RFC 6901"), "{err}");
        }
        assert!(JsonPointer::new(format!("/{}", "a".repeat(MAX_POINTER_BYTES - 1))).is_ok());
        assert!(JsonPointer::new(format!("/{}", "a".repeat(MAX_POINTER_BYTES))).is_err());
    }

    #[test]
    fn lookup_follows_the_rfc_examples() {
        // RFC 6901, section 5.
        let doc = json!({
            "foo": ["bar", "baz"], "": 0, "a/b": 1, "c%d": 2, "e^f": 3,
            "g|h": 4, "i\\j": 5, "k\"l": 6, " ": 7, "m~n": 8
        });
        let at = |p: &str| JsonPointer::new(p).unwrap().get(&doc).cloned();
        assert_eq!(at(""), Some(doc.clone()));
        assert_eq!(at("/foo"), Some(json!(["bar", "baz"])));
        assert_eq!(at("/foo/0"), Some(json!("bar")));
        for (p, v) in [
            ("/", 0),
            ("/a~1b", 1),
            ("/c%d", 2),
            ("/e^f", 3),
            ("/g|h", 4),
            ("/i\\j", 5),
            ("/k\"l", 6),
            ("/ ", 7),
            ("/m~0n", 8),
        ] {
            assert_eq!(at(p), Some(json!(v)), "{p}");
        }
        // Absent, not an error: past the end, not an index, into a scalar.
        for p in ["/foo/2", "/foo/01", "/foo/-", "/foo/0/x", "/nope"] {
            assert_eq!(at(p), None, "{p}");
        }
    }
}
