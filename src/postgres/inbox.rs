//! [`PgInbox`]: the co-transactional inbox on PostgreSQL.
//!
//! A consumer's handler runs inside a PostgreSQL transaction that also
//! holds the message id's claim; the handler's own writes and the DONE
//! record commit together, or neither does. The claim is the same atomic
//! step as [`Store::begin`](crate::Store::begin) (the same statement), made
//! inside the transaction: its advisory lock on the key is held until the
//! commit, so a concurrent delivery of the same message waits for it and
//! then answers Duplicate.

use super::errors::db_error;
use super::ops::{BeginStep, Core, RunError, complete_on};
use super::pool::Pooled;
use super::stats::Counters;
use super::{PostgresStore, row, sql};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::guard::{DEFAULT_LEASE, DEFAULT_RETENTION};
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, check_durations};
use crate::response::Response;
use crate::store::Store;
use crate::time::{Clock, Timestamp};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::Client;

/// What a [`PgInbox`] handler returns: a future borrowing the transaction's
/// client for `'c`.
pub type HandlerFuture<'c, E> = Pin<Box<dyn Future<Output = Result<Response, E>> + Send + 'c>>;

pub use crate::delivery::Delivery;

/// A transactional inbox on a [`PostgresStore`]: exactly-once effects for
/// an at-least-once consumer whose state lives in the same database.
///
/// [`handle`](PgInbox::handle) opens a transaction, claims the message id
/// in it, runs the handler with the transaction's [`Client`] (re-exported as
/// `idemstore::postgres::engine`), and commits the handler's writes with the
/// DONE record. A redelivered message is answered from the stored record
/// without running the handler; a handler error rolls everything back; a
/// panic rolls everything back (the connection is dropped) and is resumed
/// on the caller. Only writes through the given client are covered: effects
/// elsewhere still need the fencing token ([`Claim::token`]).
///
/// The handler runs on the store's runtime thread, with the other calls of
/// the store: it must not block (no blocking I/O, no blocking store calls),
/// and must not end the transaction itself (`COMMIT`, `ROLLBACK`).
///
/// ```no_run
/// use idemstore::postgres::{Delivery, PgInbox};
/// use idemstore::{Fingerprint, Key, PostgresStore, Response};
///
/// let store = PostgresStore::builder()
///     .migrate_on_build(true)
///     .connect("postgres://app@db.internal/payments")?;
/// let inbox = PgInbox::new(store);
/// let key = Key::new("payments-queue", "msg-7")?;
/// let delivery: Delivery = inbox.handle::<idemstore::Error, _>(&key, &Fingerprint::of(b"alice+10"), |client, claim| {
///     Box::pin(async move {
///         client
///             .execute("UPDATE balances SET amount = amount + 10 WHERE name = 'alice'", &[])
///             .await
///             .map_err(idemstore::Error::backend)?;
///         Ok(Response::new(200, format!("credited, token {}", claim.token())))
///     })
/// })?;
/// assert!(matches!(delivery, Delivery::Handled(_) | Delivery::Duplicate(_)));
/// # Ok::<(), idemstore::Error>(())
/// ```
pub struct PgInbox {
    store: Arc<PostgresStore>,
    retention: Duration,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for PgInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgInbox")
            .field("store", &self.store)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl PgInbox {
    /// An inbox over `store`, remembering handled ids for the default
    /// retention (24 h) and reading the store's clock.
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::connect("postgres://app@db.internal/payments")?;
    /// let inbox = idemstore::postgres::PgInbox::new(store);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn new(store: impl Into<Arc<PostgresStore>>) -> PgInbox {
        let store = store.into();
        PgInbox {
            clock: store.clock(),
            store,
            retention: DEFAULT_RETENTION,
        }
    }

