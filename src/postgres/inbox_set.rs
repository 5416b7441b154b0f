//! [`PgInbox::handle_set`]: a batch whose handler takes every claimed
//! message at once, so that its own work can be set-based SQL too.
//!
//! A pass is one transaction over messages of distinct ids: `BEGIN`, the
//! ids' locks and records (`decide_all`, one round trip), the handler once
//! with every claimed message, every DONE record in one statement, one
//! `COMMIT` (sent with the DONE records when every key was new): the same
//! statements as a pass of
//! [`handle_batch`](PgInbox::handle_batch), with one handler call in place
//! of one per message.
//!
//! **Failure isolation by halving.** A set handler that fails does not say
//! which message made it fail. The pass is rolled back and runs again
//! *carefully*: decided afresh, its claimed messages run in halves, each
//! set in a savepoint, a failing set rolled back to its savepoint and
//! halved again, down to the message that fails alone (its answer is the
//! error, and nothing of it is written). The sets that succeed keep their
//! writes, and the careful pass commits once. One poison message among
//! `n` costs one rolled-back pass and about `2 log2(n)` more handler calls,
//! not more commits. (A response over the limits names its message: the
//! pass runs again at once without it.)
//!
//! **The same id twice.** A pass holds each id once; a later message of an
//! id runs in a pass after the one that holds its first, and is decided on
//! the record that one committed: `Duplicate` of the first's result, or
//! `Conflict` when its fingerprint differs, as in `handle_batch`.

use super::errors::db_error;
use super::inbox::{
    Abort, CatchPanic, Decided, Done, OpenTx, PassContext, PgInbox, Rep, decide_all, settled,
    write_and_commit,
};
use super::inbox_sql::{InboxSql, pipelined};
use super::ops::Core;
use super::stats::Counters;
use super::{MAX_BEGIN_ATTEMPTS, sql};
use crate::delivery::Delivery;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::guard::DEFAULT_LEASE;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, check_durations};
use crate::response::Response;
use crate::time::Timestamp;
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio_postgres::Client;

/// What a [`PgInbox::handle_set`] handler returns: one response per
/// claimed message, in the order it was given them, from a future
/// borrowing the transaction's client for `'c`.
pub type SetHandlerFuture<'c, E> =
    Pin<Box<dyn Future<Output = Result<Vec<Response>, E>> + Send + 'c>>;

/// One message a [`PgInbox::handle_set`] handler is asked to handle: its
/// id, its claim (a fencing token), and its payload.
///
/// ```
/// use idemstore::postgres::Claimed;
/// fn amounts(set: &[Claimed<'_, i64>]) -> Vec<i64> {
///     set.iter().map(|m| *m.payload).collect()
/// }
/// assert!(amounts(&[]).is_empty());
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct Claimed<'a, T> {
    /// The message id.
    pub key: &'a Key,
    /// This delivery's claim on the id.
    pub claim: Claim,
    /// The message as the caller passed it.
    pub payload: &'a T,
}

