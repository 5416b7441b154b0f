//! The HTTP layer's JSON options end to end, on a real TCP loopback socket
//! over `MemoryStore`: fingerprints of chosen body fields
//! (`fingerprint_json_fields`), the key from a body field (`key_from_json`),
//! different settings on two routes (`route_layer`), and each route's
//! published policy.

use crate::tower::{Reply, fetch};
use axum::Router;
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use http::HeaderName;
use http_body_util::Full;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use idemstore::tower::{IdempotencyLayer, Problem};
use idemstore::{Guard, Key, MemoryStore};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

struct App {
    addr: SocketAddr,
    runs: Arc<AtomicUsize>,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// Counts its runs and echoes the key the layer parsed (`-` when the
/// request was not guarded).
async fn handle(
    State(runs): State<Arc<AtomicUsize>>,
    key: Option<Extension<Key>>,
) -> (StatusCode, String) {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let id = key.map_or_else(
        || "-".to_owned(),
        |Extension(k)| String::from_utf8_lossy(k.id()).into_owned(),
    );
    (StatusCode::CREATED, format!("run {n} key {id}"))
}

/// One guard (one store) behind two routes with their own settings:
/// `/payments` requires the header and fingerprints the amount and the
/// currency (and the tenant header); `/transfers` takes its key from the
/// body's `request_id` when there is no header.
fn layers() -> (IdempotencyLayer, IdempotencyLayer) {
    let guard = Guard::new(MemoryStore::new());
    let payments = IdempotencyLayer::new(guard.clone())
        .require_key(true)
        .fingerprint_headers([HeaderName::from_static("x-tenant")])
        .fingerprint_json_fields(["/currency", "/amount"])
        .unwrap();
    let transfers = IdempotencyLayer::new(guard)
        .key_from_json("/request_id")
        .unwrap()
        .fingerprint_json_fields(["/from", "/to", "/amount"])
        .unwrap()
        .max_request_body_bytes(256);
    (payments, transfers)
}

async fn start(payments: IdempotencyLayer, transfers: IdempotencyLayer) -> App {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/payments", post(handle).route_layer(payments))
        .route("/transfers", post(handle).route_layer(transfers))
        .with_state(Arc::clone(&runs));
    let (addr, client) = crate::tower::serve(app).await;
    App { addr, runs, client }
}

impl App {
    async fn send(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        let mut req = http::Request::post(format!("http://{}{path}", self.addr));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
        fetch(&self.client, req).await
    }

