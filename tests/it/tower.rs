//! The HTTP layer end to end: a real axum app on a real TCP loopback socket,
//! driven by a real HTTP client (hyper-util), over `MemoryStore`.

use axum::Router;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::TokioExecutor;
use idemstore::tower::{DoNotStore, IdempotencyLayer, Problem, StorePolicy};
use idemstore::{Claim, Guard, Key, MemoryStore};
use idemstore_testkit::FaultyStore;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const DUPLICATES: usize = 16;

#[derive(Clone)]
struct Handlers {
    runs: Arc<AtomicUsize>,
    /// Runs of `create` whose future the server has not dropped yet.
    live: LiveRuns,
    delay: Duration,
}

/// A handler's runs whose future the server has not dropped yet: until it
/// has, a run's owner is live in this process, and a retry is told
/// InFlight whatever the clock says.
#[derive(Clone, Default)]
pub struct LiveRuns(Arc<AtomicUsize>);

impl LiveRuns {
    /// Counts a run until the returned value drops (with the run's future).
    pub fn enter(&self) -> LiveRun {
        self.0.fetch_add(1, Ordering::SeqCst);
        LiveRun(Arc::clone(&self.0))
    }

    /// Waits (at most 30 s, else fails) until the server has dropped every
    /// run.
    pub async fn until_none(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while self.0.load(Ordering::SeqCst) > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "a handler's run was never dropped"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// One run counted in [`LiveRuns`].
pub struct LiveRun(Arc<AtomicUsize>);

impl Drop for LiveRun {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Creates an order: counts its runs, takes `delay`, sets a cookie and an
/// order header, and echoes the body and the fencing token.
async fn create(
    State(h): State<Handlers>,
    claim: Option<Extension<Claim>>,
    body: String,
) -> impl IntoResponse {
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let _live = h.live.enter();
    tokio::time::sleep(h.delay).await;
    let token = claim.map_or(0, |Extension(c)| c.token());
    (
        StatusCode::CREATED,
        [
            ("set-cookie", "session=s1".to_string()),
            ("x-order", n.to_string()),
            ("x-secret", "s".into()),
        ],
        format!("order {n} for {body} under token {token}"),
    )
}

/// Fails with 500 on its first run, then succeeds.
async fn flaky(State(h): State<Handlers>) -> impl IntoResponse {
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(h.delay).await;
    match n {
        1 => (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response(),
        n => (StatusCode::CREATED, format!("done on run {n}")).into_response(),
    }
}

/// Opts its first response out of storage, then succeeds.
async fn skip_first(State(h): State<Handlers>) -> impl IntoResponse {
    match h.runs.fetch_add(1, Ordering::SeqCst) + 1 {
        1 => (StatusCode::ACCEPTED, Extension(DoNotStore), "not yet").into_response(),
        n => (StatusCode::CREATED, format!("done on run {n}")).into_response(),
    }
}

struct App {
    addr: SocketAddr,
    runs: Arc<AtomicUsize>,
    live: LiveRuns,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// An HTTP answer, read whole (also used by the orders service tests).
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

/// Serves `app` on a free loopback port; its address, and a client for it
/// (also used by the JSON-field and orders service tests).
pub async fn serve(app: Router) -> (SocketAddr, Client<HttpConnector, Full<Bytes>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, Client::builder(TokioExecutor::new()).build_http())
}

/// Sends `req` over `client` and reads the whole answer.
pub async fn fetch(
    client: &Client<HttpConnector, Full<Bytes>>,
    req: http::Request<Full<Bytes>>,
) -> Reply {
    let res = client.request(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8(body.to_vec()).unwrap(),
    }
}

impl Reply {
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
    pub fn is_problem(&self) -> bool {
        self.headers["content-type"] == "application/problem+json"
    }
    /// The problem body's `type`, `title` and `status`, checked against
    /// `kind` (and against the HTTP status).
    pub fn assert_problem(&self, kind: Problem) {
        assert!(self.is_problem(), "{self:?}");
        let v: serde_json::Value = serde_json::from_str(&self.body).unwrap();
        assert_eq!(v["type"], kind.type_uri(), "{v}");
        assert_eq!(v["title"], kind.title(), "{v}");
        assert_eq!(v["status"], self.status.as_u16(), "{v}");
        assert_eq!(self.status, kind.status(), "{v}");
        assert!(v["detail"].as_str().is_some_and(|d| !d.is_empty()), "{v}");
    }
}

async fn start(layer: IdempotencyLayer, delay: Duration) -> App {
    let runs = Arc::new(AtomicUsize::new(0));
    let live = LiveRuns::default();
    let state = Handlers {
        runs: Arc::clone(&runs),
        live: live.clone(),
        delay,
    };
    let app = Router::new()
        .route(
            "/orders",
            post(create).get(|| async { "list" }).patch(create),
        )
        .route("/flaky", post(flaky))
        .route("/skip", post(skip_first))
        .with_state(state)
        .layer(layer);
    let (addr, client) = serve(app).await;
    App {
        addr,
        runs,
        live,
        client,
    }
}

impl App {
    async fn send(&self, method: &str, path: &str, keys: &[&str], body: &str) -> Reply {
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr));
        for key in keys {
            req = req.header("idempotency-key", *key);
        }
        let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
        fetch(&self.client, req).await
    }

    async fn post(&self, key: &str, body: &str) -> Reply {
        self.send("POST", "/orders", &[key], body).await
    }

    async fn post_to(&self, path: &str, key: &str) -> Reply {
        self.send("POST", path, &[key], "").await
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

fn layer() -> IdempotencyLayer {
    IdempotencyLayer::new(Guard::new(MemoryStore::new()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_click_runs_once_and_replays() {
    let app = start(layer(), Duration::ZERO).await;
    let first = app.post("k-1", "sku=A").await;
    let second = app.post("k-1", "sku=A").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(second.replayed());
    assert_eq!(first.body, "order 1 for sku=A under token 1");
    assert_eq!(second.body, first.body);
    assert_eq!(app.runs(), 1);
    // The same key as an sf-string is the same key.
    assert!(app.post("\"k-1\"", "sku=A").await.replayed());
    // PATCH is guarded too; GET passes through, even with a key.
    assert!(!app.send("PATCH", "/orders", &["k-2"], "x").await.replayed());
    assert!(app.send("PATCH", "/orders", &["k-2"], "x").await.replayed());
    let get = app.send("GET", "/orders", &["k-3"], "").await;
    assert_eq!((get.status, get.replayed()), (StatusCode::OK, false));
    assert_eq!(app.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_duplicates_execute_once() {
    let app = Arc::new(start(layer(), Duration::from_millis(300)).await);
    let replies = futures_join(&app, "k-16", "sku=B").await;
    assert_eq!(app.runs(), 1);
    let executed: Vec<_> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.replayed())
        .collect();
    assert_eq!(executed.len(), 1);
    for r in &replies {
        if r.status == StatusCode::CONFLICT {
            assert!(r.is_problem());
            let secs: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
            assert!((1..=30).contains(&secs), "Retry-After {secs}");
        } else {
            // A duplicate slow enough to arrive after completion replays.
            assert_eq!(r.status, StatusCode::CREATED);
            assert_eq!(r.body, executed[0].body);
        }
    }
    assert!(app.post("k-16", "sku=B").await.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_duplicates_with_waiting_all_get_201() {
    let guard = Guard::builder(MemoryStore::new())
        .wait_for_duplicates(Duration::from_secs(10))
        .build()
        .unwrap();
    let app = Arc::new(
        start(
            IdempotencyLayer::new(guard.clone()),
            Duration::from_millis(300),
        )
        .await,
    );
    let replies = futures_join(&app, "k-w", "sku=C").await;
    assert_eq!(app.runs(), 1);
    assert!(
        replies.iter().all(|r| r.status == StatusCode::CREATED),
        "{replies:?}"
    );
    assert!(
        replies
            .iter()
            .all(|r| r.body == "order 1 for sku=C under token 1")
    );
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
    let stats = guard.stats();
    assert_eq!((stats.executed, stats.in_flight), (1, 0));
    assert_eq!(stats.replayed, DUPLICATES as u64 - 1);
    // Each duplicate that arrived during the 300 ms run waited (rather than
    // getting 409); one that came later replayed the stored response.
    assert!(stats.waited >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_duplicates_rerun_after_a_released_server_error() {
    // The first run answers 500 under AllButServerErrors, so its claim is
    // released: the 15 waiting duplicates must neither replay the 500 nor
    // get 409; exactly one of them runs the handler again, and the other
    // 14 get its 201.
    let guard = Guard::builder(MemoryStore::new())
        .wait_for_duplicates(Duration::from_secs(10))
        .build()
        .unwrap();
    let layer = IdempotencyLayer::new(guard).store_policy(StorePolicy::AllButServerErrors);
    let app = Arc::new(start(layer, Duration::from_millis(300)).await);
    let start_line = Arc::new(tokio::sync::Barrier::new(DUPLICATES));
    let tasks: Vec<_> = (0..DUPLICATES)
        .map(|_| {
            let (app, start_line) = (Arc::clone(&app), Arc::clone(&start_line));
            tokio::spawn(async move {
                start_line.wait().await;
                app.post_to("/flaky", "k-rerun").await
            })
        })
        .collect();
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.unwrap());
    }
    assert_eq!(app.runs(), 2);
    let count = |status, replayed| {
        replies
            .iter()
            .filter(|r| r.status == status && r.replayed() == replayed)
            .count()
    };
    assert_eq!(
        count(StatusCode::INTERNAL_SERVER_ERROR, false),
        1,
        "{replies:?}"
    );
    assert_eq!(count(StatusCode::CREATED, false), 1, "{replies:?}");
    assert_eq!(
        count(StatusCode::CREATED, true),
        DUPLICATES - 2,
        "{replies:?}"
    );
}

/// Sends `DUPLICATES` identical requests at once, each on its own task.
async fn futures_join(app: &Arc<App>, key: &str, body: &str) -> Vec<Reply> {
    let start = Arc::new(tokio::sync::Barrier::new(DUPLICATES));
    let tasks: Vec<_> = (0..DUPLICATES)
        .map(|_| {
            let (app, start, key, body) = (
                Arc::clone(app),
                Arc::clone(&start),
                key.to_owned(),
                body.to_owned(),
            );
            tokio::spawn(async move {
                start.wait().await;
                app.post(&key, &body).await
            })
        })
        .collect();
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.unwrap());
    }
    replies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_payload_is_422() {
    let app = start(layer(), Duration::ZERO).await;
    assert_eq!(app.post("k-c", "qty=1").await.status, StatusCode::CREATED);
    let other_body = app.post("k-c", "qty=2").await;
    assert_eq!(other_body.status, StatusCode::UNPROCESSABLE_ENTITY);
    other_body.assert_problem(Problem::KeyReused);
    // RFC 9110's name for 422, not the old reason phrase.
    assert!(
        !other_body.body.contains("Unprocessable Entity"),
        "{}",
        other_body.body
    );
    assert!(
        other_body.body.contains("different request"),
        "{}",
        other_body.body
    );
    let other_method = app.send("PATCH", "/orders", &["k-c"], "qty=1").await;
    assert_eq!(other_method.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(app.runs(), 1);
    // The stored response is untouched by the conflicts.
    assert!(app.post("k-c", "qty=1").await.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_key_passes_through_or_is_400_when_required() {
    let app = start(layer(), Duration::ZERO).await;
    for _ in 0..2 {
        let r = app.send("POST", "/orders", &[], "x").await;
        assert_eq!((r.status, r.replayed()), (StatusCode::CREATED, false));
    }
    assert_eq!(app.runs(), 2);

    let app = start(layer().require_key(true), Duration::ZERO).await;
    let r = app.send("POST", "/orders", &[], "x").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(
        r.is_problem() && r.body.contains("needs an Idempotency-Key"),
        "{}",
        r.body
    );
    assert_eq!(app.runs(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_key_is_400_saying_why() {
    let app = start(layer(), Duration::ZERO).await;
    let long = "k".repeat(256);
    for (keys, why) in [
        (vec![long.as_str()], "256 bytes"),
        (vec!["a b"], "not visible ASCII"),
        (vec!["\"unterminated"], "no closing quote"),
        (vec!["\"\""], "empty"),
        (vec!["a", "b"], "more than one"),
    ] {
        let r = app.send("POST", "/orders", &keys, "x").await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{keys:?}");
        assert!(r.is_problem());
        assert!(r.body.contains(why), "{keys:?}: {}", r.body);
    }
    assert_eq!(
        app.post(&"k".repeat(255), "x").await.status,
        StatusCode::CREATED
    );
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_is_413_without_running_the_handler() {
    let app = start(layer().max_request_body_bytes(1024), Duration::ZERO).await;
    let r = app.post("k-big", &"x".repeat(2048)).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    r.assert_problem(Problem::RequestTooLarge);
    assert!(!r.body.contains("Payload Too Large"), "{}", r.body);
    assert!(
        r.is_problem() && r.body.contains("1024 bytes"),
        "{}",
        r.body
    );
    assert_eq!(app.runs(), 0);
    // Nothing was claimed: the key is free for a request that fits.
    let ok = app.post("k-big", &"x".repeat(1024)).await;
    assert_eq!((ok.status, ok.replayed()), (StatusCode::CREATED, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_unavailable_is_503_and_the_handler_does_not_run() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let guard = Guard::new(Arc::clone(&store));
    let app = start(
        IdempotencyLayer::new(guard).unavailable_retry_after(Duration::from_secs(3)),
        Duration::ZERO,
    )
    .await;
    store.fail_all();
    let r = app.post("k-down", "x").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.is_problem());
    assert_eq!(r.headers["retry-after"], "3");
    assert_eq!(app.runs(), 0);
    store.clear_fault();
    let r = app.post("k-down", "x").await;
    assert_eq!((r.status, r.replayed()), (StatusCode::CREATED, false));
    assert_eq!(app.runs(), 1);
}

/// A `RedbStore` on a full disk: a new key is 503 with `Retry-After` and
/// the handler does not run, a request whose response is stored is still
/// replayed, and once space is freed the same store serves new keys.
#[cfg(feature = "redb")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_503_for_new_keys_and_replays_go_on() {
    use idemstore_testkit::crash::CrashBackend;
    let disk = CrashBackend::new();
    let store = Arc::new(
        idemstore::RedbStore::builder()
            .open_backend(disk.clone(), disk.sibling())
            .unwrap(),
    );
    let guard = Guard::new(Arc::clone(&store));
    let app = start(
        IdempotencyLayer::new(guard).unavailable_retry_after(Duration::from_secs(2)),
        Duration::ZERO,
    )
    .await;
    assert_eq!(app.post("k-before", "x").await.status, StatusCode::CREATED);
    disk.set_disk_full(true);
    let r = app.post("k-full", "x").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.is_problem());
    assert_eq!(r.headers["retry-after"], "2");
    assert_eq!(app.runs(), 1);
    let again = app.post("k-before", "x").await;
    assert_eq!(
        (again.status, again.replayed()),
        (StatusCode::CREATED, true)
    );
    disk.set_disk_full(false);
    let healed = Arc::clone(&store);
    tokio::task::spawn_blocking(move || crate::redb::wait_healthy(&healed))
        .await
        .unwrap();
    let r = app.post("k-full", "x").await;
    assert_eq!((r.status, r.replayed()), (StatusCode::CREATED, false));
    assert_eq!(app.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_keeps_headers_but_drops_the_deny_list() {
    let app = start(layer(), Duration::ZERO).await;
    let first = app.post("k-h", "x").await;
    assert_eq!(first.headers["set-cookie"], "session=s1");
    assert_eq!(first.headers["x-order"], "1");
    let replay = app.post("k-h", "x").await;
    assert!(replay.replayed());
    assert_eq!(replay.headers["x-order"], "1");
    assert_eq!(replay.headers["x-secret"], "s");
    assert!(replay.headers.get("set-cookie").is_none());
    assert_eq!(
        replay.headers["content-type"],
        first.headers["content-type"]
    );

    let custom = layer().deny_headers([http::HeaderName::from_static("x-secret")]);
    let app = start(custom, Duration::ZERO).await;
    app.post("k-h", "x").await;
    let replay = app.post("k-h", "x").await;
    assert!(replay.replayed());
    assert!(replay.headers.get("x-secret").is_none());
    assert_eq!(replay.headers["set-cookie"], "session=s1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_stored_by_default() {
    let app = start(layer(), Duration::ZERO).await;
    let first = app.post_to("/flaky", "k-5").await;
    let retry = app.post_to("/flaky", "k-5").await;
    assert_eq!(
        (first.status, retry.status),
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            StatusCode::INTERNAL_SERVER_ERROR
        )
    );
    assert!(retry.replayed());
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_release_the_claim_under_all_but_5xx() {
    let app = start(
        layer().store_policy(StorePolicy::AllButServerErrors),
        Duration::ZERO,
    )
    .await;
    let first = app.post_to("/flaky", "k-5").await;
    assert_eq!(
        (first.status, first.body.as_str()),
        (StatusCode::INTERNAL_SERVER_ERROR, "boom")
    );
    // Released, not left to its lease: the retry runs at once and is stored.
    let retry = app.post_to("/flaky", "k-5").await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, false)
    );
    let again = app.post_to("/flaky", "k-5").await;
    assert!(again.replayed());
    assert_eq!(again.body, "done on run 2");
    assert_eq!(app.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn do_not_store_marker_keeps_a_response_out() {
    let app = start(layer(), Duration::ZERO).await;
    let first = app.send("POST", "/skip", &["k-s"], "").await;
    assert_eq!(
        (first.status, first.replayed()),
        (StatusCode::ACCEPTED, false)
    );
    let retry = app.send("POST", "/skip", &["k-s"], "").await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, false)
    );
    assert!(app.send("POST", "/skip", &["k-s"], "").await.replayed());
    assert_eq!(app.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scope_separates_tenants() {
    let scoped = layer().scope(|req| {
        req.headers
            .get("x-tenant")
            .map(|v| v.as_bytes().to_vec())
            .unwrap_or_default()
    });
    let app = start(scoped, Duration::ZERO).await;
    let send = |tenant: &'static str| {
        let req = http::Request::post(format!("http://{}/orders", app.addr))
            .header("idempotency-key", "same")
            .header("x-tenant", tenant)
            .body(Full::new(Bytes::from_static(b"x")))
            .unwrap();
        app.client.request(req)
    };
    let a = send("a").await.unwrap();
    let b = send("b").await.unwrap();
    assert!(a.headers().get("idempotent-replayed").is_none());
    assert!(b.headers().get("idempotent-replayed").is_none());
    assert!(
        send("a")
            .await
            .unwrap()
            .headers()
            .get("idempotent-replayed")
            .is_some()
    );
    assert_eq!(app.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storing_failure_sends_the_response_and_keeps_the_claim() {
    // Outcome::NotStored: the handler ran, `complete` failed. The client
    // gets what the handler made; the record stays PROCESSING, so a retry
    // inside the lease is 409, never a second execution.
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = start(
        IdempotencyLayer::new(Guard::new(Arc::clone(&store))),
        Duration::ZERO,
    )
    .await;
    store.fail_next(idemstore_testkit::Op::Complete, 1);
    let first = app.post("k-ns", "x").await;
    assert_eq!(
        (first.status, first.replayed()),
        (StatusCode::CREATED, false)
    );
    assert_eq!(first.body, "order 1 for x under token 1");
    let retry = app.post("k-ns", "x").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_over_the_limit_is_streamed_whole_and_not_stored() {
    let app = start(layer().max_response_body_bytes(16), Duration::ZERO).await;
    let first = app
        .post(
            "k-l",
            "a body long enough to push the response over 16 bytes",
        )
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        first.body,
        "order 1 for a body long enough to push the response over 16 bytes under token 1"
    );
    // Not stored, claim kept (the guard's default OnHandlerError): 409.
    let retry = app
        .post(
            "k-l",
            "a body long enough to push the response over 16 bytes",
        )
        .await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_timeout_then_retries_get_409_then_500_under_reconcile() {
    // The client gives up on a request whose handler hangs; its claim stays.
    // A retry inside the lease gets 409 with the remaining lease; after the
    // lease, a guard with TakeoverPolicy::Reconcile must not run the handler
    // again blindly: the layer answers 500 (outcome unknown).
    let clock = idemstore::ManualClock::new(idemstore::Timestamp::from_millis(0));
    let guard = Guard::builder(MemoryStore::new())
        .clock(clock.clone())
        .lease(Duration::from_secs(10))
        .takeover(idemstore::guard::TakeoverPolicy::Reconcile)
        .build()
        .unwrap();
    let app = start(IdempotencyLayer::new(guard), Duration::from_secs(3600)).await;
    let gave_up = tokio::time::timeout(Duration::from_millis(200), app.post("k-u", "x")).await;
    assert!(
        gave_up.is_err(),
        "the handler hangs, so the client times out"
    );
    assert_eq!(app.runs(), 1);
    // The server drops the handler's future once it sees the connection
    // closed; until then its owner is live in this process, and a retry is
    // told a renewed lease instead of the stored one.
    app.live.until_none().await;
    clock.advance(Duration::from_millis(6500));
    let r = app.post("k-u", "x").await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(
        r.headers["retry-after"], "4",
        "3.5 s of lease left, rounded up"
    );
    clock.advance(Duration::from_secs(10));
    let r = app.post("k-u", "x").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        r.is_problem() && r.body.contains("unknown outcome"),
        "{}",
        r.body
    );
    assert_eq!(app.runs(), 1);
}

/// Echoes the key the layer parsed, as the handler sees it.
async fn echo_key(key: Extension<Key>) -> String {
    format!(
        "{:?}|{:?}",
        String::from_utf8_lossy(key.scope()),
        String::from_utf8_lossy(key.id())
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_reads_the_parsed_key() {
    let layer = IdempotencyLayer::new(Guard::new(MemoryStore::new()))
        .scope(|parts| parts.uri.path().as_bytes().to_vec());
    let app = Router::new().route("/k", post(echo_key)).layer(layer);
    let (addr, client) = serve(app).await;
    // A structured-field string: the quotes and the escape are the header's,
    // not the key's.
    let req = http::Request::post(format!("http://{addr}/k"))
        .header("idempotency-key", r#""a\"b""#)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let r = fetch(&client, req).await;
    assert_eq!(r.body, r#""/k"|"a\"b""#, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_problem_type_can_point_at_the_services_own_docs() {
    const OURS: &str = "https://api.example.com/errors/idempotency-key-reused";
    let app = start(
        layer().problem_type(Problem::KeyReused, OURS),
        Duration::ZERO,
    )
    .await;
    assert_eq!(app.post("k-t", "qty=1").await.status, StatusCode::CREATED);
    let r = app.post("k-t", "qty=2").await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["type"], OURS);
    assert_eq!(v["title"], Problem::KeyReused.title());
    // The others keep theirs.
    let missing = app.send("POST", "/orders", &["k-a", "k-b"], "x").await;
    missing.assert_problem(Problem::KeyInvalid);
}

/// The guard renews the lease while the handler runs: a retry after the
/// first lease ran out (without renewal, a takeover and a second run) is
/// 409 with a `Retry-After` within the renewed lease, and the handler runs
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_longer_than_its_lease_keeps_the_key_and_retries_get_409() {
    let lease = Duration::from_secs(1);
    let guard = Guard::builder(MemoryStore::new())
        .lease(lease)
        .build()
        .unwrap();
    let app = Arc::new(start(IdempotencyLayer::new(guard), 3 * lease + lease / 2).await);
    let first = {
        let app = Arc::clone(&app);
        tokio::spawn(async move { app.post("k-long", "x").await })
    };
    tokio::time::sleep(lease + lease / 2).await;
    assert_eq!(app.runs(), 1);
    let r = app.post("k-long", "x").await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{r:?}");
    r.assert_problem(Problem::InFlight);
    let secs: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert_eq!(secs, 1, "within the renewed lease");
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let again = app.post("k-long", "x").await;
    assert!(again.replayed() && again.body == first.body);
    assert_eq!(app.runs(), 1, "executed once");
}
