//! The backends the load generator and the comparison drive with one
//! workload: idemstore stores through the `Store` trait, and the peers a
//! user would pick instead (SQLite, raw redb without group commit, Redis
//! with its append-only file), plus the disk's own floor (append +
//! fdatasync).

use idemstore::{Begin, Claim, Fingerprint, Key, Response, Store, Timestamp};
use redb::ReadableTable;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The tools' result: any error, sendable across the load threads.
pub type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The lease of every claim the workload makes.
pub const LEASE: Duration = Duration::from_secs(30);
/// How long every completed record is kept.
pub const RETENTION: Duration = Duration::from_secs(24 * 3600);

/// What a claim attempt answered, in workload terms.
pub enum Claimed {
    /// The client owns the key; complete it with this handle.
    Owned(Ticket),
    /// The key was done: the stored response came back.
    Replay,
    /// Someone else holds it (or the parameters differ).
    Busy,
}

/// What a client needs to complete what it claimed.
pub enum Ticket {
    /// An idemstore `Store`'s claim.
    Store(Claim),
    /// A peer's fencing token (its own counter).
    Token(u64),
}

/// A backend under load: makes one client per load thread.
pub trait Backend: Send + Sync {
    /// The label of the backend's row (`redb`, `sqlite`, `Redis 7, appendfsync always`, ...).
    fn name(&self) -> String;
    /// A new connection, for one load thread.
    fn client(&self) -> BoxResult<Box<dyn Client>>;
    /// Bytes on disk now.
    fn file_bytes(&self) -> u64;
    /// Average requests per commit, where the backend batches.
    fn avg_batch(&self) -> Option<f64> {
        None
    }
    /// The idemstore `Store` behind it, for tools that build a `Guard` on
    /// it (`http_load`); `None` for the peers.
    fn store(&self) -> Option<Arc<dyn Store>> {
        None
    }
}

/// One load thread's connection.
pub trait Client: Send {
    /// Claims `key` for a request with fingerprint `fp`, durably.
    fn claim(&mut self, key: &Key, fp: &Fingerprint, now: Timestamp) -> BoxResult<Claimed>;
    /// Completes what `ticket` claimed with `response`, durably.
    fn complete(
        &mut self,
        key: &Key,
        ticket: Ticket,
        response: &Response,
        now: Timestamp,
    ) -> BoxResult<()>;
}

/// Any idemstore `Store`, through the trait.
pub struct StoreBackend {
    /// The row's label.
    pub name: String,
    /// The store under load.
    pub store: Arc<dyn Store>,
    /// Where its files are, for [`Backend::file_bytes`]; `None` in memory.
    pub dir: Option<PathBuf>,
    /// Average requests per commit so far, where the store batches.
    pub batch: Option<Box<dyn Fn() -> Option<f64> + Send + Sync>>,
    /// Steps each cycle records between its claim and its completion
    /// (`Store::record_step`, one durable write each).
    pub steps: usize,
}

impl Backend for StoreBackend {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn client(&self) -> BoxResult<Box<dyn Client>> {
        Ok(Box::new(StoreClient(Arc::clone(&self.store), self.steps)))
    }
    fn file_bytes(&self) -> u64 {
        self.dir.as_deref().map_or(0, dir_bytes)
    }
    fn avg_batch(&self) -> Option<f64> {
        self.batch.as_ref().and_then(|f| f())
    }
    fn store(&self) -> Option<Arc<dyn Store>> {
        Some(Arc::clone(&self.store))
    }
}

/// The names of a cycle's steps (`redb-3step`).
const STEP_NAMES: [&str; 3] = ["charge", "reserve", "email"];

struct StoreClient(Arc<dyn Store>, usize);

impl Client for StoreClient {
    fn claim(&mut self, key: &Key, fp: &Fingerprint, now: Timestamp) -> BoxResult<Claimed> {
        Ok(match self.0.begin(key, fp, now, LEASE, RETENTION)? {
            Begin::Claimed(c) => Claimed::Owned(Ticket::Store(c)),
            Begin::Replay(_) => Claimed::Replay,
            _ => Claimed::Busy,
        })
    }
    fn complete(
        &mut self,
        key: &Key,
        ticket: Ticket,
        response: &Response,
        now: Timestamp,
    ) -> BoxResult<()> {
        let Ticket::Store(claim) = ticket else {
            return Err("foreign ticket".into());
        };
        for name in STEP_NAMES.iter().cycle().take(self.1) {
            let step = idemstore::Step::new(*name, vec![7; 16])?;
            self.0.record_step(key, &claim, &step, now)?;
        }
        Ok(self.0.complete(key, &claim, response, now, RETENTION)?)
    }
}