    /// How long a handled message id is remembered; must cover the queue's
    /// longest redelivery horizon.
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::connect("postgres://app@db.internal/payments")?;
    /// let inbox = idemstore::postgres::PgInbox::new(store)
    ///     .retention(std::time::Duration::from_secs(7 * 24 * 3600));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn retention(mut self, retention: Duration) -> PgInbox {
        self.retention = retention;
        self
    }

    /// The clock for record timestamps and expiry (default: the store's).
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::connect("postgres://app@db.internal/payments")?;
    /// let inbox = idemstore::postgres::PgInbox::new(store).clock(idemstore::SystemClock);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn clock(mut self, clock: impl Clock + 'static) -> PgInbox {
        self.clock = Arc::new(clock);
        self
    }

    /// The store this inbox writes to.
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::connect("postgres://app@db.internal/payments")?;
    /// let inbox = idemstore::postgres::PgInbox::new(store);
    /// assert_eq!(inbox.store().table(), idemstore::postgres::DEFAULT_TABLE);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn store(&self) -> &Arc<PostgresStore> {
        &self.store
    }

    /// Handles one delivery of the message `key` whose payload digests to
    /// `fingerprint`, blocking this thread until it is committed (or rolled
    /// back). See [`PgInbox`]; safe on any thread.
    ///
    /// Errors: the handler's own (everything rolled back), or the store's
    /// ([`Error::Backend`], [`Error::ResponseTooLarge`], [`Error::Corrupt`])
    /// converted into `E`. A failed `COMMIT` is an [`Error::Backend`]
    /// whose outcome is unknown: a redelivery finds out.
    ///
    /// ```no_run
    /// use idemstore::{Fingerprint, Key, PostgresStore, Response};
    /// use idemstore::postgres::{Delivery, PgInbox};
    /// let inbox = PgInbox::new(PostgresStore::connect("postgres://app@db.internal/payments")?);
    /// let key = Key::new("orders-queue", "msg-8")?;
    /// let failed: Result<Delivery, idemstore::Error> = inbox.handle(&key, &Fingerprint::of(b"m"), |_client, _claim| {
    ///     Box::pin(async { Err(idemstore::Error::backend("downstream said no")) })
    /// });
    /// assert!(failed.is_err()); // nothing recorded: a redelivery runs the handler again
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn handle<E, F>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        handler: F,
    ) -> Result<Delivery, E>
    where
        E: From<Error> + Send + 'static,
        F: for<'c> FnOnce(&'c Client, Claim) -> HandlerFuture<'c, E> + Send + 'static,
    {
        self.store
            .runtime
            .block_on_task(self.work(key, fingerprint, handler))
            .unwrap_or_else(|| Err(Error::Closed.into()))
    }

    /// [`handle`](Self::handle) as a future that blocks no thread (any
    /// executor can await it). Dropped before it answers, the delivery
    /// still runs to its commit or rollback.
    ///
    /// ```no_run
    /// # async fn f(inbox: idemstore::postgres::PgInbox) -> Result<(), idemstore::Error> {
    /// use idemstore::{Fingerprint, Key, Response};
    /// let key = Key::new("orders-queue", "msg-9")?;
    /// let delivery = inbox
    ///     .handle_async(&key, &Fingerprint::of(b"m"), |_client, _claim| {
    ///         Box::pin(async { Ok::<_, idemstore::Error>(Response::new(200, "ok")) })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn handle_async<E, F>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        handler: F,
    ) -> impl Future<Output = Result<Delivery, E>> + Send + 'static
    where
        E: From<Error> + Send + 'static,
        F: for<'c> FnOnce(&'c Client, Claim) -> HandlerFuture<'c, E> + Send + 'static,
    {
        let task = self
            .store
            .runtime
            .spawn_task(self.work(key, fingerprint, handler));
        // `None`: the store's runtime shut down under it.
        async move { task.await.unwrap_or_else(|| Err(Error::Closed.into())) }
    }

    fn work<E, F>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        handler: F,
    ) -> impl Future<Output = Result<Delivery, E>> + Send + 'static
    where
        E: From<Error> + Send + 'static,
        F: for<'c> FnOnce(&'c Client, Claim) -> HandlerFuture<'c, E> + Send + 'static,
    {
        let core = Arc::clone(&self.store.core);
        let (key, fingerprint) = (key.clone(), *fingerprint);
        let (now, retention) = (self.clock.now(), self.retention);
        async move { deliver(&core, &key, &fingerprint, now, retention, handler).await }
    }
}

