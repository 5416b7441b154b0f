//! [`Policy`]: the layer's effective idempotency policy, to publish as JSON
//! or text (the IETF Idempotency-Key draft asks a resource to publish its
//! idempotency specification, expiry included).

use super::config::{Config, StorePolicy};
use super::problem::Problem;
use super::reply::retry_after_secs;
use crate::json_pointer::JsonPointer;
use crate::key::MAX_ID_BYTES;
use http::{HeaderName, Method};
use serde_json::{Value, json};
use std::fmt;
use std::time::Duration;

/// The version of [`Policy::to_json`]'s document (its `version` key). Keys
/// are only ever added within a version; a key whose meaning changes, or
/// that goes away, takes a new version.
const POLICY_VERSION: u32 = 1;

/// What an [`IdempotencyLayer`](super::IdempotencyLayer) does, as
/// configured: its published idempotency policy, from
/// [`IdempotencyLayer::policy`](super::IdempotencyLayer::policy).
///
/// [`to_json`](Policy::to_json) renders it for clients (serve it, say, at
/// `GET /idempotency-policy`; `Policy` is also `serde::Serialize`, as that
/// document) and [`Display`](fmt::Display) as text for people. The fields
/// are public to read; the struct is `#[non_exhaustive]`, so new settings
/// become new fields.
///
/// # The JSON document
///
/// Its keys are stable: within `version` 1 keys are only added, never
/// renamed, removed or given another meaning. Durations are whole
/// milliseconds (`_ms`), except `retry_after_s`, which is the
/// `Retry-After` header's value in seconds.
///
/// | key | value |
/// |---|---|
/// | `version` | `1` |
/// | `methods` | the guarded methods, e.g. `["POST", "PATCH"]`; others pass through |
/// | `key.header` | `"Idempotency-Key"` |
/// | `key.json_field` | the JSON Pointer of the body field read for the key when the header is absent, or `null` |
/// | `key.required` | `true`: a request without a key gets 400; `false`: it passes through unguarded |
/// | `key.scoped` | `true` when keys are scoped per caller (a tenant, an account) |
/// | `key.max_bytes` | `255`: a key is 1..=255 bytes of visible ASCII |
/// | `fingerprint.method`, `fingerprint.path_and_query` | `true`: both are always part of it |
/// | `fingerprint.body` | `"bytes"` (the whole body) or `"json_fields"` (only `json_fields`; the body must be JSON) |
/// | `fingerprint.json_fields` | the JSON Pointers, sorted, or `null` |
/// | `fingerprint.headers` | the request headers that are part of it, in order |
/// | `retention_ms` | how long a key is remembered: a retry within it gets the first response |
/// | `lease_ms` | how long a first request may run before a retry may take over |
/// | `renewal` | `{"every_ms": …}`: the lease is renewed this often while its request runs, so a retry takes over only one lease after the last renewal (the first request's process died); `null`: not renewed |
/// | `limits.request_body_bytes` | the largest request body (413 above) |
/// | `limits.stored_response_body_bytes` | the largest response that is stored (a larger one is sent, not stored) |
/// | `stored_responses` | `"all"` or `"all_but_server_errors"` |
/// | `omitted_headers` | response headers never stored or replayed |
/// | `replayed_header` | `"Idempotent-Replayed"`, set on a replay |
/// | `in_flight` | `{"status": 409, "retry_after": "lease_remaining"}` |
/// | `key_reused` | `{"status": 422}`: the same key with another fingerprint |
/// | `unavailable` | `{"status": 503, "retry_after_s": …}`: the store is down and the request was not processed |
///
/// ```
/// use idemstore::{Guard, MemoryStore, tower::IdempotencyLayer};
/// use std::time::Duration;
///
/// let guard = Guard::builder(MemoryStore::new()).retention(Duration::from_secs(48 * 3600)).build()?;
/// let layer = IdempotencyLayer::new(guard)
///     .require_key(true)
///     .fingerprint_json_fields(["/amount", "/currency"])?;
/// let policy = layer.policy();
/// assert_eq!(policy.retention, Duration::from_secs(48 * 3600));
///
/// let doc = policy.to_json();
/// assert_eq!(doc["retention_ms"], 172_800_000);
/// assert_eq!(doc["key"]["required"], true);
/// assert_eq!(doc["fingerprint"]["json_fields"], serde_json::json!(["/amount", "/currency"]));
/// assert_eq!(doc["unavailable"]["status"], 503);
/// assert!(policy.to_string().contains("JSON body fields /amount, /currency"));
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    /// The guarded methods; requests with other methods pass through.
    pub methods: Vec<Method>,
    /// Whether a guarded request without a key gets 400 (`true`) or
    /// passes through unguarded (`false`).
    pub key_required: bool,
    /// The JSON body field read for the key when the request has no
    /// `Idempotency-Key` header.
    pub key_json_field: Option<JsonPointer>,
    /// Whether the key is scoped by a function of the request (the same
    /// key from two tenants is two keys).
    pub key_scoped: bool,
    /// `None`: the body's bytes are part of the fingerprint. `Some`: only
    /// these fields of it (sorted, without repeats), and it must be JSON.
    pub fingerprint_json_fields: Option<Vec<JsonPointer>>,
    /// The request headers that are part of the fingerprint, in order.
    pub fingerprint_headers: Vec<HeaderName>,
    /// How long a key is remembered (the guard's retention).
    pub retention: Duration,
    /// How long a first request may run before a retry may take over (the
    /// guard's lease).
    pub lease: Duration,
    /// How often the lease of a running request is renewed (the guard's
    /// [`renewal_interval`](crate::Guard::renewal_interval)); `None`: it
    /// is not.
    pub renewal: Option<Duration>,
    /// The largest request body; a larger one gets 413.
    pub max_request_body_bytes: usize,
    /// The largest response body that is stored; a larger one is sent and
    /// not stored.
    pub max_response_body_bytes: usize,
    /// Which responses are stored.
    pub store_policy: StorePolicy,
    /// Response headers that are never stored, so never replayed.
    pub deny_headers: Vec<HeaderName>,
    /// The `Retry-After` of a 503 when the store is unavailable.
    pub unavailable_retry_after: Duration,
}

