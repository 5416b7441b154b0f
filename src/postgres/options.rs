//! [`PostgresStoreBuilder`]: where the server is, which table, how many
//! connections, how long to wait.

use super::PostgresStore;
use super::errors::build_timeout;
use super::ops::Core;
use super::pool::{Pool, PoolOptions};
use super::runtime::StoreRuntime;
use super::sql::Sql;
use super::stats::Counters;
use crate::error::{Error, Result};
use crate::response::{DEFAULT_MAX_BODY_BYTES, check_body_limit};
use crate::time::{Clock, SystemClock};
use std::sync::Arc;
use std::time::Duration;

/// The table the store uses unless [`PostgresStoreBuilder::table`] says otherwise.
///
/// ```
/// assert_eq!(idemstore::postgres::DEFAULT_TABLE, "idemstore_records");
/// ```
pub const DEFAULT_TABLE: &str = "idemstore_records";
/// Longest table name accepted. PostgreSQL truncates identifiers at 63
/// bytes, and the store derives the sequence and index names from the table
/// name by appending a suffix of up to 12 bytes (`_expires_idx`).
///
/// ```
/// let name = "t".repeat(idemstore::postgres::MAX_TABLE_NAME_BYTES + 1);
/// let err = idemstore::PostgresStore::builder().table(name).connect("postgres://localhost/app");
/// assert!(matches!(err, Err(idemstore::Error::InvalidArgument { .. })));
/// ```
pub const MAX_TABLE_NAME_BYTES: usize = 48;
/// Most connections one store may hold (the server's `max_connections`,
/// 100 by default, is usually the tighter bound: sum it over the replicas).
///
/// ```
/// let b = idemstore::PostgresStore::builder();
/// assert!(b.max_size(idemstore::postgres::MAX_POOL_SIZE + 1).connect("postgres://localhost/app").is_err()); // before connecting
/// ```
pub const MAX_POOL_SIZE: u32 = 1_024;

// The builder's defaults; its methods' docs say them in words.
const DEFAULT_MAX_SIZE: u32 = 16;
const DEFAULT_MIN_IDLE: u32 = 1;
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_BUILD_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_millis(250);

