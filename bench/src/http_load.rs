//! The HTTP load benchmark (`http_load`): an axum service with
//! idemstore's `IdempotencyLayer` on one store (or none), on its own tokio
//! runtime, driven over loopback by a hyper client on a second runtime in
//! the same process, one keep-alive connection per concurrent client.
//!
//! Every response is checked, so a broken layer cannot produce a fast
//! number: a fresh key must get 201 without `Idempotent-Replayed`; a
//! re-sent key (same body, a recent key of the same connection, so its
//! first request is done) must get 201, `Idempotent-Replayed: true` and the
//! first response's body. Without the layer (`none`) a re-sent key simply
//! runs again and must get 201.
//!
//! Two variants put a hand-written idempotency middleware in front of the
//! app instead of the layer, the way users write one without idemstore:
//! `redis-mw` on Redis, `pg-mw` on PostgreSQL (the `postgres` feature).

use crate::peers::{BoxResult, open_backend, percentile};
use crate::procstat::{
    ThreadSampler, ensure_open_files, peak_rss_bytes, process_cpu_seconds, threads,
    threads_cpu_seconds,
};
use axum::Router;
use axum::extract::{Extension, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::serve::ListenerExt;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idemstore::tower::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyLayer};
use idemstore::{Claim, Guard};
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The variants, in table order: no layer, then the layer on each store,
/// `pg-mw` after `postgres`: the idempotency middleware as users write it
/// by hand on PostgreSQL (`INSERT .. ON CONFLICT DO NOTHING RETURNING` to
/// claim, `UPDATE` for the result, `SELECT` for a replay), on the same
/// server as `postgres` (`IDEMSTORE_PG_URL`, the `postgres` feature); then
/// `redis-mw`: the same middleware on Redis (`SET NX PX` to claim, `SET XX
/// PX` for the result, `GET` for a replay), when `IDEMSTORE_REDIS_URL`
/// names a server (its durability is the server's `appendfsync`; CI's runs
/// `always`).
pub const VARIANTS: [&str; 6] = ["none", "memory", "redb", "postgres", "pg-mw", "redis-mw"];

/// Variants run only when listed: `redb-relaxed`, the layer on `RedbStore`
/// with its log synced every 100 ms instead of once per group.
pub const EXTRA_VARIANTS: [&str; 1] = ["redb-relaxed"];

/// The route under load.
pub const PATH: &str = "/orders";

/// Recent completed keys each connection keeps for duplicates.
const RECENT_KEYS: usize = 16;

/// Files a cell needs besides its sockets (two per connection): the store,
/// the runtimes, `/proc` reads.
const SPARE_FILES: u64 = 256;

/// How long a cell waits for its connections to finish their last request.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// One cell: one variant at one concurrency.
#[derive(Clone, Debug)]
pub struct CellParams {
    /// One of [`VARIANTS`] or [`EXTRA_VARIANTS`].
    pub variant: String,
    /// Concurrent clients, one keep-alive connection each.
    pub connections: usize,
    /// Load before the measurement, not counted.
    pub warmup: Duration,
    /// The measured window.
    pub duration: Duration,
    /// The share (0..=1) of requests that re-send a recent key.
    pub dup_ratio: f64,
    /// The server runtime's worker threads.
    pub server_workers: usize,
    /// The client runtime's worker threads.
    pub client_workers: usize,
    /// The server runtime's blocking-pool limit; `None`: tokio's default (512).
    pub max_blocking_threads: Option<usize>,
}

/// What one cell measured; [`CellReport::json`] is its `--json` form.
#[derive(Clone, Debug, Default)]
pub struct CellReport {
    /// The variant.
    pub variant: String,
    /// Concurrent connections.
    pub connections: usize,
    /// Requests completed (and checked) in the measured window.
    pub requests: u64,
    /// The measured window, seconds.
    pub seconds: f64,
    /// Median latency, µs.
    pub p50_us: f64,
    /// 99th-percentile latency, µs.
    pub p99_us: f64,
    /// 99.9th-percentile latency, µs.
    pub p999_us: f64,
    /// Responses that were replays, in the window.
    pub replays: u64,
    /// Responses that failed their check (warm-up included), by kind: the
    /// status (`"409"`), or what was wrong.
    pub errors: BTreeMap<String, u64>,
    /// The process's threads when the load started (runtimes, store, sampler).
    pub threads_at_start: u64,
    /// The process's peak thread count, sampled every 10 ms.
    pub peak_threads: u64,
    /// The process's peak resident set size (`VmHWM`).
    pub peak_rss_bytes: u64,
    /// Requests per commit group, where the store batches (warm-up included).
    pub mean_group: Option<f64>,
    /// CPU time per request in the window, µs, of everything but the load
    /// client (the server runtime, the layer, the store and its threads).
    pub server_cpu_us: f64,
    /// CPU time per request in the window, µs, of the load client's threads.
    pub client_cpu_us: f64,
}

