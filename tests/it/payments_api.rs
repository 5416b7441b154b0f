//! The payments API example (examples/payments_api.rs): its scripted story
//! (each answer checked inside), and the policies it publishes per route.

#[path = "../../examples/payments_api.rs"]
#[allow(dead_code, reason = "the example's main is not called here")]
mod app;

use axum::body::Body;
use http::{Request, StatusCode};
use idemstore::{Guard, MemoryStore};
use tower::ServiceExt;

#[tokio::test]
async fn the_story_plays_as_documented() {
    let app = app::router(Guard::new(MemoryStore::new())).unwrap();
    app::demo(&app).await.unwrap();
}

#[tokio::test]
async fn each_route_publishes_its_policy() {
    let app = app::router(Guard::new(MemoryStore::new())).unwrap();
    let res = app
        .oneshot(Request::get(app::POLICY_PATH).body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["content-type"], "application/json");
    let body = axum::body::to_bytes(res.into_body(), 64 * 1024)
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let (payments, transfers) = (&v["/payments"], &v["/transfers"]);
    assert_eq!(payments["key"]["json_field"], serde_json::Value::Null);
    assert_eq!(payments["key"]["required"], true);
    assert_eq!(
        payments["fingerprint"]["json_fields"],
        serde_json::json!(["/account", "/amount", "/currency"])
    );
    assert_eq!(transfers["key"]["json_field"], app::TRANSFER_KEY_FIELD);
    assert_eq!(
        transfers["fingerprint"]["json_fields"],
        serde_json::json!(["/amount", "/from", "/to"])
    );
    assert_eq!(transfers["limits"]["request_body_bytes"], 16 * 1024);
    for route in [payments, transfers] {
        assert_eq!(route["version"], 1);
        assert_eq!(route["retention_ms"], 24 * 3600 * 1000);
        assert!(
            route["renewal"]["every_ms"]
                .as_u64()
                .is_some_and(|ms| ms > 0)
        );
    }
}