/// Options for a [`PostgresStore`]; [`connect`](PostgresStoreBuilder::connect) builds it.
///
/// ```no_run
/// use idemstore::PostgresStore;
/// use std::time::Duration;
///
/// let store = PostgresStore::builder()
///     .table("checkout_idempotency")
///     .max_size(32)
///     .min_idle(4)
///     .connect_timeout(Duration::from_secs(2))
///     .statement_timeout(Duration::from_secs(5))
///     .build_timeout(Duration::from_secs(15))
///     .probe_interval(Duration::from_millis(500))
///     .max_body_bytes(256 * 1024)
///     .migrate_on_build(true)
///     .connect("postgres://app@db.internal/orders")?;
/// # Ok::<(), idemstore::Error>(())
/// ```
///
/// # Failing at start-up
///
/// [`connect`](Self::connect) connects and checks that the table exists
/// and is an idemstore table of this schema version, or creates it when
/// [`migrate_on_build`](Self::migrate_on_build) is set. A missing table, a
/// foreign one or another schema version is an error at build (none of
/// them transient), not an [`Error::Backend`] on every request later. The
/// whole build is bounded by [`build_timeout`](Self::build_timeout); a
/// server that refuses the connection fails it at once. Build does not
/// retry: a service started before its database retries at its own level
/// (a supervisor's restart).
///
/// # Pool sizing
///
/// The pool is lazy: [`min_idle`](Self::min_idle) connections are opened
/// at build and kept; more are opened on demand, up to
/// [`max_size`](Self::max_size), and kept open once opened (a connection
/// the server ends is dropped and replaced on demand). Each call holds one
/// connection for its statement, so `max_size` bounds this replica's calls
/// in flight at the server; callers beyond it wait up to the connect
/// timeout. With `N` replicas the server must allow `N × max_size` plus its
/// other clients: with the default `max_connections = 100`, 4 replicas and
/// room for 20 other connections, `max_size` at most 20. The
/// calling-thread lanes (blocking calls on an idle store) count within
/// `max_size` too: up to one connection per four of it, kept open once
/// opened.
///
/// # When the server is unreachable
///
/// A failed connection attempt opens a circuit breaker: every call then
/// fails at once with a transient [`Error::Backend`] (a guard answers
/// Unavailable, 503) instead of each waiting out the connect timeout, and a
/// background probe tries to reconnect every
/// [`probe_interval`](Self::probe_interval); its first success closes the
/// breaker. Connections the server ended (a restart, a failover) are
/// dropped, and the call moves on to another connection.
#[derive(Clone)]
pub struct PostgresStoreBuilder {
    table: String,
    max_size: u32,
    min_idle: u32,
    connect_timeout: Duration,
    statement_timeout: Duration,
    call_timeout: Duration,
    build_timeout: Duration,
    probe_interval: Duration,
    migrate_on_build: bool,
    max_body_bytes: usize,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for PostgresStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStoreBuilder")
            .field("table", &self.table)
            .field("max_size", &self.max_size)
            .field("min_idle", &self.min_idle)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("call_timeout", &self.call_timeout)
            .field("build_timeout", &self.build_timeout)
            .field("probe_interval", &self.probe_interval)
            .field("migrate_on_build", &self.migrate_on_build)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

impl PostgresStoreBuilder {
    pub(super) fn new() -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            table: DEFAULT_TABLE.to_owned(),
            max_size: DEFAULT_MAX_SIZE,
            min_idle: DEFAULT_MIN_IDLE,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            build_timeout: DEFAULT_BUILD_TIMEOUT,
            probe_interval: DEFAULT_PROBE_INTERVAL,
            migrate_on_build: false,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            clock: Arc::new(SystemClock),
        }
    }

    /// The table holding the records (default [`DEFAULT_TABLE`]): lower-case
    /// ASCII letters, digits and `_`, starting with a letter or `_`, at most
    /// [`MAX_TABLE_NAME_BYTES`] bytes. Its sequence and index are named after
    /// it (`<table>_token_seq`, `<table>_expires_idx`). Several stores (or
    /// tests) share a database by using different tables.
    ///
    /// ```
    /// let b = idemstore::PostgresStore::builder().table("payments_idem");
    /// # let _ = b;
    /// ```
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The most connections the store opens (default 16,
    /// 1..=[`MAX_POOL_SIZE`]); see [Pool sizing](Self#pool-sizing) for
    /// choosing it against the server's `max_connections`.
    ///
    /// ```
    /// let b = idemstore::PostgresStore::builder().max_size(64);
    /// # let _ = b;
    /// ```
    pub fn max_size(mut self, max_size: u32) -> Self {
        self.max_size = max_size;
        self
    }

    /// Connections opened at build and kept open (default
    /// 1, at most `max_size`; build opens one even at 0,
    /// to check the schema, and keeps it). More than one spares the first
    /// burst of requests the connection setup (a server process fork and an
    /// authentication each).
    ///
    /// ```
    /// let b = idemstore::PostgresStore::builder().max_size(32).min_idle(8);
    /// # let _ = b;
    /// ```
    pub fn min_idle(mut self, min_idle: u32) -> Self {
        self.min_idle = min_idle;
        self
    }

    /// The bound on one connection attempt to one host (each host of a
    /// multi-host URL gets its own, tried in turn), and on a call's wait
    /// for a connection when every one is busy (default 5 s);
    /// either way the call fails with [`Error::Backend`]. While the server
    /// is unreachable calls do not wait for it: see
    /// [`probe_interval`](Self::probe_interval).
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = idemstore::PostgresStore::builder()
    ///     .connect_timeout(Duration::from_millis(500));
    /// # let _ = b;
    /// ```
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The server-side `statement_timeout` of every connection (default
    /// 10 s, at least 1 ms): a statement stuck behind a lock fails with
    /// [`Error::Backend`] instead of hanging.
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = idemstore::PostgresStore::builder()
    ///     .statement_timeout(Duration::from_secs(2));
    /// # let _ = b;
    /// ```
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// The bound on every call of the built store (default 5 s; zero is
    /// refused): a call that meets a stalled server, a lock, or a commit
    /// waiting for a synchronous standby that does not answer, returns a
    /// transient [`Error::Backend`] in time (503 through a guard; a handler
    /// does not run) instead of waiting for as long as the stall lasts
    /// (PostgreSQL does not apply `statement_timeout` to a commit's wait
    /// for a standby). The call may still take effect: a claim it makes is
    /// given back, and a completion it makes stands; a guard's run reports
    /// such a completion as not stored, and [`Store::get`](crate::Store::get)
    /// tells. Keep it above the statement timeout to let a statement that
    /// waits for a lock fail with its own error.
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = idemstore::PostgresStore::builder()
    ///     .call_timeout(Duration::from_secs(3));
    /// # let _ = b;
    /// ```
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// The bound on the whole of [`connect`](Self::connect) (default 10 s):
    /// a server that accepts connections and never answers fails the build
    /// with [`Error::Backend`] after it.
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = idemstore::PostgresStore::builder().build_timeout(Duration::from_secs(3));
    /// # let _ = b;
    /// ```
    pub fn build_timeout(mut self, timeout: Duration) -> Self {
        self.build_timeout = timeout;
        self
    }

    /// How often the background probe tries to reconnect while the circuit
    /// breaker is open (default 250 ms, at least 1 ms): calls succeed again
    /// at most about this long after the server is back. Shorter costs more
    /// connection attempts against a server that is down: one per interval
    /// per replica.
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = idemstore::PostgresStore::builder().probe_interval(Duration::from_millis(100));
    /// # let _ = b;
    /// ```
    pub fn probe_interval(mut self, interval: Duration) -> Self {
        self.probe_interval = interval;
        self
    }

    /// Whether [`connect`](Self::connect) creates the schema when it is
    /// missing (default `false`: build refuses a missing table, and
    /// [`PostgresStore::migrate`] creates it, once per deploy, with a role
    /// allowed to create tables). Turning it on suits a service whose role
    /// may create tables; migrating is idempotent and safe from several
    /// replicas at once.
    ///
    /// ```
    /// let b = idemstore::PostgresStore::builder().migrate_on_build(true);
    /// # let _ = b;
    /// ```
    pub fn migrate_on_build(mut self, migrate: bool) -> Self {
        self.migrate_on_build = migrate;
        self
    }

    /// The largest response body the store accepts (default
    /// [`DEFAULT_MAX_BODY_BYTES`](crate::limits::DEFAULT_MAX_BODY_BYTES), at most
    /// [`MAX_BODY_BYTES_HARD_CAP`](crate::limits::MAX_BODY_BYTES_HARD_CAP)).
    ///
    /// ```
    /// let b = idemstore::PostgresStore::builder().max_body_bytes(64 * 1024);
    /// # let _ = b;
    /// ```
    pub fn max_body_bytes(mut self, max_body_bytes: usize) -> Self {
        self.max_body_bytes = max_body_bytes;
        self
    }

    /// The store's clock (default [`SystemClock`]), handed out by
    /// [`Store::clock`](crate::Store::clock) to a [`Guard`](crate::Guard)
    /// over the store. The store itself never reads it: its operations take
    /// `now` from their caller, and the database clock is not used (see
    /// [`PostgresStore`]'s section on time).
    ///
    /// ```
    /// let b = idemstore::PostgresStore::builder()
    ///     .clock(idemstore::SystemClock);
    /// # let _ = b;
    /// ```
    pub fn clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Checks the options, starts the store's runtime thread, connects,
    /// and checks the schema (or creates it, with
    /// [`migrate_on_build`](Self::migrate_on_build)); see
    /// [Failing at start-up](Self#failing-at-start-up). Safe to call from
    /// any thread, inside an async runtime or not (it blocks the calling
    /// thread for the build).
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad option or URL, or when
    /// the table does not exist and `migrate_on_build` is off;
    /// [`Error::Backend`] when the server cannot be reached or the build
    /// timeout passes; [`Error::Corrupt`] when the table exists but is not
    /// an idemstore table; [`Error::UnsupportedFormat`] when another schema
    /// version created it.
    ///
    /// `url` is `postgres://user[:password]@host[:port]/database[?options]`,
    /// or the `key=value` form libpq accepts. No error message repeats it
    /// (it may hold a password).
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::builder().connect("postgres://localhost/app")?;
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn connect(self, url: &str) -> Result<PostgresStore> {
        let max_body_bytes = check_body_limit(self.max_body_bytes)?;
        check_table_name(&self.table)?;
        if !(1..=MAX_POOL_SIZE).contains(&self.max_size) {
            return Err(Error::invalid_argument(format!(
                "pool max size {} is outside 1..={MAX_POOL_SIZE}",
                self.max_size
            )));
        }
        if self.min_idle > self.max_size {
            return Err(Error::invalid_argument(format!(
                "pool min_idle {} is above max_size {}",
                self.min_idle, self.max_size
            )));
        }
        for (what, d) in [
            ("connect timeout", self.connect_timeout),
            ("build timeout", self.build_timeout),
            ("probe interval", self.probe_interval),
            ("call timeout", self.call_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::invalid_argument(format!("{what} must not be zero")));
            }
        }
        if self.statement_timeout.as_millis() == 0 {
            return Err(Error::invalid_argument(
                "statement timeout must be at least 1 ms",
            ));
        }
        let (url, tls) = super::tls::split(url)?;
        let connector = tls.connector()?;
        let mut config: tokio_postgres::Config = url.parse().map_err(|e| {
            // The parser's message never repeats the URL, so no password leaks.
            Error::invalid_argument(format!("not a PostgreSQL connection URL: {e}"))
        })?;
        // The URL's own `options` stay; the statement timeout is appended.
        let options = format!(
            "{} -c statement_timeout={}",
            config.get_options().unwrap_or_default(),
            self.statement_timeout.as_millis()
        );
        config
            .ssl_mode(tls.wire_mode())
            .connect_timeout(self.connect_timeout)
            .options(options.trim_start());
        if config.get_application_name().is_none() {
            config.application_name("idemstore");
        }
        let sql = Arc::new(Sql::new(&self.table));
        let counters = Arc::new(Counters::default());
        let pool = Pool::new(
            PoolOptions {
                config,
                connector,
                max_size: self.max_size,
                connect_timeout: self.connect_timeout,
                probe_interval: self.probe_interval,
            },
            Arc::clone(&sql),
            Arc::clone(&counters),
        );
        let core = Arc::new(Core {
            pool,
            sql,
            max_body_bytes,
            counters,
            line: Default::default(),
        });
        let runtime = StoreRuntime::start(self.call_timeout)?;
        let setup = {
            let core = Arc::clone(&core);
            let (min_idle, migrate, limit) =
                (self.min_idle, self.migrate_on_build, self.build_timeout);
            async move {
                tokio::time::timeout(limit, core.setup(min_idle, migrate))
                    .await
                    .unwrap_or_else(|_| Err(build_timeout(limit)))
            }
        };
        // On an error the runtime is dropped here, closing what was opened.
        runtime.block_on(setup)?;
        Ok(PostgresStore {
            core,
            runtime,
            lanes: super::lane::Lanes::for_pool(self.max_size, self.call_timeout),
            clock: self.clock,
        })
    }
}