impl CellReport {
    /// Requests per second in the window.
    pub fn requests_per_sec(&self) -> f64 {
        self.requests as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }

    /// All errors.
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// One JSON object.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "variant": self.variant,
            "connections": self.connections,
            "requests_per_sec": round1(self.requests_per_sec()),
            "p50_us": round1(self.p50_us),
            "p99_us": round1(self.p99_us),
            "p999_us": round1(self.p999_us),
            "requests": self.requests,
            "replays": self.replays,
            "errors": self.errors,
            "threads_at_start": self.threads_at_start,
            "peak_threads": self.peak_threads,
            "peak_rss_bytes": self.peak_rss_bytes,
            "mean_group": self.mean_group.map(round1),
            "server_cpu_us_per_request": round1(self.server_cpu_us),
            "client_cpu_us_per_request": round1(self.client_cpu_us),
            "seconds": (self.seconds * 1000.0).round() / 1000.0,
        })
    }

    /// Reads [`CellReport::json`]'s form back.
    pub fn from_json(v: &serde_json::Value) -> BoxResult<CellReport> {
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
        let int = |k: &str| v.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
        let seconds = num("seconds");
        Ok(CellReport {
            variant: v
                .get("variant")
                .and_then(serde_json::Value::as_str)
                .ok_or("cell report without a variant")?
                .to_owned(),
            connections: usize::try_from(int("connections"))?,
            requests: int("requests"),
            seconds,
            p50_us: num("p50_us"),
            p99_us: num("p99_us"),
            p999_us: num("p999_us"),
            replays: int("replays"),
            errors: v
                .get("errors")
                .and_then(serde_json::Value::as_object)
                .map(|m| {
                    m.iter()
                        .map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0)))
                        .collect()
                })
                .unwrap_or_default(),
            threads_at_start: int("threads_at_start"),
            peak_threads: int("peak_threads"),
            peak_rss_bytes: int("peak_rss_bytes"),
            mean_group: v.get("mean_group").and_then(serde_json::Value::as_f64),
            server_cpu_us: num("server_cpu_us_per_request"),
            client_cpu_us: num("client_cpu_us_per_request"),
        })
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Creates an order: 201 with a small JSON body naming the order, the
/// fencing token (0 without the layer) and the request's size.
async fn create_order(claim: Option<Extension<Claim>>, body: Bytes) -> impl IntoResponse {
    static ORDERS: AtomicU64 = AtomicU64::new(0);
    let order = ORDERS.fetch_add(1, Ordering::Relaxed) + 1;
    let token = claim.map_or(0, |Extension(c)| c.token());
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        format!(
            "{{\"order\":{order},\"token\":{token},\"request_bytes\":{}}}",
            body.len()
        ),
    )
}

/// The app: `POST /orders`, behind the layer when there is one.
pub async fn app(front: Front) -> BoxResult<Router> {
    let router = Router::new().route(PATH, post(create_order));
    Ok(match front {
        Front::None => router,
        Front::Layer(layer) => router.layer(layer),
        Front::Redis(url) => {
            let con = redis::Client::open(url)?
                .get_multiplexed_async_connection()
                .await?;
            // Keys of this app only: cells share the server, and a key
            // another cell completed would replay here.
            let run = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let prefix = Arc::from(format!("idem:{}:{run}:", std::process::id()));
            router.layer(axum::middleware::from_fn_with_state(
                RedisMiddleware { con, prefix },
                redis_idempotency,
            ))
        }
        #[cfg(feature = "postgres")]
        Front::Postgres { url, table } => router.layer(axum::middleware::from_fn_with_state(
            pg_mw::PgMiddleware::connect(&url, table).await?,
            pg_mw::pg_idempotency,
        )),
    })
}

/// The hand-written peer's connection (multiplexed: every request shares
/// it, as the redis crate recommends for async servers).
#[derive(Clone)]
struct RedisMiddleware {
    con: redis::aio::MultiplexedConnection,
    /// Before every key: this app's own key space.
    prefix: Arc<str>,
}

/// How long the hand-written peers' claim holds (the guard's default
/// lease) and how long their result is kept (the guard's default
/// retention).
const MW_LEASE_MS: u64 = 30_000;
const MW_RETENTION_MS: u64 = 24 * 3600 * 1000;