impl PgInbox {
    /// Handles a batch like [`handle_batch`](PgInbox::handle_batch), with
    /// one handler call for all its new messages instead of one per
    /// message: the handler gets every claimed message of the transaction
    /// and returns one response per message, in the same order. Its writes
    /// can then be set-based (one `UPDATE .. FROM unnest(..)` for the whole
    /// batch) rather than a round trip per message: the batch costs two
    /// round trips and one commit besides the handler's own (three when it
    /// takes over a record; see [`handle_batch`](PgInbox::handle_batch)).
    ///
    /// Answers come in input order: `Handled`, `Duplicate`, `Conflict`,
    /// `InFlight`, or that message's error.
    ///
    /// **A failing handler** (an error, a panic — [`Error::HandlerPanicked`]
    /// — or a response over the limits) rolls its transaction back, and its
    /// messages run again in one new transaction, in halves, each in a
    /// savepoint, a failing half halved again, down to the message that
    /// fails alone: its answer is the handler's error, it leaves no writes,
    /// and every other message is handled without it, in one commit. (A
    /// response over the limits names its message at once.) So the handler
    /// may run several times over a message before its writes commit (with
    /// a new claim after the rollback): its only effects must be writes
    /// through the client it is given. A handler that
    /// returns the wrong number of responses fails with
    /// [`Error::InvalidArgument`].
    ///
    /// The same id twice in a batch is handled once: the later message runs
    /// in a transaction after the first's, and is `Duplicate` of its result
    /// (`Conflict` when its fingerprint differs; after a failed first
    /// message, a later one with the same fingerprint is handled afresh).
    /// Locks, waits and the outer error are as in
    /// [`handle_batch`](PgInbox::handle_batch). Blocks this thread until the
    /// last commit; the handler runs on the store's runtime thread and must
    /// not block, nor end the transaction. An empty batch commits nothing.
    ///
    /// ```no_run
    /// use idemstore::postgres::{Claimed, Delivery, PgInbox};
    /// use idemstore::{Fingerprint, Key, PostgresStore, Response};
    ///
    /// let inbox = PgInbox::new(PostgresStore::builder().migrate_on_build(true).connect("postgres://app@db/payments")?);
    /// // (account, amount) per message.
    /// let batch: Vec<(Key, Fingerprint, (i64, i64))> = (0..100)
    ///     .map(|i| Ok((Key::new("payments", format!("msg-{i}"))?, Fingerprint::of(b"+1"), (i % 10, 1))))
    ///     .collect::<idemstore::Result<_>>()?;
    /// let answers = inbox.handle_set(batch, |client, set: &[Claimed<'_, (i64, i64)>]| {
    ///     let accounts: Vec<i64> = set.iter().map(|m| m.payload.0).collect();
    ///     let amounts: Vec<i64> = set.iter().map(|m| m.payload.1).collect();
    ///     let n = set.len();
    ///     Box::pin(async move {
    ///         client
    ///             .execute(
    ///                 "UPDATE balances b SET amount = b.amount + d.amount
    ///                    FROM (SELECT account, sum(amount)::bigint AS amount
    ///                            FROM unnest($1::bigint[], $2::bigint[]) AS t(account, amount)
    ///                           GROUP BY account) d
    ///                   WHERE b.account = d.account",
    ///                 &[&accounts, &amounts],
    ///             )
    ///             .await
    ///             .map_err(idemstore::Error::backend)?;
    ///         Ok::<_, idemstore::Error>(vec![Response::new(200, "credited"); n])
    ///     })
    /// })?;
    /// assert!(answers.iter().all(|a| matches!(a, Ok(Delivery::Handled(_) | Delivery::Duplicate(_)))));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn handle_set<T, E, F>(
        &self,
        messages: Vec<(Key, Fingerprint, T)>,
        handler: F,
    ) -> Result<Vec<Result<Delivery, E>>, Error>
    where
        T: Send + Sync + 'static,
        E: From<Error> + Send + 'static,
        F: for<'c> FnMut(&'c Client, &'c [Claimed<'c, T>]) -> SetHandlerFuture<'c, E>
            + Send
            + 'static,
    {
        self.run_batch(messages, |core, sql, messages, now, retention| async move {
            deliver_set(&core, &sql, messages, now, retention, handler).await
        })
    }
}

/// How a set pass ended without its commit (rolled back).
enum SetAbort<E> {
    /// The batch's error (see [`Abort::Batch`]).
    Batch(Error),
    /// The handler failed over these messages (indexes into the batch):
    /// run them again in smaller sets.
    Failed(Vec<usize>, E),
    /// A record moved before its DONE write: run the pass again.
    Moved,
}

impl<E> From<Abort<E>> for SetAbort<E> {
    fn from(abort: Abort<E>) -> SetAbort<E> {
        match abort {
            Abort::Batch(e) => SetAbort::Batch(e),
            Abort::Moved => SetAbort::Moved,
            // decide_all and write_all run no handler.
            Abort::Message(..) => SetAbort::Batch(Error::backend(
                "an inbox set pass failed a message outside its handler",
            )),
        }
    }
}