/// SQLite, the embedded database a user would reach for: WAL,
/// `synchronous=FULL`, one connection per client, `INSERT .. ON CONFLICT DO
/// NOTHING` to claim and a conditional `UPDATE` to complete.
pub struct Sqlite {
    path: PathBuf,
    dir: PathBuf,
    tokens: Arc<AtomicU64>,
}

impl Sqlite {
    /// Creates `peer.sqlite` in `dir` with the claims table.
    pub fn open(dir: &Path) -> BoxResult<Sqlite> {
        let path = dir.join("peer.sqlite");
        let conn = rusqlite::Connection::open(&path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS idem (
                 scope BLOB NOT NULL, id BLOB NOT NULL, fp BLOB NOT NULL,
                 state INTEGER NOT NULL, response BLOB, lease_until INTEGER,
                 expires_at INTEGER NOT NULL, token INTEGER NOT NULL,
                 PRIMARY KEY (scope, id));
             CREATE INDEX IF NOT EXISTS idem_expiry ON idem (expires_at);",
        )?;
        Ok(Sqlite {
            path,
            dir: dir.to_owned(),
            tokens: Arc::new(AtomicU64::new(1)),
        })
    }
}

impl Backend for Sqlite {
    fn name(&self) -> String {
        "sqlite (WAL, synchronous=FULL)".into()
    }
    fn client(&self) -> BoxResult<Box<dyn Client>> {
        let conn = rusqlite::Connection::open(&self.path)?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.busy_timeout(Duration::from_secs(30))?;
        Ok(Box::new(SqliteClient {
            conn,
            tokens: Arc::clone(&self.tokens),
        }))
    }
    fn file_bytes(&self) -> u64 {
        dir_bytes(&self.dir)
    }
}

struct SqliteClient {
    conn: rusqlite::Connection,
    tokens: Arc<AtomicU64>,
}

impl Client for SqliteClient {
    fn claim(&mut self, key: &Key, fp: &Fingerprint, now: Timestamp) -> BoxResult<Claimed> {
        let token = self.tokens.fetch_add(1, Ordering::Relaxed);
        let now_ms = now.as_millis() as i64;
        let inserted = self
            .conn
            .prepare_cached(
                "INSERT INTO idem (scope, id, fp, state, lease_until, expires_at, token)
             VALUES (?1, ?2, ?3, 0, ?4, ?5, ?6) ON CONFLICT DO NOTHING",
            )?
            .execute(rusqlite::params![
                key.scope(),
                key.id(),
                fp.as_bytes().as_slice(),
                now_ms + LEASE.as_millis() as i64,
                now_ms + RETENTION.as_millis() as i64,
                token as i64
            ])?;
        if inserted == 1 {
            return Ok(Claimed::Owned(Ticket::Token(token)));
        }
        let state: i64 = self
            .conn
            .prepare_cached("SELECT state FROM idem WHERE scope = ?1 AND id = ?2")?
            .query_row(rusqlite::params![key.scope(), key.id()], |row| row.get(0))?;
        Ok(if state == 1 {
            Claimed::Replay
        } else {
            Claimed::Busy
        })
    }

    fn complete(
        &mut self,
        key: &Key,
        ticket: Ticket,
        response: &Response,
        now: Timestamp,
    ) -> BoxResult<()> {
        let Ticket::Token(token) = ticket else {
            return Err("foreign ticket".into());
        };
        let updated = self
            .conn
            .prepare_cached(
                "UPDATE idem SET state = 1, response = ?1, lease_until = NULL, expires_at = ?2
             WHERE scope = ?3 AND id = ?4 AND token = ?5 AND state = 0",
            )?
            .execute(rusqlite::params![
                response.body(),
                now.as_millis() as i64 + RETENTION.as_millis() as i64,
                key.scope(),
                key.id(),
                token as i64
            ])?;
        if updated == 1 {
            Ok(())
        } else {
            Err("stale claim".into())
        }
    }
}

/// redb with one durable write transaction per operation: our engine
/// without group commit.
pub struct RedbRaw {
    db: Arc<redb::Database>,
    dir: PathBuf,
    tokens: Arc<AtomicU64>,
}

const RAW: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("raw");

