//! [`Inbox`]: the co-transactional inbox for at-least-once message consumers.
//!
//! A consumer's handler gets the store's own redb write transaction, so its
//! writes to its own tables and the DONE record for the message id commit
//! together (one transaction, one fsync) or not at all.
//!
//! ## Why its own write transaction, not a commit group
//!
//! The handler runs in a write transaction of its own on the store's
//! `Database`, on the caller's thread; it does not join a commit group. A handler inside the batch transaction could not be undone
//! alone: redb cannot roll back part of a transaction (a savepoint needs a
//! clean one), so a handler that failed or panicked after writing business
//! rows would take every other caller's request in the batch down with it,
//! and a slow handler would hold every caller's answer. Its own transaction
//! makes a failure cost exactly that message, and the handler may borrow
//! from the caller (no `'static`, no `Send`).
//!
//! The transaction is a direct one (`Shared::direct`): it holds the commit
//! lock, so no group commits while a handler runs; it first takes in what
//! the memtable holds (so the message's record is decided on the latest
//! state), and its commit retires the write-ahead log. Every message is one
//! commit and one fsync of its own: the rate of one claim per transaction,
//! not the grouped rate, whatever the number of consumer threads
//! (`benches/inbox.rs`). A redelivered message that is already DONE is
//! answered from the memtable or a read transaction and costs no write.
//!
//! Tokens come from the same in-memory high-water mark the leaders use
//! (under the commit lock), so they stay unique and increasing across both
//! paths.

use super::RedbStore;
use super::errors::engine;
use super::tables::{Source, WriteTables};
use crate::codec;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::guard::{DEFAULT_LEASE, DEFAULT_RETENTION};
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, State};
use crate::response::Response;
use crate::store::Store;
use crate::time::{Clock, Timestamp};
use ::redb::{ReadTransaction, ReadableDatabase, WriteTransaction};
use std::sync::Arc;
use std::time::Duration;

/// What [`Inbox::handle`] did with one delivery of a message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivery {
    /// First delivery: the handler ran and its writes committed together
    /// with the DONE record; this is the result it returned.
    Handled(Response),
    /// A redelivery: the handler did not run; this is the result stored by
    /// the delivery that was handled.
    Duplicate(Response),
    /// The message id was already used by a message with a different
    /// fingerprint: the handler did not run and nothing was written.
    Conflict,
    /// The id is claimed through the [`Store`](crate::Store) API by an owner
    /// whose lease is still live (not something the inbox itself leaves
    /// behind): the handler did not run; redeliver later.
    InFlight {
        /// When the owner's lease ends.
        lease_until: Timestamp,
    },
}

impl Delivery {
    /// The handler's result, fresh or stored; `None` for `Conflict` and `InFlight`.
    ///
    /// ```
    /// use idemstore::Response;
    /// use idemstore::redb::Delivery;
    /// assert_eq!(Delivery::Duplicate(Response::new(200, "ok")).response(), Some(&Response::new(200, "ok")));
    /// assert_eq!(Delivery::Conflict.response(), None);
    /// ```
    pub fn response(&self) -> Option<&Response> {
        match self {
            Delivery::Handled(r) | Delivery::Duplicate(r) => Some(r),
            Delivery::Conflict | Delivery::InFlight { .. } => None,
        }
    }
}

/// A transactional inbox on a [`RedbStore`]: exactly-once effects for an
/// at-least-once message consumer whose state lives in the same file.
///
/// [`handle`](Inbox::handle) runs the handler inside a redb write transaction
/// together with the dedup record of the message id: a redelivered message
/// is skipped (its stored result returned), and a crash, error or panic
/// before the commit leaves neither the handler's writes nor the record.
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
    /// store, as a failed group commit does.
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
        let store = &*self.store;
        if store.is_poisoned() {
            return Err(Error::Poisoned.into());
        }
        let now = self.clock.now();
        let key_bytes = codec::encode_key(key);
        // Redeliveries of handled messages are the common case under
        // at-least-once: answer them without taking the write transaction.
        if let Some(record) = logic::visible(store.shared.read(&key_bytes)?, now)
            && record.state == State::Done
        {
            return Ok(if record.fingerprint == *fingerprint {
                Delivery::Duplicate(record.response.unwrap_or_default())
            } else {
                Delivery::Conflict
            });
        }

        // One durable transaction, under the commit lock: it takes in what
        // the memtable holds, so it decides on the latest state (the same
        // message on another consumer thread may have been handled since
        // the read above), and it retires the log.
        let retention = self.retention;
        let max_body_bytes = store.max_body_bytes;
        let decided = store.shared.direct::<_, E>(|txn, hwm| {
            let mut tables = WriteTables::open(txn)?;
            let existing = tables.read(&key_bytes)?;
            let last = *hwm;
            let decided =
                logic::begin(existing, fingerprint, now, DEFAULT_LEASE, retention, || {
                    last.checked_add(1)
                        .ok_or_else(|| Error::invalid_argument("fencing tokens exhausted"))
                })?;
            let claim = match decided.answer {
                Begin::Claimed(claim) => claim,
                // Nothing of the message is written; the transaction still
                // commits what the memtable held (a checkpoint).
                Begin::Replay(response) => return Ok(Err(Delivery::Duplicate(response))),
                Begin::Conflict => return Ok(Err(Delivery::Conflict)),
                Begin::InFlight { lease_until } => {
                    return Ok(Err(Delivery::InFlight { lease_until }));
                }
            };
            let Some(record) = decided.write else {
                return Err(Error::backend("a claim without a record to write").into());
            };
            // The PROCESSING record exists only inside this transaction; it
            // is there so that `complete` below is the ordinary transition.
            tables.apply(&key_bytes, Some(&record))?;
            drop(tables);

            let response = handler(txn, &claim)?;
            logic::check_response(&response, max_body_bytes)?;

            let mut tables = WriteTables::open(txn)?;
            let existing = tables.read(&key_bytes)?;
            let done = logic::complete(existing, &claim, &response, now, retention)?;
            tables.apply(&key_bytes, Some(&done))?;
            *hwm = (*hwm).max(claim.token);
            Ok(Ok(response))
        })?;
        let response = match decided {
            Ok(response) => response,
            Err(answer) => return Ok(answer),
        };
        Ok(Delivery::Handled(response))
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
        let db = self.store.shared.read_db();
        let txn = db.begin_read().map_err(engine)?;
        f(&txn)
    }
}