/// A connection with a transaction open on it: dropped before
/// [`finish`](OpenTx::finish) (an error, a panic), it is discarded, and the
/// server rolls the transaction back when the connection closes.
struct OpenTx(Option<Pooled>);

impl OpenTx {
    fn finish(&mut self) {
        // Back to the pool: the transaction ended.
        drop(self.0.take());
    }
}

impl Drop for OpenTx {
    fn drop(&mut self) {
        if let Some(pooled) = self.0.take() {
            pooled.discard();
        }
    }
}

async fn deliver<E, F>(
    core: &Core,
    key: &Key,
    fingerprint: &Fingerprint,
    now: Timestamp,
    retention: Duration,
    handler: F,
) -> Result<Delivery, E>
where
    E: From<Error>,
    F: for<'c> FnOnce(&'c Client, Claim) -> HandlerFuture<'c, E>,
{
    check_durations(DEFAULT_LEASE, retention)?;
    Counters::bump(&core.counters.calls);
    let pooled = core.pool.get().await?;
    let conn = pooled.conn();
    let mut open = OpenTx(Some(pooled));
    let table = &core.sql.table;
    let db = |e| -> E { db_error(e, table).into() };
    let run = |e| -> E {
        match e {
            RunError::Db(e) => db_error(e, table).into(),
            RunError::Store(e) => e.into(),
        }
    };
    conn.client.batch_execute("BEGIN").await.map_err(db)?;
    let step = BeginStep {
        key,
        fingerprint,
        now,
        lease: DEFAULT_LEASE,
        retention,
        lock: sql::key_lock(table, key),
    };
    let early = match step.run(&conn, &core.counters).await.map_err(run)? {
        Begin::Claimed(claim) => Err(claim),
        Begin::Replay(response) => Ok(Delivery::Duplicate(response)),
        Begin::Conflict => Ok(Delivery::Conflict),
        Begin::InFlight { lease_until } => Ok(Delivery::InFlight { lease_until }),
    };
    let claim = match early {
        Ok(answer) => {
            conn.client.batch_execute("ROLLBACK").await.map_err(db)?;
            open.finish();
            return Ok(answer);
        }
        Err(claim) => claim,
    };
    let handled = match handler(&conn.client, claim.clone()).await {
        Ok(response) => logic::check_response(&response, core.max_body_bytes)
            .map(|()| response)
            .map_err(E::from),
        Err(err) => Err(err),
    };
    let response = match handled {
        Ok(response) => response,
        Err(err) => {
            conn.client.batch_execute("ROLLBACK").await.map_err(db)?;
            open.finish();
            return Err(err);
        }
    };
    let token = row::token(claim.token).ok_or(Error::StaleClaim)?;
    let times = (row::millis(now), row::millis(now + retention));
    let columns = row::response_columns(&response);
    // The claim is this transaction's own row, locked by it: the update
    // cannot miss it.
    let updated = complete_on(&conn, key, token, times, &columns)
        .await
        .map_err(run)?;
    if updated != 1 {
        return Err(Error::StaleClaim.into());
    }
    conn.client.batch_execute("COMMIT").await.map_err(db)?;
    open.finish();
    Ok(Delivery::Handled(response))
}

/// Most deliveries one [`PgInbox::handle_batch`] takes.
///
/// ```
/// assert_eq!(idemstore::postgres::MAX_PG_INBOX_BATCH, 4_096);
/// ```
pub const MAX_PG_INBOX_BATCH: usize = 4_096;

