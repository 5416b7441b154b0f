//! [`Idempotency`]: the service, and its [`ResponseFuture`].

use super::body::{Buffered, ResponseBody, buffer};
use super::config::{Config, DoNotStore, StorePolicy};
use super::header::parse_key;
use super::problem::Problem;
use super::reply::{from_snapshot, problem, problem_retry_after, remaining, snapshot};
use super::request::{ReadBody, fingerprint, key_from_body, missing_key};
use crate::error::BoxError;
use crate::guard::{Guard, Outcome};
use crate::key::Key;
use crate::record::Claim;
use crate::response::Response as Snapshot;
use crate::store::Store;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_service::Service;

/// Guards requests that carry an `Idempotency-Key` (see the [module docs](super)).
/// Made by [`IdempotencyLayer`](super::IdempotencyLayer).
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    guard: Guard<Arc<dyn Store>>,
    config: Arc<Config>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> Idempotency<S> {
    pub(crate) fn from_parts(
        inner: S,
        guard: Guard<Arc<dyn Store>>,
        config: Arc<Config>,
    ) -> Idempotency<S> {
        Idempotency {
            inner,
            guard,
            config,
        }
    }

    /// The inner service.
    ///
    /// ```
    /// use idemstore::{Guard, MemoryStore, tower::IdempotencyLayer};
    /// use tower_layer::Layer;
    /// let mut svc = IdempotencyLayer::new(Guard::new(MemoryStore::new())).layer(7_u8);
    /// assert_eq!(*svc.get_ref(), 7);
    /// *svc.get_mut() = 8;
    /// assert_eq!(svc.into_inner(), 8);
    /// ```
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, consuming this one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

pin_project! {
    /// The response future of [`Idempotency`].
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        // Not guarded: the inner future, unboxed.
        Passthrough { #[pin] future: F },
        // Guarded: body read, store calls, the handler, storing.
        Guarded { future: BoxFuture<Answer<B, E>> },
        // Refused before anything ran.
        Ready { response: Option<Response<ResponseBody<B>>> },
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Answer<B, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => future
                .poll(cx)
                .map_ok(|res| res.map(|body| ResponseBody::stream(Bytes::new(), body))),
            KindProj::Guarded { future } => future.as_mut().poll(cx),
            KindProj::Ready { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
        }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let ready = |response| ResponseFuture {
            kind: Kind::Ready {
                response: Some(response),
            },
        };
        if !self.config.methods.contains(req.method()) {
            return self.passthrough(req);
        }
        let id = match parse_key(req.headers()) {
            Ok(Some(id)) => Some(id),
            // No header: the key may be a field of the body, which the
            // guarded future reads.
            Ok(None) if self.config.key_from_json.is_some() => None,
            Ok(None) if !self.config.require_key => return self.passthrough(req),
            Ok(None) => {
                let detail = missing_key(&self.config);
                return ready(problem(&self.config, Problem::KeyMissing, &detail));
            }
            Err(why) => return ready(problem(&self.config, Problem::KeyInvalid, &why)),
        };
        // The instance that was polled ready serves this request (tower's
        // clone-and-swap idiom).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (guard, config) = (self.guard.clone(), Arc::clone(&self.config));
        ResponseFuture {
            kind: Kind::Guarded {
                future: Box::pin(guarded(inner, guard, config, id, req)),
            },
        }
    }
}

impl<S> Idempotency<S> {
    fn passthrough<ReqBody, ResBody>(
        &mut self,
        req: Request<ReqBody>,
    ) -> ResponseFuture<S::Future, ResBody, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    {
        ResponseFuture {
            kind: Kind::Passthrough {
                future: self.inner.call(req),
            },
        }
    }
}

/// Why the guarded handler produced no storable response.
enum Failure<B, E> {
    /// The inner service failed.
    Inner(E),
    /// Not to be stored (5xx under [`StorePolicy::AllButServerErrors`], or
    /// [`DoNotStore`]): sent, and the claim released.
    Skip(Response<ResponseBody<B>>),
    /// Over the response limit: streamed, not stored.
    TooLarge(Response<ResponseBody<B>>),
    /// The inner response body failed while it was buffered.
    BodyFailed,
}

/// The request under the guard: `id` is the header's key, or `None` when
/// the key is to be read from the body (`key_from_json`).
async fn guarded<S, ReqBody, ResBody>(
    mut inner: S,
    guard: Guard<Arc<dyn Store>>,
    config: Arc<Config>,
    id: Option<Vec<u8>>,
    req: Request<ReqBody>,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: Body + From<Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin,
{
    let (parts, body) = req.into_parts();
    let body = match Limited::new(body, config.max_request_body_bytes)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            let detail = format!(
                "the request body is over the limit of {} bytes",
                config.max_request_body_bytes
            );
            return Ok(problem(&config, Problem::RequestTooLarge, &detail));
        }
        Err(e) => {
            let detail = format!("the request body could not be read: {e}");
            return Ok(problem(&config, Problem::BodyUnreadable, &detail));
        }
    };
    let body = ReadBody::new(body);
    let found = match id {
        Some(id) => Ok(Some(id)),
        None => key_from_body(&config, &body),
    };
    let id = match found {
        Ok(Some(id)) => id,
        // No key in the body either: unguarded, as a request without the
        // header is (the body was read only to look).
        Ok(None) if !config.require_key => {
            let req = Request::from_parts(parts, ReqBody::from(body.into_bytes()));
            let res = inner.call(req).await?;
            return Ok(res.map(|b| ResponseBody::stream(Bytes::new(), b)));
        }
        Ok(None) => return Ok(problem(&config, Problem::KeyMissing, &missing_key(&config))),
        Err(why) => return Ok(problem(&config, Problem::KeyInvalid, &why)),
    };
    let scope = config.scope.as_ref().map_or_else(Vec::new, |f| f(&parts));
    let key = match Key::new(scope, id) {
        Ok(key) => key,
        // The id was checked (`parse_key`, `key_from_body`), so this is the
        // scope: a server bug.
        Err(e) => return Ok(problem(&config, Problem::ScopeInvalid, &e.to_string())),
    };
    // Never run the handler under a fingerprint that could not be computed.
    let fp = match fingerprint(&parts, &body, &config) {
        Ok(fp) => fp,
        Err(why) => return Ok(problem(&config, Problem::BodyNotJson, &why)),
    };
    let mut req = Request::from_parts(parts, ReqBody::from(body.into_bytes()));
    // The handler reads the key as the layer parsed it (`Extension<Key>`
    // in axum): unquoted, with its scope, never reparsed from the header.
    req.extensions_mut().insert(key.clone());

    let mut first = None;
    let release = |f: &Failure<ResBody, S::Error>| matches!(f, Failure::Skip(_));
    let outcome = guard
        .run_async_with(&key, &fp, release, |claim| {
            execute(&mut inner, req, claim, &config, &mut first)
        })
        .await;
    answer(outcome, first, &guard, &config)
}