impl<E> From<Error> for SetAbort<E> {
    fn from(e: Error) -> SetAbort<E> {
        SetAbort::Batch(e)
    }
}

async fn deliver_set<T, E, F>(
    core: &Core,
    sql: &InboxSql,
    messages: Vec<(Key, Fingerprint, T)>,
    now: Timestamp,
    retention: Duration,
    mut handler: F,
) -> Result<Vec<Result<Delivery, E>>, Error>
where
    E: From<Error>,
    F: for<'c> FnMut(&'c Client, &'c [Claimed<'c, T>]) -> SetHandlerFuture<'c, E>,
{
    check_durations(DEFAULT_LEASE, retention)?;
    Counters::bump(&core.counters.calls);
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
    let mut answers: Vec<Option<Result<Delivery, E>>> = messages.iter().map(|_| None).collect();
    // The fingerprint of an id whose latest message failed, until one of
    // its messages is answered from a stored result or handled: the next
    // ones with another fingerprint are Conflict (as in handle_batch).
    let mut failed_fp: HashMap<&Key, &Fingerprint> = HashMap::new();
    // Lists of messages to run, and whether carefully (after a failure).
    let mut work: VecDeque<(Vec<usize>, bool)> =
        VecDeque::from([((0..messages.len()).collect(), false)]);
    let mut moved = 0;
    while let Some((list, careful)) = work.pop_front() {
        // The first message of each id runs now, the later ones after it.
        let mut ids: HashSet<&Key> = HashSet::new();
        let (mut pass, mut later) = (Vec::new(), Vec::new());
        for index in list {
            let Some((key, fingerprint, _)) = messages.get(index) else {
                continue;
            };
            if failed_fp.get(key).is_some_and(|fp| *fp != fingerprint) {
                if let Some(slot) = answers.get_mut(index) {
                    *slot = Some(Ok(Delivery::Conflict));
                }
                continue;
            }
            if ids.insert(key) {
                pass.push(index);
            } else {
                later.push(index);
            }
        }
        if !later.is_empty() {
            work.push_front((later, false));
        }
        if pass.is_empty() {
            continue;
        }
        match set_pass(&ctx, &messages, &pass, careful, &mut handler).await {
            Ok(done) => {
                moved = 0;
                for (index, answer) in done {
                    if let Some((key, fingerprint, _)) = messages.get(index) {
                        match &answer {
                            Ok(Delivery::Handled(_) | Delivery::Duplicate(_)) => {
                                failed_fp.remove(key);
                            }
                            Err(_) => {
                                failed_fp.insert(key, fingerprint);
                            }
                            Ok(_) => {}
                        }
                    }
                    if let Some(slot) = answers.get_mut(index) {
                        *slot = Some(answer);
                    }
                }
            }
            Err(SetAbort::Batch(e)) => return Err(e),
            Err(SetAbort::Moved) => {
                Counters::bump(&core.counters.snapshot_retries);
                moved += 1;
                if moved >= MAX_BEGIN_ATTEMPTS {
                    return Err(Error::backend(format!(
                        "an inbox batch raced with concurrent writers {MAX_BEGIN_ATTEMPTS} times in a row"
                    )));
                }
                work.push_front((pass, careful));
            }
            Err(SetAbort::Failed(claimed, e)) => match claimed.as_slice() {
                [] => return Err(Error::backend("an inbox set pass failed with no message")),
                [alone] => {
                    let alone = *alone;
                    if let Some((key, fingerprint, _)) = messages.get(alone) {
                        failed_fp.insert(key, fingerprint);
                    }
                    if let Some(slot) = answers.get_mut(alone) {
                        *slot = Some(Err(e));
                    }
                    pass.retain(|&i| i != alone);
                    if !pass.is_empty() {
                        work.push_front((pass, false));
                    }
                }
                // Which one failed is unknown: the same messages again,
                // carefully (a careful pass answers its failures itself).
                _ => work.push_front((pass, true)),
            },
        }
    }
    let answers = answers
        .into_iter()
        .map(|a| {
            a.unwrap_or_else(|| Err(Error::backend("an inbox pass skipped a delivery").into()))
        })
        .collect();
    settled(&mut open, &conn, seen, answers)
}

