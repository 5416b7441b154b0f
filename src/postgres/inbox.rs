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
//! A batch ([`PgInbox::handle_batch`]) claims all its ids in one
//! set-based statement and writes all its DONE records in another
//! (inbox_sql.rs), with one commit; a failing message rolls the batch back
//! and it runs again without that message.

use super::errors::db_error;
use super::inbox_sql::InboxSql;
use super::ops::{BeginStep, Core, RunError, complete_on};
use super::pool::{Conn, Pooled};
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
use tokio_postgres::types::{ToSql, Type};

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
    sql: Arc<InboxSql>,
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
    /// Each message is `(key, fingerprint, payload)`. The transaction
    /// claims every distinct id of the batch in one statement (each id
    /// decided as [`Store::begin`](crate::Store::begin) decides it), runs
    /// the claimed messages' handlers in input order, one after the other,
    /// with its [`Client`], writes every DONE record in one statement, and
    /// commits: three round trips for the batch (the claim leaves with the
    /// `BEGIN`) besides the handlers' own, where a savepoint per message
    /// cost five per message. The same id twice in a batch is handled once:
    /// the later one is `Duplicate` of the first's result (`Conflict` when
    /// its fingerprint differs). An id that another consumer is claiming
    /// or handling right now is waited for, then answered `Duplicate` (or
    /// handled here, if that transaction rolled back); the ids are locked
    /// in one global order, so overlapping batches do not deadlock.
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
    /// with one poison message costs a second pass at the full speed.
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
        if messages.len() > MAX_PG_INBOX_BATCH {
            return Err(Error::invalid_argument(format!(
                "a batch of {} messages is over the limit of {MAX_PG_INBOX_BATCH}",
                messages.len()
            )));
        }
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let (core, sql) = (Arc::clone(&self.store.core), Arc::clone(&self.sql));
        let (now, retention) = (self.clock.now(), self.retention);
        self.store
            .runtime
            .block_on_task(async move {
                deliver_batch(&core, &sql, messages, now, retention, handler).await
            })
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

/// How many passes of a batch run without savepoints: the first, and one
/// rerun after a failed message. A batch with a second failed message runs
/// its last pass with a savepoint per message ([`careful_pass`]), so a
/// batch of `n` runs its handlers at most `(FAST_PASSES + 1) × n` times.
const FAST_PASSES: usize = 2;

/// Runs `a` and `b` together, polling `a` first. A statement's future sends
/// its request at its first poll, so both requests leave in this order
/// before either reply is awaited: two statements, one round trip.
async fn pipelined<A: Future, B: Future>(a: A, b: B) -> (A::Output, B::Output) {
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    let (mut out_a, mut out_b) = (None, None);
    std::future::poll_fn(|cx| {
        if out_a.is_none()
            && let std::task::Poll::Ready(v) = a.as_mut().poll(cx)
        {
            out_a = Some(v);
        }
        if out_b.is_none()
            && let std::task::Poll::Ready(v) = b.as_mut().poll(cx)
        {
            out_b = Some(v);
        }
        match (out_a.take(), out_b.take()) {
            (Some(a), Some(b)) => std::task::Poll::Ready((a, b)),
            (a, b) => {
                (out_a, out_b) = (a, b);
                std::task::Poll::Pending
            }
        }
    })
    .await
}

/// One message of a batch as the passes see it.
struct Item<'a, T> {
    key: &'a Key,
    fingerprint: &'a Fingerprint,
    payload: &'a T,
}

/// How a pass ended without its commit.
enum Abort<E> {
    /// The batch's error: the connection, the server, a record that does
    /// not decode.
    Batch(Error),
    /// Message `index` failed (its handler's error, a panic, a result over
    /// the limits, a lost claim): the pass was rolled back; run the batch
    /// again without it.
    Message(usize, E),
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
    let pooled = core.pool.get().await?;
    let conn = pooled.conn();
    let mut open = OpenTx(Some(pooled));
    let ctx = PassContext {
        core,
        sql,
        conn: &conn,
        now,
        retention,
    };
    // The failures of earlier passes: these messages' answers.
    let mut failed: Vec<Option<E>> = items.iter().map(|_| None).collect();
    for _ in 0..FAST_PASSES {
        if failed.iter().all(Option::is_some) {
            open.finish();
            return Ok(merge(Vec::new(), failed));
        }
        // Which messages failed (`E` need not be `Sync`: the passes see
        // flags, not the errors).
        let mask: Vec<bool> = failed.iter().map(Option::is_some).collect();
        match fast_pass(&ctx, &items, &mask, &mut handler).await {
            Ok(answers) => {
                open.finish();
                return Ok(merge(answers, failed));
            }
            Err(Abort::Batch(e)) => return Err(e),
            Err(Abort::Message(index, e)) => match failed.get_mut(index) {
                Some(slot @ None) => *slot = Some(e),
                // A pass never runs a failed message: stop rather than loop.
                _ => return Err(Error::backend("an inbox pass failed a message twice")),
            },
        }
    }
    let mask: Vec<bool> = failed.iter().map(Option::is_some).collect();
    let answers = careful_pass(&ctx, &items, &mask, &mut handler).await?;
    open.finish();
    Ok(merge(answers, failed))
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
struct PassContext<'a> {
    core: &'a Core,
    sql: &'a InboxSql,
    conn: &'a Conn,
    now: Timestamp,
    retention: Duration,
}

