//! A payments API whose two routes identify their requests differently,
//! over one idempotency store, each with its own `route_layer`:
//!
//! - `POST /payments`, for apps that send an `Idempotency-Key` header (it
//!   is required). Their SDK stamps every attempt with `sent_at` and a
//!   `trace_id`, so a whole-body fingerprint would turn an honest retry
//!   into a 422: the fingerprint is the fields that say what is paid
//!   (`/amount`, `/currency`, `/account`).
//! - `POST /transfers`, for a batch system that cannot set headers: its
//!   key is the body's `request_id` (a header still wins when one is sent),
//!   and the fingerprint is `/from`, `/to` and `/amount`.
//! - `GET /idempotency-policy`: each route's published policy, as JSON.
//!
//! Run it: `cargo run --example payments_api --features tower` plays a few
//! requests through the app in process and prints the answers;
//! `cargo run --example payments_api --features tower -- --serve 127.0.0.1:3001`
//! serves it, then
//! `curl -i localhost:3001/transfers -d '{"request_id":"t-1","from":"a","to":"b","amount":5}'`
//! (twice) and `curl localhost:3001/idempotency-policy`.
//!
//! `idemstore fingerprint --method POST --path /payments --json-field /amount
//! --json-field /currency --json-field /account --body payment.json` computes
//! what `/payments` stores, for an operator asking why a request got 422.

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Extension;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use idemstore::tower::IdempotencyLayer;
use idemstore::{BoxError, Claim, Guard, Key, MemoryStore, Store};
use serde_json::{Value, json};
use tower::ServiceExt;

/// What identifies a payment; anything else in its body may change on a retry.
pub const PAYMENT_FIELDS: [&str; 3] = ["/amount", "/currency", "/account"];
/// What identifies a transfer.
pub const TRANSFER_FIELDS: [&str; 3] = ["/from", "/to", "/amount"];
/// Where a transfer's key is when its client sends no header.
pub const TRANSFER_KEY_FIELD: &str = "/request_id";
/// Where the policies are published.
pub const POLICY_PATH: &str = "/idempotency-policy";

/// The two routes' layers over one guard. A pointer that is not RFC 6901
/// fails here, when the app is built, never on a request.
pub fn layers<S: Store + 'static>(
    guard: Guard<S>,
) -> Result<(IdempotencyLayer, IdempotencyLayer), idemstore::Error> {
    let payments = IdempotencyLayer::new(guard.clone())
        .require_key(true)
        .fingerprint_json_fields(PAYMENT_FIELDS)?;
    let transfers = IdempotencyLayer::new(guard)
        .require_key(true)
        .key_from_json(TRANSFER_KEY_FIELD)?
        .fingerprint_json_fields(TRANSFER_FIELDS)?
        .max_request_body_bytes(16 * 1024);
    Ok((payments, transfers))
}

/// The app: the two guarded routes and the published policies.
pub fn router<S: Store + 'static>(guard: Guard<S>) -> Result<Router, idemstore::Error> {
    let (payments, transfers) = layers(guard)?;
    let policies = json!({
        "/payments": payments.policy(),
        "/transfers": transfers.policy(),
    })
    .to_string();
    Ok(Router::new()
        .route("/payments", post(execute).route_layer(payments))
        .route("/transfers", post(execute).route_layer(transfers))
        .route(
            POLICY_PATH,
            get(move || {
                std::future::ready(([("content-type", "application/json")], policies.clone()))
            }),
        ))
}

/// Executes a payment or a transfer (here: echoes what it would do). The
/// key is the one the layer found, from the header or the body.
async fn execute(
    Extension(key): Extension<Key>,
    Extension(claim): Extension<Claim>,
    body: Bytes,
) -> impl IntoResponse {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        // The layer already refused bodies that are not JSON (400).
        return (StatusCode::BAD_REQUEST, "expected a JSON body".to_owned());
    };
    let answer = json!({
        "id": String::from_utf8_lossy(key.id()),
        "amount": request.get("amount"),
        // Pass it downstream as the provider's own idempotency key.
        "token": claim.token(),
    });
    (StatusCode::CREATED, answer.to_string())
}

/// One request through `app`: its status, whether it was a replay, its body.
async fn send(
    app: &Router,
    path: &str,
    key: Option<&str>,
    body: Value,
) -> Result<(StatusCode, bool, String), BoxError> {
    let mut req = Request::post(path).header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let res = app
        .clone()
        .oneshot(req.body(Body::from(body.to_string()))?)
        .await?;
    let replayed = res.headers().contains_key("idempotent-replayed");
    let status = res.status();
    let body = axum::body::to_bytes(res.into_body(), 64 * 1024).await?;
    Ok((
        status,
        replayed,
        String::from_utf8_lossy(&body).into_owned(),
    ))
}

/// A short story through the app, printed; each answer is checked, so a
/// change of behaviour fails the example (and its test).
pub async fn demo(app: &Router) -> Result<(), BoxError> {
    let pay = |at: &str, amount: u64| {
        json!({"amount": amount, "currency": "EUR", "account": "acc-7",
               "sent_at": at, "trace_id": format!("trace-{at}")})
    };
    let transfer = |at: &str| {
        json!({"request_id": "tr-1", "from": "acc-7", "to": "acc-9",
               "amount": 300, "sent_at": at})
    };
    // (what, path, Idempotency-Key header, body, expected status, replayed?)
    #[rustfmt::skip] // a table: one step per line reads best
    let steps = [
        ("a payment",                        "/payments",  Some("p-1"), pay("9:00", 1250),     201, false),
        ("its retry: new sent_at, trace_id", "/payments",  Some("p-1"), pay("9:04", 1250),     201, true),
        ("the same key, another amount",     "/payments",  Some("p-1"), pay("9:09", 99),       422, false),
        ("a payment without the header",     "/payments",  None,        pay("9:10", 5),        400, false),
        ("a transfer, its key in the body",  "/transfers", None,        transfer("10:00"),     201, false),
        ("its retry",                        "/transfers", None,        transfer("10:30"),     201, true),
        ("a transfer without a key",         "/transfers", None,        json!({"amount": 1}),  400, false),
    ];
    for (what, path, key, body, want, replay) in steps {
        let (status, replayed, text) = send(app, path, key, body).await?;
        let note = if replayed { " (replayed)" } else { "" };
        println!("{what}\n  -> {status}{note}: {text}");
        assert_eq!(
            (status.as_u16(), replayed),
            (want, replay),
            "{what}: {text}"
        );
    }
    let policy = app
        .clone()
        .oneshot(Request::get(POLICY_PATH).body(Body::empty())?)
        .await?;
    let policy = axum::body::to_bytes(policy.into_body(), 64 * 1024).await?;
    let policy: Value = serde_json::from_slice(&policy)?;
    println!(
        "GET {POLICY_PATH}\n{}",
        serde_json::to_string_pretty(&policy)?
    );
    Ok(())
}

#[allow(
    dead_code,
    reason = "the tests include this file for its router and demo and do not call main"
)]
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let guard = Guard::new(MemoryStore::new()); // RedbStore::open(path) in production
    let (payments, _) = layers(guard.clone())?;
    println!("POST /payments:\n{}\n", payments.policy());
    let app = router(guard)?;
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("--serve") => {
            let addr = args.next().unwrap_or_else(|| "127.0.0.1:3001".to_owned());
            let listener = tokio::net::TcpListener::bind(&addr).await?;
            println!("payments API on http://{addr}");
            axum::serve(listener, app).await?;
        }
        _ => demo(&app).await?,
    }
    Ok(())
}