impl RedbRaw {
    /// Creates `peer.redb` in `dir` with its one table.
    pub fn open(dir: &Path) -> BoxResult<RedbRaw> {
        let db = redb::Database::create(dir.join("peer.redb"))?;
        let tx = db.begin_write()?;
        tx.open_table(RAW)?;
        tx.commit()?;
        Ok(RedbRaw {
            db: Arc::new(db),
            dir: dir.to_owned(),
            tokens: Arc::new(AtomicU64::new(1)),
        })
    }
}

impl Backend for RedbRaw {
    fn name(&self) -> String {
        "redb, one txn per op".into()
    }
    fn client(&self) -> BoxResult<Box<dyn Client>> {
        Ok(Box::new(RedbRawClient {
            db: Arc::clone(&self.db),
            tokens: Arc::clone(&self.tokens),
        }))
    }
    fn file_bytes(&self) -> u64 {
        dir_bytes(&self.dir)
    }
}

struct RedbRawClient {
    db: Arc<redb::Database>,
    tokens: Arc<AtomicU64>,
}

fn raw_key(key: &Key) -> Vec<u8> {
    let mut k = vec![key.scope().len() as u8];
    k.extend_from_slice(key.scope());
    k.extend_from_slice(key.id());
    k
}

impl Client for RedbRawClient {
    fn claim(&mut self, key: &Key, fp: &Fingerprint, now: Timestamp) -> BoxResult<Claimed> {
        let k = raw_key(key);
        let tx = self.db.begin_write()?;
        let answer = {
            let mut table = tx.open_table(RAW)?;
            let existing = table.get(k.as_slice())?.map(|v| v.value().first().copied());
            match existing {
                Some(Some(1)) => Claimed::Replay,
                Some(_) => Claimed::Busy,
                None => {
                    let token = self.tokens.fetch_add(1, Ordering::Relaxed);
                    let mut v = vec![0u8];
                    v.extend_from_slice(fp.as_bytes());
                    v.extend_from_slice(&token.to_be_bytes());
                    v.extend_from_slice(
                        &(now.as_millis() + LEASE.as_millis() as u64).to_be_bytes(),
                    );
                    table.insert(k.as_slice(), v.as_slice())?;
                    Claimed::Owned(Ticket::Token(token))
                }
            }
        };
        tx.commit()?;
        Ok(answer)
    }

    fn complete(
        &mut self,
        key: &Key,
        ticket: Ticket,
        response: &Response,
        _now: Timestamp,
    ) -> BoxResult<()> {
        let Ticket::Token(token) = ticket else {
            return Err("foreign ticket".into());
        };
        let k = raw_key(key);
        let tx = self.db.begin_write()?;
        {
            let mut table = tx.open_table(RAW)?;
            let mut v = vec![1u8];
            v.extend_from_slice(&token.to_be_bytes());
            v.extend_from_slice(response.body());
            table.insert(k.as_slice(), v.as_slice())?;
        }
        tx.commit()?;
        Ok(())
    }
}

/// Bytes in all files directly inside `dir`.
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// The disk's floor: 256-byte appends, each followed by `fdatasync`, on one
/// thread for `duration`. Returns (ops/s, p50 µs).
pub fn fdatasync_probe(dir: &Path, duration: Duration) -> BoxResult<(f64, f64)> {
    use std::io::Write;
    let path = dir.join("probe.log");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)?;
    let record = [0x5au8; 256];
    let mut lat = Vec::new();
    let start = std::time::Instant::now();
    while start.elapsed() < duration {
        let t = std::time::Instant::now();
        f.write_all(&record)?;
        f.sync_data()?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&path);
    Ok((lat.len() as f64 / elapsed, percentile(&mut lat, 0.50)))
}

/// The `q` quantile (0..=1) of `values`, nearest rank; sorts `values`; 0 when empty.
pub fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let i = ((values.len() as f64 - 1.0) * q).round() as usize;
    values.get(i).or(values.last()).copied().unwrap_or(0.0)
}

/// The median of `values` (sorts them); 0 when empty.
pub fn median(values: &mut [f64]) -> f64 {
    percentile(values, 0.5)
}