impl PassContext<'_> {
    fn db(&self, e: tokio_postgres::Error) -> Error {
        db_error(e, &self.core.sql.table)
    }

    fn run(&self, e: RunError) -> Error {
        match e {
            RunError::Db(e) => self.db(e),
            RunError::Store(e) => e,
        }
    }

    /// Ends the pass's transaction with `ROLLBACK`, then reports `abort`.
    async fn roll_back<R, E>(&self, abort: Abort<E>) -> Result<R, Abort<E>> {
        self.conn
            .client
            .batch_execute("ROLLBACK")
            .await
            .map_err(|e| self.db(e))?;
        Err(abort)
    }
}

/// What the batch's claim statement decided for one distinct key.
enum Decided {
    /// Claimed in this transaction.
    Claimed(Claim),
    /// Not claimable: `logic::begin`'s answer (Replay, Conflict, InFlight)
    /// and the row it was decided on.
    Answer(Begin, Record),
}

/// A distinct key of the batch for the claim statement, and its message.
struct Rep<'a> {
    key: &'a Key,
    fingerprint: &'a Fingerprint,
    lock: i64,
    /// The message whose claim this is (the key's first one that reaches
    /// the store in this pass).
    index: usize,
}

/// One pass without savepoints: every distinct key claimed in one
/// statement, the handlers run in input order on the transaction's client,
/// every DONE record written in one statement, one `COMMIT`. A message
/// that fails rolls the whole pass back (`Abort::Message`).
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
    // The claim statement takes the keys' locks in this order (see
    // inbox_sql.rs): by lock id, the same order in every batch.
    let mut order: Vec<(i64, &Key, usize)> = reps
        .iter()
        .enumerate()
        .map(|(i, rep)| (rep.lock, rep.key, i))
        .collect();
    order.sort_unstable();
    let order: Vec<usize> = order.into_iter().map(|(_, _, i)| i).collect();
    let sorted: Vec<&Rep<'_>> = order.iter().filter_map(|&i| reps.get(i)).collect();
    let decided = claim_all(ctx, &sorted).await?;
    // Per distinct key (indexed like `reps`), what the statement decided.
    let mut by_rep: Vec<Option<Decided>> = reps.iter().map(|_| None).collect();
    for (&i, d) in order.iter().zip(decided) {
        if let Some(slot) = by_rep.get_mut(i) {
            *slot = Some(d);
        }
    }

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
            Some(slot) if is_rep => match slot {
                Some(Decided::Claimed(claim)) => Begin::Claimed(claim.clone()),
                Some(Decided::Answer(answer, _)) => answer.clone(),
                None => return ctx.roll_back(Abort::Batch(undecided())).await,
            },
            // A later message of an id whose first one was answered
            // Conflict or InFlight: decided on the same row, as a
            // statement of its own would (and when that row would be
            // claimed for this fingerprint, by one: `BeginStep`).
            Some(Some(Decided::Answer(_, record))) => {
                let step = logic::begin(
                    Some(record.clone()),
                    item.fingerprint,
                    ctx.now,
                    DEFAULT_LEASE,
                    ctx.retention,
                    || Ok(0),
                )?;
                if step.write.is_none() {
                    step.answer
                } else {
                    let step = BeginStep {
                        key: item.key,
                        fingerprint: item.fingerprint,
                        now: ctx.now,
                        lease: DEFAULT_LEASE,
                        retention: ctx.retention,
                        lock: sql::key_lock(&core.sql.table, item.key),
                    };
                    step.run(conn, &core.counters)
                        .await
                        .map_err(|e| ctx.run(e))?
                }
            }
            _ => return ctx.roll_back(Abort::Batch(undecided())).await,
        };
        let claim = match begin {
            Begin::Claimed(claim) => claim,
            Begin::Replay(response) => {
                seen.insert(item.key, (item.fingerprint, Some(response.clone())));
                answers.push(Some(Ok(Delivery::Duplicate(response))));
                continue;
            }
            Begin::Conflict => {
                answers.push(Some(Ok(Delivery::Conflict)));
                continue;
            }
            Begin::InFlight { lease_until } => {
                answers.push(Some(Ok(Delivery::InFlight { lease_until })));
                continue;
            }
        };
        let Some(token) = row::token(claim.token) else {
            return ctx
                .roll_back(Abort::Message(index, Error::StaleClaim.into()))
                .await;
        };
        match run_handler(core, handler, conn, claim, item.payload).await {
            Ok(response) => {
                seen.insert(item.key, (item.fingerprint, Some(response.clone())));
                answers.push(Some(Ok(Delivery::Handled(response.clone()))));
                handled.push(Done {
                    index,
                    key: item.key,
                    token,
                    response,
                });
            }
            // Its claim and its writes, and its batch-mates' so far: all
            // undone. The next pass runs without it.
            Err(e) => return ctx.roll_back(Abort::Message(index, e)).await,
        }
    }
    if !handled.is_empty() {
        let written = complete_all(ctx, &handled).await?;
        // Each record is this transaction's own row, locked by it since its
        // claim: only a handler's own write through its client (a DELETE or
        // UPDATE of the store's table) can make it miss one.
        if let Some(index) = handled
            .iter()
            .map(|done| done.index)
            .find(|index| !written.contains(index))
        {
            return ctx
                .roll_back(Abort::Message(index, Error::StaleClaim.into()))
                .await;
        }
    }
    conn.client
        .batch_execute("COMMIT")
        .await
        .map_err(|e| ctx.db(e))?;
    Ok(answers)
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

