//! An orders service: `POST /orders` reserves stock and charges a payment
//! in a ledger kept in the same redb file as the idempotency records.
//!
//! Two layers of protection, each doing what it is good at:
//!
//! - [`IdempotencyLayer`] gives the HTTP semantics: a retry with the same
//!   `Idempotency-Key` gets the first response back, a duplicate in flight
//!   gets 409, a reused key with another body 422, a dead store 503.
//! - The handler's business write (stock, reservation, charge) goes through
//!   an [`Inbox`] keyed by the same idempotency key: the three rows and the
//!   ledger's own DONE record commit in one redb transaction. So even when
//!   the HTTP record could not be completed (the client hung up and the
//!   response future was dropped, then the lease ran out and a retry took
//!   the key over), the re-run handler finds the ledger entry and returns it
//!   instead of charging twice. The fencing token is recorded with the
//!   charge, for a downstream payment provider's own idempotency key.
//!
//! The layer's effective policy (retention, lease, limits, what is
//! fingerprinted, where the key comes from) is published at
//! `GET /idempotency-policy`, as the IETF Idempotency-Key draft asks.
//!
//! Run: `cargo run --example orders_service --features tracing,metrics -- /tmp/orders.idem`,
//! then `curl -i -X POST localhost:3000/orders -H 'Idempotency-Key: o-1' -d '{"sku":"apple","qty":2}'`
//! and `curl localhost:3000/idempotency-policy`.
//! It logs through `tracing-subscriber` (`RUST_LOG=idemstore=debug` for
//! every request's span) and serves the crate's metrics for Prometheus on
//! `GET /metrics` (`curl localhost:3000/metrics`); without the features the
//! crate reports nothing there.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::routing::{get, post};
use idemstore::redb::engine::{ReadableTable, TableDefinition, WriteTransaction};
use idemstore::redb::{Delivery, Inbox};
use idemstore::tower::{DoNotStore, IdempotencyLayer};
use idemstore::{BoxError, Claim, Fingerprint, Guard, Key, RedbStore, Response, Store};
use std::collections::BTreeMap;
use std::time::Duration;

/// sku -> units on hand.
pub const STOCK: TableDefinition<&str, u64> = TableDefinition::new("shop.stock");
/// order (idempotency key) -> "sku:qty".
pub const RESERVATIONS: TableDefinition<&str, &str> = TableDefinition::new("shop.reservations");
/// order (idempotency key) -> (amount in cents, fencing token of the run that charged).
pub const CHARGES: TableDefinition<&str, (u64, u64)> = TableDefinition::new("shop.charges");
/// Price of one unit, in cents.
pub const PRICE_CENTS: u64 = 250;
/// Largest order body accepted (413 above, without running the handler).
pub const MAX_ORDER_BYTES: usize = 1024;
/// The inbox scope of the ledger's own dedup records.
const LEDGER_SCOPE: &str = "orders.ledger";

/// The service's state: the ledger's inbox and an artificial delay after the
/// ledger write (tests use it to make a client time out).
#[derive(Clone, Debug)]
pub struct Shop {
    /// The inbox on the same store as the HTTP layer's guard.
    pub inbox: Inbox,
    /// Sleep after the ledger commit, before answering.
    pub delay_after_commit: Duration,
}

/// Where the idempotency policy is published. Not under `/.well-known/`:
/// the draft registers no name there.
pub const POLICY_PATH: &str = "/idempotency-policy";

/// The app: `POST /orders` behind the idempotency layer (key required),
/// and the layer's policy at [`POLICY_PATH`].
pub fn router<S: Store + 'static>(guard: Guard<S>, shop: Shop) -> Router {
    let idempotency = IdempotencyLayer::new(guard)
        .require_key(true)
        .max_request_body_bytes(MAX_ORDER_BYTES);
    // Rendered once: the policy is the layer's configuration, which does
    // not change while the service runs.
    let policy = idempotency.policy().to_json().to_string();
    Router::new()
        .route("/orders", post(create_order))
        .with_state(shop)
        .layer(idempotency)
        // Added after `layer`, so outside it.
        .route(
            POLICY_PATH,
            get(move || {
                std::future::ready(([("content-type", "application/json")], policy.clone()))
            }),
        )
}

#[derive(serde::Deserialize)]
struct Order {
    sku: String,
    qty: u64,
}

