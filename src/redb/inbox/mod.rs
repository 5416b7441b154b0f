//! [`Inbox`]: the co-transactional inbox for at-least-once message consumers.
//!
//! A handler gets a redb write transaction of the inbox's own (a direct one,
//! under the commit lock), not a place in the store's commit groups: redb
//! cannot roll back part of a transaction, so inside a group a failed or
//! slow handler would take every other caller's request with it. A batch
//! deals with that alone (`batch.rs`). [`RedbStore::atomic_step`] is the
//! same mechanism for one step of a guarded run.

mod batch;

pub use batch::Message;

use super::RedbStore;
use super::file::engine_error;
use crate::codec;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::guard::{DEFAULT_RETENTION, Next};
use crate::key::Key;
use crate::logic;
use crate::record::Claim;
use crate::response::Response;
use crate::step::{self, Step};
use crate::store::Store;
use crate::time::Clock;
use ::redb::{ReadTransaction, ReadableDatabase, WriteTransaction};
use std::sync::Arc;
use std::time::Duration;

pub use crate::delivery::Delivery;

/// A transactional inbox on a [`RedbStore`]: a handler's writes to its own
/// tables and the message id's DONE record commit together or not at all,
/// so a redelivered message is skipped (its stored result returned).
/// Effects outside the file still need the fencing token ([`Claim::token`])
/// as their idempotency key.
///
/// A handler must not call the same store while it runs (those writes wait
/// for its transaction), and should be short: the store's other writes
/// wait for it.
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
    /// An inbox on `store`, with the store's clock ([`Store::clock`]) and
    /// [`DEFAULT_RETENTION`]; the example sets every option.
    ///
    /// ```
    /// use std::sync::Arc;
    /// # let dir = tempfile::tempdir()?;
    /// let store = Arc::new(idemstore::RedbStore::open(dir.path().join("s.idem"))?);
    /// let inbox = idemstore::redb::Inbox::new(Arc::clone(&store))
    ///     .retention(std::time::Duration::from_secs(7 * 24 * 3600))
    ///     .clock(idemstore::SystemClock)
    ///     .quick_repair(false);
    /// assert!(Arc::ptr_eq(inbox.store(), &store) && !inbox.store().is_poisoned());
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
    /// longest redelivery horizon (example: [`Inbox::new`]).
    pub fn retention(mut self, retention: Duration) -> Inbox {
        self.retention = retention;
        self
    }

    /// The clock for record timestamps and expiry (default: the store's;
    /// example: [`Inbox::new`]).
    pub fn clock(mut self, clock: impl Clock + 'static) -> Inbox {
        self.clock = Arc::new(clock);
        self
    }

    /// redb's quick-repair on the inbox's commits (on by default). Off, a
    /// commit takes one fsync instead of two and is as durable, but an open
    /// after a crash walks the whole file: for a small store whose
    /// throughput matters more than its restart time (example: [`Inbox::new`]).
    pub fn quick_repair(mut self, on: bool) -> Inbox {
        self.quick_repair = on;
        self
    }

    /// The store this inbox writes to (example: [`Inbox::new`]).
    pub fn store(&self) -> &Arc<RedbStore> {
        &self.store
    }

    /// Handles one delivery of the message `key` whose payload digests to
    /// `fingerprint`: a batch of one ([`handle_batch`](Inbox::handle_batch))
    /// whose handler never runs twice. Errors: the handler's (nothing is
    /// written), or the store's converted into `E`; a handler's panic
    /// reaches the caller and does not poison the store.
    ///
    /// ```
    /// use idemstore::{Error, Fingerprint, Key, RedbStore, Response};
    /// # let dir = tempfile::tempdir()?;
    /// let inbox = idemstore::redb::Inbox::new(RedbStore::open(dir.path().join("s.idem"))?);
    /// let (key, fp) = (Key::new("orders-queue", "msg-7")?, Fingerprint::of(b"m"));
    /// let failed = inbox.handle(&key, &fp, |_txn, _claim| Err(Error::backend("downstream said no")));
    /// // Nothing was recorded: the redelivery runs the handler again.
    /// let again = inbox.handle(&key, &fp, |_txn, _claim| Ok::<_, Error>(Response::new(200, "ok")))?;
    /// assert!(failed.is_err() && again == idemstore::redb::Delivery::Handled(Response::new(200, "ok")));
    /// # Ok::<(), Error>(())
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
        let items = [(codec::encode_key(key), fingerprint)];
        let mut answers = self.run(&items, |_, txn, claim| match handler.take() {
            Some(handler) => handler(txn, claim),
            // A batch of one never re-runs: a failure ends it.
            None => Err(Error::backend("the inbox ran a one-message handler twice").into()),
        })?;
        match answers.pop() {
            Some(Ok(delivery)) => Ok(delivery),
            Some(Err(batch::Failed::Error(e))) => Err(e),
            Some(Err(batch::Failed::Panic(payload))) => std::panic::resume_unwind(payload),
            None => Err(Error::backend("the inbox answered no delivery").into()),
        }
    }

    /// Handles a batch of deliveries in one durable commit, an answer per
    /// delivery, in order, each decided against the latest state, the
    /// batch's earlier messages included (the same id twice is handled
    /// once). An empty batch commits nothing.
    ///
    /// **A failing message takes nothing with it**: when a handler returns
    /// `Err`, panics ([`Error::HandlerPanicked`]) or returns a result over
    /// the limits, the batch runs again without that message, whose answer
    /// is the error. So **a handler may run more than once per delivery**:
    /// its only effects must be its writes through `txn`. The outer error is
    /// the store's (nothing committed; more than
    /// [`MAX_INBOX_BATCH`](crate::limits::MAX_INBOX_BATCH) is
    /// [`Error::InvalidArgument`]); a failed commit poisons the store.
    /// Acknowledge a message only after its answer.
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
        let items: Vec<_> = batch
            .iter()
            .map(|m| (codec::encode_key(&m.key), &m.fingerprint))
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

    /// Runs `f` on a read transaction of the store's file (the consumer's
    /// own tables, outside a handler).
    ///
    /// ```
    /// use idemstore::redb::engine::{ReadableTableMetadata, TableDefinition};
    /// const SEEN: TableDefinition<&str, u64> = TableDefinition::new("app.seen");
    /// fn seen(inbox: &idemstore::redb::Inbox) -> Result<u64, idemstore::BoxError> {
    ///     inbox.read(|txn| Ok(txn.open_table(SEEN)?.len()?))
    /// }
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