fn undecided() -> Error {
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

/// `BEGIN`, then the claim statement for `reps` (sorted by lock), run again
/// for the keys a concurrent claim left undecided; one answer per key, in
/// `reps`' order. The first statement leaves with the `BEGIN`: one round
/// trip. (Should the `BEGIN` fail, the claim statement would run alone and
/// commit its claims with no handler run: the connection is then broken,
/// and the claims' leases run out as after a crash.)
async fn claim_all<E>(ctx: &PassContext<'_>, reps: &[&Rep<'_>]) -> Result<Vec<Decided>, Abort<E>> {
    let (conn, core) = (ctx.conn, ctx.core);
    let (at, lease_until, expires_at) = (
        row::millis(ctx.now),
        row::millis(ctx.now + DEFAULT_LEASE),
        row::millis(ctx.now + ctx.retention),
    );
    if reps.is_empty() {
        // Every message was answered from an earlier failure of its id.
        conn.client
            .batch_execute("BEGIN")
            .await
            .map_err(|e| ctx.db(e))?;
        return Ok(Vec::new());
    }
    let mut decided: Vec<Option<Decided>> = reps.iter().map(|_| None).collect();
    // Positions (in `reps`) of the keys still to decide.
    let mut pending: Vec<usize> = (0..reps.len()).collect();
    for attempt in 0..MAX_BEGIN_ATTEMPTS {
        if pending.is_empty() {
            break;
        }
        let batch: Vec<&Rep<'_>> = pending
            .iter()
            .filter_map(|&p| reps.get(p).copied())
            .collect();
        let scopes: Vec<&[u8]> = batch.iter().map(|r| r.key.scope()).collect();
        let ids: Vec<&[u8]> = batch.iter().map(|r| r.key.id()).collect();
        let fps: Vec<&[u8]> = batch
            .iter()
            .map(|r| &r.fingerprint.as_bytes()[..])
            .collect();
        let locks: Vec<i64> = batch.iter().map(|r| r.lock).collect();
        let params: [(&(dyn ToSql + Sync), Type); 7] = [
            (&scopes, Type::BYTEA_ARRAY),
            (&ids, Type::BYTEA_ARRAY),
            (&fps, Type::BYTEA_ARRAY),
            (&locks, Type::INT8_ARRAY),
            (&at, Type::INT8),
            (&lease_until, Type::INT8),
            (&expires_at, Type::INT8),
        ];
        let claim = conn.client.query_typed(&ctx.sql.claim, &params);
        let rows = if attempt == 0 {
            let (begun, rows) = pipelined(conn.client.batch_execute("BEGIN"), claim).await;
            begun.map_err(|e| ctx.db(e))?;
            rows
        } else {
            Counters::bump(&core.counters.snapshot_retries);
            claim.await
        }
        .map_err(|e| ctx.db(e))?;
        for found in &rows {
            let ord: i64 = found.try_get(0).map_err(|e| ctx.db(e))?;
            let claimed: bool = found.try_get(1).map_err(|e| ctx.db(e))?;
            let Some(&position) = usize::try_from(ord)
                .ok()
                .and_then(|o| o.checked_sub(1))
                .and_then(|o| pending.get(o))
            else {
                return Err(Error::backend(format!("the inbox claim returned row {ord}")).into());
            };
            let (Some(rep), Some(slot)) = (reps.get(position), decided.get_mut(position)) else {
                continue;
            };
            let record = row::record(rep.key, found, 2)?;
            if claimed {
                *slot = Some(Decided::Claimed(claim_of(&record)));
                continue;
            }
            let step = logic::begin(
                Some(record.clone()),
                rep.fingerprint,
                ctx.now,
                DEFAULT_LEASE,
                ctx.retention,
                || Ok(0),
            )?;
            // Claimable as read, yet not claimed: a claim committed after
            // the snapshot. Decided again below.
            if step.write.is_none() {
                *slot = Some(Decided::Answer(step.answer, record));
            }
        }
        // No row at all: the same (a claim committed after the snapshot,
        // whose statement this one waited for). This transaction now holds
        // these keys' locks; a new snapshot shows the committed rows.
        pending.retain(|&p| decided.get(p).is_some_and(Option::is_none));
    }
    if !pending.is_empty() {
        return Err(Error::backend(format!(
            "an inbox batch raced with concurrent writers {MAX_BEGIN_ATTEMPTS} times in a row"
        ))
        .into());
    }
    Ok(decided.into_iter().flatten().collect())
}

