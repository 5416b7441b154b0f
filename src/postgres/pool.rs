//! The connection pool and its circuit breaker, on the store's runtime.
//!
//! A small pool of our own rather than `deadpool-postgres`: it is lazy
//! (`min_idle` connections at build, more on demand up to `max_size`), it
//! owns each connection's prepared statements, it counts what
//! [`PostgresStats`](super::PostgresStats) reports, and its connect path is
//! where the circuit breaker sits — none of which deadpool's API offers
//! without wrapping it as thickly, and it is one dependency tree less.
//!
//! **The breaker.** A connection that cannot be opened opens the breaker:
//! from then on every checkout fails at once (no connect attempt, no
//! timeout waited) until a probe on the store's runtime, retrying every
//! probe interval, opens a connection; that connection joins the pool and
//! the breaker closes. So while the server is down a call costs
//! microseconds, not the connect timeout, and the first call after the
//! server is back within one probe interval succeeds.

use super::errors::{
    connect_error, connect_timeout, is_unreplicated_commit, pool_exhausted, unavailable,
};
use super::sql::{Sql, Stmt};
use super::stats::Counters;
use super::tls::Connector;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::config::{Host, LoadBalanceHosts};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::types::ToSql;
use tokio_postgres::{AsyncMessage, Client, Config, NoTls, Row, Socket, Statement};

/// How the pool opens connections and how long it waits.
pub(super) struct PoolOptions {
    pub(super) config: Config,
    /// Plain, or TLS as the URL's `sslmode` asks (tls.rs).
    pub(super) connector: Connector,
    pub(super) max_size: u32,
    /// The bound on one connection attempt to one host, and on a wait for
    /// a busy pool.
    pub(super) connect_timeout: Duration,
    pub(super) probe_interval: Duration,
}

/// A pool of connections; cheap to clone (one shared state).
#[derive(Clone)]
pub(super) struct Pool {
    inner: Arc<Inner>,
}

struct Inner {
    options: PoolOptions,
    /// The URL's hosts, one configuration each, in the order tried.
    hosts: Vec<Config>,
    sql: Arc<Sql>,
    idle: Mutex<Vec<Arc<Conn>>>,
    /// One permit per connection in use: idle + in use never exceeds
    /// `max_size`, since a connection is opened only under a permit and
    /// only when none is idle.
    permits: Arc<Semaphore>,
    open: Arc<AtomicU64>,
    /// Mirrors `breaker.open.is_some()`, for a lock-free check per call.
    breaker_open: AtomicBool,
    breaker: Mutex<Breaker>,
    counters: Arc<Counters>,
}

