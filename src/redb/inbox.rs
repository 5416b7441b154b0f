//! [`Inbox`]: the co-transactional inbox for at-least-once message consumers.
//!
//! A handler gets a redb write transaction of the inbox's own (a direct one,
//! under the commit lock), not a place in the store's commit groups: redb
//! cannot roll back part of a transaction, so inside a group a failed or
//! slow handler would take every other caller's request with it. A batch
//! deals with that alone (`Inbox::run`). [`RedbStore::atomic_step`] is the
//! same mechanism for one step of a guarded run.

use super::RedbStore;
use super::file::engine_error;
use super::health::On;
use super::tables::WriteTables;
use crate::codec;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::guard::{DEFAULT_LEASE, DEFAULT_RETENTION, Next};
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, State};
use crate::response::Response;
use crate::step::{self, Step};
use crate::store::Store;
use crate::time::{Clock, Timestamp};
use ::redb::{ReadTransaction, ReadableDatabase, WriteTransaction};
use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
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
            Some(Err(Failed::Error(e))) => Err(e),
            Some(Err(Failed::Panic(payload))) => std::panic::resume_unwind(payload),
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
            .map(|answer| answer.map_err(Failed::into_error))
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

/// One delivery for [`Inbox::handle_batch`]: the message's key, the digest
/// of its content, and what the handler needs (its payload).
///
/// ```
/// use idemstore::redb::Message;
/// use idemstore::{Fingerprint, Key};
///
/// let m = Message::new(Key::new("payments", "p-1")?, Fingerprint::of(b"alice+5"), ("alice", 5u64));
/// assert_eq!((m.key.id(), m.payload), (b"p-1".as_slice(), ("alice", 5)));
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message<T> {
    /// The message's key: its id names the delivery across redeliveries.
    pub key: Key,
    /// The digest of the message's content: the same id with another
    /// fingerprint is [`Delivery::Conflict`].
    pub fingerprint: Fingerprint,
    /// What the handler gets besides the transaction and the claim.
    pub payload: T,
}

impl<T> Message<T> {
    /// A delivery of `payload` under `key`, whose content digests to
    /// `fingerprint` (example: [`Message`]).
    pub fn new(key: Key, fingerprint: Fingerprint, payload: T) -> Message<T> {
        Message {
            key,
            fingerprint,
            payload,
        }
    }
}

/// How one message of a batch failed; none of its writes were committed.
enum Failed<E> {
    Error(E),
    Panic(Box<dyn Any + Send>),
}

impl<E: From<Error>> Failed<E> {
    /// A panic becomes [`Error::HandlerPanicked`].
    fn into_error(self) -> E {
        match self {
            Failed::Error(e) => e,
            Failed::Panic(payload) => Error::HandlerPanicked {
                message: crate::delivery::panic_message(payload.as_ref()),
            }
            .into(),
        }
    }
}

/// Why a pass stopped before its commit.
enum Abort<E> {
    /// The store failed: the whole batch fails with it.
    Store(Error),
    /// Message `index` failed: run the batch again without it.
    Message(usize, Failed<E>),
}

impl<E> From<Error> for Abort<E> {
    fn from(e: Error) -> Abort<E> {
        Abort::Store(e)
    }
}

/// One delivery as the engine sees it: the encoded key and the fingerprint.
type Item<'a> = (Vec<u8>, &'a Fingerprint);

type Answers<E> = Vec<Result<Delivery, Failed<E>>>;

