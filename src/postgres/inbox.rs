//! [`PgInbox`]: the co-transactional inbox on PostgreSQL.
//!
//! A consumer's handler runs inside a PostgreSQL transaction that also
//! holds the message id's claim; the handler's own writes and the DONE
//! record commit together, or neither does. The claim is the same atomic
//! step as [`Store::begin`](crate::Store::begin) (the same statement), made
//! inside the transaction: its advisory lock on the key is held until the
//! commit, so a concurrent delivery of the same message waits for it and
//! then answers Duplicate.
//!
//! A batch ([`PgInbox::handle_batch`]) locks and decides all its ids in
//! one round trip and writes all its DONE records in one statement
//! (inbox_sql.rs), with one commit; a failing message rolls the batch back
//! and it runs again without that message.

use super::errors::{self, db_error};
use super::inbox_sql::{InboxSql, Prepared, pipelined};
use super::ops::{BeginStep, Core, RunError, complete_on};
use super::pool::{Conn, Pool, Pooled};
use super::stats::Counters;
use super::{MAX_BEGIN_ATTEMPTS, PostgresStore, row, sql};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::guard::{DEFAULT_LEASE, DEFAULT_RETENTION};
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, Record, check_durations};
use crate::response::Response;
use crate::store::Store;
use crate::time::{Clock, Timestamp};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

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
    pub(super) store: Arc<PostgresStore>,
    pub(super) sql: Arc<InboxSql>,
    pub(super) retention: Duration,
    pub(super) clock: Arc<dyn Clock>,
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
        let sql = Arc::new(InboxSql::new(
            &store.core.sql.table,
            &store.core.sql.sequence,
        ));
        PgInbox {
            clock: store.clock(),
            sql,
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
    /// whose outcome is unknown: a redelivery finds out. So is a `COMMIT`
    /// PostgreSQL reports done on the primary only (its wait for a
    /// synchronous standby cancelled), in a batch or a set too.
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
pub(super) struct OpenTx(pub(super) Option<Pooled>);

impl OpenTx {
    /// A pooled connection for one transaction, and the connection's count
    /// of commits reported on the primary only so far, which [`settled`]
    /// compares with the count after the transaction.
    pub(super) async fn take(pool: &Pool) -> Result<(OpenTx, Arc<Conn>, u64), Error> {
        let pooled = pool.get().await?;
        let conn = pooled.conn();
        let seen = conn.unreplicated();
        Ok((OpenTx(Some(pooled)), conn, seen))
    }

    pub(super) fn finish(&mut self) {
        // Back to the pool: the transaction ended.
        drop(self.0.take());
    }

    /// Rolls the transaction on `conn` (this one's connection) back, and
    /// the connection goes back to the pool.
    pub(super) async fn rollback(&mut self, conn: &Conn) -> Result<(), tokio_postgres::Error> {
        conn.client.batch_execute("ROLLBACK").await?;
        self.finish();
        Ok(())
    }
}

/// Ends a delivery whose transactions are over (the connection goes back
/// to the pool) with `answers`, unless the server reported one of its
/// commits on the primary only ([`Conn::unreplicated`] moved from `seen`):
/// then its outcome is unknown, as after a failed `COMMIT`, and a
/// redelivery finds out.
pub(super) fn settled<T>(
    open: &mut OpenTx,
    conn: &Conn,
    seen: u64,
    answers: T,
) -> Result<T, Error> {
    open.finish();
    if conn.unreplicated() == seen {
        Ok(answers)
    } else {
        Err(errors::unreplicated())
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
    let (mut open, conn, seen) = OpenTx::take(&core.pool).await?;
    let table = &core.sql.table;
    let db = |e| -> E { db_error(e, table).into() };
    let run = |e: RunError| -> E { e.into_error(table).into() };
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
            open.rollback(&conn).await.map_err(db)?;
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
            open.rollback(&conn).await.map_err(db)?;
            return Err(err);
        }
    };
    let token = row::token(claim.token).ok_or(Error::StaleClaim)?;
    let times = row::times(now, retention);
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
    Ok(settled(
        &mut open,
        &conn,
        seen,
        Delivery::Handled(response),
    )?)
}

