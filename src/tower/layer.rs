//! [`IdempotencyLayer`]: the builder of the configuration (config.rs), and
//! the [`Layer`] that applies it.

use super::config::{Config, StorePolicy};
use super::policy::Policy;
use super::problem::Problem;
use super::service::Idempotency;
use crate::error::{Error, Result};
use crate::guard::Guard;
use crate::json_pointer::{JsonPointer, MAX_JSON_FIELDS};
use crate::response::MAX_BODY_BYTES_HARD_CAP;
use crate::store::Store;
use http::{HeaderName, Method, request};
use std::sync::Arc;
use std::time::Duration;
use tower_layer::Layer;

/// Puts an [`Idempotency`] service in front of a service: requests with an
/// `Idempotency-Key` go through a [`Guard`]. See the [module docs](super)
/// for the behaviour and the status codes.
///
/// The layer takes the guard's store, clock, lease, retention and policies
/// (including [`wait_for_duplicates`](crate::guard::GuardBuilder::wait_for_duplicates));
/// the guard's counters are shared with the caller's copy.
///
/// ```
/// use idemstore::{Guard, MemoryStore, tower::{IdempotencyLayer, StorePolicy}};
/// use http::{HeaderName, Method};
///
/// let layer = IdempotencyLayer::new(Guard::new(MemoryStore::new()))
///     .methods([Method::POST, Method::PUT, Method::PATCH])
///     .require_key(true)
///     .scope(|req| req.headers.get("x-tenant").map(|v| v.as_bytes().to_vec()).unwrap_or_default())
///     .fingerprint_headers([HeaderName::from_static("x-tenant")])
///     .store_policy(StorePolicy::AllButServerErrors)
///     .max_request_body_bytes(64 * 1024);
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    guard: Guard<Arc<dyn Store>>,
    config: Arc<Config>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("methods", &self.config.methods)
            .field("require_key", &self.config.require_key)
            .field("key_from_json", &self.config.key_from_json)
            .field("json_fields", &self.config.json_fields)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `guard`, with the defaults: POST and PATCH, key
    /// optional, empty scope, a 1 MiB request body limit, every response
    /// stored, `Set-Cookie` and `Date` not stored.
    pub fn new<S: Store + 'static>(guard: Guard<S>) -> IdempotencyLayer {
        IdempotencyLayer {
            guard: guard.erased(),
            config: Arc::default(),
        }
    }

    fn config(mut self, change: impl FnOnce(&mut Config)) -> IdempotencyLayer {
        change(Arc::make_mut(&mut self.config));
        self
    }

    /// The methods that are guarded (default POST and PATCH); others pass through.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> IdempotencyLayer {
        self.config(|c| c.methods = methods.into_iter().collect())
    }

    /// When on, a guarded request without a key gets 400; when off (the
    /// default), it passes through unguarded.
    pub fn require_key(self, required: bool) -> IdempotencyLayer {
        self.config(|c| c.require_key = required)
    }

    /// The key's scope as a function of the request (say, the authenticated
    /// account from an extension set by an auth layer), so that two tenants
    /// never share a key. Default: the empty scope. At most
    /// [`MAX_SCOPE_BYTES`](crate::limits::MAX_SCOPE_BYTES), else the request gets 500.
    pub fn scope(
        self,
        scope: impl Fn(&request::Parts) -> Vec<u8> + Send + Sync + 'static,
    ) -> IdempotencyLayer {
        self.config(|c| c.scope = Some(Arc::new(scope)))
    }

    /// Request headers that are part of the fingerprint, besides the method,
    /// the path and query, and the body (default none).
    pub fn fingerprint_headers(
        self,
        names: impl IntoIterator<Item = HeaderName>,
    ) -> IdempotencyLayer {
        self.config(|c| c.fingerprint_headers = names.into_iter().collect())
    }

    /// Fingerprints the request body by these fields of it alone, each an
    /// RFC 6901 [`JsonPointer`], instead of by its bytes: a retry whose
    /// client added a timestamp or a trace id, or reordered the members,
    /// is still the same request. The method, the path and query and the
    /// [`fingerprint_headers`](Self::fingerprint_headers) stay in the
    /// fingerprint ([`Fingerprint::of_http_json_fields`](crate::Fingerprint::of_http_json_fields)).
    ///
    /// - The pointers are a set (order and repeats do not matter); a field
    ///   a request does not have counts as absent, which is not an error.
    ///   The pointer `""` is the whole body, in canonical form: only its
    ///   key order and whitespace stop mattering. A later call replaces
    ///   the set.
    /// - A guarded request whose body is not JSON gets 400
    ///   ([`Problem::BodyNotJson`]) and the handler does not run: its
    ///   fingerprint cannot be computed. The `Content-Type` is not looked at.
    /// - Changing the fields changes every fingerprint: a retry of a request
    ///   made before the change gets 422.
    ///
    /// Errors, when the layer is built and never per request:
    /// [`Error::InvalidArgument`] for a pointer that is not RFC 6901, for
    /// no pointer at all, or for more than [`MAX_JSON_FIELDS`](crate::limits::MAX_JSON_FIELDS).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
    /// use idemstore::{Guard, MemoryStore, tower::IdempotencyLayer};
    /// use tower::ServiceExt;
    ///
    /// let layer = IdempotencyLayer::new(Guard::new(MemoryStore::new()))
    ///     .fingerprint_json_fields(["/amount", "/currency"])?;
    /// let app = Router::new()
    ///     .route("/payments", post(|| async { StatusCode::CREATED }))
    ///     .layer(layer);
    /// let pay = |body: &'static str| {
    ///     Request::post("/payments").header("idempotency-key", "p-1").body(Body::from(body)).unwrap()
    /// };
    /// app.clone().oneshot(pay(r#"{"amount": 100, "currency": "EUR", "sent_at": "12:00:00"}"#)).await?;
    /// // The retry has another timestamp: still a retry.
    /// let retry = app.clone().oneshot(pay(r#"{"sent_at": "12:00:09", "currency": "EUR", "amount": 100}"#)).await?;
    /// assert_eq!(retry.headers()["idempotent-replayed"], "true");
    /// // Another amount under the same key is another request.
    /// let other = app.clone().oneshot(pay(r#"{"amount": 200, "currency": "EUR"}"#)).await?;
    /// assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    /// // A body that is not JSON cannot be fingerprinted.
    /// let form = app.oneshot(pay("amount=100&currency=EUR")).await?;
    /// assert_eq!(form.status(), StatusCode::BAD_REQUEST);
    ///
    /// assert!(IdempotencyLayer::new(Guard::new(MemoryStore::new())).fingerprint_json_fields(["amount"]).is_err());
    /// # Ok(()) }
    /// ```
    pub fn fingerprint_json_fields<I>(self, pointers: I) -> Result<IdempotencyLayer>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut fields = pointers
            .into_iter()
            .map(|p| JsonPointer::new(p.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        fields.sort();
        fields.dedup();
        if fields.is_empty() {
            return Err(Error::invalid_argument(
                "fingerprint_json_fields needs at least one JSON Pointer (\"\" is the whole body)",
            ));
        }
        if fields.len() > MAX_JSON_FIELDS {
            return Err(Error::invalid_argument(format!(
                "fingerprint_json_fields got {} JSON Pointers; at most {MAX_JSON_FIELDS} are allowed",
                fields.len()
            )));
        }
        Ok(self.config(|c| c.json_fields = Some(fields)))
    }

    /// For a client that cannot send a header: a guarded request without an
    /// `Idempotency-Key` header takes its key from this string field of
    /// its JSON body (an RFC 6901 [`JsonPointer`]). The header wins when
    /// both are there.
    ///
    /// - The field is held to the header's rules: a string of
    ///   1..=[`MAX_ID_BYTES`](crate::limits::MAX_ID_BYTES) bytes of visible
    ///   ASCII, else 400 ([`Problem::KeyInvalid`]).
    /// - A body that is not JSON, or has no such field (or `null`), has no
    ///   key: 400 under [`require_key`](Self::require_key), else the
    ///   request passes through unguarded.
    /// - To look, the layer reads the body of every guarded request without
    ///   the header, up to [`max_request_body_bytes`](Self::max_request_body_bytes)
    ///   (413 above), before it decides.
    ///
    /// Errors: [`Error::InvalidArgument`] for a pointer that is not RFC 6901,
    /// when the layer is built.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
    /// use idemstore::{Guard, Key, MemoryStore, tower::IdempotencyLayer};
    /// use tower::ServiceExt;
    ///
    /// let layer = IdempotencyLayer::new(Guard::new(MemoryStore::new()))
    ///     .require_key(true)
    ///     .key_from_json("/request_id")?;
    /// let app = Router::new()
    ///     .route("/transfers", post(|axum::Extension(key): axum::Extension<Key>| async move {
    ///         (StatusCode::CREATED, key.id().to_vec())
    ///     }))
    ///     .layer(layer);
    /// let send = || Request::post("/transfers").body(Body::from(r#"{"request_id": "t-7", "amount": 5}"#)).unwrap();
    /// let first = app.clone().oneshot(send()).await?;
    /// assert_eq!(first.status(), StatusCode::CREATED);
    /// let retry = app.clone().oneshot(send()).await?;
    /// assert_eq!(retry.headers()["idempotent-replayed"], "true");
    /// // No header and no field: 400, since the key is required.
    /// let none = app.oneshot(Request::post("/transfers").body(Body::from("{}")).unwrap()).await?;
    /// assert_eq!(none.status(), StatusCode::BAD_REQUEST);
    /// # Ok(()) }
    /// ```
    pub fn key_from_json(self, pointer: impl AsRef<str>) -> Result<IdempotencyLayer> {
        let pointer = JsonPointer::new(pointer.as_ref())?;
        Ok(self.config(|c| c.key_from_json = Some(pointer)))
    }

    /// The largest request body read for the fingerprint (default
    /// 1 MiB, at most
    /// [`MAX_BODY_BYTES_HARD_CAP`]); a larger one gets 413.
    pub fn max_request_body_bytes(self, limit: usize) -> IdempotencyLayer {
        self.config(|c| c.max_request_body_bytes = limit.min(MAX_BODY_BYTES_HARD_CAP))
    }

    /// The largest response body buffered for storage (default
    /// [`DEFAULT_MAX_BODY_BYTES`](crate::limits::DEFAULT_MAX_BODY_BYTES), at most [`MAX_BODY_BYTES_HARD_CAP`]). A
    /// larger response is streamed to the client and not stored; the claim
    /// then follows the guard's [`OnHandlerError`](crate::guard::OnHandlerError).
    pub fn max_response_body_bytes(self, limit: usize) -> IdempotencyLayer {
        self.config(|c| c.max_response_body_bytes = limit.min(MAX_BODY_BYTES_HARD_CAP))
    }

    /// Which responses are stored (default [`StorePolicy::All`]).
    pub fn store_policy(self, policy: StorePolicy) -> IdempotencyLayer {
        self.config(|c| c.store_policy = policy)
    }

    /// Response headers left out of the stored snapshot, so a replay never
    /// repeats them (default `Set-Cookie` and `Date`). Replaces the list.
    pub fn deny_headers(self, names: impl IntoIterator<Item = HeaderName>) -> IdempotencyLayer {
        self.config(|c| c.deny_headers = names.into_iter().collect())
    }

    /// The `Retry-After` sent with a 503 when the store is unavailable
    /// (default 1 s).
    pub fn unavailable_retry_after(self, after: Duration) -> IdempotencyLayer {
        self.config(|c| c.unavailable_retry_after = after)
    }

    /// The problem `type` URI the layer sends for `kind` (default
    /// [`Problem::type_uri`]: its entry in these docs), for a service that
    /// documents its errors at its own addresses. The title stays.
    ///
    /// ```
    /// use idemstore::tower::{IdempotencyLayer, Problem};
    /// use idemstore::{Guard, MemoryStore};
    /// let layer = IdempotencyLayer::new(Guard::new(MemoryStore::new()))
    ///     .problem_type(Problem::KeyReused, "https://api.example.com/errors/idempotency-key-reused");
    /// ```
    pub fn problem_type(self, kind: Problem, uri: impl Into<String>) -> IdempotencyLayer {
        let uri = uri.into();
        self.config(|c| {
            c.problem_types.insert(kind, uri);
        })
    }

    /// The policy this layer applies, with the guard's lease and retention,
    /// to publish (the IETF draft asks a resource to publish its
    /// idempotency specification): [`Policy::to_json`] for clients,
    /// `Display` for people. Serve each route's own, since each
    /// `route_layer` may differ.
    ///
    /// ```
    /// use idemstore::{Guard, MemoryStore, tower::IdempotencyLayer};
    /// use axum::{Router, routing::get};
    ///
    /// let layer = IdempotencyLayer::new(Guard::new(MemoryStore::new())).require_key(true);
    /// let published = layer.policy().to_json().to_string();
    /// let app: Router = Router::new().route(
    ///     "/idempotency-policy",
    ///     get(move || std::future::ready(([("content-type", "application/json")], published))),
    /// );
    /// assert!(layer.policy().to_string().contains("required"));
    /// ```
    pub fn policy(&self) -> Policy {
        Policy::new(
            &self.config,
            self.guard.lease(),
            self.guard.renewal_interval(),
            self.guard.retention(),
        )
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Idempotency<S> {
        Idempotency::from_parts(inner, self.guard.clone(), Arc::clone(&self.config))
    }
}
