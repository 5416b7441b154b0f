//! An orders service: `POST /orders` reserves stock and charges a payment
//! in a ledger kept in the same redb file as the idempotency records.
//!
//! - [`IdempotencyLayer`] gives the HTTP semantics: a retry with the same
//!   `Idempotency-Key` gets the first response back, a duplicate in flight
//!   gets 409, a reused key with another body 422, a dead store 503.
//! - The handler runs in two steps, each an atomic phase
//!   ([`RedbStore::atomic_step`]): `reserve` (stock and reservation rows)
//!   and `charge` (the charge row), each committed in one redb transaction
//!   with the step's record on the key. So even when the HTTP record could
//!   not be completed (the client hung up and the response future was
//!   dropped, then the lease ran out and a retry took the key over), the
//!   re-run handler gets both steps' outputs back instead of reserving and
//!   charging twice. The charge row keeps the fencing token of the run
//!   that made it; a payment provider would get the step key instead.
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
use idemstore::redb::Inbox;
use idemstore::redb::engine::{ReadableTable, TableDefinition};
use idemstore::tower::{DoNotStore, IdempotencyLayer};
use idemstore::{BoxError, Claim, Fingerprint, Guard, Key, RedbStore, Response, Store};
use std::collections::BTreeMap;
use std::sync::Arc;
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
/// The service's state: the store the ledger shares with the layer, and an
/// artificial delay after the ledger writes (tests use it to make a client
/// time out).
#[derive(Clone, Debug)]
pub struct Shop {
    /// The store under the HTTP layer's guard.
    pub store: Arc<RedbStore>,
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
    // The ledger commits fsync: off the async workers.
    let steps =
        tokio::task::spawn_blocking(move || reserve_and_charge(&shop.store, &key, &claim, &order))
            .await
            .unwrap_or_else(|e| Err(e.into()));
    let response = match steps {
        Ok(response) => response,
        Err(e) => Response::new(503, format!("ledger unavailable: {e}")),
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

/// The order's two steps. An out-of-stock answer is the `reserve` step's
/// output (nothing reserved, nothing to charge), stored like any response.
fn reserve_and_charge(
    store: &RedbStore,
    key: &Key,
    claim: &Claim,
    order: &Order,
) -> Result<Response, BoxError> {
    let order_id = String::from_utf8_lossy(key.id()).into_owned();
    // The step's output is the refusal to answer with, empty when reserved.
    let refused = store.atomic_step(key, claim, "reserve", |txn, _| -> Result<_, BoxError> {
        let mut stock = txn.open_table(STOCK)?;
        let on_hand = stock.get(order.sku.as_str())?.map(|v| v.value());
        match on_hand {
            None => return Ok(br#"404 {"error":"UNKNOWN_SKU"}"#.to_vec()),
            Some(n) if n < order.qty => return Ok(br#"409 {"error":"OUT_OF_STOCK"}"#.to_vec()),
            Some(n) => stock.insert(order.sku.as_str(), n - order.qty)?,
        };
        let reservation = format!("{}:{}", order.sku, order.qty);
        txn.open_table(RESERVATIONS)?
            .insert(order_id.as_str(), reservation.as_str())?;
        Ok(Vec::new())
    })?;
    if let Some((status, body)) = std::str::from_utf8(&refused)?.split_once(' ') {
        return Ok(Response::new(status.parse()?, body.to_owned()));
    }
    let amount = order.qty * PRICE_CENTS;
    let token = claim.token();
    let charge = store.atomic_step(key, claim, "charge", |txn, _| -> Result<_, BoxError> {
        txn.open_table(CHARGES)?
            .insert(order_id.as_str(), (amount, token))?;
        Ok(token.to_string().into_bytes())
    })?;
    let body = serde_json::json!({
        "order": order_id, "sku": order.sku, "qty": order.qty,
        "charged_cents": amount, "token": String::from_utf8_lossy(&charge).parse::<u64>()?,
    });
    Ok(Response::new(201, body.to_string()))
}

/// Puts stock on the shelf once per file (a guarded run of its own, so a
/// restart does not restock).
pub fn seed_stock(store: &Arc<RedbStore>, items: &[(&str, u64)]) -> Result<(), BoxError> {
    let key = Key::new("orders.setup", "initial-stock")?;
    let seeded = Guard::new(Arc::clone(store)).run(&key, &Fingerprint::of(b"v1"), |claim| {
        store.atomic_step(&key, claim, "stock", |txn, _| -> Result<_, BoxError> {
            let mut stock = txn.open_table(STOCK)?;
            for (sku, qty) in items {
                stock.insert(*sku, *qty)?;
            }
            Ok(Vec::new())
        })?;
        Ok::<_, BoxError>(Response::new(200, ""))
    });
    match seeded.response() {
        Some(_) => Ok(()),
        None => Err(format!("stock not seeded: {seeded:?}").into()),
    }
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
pub fn ledger(store: &Arc<RedbStore>) -> Result<Ledger, BoxError> {
    Inbox::new(Arc::clone(store)).read(|txn| {
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
    let store = Arc::new(RedbStore::open(&path)?);
    seed_stock(&store, &[("apple", 100), ("pear", 10)])?;
    let app = router(
        Guard::new(Arc::clone(&store)),
        Shop {
            store,
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