async fn create_order(
    State(shop): State<Shop>,
    Extension(key): Extension<Key>,
    Extension(claim): Extension<Claim>,
    body: Bytes,
) -> HttpResponse {
    // A request that fails validation never started executing: its 400 is
    // not stored (DoNotStore releases the claim), so the client's corrected
    // retry with the same key runs, instead of replaying the 400 or getting
    // 422 for the changed body (Stripe's practice).
    let order = match serde_json::from_slice::<Order>(&body) {
        Ok(order) if order.qty > 0 && !order.sku.is_empty() => order,
        _ => {
            return (
                StatusCode::BAD_REQUEST,
                Extension(DoNotStore),
                "expected {\"sku\": non-empty string, \"qty\": positive number}",
            )
                .into_response();
        }
    };
    // The key as the layer parsed it (the header's quoting removed).
    let order_id = String::from_utf8_lossy(key.id()).into_owned();
    let token = claim.token();
    let inbox = shop.inbox.clone();
    // The ledger commit fsyncs: off the async workers.
    let ledger = tokio::task::spawn_blocking(move || -> Result<Delivery, BoxError> {
        let key = Key::new(LEDGER_SCOPE, order_id.as_str())?;
        inbox.handle(&key, &Fingerprint::of(&body), |txn, _| {
            reserve_and_charge(txn, &order_id, &order, token)
        })
    })
    .await;
    let response = match ledger {
        Ok(Ok(Delivery::Handled(r) | Delivery::Duplicate(r))) => r,
        Ok(Ok(Delivery::Conflict)) => Response::new(422, "order id reused with another body"),
        Ok(Ok(other)) => Response::new(503, format!("ledger busy: {other:?}")),
        Ok(Err(e)) => Response::new(503, format!("ledger unavailable: {e}")),
        Err(e) => Response::new(500, format!("ledger task failed: {e}")),
    };
    tokio::time::sleep(shop.delay_after_commit).await;
    let status =
        StatusCode::from_u16(response.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [("content-type", "application/json")],
        response.body().to_vec(),
    )
        .into_response()
}

/// The business write, inside the ledger's transaction. An out-of-stock
/// answer writes nothing of its own and is recorded like any other result.
fn reserve_and_charge(
    txn: &WriteTransaction,
    order_id: &str,
    order: &Order,
    token: u64,
) -> Result<Response, BoxError> {
    let mut stock = txn.open_table(STOCK)?;
    let on_hand = stock.get(order.sku.as_str())?.map(|v| v.value());
    let Some(on_hand) = on_hand else {
        return Ok(Response::new(404, r#"{"error":"UNKNOWN_SKU"}"#));
    };
    if order.qty == 0 || on_hand < order.qty {
        return Ok(Response::new(409, r#"{"error":"OUT_OF_STOCK"}"#));
    }
    stock.insert(order.sku.as_str(), on_hand - order.qty)?;
    let amount = order.qty * PRICE_CENTS;
    txn.open_table(RESERVATIONS)?
        .insert(order_id, format!("{}:{}", order.sku, order.qty).as_str())?;
    txn.open_table(CHARGES)?.insert(order_id, (amount, token))?;
    let body = serde_json::json!({
        "order": order_id, "sku": order.sku, "qty": order.qty,
        "charged_cents": amount, "token": token,
    });
    Ok(Response::new(201, body.to_string()))
}

/// Puts stock on the shelf once per file (an inbox message of its own, so a
/// restart does not restock).
pub fn seed_stock(inbox: &Inbox, items: &[(&str, u64)]) -> Result<(), BoxError> {
    let key = Key::new("orders.setup", "initial-stock")?;
    inbox.handle(&key, &Fingerprint::of(b"initial-stock"), |txn, _| {
        let mut stock = txn.open_table(STOCK)?;
        for (sku, qty) in items {
            stock.insert(*sku, *qty)?;
        }
        Ok::<_, BoxError>(Response::new(200, ""))
    })?;
    Ok(())
}

/// What the ledger holds: stock by sku, reservations and charges by order.
#[derive(Debug, Default)]
pub struct Ledger {
    /// sku -> units on hand.
    pub stock: BTreeMap<String, u64>,
    /// order -> "sku:qty".
    pub reservations: BTreeMap<String, String>,
    /// order -> (cents, token).
    pub charges: BTreeMap<String, (u64, u64)>,
}

/// Reads the whole ledger.
pub fn ledger(inbox: &Inbox) -> Result<Ledger, BoxError> {
    inbox.read(|txn| {
        let mut out = Ledger::default();
        // Tables appear with their first write.
        if let Ok(t) = txn.open_table(STOCK) {
            for e in t.iter()? {
                let (k, v) = e?;
                out.stock.insert(k.value().to_owned(), v.value());
            }
        }
        if let Ok(t) = txn.open_table(RESERVATIONS) {
            for e in t.iter()? {
                let (k, v) = e?;
                out.reservations
                    .insert(k.value().to_owned(), v.value().to_owned());
            }
        }
        if let Ok(t) = txn.open_table(CHARGES) {
            for e in t.iter()? {
                let (k, v) = e?;
                out.charges.insert(k.value().to_owned(), v.value());
            }
        }
        Ok(out)
    })
}

#[allow(
    dead_code,
    reason = "the tests include this file for its router and do not call main"
)]
#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "orders.idem".to_owned());
    let addr = std::env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let store = std::sync::Arc::new(RedbStore::open(&path)?);
    let inbox = Inbox::new(std::sync::Arc::clone(&store));
    seed_stock(&inbox, &[("apple", 100), ("pear", 10)])?;
    let app = router(
        Guard::new(store),
        Shop {
            inbox,
            delay_after_commit: Duration::ZERO,
        },
    );
    // The scrape endpoint, outside the idempotency layer.
    let app = app.merge(Router::new().route(
        "/metrics",
        axum::routing::get(move || std::future::ready(prometheus.render())),
    ));
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(%addr, %path, "orders service listening");
    axum::serve(listener, app).await?;
    Ok(())
}
