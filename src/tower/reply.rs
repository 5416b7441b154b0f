//! Snapshots and the layer's own answers as HTTP responses (the request
//! side, key and fingerprint, is request.rs).

use super::body::ResponseBody;
use super::config::Config;
use super::header::IDEMPOTENT_REPLAYED;
use super::problem::Problem;
use crate::response::Response as Snapshot;
use crate::time::Timestamp;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header, response};
use std::time::Duration;

/// What is stored: status, headers minus the deny-list, body.
pub(crate) fn snapshot(parts: &response::Parts, body: &Bytes, deny: &[HeaderName]) -> Snapshot {
    let mut s = Snapshot::new(parts.status.as_u16(), body.to_vec());
    for (name, value) in &parts.headers {
        if !deny.contains(name) {
            s = s.with_header(name.as_str(), value.as_bytes());
        }
    }
    s
}

/// A stored response as an HTTP response; `replayed` adds `Idempotent-Replayed: true`.
pub(crate) fn from_snapshot<B>(
    config: &Config,
    s: Snapshot,
    replayed: bool,
) -> Response<ResponseBody<B>> {
    let (status, headers, body) = s.into_parts();
    let mut res = Response::new(ResponseBody::from_bytes(body));
    // A stored status or header that does not parse was not written by this
    // layer (it stores what `http` accepted); it is answered as an error
    // rather than half-replayed.
    let Ok(status) = StatusCode::from_u16(status) else {
        return problem(
            config,
            Problem::StoredResponseInvalid,
            "the stored response has an invalid status",
        );
    };
    *res.status_mut() = status;
    for (name, value) in headers {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) else {
            return problem(
                config,
                Problem::StoredResponseInvalid,
                "the stored response has an invalid header",
            );
        };
        res.headers_mut().append(name, value);
    }
    if replayed {
        res.headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    res
}

/// An RFC 9457 problem response (`application/problem+json`).
pub(crate) fn problem<B>(
    config: &Config,
    kind: Problem,
    detail: &str,
) -> Response<ResponseBody<B>> {
    let status = kind.status();
    let body = serde_json::json!({
        "type": config.problem_type(kind),
        "title": kind.title(),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut res = Response::new(ResponseBody::from_bytes(body.to_string()));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    res
}

/// A problem with `Retry-After: seconds` (rounded up, at least 1).
pub(crate) fn problem_retry_after<B>(
    config: &Config,
    kind: Problem,
    detail: &str,
    after: Duration,
) -> Response<ResponseBody<B>> {
    let mut res = problem(config, kind, detail);
    res.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from(retry_after_secs(after)),
    );
    res
}

/// The `Retry-After` value for `after`: whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    let secs = after.as_millis().div_ceil(1000).max(1);
    u64::try_from(secs).unwrap_or(u64::MAX)
}

/// How long until `lease_until`, from `now`.
pub(crate) fn remaining(now: Timestamp, lease_until: Timestamp) -> Duration {
    now.until(lease_until)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up() {
        let r = problem_retry_after::<()>(
            &Config::default(),
            Problem::InFlight,
            "x",
            Duration::from_millis(1001),
        );
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let r =
            problem_retry_after::<()>(&Config::default(), Problem::InFlight, "x", Duration::ZERO);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
