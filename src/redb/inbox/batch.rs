//! The one way the inbox writes: a batch handled in one direct write
//! transaction, committed once. redb cannot undo part of a transaction, so
//! a failed message aborts the pass and the batch runs again without it
//! (`f` failures: at most `f + 1` passes). Tokens a pass handed out are
//! never handed out again, however it ended: a token a handler passed
//! downstream names one message. `Handled` is answered only after the
//! commit returned.

use super::super::RedbStore;
use super::super::health::On;
use super::super::tables::WriteTables;
use super::{Delivery, Inbox};
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
pub(super) enum Failed<E> {
    Error(E),
    Panic(Box<dyn Any + Send>),
}

impl<E: From<Error>> Failed<E> {
    /// A panic becomes [`Error::HandlerPanicked`].
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
pub(super) type Item<'a> = (Vec<u8>, &'a Fingerprint);

type Answers<E> = Vec<Result<Delivery, Failed<E>>>;

impl Inbox {
    /// Decides and handles `items` in order, committing once; an answer per
    /// item. `handler(i, txn, claim)` runs item `i`'s handler. The error is
    /// the store's: nothing of the batch was committed.
    pub(super) fn run<E, F>(&self, items: &[Item<'_>], mut handler: F) -> Result<Answers<E>>
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
        shared.db.health.check()?;
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
            let next = || logic::next_token(*hwm);
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
