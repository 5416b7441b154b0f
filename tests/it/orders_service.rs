//! The orders service example (examples/orders_service.rs) on a real TCP
//! loopback port, driven by a real HTTP client (hyper-util), over a real
//! redb file: every situation ends with exactly one reservation and one
//! charge per order, or none.

#[path = "../../examples/orders_service.rs"]
#[allow(dead_code, reason = "the example's main is not called here")]
mod app;

use axum::http::StatusCode;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use idemstore::{Guard, ManualClock, RedbStore, Timestamp};
use idemstore_testkit::FaultyStore;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(10);

struct Service {
    addr: SocketAddr,
    client: Client<HttpConnector, Full<Bytes>>,
    store: Arc<RedbStore>,
    /// The guard's store, for injecting faults.
    faults: Arc<FaultyStore<Arc<RedbStore>>>,
    /// The guard's clock, for running out a lease.
    clock: ManualClock,
    _dir: tempfile::TempDir,
}

use crate::tower::{Reply, fetch};

async fn start(delay_after_commit: Duration) -> Service {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(RedbStore::open(dir.path().join("orders.idem")).unwrap());
    app::seed_stock(&store, &[("apple", 100)]).unwrap();
    let faults = Arc::new(FaultyStore::new(Arc::clone(&store)));
    let clock = ManualClock::new(Timestamp::from_millis(1_800_000_000_000));
    let guard = Guard::builder(Arc::clone(&faults))
        .clock(clock.clone())
        .lease(LEASE)
        .build()
        .unwrap();
    let shop = app::Shop {
        store: Arc::clone(&store),
        delay_after_commit,
    };
    let router = app::router(guard, shop);
    let (addr, client) = crate::tower::serve(router).await;
    Service {
        addr,
        client,
        store,
        faults,
        clock,
        _dir: dir,
    }
}

impl Service {
    async fn post(&self, key: Option<&str>, body: impl Into<Bytes>) -> Reply {
        let mut req = http::Request::post(format!("http://{}/orders", self.addr));
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        fetch(&self.client, req.body(Full::new(body.into())).unwrap()).await
    }