/// Accepts only names that need no quoting and cannot collide with the
/// derived sequence and index names after PostgreSQL's truncation.
fn check_table_name(table: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::invalid_argument(format!(
            "table name {table:?} {why}"
        )))
    };
    let Some(first) = table.bytes().next() else {
        return bad("is empty");
    };
    if table.len() > MAX_TABLE_NAME_BYTES {
        return bad(&format!("is longer than {MAX_TABLE_NAME_BYTES} bytes"));
    }
    if !(first.is_ascii_lowercase() || first == b'_') {
        return bad("must start with a lower-case ASCII letter or '_'");
    }
    if !table
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return bad("may hold only lower-case ASCII letters, digits and '_'");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names() {
        assert!(check_table_name(DEFAULT_TABLE).is_ok());
        assert!(check_table_name("_t1").is_ok());
        assert!(check_table_name(&"a".repeat(MAX_TABLE_NAME_BYTES)).is_ok());
        for bad in [
            "",
            "1abc",
            "Orders",
            "a-b",
            "a b",
            "a;drop table x",
            "\"q\"",
            "é",
        ] {
            assert!(
                matches!(check_table_name(bad), Err(Error::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
        assert!(check_table_name(&"a".repeat(MAX_TABLE_NAME_BYTES + 1)).is_err());
    }

    #[test]
    fn options_checked_before_connecting() {
        // Port 1 on localhost: nothing listens, but no connection is tried.
        let b = PostgresStoreBuilder::new;
        let err = |b: PostgresStoreBuilder| {
            b.connect("postgres://u@127.0.0.1:1/db")
                .err()
                .map(|e| e.to_string())
        };
        assert!(err(b().max_size(0)).unwrap().contains("max size"));
        assert!(
            err(b().max_size(MAX_POOL_SIZE + 1))
                .unwrap()
                .contains("max size")
        );
        assert!(
            err(b().max_size(2).min_idle(3))
                .unwrap()
                .contains("min_idle")
        );
        assert!(
            err(b().probe_interval(Duration::ZERO))
                .unwrap()
                .contains("probe interval")
        );
        assert!(err(b().table("X")).unwrap().contains("table name"));
        assert!(
            err(b().connect_timeout(Duration::ZERO))
                .unwrap()
                .contains("connect timeout")
        );
        assert!(
            err(b().statement_timeout(Duration::from_micros(10)))
                .unwrap()
                .contains("statement timeout")
        );
        assert!(
            err(b().max_body_bytes(usize::MAX))
                .unwrap()
                .contains("hard cap")
        );
        let url = PostgresStoreBuilder::new()
            .connect("postgres://u:secret@host:notaport/db")
            .unwrap_err();
        assert!(matches!(url, Error::InvalidArgument { .. }), "{url}");
        assert!(!url.to_string().contains("secret"), "{url}");
    }
}