impl Policy {
    pub(crate) fn new(
        config: &Config,
        lease: Duration,
        renewal: Option<Duration>,
        retention: Duration,
    ) -> Policy {
        Policy {
            methods: config.methods.clone(),
            key_required: config.require_key,
            key_json_field: config.key_from_json.clone(),
            key_scoped: config.scope.is_some(),
            fingerprint_json_fields: config.json_fields.clone(),
            fingerprint_headers: config.fingerprint_headers.clone(),
            retention,
            lease,
            renewal,
            max_request_body_bytes: config.max_request_body_bytes,
            max_response_body_bytes: config.max_response_body_bytes,
            store_policy: config.store_policy,
            deny_headers: config.deny_headers.clone(),
            unavailable_retry_after: config.unavailable_retry_after,
        }
    }

    /// The policy as a JSON document with the stable keys of the table
    /// above.
    ///
    /// ```
    /// use idemstore::{Guard, MemoryStore, tower::IdempotencyLayer};
    /// let layer = IdempotencyLayer::new(Guard::new(MemoryStore::new())).key_from_json("/request_id")?;
    /// let doc = layer.policy().to_json();
    /// assert_eq!(doc["version"], 1);
    /// assert_eq!(doc["methods"], serde_json::json!(["POST", "PATCH"]));
    /// assert_eq!(doc["key"]["json_field"], "/request_id");
    /// assert_eq!(doc["fingerprint"]["body"], "bytes");
    /// assert_eq!(doc["retention_ms"], 24 * 3600 * 1000);
    /// assert_eq!(doc["renewal"]["every_ms"], 10_000); // a third of the 30 s lease
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn to_json(&self) -> Value {
        json!({
            "version": POLICY_VERSION,
            "methods": self.methods.iter().map(Method::as_str).collect::<Vec<_>>(),
            "key": {
                "header": "Idempotency-Key",
                "json_field": self.key_json_field.as_ref().map(JsonPointer::as_str),
                "required": self.key_required,
                "scoped": self.key_scoped,
                "max_bytes": MAX_ID_BYTES,
            },
            "fingerprint": {
                "method": true,
                "path_and_query": true,
                "body": if self.fingerprint_json_fields.is_some() { "json_fields" } else { "bytes" },
                "json_fields": self.fingerprint_json_fields.as_deref().map(pointers),
                "headers": names(&self.fingerprint_headers),
            },
            "retention_ms": millis(self.retention),
            "lease_ms": millis(self.lease),
            "renewal": self.renewal.map(|every| json!({ "every_ms": millis(every) })),
            "limits": {
                "request_body_bytes": self.max_request_body_bytes,
                "stored_response_body_bytes": self.max_response_body_bytes,
            },
            "stored_responses": match self.store_policy {
                StorePolicy::All => "all",
                StorePolicy::AllButServerErrors => "all_but_server_errors",
            },
            "omitted_headers": names(&self.deny_headers),
            "replayed_header": "Idempotent-Replayed",
            "in_flight": {
                "status": Problem::InFlight.status().as_u16(),
                "retry_after": "lease_remaining",
            },
            "key_reused": { "status": Problem::KeyReused.status().as_u16() },
            "unavailable": {
                "status": Problem::StoreUnavailable.status().as_u16(),
                "retry_after_s": retry_after_secs(self.unavailable_retry_after),
            },
        })
    }
}