/// The idempotency middleware as users write it on Redis: `SET key P NX PX
/// lease` claims; the claimant runs the handler and stores `D`, the status
/// and the body with `SET key .. XX PX retention`; anyone else `GET`s the
/// key: a stored result is replayed (`Idempotent-Replayed: true`), a claim
/// is 409. No fingerprint, no fencing token, no Retry-After: what a short
/// hand-written version has. A Redis error is 503.
async fn redis_idempotency(
    State(mw): State<RedisMiddleware>,
    req: Request,
    next: Next,
) -> axum::response::Response {
    let Some(key) = req
        .headers()
        .get(IDEMPOTENCY_KEY)
        .and_then(|v| v.to_str().ok())
        .map(|k| format!("{}{k}", mw.prefix))
    else {
        return next.run(req).await;
    };
    let unavailable = || StatusCode::SERVICE_UNAVAILABLE.into_response();
    let mut con = mw.con.clone();
    let claimed: redis::RedisResult<Option<String>> = redis::cmd("SET")
        .arg(&key)
        .arg("P")
        .arg("NX")
        .arg("PX")
        .arg(MW_LEASE_MS)
        .query_async(&mut con)
        .await;
    match claimed {
        Ok(Some(_)) => {
            let (parts, body) = next.run(req).await.into_parts();
            let Ok(bytes) = body.collect().await.map(|b| b.to_bytes()) else {
                return unavailable();
            };
            let mut value = Vec::with_capacity(3 + bytes.len());
            value.push(b'D');
            value.extend_from_slice(&parts.status.as_u16().to_be_bytes());
            value.extend_from_slice(&bytes);
            let stored: redis::RedisResult<Option<String>> = redis::cmd("SET")
                .arg(&key)
                .arg(value)
                .arg("XX")
                .arg("PX")
                .arg(MW_RETENTION_MS)
                .query_async(&mut con)
                .await;
            if stored.is_err() {
                return unavailable();
            }
            axum::response::Response::from_parts(parts, axum::body::Body::from(bytes))
        }
        Ok(None) => {
            let found: redis::RedisResult<Option<Vec<u8>>> =
                redis::cmd("GET").arg(&key).query_async(&mut con).await;
            match found {
                Ok(Some(v)) if matches!(v.as_slice(), [b'D', _, _, ..]) => {
                    let [_, hi, lo, rest @ ..] = v.as_slice() else {
                        return unavailable();
                    };
                    replayed(u16::from_be_bytes([*hi, *lo]), Bytes::copy_from_slice(rest))
                }
                Ok(_) => StatusCode::CONFLICT.into_response(),
                Err(_) => unavailable(),
            }
        }
        Err(_) => unavailable(),
    }
}

/// The idempotency middleware as users write it on PostgreSQL (`pg-mw`).
#[cfg(feature = "postgres")]
pub mod pg_mw {
    use super::{MW_LEASE_MS, MW_RETENTION_MS};
    use crate::peers::{BoxResult, PG_POOL_SIZE};
    use axum::extract::{Request, State};
    use axum::http::StatusCode;
    use axum::middleware::Next;
    use axum::response::{IntoResponse, Response};
    use http_body_util::BodyExt;
    use idemstore::postgres::engine as pg;
    use idemstore::tower::IDEMPOTENCY_KEY;
    use std::sync::{Arc, Mutex, PoisonError};

    /// A row's `state`: claimed, the handler running.
    const CLAIMED: i16 = 0;
    /// A row's `state`: the handler's response stored.
    const DONE: i16 = 1;

    /// The middleware's table on the server, named after the process and a
    /// nanosecond stamp (cells share the server, and a key another cell
    /// completed would replay here), dropped with this value. Made and
    /// dropped with the synchronous client, outside any runtime: the
    /// middleware's own connections are the server runtime's.
    pub struct PgMwTable {
        url: String,
        name: String,
    }

    impl PgMwTable {
        /// Creates the table (and the index on `expires_at` a clean-up job
        /// deletes by) on the server `url` names.
        pub fn create(url: &str) -> BoxResult<PgMwTable> {
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let name = format!("idem_mw_{}_{stamp}", std::process::id());
            let mut c = postgres::Client::connect(url, postgres::NoTls)?;
            c.batch_execute(&format!(
                "CREATE TABLE \"{name}\" (
                     key        text     PRIMARY KEY,
                     state      smallint NOT NULL,
                     status     integer,
                     body       bytea,
                     expires_at bigint   NOT NULL);
                 CREATE INDEX ON \"{name}\" (expires_at);"
            ))?;
            Ok(PgMwTable {
                url: url.to_owned(),
                name,
            })
        }

        /// The table's name.
        pub fn name(&self) -> &str {
            &self.name
        }

