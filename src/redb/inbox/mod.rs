//! [`Inbox`]: the co-transactional inbox for at-least-once message consumers.
//!
//! A consumer's handler gets the store's own redb write transaction, so its
//! writes to its own tables and the DONE record for the message id commit
//! together or not at all. [`Inbox::handle`] takes one delivery (one
//! durable commit); [`Inbox::handle_batch`] takes a batch of them (one
//! durable commit for the whole batch): the way to consume a stream.
//!
//! ## Why a direct write transaction, not a commit group
//!
//! The handlers run in a write transaction of the inbox's own on the
//! store's `Database`, on the caller's thread; they do not join the store's
//! commit groups. Inside a group a failed handler could not be undone alone
//! (redb cannot roll back part of a transaction: a savepoint needs a clean
//! one), so it would take every other caller's request in the group down
//! with it, and a slow handler would hold every caller's answer. In an
//! inbox batch the same problem is the batch's own: a failed or panicking
//! handler aborts the pass, and the batch runs again without that message
//! (`batch.rs`). That is why a handler may run more than once per delivery
//! and must write only through the transaction it is given.
//!
//! The transaction is a direct one (`Shared::direct`): it holds the commit
//! lock, so no group commits while handlers run; it first takes in what the
//! memtable holds (so every message is decided on the latest state), and
//! its commit retires the write-ahead log. One handled message is one
//! durable commit: the rate of one claim per transaction, whatever
//! the number of consumer threads; a batch of 100 shares one
//! (`docs/performance.md`). Redeliveries of messages that are already DONE
//! are answered from the memtable or a read transaction and cost no write
//! when the whole batch is such redeliveries.
//!
//! Tokens come from the same in-memory high-water mark the leaders use
//! (under the commit lock), so they stay unique and increasing across both
//! paths.

mod batch;

pub use batch::{MAX_INBOX_BATCH, Message};

use super::RedbStore;
use super::errors::engine_error;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::guard::DEFAULT_RETENTION;
use crate::key::Key;
use crate::record::Claim;
use crate::response::Response;
use crate::store::Store;
use crate::time::Clock;
use ::redb::{ReadTransaction, ReadableDatabase, WriteTransaction};
use std::sync::Arc;
use std::time::Duration;

pub use crate::delivery::Delivery;

/// A transactional inbox on a [`RedbStore`]: exactly-once effects for an
/// at-least-once message consumer whose state lives in the same file.
///
/// [`handle`](Inbox::handle) runs the handler inside a redb write transaction
/// together with the dedup record of the message id: a redelivered message
/// is skipped (its stored result returned), and a crash, error or panic
/// before the commit leaves neither the handler's writes nor the record.
/// [`handle_batch`](Inbox::handle_batch) does the same for a batch of
/// deliveries in one commit, the way to consume a stream.
/// Only the handler's writes through the transaction it is given are covered;
/// effects outside the file (an HTTP call, another database) still need the
/// fencing token ([`Claim::token`]) as their own idempotency key.
///
/// The handler must not call the same store (its `Store` methods, a `Guard`
/// or another inbox on it) while it runs: those writes wait for this
/// transaction, which waits for the handler. It should be short — the store's
/// other writes wait for it (see the module notes on throughput).
///
/// ```
/// use idemstore::redb::engine::{ReadableTable, TableDefinition};
/// use idemstore::{Fingerprint, Key, RedbStore, Response};
/// use idemstore::redb::{Delivery, Inbox};
///
/// const BALANCES: TableDefinition<&str, u64> = TableDefinition::new("app.balances");
///
/// # let dir = tempfile::tempdir()?;
/// let inbox = Inbox::new(RedbStore::open(dir.path().join("consumer.idem"))?);
/// let deposit = |msg_id: &str, amount: u64| -> Result<Delivery, idemstore::BoxError> {
///     let key = Key::new("payments-queue", msg_id)?;
///     inbox.handle(&key, &Fingerprint::of(&amount.to_be_bytes()), |txn, _claim| {
///         let mut balances = txn.open_table(BALANCES)?;
///         let old = balances.get("alice")?.map(|v| v.value()).unwrap_or(0);
///         balances.insert("alice", old + amount)?;
///         Ok(Response::new(200, format!("balance {}", old + amount)))
///     })
/// };
/// assert_eq!(deposit("m-1", 5)?, Delivery::Handled(Response::new(200, "balance 5")));
/// // The queue redelivers m-1: skipped, the first result comes back.
/// assert_eq!(deposit("m-1", 5)?, Delivery::Duplicate(Response::new(200, "balance 5")));
/// assert_eq!(deposit("m-2", 3)?, Delivery::Handled(Response::new(200, "balance 8")));
/// # Ok::<(), idemstore::BoxError>(())
/// ```
#[derive(Clone, Debug)]
pub struct Inbox {
    store: Arc<RedbStore>,
    clock: Arc<dyn Clock>,
    retention: Duration,
    quick_repair: bool,
}