/// Opens the named backend in `dir`.
pub fn open_backend(name: &str, dir: &Path, durability: &str) -> BoxResult<Box<dyn Backend>> {
    Ok(match name {
        "redb" => Box::new(redb_backend(dir, durability)?),
        // A cycle of a handler with three steps: five durable writes
        // (claim, three steps, completion) where a plain cycle makes two.
        "redb-3step" => Box::new(StoreBackend {
            name: "redb-3step".into(),
            steps: STEP_NAMES.len(),
            ..redb_backend(dir, durability)?
        }),
        "memory" => Box::new(StoreBackend {
            name: "memory".into(),
            store: std::sync::Arc::new(idemstore::MemoryStore::new()),
            dir: None,
            batch: None,
            steps: 0,
        }),
        #[cfg(feature = "sled")]
        "sled" => {
            let level = match durability {
                "relaxed" => idemstore::sled::Durability::OsBuffered,
                _ => idemstore::sled::Durability::Immediate,
            };
            let path = dir.join("store.sled");
            let store = std::sync::Arc::new(
                idemstore::SledStore::builder()
                    .durability(level)
                    .open(&path)?,
            );
            let stats = std::sync::Arc::clone(&store);
            Box::new(StoreBackend {
                name: "sled".into(),
                store,
                dir: Some(path),
                // Commits per flush round: sled's group size.
                batch: Some(Box::new(move || {
                    let s = stats.stats();
                    (s.flushes > 0).then(|| s.commits as f64 / s.flushes as f64)
                })),
                steps: 0,
            })
        }
        "sqlite" => Box::new(Sqlite::open(dir)?),
        "redb-raw" => Box::new(RedbRaw::open(dir)?),
        #[cfg(feature = "postgres")]
        "postgres" => Box::new(Postgres::open()?),
        #[cfg(feature = "postgres")]
        "postgres-hand" => Box::new(PgHand::open()?),
        // The server decides durability (its `appendfsync`): `durability`
        // does not apply.
        "redis" | "redis-always" | "redis-everysec" => Box::new(Redis::open(&redis_url(name)?)?),
        other => return Err(format!("unknown or not yet available backend {other}").into()),
    })
}

/// `RedbStore` in `dir`; `durability` is `immediate` (default), `relaxed`
/// (the log synced every 100 ms) or `periodic:MS`.
pub fn redb_backend(dir: &Path, durability: &str) -> BoxResult<StoreBackend> {
    let durability = match durability.split_once(':') {
        None if durability.is_empty() || durability == "immediate" => {
            idemstore::redb::Durability::Immediate
        }
        None if durability == "relaxed" => idemstore::redb::Durability::Periodic {
            max_loss: std::time::Duration::from_millis(100),
        },
        Some(("periodic", ms)) => idemstore::redb::Durability::Periodic {
            max_loss: std::time::Duration::from_millis(ms.parse()?),
        },
        _ => return Err(format!("unknown durability {durability}").into()),
    };
    let store = std::sync::Arc::new(
        idemstore::RedbStore::builder()
            .durability(durability)
            .open(dir.join("loadgen.idem"))?,
    );
    let stats = std::sync::Arc::clone(&store);
    Ok(StoreBackend {
        name: "redb".into(),
        store,
        dir: Some(dir.to_owned()),
        batch: Some(Box::new(move || {
            let s = stats.stats();
            (s.groups > 0).then(|| s.mean_group())
        })),
        steps: 0,
    })
}

/// The server the `postgres` backend uses: set by the load generator from its
/// `--pg-url`, else `IDEMSTORE_PG_URL`.
#[cfg(feature = "postgres")]
pub static PG_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Connections the `postgres` backend's pool may open: one per client up
/// to 64 clients (the server's default `max_connections` is 100).
#[cfg(feature = "postgres")]
pub const PG_POOL_SIZE: u32 = 64;

/// `PostgresStore` on a fresh table (`loadgen_<pid>_<n>`), dropped when the
/// backend is dropped. The server decides durability (`synchronous_commit`,
/// `fsync`): `--durability` does not apply.
#[cfg(feature = "postgres")]
pub struct Postgres {
    store: Arc<idemstore::PostgresStore>,
    url: String,
}

#[cfg(feature = "postgres")]
impl Postgres {
    /// A `PostgresStore` on a fresh table of the server in [`PG_URL`] (else
    /// `IDEMSTORE_PG_URL`).
    pub fn open() -> BoxResult<Postgres> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let url = match PG_URL.get() {
            Some(url) => url.clone(),
            None => std::env::var("IDEMSTORE_PG_URL").map_err(|_| {
                "--backend postgres needs --pg-url or IDEMSTORE_PG_URL \
                 (a throwaway server: scripts/pg-test-cluster start DIR)"
            })?,
        };
        let table = format!(
            "loadgen_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let store = idemstore::PostgresStore::builder()
            .table(&table)
            .max_size(PG_POOL_SIZE)
            .migrate_on_build(true)
            .connect(&url)?;
        Ok(Postgres {
            store: Arc::new(store),
            url,
        })
    }
}