        /// The middleware on this table, for [`super::app`].
        pub fn front(&self) -> super::Front {
            super::Front::Postgres {
                url: self.url.clone(),
                table: self.name.clone(),
            }
        }
    }

    impl Drop for PgMwTable {
        fn drop(&mut self) {
            if let Ok(mut c) = postgres::Client::connect(&self.url, postgres::NoTls) {
                let _ = c.batch_execute(&format!("DROP TABLE IF EXISTS \"{}\"", self.name));
            }
        }
    }

    /// The middleware's state: its connection pool.
    #[derive(Clone)]
    pub struct PgMiddleware {
        pool: Arc<Pool>,
    }

    impl PgMiddleware {
        /// A pool of up to [`PG_POOL_SIZE`] connections (`PostgresStore`'s
        /// size in the bench) to `url`, on `table`, made on demand on the
        /// calling runtime; one is made now, so that a wrong URL or a
        /// missing table fails here.
        pub async fn connect(url: &str, table: String) -> BoxResult<PgMiddleware> {
            let pool = Pool {
                config: url.parse()?,
                table,
                permits: tokio::sync::Semaphore::new(PG_POOL_SIZE as usize),
                idle: Mutex::new(Vec::new()),
            };
            let first = pool.connect().await?;
            pool.idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(first);
            Ok(PgMiddleware {
                pool: Arc::new(pool),
            })
        }
    }

    /// Connections made on demand up to the semaphore's permits, one
    /// statement at a time each (what deadpool or bb8 do).
    struct Pool {
        config: pg::Config,
        table: String,
        permits: tokio::sync::Semaphore,
        idle: Mutex<Vec<Conn>>,
    }

    /// A connection with its statements, prepared once.
    struct Conn {
        client: pg::Client,
        claim: pg::Statement,
        look: pg::Statement,
        complete: pg::Statement,
    }

    impl Pool {
        async fn connect(&self) -> BoxResult<Conn> {
            let (client, connection) = self.config.connect(pg::NoTls).await?;
            tokio::spawn(async move {
                let _ = connection.await;
            });
            let t = &self.table;
            let claim = client
                .prepare(&format!(
                    "INSERT INTO \"{t}\" (key, state, expires_at) VALUES ($1, {CLAIMED}, $2)
                     ON CONFLICT DO NOTHING RETURNING 1"
                ))
                .await?;
            let look = client
                .prepare(&format!(
                    "SELECT state, status, body FROM \"{t}\" WHERE key = $1"
                ))
                .await?;
            let complete = client
                .prepare(&format!(
                    "UPDATE \"{t}\" SET state = {DONE}, status = $2, body = $3, expires_at = $4
                     WHERE key = $1"
                ))
                .await?;
            Ok(Conn {
                client,
                claim,
                look,
                complete,
            })
        }

        /// Runs one statement (autocommit) on a pooled connection, a new
        /// one when none is idle. The connection goes back to the pool
        /// only when the statement succeeded: a failed or cancelled one is
        /// closed, and its permit lets the next caller open another.
        async fn query(
            &self,
            statement: fn(&Conn) -> &pg::Statement,
            params: &[&(dyn pg::types::ToSql + Sync)],
        ) -> BoxResult<Vec<pg::Row>> {
            let permit = self.permits.acquire().await?;
            let idle = self
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            let conn = match idle {
                Some(conn) if !conn.client.is_closed() => conn,
                _ => self.connect().await?,
            };
            let rows = conn.client.query(statement(&conn), params).await?;
            self.idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(conn);
            drop(permit); // after the push: the next holder finds it idle
            Ok(rows)
        }
    }

    fn now_ms() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    }

    /// The idempotency middleware as users write it on PostgreSQL: `INSERT
    /// (key, CLAIMED, lease) .. ON CONFLICT DO NOTHING RETURNING 1` claims;
    /// the claimant runs the handler and stores `DONE`, the status and the
    /// body with an `UPDATE`; anyone else `SELECT`s the row: a stored
    /// result is replayed (`Idempotent-Replayed: true`), a claim is 409.
    /// Each statement its own (autocommit) transaction, prepared once per
    /// connection. No fingerprint, no fencing token, no Retry-After: what
    /// a short hand-written version has, like `redis-mw`. A database error
    /// is 503.
    pub async fn pg_idempotency(
        State(mw): State<PgMiddleware>,
        req: Request,
        next: Next,
    ) -> Response {
        let Some(key) = req
            .headers()
            .get(IDEMPOTENCY_KEY)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
        else {
            return next.run(req).await;
        };
        let unavailable = || StatusCode::SERVICE_UNAVAILABLE.into_response();
        let lease = now_ms().saturating_add(MW_LEASE_MS as i64);
        let claimed = mw.pool.query(|c| &c.claim, &[&key, &lease]).await;
        match claimed {
            Ok(rows) if !rows.is_empty() => {
                let (parts, body) = next.run(req).await.into_parts();
                let Ok(bytes) = body.collect().await.map(|b| b.to_bytes()) else {
                    return unavailable();
                };
                let status = i32::from(parts.status.as_u16());
                let keep = now_ms().saturating_add(MW_RETENTION_MS as i64);
                let stored = mw
                    .pool
                    .query(|c| &c.complete, &[&key, &status, &bytes.as_ref(), &keep])
                    .await;
                if stored.is_err() {
                    return unavailable();
                }
                Response::from_parts(parts, axum::body::Body::from(bytes))
            }
            Ok(_) => match mw.pool.query(|c| &c.look, &[&key]).await {
                Ok(rows) => {
                    // No row: a clean-up job deleted it since; busy, as
                    // Redis's `GET` of an expired key.
                    let Some(row) = rows.first() else {
                        return StatusCode::CONFLICT.into_response();
                    };
                    let stored = (
                        row.try_get::<_, i16>(0),
                        row.try_get::<_, Option<i32>>(1),
                        row.try_get::<_, Option<Vec<u8>>>(2),
                    );
                    match stored {
                        (Ok(DONE), Ok(Some(status)), Ok(Some(body))) => {
                            let status = u16::try_from(status).unwrap_or(200);
                            super::replayed(status, body.into())
                        }
                        (Ok(CLAIMED), ..) => StatusCode::CONFLICT.into_response(),
                        _ => unavailable(),
                    }
                }
                Err(_) => unavailable(),
            },
            Err(_) => unavailable(),
        }
    }
}