/// Runs the inner service under `claim` and returns the snapshot to store,
/// keeping the full first response (deny-listed headers included) in `first`.
async fn execute<S, ReqBody, ResBody>(
    inner: &mut S,
    mut req: Request<ReqBody>,
    claim: Claim,
    config: &Config,
    first: &mut Option<Response<ResponseBody<ResBody>>>,
) -> Result<Snapshot, Failure<ResBody, S::Error>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Unpin,
{
    // The handler may read the fencing token (`Extension<Claim>` in axum)
    // and pass it downstream as its own idempotency key.
    req.extensions_mut().insert(claim);
    let (parts, body) = inner.call(req).await.map_err(Failure::Inner)?.into_parts();
    let bytes = match buffer(body, config.max_response_body_bytes).await {
        Buffered::Complete(bytes) => bytes,
        Buffered::TooLarge(prefix, rest) => {
            let res = Response::from_parts(parts, ResponseBody::stream(prefix, rest));
            return Err(Failure::TooLarge(res));
        }
        Buffered::Failed(_) => return Err(Failure::BodyFailed),
    };
    let skip = parts.extensions.get::<DoNotStore>().is_some()
        || (config.store_policy == StorePolicy::AllButServerErrors
            && parts.status.is_server_error());
    if skip {
        let res = Response::from_parts(parts, ResponseBody::from_bytes(bytes));
        return Err(Failure::Skip(res));
    }
    let stored = snapshot(&parts, &bytes, &config.deny_headers);
    *first = Some(Response::from_parts(parts, ResponseBody::from_bytes(bytes)));
    Ok(stored)
}

/// The HTTP answer for each outcome (the table in the module docs).
fn answer<B, E>(
    outcome: Outcome<Failure<B, E>>,
    first: Option<Response<ResponseBody<B>>>,
    guard: &Guard<Arc<dyn Store>>,
    config: &Config,
) -> Answer<B, E> {
    let executed = |s: Snapshot| first.unwrap_or_else(|| from_snapshot(config, s, false));
    Ok(match outcome {
        Outcome::Executed(s) | Outcome::FailedOpen(Ok(s)) => executed(s),
        // Sent as the handler made it; nothing stored, the record stays
        // PROCESSING until its lease ends (the guard's contract).
        Outcome::NotStored { response, .. } => executed(response),
        // A renewal found the claim taken over while the handler ran: its
        // response is sent, nothing is stored (the new owner's run answers
        // the retries).
        Outcome::LeaseLost(Ok(response)) => executed(response),
        Outcome::Replayed(s) => from_snapshot(config, s, true),
        Outcome::InFlight { lease_until } => problem_retry_after(
            config,
            Problem::InFlight,
            "a request with this Idempotency-Key is being processed; retry later",
            remaining(guard.now(), lease_until),
        ),
        Outcome::Conflicted => problem(
            config,
            Problem::KeyReused,
            "this Idempotency-Key was used with a different request",
        ),
        Outcome::Unavailable(_) => problem_retry_after(
            config,
            Problem::StoreUnavailable,
            "the idempotency store is unavailable; the request was not processed",
            config.unavailable_retry_after,
        ),
        // An earlier attempt's lease expired with its outcome unknown and the
        // guard says reconcile, which HTTP cannot do: the claim is kept (it
        // expires with its lease) and the client is told to stop retrying blindly.
        Outcome::Unknown(_) => problem(
            config,
            Problem::OutcomeUnknown,
            "an earlier attempt with this Idempotency-Key ended with an unknown outcome",
        ),
        Outcome::HandlerFailed(failure)
        | Outcome::FailedOpen(Err(failure))
        | Outcome::LeaseLost(Err(failure)) => match failure {
            Failure::Inner(e) => return Err(e),
            Failure::Skip(res) | Failure::TooLarge(res) => res,
            Failure::BodyFailed => problem(
                config,
                Problem::ResponseBodyFailed,
                "the response body failed while it was read",
            ),
        },
    })
}