/// One line per setting, for people (a log line at start-up, a text page).
///
/// ```
/// use idemstore::{Guard, MemoryStore, tower::IdempotencyLayer};
/// let text = IdempotencyLayer::new(Guard::new(MemoryStore::new())).policy().to_string();
/// assert!(text.contains("retention    24 h"), "{text}");
/// assert!(text.contains("fingerprint  method, path and query; body bytes"), "{text}");
/// ```
impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let methods: Vec<&str> = self.methods.iter().map(Method::as_str).collect();
        writeln!(f, "idempotency policy (version {POLICY_VERSION})")?;
        writeln!(f, "methods      {}", methods.join(", "))?;
        let source = match &self.key_json_field {
            None => "the Idempotency-Key header".to_owned(),
            Some(p) => format!("the Idempotency-Key header, else the JSON body field {p}"),
        };
        let presence = if self.key_required {
            "required"
        } else {
            "optional (a request without one is not guarded)"
        };
        let scoped = if self.key_scoped {
            ", scoped per caller"
        } else {
            ""
        };
        writeln!(
            f,
            "key          {source}; {presence}; 1..={MAX_ID_BYTES} bytes of visible ASCII{scoped}"
        )?;
        let mut parts = vec!["method, path and query".to_owned()];
        parts.push(match &self.fingerprint_json_fields {
            None => "body bytes".to_owned(),
            Some(fields) => format!(
                "JSON body fields {} (a JSON body is required; key order and whitespace do not count)",
                pointers(fields).join(", ")
            ),
        });
        if !self.fingerprint_headers.is_empty() {
            let headers = names(&self.fingerprint_headers).join(", ");
            parts.push(format!("headers {headers}"));
        }
        writeln!(f, "fingerprint  {}", parts.join("; "))?;
        writeln!(
            f,
            "retention    {}: a retry within it gets the first response, with Idempotent-Replayed: true",
            human(self.retention)
        )?;
        writeln!(
            f,
            "lease        {}: a retry meanwhile gets {} with Retry-After; after it, a retry takes over",
            human(self.lease),
            Problem::InFlight.status().as_u16()
        )?;
        match self.renewal {
            Some(every) => writeln!(
                f,
                "renewal      every {} while the request runs: a retry takes over only one lease after the last renewal",
                human(every)
            )?,
            None => writeln!(f, "renewal      none")?,
        }
        writeln!(
            f,
            "limits       request body {} bytes ({} above); responses over {} bytes are sent, not stored",
            self.max_request_body_bytes,
            Problem::RequestTooLarge.status().as_u16(),
            self.max_response_body_bytes
        )?;
        let stored = match self.store_policy {
            StorePolicy::All => "every response, errors included",
            StorePolicy::AllButServerErrors => "every response but 5xx",
        };
        let omitted = names(&self.deny_headers);
        if omitted.is_empty() {
            writeln!(f, "stored       {stored}")?;
        } else {
            writeln!(
                f,
                "stored       {stored}; headers never stored: {}",
                omitted.join(", ")
            )?;
        }
        writeln!(
            f,
            "key reused   {} for the same key with another fingerprint",
            Problem::KeyReused.status().as_u16()
        )?;
        write!(
            f,
            "unavailable  {} with Retry-After: {}; the request is not processed",
            Problem::StoreUnavailable.status().as_u16(),
            retry_after_secs(self.unavailable_retry_after)
        )
    }
}