    async fn pay(&self, key: &str, body: &str) -> Reply {
        self.send("/payments", &[("idempotency-key", key)], body)
            .await
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

async fn app() -> App {
    let (payments, transfers) = layers();
    start(payments, transfers).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_new_noise_replays_and_a_changed_field_conflicts() {
    let app = app().await;
    let first = app
        .pay(
            "p-1",
            r#"{"amount": 1250, "currency": "EUR", "sent_at": "09:00:00", "trace": "a"}"#,
        )
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    // Another timestamp and trace id, the members reordered, other spacing.
    let retry = app
        .pay(
            "p-1",
            r#"{"trace":"b","currency":"EUR","sent_at":"09:00:07","amount":1250}"#,
        )
        .await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, true)
    );
    assert_eq!(retry.body, first.body);
    // A field that matters changed: the same key is another request.
    let other = app
        .pay("p-1", r#"{"amount": 1251, "currency": "EUR"}"#)
        .await;
    other.assert_problem(Problem::KeyReused);
    // The method and path, and the fingerprinted header, still count.
    let tenant = app
        .send(
            "/payments",
            &[("idempotency-key", "p-1"), ("x-tenant", "acme")],
            r#"{"amount": 1250, "currency": "EUR"}"#,
        )
        .await;
    tenant.assert_problem(Problem::KeyReused);
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_field_is_absent_not_null_and_not_an_error() {
    let app = app().await;
    let r = app.pay("p-2", r#"{"amount": 5}"#).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert!(
        app.pay("p-2", r#"{"amount": 5, "note": "x"}"#)
            .await
            .replayed()
    );
    let null = app.pay("p-2", r#"{"amount": 5, "currency": null}"#).await;
    null.assert_problem(Problem::KeyReused);
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_is_400_and_claims_nothing() {
    // The fingerprint of a body that is not JSON cannot be computed: the
    // handler never runs under it, and the key stays free.
    let app = app().await;
    for body in ["amount=5&currency=EUR", "", "{\"amount\": 5"] {
        let r = app.pay("p-3", body).await;
        r.assert_problem(Problem::BodyNotJson);
        assert!(
            r.body.contains("not JSON") && r.body.contains("/amount, /currency"),
            "{}",
            r.body
        );
    }
    assert_eq!(app.runs(), 0);
    let ok = app.pay("p-3", r#"{"amount": 5, "currency": "EUR"}"#).await;
    assert_eq!((ok.status, ok.replayed()), (StatusCode::CREATED, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_comes_from_the_body_when_the_header_is_absent() {
    let app = app().await;
    let body = r#"{"request_id": "t-1", "from": "a", "to": "b", "amount": 5, "ts": 1}"#;
    let first = app.send("/transfers", &[], body).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, "run 1 key t-1");
    let retry = app
        .send(
            "/transfers",
            &[],
            r#"{"ts": 2, "amount": 5, "to": "b", "from": "a", "request_id": "t-1"}"#,
        )
        .await;
    assert!(retry.replayed(), "{retry:?}");
    // The body's key is the header's key: the same key with other fields
    // conflicts whichever way it comes.
    let by_header = app
        .send(
            "/transfers",
            &[("idempotency-key", "t-1")],
            r#"{"from": "a", "to": "c", "amount": 5}"#,
        )
        .await;
    by_header.assert_problem(Problem::KeyReused);
    // The header wins over the field.
    let both = app
        .send("/transfers", &[("idempotency-key", "h-9")], body)
        .await;
    assert_eq!((both.status, both.replayed()), (StatusCode::CREATED, false));
    assert_eq!(both.body, "run 2 key h-9");
    assert_eq!(app.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_key_field_is_400_and_no_key_passes_through_unless_required() {
    let app = app().await;
    for (body, why) in [
        (r#"{"request_id": 42}"#, "is a number, not a string"),
        (r#"{"request_id": ""}"#, "is empty"),
        (r#"{"request_id": "a b"}"#, "not visible ASCII"),
    ] {
        let r = app.send("/transfers", &[], body).await;
        r.assert_problem(Problem::KeyInvalid);
        assert!(
            r.body.contains("/request_id") && r.body.contains(why),
            "{}",
            r.body
        );
    }
    assert_eq!(app.runs(), 0);
    // No field, or no JSON: no key, so (the key being optional here) the
    // request is not guarded, and its body reaches the handler whole.
    for body in [r#"{"from": "a"}"#, "not json", r#"{"request_id": null}"#] {
        let r = app.send("/transfers", &[], body).await;
        assert_eq!((r.status, r.replayed()), (StatusCode::CREATED, false));
        assert!(r.body.ends_with("key -"), "{}", r.body);
    }
    assert_eq!(app.runs(), 3);
    // With the key required, the 400 names both places to put it.
    let (_, transfers) = layers();
    let (payments, _) = layers();
    let strict = start(payments, transfers.require_key(true)).await;
    let r = strict.send("/transfers", &[], r#"{"from": "a"}"#).await;
    r.assert_problem(Problem::KeyMissing);
    assert!(
        r.body.contains("Idempotency-Key header") && r.body.contains("/request_id"),
        "{}",
        r.body
    );
    assert_eq!(strict.runs(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_is_read_for_its_key_only_up_to_the_limit() {
    let app = app().await;
    let big = format!(r#"{{"request_id": "t-big", "pad": "{}"}}"#, "x".repeat(300));
    let r = app.send("/transfers", &[], &big).await;
    r.assert_problem(Problem::RequestTooLarge);
    assert_eq!(app.runs(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_route_publishes_its_own_policy() {
    let (payments, transfers) = layers();
    let p = payments.policy().to_json();
    assert_eq!(p["key"]["required"], true);
    assert_eq!(p["key"]["json_field"], serde_json::Value::Null);
    assert_eq!(p["fingerprint"]["body"], "json_fields");
    assert_eq!(
        p["fingerprint"]["json_fields"],
        serde_json::json!(["/amount", "/currency"])
    );
    assert_eq!(p["fingerprint"]["headers"], serde_json::json!(["x-tenant"]));
    let t = transfers.policy().to_json();
    assert_eq!(t["key"]["required"], false);
    assert_eq!(t["key"]["json_field"], "/request_id");
    assert_eq!(
        t["fingerprint"]["json_fields"],
        serde_json::json!(["/amount", "/from", "/to"])
    );
    assert_eq!(t["limits"]["request_body_bytes"], 256);
    // Both come from the one guard.
    assert_eq!(p["retention_ms"], t["retention_ms"]);
    assert_eq!(p["lease_ms"], t["lease_ms"]);
    let text = transfers.policy().to_string();
    assert!(
        text.contains("else the JSON body field /request_id"),
        "{text}"
    );
}