/// A hand-written middleware's stored response again, marked as a replay
/// (the app's responses are JSON).
fn replayed(status: u16, body: Bytes) -> axum::response::Response {
    let mut res = axum::response::Response::new(axum::body::Body::from(body));
    *res.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let headers = res.headers_mut();
    headers.insert(
        IDEMPOTENT_REPLAYED,
        header::HeaderValue::from_static("true"),
    );
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    res
}

/// Measurement phases, shared by the connections and the controller.
const WARMUP: u8 = 0;
const MEASURE: u8 = 1;
const STOP: u8 = 2;

/// One connection's counts.
#[derive(Default)]
struct ConnStats {
    latencies_us: Vec<u32>,
    replays: u64,
    errors: BTreeMap<String, u64>,
}

impl ConnStats {
    fn error(&mut self, kind: impl Into<String>) {
        *self.errors.entry(kind.into()).or_default() += 1;
    }
}

/// The load client's runtime threads (their CPU is told apart from the
/// server's).
const CLIENT_THREADS: &str = "http-client";

/// A variant's store (kept for its counters and dropped at the end), what
/// is in front of the app, and `pg-mw`'s table (dropped after the server).
type Variant = (Option<Box<dyn crate::peers::Backend>>, Front, Option<Table>);

/// `pg-mw`'s table; nothing without the `postgres` feature.
#[cfg(feature = "postgres")]
type Table = pg_mw::PgMwTable;
#[cfg(not(feature = "postgres"))]
enum Table {}

/// What is in front of the app.
pub enum Front {
    /// Nothing: the bare app.
    None,
    /// idemstore's layer.
    Layer(IdempotencyLayer),
    /// The hand-written Redis middleware, on the server named by this URL
    /// (connected on the server's runtime).
    Redis(String),
    /// The hand-written PostgreSQL middleware (`pg-mw`), on `table` (see
    /// [`pg_mw::PgMwTable`]) of the server named by `url` (connected on the
    /// server's runtime).
    #[cfg(feature = "postgres")]
    Postgres {
        /// The server.
        url: String,
        /// The middleware's table.
        table: String,
    },
}

/// A variant's store and layer (`None`, `None` for the bare app), with its
/// files in `dir`.
fn variant(name: &str, dir: &std::path::Path) -> BoxResult<Variant> {
    match name {
        "none" => return Ok((None, Front::None, None)),
        "redis-mw" => {
            let url = std::env::var("IDEMSTORE_REDIS_URL")
                .map_err(|_| "redis-mw needs IDEMSTORE_REDIS_URL (scripts/redis-test-server)")?;
            return Ok((None, Front::Redis(url), None));
        }
        #[cfg(feature = "postgres")]
        "pg-mw" => {
            let url = match crate::peers::PG_URL.get() {
                Some(url) => url.clone(),
                None => std::env::var("IDEMSTORE_PG_URL")
                    .map_err(|_| "pg-mw needs IDEMSTORE_PG_URL (scripts/pg-test-cluster)")?,
            };
            let table = pg_mw::PgMwTable::create(&url)?;
            return Ok((None, table.front(), Some(table)));
        }
        #[cfg(not(feature = "postgres"))]
        "pg-mw" => return Err("pg-mw needs the postgres feature".into()),
        _ => {}
    }
    // Each claim and completion durable (the default), a fresh store.
    let backend = match name {
        // The same store with its log synced every 100 ms instead of once
        // per group: what the disk costs the layer.
        "redb-relaxed" => open_backend("redb", dir, "relaxed")?,
        _ => open_backend(name, dir, "immediate")?,
    };
    let store = backend
        .store()
        .ok_or_else(|| format!("{name} is not an idemstore store"))?;
    Ok((
        Some(backend),
        Front::Layer(IdempotencyLayer::new(Guard::new(store))),
        None,
    ))
}

