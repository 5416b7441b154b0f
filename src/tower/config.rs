//! The layer's configuration as data: the defaults, [`StorePolicy`],
//! [`DoNotStore`], and `Config`, what the layer's builder methods fill in
//! (layer.rs) and the service and its replies read (service.rs, reply.rs).

use super::problem::Problem;
use crate::json_pointer::JsonPointer;
use crate::response::DEFAULT_MAX_BODY_BYTES;
use http::{HeaderName, Method, header, request};
use std::sync::Arc;
use std::time::Duration;

/// Default limit on a request body read for the fingerprint (1 MiB); larger
/// bodies get 413 without reaching the handler.
pub(crate) const DEFAULT_MAX_REQUEST_BODY_BYTES: usize = 1024 * 1024;
/// Default `Retry-After` on a 503 when the store is unavailable.
pub(crate) const DEFAULT_UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Which handler responses are stored for replay.
///
/// ```
/// assert_eq!(idemstore::tower::StorePolicy::default(), idemstore::tower::StorePolicy::All);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StorePolicy {
    /// Every response, errors included (the IETF draft's and Stripe's
    /// practice: a retry sees exactly what the first attempt saw).
    #[default]
    All,
    /// Every response but 5xx: a server error is sent but not stored, and the
    /// claim is released so that a retry runs the handler again. Use it when
    /// your 5xx responses mean "nothing happened".
    AllButServerErrors,
}

/// A response extension that keeps one response out of the store: the
/// response is sent, nothing is stored, and the claim is released so that a
/// retry runs the handler again.
///
/// ```
/// use idemstore::tower::DoNotStore;
/// let mut res = http::Response::new(());
/// res.extensions_mut().insert(DoNotStore);
/// // in axum: `(StatusCode::ACCEPTED, axum::Extension(DoNotStore), "try later")`
/// assert!(res.extensions().get::<DoNotStore>().is_some());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DoNotStore;

pub(crate) type ScopeFn = Arc<dyn Fn(&request::Parts) -> Vec<u8> + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) scope: Option<ScopeFn>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    /// `Some`: the body is fingerprinted by these JSON fields (sorted,
    /// without repeats) instead of as bytes, and must be JSON.
    pub(crate) json_fields: Option<Vec<JsonPointer>>,
    /// `Some`: without an `Idempotency-Key` header, the key is this string
    /// field of a JSON body.
    pub(crate) key_from_json: Option<JsonPointer>,
    pub(crate) max_request_body_bytes: usize,
    pub(crate) max_response_body_bytes: usize,
    pub(crate) store_policy: StorePolicy,
    pub(crate) deny_headers: Vec<HeaderName>,
    pub(crate) unavailable_retry_after: Duration,
    /// Problem `type` URIs that replace [`Problem::type_uri`]'s.
    pub(crate) problem_types: std::collections::HashMap<Problem, String>,
}

impl Config {
    /// The `type` of `kind`'s problem bodies: the one set with
    /// [`IdempotencyLayer::problem_type`](super::IdempotencyLayer::problem_type), else [`Problem::type_uri`].
    pub(crate) fn problem_type(&self, kind: Problem) -> String {
        self.problem_types
            .get(&kind)
            .cloned()
            .unwrap_or_else(|| kind.type_uri())
    }
}

impl Default for Config {
    fn default() -> Config {
        Config {
            methods: vec![Method::POST, Method::PATCH],
            require_key: false,
            scope: None,
            fingerprint_headers: Vec::new(),
            json_fields: None,
            key_from_json: None,
            max_request_body_bytes: DEFAULT_MAX_REQUEST_BODY_BYTES,
            max_response_body_bytes: DEFAULT_MAX_BODY_BYTES,
            store_policy: StorePolicy::All,
            deny_headers: vec![header::SET_COOKIE, header::DATE],
            unavailable_retry_after: DEFAULT_UNAVAILABLE_RETRY_AFTER,
            problem_types: std::collections::HashMap::new(),
        }
    }
}