impl PgInbox {
    /// Handles a batch of deliveries in one PostgreSQL transaction, one
    /// commit for the batch, and answers each in input order: `Handled`,
    /// `Duplicate`, `Conflict`, `InFlight`, or that message's error.
    ///
    /// Each message is `(key, fingerprint, payload)`. The transaction takes
    /// every distinct id's lock and reads its record (one round trip, with
    /// the `BEGIN`), decides each id as [`Store::begin`](crate::Store::begin)
    /// would, runs the claimed messages' handlers in input order, one after
    /// the other, with its [`Client`], writes every DONE record in one
    /// statement, and commits: two round trips for the batch besides the
    /// handlers' own when every id is new (the DONE records, plain inserts,
    /// go with the `COMMIT`), three when a record already exists (written
    /// under the claim's conditions, then `COMMIT`), where a savepoint per
    /// message cost five per message.
    /// (No PROCESSING record is written: inside the transaction no one else
    /// could see it; the ids' locks keep other claimers out until the
    /// commit.) The same id twice in a batch is handled once: the later
    /// one is `Duplicate` of the first's result (`Conflict` when its
    /// fingerprint differs). An id that another consumer is claiming or
    /// handling right now is waited for, then answered `Duplicate` (or
    /// handled here, if that transaction rolled back); the wait counts
    /// against the store's statement timeout (past it the batch fails and
    /// nothing of it is committed). The ids are locked in one global
    /// order, so overlapping batches do not deadlock. Each
    /// id holds an entry of the server's lock table until the commit (see
    /// `max_locks_per_transaction` for batches of thousands).
    ///
    /// **A failing message** (the handler returned an error, panicked —
    /// [`Error::HandlerPanicked`] — or returned a result over the limits)
    /// rolls the transaction back, and the batch runs again without it: it
    /// leaves none of its writes, its answer is its error, and its
    /// batch-mates run again in a new transaction, each with a new claim
    /// (a new fencing token); their first run's writes were rolled back.
    /// So a handler may run more than once for one delivery, and its only
    /// effects must be writes through the client it is given. A second
    /// failing message makes the third and last pass run each message in a
    /// savepoint of its own (claim, handler and DONE record, five round
    /// trips per message), where a failure rolls back only its own message:
    /// a batch of `n` runs its handlers at most `3n` times, and a batch
    /// with one poison message costs a second pass at the full speed. (A
    /// batch also runs again when a record it took over was completed or
    /// renewed by its previous owner while the handlers ran.)
    ///
    /// The outer error is the batch's: a lost connection or a failed
    /// `COMMIT` (then nothing, or everything, committed: a redelivery finds
    /// out). Blocks this thread until the commit; the handler runs on the
    /// store's runtime thread and must not block. An empty batch commits
    /// nothing.
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
        self.run_batch(messages, |core, sql, messages, now, retention| async move {
            deliver_batch(&core, &sql, messages, now, retention, handler).await
        })
    }

    /// A batch's checks (its size; an empty batch answers at once), then
    /// `work` on the store's runtime, this thread blocked until it ends.
    pub(super) fn run_batch<T, R, W, Fut>(
        &self,
        messages: Vec<(Key, Fingerprint, T)>,
        work: W,
    ) -> Result<Vec<R>, Error>
    where
        R: Send + 'static,
        W: FnOnce(Arc<Core>, Arc<InboxSql>, Vec<(Key, Fingerprint, T)>, Timestamp, Duration) -> Fut,
        Fut: Future<Output = Result<Vec<R>, Error>> + Send + 'static,
    {
        crate::delivery::check_batch_len(messages.len())?;
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let (core, sql) = (Arc::clone(&self.store.core), Arc::clone(&self.sql));
        let work = work(core, sql, messages, self.clock.now(), self.retention);
        self.store
            .runtime
            .block_on_task(work)
            .unwrap_or(Err(Error::Closed))
    }
}

/// A future whose poll's panic becomes [`Error::HandlerPanicked`].
pub(super) struct CatchPanic<F>(pub(super) F);

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

/// How many passes of a batch run without savepoints: the first, and one
/// rerun after a failed message. A batch with a second failed message runs
/// its last pass with a savepoint per message ([`careful_pass`]), so a
/// batch of `n` runs its handlers at most `(FAST_PASSES + 1) × n` times.
const FAST_PASSES: usize = 2;

/// One message of a batch as the passes see it.
struct Item<'a, T> {
    key: &'a Key,
    fingerprint: &'a Fingerprint,
    payload: &'a T,
}

/// How a pass ended without its commit.
pub(super) enum Abort<E> {
    /// The batch's error: the connection, the server, a record that does
    /// not decode.
    Batch(Error),
    /// Message `index` failed (its handler's error, a panic, a result over
    /// the limits): the pass was rolled back; run the batch again without
    /// it.
    Message(usize, E),
    /// A record moved between the pass's decision and its DONE write (its
    /// previous owner completed or renewed it): the pass was rolled back;
    /// run it again, to decide on the new row.
    Moved,
}

impl<E> From<Error> for Abort<E> {
    fn from(e: Error) -> Abort<E> {
        Abort::Batch(e)
    }
}