impl serde::Serialize for Policy {
    /// As [`Policy::to_json`].
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(serializer)
    }
}

fn names(names: &[HeaderName]) -> Vec<&str> {
    names.iter().map(HeaderName::as_str).collect()
}

fn pointers(pointers: &[JsonPointer]) -> Vec<&str> {
    pointers.iter().map(JsonPointer::as_str).collect()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `24 h`, `90 min`, `30 s` or `1500 ms`: the largest unit that divides it.
fn human(d: Duration) -> String {
    let ms = millis(d);
    match ms {
        0 => "0 ms".to_owned(),
        ms if ms % 3_600_000 == 0 => format!("{} h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{} min", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{} s", ms / 1000),
        ms => format!("{ms} ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_in_their_largest_unit() {
        let cases = [
            (0, "0 ms"),
            (1500, "1500 ms"),
            (30_000, "30 s"),
            (90 * 60_000, "90 min"),
            (86_400_000, "24 h"),
        ];
        for (ms, text) in cases {
            assert_eq!(human(Duration::from_millis(ms)), text);
        }
    }

    #[test]
    fn the_default_policy_has_every_documented_key() {
        let p = Policy::new(
            &Config::default(),
            Duration::from_secs(30),
            Some(Duration::from_secs(10)),
            Duration::from_secs(60),
        );
        let doc = p.to_json();
        for key in [
            "version",
            "methods",
            "key",
            "fingerprint",
            "retention_ms",
            "lease_ms",
            "renewal",
            "limits",
            "stored_responses",
            "omitted_headers",
            "replayed_header",
            "in_flight",
            "key_reused",
            "unavailable",
        ] {
            assert!(doc.get(key).is_some(), "{key} missing in {doc}");
        }
        assert_eq!(doc["lease_ms"], 30_000);
        assert_eq!(doc["fingerprint"]["json_fields"], Value::Null);
        assert_eq!(doc["omitted_headers"], json!(["set-cookie", "date"]));
        assert_eq!(doc["unavailable"]["retry_after_s"], 1);
        assert_eq!(serde_json::to_value(&p).unwrap(), doc);
        let text = p.to_string();
        assert_eq!(text.lines().count(), 11, "{text}");
        assert!(text.contains("lease        30 s"), "{text}");
        assert_eq!(doc["renewal"], json!({ "every_ms": 10_000 }));
        assert!(text.contains("renewal      every 10 s"), "{text}");
        let off = Policy::new(
            &Config::default(),
            Duration::from_secs(30),
            None,
            Duration::from_secs(60),
        );
        assert_eq!(off.to_json()["renewal"], Value::Null);
        assert!(off.to_string().contains("renewal      none"));
    }
}