/// The server's runtime: `server_workers` threads named `http-server`.
fn server_runtime(p: &CellParams) -> BoxResult<tokio::runtime::Runtime> {
    let mut server = tokio::runtime::Builder::new_multi_thread();
    server
        .worker_threads(p.server_workers.max(1))
        .thread_name("http-server")
        .enable_all();
    if let Some(n) = p.max_blocking_threads {
        server.max_blocking_threads(n.max(1));
    }
    Ok(server.build()?)
}

/// Serves `variant`'s app on `127.0.0.1:port` for `seconds`, for a load
/// client outside this program (`wrk`, see `bench/wrk/idempotency.lua`),
/// and prints the address, then every second the process's CPU time so far.
/// Stops by itself after `seconds`.
pub fn serve(p: &CellParams, port: u16, seconds: f64) -> BoxResult<()> {
    ensure_open_files(8_192)?;
    let dir = tempfile::tempdir()?;
    // `_table` (pg-mw's) is dropped on return, after the server runtime
    // and its connections.
    let (backend, front, _table) = variant(&p.variant, dir.path())?;
    let server = server_runtime(p)?;
    let app = server.block_on(app(front))?;
    let listener = server.block_on(tokio::net::TcpListener::bind(("127.0.0.1", port)))?;
    println!(
        "http_load: serving {} on http://{} for {seconds} s (POST /orders)",
        p.variant,
        listener.local_addr()?
    );
    server.spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let until = std::time::Instant::now() + Duration::from_secs_f64(seconds);
    while std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_secs(1));
        println!("cpu {:.2} s", process_cpu_seconds());
    }
    server.shutdown_timeout(Duration::from_secs(1));
    drop(backend);
    Ok(())
}

/// Runs one cell in this process: the store, the server, the load, the
/// counts. The process's threads and peak RSS are the cell's only when
/// nothing else runs in it (`http_load` runs each cell in a child process).
pub fn run_cell(p: &CellParams) -> BoxResult<CellReport> {
    ensure_open_files(2 * p.connections as u64 + SPARE_FILES)?;
    let sampler = ThreadSampler::start()?;
    let dir = tempfile::tempdir()?;
    // `_table` (pg-mw's) is dropped on return, after the server runtime
    // and its connections.
    let (backend, front, _table) = variant(&p.variant, dir.path())?;
    let layered = !matches!(front, Front::None);
    let server = server_runtime(p)?;
    let app = server.block_on(app(front))?;
    let listener = server.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_reuseaddr(true)?;
        socket.bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        // The kernel caps the backlog at net.core.somaxconn.
        socket.listen(u32::try_from(p.connections.max(1024)).unwrap_or(u32::MAX))
    })?;
    let addr = listener.local_addr()?;
    server.spawn(async move {
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("http_load: server: {e}");
        }
    });

    let client = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(p.client_workers.max(1))
        .thread_name(CLIENT_THREADS)
        .enable_all()
        .build()?;
    let load = client.block_on(load(addr, p, layered));
    let peak_threads = sampler.stop();
    client.shutdown_timeout(Duration::from_secs(1));
    server.shutdown_timeout(Duration::from_secs(1));
    let (stats, seconds, threads_at_start, cpu) = load?;
    let mean_group = backend.as_ref().and_then(|b| b.avg_batch());
    drop(backend); // the PostgreSQL table is dropped here

    let mut latencies: Vec<f64> = stats
        .iter()
        .flat_map(|s| s.latencies_us.iter().map(|&us| f64::from(us)))
        .collect();
    let mut errors = BTreeMap::new();
    for s in &stats {
        for (kind, n) in &s.errors {
            *errors.entry(kind.clone()).or_default() += n;
        }
    }
    let requests = latencies.len() as u64;
    Ok(CellReport {
        variant: p.variant.clone(),
        connections: p.connections,
        requests,
        seconds,
        p50_us: percentile(&mut latencies, 0.50),
        p99_us: percentile(&mut latencies, 0.99),
        p999_us: percentile(&mut latencies, 0.999),
        replays: stats.iter().map(|s| s.replays).sum(),
        errors,
        threads_at_start,
        peak_threads,
        peak_rss_bytes: peak_rss_bytes(),
        mean_group,
        server_cpu_us: cpu.server * 1e6 / requests.max(1) as f64,
        client_cpu_us: cpu.client * 1e6 / requests.max(1) as f64,
    })
}