#[derive(Default)]
struct Breaker {
    /// Why it is open: the last connection failure.
    open: Option<String>,
    /// A probe task is running.
    probing: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The data behind these locks stays consistent at every point a panic
    // could occur (single pushes, pops and field writes).
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Pool {
    pub(super) fn new(options: PoolOptions, sql: Arc<Sql>, counters: Arc<Counters>) -> Pool {
        let permits = Arc::new(Semaphore::new(options.max_size as usize));
        Pool {
            inner: Arc::new(Inner {
                hosts: one_per_host(&options.config),
                options,
                sql,
                idle: Mutex::new(Vec::new()),
                permits,
                open: Arc::new(AtomicU64::new(0)),
                breaker_open: AtomicBool::new(false),
                breaker: Mutex::new(Breaker::default()),
                counters,
            }),
        }
    }

    pub(super) fn max_size(&self) -> u32 {
        self.inner.options.max_size
    }

    /// Connections open, and of those idle.
    pub(super) fn state(&self) -> (u64, u64) {
        let idle = lock(&self.inner.idle).len() as u64;
        (self.inner.open.load(Ordering::Relaxed), idle)
    }

    pub(super) fn breaker_is_open(&self) -> bool {
        self.inner.breaker_open.load(Ordering::Relaxed)
    }

    /// Opens connections until `n` are idle (at build: `min_idle`). Does not
    /// touch the breaker: a failure here fails the build.
    pub(super) async fn warm(&self, n: u32) -> Result<()> {
        for _ in 0..n.min(self.max_size()) {
            let conn = self.inner.connect().await?;
            lock(&self.inner.idle).push(conn);
        }
        Ok(())
    }

    /// A connection: an idle one, else a new one. Fails at once while the
    /// breaker is open; waits at most the connect timeout for a busy pool.
    pub(super) async fn get(&self) -> Result<Pooled> {
        let inner = &self.inner;
        inner.refuse_if_open()?;
        let permit = match Arc::clone(&inner.permits).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                Counters::bump(&inner.counters.pool_waits);
                let wait = Arc::clone(&inner.permits).acquire_owned();
                match tokio::time::timeout(inner.options.connect_timeout, wait).await {
                    Ok(Ok(permit)) => permit,
                    Ok(Err(_)) => return Err(Error::Closed),
                    Err(_) => return Err(pool_exhausted(inner.options.connect_timeout)),
                }
            }
        };
        // The breaker may have opened while this call waited.
        inner.refuse_if_open()?;
        loop {
            let Some(conn) = lock(&inner.idle).pop() else {
                break;
            };
            if conn.client.is_closed() {
                // Ended while idle (a server restart): drop it, try the next.
                Counters::bump(&inner.counters.connections_lost);
                continue;
            }
            return Ok(self.pooled(conn, permit));
        }
        match inner.connect().await {
            Ok(conn) => Ok(self.pooled(conn, permit)),
            Err(err) => {
                Inner::trip(inner, &err);
                Err(err)
            }
        }
    }

    /// A connection of its own for the calling thread's lane (`lane.rs`),
    /// under a permit it keeps until it is dropped, so the pool and the
    /// lane together never hold more than `max_size`. Opened on the
    /// *current* runtime, whose thread then drives its I/O. `None` (nothing
    /// opened) while the breaker is open, or when fewer than two permits
    /// are free: the lane never takes the pool's last connection.
    pub(super) async fn dedicated(&self) -> Option<Result<Dedicated>> {
        let inner = &self.inner;
        if self.breaker_is_open() || inner.permits.available_permits() < 2 {
            return None;
        }
        let permit = Arc::clone(&inner.permits).try_acquire_owned().ok()?;
        Some(inner.connect().await.map(|conn| Dedicated {
            conn,
            _permit: permit,
        }))
    }

    /// Opens the breaker after a connection attempt made off the store's
    /// runtime failed with `err`; the probe is spawned on `store` (the
    /// store's runtime), as [`get`](Pool::get)'s would be.
    pub(super) fn trip_after(&self, err: &Error, store: &tokio::runtime::Handle) {
        let _on_store = store.enter();
        Inner::trip(&self.inner, err);
    }

    fn pooled(&self, conn: Arc<Conn>, permit: OwnedSemaphorePermit) -> Pooled {
        Pooled {
            conn,
            keep: true,
            _permit: permit,
            pool: Arc::clone(&self.inner),
        }
    }
}

impl Inner {
    fn refuse_if_open(&self) -> Result<()> {
        if !self.breaker_open.load(Ordering::Relaxed) {
            return Ok(());
        }
        let why = lock(&self.breaker).open.clone();
        match why {
            Some(why) => {
                Counters::bump(&self.counters.refusals);
                Err(unavailable(&why, self.options.probe_interval))
            }
            None => Ok(()), // closed in the meantime
        }
    }

