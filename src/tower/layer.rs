//! [`IdempotencyLayer`]: the builder of the configuration (config.rs), and
//! the [`Layer`] that applies it.

use super::config::{Config, StorePolicy};
use super::problem::Problem;
use super::service::Idempotency;
use crate::guard::Guard;
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
/// (including [`wait_for_duplicates`](crate::GuardBuilder::wait_for_duplicates));
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

    /// The largest request body read for the fingerprint (default
    /// [`DEFAULT_MAX_REQUEST_BODY_BYTES`](super::DEFAULT_MAX_REQUEST_BODY_BYTES), at most
    /// [`MAX_BODY_BYTES_HARD_CAP`]); a larger one gets 413.
    pub fn max_request_body_bytes(self, limit: usize) -> IdempotencyLayer {
        self.config(|c| c.max_request_body_bytes = limit.min(MAX_BODY_BYTES_HARD_CAP))
    }

    /// The largest response body buffered for storage (default
    /// [`DEFAULT_MAX_BODY_BYTES`](crate::limits::DEFAULT_MAX_BODY_BYTES), at most [`MAX_BODY_BYTES_HARD_CAP`]). A
    /// larger response is streamed to the client and not stored; the claim
    /// then follows the guard's [`OnHandlerError`](crate::OnHandlerError).
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
    /// (default [`DEFAULT_UNAVAILABLE_RETRY_AFTER`](super::DEFAULT_UNAVAILABLE_RETRY_AFTER)).
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
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Idempotency<S> {
        Idempotency::from_parts(inner, self.guard.clone(), Arc::clone(&self.config))
    }
}