async fn deliver_batch<T, E, F>(
    core: &Core,
    sql: &InboxSql,
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
    let items: Vec<Item<'_, T>> = messages
        .iter()
        .map(|(key, fingerprint, payload)| Item {
            key,
            fingerprint,
            payload,
        })
        .collect();
    let (mut open, conn, seen) = OpenTx::take(&core.pool).await?;
    let statements = sql
        .prepared(&conn)
        .await
        .map_err(|e| db_error(e, &core.sql.table))?;
    let ctx = PassContext {
        core,
        sql,
        statements: &statements,
        conn: &conn,
        now,
        retention,
    };
    // The failures of earlier passes: these messages' answers.
    let mut failed: Vec<Option<E>> = items.iter().map(|_| None).collect();
    let (mut fast, mut moved) = (0, 0);
    while fast < FAST_PASSES {
        if failed.iter().all(Option::is_some) {
            return settled(&mut open, &conn, seen, merge(Vec::new(), failed));
        }
        // Which messages failed (`E` need not be `Sync`: the passes see
        // flags, not the errors).
        let mask: Vec<bool> = failed.iter().map(Option::is_some).collect();
        match fast_pass(&ctx, &items, &mask, &mut handler).await {
            Ok(answers) => return settled(&mut open, &conn, seen, merge(answers, failed)),
            Err(Abort::Batch(e)) => return Err(e),
            Err(Abort::Message(index, e)) => match failed.get_mut(index) {
                Some(slot @ None) => {
                    *slot = Some(e);
                    fast += 1;
                }
                // A pass never runs a failed message: stop rather than loop.
                _ => return Err(Error::backend("an inbox pass failed a message twice")),
            },
            Err(Abort::Moved) => {
                // Counted with the begins that raced a concurrent writer.
                Counters::bump(&core.counters.snapshot_retries);
                moved += 1;
                if moved >= MAX_BEGIN_ATTEMPTS {
                    return Err(Error::backend(format!(
                        "an inbox batch raced with concurrent writers {MAX_BEGIN_ATTEMPTS} times in a row"
                    )));
                }
            }
        }
    }
    let mask: Vec<bool> = failed.iter().map(Option::is_some).collect();
    let answers = careful_pass(&ctx, &items, &mask, &mut handler).await?;
    settled(&mut open, &conn, seen, merge(answers, failed))
}

/// The answers of the last pass, with the failures of every pass.
fn merge<E: From<Error>>(
    answers: Vec<Option<Result<Delivery, E>>>,
    failed: Vec<Option<E>>,
) -> Vec<Result<Delivery, E>> {
    let mut answers = answers.into_iter();
    failed
        .into_iter()
        .map(|failed| match (answers.next().flatten(), failed) {
            (_, Some(e)) => Err(e),
            (Some(answer), None) => answer,
            (None, None) => Err(Error::backend("an inbox pass skipped a delivery").into()),
        })
        .collect()
}

/// What every pass of one batch shares.
pub(super) struct PassContext<'a> {
    pub(super) core: &'a Core,
    pub(super) sql: &'a InboxSql,
    pub(super) statements: &'a Prepared,
    pub(super) conn: &'a Conn,
    pub(super) now: Timestamp,
    pub(super) retention: Duration,
}

impl PassContext<'_> {
    pub(super) fn db(&self, e: tokio_postgres::Error) -> Error {
        db_error(e, &self.core.sql.table)
    }

    fn run(&self, e: RunError) -> Error {
        e.into_error(&self.core.sql.table)
    }

    /// Ends the pass's transaction with `ROLLBACK`, then reports `abort`
    /// (a failed `ROLLBACK` is reported instead, as the batch's error).
    pub(super) async fn roll_back<R, A: From<Error>>(&self, abort: A) -> Result<R, A> {
        self.conn
            .client
            .batch_execute("ROLLBACK")
            .await
            .map_err(|e| A::from(self.db(e)))?;
        Err(abort)
    }
}

/// What `logic::begin` decided for one distinct key of a pass, on the row
/// the `decide` statement read.
pub(super) enum Decided {
    /// Claimed: the claim, the PROCESSING record it would write (never
    /// written: the DONE record made from it replaces it), and whether the
    /// key had no row (see [`write_and_commit`]).
    Claimed(Claim, Record, bool),
    /// Not claimable: the answer (Replay, Conflict, InFlight) and the row
    /// it was decided on.
    Answer(Begin, Option<Record>),
}

/// A distinct key of a pass, for the `decide` statement, and its message.
pub(super) struct Rep<'a> {
    pub(super) key: &'a Key,
    pub(super) fingerprint: &'a Fingerprint,
    pub(super) lock: i64,
    /// The message whose claim this is (the key's first one that reaches
    /// the store in this pass).
    pub(super) index: usize,
}

