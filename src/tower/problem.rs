//! [`Problem`]: the layer's own answers, as RFC 9457 problem details.

use http::StatusCode;

/// An answer the layer gives itself, without the handler's response (see
/// the status table in the [module docs](crate::tower)): its HTTP status,
/// and the RFC 9457 problem `type` and `title` of the
/// `application/problem+json` body. The body's `detail` says what happened
/// to this request.
///
/// Each `type` is this page's anchor for the variant, so a client (or a
/// person reading a log) can look it up; the titles are fixed per type.
///
/// ```
/// use idemstore::tower::Problem;
/// assert_eq!(Problem::InFlight.status(), http::StatusCode::CONFLICT);
/// assert_eq!(Problem::KeyReused.title(), "Idempotency-Key reused with another request");
/// assert!(Problem::KeyReused.type_uri().ends_with("#variant.KeyReused"));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Problem {
    /// 400: the route requires an `Idempotency-Key` and the request has none.
    KeyMissing,
    /// 400: the `Idempotency-Key` is not 1..=255 bytes of visible ASCII, or
    /// there are two.
    KeyInvalid,
    /// 400: the request body could not be read.
    BodyUnreadable,
    /// 400: the layer fingerprints JSON body fields
    /// ([`fingerprint_json_fields`](crate::tower::IdempotencyLayer::fingerprint_json_fields))
    /// and the body is not JSON, so the request's fingerprint cannot be
    /// computed: the handler does not run.
    BodyNotJson,
    /// 413 (Content Too Large): the request body is over the layer's limit.
    RequestTooLarge,
    /// 409 (Conflict) with `Retry-After`: a request with this key is being
    /// processed.
    InFlight,
    /// 422 (Unprocessable Content): the key was used with a different
    /// request (another fingerprint).
    KeyReused,
    /// 503 (Service Unavailable) with `Retry-After`: the idempotency store
    /// cannot answer; the request was not processed.
    StoreUnavailable,
    /// 500: an earlier attempt's lease ended with its outcome unknown and
    /// the guard's takeover policy is to reconcile first.
    OutcomeUnknown,
    /// 500: the key's scope (from the layer's scope function) is not a
    /// valid scope: a server bug.
    ScopeInvalid,
    /// 500: a stored response has a status or header HTTP does not accept.
    StoredResponseInvalid,
    /// 500: the handler's response body failed while it was read.
    ResponseBodyFailed,
}

/// Where the problem types are documented.
const TYPE_BASE: &str = "https://docs.rs/idemstore/latest/idemstore/tower/enum.Problem.html";

impl Problem {
    /// The HTTP status the layer answers with.
    ///
    /// ```
    /// assert_eq!(idemstore::tower::Problem::RequestTooLarge.status().as_u16(), 413);
    /// ```
    pub fn status(self) -> StatusCode {
        match self {
            Problem::KeyMissing
            | Problem::KeyInvalid
            | Problem::BodyUnreadable
            | Problem::BodyNotJson => StatusCode::BAD_REQUEST,
            Problem::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::InFlight => StatusCode::CONFLICT,
            Problem::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Problem::OutcomeUnknown
            | Problem::ScopeInvalid
            | Problem::StoredResponseInvalid
            | Problem::ResponseBodyFailed => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The problem `title`: a short summary of the type, the same for every
    /// occurrence.
    ///
    /// ```
    /// assert_eq!(idemstore::tower::Problem::RequestTooLarge.title(), "Request content too large");
    /// ```
    pub fn title(self) -> &'static str {
        match self {
            Problem::KeyMissing => "Idempotency-Key required",
            Problem::KeyInvalid => "Invalid Idempotency-Key",
            Problem::BodyUnreadable => "Request body unreadable",
            Problem::BodyNotJson => "Request body is not JSON",
            Problem::RequestTooLarge => "Request content too large",
            Problem::InFlight => "Request with this Idempotency-Key in progress",
            Problem::KeyReused => "Idempotency-Key reused with another request",
            Problem::StoreUnavailable => "Idempotency store unavailable",
            Problem::OutcomeUnknown => "Outcome of an earlier attempt unknown",
            Problem::ScopeInvalid => "Invalid idempotency scope",
            Problem::StoredResponseInvalid => "Stored response invalid",
            Problem::ResponseBodyFailed => "Response body failed",
        }
    }

    /// The problem `type`: a URI naming this kind of problem (its entry in
    /// these docs).
    ///
    /// ```
    /// let uri = idemstore::tower::Problem::InFlight.type_uri();
    /// assert_eq!(uri, "https://docs.rs/idemstore/latest/idemstore/tower/enum.Problem.html#variant.InFlight");
    /// ```
    pub fn type_uri(self) -> String {
        format!("{TYPE_BASE}#variant.{self:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Problem; 12] = [
        Problem::KeyMissing,
        Problem::KeyInvalid,
        Problem::BodyUnreadable,
        Problem::BodyNotJson,
        Problem::RequestTooLarge,
        Problem::InFlight,
        Problem::KeyReused,
        Problem::StoreUnavailable,
        Problem::OutcomeUnknown,
        Problem::ScopeInvalid,
        Problem::StoredResponseInvalid,
        Problem::ResponseBodyFailed,
    ];

    #[test]
    fn every_problem_has_its_own_type_and_title() {
        let types: std::collections::HashSet<_> = ALL.iter().map(|p| p.type_uri()).collect();
        let titles: std::collections::HashSet<_> = ALL.iter().map(|p| p.title()).collect();
        assert_eq!((types.len(), titles.len()), (ALL.len(), ALL.len()));
        for p in ALL {
            assert!(
                p.status().is_client_error() || p.status().is_server_error(),
                "{p:?}"
            );
            // No title is a status's reason phrase (old or new).
            assert_ne!(Some(p.title()), p.status().canonical_reason(), "{p:?}");
        }
    }
}
