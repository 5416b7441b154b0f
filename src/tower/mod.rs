//! HTTP middleware (feature `tower`): the `Idempotency-Key` header in front
//! of any tower service, such as an axum router.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use idemstore::{Guard, MemoryStore, tower::IdempotencyLayer};
//! use tower::ServiceExt;
//!
//! let guard = Guard::new(MemoryStore::new()); // RedbStore in production
//! let app = Router::new()
//!     .route("/orders", post(|body: String| async move { (StatusCode::CREATED, body) }))
//!     .layer(IdempotencyLayer::new(guard));
//!
//! let order = || Request::post("/orders").header("idempotency-key", "k-1").body(Body::from("qty=1")).unwrap();
//! let first = app.clone().oneshot(order()).await.unwrap();
//! let retry = app.oneshot(order()).await.unwrap();
//! assert_eq!((first.status(), retry.status()), (StatusCode::CREATED, StatusCode::CREATED));
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # }
//! ```
//!
//! # Behaviour
//!
//! It follows the IETF draft "The Idempotency-Key HTTP Header Field" and
//! Stripe's practice:
//!
//! - The key is the `Idempotency-Key` header, as a structured-field string
//!   (`"8e03978e"`) or a bare value, 1..=255 bytes of visible ASCII. For a
//!   client that cannot send a header,
//!   [`key_from_json`](IdempotencyLayer::key_from_json) takes it from a
//!   string field of a JSON body when the header is absent.
//! - POST and PATCH are guarded by default ([`IdempotencyLayer::methods`]);
//!   other methods, and requests without a key unless
//!   [`require_key`](IdempotencyLayer::require_key) is on, pass through.
//! - The key's scope comes from [`IdempotencyLayer::scope`] (default empty).
//! - The fingerprint is the method, the path and query, the body and the
//!   [`fingerprint_headers`](IdempotencyLayer::fingerprint_headers), computed
//!   once before the handler runs. The body is read into memory for it, up
//!   to [`max_request_body_bytes`](IdempotencyLayer::max_request_body_bytes).
//!   With [`fingerprint_json_fields`](IdempotencyLayer::fingerprint_json_fields)
//!   only the named fields of a JSON body count, so a retry that adds a
//!   timestamp or reorders members is still a retry.
//! - [`IdempotencyLayer::policy`] renders all of this, with the guard's
//!   lease and retention, for the service to publish ([`Policy`]).
//! - The handler sees its [`Claim`](crate::Claim) and the parsed
//!   [`Key`](crate::Key) (scope and id, the header's quoting removed) as
//!   request extensions (`Extension<Claim>`, `Extension<Key>` in axum):
//!   `claim.token()` is a fencing token to pass downstream, and
//!   `claim.step_async(name, ..)` runs one of the handler's steps, recorded
//!   on the key, so a retry after a crash resumes after the last one
//!   ([`Claim::step`](crate::Claim::step); `atomic_step` for a step's own
//!   writes: `RedbStore`'s from a blocking thread, `PostgresStore`'s awaited).
//! - The first response is sent as the handler made it; what is stored (and
//!   replayed) leaves out the [`deny_headers`](IdempotencyLayer::deny_headers)
//!   (`Set-Cookie` and `Date` by default) and trailers. A replay adds
//!   `Idempotent-Replayed: true`.
//! - [`StorePolicy`] picks which responses are stored; a handler keeps one
//!   response out with the [`DoNotStore`] extension. Either way the claim is
//!   released, so a retry runs the handler again.
//! - Store calls go through the store's native async entry
//!   ([`Store::begin_async`](crate::Store::begin_async): no thread per
//!   waiting request on `RedbStore` and `MemoryStore`), or tokio's blocking
//!   pool for a store without one; with
//!   [`wait_for_duplicates`](crate::guard::GuardBuilder::wait_for_duplicates) on the
//!   guard, a duplicate that arrives while the first request runs in this
//!   process waits for its response instead of getting 409.
//!
//! # Status codes
//!
//! | situation | answer | handler runs? |
//! |---|---|---|
//! | method not guarded, or no key and the key is optional | the handler's response | yes, unguarded |
//! | no key, key required | 400 problem+json | no |
//! | key not 1..=255 visible ASCII, or two keys | 400 problem+json saying why | no |
//! | request body over the limit | 413 problem+json | no |
//! | JSON fields fingerprinted and the body is not JSON | 400 problem+json | no |
//! | first request | the handler's response, stored | yes, once |
//! | retry after completion | the stored status, headers and body + `Idempotent-Replayed: true` | no |
//! | retry while the first runs | 409 + `Retry-After` (remaining lease, seconds rounded up; the guard renews the lease while the handler runs) | no |
//! | ... with waiting on, first runs in this process | the first's response + `Idempotent-Replayed: true` | no |
//! | same key, different fingerprint | 422 problem+json | no |
//! | store unavailable | 503 + `Retry-After` problem+json (fail closed) | no |
//! | handler ran, storing failed (`NotStored`) | the handler's response, not stored; retries get 409 until the lease ends, then run again | yes |
//! | handler ran, but a renewal found its claim taken over meanwhile (`LeaseLost`) | the handler's response, not stored (the new owner answers retries) | yes |
//! | 5xx under `AllButServerErrors`, or `DoNotStore` | the handler's response, not stored, claim released | yes |
//! | response body over the response limit | the handler's response, streamed, not stored; the claim follows the guard's `OnHandlerError` | yes |
//! | expired lease under `TakeoverPolicy::Reconcile` (`Unknown`) | 500 problem+json; the claim is kept until its lease ends (reconcile out of band) | no |
//! | inner service returns `Err` | that error; the claim follows the guard's `OnHandlerError` | yes |
//!
//! Problem bodies are RFC 9457 `application/problem+json`: a `type` and a
//! `title` for each kind of answer ([`Problem`]: the `type` is the kind's
//! entry in these docs), the `status`, and a `detail` saying what happened
//! to this request.
//!
//! # Settings per route
//!
//! Each route may identify its requests differently: give each its own
//! layer with axum's `route_layer`, over one guard (one store). Here
//! `/payments` requires the header and compares the amount and currency
//! alone; `/transfers` serves a client that cannot send headers, so its key
//! is the body's `request_id`. Each layer's [`policy`](IdempotencyLayer::policy)
//! is what to publish for its route (`examples/payments_api.rs` serves them).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use idemstore::{Guard, MemoryStore, tower::IdempotencyLayer};
//! use tower::ServiceExt;
//!
//! let guard = Guard::new(MemoryStore::new()); // RedbStore in production
//! let payments = IdempotencyLayer::new(guard.clone())
//!     .require_key(true)
//!     .fingerprint_json_fields(["/amount", "/currency"])?;
//! let transfers = IdempotencyLayer::new(guard)
//!     .require_key(true)
//!     .key_from_json("/request_id")?
//!     .fingerprint_json_fields(["/from", "/to", "/amount"])?;
//! let app = Router::new()
//!     .route("/payments", post(|| async { StatusCode::CREATED }).route_layer(payments))
//!     .route("/transfers", post(|| async { StatusCode::CREATED }).route_layer(transfers));
//!
//! let transfer = |sent_at: &str| {
//!     let body = format!(r#"{{"request_id": "t-1", "from": "a", "to": "b", "amount": 5, "sent_at": "{sent_at}"}}"#);
//!     Request::post("/transfers").body(Body::from(body)).unwrap()
//! };
//! let first = app.clone().oneshot(transfer("09:00")).await?;
//! let retry = app.clone().oneshot(transfer("09:01")).await?; // a new timestamp: still a retry
//! assert_eq!((first.status(), retry.status()), (StatusCode::CREATED, StatusCode::CREATED));
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! // /payments still requires its header.
//! let payment = Request::post("/payments").body(Body::from(r#"{"amount": 5}"#))?;
//! assert_eq!(app.oneshot(payment).await?.status(), StatusCode::BAD_REQUEST);
//! # Ok(()) }
//! ```

mod body;
mod config;
mod header;
mod layer;
mod policy;
mod problem;
mod reply;
mod request;
mod service;

pub use body::ResponseBody;
pub use config::{DoNotStore, StorePolicy};
pub use header::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
pub use layer::IdempotencyLayer;
pub use policy::Policy;
pub use problem::Problem;
pub use service::{Idempotency, ResponseFuture};