/// The claim for a record the statement just claimed: `logic::begin` gives
/// a fresh record attempt 1 and a takeover the previous attempts + 1.
fn claim_of(record: &Record) -> Claim {
    Claim::new(
        record.token,
        record.lease_until.unwrap_or(Timestamp::EPOCH),
        record.attempts > 1,
        record.attempts,
    )
}

/// A handled message of a pass, for the DONE statement.
struct Done<'a> {
    index: usize,
    key: &'a Key,
    token: i64,
    response: Response,
}

/// The DONE statement for every handled message: the indexes whose record
/// it wrote.
async fn complete_all<E>(
    ctx: &PassContext<'_>,
    handled: &[Done<'_>],
) -> Result<std::collections::HashSet<usize>, Abort<E>> {
    let mut scopes: Vec<&[u8]> = Vec::with_capacity(handled.len());
    let mut ids: Vec<&[u8]> = Vec::with_capacity(handled.len());
    let mut tokens: Vec<i64> = Vec::with_capacity(handled.len());
    let mut statuses: Vec<i32> = Vec::with_capacity(handled.len());
    let mut firsts: Vec<i32> = Vec::with_capacity(handled.len());
    let mut lasts: Vec<i32> = Vec::with_capacity(handled.len());
    let mut names: Vec<&[u8]> = Vec::new();
    let mut values: Vec<&[u8]> = Vec::new();
    let mut bodies: Vec<&[u8]> = Vec::with_capacity(handled.len());
    let too_many = || Error::invalid_argument("too many response headers in one inbox batch");
    for done in handled {
        scopes.push(done.key.scope());
        ids.push(done.key.id());
        tokens.push(done.token);
        let columns = row::response_columns(&done.response);
        statuses.push(columns.status);
        // 1-based, inclusive: an empty response's slice is [n + 1, n].
        firsts.push(i32::try_from(names.len() + 1).map_err(|_| too_many())?);
        names.extend(columns.names);
        values.extend(columns.values);
        lasts.push(i32::try_from(names.len()).map_err(|_| too_many())?);
        bodies.push(columns.body);
    }
    let (at, expires_at) = (row::millis(ctx.now), row::millis(ctx.now + ctx.retention));
    let params: [(&(dyn ToSql + Sync), Type); 11] = [
        (&scopes, Type::BYTEA_ARRAY),
        (&ids, Type::BYTEA_ARRAY),
        (&tokens, Type::INT8_ARRAY),
        (&statuses, Type::INT4_ARRAY),
        (&firsts, Type::INT4_ARRAY),
        (&lasts, Type::INT4_ARRAY),
        (&names, Type::BYTEA_ARRAY),
        (&values, Type::BYTEA_ARRAY),
        (&bodies, Type::BYTEA_ARRAY),
        (&at, Type::INT8),
        (&expires_at, Type::INT8),
    ];
    let rows = ctx
        .conn
        .client
        .query_typed(&ctx.sql.done, &params)
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
/// every key's lock in lock order (as the claim statement does), so the
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
    let params: [(&(dyn ToSql + Sync), Type); 1] = [(&locks, Type::INT8_ARRAY)];
    let (begun, locked) = pipelined(
        conn.client.batch_execute("BEGIN"),
        conn.client.query_typed(&ctx.sql.lock_all, &params),
    )
    .await;
    begun.map_err(db)?;
    locked.map_err(db)?;
    let mut seen: HashMap<&Key, (&Fingerprint, Option<Response>)> = HashMap::new();
    let mut answers = Vec::with_capacity(items.len());
    let times = (row::millis(ctx.now), row::millis(ctx.now + ctx.retention));
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
