//! [`PostgresStoreBuilder`]: where the server is, which table, how many
//! connections, how long to wait.

use super::PostgresStore;
use super::errors::pool_error;
use super::pool::{Manager, Pool};
use super::schema;
use super::sql::Sql;
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
/// Connections per store unless [`PostgresStoreBuilder::pool_size`] says otherwise.
///
/// ```
/// assert!(idemstore::postgres::DEFAULT_POOL_SIZE <= idemstore::postgres::MAX_POOL_SIZE);
/// ```
pub const DEFAULT_POOL_SIZE: u32 = 16;
/// Most connections one store may hold (the server's `max_connections`,
/// 100 by default, is usually the tighter bound: sum it over the replicas).
///
/// ```
/// let b = idemstore::PostgresStore::builder();
/// assert!(b.pool_size(idemstore::postgres::MAX_POOL_SIZE + 1).connect("postgres://localhost/app").is_err()); // before connecting
/// ```
pub const MAX_POOL_SIZE: u32 = 1_024;
/// How long a call waits for a connection (from the pool, or a new one)
/// before it fails with [`Error::Backend`], unless configured otherwise.
///
/// ```
/// assert_eq!(idemstore::postgres::DEFAULT_CONNECT_TIMEOUT.as_secs(), 5);
/// ```
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one statement may run (waiting on a row lock included) before
/// the server cancels it and the call fails with [`Error::Backend`].
///
/// ```
/// assert_eq!(idemstore::postgres::DEFAULT_STATEMENT_TIMEOUT.as_secs(), 10);
/// ```
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Options for a [`PostgresStore`]; [`connect`](PostgresStoreBuilder::connect) connects.
///
/// ```no_run
/// use idemstore::PostgresStore;
/// use std::time::Duration;
///
/// let store = PostgresStore::builder()
///     .table("checkout_idempotency")
///     .pool_size(32)
///     .connect_timeout(Duration::from_secs(2))
///     .statement_timeout(Duration::from_secs(5))
///     .max_body_bytes(256 * 1024)
///     .connect("postgres://app@db.internal/orders")?;
/// store.migrate()?; // once per deploy; idempotent
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone)]
pub struct PostgresStoreBuilder {
    table: String,
    pool_size: u32,
    connect_timeout: Duration,
    statement_timeout: Duration,
    max_body_bytes: usize,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for PostgresStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStoreBuilder")
            .field("table", &self.table)
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

impl PostgresStoreBuilder {
    pub(super) fn new() -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            table: DEFAULT_TABLE.to_owned(),
            pool_size: DEFAULT_POOL_SIZE,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
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

    /// The connections the store holds (default [`DEFAULT_POOL_SIZE`],
    /// 1..=[`MAX_POOL_SIZE`]), all opened by [`connect`](Self::connect) and
    /// kept open. Each call uses one connection for one statement, so this
    /// bounds the calls in flight at the server; callers beyond it wait up
    /// to the connect timeout. Sum it over the replicas against the server's
    /// `max_connections`.
    ///
    /// ```
    /// let b = idemstore::PostgresStore::builder().pool_size(64);
    /// # let _ = b;
    /// ```
    pub fn pool_size(mut self, pool_size: u32) -> Self {
        self.pool_size = pool_size;
        self
    }

    /// How long a call waits for a connection before failing with
    /// [`Error::Backend`] (default [`DEFAULT_CONNECT_TIMEOUT`]): the bound
    /// on a call when the server is down or every connection is busy.
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
    /// [`DEFAULT_STATEMENT_TIMEOUT`], at least 1 ms): a statement stuck
    /// behind a lock fails with [`Error::Backend`] instead of hanging.
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

    /// Checks the options, connects once, and checks that the table, if it
    /// exists, is an idemstore table of this schema version. It does not
    /// create anything: call [`PostgresStore::migrate`] for that.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad option or URL;
    /// [`Error::Backend`] when the server cannot be reached within the
    /// connect timeout; [`Error::Corrupt`] when the table exists but is not
    /// an idemstore table; [`Error::UnsupportedFormat`] when it was created
    /// by a newer schema version.
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
        if !(1..=MAX_POOL_SIZE).contains(&self.pool_size) {
            return Err(Error::invalid_argument(format!(
                "pool size {} is outside 1..={MAX_POOL_SIZE}",
                self.pool_size
            )));
        }
        if self.connect_timeout.is_zero() {
            return Err(Error::invalid_argument("connect timeout must not be zero"));
        }
        if self.statement_timeout.as_millis() == 0 {
            return Err(Error::invalid_argument(
                "statement timeout must be at least 1 ms",
            ));
        }
        let mut config: ::postgres::Config = url.parse().map_err(|e| {
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
            .connect_timeout(self.connect_timeout)
            .options(options.trim_start());
        if config.get_application_name().is_none() {
            config.application_name("idemstore");
        }
        let sql = Arc::new(Sql::new(&self.table));
        let pool: Pool = r2d2::Pool::builder()
            .max_size(self.pool_size)
            // Every connection is opened here and kept open (r2d2 replaces
            // one that dies): opening one takes a server process fork and
            // an authentication, milliseconds that would otherwise land on
            // the first burst of requests, as a latency spike.
            .min_idle(None)
            .connection_timeout(self.connect_timeout)
            // A validity check per checkout would cost a round trip per call;
            // a connection the server ended is noticed by its failed
            // statement instead, and the call moves on to another one.
            .test_on_check_out(false)
            .build(Manager::new(config, Arc::clone(&sql)))
            .map_err(pool_error)?;
        let store = PostgresStore {
            pool,
            sql,
            max_body_bytes,
            clock: self.clock,
        };
        schema::check(&mut *store.conn()?, &store.sql)?;
        Ok(store)
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
        assert!(err(b().pool_size(0)).unwrap().contains("pool size"));
        assert!(
            err(b().pool_size(MAX_POOL_SIZE + 1))
                .unwrap()
                .contains("pool size")
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