    async fn order(&self, key: &str, qty: u64) -> Reply {
        self.post(Some(key), format!(r#"{{"sku":"apple","qty":{qty}}}"#))
            .await
    }

    fn ledger(&self) -> app::Ledger {
        app::ledger(&self.store).unwrap()
    }

    /// Exactly one reservation and one charge for each of `orders` (with
    /// their quantities), none for anything else, and the stock to match.
    fn assert_charged_once(&self, orders: &[(&str, u64)]) {
        let l = self.ledger();
        assert_eq!(l.reservations.len(), orders.len(), "{l:?}");
        assert_eq!(l.charges.len(), orders.len(), "{l:?}");
        for (key, qty) in orders {
            assert_eq!(l.reservations[*key], format!("apple:{qty}"));
            assert_eq!(l.charges[*key].0, qty * app::PRICE_CENTS);
        }
        let sold: u64 = orders.iter().map(|(_, q)| q).sum();
        assert_eq!(l.stock["apple"], 100 - sold, "{l:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_order_is_400_unstored_and_the_corrected_retry_runs() {
    let s = start(Duration::ZERO).await;
    let bad = s
        .post(Some("o-fix"), r#"{"sku":"apple","qty":"two"}"#)
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{bad:?}");
    assert!(!bad.replayed());
    // The same key with the corrected body: runs (not 422, not the 400 again).
    let fixed = s.order("o-fix", 2).await;
    assert_eq!(fixed.status, StatusCode::CREATED, "{fixed:?}");
    s.assert_charged_once(&[("o-fix", 2)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_click_charges_once_and_replays() {
    let s = start(Duration::ZERO).await;
    let first = s.order("o-1", 2).await;
    let second = s.order("o-1", 2).await;
    assert_eq!(
        (first.status, first.replayed()),
        (StatusCode::CREATED, false)
    );
    assert_eq!(
        (second.status, second.replayed()),
        (StatusCode::CREATED, true)
    );
    assert_eq!(first.body, second.body);
    assert!(
        first.body.contains(r#""charged_cents":500"#),
        "{}",
        first.body
    );
    s.assert_charged_once(&[("o-1", 2)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_duplicates_charge_once() {
    let s = Arc::new(start(Duration::from_millis(50)).await);
    let replies = futures_join(&s, "o-16", 16).await;
    let created: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .collect();
    assert!(
        replies
            .iter()
            .all(|r| r.status == StatusCode::CREATED || r.status == StatusCode::CONFLICT),
        "{replies:?}"
    );
    assert_eq!(
        created.iter().filter(|r| !r.replayed()).count(),
        1,
        "{replies:?}"
    );
    s.assert_charged_once(&[("o-16", 1)]);
}

async fn futures_join(s: &Arc<Service>, key: &'static str, n: usize) -> Vec<Reply> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let s = Arc::clone(s);
            tokio::spawn(async move { s.order(key, 1).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_a_client_timeout_charges_once() {
    // The client gives up after the ledger committed but before the answer
    // (the handler is slow to respond); its HTTP record may never be
    // completed. A retry inside the lease gets 409; after the lease the key
    // is taken over and the handler runs again, and its recorded steps
    // must hand back the first reservation and charge instead of making
    // second ones.
    let s = start(Duration::from_millis(800)).await;
    let gave_up = tokio::time::timeout(Duration::from_millis(300), s.order("o-t", 3)).await;
    assert!(
        gave_up.is_err(),
        "the handler is slow, so the client times out"
    );
    let busy = s.order("o-t", 3).await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");
    assert!(busy.headers.contains_key("retry-after"));
    // Let the first handler finish (or be dropped with its connection), and
    // run out its lease either way. Until the server has dropped or
    // finished it, its owner is live in this process and a retry is told
    // InFlight whatever the clock says: a loaded machine may take longer
    // than the handler's 800 ms, so the client retries on 409 as told.
    tokio::time::sleep(Duration::from_millis(900)).await;
    s.clock.advance(LEASE);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let r = loop {
        let r = s.order("o-t", 3).await;
        if r.status != StatusCode::CONFLICT {
            break r;
        }
        assert!(std::time::Instant::now() < deadline, "{r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert!(r.body.contains(r#""order":"o-t""#), "{}", r.body);
    // hyper drops the first response future with its connection, so the
    // HTTP record stays PROCESSING and this retry re-ran the handler (not a
    // replay); either way the answer is the first run's charge.
    let (_, charge_token) = s.ledger().charges["o-t"];
    assert!(
        r.body.contains(&format!(r#""token":{charge_token}"#)),
        "replayed={} {}",
        r.replayed(),
        r.body
    );
    s.assert_charged_once(&[("o-t", 3)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflicting_payload_is_422_and_charges_nothing_more() {
    let s = start(Duration::ZERO).await;
    assert_eq!(s.order("o-c", 1).await.status, StatusCode::CREATED);
    let r = s.order("o-c", 5).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{r:?}");
    s.assert_charged_once(&[("o-c", 1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_key_is_400_and_charges_nothing() {
    let s = start(Duration::ZERO).await;
    let r = s.post(None, r#"{"sku":"apple","qty":1}"#).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{r:?}");
    s.assert_charged_once(&[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_is_413_and_charges_nothing() {
    let s = start(Duration::ZERO).await;
    let padding = " ".repeat(app::MAX_ORDER_BYTES);
    let r = s
        .post(
            Some("o-big"),
            format!(r#"{{"sku":"apple","qty":1}}{padding}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{r:?}");
    s.assert_charged_once(&[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_store_is_503_then_the_retry_charges_once() {
    let s = start(Duration::ZERO).await;
    s.faults.fail_all();
    let r = s.order("o-down", 4).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{r:?}");
    assert!(r.headers.contains_key("retry-after"));
    s.assert_charged_once(&[]);
    s.faults.clear_fault();
    let r = s.order("o-down", 4).await;
    assert_eq!((r.status, r.replayed()), (StatusCode::CREATED, false));
    let again = s.order("o-down", 4).await;
    assert_eq!(
        (again.status, again.replayed()),
        (StatusCode::CREATED, true)
    );
    s.assert_charged_once(&[("o-down", 4)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_stock_is_a_stored_409_that_charges_nothing() {
    let s = start(Duration::ZERO).await;
    let r = s.order("o-many", 1000).await;
    assert_eq!((r.status, r.replayed()), (StatusCode::CONFLICT, false));
    assert!(r.body.contains("OUT_OF_STOCK"));
    let again = s.order("o-many", 1000).await;
    assert_eq!(
        (again.status, again.replayed()),
        (StatusCode::CONFLICT, true)
    );
    s.assert_charged_once(&[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idempotency_policy_is_published() {
    let s = start(Duration::ZERO).await;
    let req = http::Request::get(format!("http://{}{}", s.addr, app::POLICY_PATH))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let r = fetch(&s.client, req).await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.headers["content-type"], "application/json");
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    // What this service's layer and guard do, not the defaults.
    assert_eq!(v["version"], 1, "{v}");
    assert_eq!(v["methods"], serde_json::json!(["POST", "PATCH"]));
    assert_eq!(v["key"]["required"], true);
    assert_eq!(v["key"]["header"], "Idempotency-Key");
    assert_eq!(v["fingerprint"]["body"], "bytes");
    assert_eq!(v["lease_ms"], LEASE.as_millis() as u64);
    assert_eq!(v["retention_ms"], 24 * 3600 * 1000);
    // Renewed every third of the lease while an order runs.
    assert_eq!(v["renewal"]["every_ms"], (LEASE / 3).as_millis() as u64);
    assert_eq!(v["limits"]["request_body_bytes"], app::MAX_ORDER_BYTES);
    assert_eq!(v["unavailable"]["status"], 503);
    // Served outside the layer: a key on the GET changes nothing.
    let keyed = http::Request::get(format!("http://{}{}", s.addr, app::POLICY_PATH))
        .header("idempotency-key", "o-policy")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let again = fetch(&s.client, keyed).await;
    assert_eq!((again.status, again.replayed()), (StatusCode::OK, false));
    assert_eq!(again.body, r.body);
    s.assert_charged_once(&[]);
}
