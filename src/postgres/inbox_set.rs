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
//! which message made it fail. The pass is rolled back and its messages run
//! again as two passes, the first half of its claimed messages, then the
//! second, and so on down to the one message that fails alone: that one's
//! answer is the error, and nothing of it is written. Every other message
//! is handled in a pass that commits. One poison message among `n` costs
//! about `2 log2(n)` extra passes; each pass is a transaction of its own.
//!
//! **The same id twice.** A pass holds each id once; a later message of an
//! id runs in a pass after the one that holds its first, and is decided on
//! the record that one committed: `Duplicate` of the first's result, or
//! `Conflict` when its fingerprint differs, as in `handle_batch`.

use super::errors::db_error;
use super::inbox::{
    Abort, CatchPanic, Decided, Done, OpenTx, PassContext, PgInbox, Rep, decide_all,
    write_and_commit,
};
use super::inbox_sql::InboxSql;
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
use std::sync::Arc;
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
    /// batch) rather than a round trip per message: the batch costs four
    /// round trips and one commit, besides the handler's own.
    ///
    /// Answers come in input order: `Handled`, `Duplicate`, `Conflict`,
    /// `InFlight`, or that message's error.
    ///
    /// **A failing handler** (an error, a panic — [`Error::HandlerPanicked`]
    /// — or a response over the limits) rolls its transaction back, and its
    /// messages run again in halves, each half its own transaction, down to
    /// the message that fails alone: its answer is the handler's error, it
    /// leaves no writes, and every other message is handled without it.
    /// (A response over the limits names its message at once.) So the
    /// handler may run several times over a message before that message's
    /// transaction commits, each time with a new claim: its only effects
    /// must be writes through the client it is given. A handler that
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
        super::inbox::check_batch_len(messages.len())?;
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let (core, sql) = (Arc::clone(&self.store.core), Arc::clone(&self.sql));
        let (now, retention) = (self.clock.now(), self.retention);
        self.store
            .runtime
            .block_on_task(async move {
                deliver_set(&core, &sql, messages, now, retention, handler).await
            })
            .unwrap_or(Err(Error::Closed))
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
    let pooled = core.pool.get().await?;
    let conn = pooled.conn();
    let mut open = OpenTx(Some(pooled));
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
    let mut work: VecDeque<Vec<usize>> = VecDeque::from([(0..messages.len()).collect()]);
    let mut moved = 0;
    while let Some(list) = work.pop_front() {
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
            work.push_front(later);
        }
        if pass.is_empty() {
            continue;
        }
        match set_pass(&ctx, &messages, &pass, &mut handler).await {
            Ok(done) => {
                moved = 0;
                for (index, answer) in done {
                    if let Some((key, _, _)) = messages.get(index)
                        && matches!(answer, Delivery::Handled(_) | Delivery::Duplicate(_))
                    {
                        failed_fp.remove(key);
                    }
                    if let Some(slot) = answers.get_mut(index) {
                        *slot = Some(Ok(answer));
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
                work.push_front(pass);
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
                        work.push_front(pass);
                    }
                }
                _ => {
                    // Halves by the claimed messages; the others go with
                    // the first half (they are answered wherever they run).
                    let mid = claimed.get(claimed.len() / 2).copied().unwrap_or(0);
                    let (first, second): (Vec<usize>, Vec<usize>) =
                        pass.into_iter().partition(|&i| i < mid);
                    work.push_front(second);
                    work.push_front(first);
                }
            },
        }
    }
    open.finish();
    Ok(answers
        .into_iter()
        .map(|a| {
            a.unwrap_or_else(|| Err(Error::backend("an inbox pass skipped a delivery").into()))
        })
        .collect())
}

/// One pass over `pass` (indexes into `messages`, distinct ids): decided,
/// handled as one set, written, committed. The answers of its messages.
async fn set_pass<T, E, F>(
    ctx: &PassContext<'_>,
    messages: &[(Key, Fingerprint, T)],
    pass: &[usize],
    handler: &mut F,
) -> Result<Vec<(usize, Delivery)>, SetAbort<E>>
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
                    return roll_back(ctx, SetAbort::Batch(super::inbox::undecided())).await;
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
                return roll_back(ctx, SetAbort::Batch(super::inbox::undecided())).await;
            }
        }
    }
    if set.is_empty() {
        // Nothing written: the commit only ends the transaction (and
        // releases the locks).
        commit(ctx).await?;
        return Ok(answers);
    }
    let indexes: Vec<usize> = claimed.iter().map(|(rep, ..)| rep.index).collect();
    let responses = match CatchPanic(handler(&ctx.conn.client, &set)).await {
        Ok(Ok(responses)) => responses,
        Ok(Err(e)) => return roll_back(ctx, SetAbort::Failed(indexes, e)).await,
        Err(message) => {
            let e = Error::HandlerPanicked { message }.into();
            return roll_back(ctx, SetAbort::Failed(indexes, e)).await;
        }
    };
    drop(set);
    if responses.len() != claimed.len() {
        let e = Error::invalid_argument(format!(
            "the set handler returned {} responses for {} messages",
            responses.len(),
            claimed.len()
        ));
        return roll_back(ctx, SetAbort::Failed(indexes, e.into())).await;
    }
    let mut handled = Vec::with_capacity(claimed.len());
    for ((rep, claim, processing, fresh), response) in claimed.into_iter().zip(responses) {
        let checked = logic::check_response(&response, ctx.core.max_body_bytes).and_then(|()| {
            logic::complete(Some(processing), &claim, &response, ctx.now, ctx.retention)
        });
        let record = match checked {
            Ok(record) => record,
            Err(e) => return roll_back(ctx, SetAbort::Failed(vec![rep.index], e.into())).await,
        };
        answers.push((rep.index, Delivery::Handled(response)));
        handled.push(Done {
            index: rep.index,
            key: rep.key,
            record,
            fresh,
        });
    }
    write_and_commit(ctx, &handled).await?;
    Ok(answers)
}

async fn commit<E>(ctx: &PassContext<'_>) -> Result<(), SetAbort<E>> {
    ctx.conn
        .client
        .batch_execute("COMMIT")
        .await
        .map_err(|e| SetAbort::Batch(ctx.db(e)))
}

/// Ends the pass's transaction with `ROLLBACK`, then reports `abort`.
async fn roll_back<R, E>(ctx: &PassContext<'_>, abort: SetAbort<E>) -> Result<R, SetAbort<E>> {
    ctx.conn
        .client
        .batch_execute("ROLLBACK")
        .await
        .map_err(|e| SetAbort::Batch(ctx.db(e)))?;
    Err(abort)
}