/// Connects every client, warms up, measures; returns each connection's
/// counts, the window in seconds and the threads at the start.
async fn load(
    addr: SocketAddr,
    p: &CellParams,
    layered: bool,
) -> BoxResult<(Vec<ConnStats>, f64, u64, Cpu)> {
    let phase = Arc::new(AtomicU8::new(WARMUP));
    let connected = Arc::new(tokio::sync::Barrier::new(p.connections + 1));
    let tasks: Vec<_> = (0..p.connections)
        .map(|i| {
            let (phase, connected) = (Arc::clone(&phase), Arc::clone(&connected));
            let dup_ratio = p.dup_ratio;
            tokio::spawn(
                async move { connection(i, addr, phase, connected, dup_ratio, layered).await },
            )
        })
        .collect();
    connected.wait().await;
    let threads_at_start = threads();
    tokio::time::sleep(p.warmup).await;
    let started = Instant::now();
    let cpu_at = |()| (process_cpu_seconds(), threads_cpu_seconds(CLIENT_THREADS));
    let cpu_start = cpu_at(());
    phase.store(MEASURE, Ordering::Relaxed);
    tokio::time::sleep(p.duration).await;
    phase.store(STOP, Ordering::Relaxed);
    let cpu_end = cpu_at(());
    let seconds = started.elapsed().as_secs_f64();
    let client_cpu = cpu_end.1 - cpu_start.1;
    let cpu = Cpu {
        server: (cpu_end.0 - cpu_start.0 - client_cpu).max(0.0),
        client: client_cpu,
    };
    let mut stats = Vec::with_capacity(tasks.len());
    let mut unfinished = 0u64;
    let drain = tokio::time::Instant::now() + DRAIN_TIMEOUT;
    for task in tasks {
        match tokio::time::timeout_at(drain, task).await {
            Ok(Ok(s)) => stats.push(s),
            Ok(Err(join)) => return Err(format!("a connection task failed: {join}").into()),
            Err(_) => unfinished += 1,
        }
    }
    if unfinished > 0 {
        let mut s = ConnStats::default();
        *s.errors
            .entry("no answer within the drain timeout".into())
            .or_default() = unfinished;
        stats.push(s);
    }
    Ok((stats, seconds, threads_at_start, cpu))
}