#[cfg(feature = "postgres")]
impl Backend for Postgres {
    fn name(&self) -> String {
        "postgres".into()
    }
    fn client(&self) -> BoxResult<Box<dyn Client>> {
        Ok(Box::new(StoreClient(
            Arc::clone(&self.store) as Arc<dyn Store>,
            0,
        )))
    }
    fn file_bytes(&self) -> u64 {
        0 // on the server, not in the run's directory
    }
    /// Calls per group commit (`PostgresStats`), over the store's life.
    fn avg_batch(&self) -> Option<f64> {
        let stats = self.store.stats();
        (stats.group_commits > 0).then(|| stats.grouped_calls as f64 / stats.group_commits as f64)
    }
    fn store(&self) -> Option<Arc<dyn Store>> {
        Some(Arc::clone(&self.store) as Arc<dyn Store>)
    }
}

#[cfg(feature = "postgres")]
impl Drop for Postgres {
    fn drop(&mut self) {
        if let Ok(mut c) = postgres::Client::connect(&self.url, postgres::NoTls) {
            let _ = c.batch_execute(&format!("DROP TABLE IF EXISTS \"{}\"", self.store.table()));
        }
    }
}

/// PostgreSQL as users write the request path by hand, beside
/// `PostgresStore` on the same server: one `INSERT .. ON CONFLICT DO
/// NOTHING RETURNING` to claim (a `SELECT` of the state when the key
/// exists: a replay or busy), one conditional `UPDATE` to complete; one
/// statement per call, each its own (autocommit) transaction, prepared once
/// per connection, over a pool of the same size as `PostgresStore`'s
/// ([`PG_POOL_SIZE`]). A fresh table per backend, dropped with it.
#[cfg(feature = "postgres")]
pub struct PgHand {
    pool: Arc<PgPool>,
    url: String,
    table: String,
}

#[cfg(feature = "postgres")]
struct PgConn {
    client: postgres::Client,
    claim: postgres::Statement,
    state: postgres::Statement,
    complete: postgres::Statement,
}

/// Connections made on demand up to [`PG_POOL_SIZE`], handed out one
/// call at a time.
#[cfg(feature = "postgres")]
struct PgPool {
    url: String,
    table: String,
    idle: std::sync::Mutex<(Vec<PgConn>, u32)>,
    freed: std::sync::Condvar,
}

#[cfg(feature = "postgres")]
impl PgPool {
    fn connect(&self) -> BoxResult<PgConn> {
        let mut client = postgres::Client::connect(&self.url, postgres::NoTls)?;
        let t = &self.table;
        let claim = client.prepare(&format!(
            "INSERT INTO \"{t}\" (scope, id, fp, state, lease_until, expires_at, token)
             VALUES ($1, $2, $3, 0, $4, $5, nextval('\"{t}_seq\"'))
             ON CONFLICT DO NOTHING RETURNING token"
        ))?;
        let state = client.prepare(&format!(
            "SELECT state FROM \"{t}\" WHERE scope = $1 AND id = $2"
        ))?;
        let complete = client.prepare(&format!(
            "UPDATE \"{t}\" SET state = 1, response = $1, lease_until = NULL, expires_at = $2
             WHERE scope = $3 AND id = $4 AND token = $5 AND state = 0"
        ))?;
        Ok(PgConn {
            client,
            claim,
            state,
            complete,
        })
    }

    /// Runs `f` on a pooled connection (a new one while under the size);
    /// a connection whose call failed is not returned to the pool.
    fn with<T>(&self, f: impl FnOnce(&mut PgConn) -> BoxResult<T>) -> BoxResult<T> {
        let mut conn = {
            let mut guard = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(conn) = guard.0.pop() {
                    break Some(conn);
                }
                if guard.1 < PG_POOL_SIZE {
                    guard.1 += 1;
                    break None;
                }
                guard = self.freed.wait(guard).unwrap_or_else(|p| p.into_inner());
            }
        };
        let mut fresh = match conn.take() {
            Some(conn) => conn,
            None => match self.connect() {
                Ok(conn) => conn,
                Err(e) => {
                    self.idle.lock().unwrap_or_else(|p| p.into_inner()).1 -= 1;
                    self.freed.notify_one();
                    return Err(e);
                }
            },
        };
        let out = f(&mut fresh);
        let mut guard = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if out.is_ok() {
            guard.0.push(fresh);
        } else {
            guard.1 -= 1;
        }
        self.freed.notify_one();
        out
    }
}