/// One pass without savepoints: every distinct key locked and decided (one
/// round trip), the handlers run in input order on the transaction's
/// client, every DONE record written in one statement, one `COMMIT`. A
/// message that fails rolls the whole pass back (`Abort::Message`).
async fn fast_pass<T, E, F>(
    ctx: &PassContext<'_>,
    items: &[Item<'_, T>],
    failed: &[bool],
    handler: &mut F,
) -> Result<Vec<Option<Result<Delivery, E>>>, Abort<E>>
where
    E: From<Error>,
    F: for<'c> FnMut(&'c Client, Claim, &'c T) -> HandlerFuture<'c, E>,
{
    let (core, conn) = (ctx.core, ctx.conn);
    // Which message of each key reaches the store: the first that is not
    // answered from an earlier failure of its id (a failed message makes
    // the next ones of its id with another fingerprint Conflict, as below).
    let mut reps: Vec<Rep<'_>> = Vec::new();
    let mut rep_of: HashMap<&Key, usize> = HashMap::new();
    let mut failed_fp: HashMap<&Key, &Fingerprint> = HashMap::new();
    for (index, (item, failed)) in items.iter().zip(failed).enumerate() {
        if *failed {
            failed_fp.insert(item.key, item.fingerprint);
            continue;
        }
        if rep_of.contains_key(item.key)
            || failed_fp
                .get(item.key)
                .is_some_and(|fp| *fp != item.fingerprint)
        {
            continue;
        }
        rep_of.insert(item.key, reps.len());
        reps.push(Rep {
            key: item.key,
            fingerprint: item.fingerprint,
            lock: sql::key_lock(&core.sql.table, item.key),
            index,
        });
    }
    // Per distinct key (indexed like `reps`), what `logic::begin` decided.
    let mut by_rep: Vec<Option<Decided>> = decide_all(ctx, &reps)
        .await?
        .into_iter()
        .map(Some)
        .collect();

    // The batch in input order, as the per-message inbox decides it: what
    // this pass already answered for an id is its fingerprint and its
    // stored result (None: that message failed in an earlier pass).
    let mut seen: HashMap<&Key, (&Fingerprint, Option<Response>)> = HashMap::new();
    let mut answers: Vec<Option<Result<Delivery, E>>> = Vec::with_capacity(items.len());
    let mut handled: Vec<Done<'_>> = Vec::new();
    for (index, (item, failed)) in items.iter().zip(failed).enumerate() {
        if *failed {
            failed_before(&mut seen, item.key, item.fingerprint);
            answers.push(None);
            continue;
        }
        if let Some((first, stored)) = seen.get(item.key) {
            if *first != item.fingerprint {
                answers.push(Some(Ok(Delivery::Conflict)));
                continue;
            }
            if let Some(response) = stored {
                answers.push(Some(Ok(Delivery::Duplicate(response.clone()))));
                continue;
            }
            // The earlier delivery failed: this one is tried afresh.
        }
        let rep = rep_of.get(item.key).copied();
        let is_rep = rep
            .and_then(|r| reps.get(r))
            .is_some_and(|r| r.index == index);
        let begin = match rep.and_then(|r| by_rep.get_mut(r)) {
            Some(slot) if is_rep => match slot.take() {
                Some(Decided::Claimed(claim, processing, fresh)) => {
                    (Begin::Claimed(claim), Some(processing), fresh)
                }
                Some(Decided::Answer(answer, record)) => {
                    // Kept for the id's later messages.
                    *slot = Some(Decided::Answer(answer.clone(), record));
                    (answer, None, false)
                }
                None => return ctx.roll_back(Abort::Batch(undecided())).await,
            },
            // A later message of an id whose first one was answered
            // Conflict or InFlight: decided on the same row (its key is
            // locked, so the row is current), drawing a token of its own
            // when that row is claimable for this fingerprint.
            Some(Some(Decided::Answer(_, record))) => {
                let begin = |token| {
                    logic::begin(
                        record.clone(),
                        item.fingerprint,
                        ctx.now,
                        DEFAULT_LEASE,
                        ctx.retention,
                        || Ok(token),
                    )
                };
                let mut step = begin(0)?;
                if step.write.is_some() {
                    step = begin(next_token(ctx).await?)?;
                }
                (step.answer, step.write, false)
            }
            _ => return ctx.roll_back(Abort::Batch(undecided())).await,
        };
        let (claim, processing, fresh) = match begin {
            (Begin::Claimed(claim), Some(processing), fresh) => (claim, processing, fresh),
            (Begin::Claimed(_), None, _) => {
                return ctx.roll_back(Abort::Batch(undecided())).await;
            }
            (Begin::Replay(response), _, _) => {
                seen.insert(item.key, (item.fingerprint, Some(response.clone())));
                answers.push(Some(Ok(Delivery::Duplicate(response))));
                continue;
            }
            (Begin::Conflict, _, _) => {
                answers.push(Some(Ok(Delivery::Conflict)));
                continue;
            }
            (Begin::InFlight { lease_until }, _, _) => {
                answers.push(Some(Ok(Delivery::InFlight { lease_until })));
                continue;
            }
        };
        match run_handler(core, handler, conn, claim.clone(), item.payload).await {
            Ok(response) => {
                // The record as `complete` would write it over the claim.
                let done = match logic::complete(
                    Some(processing),
                    &claim,
                    &response,
                    ctx.now,
                    ctx.retention,
                ) {
                    Ok(done) => done,
                    Err(e) => return ctx.roll_back(Abort::Message(index, e.into())).await,
                };
                seen.insert(item.key, (item.fingerprint, Some(response.clone())));
                answers.push(Some(Ok(Delivery::Handled(response))));
                handled.push(Done {
                    index,
                    key: item.key,
                    record: done,
                    fresh,
                });
            }
            // Its claim and its writes, and its batch-mates' so far: all
            // undone. The next pass runs without it.
            Err(e) => return ctx.roll_back(Abort::Message(index, e)).await,
        }
    }
    write_and_commit(ctx, &handled).await?;
    Ok(answers)
}

/// Writes every DONE record of a pass and commits.
///
/// When every key was without a row at `decide`, the records are new rows
/// that nothing can have written since: only a holder of the key's lock
/// inserts a row for a key (a begin, an inbox batch), and the other
/// writers (complete, renew, release, sweep) touch existing rows only. The
/// plain `insert_done` and the `COMMIT` then go together, one round trip:
/// should a row exist after all, the insert fails (a unique violation), the
/// `COMMIT` finds the transaction failed and rolls it back, and the pass
/// runs again (`Abort::Moved`), nothing of it written. Otherwise
/// `write_done` checks each row under its row lock, and a row no longer
/// claimable (its previous owner completed or renewed it) rolls the pass
/// back (`Abort::Moved`) before any `COMMIT`.
pub(super) async fn write_and_commit<E>(
    ctx: &PassContext<'_>,
    handled: &[Done<'_>],
) -> Result<(), Abort<E>> {
    let client = &ctx.conn.client;
    if !handled.is_empty() && handled.iter().all(|done| done.fresh) {
        let columns = DoneColumns::of(handled)?;
        let params = columns.params();
        let (inserted, committed) = pipelined(
            client.execute(&ctx.statements.insert_done, &params[..13]),
            client.batch_execute("COMMIT"),
        )
        .await;
        if let Err(e) = inserted {
            // The COMMIT ended the failed transaction: nothing committed.
            if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
                return Err(Abort::Moved);
            }
            return Err(Abort::Batch(ctx.db(e)));
        }
        return committed.map_err(|e| Abort::Batch(ctx.db(e)));
    }
    if !handled.is_empty() {
        let written = write_all(ctx, handled).await?;
        if handled.iter().any(|done| !written.contains(&done.index)) {
            return ctx.roll_back(Abort::Moved).await;
        }
    }
    client
        .batch_execute("COMMIT")
        .await
        .map_err(|e| Abort::Batch(ctx.db(e)))
}

/// Notes in `seen` a message that failed in an earlier pass: the next
/// ones of its id with another fingerprint are Conflict, and one with the
/// same is tried afresh. Unless this pass already stored (or found) a
/// result for the id: that record is what the store would answer from
/// (Duplicate of it, or Conflict), and it stays.
fn failed_before<'a>(
    seen: &mut HashMap<&'a Key, (&'a Fingerprint, Option<Response>)>,
    key: &'a Key,
    fingerprint: &'a Fingerprint,
) {
    match seen.get(key) {
        Some((_, Some(_))) => {}
        _ => {
            seen.insert(key, (fingerprint, None));
        }
    }
}