impl Inbox {
    /// An inbox on `store` (a `RedbStore` or an `Arc` of one), with the
    /// store's clock ([`Store::clock`]) and [`DEFAULT_RETENTION`]:
    /// redeliveries are recognised for 24 hours after a message was handled.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let store = std::sync::Arc::new(idemstore::RedbStore::open(dir.path().join("s.idem"))?);
    /// let inbox = idemstore::redb::Inbox::new(std::sync::Arc::clone(&store));
    /// assert!(std::sync::Arc::ptr_eq(inbox.store(), &store));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn new(store: impl Into<Arc<RedbStore>>) -> Inbox {
        let store = store.into();
        Inbox {
            clock: store.clock(),
            store,
            retention: DEFAULT_RETENTION,
            quick_repair: true,
        }
    }

    /// How long a handled message id is remembered; must cover the queue's
    /// longest redelivery horizon.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let inbox = idemstore::redb::Inbox::new(idemstore::RedbStore::open(dir.path().join("s.idem"))?)
    ///     .retention(std::time::Duration::from_secs(7 * 24 * 3600));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn retention(mut self, retention: Duration) -> Inbox {
        self.retention = retention;
        self
    }

    /// The clock for record timestamps and expiry (default: the store's,
    /// [`Store::clock`]). Only for an inbox that must see another time than
    /// its store's recovery and sweeper; a test that drives time builds the
    /// store with its `ManualClock` instead.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let inbox = idemstore::redb::Inbox::new(idemstore::RedbStore::open(dir.path().join("s.idem"))?)
    ///     .clock(idemstore::SystemClock);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn clock(mut self, clock: impl Clock + 'static) -> Inbox {
        self.clock = Arc::new(clock);
        self
    }

    /// Whether the inbox's commits save redb's allocator state (redb's
    /// quick-repair; on by default, as every other commit of the store).
    ///
    /// On, a commit is redb's two-phase commit (two fsyncs) and an open
    /// after a crash is quick. Off, a commit is redb's one-phase commit with
    /// checksums: one fsync, as durable (an acknowledged batch survives a
    /// power loss either way), and about twice the batches per second on a
    /// disk whose fsync is slow (`docs/performance.md`); but an open after a
    /// crash that follows such a commit walks the whole file to rebuild the
    /// allocator state (redb's full repair), which takes longer the larger
    /// the file. Switch it off for a consumer whose store is small (a short
    /// retention) and whose throughput matters more than its restart time.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let inbox = idemstore::redb::Inbox::new(idemstore::RedbStore::open(dir.path().join("s.idem"))?)
    ///     .quick_repair(false);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn quick_repair(mut self, on: bool) -> Inbox {
        self.quick_repair = on;
        self
    }

    /// The store this inbox writes to.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let inbox = idemstore::redb::Inbox::new(idemstore::RedbStore::open(dir.path().join("s.idem"))?);
    /// assert!(!inbox.store().is_poisoned());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn store(&self) -> &Arc<RedbStore> {
        &self.store
    }

    /// Handles one delivery of the message `key` (e.g. scope = queue name,
    /// id = message id) whose payload digests to `fingerprint`.
    ///
    /// If the id is new (or its record expired), `handler` runs with the
    /// write transaction and the claim (whose token is larger than any
    /// handed out before); when it returns `Ok(response)`, its writes, the
    /// DONE record holding `response` and the token high-water mark commit
    /// in one durable transaction ([`Delivery::Handled`]). If the id was
    /// handled before, the handler does not run ([`Delivery::Duplicate`]).
    ///
    /// Errors: the handler's own error (nothing is written: the transaction
    /// is dropped, and so is everything on a panic), or the store's
    /// ([`Error::Poisoned`], [`Error::ResponseTooLarge`], [`Error::Corrupt`],
    /// [`Error::Backend`]) converted into `E`. A failed commit poisons the
    /// store, as a failed group commit does. A handler's panic reaches the
    /// caller and does not poison the store. It is a batch of one
    /// ([`handle_batch`](Inbox::handle_batch)) that never runs twice; to
    /// consume a stream, batch: one commit per batch instead of per message.
    ///
    /// ```
    /// use idemstore::{Fingerprint, Key, RedbStore, Response};
    /// use idemstore::redb::{Delivery, Inbox};
    /// # let dir = tempfile::tempdir()?;
    /// let inbox = Inbox::new(RedbStore::open(dir.path().join("s.idem"))?);
    /// let key = Key::new("orders-queue", "msg-7")?;
    /// let failed: Result<Delivery, idemstore::Error> = inbox.handle(&key, &Fingerprint::of(b"m"), |_txn, _claim| {
    ///     Err(idemstore::Error::backend("downstream said no"))
    /// });
    /// assert!(failed.is_err());
    /// // Nothing was recorded: the redelivery runs the handler again.
    /// let again = inbox.handle(&key, &Fingerprint::of(b"m"), |_txn, _claim| Ok::<_, idemstore::Error>(Response::new(200, "ok")))?;
    /// assert_eq!(again, Delivery::Handled(Response::new(200, "ok")));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn handle<E, F>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        handler: F,
    ) -> Result<Delivery, E>
    where
        E: From<Error>,
        F: FnOnce(&WriteTransaction, &Claim) -> Result<Response, E>,
    {
        let mut handler = Some(handler);
        let items = [batch::item(key, fingerprint)];
        let mut answers = self.run(&items, |_, txn, claim| match handler.take() {
            Some(handler) => handler(txn, claim),
            // A batch of one never re-runs: a failure ends it.
            None => Err(Error::backend("the inbox ran a one-message handler twice").into()),
        })?;
        match answers.pop() {
            Some(Ok(delivery)) => Ok(delivery),
            Some(Err(batch::Failed::Error(e))) => Err(e),
            // As before batches: a handler's panic reaches the caller (its
            // writes were dropped with the transaction).
            Some(Err(batch::Failed::Panic(payload))) => std::panic::resume_unwind(payload),
            None => Err(Error::backend("the inbox answered no delivery").into()),
        }
    }

    /// Handles a batch of deliveries in one durable transaction: one commit
    /// for the batch (redb's durable commit: two fsyncs with quick-repair,
    /// one without, [`quick_repair`](Inbox::quick_repair)), an answer per
    /// delivery, in order.
    ///
    /// Each delivery is decided in order against the latest state, the
    /// batch's own earlier messages included, as [`handle`](Inbox::handle)
    /// decides one: a new message id runs `handler(txn, claim, message)`
    /// and answers [`Delivery::Handled`]; a handled one (before this batch,
    /// or earlier in it: the same id twice is handled once)
    /// [`Delivery::Duplicate`] with the stored result; the same id with
    /// another fingerprint [`Delivery::Conflict`]; an id claimed through the
    /// [`Store`](crate::Store) API [`Delivery::InFlight`]. An empty batch is
    /// `Ok(vec![])` and commits nothing.
    ///
    /// **A failing message takes nothing with it.** When a handler returns
    /// `Err`, panics, or returns a result over the store's limits, the
    /// transaction is aborted and the batch runs again without that message,
    /// whose answer is the error (a panic is [`Error::HandlerPanicked`]
    /// converted into `E`, and does not poison the store). None of its
    /// writes are stored; its batch-mates' are. So **a handler may run more
    /// than once for one delivery** (once per pass, each time with a new
    /// claim): its only effects must be its writes through `txn`, and it
    /// must be callable again (`FnMut`). A batch with `f` failing messages
    /// runs at most `f + 1` passes.
    ///
    /// The outer error is the store's, for the whole batch: nothing of it
    /// was committed ([`Error::Poisoned`], a storage error, or more than
    /// [`MAX_INBOX_BATCH`] deliveries: [`Error::InvalidArgument`]); a failed
    /// commit poisons the store, as a failed group commit does. Acknowledge a
    /// message to its queue only after this returned its answer.
    ///
    /// ```
    /// use idemstore::redb::engine::{ReadableTable, TableDefinition};
    /// use idemstore::redb::{Delivery, Inbox, Message};
    /// use idemstore::{BoxError, Fingerprint, Key, RedbStore, Response};
    ///
    /// const BALANCES: TableDefinition<&str, u64> = TableDefinition::new("app.balances");
    /// # let dir = tempfile::tempdir()?;
    /// let inbox = Inbox::new(RedbStore::open(dir.path().join("s.idem"))?);
    /// let payment = |id: &str, amount: u64| -> Result<Message<u64>, idemstore::Error> {
    ///     Ok(Message::new(Key::new("payments", id)?, Fingerprint::of(&amount.to_be_bytes()), amount))
    /// };
    /// // p-2 is delivered twice in the batch; p-3's handler fails.
    /// let batch = [payment("p-1", 5)?, payment("p-2", 7)?, payment("p-2", 7)?, payment("p-3", 0)?];
    /// let answers = inbox.handle_batch(&batch, |txn, _claim, msg| -> Result<Response, BoxError> {
    ///     if msg.payload == 0 {
    ///         return Err("an empty payment".into());
    ///     }
    ///     let mut balances = txn.open_table(BALANCES)?;
    ///     let new = balances.get("alice")?.map_or(0, |v| v.value()) + msg.payload;
    ///     balances.insert("alice", new)?;
    ///     Ok(Response::new(200, new.to_string()))
    /// })?;
    /// assert!(matches!(&answers[0], Ok(Delivery::Handled(r)) if r.body() == b"5"));
    /// assert!(matches!(&answers[1], Ok(Delivery::Handled(r)) if r.body() == b"12"));
    /// assert!(matches!(&answers[2], Ok(Delivery::Duplicate(r)) if r.body() == b"12"));
    /// assert!(answers[3].is_err());
    /// assert_eq!(inbox.store().stats().durable_commits, 1); // one commit for the batch
    /// # Ok::<(), BoxError>(())
    /// ```
    pub fn handle_batch<T, E, F>(
        &self,
        batch: &[Message<T>],
        mut handler: F,
    ) -> Result<Vec<Result<Delivery, E>>>
    where
        E: From<Error>,
        F: FnMut(&WriteTransaction, &Claim, &Message<T>) -> Result<Response, E>,
    {
        let items: Vec<batch::Item<'_>> = batch
            .iter()
            .map(|m| batch::item(&m.key, &m.fingerprint))
            .collect();
        let answers = self.run(&items, |index, txn, claim| match batch.get(index) {
            Some(message) => handler(txn, claim, message),
            None => Err(Error::backend("an inbox batch index out of range").into()),
        })?;
        Ok(answers
            .into_iter()
            .map(|answer| answer.map_err(batch::Failed::into_error))
            .collect())
    }

    /// The engine under both entries, on this inbox's clock and retention.
    fn run<E, F>(
        &self,
        items: &[batch::Item<'_>],
        handler: F,
    ) -> Result<Vec<Result<Delivery, batch::Failed<E>>>>
    where
        E: From<Error>,
        F: FnMut(usize, &WriteTransaction, &Claim) -> Result<Response, E>,
    {
        let settings = batch::Settings {
            now: self.clock.now(),
            retention: self.retention,
            quick_repair: self.quick_repair,
        };
        batch::run(&self.store, items, &settings, handler)
    }
}