    /// Opens one connection and spawns its I/O task on the store's runtime.
    async fn connect(&self) -> Result<Arc<Conn>> {
        let opened = match &self.options.connector {
            Connector::Plain => self.open(NoTls).await,
            Connector::Tls(tls) => self.open(tls.clone()).await,
        };
        let (client, unreplicated) =
            opened.inspect_err(|_| Counters::bump(&self.counters.connect_failures))?;
        Counters::bump(&self.counters.connections_opened);
        self.open.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(Conn {
            client,
            unreplicated,
            sql: Arc::clone(&self.sql),
            prepared: Mutex::new(Default::default()),
            open: Arc::clone(&self.open),
        }))
    }

    /// Connects through `tls` to the first host that answers, each within
    /// the connect timeout, and spawns the
    /// connection's I/O task, which ends when the client is dropped or the
    /// server closes the socket. Also returns the count of commits the
    /// server reported as possibly unreplicated on it ([`Conn::unreplicated`]).
    async fn open<T>(&self, tls: T) -> Result<(Client, Arc<AtomicU64>)>
    where
        T: MakeTlsConnect<Socket> + Clone,
        T::Stream: Send + 'static,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        // Each host in turn, its whole attempt (TCP, TLS, startup,
        // authentication, the session check) bounded by the connect
        // timeout: a host that accepts the connection but never answers
        // costs one timeout, and the next host still gets its own.
        let bound = self.options.connect_timeout;
        let mut failed = None;
        let mut opened = None;
        for config in &self.hosts {
            match tokio::time::timeout(bound, config.connect(tls.clone())).await {
                Ok(Ok(pair)) => {
                    opened = Some(pair);
                    break;
                }
                Ok(Err(err)) => failed = Some(connect_error(err)),
                Err(_) => failed = Some(connect_timeout(bound)),
            }
        }
        let Some((client, connection)) = opened else {
            return Err(failed.unwrap_or_else(|| connect_timeout(bound)));
        };
        let unreplicated = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&unreplicated);
        tokio::spawn(async move {
            let mut connection = connection;
            // The notice is counted before the connection task passes on
            // the rest of the statement's answer (which follows it on the
            // socket), so the call that ran the statement sees the count
            // once its statement returns.
            while let Some(Ok(message)) =
                std::future::poll_fn(|cx| connection.poll_message(cx)).await
            {
                if let AsyncMessage::Notice(notice) = message
                    && is_unreplicated_commit(&notice)
                {
                    seen.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        Ok((client, unreplicated))
    }

    /// Opens the breaker after `err`, and starts the probe unless it runs.
    fn trip(inner: &Arc<Inner>, err: &Error) {
        let mut breaker = lock(&inner.breaker);
        if breaker.open.is_none() {
            Counters::bump(&inner.counters.breaker_trips);
        }
        breaker.open = Some(err.to_string());
        inner.breaker_open.store(true, Ordering::Relaxed);
        if !breaker.probing {
            breaker.probing = true;
            tokio::spawn(Inner::probe(Arc::clone(inner)));
        }
    }

    /// Every probe interval, tries to open a connection; the first that
    /// opens joins the pool and closes the breaker.
    async fn probe(inner: Arc<Inner>) {
        loop {
            tokio::time::sleep(inner.options.probe_interval).await;
            // Under a permit, so the pool never holds more than max_size.
            let Ok(permit) = Arc::clone(&inner.permits).acquire_owned().await else {
                return;
            };
            match inner.connect().await {
                Ok(conn) => {
                    lock(&inner.idle).push(conn);
                    drop(permit);
                    let mut breaker = lock(&inner.breaker);
                    breaker.open = None;
                    breaker.probing = false;
                    inner.breaker_open.store(false, Ordering::Relaxed);
                    return;
                }
                Err(err) => lock(&inner.breaker).open = Some(err.to_string()),
            }
        }
    }
}

/// `config` split into one configuration per host (with its `hostaddr`
/// and port), everything else the same, in the URL's order; so that each
/// host's attempt can have a bound of its own. A configuration that names
/// one host or none, or whose ports do not match its hosts, is kept whole
/// (in the last two cases its connect fails with tokio-postgres's message).
fn one_per_host(config: &Config) -> Vec<Config> {
    let (hosts, addrs, ports) = (
        config.get_hosts(),
        config.get_hostaddrs(),
        config.get_ports(),
    );
    let count = hosts.len().max(addrs.len());
    if count < 2
        || (!hosts.is_empty() && !addrs.is_empty() && hosts.len() != addrs.len())
        || (ports.len() > 1 && ports.len() != count)
    {
        return vec![config.clone()];
    }
    let mut order: Vec<usize> = (0..count).collect();
    if config.get_load_balance_hosts() == LoadBalanceHosts::Random {
        // A random first host (tokio-postgres would shuffle them all).
        let start = std::hash::BuildHasher::hash_one(
            &std::collections::hash_map::RandomState::new(),
            count,
        );
        order.rotate_left(usize::try_from(start % count as u64).unwrap_or(0));
    }
    order
        .into_iter()
        .map(|i| {
            let mut one = Config::new();
            if let Some(user) = config.get_user() {
                one.user(user);
            }
            if let Some(password) = config.get_password() {
                one.password(password);
            }
            if let Some(dbname) = config.get_dbname() {
                one.dbname(dbname);
            }
            if let Some(options) = config.get_options() {
                one.options(options);
            }
            if let Some(name) = config.get_application_name() {
                one.application_name(name);
            }
            one.ssl_mode(config.get_ssl_mode())
                .ssl_negotiation(config.get_ssl_negotiation())
                .keepalives(config.get_keepalives())
                .keepalives_idle(config.get_keepalives_idle())
                .target_session_attrs(config.get_target_session_attrs())
                .channel_binding(config.get_channel_binding())
                .load_balance_hosts(config.get_load_balance_hosts());
            if let Some(timeout) = config.get_connect_timeout() {
                one.connect_timeout(*timeout);
            }
            if let Some(timeout) = config.get_tcp_user_timeout() {
                one.tcp_user_timeout(*timeout);
            }
            if let Some(interval) = config.get_keepalives_interval() {
                one.keepalives_interval(interval);
            }
            if let Some(retries) = config.get_keepalives_retries() {
                one.keepalives_retries(retries);
            }
            match hosts.get(i) {
                Some(Host::Tcp(host)) => {
                    one.host(host);
                }
                #[cfg(unix)]
                Some(Host::Unix(path)) => {
                    one.host_path(path);
                }
                None => {}
            }
            if let Some(addr) = addrs.get(i) {
                one.hostaddr(*addr);
            }
            if let Some(port) = ports.get(i).or_else(|| ports.first()) {
                one.port(*port);
            }
            one
        })
        .collect()
}

/// A connection taken from the pool; back to it on drop unless discarded
/// or closed.
pub(super) struct Pooled {
    conn: Arc<Conn>,
    /// False once discarded: the connection is dropped, not pooled.
    keep: bool,
    _permit: OwnedSemaphorePermit,
    pool: Arc<Inner>,
}

impl Pooled {
    /// The connection, for a statement run that may outlive this borrow.
    pub(super) fn conn(&self) -> Arc<Conn> {
        Arc::clone(&self.conn)
    }

    /// Drops the connection instead of returning it (it is dead, or a
    /// transaction on it did not finish).
    pub(super) fn discard(mut self) {
        self.keep = false;
        Counters::bump(&self.pool.counters.connections_lost);
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if self.keep && !self.conn.client.is_closed() {
            lock(&self.pool.idle).push(Arc::clone(&self.conn));
        }
    }
}

/// A connection outside the pool (see [`Pool::dedicated`]); its permit
/// goes back to the pool when it is dropped.
pub(super) struct Dedicated {
    pub(super) conn: Arc<Conn>,
    _permit: OwnedSemaphorePermit,
}

/// A connection and its prepared statements. Statements are prepared on
/// first use, not at connect: before the schema exists preparing would fail.
pub(super) struct Conn {
    pub(super) client: Client,
    /// Commits on this connection whose wait for a synchronous standby
    /// ended before the standby had them (see [`Conn::unreplicated`]).
    unreplicated: Arc<AtomicU64>,
    sql: Arc<Sql>,
    prepared: Mutex<[Option<Statement>; Stmt::COUNT]>,
    open: Arc<AtomicU64>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Conn {
    /// How many commits on this connection the server reported done on the
    /// primary only: a wait for a synchronous standby cancelled (or ended
    /// with the backend) after the commit was written locally. A call
    /// compares it before and after its statements: a change means one of
    /// its commits may be lost by a failover, so its outcome is unknown,
    /// as if the connection had broken after the commit was sent. One call
    /// uses a connection at a time, so a change is that call's own.
    pub(super) fn unreplicated(&self) -> u64 {
        self.unreplicated.load(Ordering::SeqCst)
    }

    /// Prepares `stmt` on this connection if it is not yet (one extra round
    /// trip, once per connection), then runs it.
    pub(super) async fn query(
        &self,
        stmt: Stmt,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let prepared = self.prepared(stmt).await?;
        self.client.query(&prepared, params).await
    }

    /// Like [`query`](Conn::query), returning the number of rows affected.
    pub(super) async fn execute(
        &self,
        stmt: Stmt,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        let prepared = self.prepared(stmt).await?;
        self.client.execute(&prepared, params).await
    }

    /// `stmt`, prepared on this connection if it is not yet.
    pub(super) async fn prepared(&self, stmt: Stmt) -> Result<Statement, tokio_postgres::Error> {
        if let Some(Some(prepared)) = lock(&self.prepared).get(stmt as usize) {
            return Ok(prepared.clone());
        }
        let prepared = self.client.prepare(self.sql.text(stmt)).await?;
        if let Some(slot) = lock(&self.prepared).get_mut(stmt as usize) {
            *slot = Some(prepared.clone());
        }
        Ok(prepared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_postgres::config::TargetSessionAttrs;

    #[test]
    fn a_multi_host_url_becomes_one_configuration_per_host_in_order() {
        let config: Config = "postgres://app:pw@a:5001,b:5002/orders?target_session_attrs=read-write&application_name=x&options=-c%20a%3D1"
            .parse()
            .unwrap();
        let hosts = one_per_host(&config);
        assert_eq!(hosts.len(), 2);
        for (one, (host, port)) in hosts.iter().zip([("a", 5001), ("b", 5002)]) {
            assert!(matches!(one.get_hosts(), [Host::Tcp(h)] if h == host));
            assert_eq!(one.get_ports(), [port]);
            assert_eq!(one.get_user(), Some("app"));
            assert_eq!(one.get_password(), Some(&b"pw"[..]));
            assert_eq!(one.get_dbname(), Some("orders"));
            assert_eq!(one.get_application_name(), Some("x"));
            assert_eq!(one.get_options(), Some("-c a=1"));
            assert_eq!(
                one.get_target_session_attrs(),
                TargetSessionAttrs::ReadWrite
            );
        }
        let shared_port: Config = "host=a,b port=7 dbname=d".parse().unwrap();
        let hosts = one_per_host(&shared_port);
        assert!(hosts.iter().all(|one| one.get_ports() == [7]));
        let single: Config = "postgres://a:1/d".parse().unwrap();
        assert_eq!(one_per_host(&single).len(), 1);
    }
}