#[cfg(feature = "postgres")]
impl PgHand {
    /// A fresh table (`hand_<pid>_<n>`, with its token sequence and expiry
    /// index) on the server in [`PG_URL`] (else `IDEMSTORE_PG_URL`).
    pub fn open() -> BoxResult<PgHand> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let url = match PG_URL.get() {
            Some(url) => url.clone(),
            None => std::env::var("IDEMSTORE_PG_URL")
                .map_err(|_| "postgres-hand needs --pg-url or IDEMSTORE_PG_URL")?,
        };
        let table = format!(
            "hand_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut c = postgres::Client::connect(&url, postgres::NoTls)?;
        c.batch_execute(&format!(
            "CREATE TABLE \"{table}\" (
                 scope bytea NOT NULL, id bytea NOT NULL, fp bytea NOT NULL,
                 state smallint NOT NULL, response bytea, lease_until bigint,
                 expires_at bigint NOT NULL, token bigint NOT NULL,
                 PRIMARY KEY (scope, id));
             CREATE SEQUENCE \"{table}_seq\";
             CREATE INDEX ON \"{table}\" (expires_at);"
        ))?;
        let pool = Arc::new(PgPool {
            url: url.clone(),
            table: table.clone(),
            idle: std::sync::Mutex::new((Vec::new(), 0)),
            freed: std::sync::Condvar::new(),
        });
        Ok(PgHand { pool, url, table })
    }
}

#[cfg(feature = "postgres")]
impl Backend for PgHand {
    fn name(&self) -> String {
        "postgres, by hand (ON CONFLICT + UPDATE)".into()
    }
    fn client(&self) -> BoxResult<Box<dyn Client>> {
        Ok(Box::new(PgHandClient(Arc::clone(&self.pool))))
    }
    fn file_bytes(&self) -> u64 {
        0 // on the server
    }
}

#[cfg(feature = "postgres")]
impl Drop for PgHand {
    fn drop(&mut self) {
        if let Ok(mut c) = postgres::Client::connect(&self.url, postgres::NoTls) {
            let t = &self.table;
            let _ = c.batch_execute(&format!(
                "DROP TABLE IF EXISTS \"{t}\"; DROP SEQUENCE IF EXISTS \"{t}_seq\";"
            ));
        }
    }
}

#[cfg(feature = "postgres")]
struct PgHandClient(Arc<PgPool>);

#[cfg(feature = "postgres")]
impl Client for PgHandClient {
    fn claim(&mut self, key: &Key, fp: &Fingerprint, now: Timestamp) -> BoxResult<Claimed> {
        let now_ms = now.as_millis() as i64;
        let (lease, keep) = (
            now_ms + LEASE.as_millis() as i64,
            now_ms + RETENTION.as_millis() as i64,
        );
        self.0.with(|c| {
            let fp = fp.as_bytes().as_slice();
            let rows = c
                .client
                .query(&c.claim, &[&key.scope(), &key.id(), &fp, &lease, &keep])?;
            if let Some(row) = rows.first() {
                let token: i64 = row.get(0);
                return Ok(Claimed::Owned(Ticket::Token(token as u64)));
            }
            let row = c.client.query_one(&c.state, &[&key.scope(), &key.id()])?;
            let state: i16 = row.get(0);
            Ok(if state == 1 {
                Claimed::Replay
            } else {
                Claimed::Busy
            })
        })
    }

    fn complete(
        &mut self,
        key: &Key,
        ticket: Ticket,
        response: &Response,
        now: Timestamp,
    ) -> BoxResult<()> {
        let Ticket::Token(token) = ticket else {
            return Err("foreign ticket".into());
        };
        let keep = now.as_millis() as i64 + RETENTION.as_millis() as i64;
        let token = token as i64;
        let updated = self.0.with(|c| {
            Ok(c.client.execute(
                &c.complete,
                &[&response.body(), &keep, &key.scope(), &key.id(), &token],
            )?)
        })?;
        if updated == 1 {
            Ok(())
        } else {
            Err("stale claim".into())
        }
    }
}

