//! The one way the inbox writes: a batch of deliveries decided and handled
//! in one direct write transaction, committed once, and re-run without a
//! message whose handler failed.
//!
//! ## Why abort and re-run, not roll back one message
//!
//! redb cannot undo part of a transaction: a savepoint can only be taken in
//! a clean one (`ephemeral_savepoint` refuses a dirty transaction). So when
//! a handler fails (an `Err`, a panic, a result over the limits) after its
//! batch-mates wrote their rows, the pass is aborted (the transaction is
//! dropped: nothing of it reaches the file), that message is set aside with
//! its failure, and the batch runs again without it. Every failure removes
//! one message, so a batch of `n` runs at most `n + 1` passes; a batch
//! whose handlers all succeed runs one.
//!
//! The price of that choice is the handler contract: a handler may run more
//! than once for one delivery (once per pass), so its only effects must be
//! writes through the transaction it is given. Each run gets a new claim:
//! tokens handed out in an aborted pass are never handed out again by this
//! process (the in-memory high-water mark keeps them), so a token a handler
//! did pass downstream never names two messages.
//!
//! ## Durability
//!
//! The pass is a direct transaction (`Shared::direct_locked`, under
//! the commit lock, held across passes): it first takes in what the
//! memtable holds, so every message is decided on the latest state; it
//! commits with `redb::Durability::Immediate`, the same durability as every
//! other direct transaction (with quick-repair: redb's two-phase commit, two
//! fsyncs for the whole batch; with `Inbox::quick_repair(false)` redb's
//! one-phase commit with checksums, one fsync); its commit retires the
//! write-ahead log's frames; a failed commit poisons the store.
//! A message is answered `Handled` only after that commit returned: a crash
//! before it leaves none of the batch, a crash after it all of it.

use super::super::RedbStore;
use super::super::health::On;
use super::super::tables::{Source, WriteTables};
use super::Delivery;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::guard::DEFAULT_LEASE;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, State};
use crate::response::Response;
use crate::time::Timestamp;
use ::redb::WriteTransaction;
use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

/// Most deliveries in one [`Inbox::handle_batch`](super::Inbox::handle_batch)
/// call; a larger batch is [`Error::InvalidArgument`] before any I/O.
///
/// The handlers of a batch run while the store's commit lock is held, and a
/// batch with `f` failing handlers runs up to `f + 1` passes; the limit
/// bounds both. Batches of 100 to 1,000 already amortise the fsync
/// (`docs/performance.md`).
///
/// ```
/// assert_eq!(idemstore::redb::MAX_INBOX_BATCH, 4_096);
/// ```
pub const MAX_INBOX_BATCH: usize = 4_096;

/// One delivery in a batch for [`Inbox::handle_batch`](super::Inbox::handle_batch):
/// the message's key (e.g. scope = queue name, id = message id), the digest
/// of what it asks for, and whatever the handler needs (its payload).
///
/// ```
/// use idemstore::redb::Message;
/// use idemstore::{Fingerprint, Key};
///
/// let m = Message::new(Key::new("payments", "p-1")?, Fingerprint::of(b"alice+5"), ("alice", 5u64));
/// assert_eq!(m.payload, ("alice", 5));
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
    /// A delivery of `payload` under `key`, whose content digests to `fingerprint`.
    ///
    /// ```
    /// use idemstore::redb::Message;
    /// use idemstore::{Fingerprint, Key};
    ///
    /// let m = Message::new(Key::new("q", "m-1")?, Fingerprint::of(b"x"), ());
    /// assert_eq!(m.key.id(), b"m-1");
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn new(key: Key, fingerprint: Fingerprint, payload: T) -> Message<T> {
        Message {
            key,
            fingerprint,
            payload,
        }
    }
}

/// How one message of a batch failed; none of its writes were committed.
pub(super) enum Failed<E> {
    /// The handler's error, or the store's about this message (a result
    /// over the limits, a record that does not decode) converted into `E`.
    Error(E),
    /// The handler panicked, with this payload.
    Panic(Box<dyn Any + Send>),
}