impl Inbox {
    /// Runs `f` on a read transaction of the store's file, for reading the
    /// consumer's own tables (what its handlers committed) outside a handler.
    ///
    /// ```
    /// use idemstore::redb::engine::{ReadableTableMetadata, TableDefinition};
    /// use idemstore::{Fingerprint, Key, RedbStore, Response};
    /// use idemstore::redb::Inbox;
    ///
    /// const SEEN: TableDefinition<&str, u64> = TableDefinition::new("app.seen");
    /// # let dir = tempfile::tempdir()?;
    /// let inbox = Inbox::new(RedbStore::open(dir.path().join("s.idem"))?);
    /// inbox.handle(&Key::new("q", "m-1")?, &Fingerprint::of(b"m-1"), |txn, claim| {
    ///     txn.open_table(SEEN)?.insert("m-1", claim.token())?;
    ///     Ok::<_, idemstore::BoxError>(Response::new(200, ""))
    /// })?;
    /// let seen = inbox.read(|txn| Ok::<_, idemstore::BoxError>(txn.open_table(SEEN)?.len()?))?;
    /// assert_eq!(seen, 1);
    /// # Ok::<(), idemstore::BoxError>(())
    /// ```
    pub fn read<T, E, F>(&self, f: F) -> Result<T, E>
    where
        E: From<Error>,
        F: FnOnce(&ReadTransaction) -> Result<T, E>,
    {
        let db = self.store.shared.db.read_db()?;
        let txn = db.begin_read().map_err(engine_error)?;
        f(&txn)
    }
}