/// One pass over `pass` (indexes into `messages`, distinct ids): decided,
/// handled as one set, written, committed. The answers of its messages.
/// A `careful` pass runs the claimed messages in halves, each in a
/// savepoint, halving a failing set again down to the messages that fail
/// alone (their answers are their errors), and commits the rest once.
async fn set_pass<T, E, F>(
    ctx: &PassContext<'_>,
    messages: &[(Key, Fingerprint, T)],
    pass: &[usize],
    careful: bool,
    handler: &mut F,
) -> Result<Vec<(usize, Result<Delivery, E>)>, SetAbort<E>>
where
    E: From<Error>,
    F: for<'c> FnMut(&'c Client, &'c [Claimed<'c, T>]) -> SetHandlerFuture<'c, E>,
{
    let table = &ctx.core.sql.table;
    let mut reps = Vec::with_capacity(pass.len());
    for &index in pass {
        let Some((key, fingerprint, _)) = messages.get(index) else {
            return Err(SetAbort::Batch(Error::backend(
                "an inbox pass lost a delivery",
            )));
        };
        reps.push(Rep {
            key,
            fingerprint,
            lock: sql::key_lock(table, key),
            index,
        });
    }
    let decided = decide_all(ctx, &reps).await?;
    let mut answers = Vec::with_capacity(pass.len());
    let mut set: Vec<Claimed<'_, T>> = Vec::new();
    let mut claimed = Vec::new();
    for (rep, decided) in reps.iter().zip(decided) {
        match decided {
            Decided::Claimed(claim, processing, fresh) => {
                let Some((key, _, payload)) = messages.get(rep.index) else {
                    return ctx
                        .roll_back(SetAbort::Batch(super::inbox::undecided()))
                        .await;
                };
                set.push(Claimed {
                    key,
                    claim: claim.clone(),
                    payload,
                });
                claimed.push((rep, claim, processing, fresh));
            }
            Decided::Answer(Begin::Replay(response), _) => {
                answers.push((rep.index, Delivery::Duplicate(response)));
            }
            Decided::Answer(Begin::Conflict, _) => answers.push((rep.index, Delivery::Conflict)),
            Decided::Answer(Begin::InFlight { lease_until }, _) => {
                answers.push((rep.index, Delivery::InFlight { lease_until }));
            }
            Decided::Answer(Begin::Claimed(_), _) => {
                return ctx
                    .roll_back(SetAbort::Batch(super::inbox::undecided()))
                    .await;
            }
        }
    }
    if set.is_empty() {
        // Nothing written: the commit only ends the transaction (and
        // releases the locks).
        write_and_commit(ctx, &[]).await?;
        return Ok(answers
            .into_iter()
            .map(|(index, answer)| (index, Ok(answer)))
            .collect());
    }
    // The claimed messages' sets, as ranges of `set`; a stack (the last is
    // run next). A careful pass starts from the halves, each set in a
    // savepoint, and halves a failing set again: the handler's writes of
    // the sets that succeed stay, and the pass commits once.
    let mut todo: Vec<std::ops::Range<usize>> = Vec::with_capacity(2);
    if careful && set.len() > 1 {
        let mid = set.len() / 2;
        todo.extend([mid..set.len(), 0..mid]);
    } else {
        todo.push(0..set.len());
    }
    let mut results: Vec<(usize, Result<Delivery, E>)> = answers
        .into_iter()
        .map(|(index, answer)| (index, Ok(answer)))
        .collect();
    let mut handled = Vec::with_capacity(claimed.len());
    let client = &ctx.conn.client;
    while let Some(range) = todo.pop() {
        let (start, end) = (range.start, range.end);
        let Some(subset) = set.get(range.clone()) else {
            return ctx
                .roll_back(SetAbort::Batch(super::inbox::undecided()))
                .await;
        };
        // A careful set's savepoint goes out with the handler's first
        // statement. (Savepoints of sets that succeed are not released:
        // the next one shadows them, and the commit ends them all.)
        let ran = if careful {
            let (saved, ran) = pipelined(
                client.batch_execute("SAVEPOINT idemstore_set"),
                run_set(handler, client, subset),
            )
            .await;
            saved.map_err(|e| SetAbort::Batch(ctx.db(e)))?;
            ran
        } else {
            run_set(handler, client, subset).await
        };
        // What failed: the whole set (None), or one message of it.
        let outcome = match ran {
            Ok(responses) => {
                let mut records = Vec::with_capacity(responses.len());
                let mut bad = None;
                for (i, response) in (start..end).zip(responses) {
                    let Some((_, claim, processing, _)) = claimed.get(i) else {
                        continue;
                    };
                    let (now, keep, max) = (ctx.now, ctx.retention, ctx.core.max_body_bytes);
                    let checked = logic::check_response(&response, max).and_then(|()| {
                        logic::complete(Some(processing.clone()), claim, &response, now, keep)
                    });
                    match checked {
                        Ok(record) => records.push((i, response, record)),
                        Err(e) => {
                            bad = Some((i, E::from(e)));
                            break;
                        }
                    }
                }
                match bad {
                    None => Ok(records),
                    Some((i, e)) => Err((Some(i), e)),
                }
            }
            Err(e) => Err((None, e)),
        };
        match outcome {
            Ok(records) => {
                for (i, response, record) in records {
                    let Some((rep, _, _, fresh)) = claimed.get(i) else {
                        continue;
                    };
                    results.push((rep.index, Ok(Delivery::Handled(response))));
                    handled.push(Done {
                        index: rep.index,
                        key: rep.key,
                        record,
                        fresh: *fresh,
                    });
                }
            }
            Err((culprit, e)) if !careful => {
                let failed = match culprit.and_then(|i| claimed.get(i)) {
                    Some((rep, ..)) => vec![rep.index],
                    None => claimed.iter().map(|(rep, ..)| rep.index).collect(),
                };
                return ctx.roll_back(SetAbort::Failed(failed, e)).await;
            }
            Err((culprit, e)) => {
                client
                    .batch_execute("ROLLBACK TO SAVEPOINT idemstore_set")
                    .await
                    .map_err(|e| SetAbort::Batch(ctx.db(e)))?;
                let alone = culprit.or((end - start == 1).then_some(start));
                match alone.and_then(|i| claimed.get(i).map(|(rep, ..)| (i, rep.index))) {
                    // That message's answer is its error; the rest of its
                    // set runs again without it.
                    Some((i, index)) => {
                        results.push((index, Err(e)));
                        todo.extend([i + 1..end, start..i].into_iter().filter(|r| !r.is_empty()));
                    }
                    None => {
                        let mid = start + (end - start) / 2;
                        todo.extend([mid..end, start..mid]);
                    }
                }
            }
        }
    }
    write_and_commit(ctx, &handled).await?;
    Ok(results)
}

/// Runs the handler over `subset` (a panic becomes
/// [`Error::HandlerPanicked`]) and checks it answered one response per
/// message.
async fn run_set<'c, T, E, F>(
    handler: &mut F,
    client: &'c Client,
    subset: &'c [Claimed<'c, T>],
) -> Result<Vec<Response>, E>
where
    E: From<Error>,
    F: for<'h> FnMut(&'h Client, &'h [Claimed<'h, T>]) -> SetHandlerFuture<'h, E>,
{
    match CatchPanic(handler(client, subset)).await {
        Ok(Ok(responses)) if responses.len() == subset.len() => Ok(responses),
        Ok(Ok(responses)) => Err(Error::invalid_argument(format!(
            "the set handler returned {} responses for {} messages",
            responses.len(),
            subset.len()
        ))
        .into()),
        Ok(Err(e)) => Err(e),
        Err(message) => Err(Error::HandlerPanicked { message }.into()),
    }
}