impl<E: From<Error>> Failed<E> {
    /// The failure as a value: a panic becomes [`Error::HandlerPanicked`].
    pub(super) fn into_error(self) -> E {
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
    /// The store failed (the whole batch fails with it).
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
pub(super) struct Item<'a> {
    pub(super) key: Vec<u8>,
    pub(super) fingerprint: &'a Fingerprint,
}

/// What the engine needs of the inbox besides the store.
pub(super) struct Settings {
    pub(super) now: Timestamp,
    pub(super) retention: Duration,
    /// redb's quick-repair on the commit (`Inbox::quick_repair`).
    pub(super) quick_repair: bool,
}

/// Decides and handles `items` in order, committing once; an answer per
/// item, in order. `handler(i, txn, claim)` runs item `i`'s handler. The
/// error is the store's: nothing of the batch was committed (or, after a
/// failed commit, the store is poisoned).
pub(super) fn run<E, F>(
    store: &RedbStore,
    items: &[Item<'_>],
    settings: &Settings,
    mut handler: F,
) -> Result<Vec<Result<Delivery, Failed<E>>>>
where
    E: From<Error>,
    F: FnMut(usize, &WriteTransaction, &Claim) -> Result<Response, E>,
{
    if items.is_empty() {
        return Ok(Vec::new());
    }
    if items.len() > MAX_INBOX_BATCH {
        return Err(Error::invalid_argument(format!(
            "an inbox batch of {} deliveries is over MAX_INBOX_BATCH ({MAX_INBOX_BATCH})",
            items.len()
        )));
    }
    store.shared.db.check_healthy()?;
    if let Some(answers) = all_redelivered(store, items, settings.now) {
        return Ok(answers.into_iter().map(Ok).collect());
    }

    let shared = &store.shared;
    let mut failed: Vec<Option<Failed<E>>> = items.iter().map(|_| None).collect();
    let mut core = shared.log.lock();
    loop {
        let mut burned = 0;
        let io_errors = shared.db.witness.count();
        let pass = shared.direct_locked(&mut core, settings.quick_repair, |tables, hwm| {
            one_pass(
                store,
                tables,
                hwm,
                &mut burned,
                items,
                &failed,
                settings,
                &mut handler,
            )
        });
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
            // A handler failed after the engine's storage returned an I/O
            // error in this pass (the handler's transaction grew the file
            // on a full disk): the failure is the store's, not the
            // message's. redb refuses the database from now on, so the
            // store poisons and heals; the batch fails with the error
            // itself, its kind kept (the handler's error type may not
            // carry it).
            Err(Abort::Message(..)) if shared.db.witness.count() != io_errors => {
                let error = shared.db.witness.last().map_or_else(
                    || Error::backend("the storage engine failed an I/O"),
                    Error::Io,
                );
                return Err(shared.fail("inbox batch", On::Store, error));
            }
            Err(Abort::Message(index, failure)) => {
                // Tokens of the aborted pass may have been seen by a
                // handler: never hand them out again.
                core.token_hwm = core.token_hwm.max(burned);
                match failed.get_mut(index) {
                    Some(slot @ None) => *slot = Some(failure),
                    // Cannot happen (a pass skips failed messages); stop
                    // rather than loop.
                    _ => return Err(Error::backend("an inbox pass failed a message twice")),
                }
            }
        }
    }
}

/// One pass over the messages not failed yet. `Ok`: an answer per item
/// (`None` for a failed one), the caller commits; `Err`: abort.
#[allow(
    clippy::too_many_arguments,
    reason = "one private step of `run`, which owns every argument"
)]
fn one_pass<E, F>(
    store: &RedbStore,
    tables: &mut WriteTables<'_>,
    hwm: &mut u64,
    burned: &mut u64,
    items: &[Item<'_>],
    failed: &[Option<Failed<E>>],
    settings: &Settings,
    handler: &mut F,
) -> std::result::Result<Vec<Option<Result<Delivery, E>>>, Abort<E>>
where
    E: From<Error>,
    F: FnMut(usize, &WriteTransaction, &Claim) -> Result<Response, E>,
{
    let (now, retention) = (settings.now, settings.retention);
    // The handler opens its own tables beside the store's.
    let txn = tables.txn;
    let mut answers = Vec::with_capacity(items.len());
    for (index, (item, failed)) in items.iter().zip(failed).enumerate() {
        if failed.is_some() {
            answers.push(None);
            continue;
        }
        // A message that cannot be decided (its record does not decode,
        // tokens ran out) fails alone, having written nothing.
        let decided = tables.read(&item.key).and_then(|existing| {
            let last = *hwm;
            logic::begin(
                existing,
                item.fingerprint,
                now,
                DEFAULT_LEASE,
                retention,
                || {
                    last.checked_add(1)
                        .ok_or_else(|| Error::invalid_argument("fencing tokens exhausted"))
                },
            )
        });
        let decided = match decided {
            Ok(decided) => decided,
            Err(e) => {
                answers.push(Some(Err(e.into())));
                continue;
            }
        };
        let claim = match decided.answer {
            Begin::Claimed(claim) => claim,
            // Already handled (before this batch, or earlier in it).
            Begin::Replay(response) => {
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
        let Some(processing) = decided.write else {
            return Err(Abort::Store(Error::backend(
                "a claim without a record to write",
            )));
        };
        *hwm = (*hwm).max(claim.token);
        *burned = (*burned).max(claim.token);
        // The PROCESSING record is never written: it would live only inside
        // this transaction, and the DONE record below replaces it.
        let response = match catch_unwind(AssertUnwindSafe(|| handler(index, txn, &claim))) {
            Ok(Ok(response)) => response,
            Ok(Err(e)) => return Err(Abort::Message(index, Failed::Error(e))),
            Err(panic) => return Err(Abort::Message(index, Failed::Panic(panic))),
        };
        let stored = logic::check_response(&response, store.max_body_bytes)
            .and_then(|()| logic::complete(Some(processing), &claim, &response, now, retention))
            .and_then(|done| tables.apply(&item.key, Some(&done)));
        if let Err(e) = stored {
            return Err(Abort::Message(index, Failed::Error(e.into())));
        }
        answers.push(Some(Ok(Delivery::Handled(response))));
    }
    Ok(answers)
}

/// The answers when every item is a redelivery of a handled message (read
/// from the memtable or a read transaction, no write); `None` as soon as one
/// needs the write transaction.
fn all_redelivered(store: &RedbStore, items: &[Item<'_>], now: Timestamp) -> Option<Vec<Delivery>> {
    let mut answers = Vec::with_capacity(items.len());
    for item in items {
        let record = logic::visible(store.shared.read(&item.key).ok()?, now)?;
        if record.state != State::Done {
            return None;
        }
        answers.push(if record.fingerprint == *item.fingerprint {
            Delivery::Duplicate(record.response.unwrap_or_default())
        } else {
            Delivery::Conflict
        });
    }
    Some(answers)
}

/// The encoded key of `key`, for an [`Item`].
pub(super) fn item<'a>(key: &Key, fingerprint: &'a Fingerprint) -> Item<'a> {
    Item {
        key: crate::codec::encode_key(key),
        fingerprint,
    }
}