/// The server the `redis*` backends use when set (the load generator's
/// `--redis-url`), else `IDEMSTORE_REDIS_URL` for `redis`/`redis-always`
/// and `IDEMSTORE_REDIS_EVERYSEC_URL` for `redis-everysec`.
pub static REDIS_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The environment variable naming the server of a `redis*` backend.
pub fn redis_env(name: &str) -> &'static str {
    if name == "redis-everysec" {
        "IDEMSTORE_REDIS_EVERYSEC_URL"
    } else {
        "IDEMSTORE_REDIS_URL"
    }
}

/// The server of a `redis*` backend: see [`REDIS_URL`].
pub fn redis_url(name: &str) -> BoxResult<String> {
    if let Some(url) = REDIS_URL.get() {
        return Ok(url.clone());
    }
    let var = redis_env(name);
    std::env::var(var).map_err(|_| {
        format!(
            "--backend {name} needs {var} (a throwaway server: \
             scripts/redis-test-server start DIR{})",
            if var == "IDEMSTORE_REDIS_EVERYSEC_URL" {
                " everysec"
            } else {
                ""
            }
        )
        .into()
    })
}

/// What a Redis server says about itself.
#[derive(Clone, Debug)]
pub struct RedisInfo {
    /// `INFO server`'s `redis_version`, e.g. `7.0.15`.
    pub version: String,
    /// `CONFIG GET appendonly`: `yes` or `no`.
    pub appendonly: String,
    /// `CONFIG GET appendfsync`: `always`, `everysec` or `no`.
    pub appendfsync: String,
    /// `CONFIG GET save`: empty when RDB snapshots are off.
    pub save: String,
    /// The append-only files' directory (`dir`/`appenddirname`), where it
    /// is on this machine.
    pub aof_dir: Option<PathBuf>,
}

impl RedisInfo {
    /// Asks the server at `url`.
    pub fn of(url: &str) -> BoxResult<RedisInfo> {
        let mut con = redis::Client::open(url)?.get_connection()?;
        let info: String = redis::cmd("INFO").arg("server").query(&mut con)?;
        let version = info
            .lines()
            .find_map(|l| l.trim().strip_prefix("redis_version:"))
            .unwrap_or("?")
            .to_owned();
        let mut config = |name: &str| -> BoxResult<String> {
            // [name, value] (RESP2); empty when the server has no such item.
            let pair: Vec<String> = redis::cmd("CONFIG").arg("GET").arg(name).query(&mut con)?;
            Ok(pair.into_iter().nth(1).unwrap_or_default())
        };
        let (appendonly, appendfsync, save) = (
            config("appendonly")?,
            config("appendfsync")?,
            config("save")?,
        );
        let dir = config("dir")?;
        let aof_dir = match config("appenddirname")? {
            // Redis 7 keeps its multi-part AOF in a directory of `dir`.
            sub if !sub.is_empty() => Some(Path::new(&dir).join(sub)),
            _ if !dir.is_empty() => Some(PathBuf::from(dir)),
            _ => None,
        }
        .filter(|p| p.is_dir());
        Ok(RedisInfo {
            version,
            appendonly,
            appendfsync,
            save,
            aof_dir,
        })
    }

    /// `Redis 7, appendfsync always` (the major version and the fsync
    /// policy: what the row measures), or `Redis 7, no AOF`.
    pub fn label(&self) -> String {
        let major = self.version.split('.').next().unwrap_or("?");
        if self.appendonly == "yes" {
            format!("Redis {major}, appendfsync {}", self.appendfsync)
        } else {
            format!("Redis {major}, no AOF")
        }
    }
}

/// Redis as a user would use it for idempotency keys, one connection per
/// client: claim = `SET key C|token|fp NX PX lease_ms` (a nil reply: the
/// key exists, and a `GET` tells a replay, `D|fp|response` with the same
/// fingerprint, from a claim in flight or another request's key),
/// completion = `SET key D|fp|response XX PX retention_ms`.
/// Durability is the server's (`appendfsync`; with `always` Redis fsyncs its
/// append-only file once per event-loop round, before that round's replies
/// go out: a group commit). The completion is not fenced by the token (that
/// would take a script or WATCH/MULTI): less work than the stores do.
///
/// Each open writes under its own key prefix and deletes its keys when
/// dropped (as `Postgres` drops its table); the server and its append-only
/// file are shared by all opens.
pub struct Redis {
    client: redis::Client,
    info: RedisInfo,
    prefix: Vec<u8>,
    tokens: Arc<AtomicU64>,
}