impl PgInbox {
    /// Handles a batch of deliveries in one PostgreSQL transaction, one
    /// commit for the batch, and answers each in input order: `Handled`,
    /// `Duplicate`, `Conflict`, `InFlight`, or that message's error.
    ///
    /// Each message is `(key, fingerprint, payload)`. Each new message runs
    /// inside a savepoint: its claim, the handler's writes and its DONE
    /// record are kept, or (the handler returned an error, panicked —
    /// [`Error::HandlerPanicked`] — or returned a result over the limits)
    /// rolled back to the savepoint, so a failed message takes none of its
    /// batch-mates' writes with it and leaves none of its own. The same id
    /// twice in a batch is handled once: the later one is `Duplicate` of
    /// the first's result (`Conflict` when its fingerprint differs). The
    /// outer error is the batch's: a lost connection or a failed `COMMIT`
    /// (then nothing, or everything, committed: a redelivery finds out).
    /// Blocks this thread until the commit; the handler runs on the store's
    /// runtime thread and must not block. An empty batch commits nothing.
    ///
    /// ```no_run
    /// use idemstore::postgres::{Delivery, PgInbox};
    /// use idemstore::{Fingerprint, Key, PostgresStore, Response};
    ///
    /// let inbox = PgInbox::new(PostgresStore::builder().migrate_on_build(true).connect("postgres://app@db/payments")?);
    /// let batch: Vec<(Key, Fingerprint, i64)> = (0..100)
    ///     .map(|i| Ok((Key::new("payments", format!("msg-{i}"))?, Fingerprint::of(b"+1"), 1)))
    ///     .collect::<idemstore::Result<_>>()?;
    /// let answers = inbox.handle_batch(batch, |client, _claim, amount: &i64| {
    ///     let amount = *amount;
    ///     Box::pin(async move {
    ///         client
    ///             .execute("UPDATE balances SET amount = amount + $1 WHERE name = 'alice'", &[&amount])
    ///             .await
    ///             .map_err(idemstore::Error::backend)?;
    ///         Ok::<_, idemstore::Error>(Response::new(200, "credited"))
    ///     })
    /// })?;
    /// assert!(answers.iter().all(|a| matches!(a, Ok(Delivery::Handled(_) | Delivery::Duplicate(_)))));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn handle_batch<T, E, F>(
        &self,
        messages: Vec<(Key, Fingerprint, T)>,
        handler: F,
    ) -> Result<Vec<Result<Delivery, E>>, Error>
    where
        T: Send + Sync + 'static,
        E: From<Error> + Send + 'static,
        F: for<'c> FnMut(&'c Client, Claim, &'c T) -> HandlerFuture<'c, E> + Send + 'static,
    {
        if messages.len() > MAX_PG_INBOX_BATCH {
            return Err(Error::invalid_argument(format!(
                "a batch of {} messages is over the limit of {MAX_PG_INBOX_BATCH}",
                messages.len()
            )));
        }
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let core = Arc::clone(&self.store.core);
        let (now, retention) = (self.clock.now(), self.retention);
        self.store
            .runtime
            .block_on_task(
                async move { deliver_batch(&core, messages, now, retention, handler).await },
            )
            .unwrap_or(Err(Error::Closed))
    }
}

/// A future whose poll's panic becomes [`Error::HandlerPanicked`].
struct CatchPanic<F>(F);

impl<F: Future + Unpin> Future for CatchPanic<F> {
    type Output = Result<F::Output, String>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let inner = &mut self.0;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Pin::new(inner).poll(cx))) {
            Ok(std::task::Poll::Ready(out)) => std::task::Poll::Ready(Ok(out)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(payload) => {
                std::task::Poll::Ready(Err(crate::delivery::panic_message(payload.as_ref())))
            }
        }
    }
}