impl RedbStore {
    /// Runs the step `name` of `claim`'s run as an atomic phase: `f`'s
    /// writes through the transaction it is given and the step's record
    /// commit in one durable redb transaction, so a crash leaves both or
    /// neither and a retry never applies them twice; a step an earlier
    /// attempt recorded ([`Claim::steps`]) returns its output without
    /// calling `f`. `f` gets the step key ([`Key::step_key`]) and returns the
    /// step's output; an `Err` from `f` (or a panic) aborts the transaction,
    /// as does a claim that no longer owns `key` (taken over, released,
    /// expired: [`Error::StaleClaim`]). The limits and the one-name-per-run
    /// rule are [`Claim::step`]'s; a claim from [`Store::begin`] (no guard)
    /// may be used too.
    ///
    /// Like the [`Inbox`], it commits under the store's commit
    /// lock: `f` must not call this store, and should be short. It blocks:
    /// from async code, call it on a blocking thread.
    ///
    /// ```
    /// use idemstore::redb::engine::{ReadableTable, TableDefinition};
    /// use idemstore::{BoxError, Fingerprint, Guard, Key, RedbStore, Response};
    /// use std::sync::Arc;
    ///
    /// const STOCK: TableDefinition<&str, u64> = TableDefinition::new("shop.stock");
    ///
    /// # let dir = tempfile::tempdir()?;
    /// let store = Arc::new(RedbStore::open(dir.path().join("shop.idem"))?);
    /// let guard = Guard::new(Arc::clone(&store));
    /// let key = Key::new("orders", "o-1")?;
    /// guard.run(&key, &Fingerprint::of(b"apple x2"), |claim| {
    ///     let left = store.atomic_step(&key, claim, "reserve", |txn, _| -> Result<_, BoxError> {
    ///         let mut stock = txn.open_table(STOCK)?;
    ///         let left = stock.get("apple")?.map_or(10, |v| v.value()) - 2;
    ///         stock.insert("apple", left)?;
    ///         Ok(left.to_string().into_bytes())
    ///     })?;
    ///     Ok::<_, BoxError>(Response::new(201, left))
    /// });
    /// # Ok::<(), BoxError>(())
    /// ```
    pub fn atomic_step<E: From<Error>>(
        &self,
        key: &Key,
        claim: &Claim,
        name: &str,
        f: impl FnOnce(&WriteTransaction, &str) -> std::result::Result<Vec<u8>, E>,
    ) -> std::result::Result<Vec<u8>, E> {
        if claim.run.is_some() {
            if let Next::Replay(output) = claim.next_step(name)? {
                return Ok(output);
            }
        } else {
            step::check_name(name)?;
            if let Some(recorded) = claim.steps.iter().find(|s| s.name == name) {
                return Ok(recorded.output.clone());
            }
        }
        let key_bytes = codec::encode_key(key);
        let step_key = key.step_key(name);
        let now = self.clock().now();
        let output = self.shared.direct(|tables, _| {
            let output = f(tables.txn, &step_key)?;
            let step = Step::new(name, output)?;
            let existing = tables.read(&key_bytes)?;
            if let Some(record) = logic::record_step(existing, claim, &step, now)? {
                tables.put(&key_bytes, &record)?;
            }
            Ok::<_, E>(step.output)
        })?;
        crate::observability::step(false);
        Ok(output)
    }
}