pub(super) fn undecided() -> Error {
    Error::backend("an inbox batch left a delivery undecided")
}

/// Runs one message's handler (a panic becomes [`Error::HandlerPanicked`])
/// and checks its result against the limits.
async fn run_handler<'c, T, E, F>(
    core: &Core,
    handler: &mut F,
    conn: &'c Conn,
    claim: Claim,
    payload: &'c T,
) -> Result<Response, E>
where
    E: From<Error>,
    F: for<'h> FnMut(&'h Client, Claim, &'h T) -> HandlerFuture<'h, E>,
{
    match CatchPanic(handler(&conn.client, claim, payload)).await {
        Ok(Ok(response)) => logic::check_response(&response, core.max_body_bytes)
            .map(|()| response)
            .map_err(E::from),
        Ok(Err(err)) => Err(err),
        Err(message) => Err(Error::HandlerPanicked { message }.into()),
    }
}

/// `BEGIN` with the set-based plan settings ([`sql::Stmt::PlanSettings`]), every key's lock
/// (in lock order), the `decide` statement, and the settings put back: sent
/// together, one round trip. `logic::begin`'s decision for each of
/// `reps`, in order. (Should the `BEGIN` fail, the statements after it
/// would run alone, each its own transaction: they write nothing.)
pub(super) async fn decide_all<E>(
    ctx: &PassContext<'_>,
    reps: &[Rep<'_>],
) -> Result<Vec<Decided>, Abort<E>> {
    // Sorted by lock id: every batch takes the locks it shares with
    // another in the same order, so batches never wait on each other in a
    // cycle, whatever their overlap. (A claimer waits on a row only while
    // it holds the key's lock, which no other claimer then holds; the
    // store's own complete, renew, release and sweep wait for nothing
    // while they hold a row.)
    let mut locks: Vec<i64> = reps.iter().map(|rep| rep.lock).collect();
    locks.sort_unstable();
    locks.dedup();
    let scopes: Vec<&[u8]> = reps.iter().map(|r| r.key.scope()).collect();
    let ids: Vec<&[u8]> = reps.iter().map(|r| r.key.id()).collect();
    let fps: Vec<&[u8]> = reps.iter().map(|r| &r.fingerprint.as_bytes()[..]).collect();
    let at = row::millis(ctx.now);
    let lock_params: [&(dyn ToSql + Sync); 1] = [&locks];
    let decide_params: [&(dyn ToSql + Sync); 4] = [&scopes, &ids, &fps, &at];
    let client = &ctx.conn.client;
    // The key locks are transaction-scoped: held until the COMMIT or
    // ROLLBACK. A key another consumer is claiming or handling is waited
    // for here; `decide` then reads its committed row (DONE: Duplicate).
    // `decide` runs under the set-based plan settings, which are put back
    // before the handlers' own statements run.
    let settings = ctx
        .conn
        .prepared(sql::Stmt::PlanSettings)
        .await
        .map_err(|e| ctx.db(e))?;
    let ((((begun, set), locked), rows), reset) = pipelined(
        pipelined(
            pipelined(
                pipelined(client.batch_execute("BEGIN"), client.query(&settings, &[])),
                client.query(&ctx.statements.lock_all, &lock_params),
            ),
            client.query(&ctx.statements.decide, &decide_params),
        ),
        client.batch_execute(sql::SET_END),
    )
    .await;
    begun.map_err(|e| ctx.db(e))?;
    set.map_err(|e| ctx.db(e))?;
    locked.map_err(|e| ctx.db(e))?;
    reset.map_err(|e| ctx.db(e))?;
    let rows = rows.map_err(|e| ctx.db(e))?;
    let mut decided: Vec<Option<Decided>> = reps.iter().map(|_| None).collect();
    for found in &rows {
        let ord: i64 = found.try_get(0).map_err(|e| ctx.db(e))?;
        let token: Option<i64> = found.try_get(1).map_err(|e| ctx.db(e))?;
        let position = usize::try_from(ord).ok().and_then(|o| o.checked_sub(1));
        let (Some(rep), Some(slot)) = (
            position.and_then(|p| reps.get(p)),
            position.and_then(|p| decided.get_mut(p)),
        ) else {
            return Err(Error::backend(format!("the inbox's decide returned row {ord}")).into());
        };
        // The state column (NOT NULL in the table) is NULL: no row.
        let state: Option<i16> = found.try_get(3).map_err(|e| ctx.db(e))?;
        let record = match state {
            Some(_) => Some(row::record(rep.key, found, 2)?),
            None => None,
        };
        let step = logic::begin(
            record.clone(),
            rep.fingerprint,
            ctx.now,
            DEFAULT_LEASE,
            ctx.retention,
            || {
                token
                    .and_then(|t| u64::try_from(t).ok())
                    .ok_or_else(|| Error::backend("the inbox's decide drew no token for a claim"))
            },
        )?;
        *slot = Some(match (step.answer, step.write) {
            (Begin::Claimed(claim), Some(processing)) => {
                Decided::Claimed(claim, processing, record.is_none())
            }
            (answer, _) => Decided::Answer(answer, record),
        });
    }
    decided
        .into_iter()
        .map(|d| d.ok_or_else(|| Abort::Batch(undecided())))
        .collect()
}

/// One token from the sequence (for a claim `decide` did not foresee).
async fn next_token<E>(ctx: &PassContext<'_>) -> Result<u64, Abort<E>> {
    let rows = ctx
        .conn
        .client
        .query_typed(&ctx.sql.next_token, &[])
        .await
        .map_err(|e| ctx.db(e))?;
    let token: i64 = match rows.first() {
        Some(found) => found.try_get(0).map_err(|e| ctx.db(e))?,
        None => return Err(Error::backend("nextval returned no row").into()),
    };
    u64::try_from(token).map_err(|_| Error::backend(format!("token {token} is negative")).into())
}

/// A handled message of a pass: its DONE record, to write.
pub(super) struct Done<'a> {
    pub(super) index: usize,
    pub(super) key: &'a Key,
    pub(super) record: Record,
    /// The key had no row at `decide` (see [`write_and_commit`]).
    pub(super) fresh: bool,
}