async fn deliver_batch<T, E, F>(
    core: &Core,
    messages: Vec<(Key, Fingerprint, T)>,
    now: Timestamp,
    retention: Duration,
    mut handler: F,
) -> Result<Vec<Result<Delivery, E>>, Error>
where
    E: From<Error>,
    F: for<'c> FnMut(&'c Client, Claim, &'c T) -> HandlerFuture<'c, E>,
{
    check_durations(DEFAULT_LEASE, retention)?;
    Counters::bump(&core.counters.calls);
    let pooled = core.pool.get().await?;
    let conn = pooled.conn();
    let mut open = OpenTx(Some(pooled));
    let table = &core.sql.table;
    let db = |e| db_error(e, table);
    let run = |e| match e {
        RunError::Db(e) => db_error(e, table),
        RunError::Store(e) => e,
    };
    conn.client.batch_execute("BEGIN").await.map_err(db)?;
    // What this batch already answered for an id: its fingerprint and the
    // result it stored (None: the id's message failed).
    let mut seen: std::collections::HashMap<Key, (Fingerprint, Option<Response>)> =
        std::collections::HashMap::new();
    let mut answers = Vec::with_capacity(messages.len());
    let times = (row::millis(now), row::millis(now + retention));
    for (key, fingerprint, payload) in &messages {
        if let Some((first, stored)) = seen.get(key) {
            if first != fingerprint {
                answers.push(Ok(Delivery::Conflict));
                continue;
            }
            if let Some(response) = stored {
                answers.push(Ok(Delivery::Duplicate(response.clone())));
                continue;
            }
            // The earlier delivery failed: this one is tried afresh.
        }
        conn.client.batch_execute("SAVEPOINT m").await.map_err(db)?;
        let step = BeginStep {
            key,
            fingerprint,
            now,
            lease: DEFAULT_LEASE,
            retention,
            lock: sql::key_lock(table, key),
        };
        let claim = match step.run(&conn, &core.counters).await.map_err(run)? {
            Begin::Claimed(claim) => claim,
            Begin::Replay(response) => {
                conn.client
                    .batch_execute("RELEASE SAVEPOINT m")
                    .await
                    .map_err(db)?;
                seen.insert(key.clone(), (*fingerprint, Some(response.clone())));
                answers.push(Ok(Delivery::Duplicate(response)));
                continue;
            }
            Begin::Conflict => {
                conn.client
                    .batch_execute("RELEASE SAVEPOINT m")
                    .await
                    .map_err(db)?;
                answers.push(Ok(Delivery::Conflict));
                continue;
            }
            Begin::InFlight { lease_until } => {
                conn.client
                    .batch_execute("RELEASE SAVEPOINT m")
                    .await
                    .map_err(db)?;
                answers.push(Ok(Delivery::InFlight { lease_until }));
                continue;
            }
        };
        let ran = CatchPanic(handler(&conn.client, claim.clone(), payload)).await;
        let handled: Result<Response, E> = match ran {
            Ok(Ok(response)) => logic::check_response(&response, core.max_body_bytes)
                .map(|()| response)
                .map_err(E::from),
            Ok(Err(err)) => Err(err),
            Err(message) => Err(Error::HandlerPanicked { message }.into()),
        };
        let written = match handled {
            Ok(response) => {
                let token = row::token(claim.token).ok_or(Error::StaleClaim)?;
                let columns = row::response_columns(&response);
                // This transaction's own row, locked by it.
                let updated = complete_on(&conn, key, token, times, &columns)
                    .await
                    .map_err(run)?;
                if updated == 1 {
                    Ok(response)
                } else {
                    Err(E::from(Error::StaleClaim))
                }
            }
            Err(err) => Err(err),
        };
        match written {
            Ok(response) => {
                conn.client
                    .batch_execute("RELEASE SAVEPOINT m")
                    .await
                    .map_err(db)?;
                seen.insert(key.clone(), (*fingerprint, Some(response.clone())));
                answers.push(Ok(Delivery::Handled(response)));
            }
            Err(err) => {
                // The claim, the handler's writes: all undone.
                conn.client
                    .batch_execute("ROLLBACK TO SAVEPOINT m; RELEASE SAVEPOINT m")
                    .await
                    .map_err(db)?;
                seen.insert(key.clone(), (*fingerprint, None));
                answers.push(Err(err));
            }
        }
    }
    conn.client.batch_execute("COMMIT").await.map_err(db)?;
    open.finish();
    Ok(answers)
}