/// CPU seconds spent in the measured window.
struct Cpu {
    /// Everything but the load client's threads.
    server: f64,
    /// The load client's threads.
    client: f64,
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr) -> BoxResult<Sender> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// One client: a keep-alive connection sending one request at a time until
/// the phase is STOP; fresh keys, and with `dup_ratio` a recent key again.
async fn connection(
    i: usize,
    addr: SocketAddr,
    phase: Arc<AtomicU8>,
    connected: Arc<tokio::sync::Barrier>,
    dup_ratio: f64,
    layered: bool,
) -> ConnStats {
    let mut stats = ConnStats::default();
    let mut sender = connect(addr).await;
    connected.wait().await;
    let mut rng = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut recent: VecDeque<(u64, Bytes)> = VecDeque::with_capacity(RECENT_KEYS);
    let mut next = 0u64;
    while phase.load(Ordering::Relaxed) != STOP {
        let s = match &mut sender {
            Ok(s) => s,
            Err(e) => {
                stats.error(format!("connect: {e}"));
                tokio::time::sleep(Duration::from_millis(10)).await;
                sender = connect(addr).await;
                continue;
            }
        };
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let dup = !recent.is_empty() && (rng % 10_000) as f64 / 10_000.0 < dup_ratio;
        let (n, first_body) = match recent.get((rng >> 32) as usize % recent.len().max(1)) {
            Some((n, body)) if dup => (*n, Some(body.clone())),
            _ => {
                next += 1;
                (next, None)
            }
        };
        let req = http::Request::post(PATH)
            .header(header::HOST, "127.0.0.1")
            .header(header::CONTENT_TYPE, "application/json")
            .header(IDEMPOTENCY_KEY, format!("c{i}-{n}"))
            .body(Full::new(Bytes::from(format!(
                "{{\"sku\":\"sku-{}\",\"qty\":{}}}",
                n % 100,
                n % 9 + 1
            ))));
        let Ok(req) = req else {
            stats.error("request not built");
            continue;
        };
        let started = Instant::now();
        let answer = async {
            s.ready().await?;
            let res = s.send_request(req).await?;
            let (parts, body) = res.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, hyper::Error>((parts, body))
        }
        .await;
        let elapsed = started.elapsed();
        let (parts, body) = match answer {
            Ok(a) => a,
            Err(e) => {
                stats.error(format!("transport: {e}"));
                sender = connect(addr).await;
                continue;
            }
        };
        let replayed = parts
            .headers
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|v| v == "true");
        let expect_replay = layered && first_body.is_some();
        let verdict = if parts.status != StatusCode::CREATED {
            Err(parts.status.as_str().to_owned())
        } else if replayed != expect_replay {
            Err(if replayed {
                "fresh key replayed".to_owned()
            } else {
                "re-sent key not replayed".to_owned()
            })
        } else if expect_replay && first_body.as_ref() != Some(&body) {
            Err("replay differs from the first response".to_owned())
        } else {
            Ok(())
        };
        if let Err(kind) = verdict {
            stats.error(kind);
            continue;
        }
        if first_body.is_none() {
            if recent.len() == RECENT_KEYS {
                recent.pop_front();
            }
            recent.push_back((n, body));
        }
        // Counted when it completes inside the measured window.
        if phase.load(Ordering::Relaxed) == MEASURE {
            stats
                .latencies_us
                .push(u32::try_from(elapsed.as_micros()).unwrap_or(u32::MAX));
            stats.replays += u64::from(replayed);
        }
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemstore::MemoryStore;

    fn params() -> CellParams {
        CellParams {
            variant: "test".into(),
            connections: 8,
            warmup: Duration::from_millis(50),
            duration: Duration::from_millis(300),
            dup_ratio: 0.3,
            server_workers: 1,
            client_workers: 1,
            max_blocking_threads: None,
        }
    }

    /// Serves `app` and runs the load against it, expecting replays when
    /// `layered`.
    fn drive(front: Front, layered: bool) -> Vec<ConnStats> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("addr");
            let app = app(front).await.expect("app");
            tokio::spawn(async move { axum::serve(listener, app).await });
            load(addr, &params(), layered).await.expect("load").0
        })
    }

    fn errors(stats: &[ConnStats]) -> BTreeMap<String, u64> {
        let mut all = BTreeMap::new();
        for s in stats {
            for (kind, n) in &s.errors {
                *all.entry(kind.clone()).or_default() += n;
            }
        }
        all
    }

    #[test]
    fn the_layer_passes_every_check() {
        let layer = IdempotencyLayer::new(Guard::new(MemoryStore::new()));
        let stats = drive(Front::Layer(layer), true);
        assert_eq!(errors(&stats), BTreeMap::new());
        assert!(stats.iter().map(|s| s.replays).sum::<u64>() > 0);
        assert!(stats.iter().map(|s| s.latencies_us.len()).sum::<usize>() > 0);
    }

    /// The hand-written Redis middleware passes the same checks (replays
    /// included), against the server `IDEMSTORE_REDIS_URL` names; without
    /// one there is nothing to check.
    #[test]
    fn the_redis_middleware_passes_every_check() {
        let Ok(url) = std::env::var("IDEMSTORE_REDIS_URL") else {
            return;
        };
        let stats = drive(Front::Redis(url), true);
        assert_eq!(errors(&stats), BTreeMap::new());
        assert!(stats.iter().map(|s| s.replays).sum::<u64>() > 0);
    }

    /// The hand-written PostgreSQL middleware passes the same checks
    /// (replays included), against the server `IDEMSTORE_PG_URL` names, and
    /// its table is gone afterwards; without a server there is nothing to
    /// check.
    #[cfg(feature = "postgres")]
    #[test]
    fn the_postgres_middleware_passes_every_check() {
        let Ok(url) = std::env::var("IDEMSTORE_PG_URL") else {
            return;
        };
        let table = pg_mw::PgMwTable::create(&url).expect("table");
        let name = table.name().to_owned();
        let stats = drive(table.front(), true);
        assert_eq!(errors(&stats), BTreeMap::new());
        assert!(stats.iter().map(|s| s.replays).sum::<u64>() > 0);
        drop(table);
        let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
        let left: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_tables WHERE tablename = $1",
                &[&name],
            )
            .expect("pg_tables")
            .get(0);
        assert_eq!(left, 0, "{name} not dropped");
    }

    /// A child's report reaches the parent whole, the group size included
    /// (and absent for a store without groups).
    #[test]
    fn a_cell_report_survives_its_json() {
        let mut report = CellReport {
            variant: "redb".into(),
            connections: 64,
            requests: 1_000,
            seconds: 2.0,
            p50_us: 1_500.0,
            mean_group: Some(12.5),
            server_cpu_us: 15.5,
            client_cpu_us: 8.25,
            ..CellReport::default()
        };
        let back = CellReport::from_json(&report.json()).expect("parse");
        assert_eq!(back.mean_group, Some(12.5));
        assert_eq!((back.server_cpu_us, back.client_cpu_us), (15.5, 8.3));
        assert_eq!(back.requests_per_sec(), 500.0);
        assert_eq!(back.p50_us, 1_500.0);
        report.mean_group = None;
        let back = CellReport::from_json(&report.json()).expect("parse");
        assert_eq!(back.mean_group, None);
    }

    /// A layer that never replays must not produce a clean number: the app
    /// without the layer, checked as if it had one.
    #[test]
    fn a_layer_that_does_not_replay_fails_the_checks() {
        let stats = drive(Front::None, true);
        let errors = errors(&stats);
        assert!(
            errors
                .get("re-sent key not replayed")
                .is_some_and(|&n| n > 0),
            "{errors:?}"
        );
    }
}