/// The DONE records of a pass as the columns of `write_done` and
/// `insert_done` (one array element per record; the headers of all of them
/// as two flat arrays, each record's a slice, 1-based and inclusive).
pub(super) struct DoneColumns<'a> {
    scopes: Vec<&'a [u8]>,
    ids: Vec<&'a [u8]>,
    fps: Vec<&'a [u8]>,
    expiries: Vec<i64>,
    created: Vec<i64>,
    tokens: Vec<i64>,
    attempts: Vec<i64>,
    statuses: Vec<i32>,
    firsts: Vec<i32>,
    lasts: Vec<i32>,
    names: Vec<&'a [u8]>,
    values: Vec<&'a [u8]>,
    bodies: Vec<&'a [u8]>,
}

impl<'a> DoneColumns<'a> {
    pub(super) fn of(handled: &'a [Done<'a>]) -> Result<DoneColumns<'a>, Error> {
        let n = handled.len();
        let mut c = DoneColumns {
            scopes: Vec::with_capacity(n),
            ids: Vec::with_capacity(n),
            fps: Vec::with_capacity(n),
            expiries: Vec::with_capacity(n),
            created: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
            attempts: Vec::with_capacity(n),
            statuses: Vec::with_capacity(n),
            firsts: Vec::with_capacity(n),
            lasts: Vec::with_capacity(n),
            names: Vec::new(),
            values: Vec::new(),
            bodies: Vec::with_capacity(n),
        };
        let too_many = || Error::invalid_argument("too many response headers in one inbox batch");
        for done in handled {
            let record = &done.record;
            let (Some(response), Some(token)) = (&record.response, row::token(record.token)) else {
                return Err(Error::StaleClaim);
            };
            c.scopes.push(done.key.scope());
            c.ids.push(done.key.id());
            c.fps.push(&record.fingerprint.as_bytes()[..]);
            c.expiries.push(row::millis(record.expires_at));
            c.created.push(row::millis(record.created_at));
            c.tokens.push(token);
            c.attempts.push(i64::from(record.attempts));
            let columns = row::response_columns(response);
            c.statuses.push(columns.status);
            // An empty response's slice is [n + 1, n].
            c.firsts
                .push(i32::try_from(c.names.len() + 1).map_err(|_| too_many())?);
            c.names.extend(columns.names);
            c.values.extend(columns.values);
            c.lasts
                .push(i32::try_from(c.names.len()).map_err(|_| too_many())?);
            c.bodies.push(columns.body);
        }
        Ok(c)
    }

    /// `$1` to `$13` of both statements, and a placeholder for
    /// `write_done`'s `$14` (its caller's `now`).
    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 14] {
        [
            &self.scopes,
            &self.ids,
            &self.fps,
            &self.expiries,
            &self.created,
            &self.tokens,
            &self.attempts,
            &self.statuses,
            &self.firsts,
            &self.lasts,
            &self.names,
            &self.values,
            &self.bodies,
            &0i64,
        ]
    }
}