impl Redis {
    /// Connects to the server at `url` and picks a fresh key prefix.
    pub fn open(url: &str) -> BoxResult<Redis> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let client = redis::Client::open(url)?;
        let info = RedisInfo::of(url)?;
        let prefix = format!(
            "idemstore-loadgen:{}:{}:",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
        .into_bytes();
        Ok(Redis {
            client,
            info,
            prefix,
            tokens: Arc::new(AtomicU64::new(1)),
        })
    }

    /// What the server said about itself at open.
    pub fn info(&self) -> &RedisInfo {
        &self.info
    }
}

impl Backend for Redis {
    fn name(&self) -> String {
        self.info.label()
    }
    fn client(&self) -> BoxResult<Box<dyn Client>> {
        Ok(Box::new(RedisClient {
            con: self.client.get_connection()?,
            prefix: self.prefix.clone(),
            tokens: Arc::clone(&self.tokens),
            claimed: None,
        }))
    }
    /// The whole server's append-only files (every open's, not this one's
    /// alone), 0 when they are not on this machine.
    fn file_bytes(&self) -> u64 {
        self.info.aof_dir.as_deref().map_or(0, dir_bytes)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let Ok(mut con) = self.client.get_connection() else {
            return;
        };
        let mut pattern = self.prefix.clone();
        pattern.push(b'*');
        let mut cursor = 0u64;
        loop {
            let Ok((next, keys)): redis::RedisResult<(u64, Vec<Vec<u8>>)> = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(10_000)
                .query(&mut con)
            else {
                return;
            };
            if !keys.is_empty() {
                let _: redis::RedisResult<i64> = redis::cmd("UNLINK").arg(&keys).query(&mut con);
            }
            if next == 0 {
                return;
            }
            cursor = next;
        }
    }
}

struct RedisClient {
    con: redis::Connection,
    prefix: Vec<u8>,
    tokens: Arc<AtomicU64>,
    /// The claim this connection holds (the workload completes what it
    /// claimed before its next claim): its token and fingerprint, which the
    /// completed record keeps for replays to check.
    claimed: Option<(u64, [u8; 32])>,
}

impl RedisClient {
    fn key(&self, key: &Key) -> Vec<u8> {
        let mut k = self.prefix.clone();
        k.extend_from_slice(&raw_key(key));
        k
    }
}

impl Client for RedisClient {
    fn claim(&mut self, key: &Key, fp: &Fingerprint, _now: Timestamp) -> BoxResult<Claimed> {
        let k = self.key(key);
        let token = self.tokens.fetch_add(1, Ordering::Relaxed);
        let mut v = vec![b'C'];
        v.extend_from_slice(&token.to_be_bytes());
        v.extend_from_slice(fp.as_bytes());
        let set: redis::Value = redis::cmd("SET")
            .arg(&k)
            .arg(v)
            .arg("NX")
            .arg("PX")
            .arg(LEASE.as_millis() as u64)
            .query(&mut self.con)?;
        if !matches!(set, redis::Value::Nil) {
            self.claimed = Some((token, *fp.as_bytes()));
            return Ok(Claimed::Owned(Ticket::Token(token)));
        }
        let existing: Option<Vec<u8>> = redis::cmd("GET").arg(&k).query(&mut self.con)?;
        Ok(match existing {
            Some(v) if v.first() == Some(&b'D') && v.get(1..33) == Some(fp.as_bytes()) => {
                Claimed::Replay
            }
            // In flight, another fingerprint, or expired in between.
            _ => Claimed::Busy,
        })
    }

    fn complete(
        &mut self,
        key: &Key,
        ticket: Ticket,
        response: &Response,
        _now: Timestamp,
    ) -> BoxResult<()> {
        let Ticket::Token(token) = ticket else {
            return Err("foreign ticket".into());
        };
        let Some((_, fp)) = self.claimed.take().filter(|(t, _)| *t == token) else {
            return Err("completion without its claim on this connection".into());
        };
        let mut v = Vec::with_capacity(1 + fp.len() + response.body().len());
        v.push(b'D');
        v.extend_from_slice(&fp);
        v.extend_from_slice(response.body());
        let set: redis::Value = redis::cmd("SET")
            .arg(self.key(key))
            .arg(v)
            .arg("XX")
            .arg("PX")
            .arg(RETENTION.as_millis() as u64)
            .query(&mut self.con)?;
        if matches!(set, redis::Value::Nil) {
            Err("stale claim: the key expired".into())
        } else {
            Ok(())
        }
    }
}