impl Inbox {
    /// The one way the inbox writes: decides and handles `items` in order in
    /// one direct write transaction, committed once; an answer per item
    /// (`handler(i, txn, claim)` runs item `i`'s handler). redb cannot undo
    /// part of a transaction, so a failed message aborts the pass and the
    /// batch runs again without it (`f` failures: at most `f + 1` passes).
    /// Tokens a pass handed out are never handed out again, however it
    /// ended: a token a handler passed downstream names one message.
    /// `Handled` is answered only after the commit returned. The error is
    /// the store's: nothing of the batch was committed.
    fn run<E, F>(&self, items: &[Item<'_>], mut handler: F) -> Result<Answers<E>>
    where
        E: From<Error>,
        F: FnMut(usize, &WriteTransaction, &Claim) -> Result<Response, E>,
    {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        crate::delivery::check_batch_len(items.len())?;
        let now = self.clock.now();
        let shared = &self.store.shared;
        shared.db.check_healthy()?;
        if let Some(answers) = all_redelivered(&self.store, items, now) {
            return Ok(answers.into_iter().map(Ok).collect());
        }
        let mut failed: Vec<Option<Failed<E>>> = items.iter().map(|_| None).collect();
        let mut core = shared.log.lock();
        loop {
            let mut burned = 0;
            let io_errors = shared.db.witness.count();
            let pass = shared.direct_locked(&mut core, self.quick_repair, |tables, hwm| {
                self.one_pass(tables, hwm, &mut burned, items, &failed, now, &mut handler)
            });
            // Whatever ends the pass, a handler may have passed its token
            // downstream: no later claim gets it (a heal keeps this mark).
            core.token_hwm = core.token_hwm.max(burned);
            match pass {
                Ok(answers) => {
                    let answers = answers.into_iter().zip(failed).map(|(answer, failed)| {
                        match (answer, failed) {
                            (_, Some(failed)) => Err(failed),
                            (Some(answer), None) => answer.map_err(Failed::Error),
                            (None, None) => Err(Failed::Error(
                                Error::backend("an inbox pass skipped a delivery").into(),
                            )),
                        }
                    });
                    return Ok(answers.collect());
                }
                Err(Abort::Store(e)) => return Err(e),
                // The engine's storage failed in this pass (a handler grew
                // the file on a full disk): the failure is the store's, and
                // its kind is kept (the handler's error type may not carry
                // it). redb refuses the database now: poison and heal.
                Err(Abort::Message(..)) if shared.db.witness.count() != io_errors => {
                    let error = shared.db.witness.last().map_or_else(
                        || Error::backend("the storage engine failed an I/O"),
                        Error::Io,
                    );
                    return Err(shared.fail("inbox batch", On::Store, error));
                }
                Err(Abort::Message(index, failure)) => {
                    match failed.get_mut(index) {
                        Some(slot @ None) => *slot = Some(failure),
                        // A pass skips failed messages: stop rather than loop.
                        _ => return Err(Error::backend("an inbox pass failed a message twice")),
                    }
                }
            }
        }
    }

    /// One pass over the messages not failed yet: an answer per item
    /// (`None` for a failed one), to commit, or why it aborts.
    #[allow(
        clippy::too_many_arguments,
        reason = "one private step of `run`, which owns every argument"
    )]
    fn one_pass<E, F>(
        &self,
        tables: &mut WriteTables<'_>,
        hwm: &mut u64,
        burned: &mut u64,
        items: &[Item<'_>],
        failed: &[Option<Failed<E>>],
        now: Timestamp,
        handler: &mut F,
    ) -> std::result::Result<Vec<Option<Result<Delivery, E>>>, Abort<E>>
    where
        E: From<Error>,
        F: FnMut(usize, &WriteTransaction, &Claim) -> Result<Response, E>,
    {
        let retention = self.retention;
        let txn = tables.txn;
        let mut answers = Vec::with_capacity(items.len());
        for (index, ((key, fingerprint), failed)) in items.iter().zip(failed).enumerate() {
            if failed.is_some() {
                answers.push(None);
                continue;
            }
            // A message that cannot be decided (its record does not decode,
            // tokens ran out) fails alone, having written nothing.
            let last = *hwm;
            let next = || {
                last.checked_add(1)
                    .ok_or_else(|| Error::invalid_argument("fencing tokens exhausted"))
            };
            let decided = tables.read(key).and_then(|existing| {
                logic::begin(existing, fingerprint, now, DEFAULT_LEASE, retention, next)
            });
            let answer = match decided.map(|d| (d.answer, d.write)) {
                Err(e) => Err(e.into()),
                Ok((Begin::Replay(response), _)) => Ok(Delivery::Duplicate(response)),
                Ok((Begin::Conflict, _)) => Ok(Delivery::Conflict),
                Ok((Begin::InFlight { lease_until }, _)) => Ok(Delivery::InFlight { lease_until }),
                Ok((Begin::Claimed(_), None)) => {
                    return Err(Abort::Store(Error::backend(
                        "a claim without a record to write",
                    )));
                }
                Ok((Begin::Claimed(claim), Some(processing))) => {
                    *hwm = (*hwm).max(claim.token);
                    *burned = (*burned).max(claim.token);
                    // The PROCESSING record is never written: the DONE
                    // record replaces it in this transaction.
                    let failed = |e| Err(Abort::Message(index, e));
                    let response =
                        match catch_unwind(AssertUnwindSafe(|| handler(index, txn, &claim))) {
                            Ok(Ok(response)) => response,
                            Ok(Err(e)) => return failed(Failed::Error(e)),
                            Err(panic) => return failed(Failed::Panic(panic)),
                        };
                    let stored = logic::check_response(&response, self.store.max_body_bytes)
                        .and_then(|()| {
                            logic::complete(Some(processing), &claim, &response, now, retention)
                        })
                        .and_then(|done| tables.put(key, &done));
                    if let Err(e) = stored {
                        return failed(Failed::Error(e.into()));
                    }
                    Ok(Delivery::Handled(response))
                }
            };
            answers.push(Some(answer));
        }
        Ok(answers)
    }
}

/// The answers when every item is a redelivery of a handled message (read
/// without a write transaction); `None` as soon as one needs one.
fn all_redelivered(store: &RedbStore, items: &[Item<'_>], now: Timestamp) -> Option<Vec<Delivery>> {
    let mut answers = Vec::with_capacity(items.len());
    for (key, fingerprint) in items {
        let record = logic::visible(store.shared.read(key).ok()?, now)?;
        if record.state != State::Done {
            return None;
        }
        answers.push(if record.fingerprint == **fingerprint {
            Delivery::Duplicate(record.response.unwrap_or_default())
        } else {
            Delivery::Conflict
        });
    }
    Some(answers)
}