/// The `write_done` statement for every handled message: the indexes whose
/// record it wrote.
pub(super) async fn write_all<E>(
    ctx: &PassContext<'_>,
    handled: &[Done<'_>],
) -> Result<std::collections::HashSet<usize>, Abort<E>> {
    let columns = DoneColumns::of(handled)?;
    let at = row::millis(ctx.now);
    let mut params = columns.params();
    params[13] = &at;
    let rows = ctx
        .conn
        .client
        .query(&ctx.statements.write_done, &params[..])
        .await
        .map_err(|e| ctx.db(e))?;
    let mut written = std::collections::HashSet::with_capacity(rows.len());
    for done in &rows {
        let ord: i64 = done.try_get(0).map_err(|e| ctx.db(e))?;
        let index = usize::try_from(ord)
            .ok()
            .and_then(|o| o.checked_sub(1))
            .and_then(|o| handled.get(o))
            .map(|done| done.index);
        written.extend(index);
    }
    Ok(written)
}

/// The pass after a second failed message: the per-message path, each new
/// message's claim (`BeginStep`), handler and DONE record in a savepoint of
/// its own, so a failure rolls back only its own message. It first takes
/// every key's lock in lock order (as a fast pass does), so the
/// claims below never wait for a lock while this transaction holds another.
async fn careful_pass<T, E, F>(
    ctx: &PassContext<'_>,
    items: &[Item<'_, T>],
    failed: &[bool],
    handler: &mut F,
) -> Result<Vec<Option<Result<Delivery, E>>>, Error>
where
    E: From<Error>,
    F: for<'c> FnMut(&'c Client, Claim, &'c T) -> HandlerFuture<'c, E>,
{
    let (core, conn) = (ctx.core, ctx.conn);
    let table = &core.sql.table;
    let db = |e| ctx.db(e);
    let mut locks: Vec<i64> = items
        .iter()
        .zip(failed)
        .filter(|(_, failed)| !**failed)
        .map(|(item, _)| sql::key_lock(table, item.key))
        .collect();
    locks.sort_unstable();
    locks.dedup();
    let params: [&(dyn ToSql + Sync); 1] = [&locks];
    let (begun, locked) = pipelined(
        conn.client.batch_execute("BEGIN"),
        conn.client.query(&ctx.statements.lock_all, &params),
    )
    .await;
    begun.map_err(db)?;
    locked.map_err(db)?;
    let mut seen: HashMap<&Key, (&Fingerprint, Option<Response>)> = HashMap::new();
    let mut answers = Vec::with_capacity(items.len());
    let times = row::times(ctx.now, ctx.retention);
    for (item, failed) in items.iter().zip(failed) {
        let (key, fingerprint) = (item.key, item.fingerprint);
        if *failed {
            failed_before(&mut seen, key, fingerprint);
            answers.push(None);
            continue;
        }
        if let Some((first, stored)) = seen.get(key) {
            if *first != fingerprint {
                answers.push(Some(Ok(Delivery::Conflict)));
                continue;
            }
            if let Some(response) = stored {
                answers.push(Some(Ok(Delivery::Duplicate(response.clone()))));
                continue;
            }
            // The earlier delivery failed: this one is tried afresh.
        }
        conn.client.batch_execute("SAVEPOINT m").await.map_err(db)?;
        let step = BeginStep {
            key,
            fingerprint,
            now: ctx.now,
            lease: DEFAULT_LEASE,
            retention: ctx.retention,
            lock: sql::key_lock(table, key),
        };
        let begin = step
            .run(conn, &core.counters)
            .await
            .map_err(|e| ctx.run(e))?;
        let answer = match begin {
            Begin::Claimed(claim) => Err(claim),
            Begin::Replay(response) => {
                seen.insert(key, (fingerprint, Some(response.clone())));
                Ok(Delivery::Duplicate(response))
            }
            Begin::Conflict => Ok(Delivery::Conflict),
            Begin::InFlight { lease_until } => Ok(Delivery::InFlight { lease_until }),
        };
        let claim = match answer {
            Err(claim) => claim,
            Ok(answer) => {
                conn.client
                    .batch_execute("RELEASE SAVEPOINT m")
                    .await
                    .map_err(db)?;
                answers.push(Some(Ok(answer)));
                continue;
            }
        };
        let written = match run_handler(core, handler, conn, claim.clone(), item.payload).await {
            Ok(response) => {
                let token = row::token(claim.token).ok_or(Error::StaleClaim)?;
                let columns = row::response_columns(&response);
                // This transaction's own row, locked by it.
                let updated = complete_on(conn, key, token, times, &columns)
                    .await
                    .map_err(|e| ctx.run(e))?;
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
                seen.insert(key, (fingerprint, Some(response.clone())));
                answers.push(Some(Ok(Delivery::Handled(response))));
            }
            Err(err) => {
                // The claim, the handler's writes: all undone.
                conn.client
                    .batch_execute("ROLLBACK TO SAVEPOINT m; RELEASE SAVEPOINT m")
                    .await
                    .map_err(db)?;
                seen.insert(key, (fingerprint, None));
                answers.push(Some(Err(err)));
            }
        }
    }
    conn.client.batch_execute("COMMIT").await.map_err(db)?;
    Ok(answers)
}
