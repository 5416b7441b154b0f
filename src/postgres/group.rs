//! Group commit against PostgreSQL: the `begin`s and `complete`s that
//! callers of one store make at the same time are sent to the server
//! together, as one set-based statement per kind in one pipelined
//! transaction, so 64 concurrent requests cost one round trip, two
//! statements and one commit (one WAL flush) instead of 64 of each.
//!
//! # The line
//!
//! A call puts its job on the store's queue and waits for its answer. A
//! *runner* (a task on the store's runtime; at most [`MAX_GROUPS_IN_FLIGHT`] at once,
//! one more while [`GROUP_BACKLOG`] calls wait, each on its own pooled
//! connection) takes everything queued, up to
//! [`MAX_GROUP`] jobs, runs it, answers every job, and takes the next group
//! while the queue is not empty. A group of one job runs exactly as a lone
//! call always has (one prepared statement, autocommit), so a single
//! client pays nothing for the line but a task hand-off.
//!
//! # A group of several
//!
//! One message carries `BEGIN` (with the plan settings of [`Stmt::PlanSettings`]),
//! the group's completes as one [`Stmt::CompleteGroup`], its begins as one
//! [`Stmt::BeginGroup`], and `COMMIT`; the answers are read after. The two
//! statements are [`Stmt::Complete`] and [`Stmt::Begin`] over arrays, with
//! the same per-key decisions (see `sql.rs`). What a group changes, and
//! why each answer stays the one a lone call would give:
//!
//! - **Nothing is answered before the `COMMIT` succeeds.** A `Claimed` is
//!   durable when the caller sees it, as before; a `Replay` or `InFlight`
//!   read inside the transaction is as true at the commit as at the read
//!   (it wrote nothing, and another writer's change would only be newer).
//! - **One job per key and kind in a statement.** A set statement cannot
//!   write one row twice, so a key's second `begin` (or `complete`) in a
//!   group waits for the commit and runs alone, where it answers as it
//!   would have after the first one (`InFlight`, `Conflict`, `StaleClaim`).
//!   The completes run first: a `begin` of a key completed in the same
//!   group replays that response.
//! - **A `begin` that must wait** (its statement found another claimer of
//!   the key mid-commit: no row, or a claimable snapshot) never waits inside
//!   the group: waiting on an advisory lock while holding the group's row
//!   locks could deadlock with another group. Its row is left out, and
//!   after the commit it runs alone, where it waits and retries as a lone
//!   `begin` does.
//! - **Lock order.** The keys are sorted, and the statements are planned as
//!   index lookups in that order ([`Stmt::PlanSettings`]), so groups take their row
//!   locks in key order; a claim only *tries* its advisory lock. A group
//!   can still meet a lock held by a transaction outside the store's
//!   statements (an inbox batch, a hand-written one); PostgreSQL's deadlock
//!   detector then fails one of them, and a failed group falls back as
//!   below.
//! - **A group that fails** (a statement's error aborts the transaction,
//!   the `COMMIT` fails, the connection breaks) commits nothing, or, when
//!   the connection broke after the `COMMIT` was sent, may have committed:
//!   the connection is dropped and every job runs again alone. After a
//!   broken connection each is run as a repetition (see
//!   `Core::retrying`): a `complete` that finds its own response stored
//!   reports success once it is durable, a `begin` that finds its own lost
//!   claim answers `InFlight` (fail closed). One bad job costs its group a
//!   second round trip, never a wrong answer.
//! - **A commit on the primary only** (its wait for a synchronous standby
//!   cancelled: `Conn::unreplicated`) is treated as that broken
//!   connection: every job of the group runs again alone, as a repetition.
//!
//! Lone reruns are spawned off the runner: a call that waits (for a row
//! lock, for a connection) keeps only itself waiting, not the line.

use super::errors;
use super::line::{BeginJob, CompleteJob, Flight, Job};
use super::ops::{BeginStep, Core};
use super::pool::Conn;
use super::row;
use super::sql::{self, Stmt};
use super::stats::Counters;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, check_durations};
use crate::response::Response;
use crate::sync::Arc;
use crate::time::Timestamp;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

/// Most jobs one group's transaction carries.
const MAX_GROUP: usize = 128;

/// Most groups in flight at once, each on its own connection, whenever
/// calls wait: while one waits for its commit's WAL flush, the other is
/// already executing. Fewer in flight makes larger groups, whose fixed
/// cost (a transaction, two statements' executor start-up, a commit) is
/// shared by more calls; more in flight serves a moderate load sooner. Two
/// served 64 clients best of one, two and four (docs/performance.md,
/// "PostgreSQL"). A backlog of calls starts one more
/// ([`MAX_GROUPS_IN_FLIGHT_BACKLOGGED`]).
const MAX_GROUPS_IN_FLIGHT: usize = 2;

/// Most groups in flight while a backlog waits: with at least
/// [`GROUP_BACKLOG`] calls queued behind the [`MAX_GROUPS_IN_FLIGHT`]
/// groups already running, one more group starts, and it ends as soon as
/// fewer than [`GROUP_BACKLOG`] wait. Under a steady heavy load (64 callers
/// on the 2-core test machine) the two groups left a third of the CPU idle
/// while both waited for their commits; a third group of at least 16 calls
/// runs in that wait at nearly the per-call cost of the others, where a
/// third group at any queue length made small groups (docs/performance.md).
const MAX_GROUPS_IN_FLIGHT_BACKLOGGED: usize = 3;

/// How many queued calls start a group beyond [`MAX_GROUPS_IN_FLIGHT`]
/// (see [`MAX_GROUPS_IN_FLIGHT_BACKLOGGED`]).
const GROUP_BACKLOG: usize = 16;

/// The line's runner policy, from the constants above.
const FLIGHT: Flight = Flight {
    base: MAX_GROUPS_IN_FLIGHT,
    most: MAX_GROUPS_IN_FLIGHT_BACKLOGGED,
    backlog: GROUP_BACKLOG,
};

/// The line's entries: `begin` and `complete` queue their job and wait.
impl Core {
    /// `begin` through the group-commit line.
    pub(super) async fn begin(
        self: &Arc<Self>,
        key: Key,
        fingerprint: Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        Counters::bump(&self.counters.calls);
        check_durations(lease, retention)?;
        let (reply, answer) = tokio::sync::oneshot::channel();
        submit(
            self,
            Job::Begin(BeginJob {
                key,
                fingerprint,
                now,
                lease,
                retention,
                reply,
            }),
        );
        answer.await.unwrap_or_else(|_| Err(line_ended()))
    }

    /// `complete` through the group-commit line.
    pub(super) async fn complete(
        self: &Arc<Self>,
        key: Key,
        claim: Claim,
        response: Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        Counters::bump(&self.counters.calls);
        logic::check_response(&response, self.max_body_bytes)?;
        let Some(token) = row::token(claim.token) else {
            return Err(Error::StaleClaim);
        };
        let (reply, answer) = tokio::sync::oneshot::channel();
        submit(
            self,
            Job::Complete(CompleteJob {
                key,
                claim,
                token,
                response,
                now,
                retention,
                reply,
            }),
        );
        answer.await.unwrap_or_else(|_| Err(line_ended()))
    }
}

/// A call whose answer the line dropped: its runner ended mid-group (the
/// store is being dropped with the runtime, or a bug panicked in it).
fn line_ended() -> Error {
    Error::backend("the store's commit line ended before answering (the store is closing)")
}

/// Puts `job` on `core`'s line, starting a runner unless
/// [`MAX_GROUPS_IN_FLIGHT`] run (or, with a backlog,
/// [`MAX_GROUPS_IN_FLIGHT_BACKLOGGED`]). Must be called on the store's runtime (it
/// spawns there).
fn submit(core: &Arc<Core>, job: Job) {
    if core.line.push(job, FLIGHT) {
        tokio::spawn(run(Arc::clone(core)));
    }
}

/// Counts a runner out when it ends another way than by finding the queue
/// empty (a panic in a job; the store's runtime dropping it mid-group): the
/// line then starts a new runner at the next submission.
struct Running {
    core: Arc<Core>,
    /// Already counted out (the runner found the queue empty).
    out: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.out {
            self.core.line.runner_gone();
        }
    }
}

/// A runner: groups until the queue is empty.
async fn run(core: Arc<Core>) {
    let mut running = Running { core, out: false };
    loop {
        let core = &running.core;
        let Some(mut group) = core.line.next_group(MAX_GROUP, FLIGHT) else {
            running.out = true;
            return;
        };
        if group.len() == 1 {
            if let Some(job) = group.pop() {
                alone(core, job, false).await;
            }
        } else {
            together(core, group).await;
        }
    }
}

/// `job` as a lone call: its own statement in its own transaction, with
/// the waits and retries of a lone call. `repeated`: an earlier run may
/// have committed (its group's connection broke after `COMMIT` was sent).
async fn alone(core: &Core, job: Job, repeated: bool) {
    match job {
        Job::Begin(j) => {
            let answer = core
                .begin_alone(
                    &j.key,
                    &j.fingerprint,
                    j.now,
                    j.lease,
                    j.retention,
                    repeated,
                )
                .await;
            let _ = j.reply.send(answer);
        }
        Job::Complete(j) => {
            let times = row::times(j.now, j.retention);
            let answer = core
                .complete_alone(&j.key, &j.claim, j.token, &j.response, times, repeated)
                .await;
            let _ = j.reply.send(answer);
        }
    }
}

/// Runs each job alone, all at once (each on its own connection, as lone
/// calls would), off the runner: a call that waits (for a row lock, a
/// connection) keeps only itself waiting, not the line.
fn each_alone(core: &Arc<Core>, jobs: impl IntoIterator<Item = Job>, repeated: bool) {
    for job in jobs {
        let core = Arc::clone(core);
        tokio::spawn(async move { alone(&core, job, repeated).await });
    }
}

/// The answer a statement gave inside the group's pipeline.
enum Ran {
    Rows(Vec<Row>),
    Done,
}

type Sent<'a> = Pin<Box<dyn Future<Output = Result<Ran, tokio_postgres::Error>> + Send + 'a>>;

/// A group split by kind, one job per key in each kind (a key's second job
/// of a kind waits for the commit and runs alone, as it would have run
/// after the first one).
struct Split {
    begins: Vec<BeginJob>,
    completes: Vec<CompleteJob>,
    after: Vec<Job>,
}

fn split(jobs: Vec<Job>) -> Split {
    let mut out = Split {
        begins: Vec::new(),
        completes: Vec::new(),
        after: Vec::new(),
    };
    for job in jobs {
        match job {
            Job::Begin(j) if out.begins.last().is_some_and(|b| b.key == j.key) => {
                out.after.push(Job::Begin(j));
            }
            Job::Begin(j) => out.begins.push(j),
            Job::Complete(j) if out.completes.last().is_some_and(|c| c.key == j.key) => {
                out.after.push(Job::Complete(j));
            }
            Job::Complete(j) => out.completes.push(j),
        }
    }
    out
}

/// A group of several jobs: its `complete`s in one statement, its
/// `begin`s in another, in one pipelined transaction (see the module
/// docs), then the answers.
async fn together(core: &Arc<Core>, mut jobs: Vec<Job>) {
    // Key order, stable: a key's jobs keep their arrival order, and the
    // set statements get their keys sorted.
    jobs.sort_by(|a, b| a.key().cmp(b.key()));
    let pooled = match core.pool.get().await {
        Ok(pooled) => pooled,
        // No connection (the breaker is open, the pool is exhausted): each
        // job meets the same condition alone and reports it.
        Err(_) => return each_alone(core, jobs, false),
    };
    let conn = pooled.conn();
    let Split {
        begins,
        completes,
        after,
    } = split(jobs);
    let seen = conn.unreplicated();
    let ran = pipeline(core, &conn, &begins, &completes).await;
    // The group's commit may be on the primary only: every job's outcome
    // is then unknown, as after a broken connection.
    let unreplicated = conn.unreplicated() != seen;
    let (began, completed) = match ran {
        Ok(answers) if !unreplicated => answers,
        ran => {
            // Nothing committed, or (the connection broke after COMMIT was
            // sent, or the commit is on the primary only) maybe everything
            // did: rerun each job alone, as a repetition when the outcome
            // is unknown.
            let broken = unreplicated || ran.as_ref().is_err_and(errors::is_dead_connection);
            if ran.is_err() {
                pooled.discard();
            }
            let jobs = completes
                .into_iter()
                .map(Job::Complete)
                .chain(begins.into_iter().map(Job::Begin));
            each_alone(core, jobs, broken);
            return each_alone(core, after, false);
        }
    };
    drop(pooled);
    Counters::bump(&core.counters.group_commits);
    Counters::add(
        &core.counters.grouped_calls,
        (begins.len() + completes.len()) as u64,
    );
    for (j, done) in completes.into_iter().zip(completed) {
        let _ = j
            .reply
            .send(if done { Ok(()) } else { Err(Error::StaleClaim) });
    }
    let mut later = after;
    for (j, rows) in begins.into_iter().zip(began) {
        match rows.and_then(|row| settle_begin(core, &j, &row)) {
            Some(answer) => {
                let _ = j.reply.send(answer);
            }
            None => {
                Counters::bump(&core.counters.snapshot_retries);
                later.push(Job::Begin(j));
            }
        }
    }
    // Their statements wrote nothing (or they were a key's second job):
    // each runs alone now, waiting for the other claimer of its key as a
    // lone begin does.
    each_alone(core, later, false);
}

/// Sends `BEGIN`, the group's statements and `COMMIT` without waiting,
/// then reads the answers: for each begin its row (none: run it again
/// alone), for each complete whether it stored its response. Any error
/// means the transaction did not commit (a failed statement aborts it, and
/// the pipelined `COMMIT` then rolls it back), unless the connection broke
/// after the `COMMIT` was sent.
async fn pipeline(
    core: &Core,
    conn: &Conn,
    begins: &[BeginJob],
    completes: &[CompleteJob],
) -> Result<(Vec<Option<Row>>, Vec<bool>), tokio_postgres::Error> {
    // Prepared before anything is sent: a statement prepared on first use
    // would be sent after the COMMIT, outside the transaction.
    let begin_group = conn.prepared(Stmt::BeginGroup).await?;
    let complete_group = conn.prepared(Stmt::CompleteGroup).await?;
    let plan_settings = conn.prepared(Stmt::PlanSettings).await?;
    let table = &core.sql.table;

    let b_scopes: Vec<&[u8]> = begins.iter().map(|j| j.key.scope()).collect();
    let b_ids: Vec<&[u8]> = begins.iter().map(|j| j.key.id()).collect();
    let b_fps: Vec<&[u8]> = begins
        .iter()
        .map(|j| &j.fingerprint.as_bytes()[..])
        .collect();
    let b_ats: Vec<i64> = begins.iter().map(|j| row::millis(j.now)).collect();
    let b_leases: Vec<i64> = begins
        .iter()
        .map(|j| row::millis(j.now + j.lease))
        .collect();
    let b_expiries: Vec<i64> = begins
        .iter()
        .map(|j| row::millis(j.now + j.retention))
        .collect();
    let b_locks: Vec<i64> = begins
        .iter()
        .map(|j| sql::key_lock(table, &j.key))
        .collect();
    let b_args: [&(dyn ToSql + Sync); 7] = [
        &b_scopes,
        &b_ids,
        &b_fps,
        &b_ats,
        &b_leases,
        &b_expiries,
        &b_locks,
    ];

    let c_scopes: Vec<&[u8]> = completes.iter().map(|j| j.key.scope()).collect();
    let c_ids: Vec<&[u8]> = completes.iter().map(|j| j.key.id()).collect();
    let c_tokens: Vec<i64> = completes.iter().map(|j| j.token).collect();
    let c_ats: Vec<i64> = completes.iter().map(|j| row::millis(j.now)).collect();
    let c_expiries: Vec<i64> = completes
        .iter()
        .map(|j| row::millis(j.now + j.retention))
        .collect();
    let c_statuses: Vec<i32> = completes
        .iter()
        .map(|j| i32::from(j.response.status))
        .collect();
    let c_bodies: Vec<&[u8]> = completes.iter().map(|j| &j.response.body[..]).collect();
    let mut c_firsts: Vec<i32> = Vec::with_capacity(completes.len());
    let (mut c_names, mut c_values): (Vec<&[u8]>, Vec<&[u8]>) = (Vec::new(), Vec::new());
    for j in completes {
        // MAX_GROUP responses of at most MAX_HEADERS headers each: far
        // below i32::MAX.
        c_firsts.push(i32::try_from(c_names.len()).unwrap_or(i32::MAX));
        for (name, value) in &j.response.headers {
            c_names.push(name.as_bytes());
            c_values.push(value);
        }
    }
    let c_args: [&(dyn ToSql + Sync); 10] = [
        &c_scopes,
        &c_ids,
        &c_tokens,
        &c_ats,
        &c_expiries,
        &c_statuses,
        &c_bodies,
        &c_firsts,
        &c_names,
        &c_values,
    ];

    let client = &conn.client;
    let mut sent: Vec<Sent<'_>> = Vec::with_capacity(4);
    sent.push(Box::pin(async move {
        client.batch_execute("BEGIN").await.map(|()| Ran::Done)
    }));
    let settings = &plan_settings;
    sent.push(Box::pin(async move {
        client.query(settings, &[]).await.map(Ran::Rows)
    }));
    // The completes first: a begin of a key completed in the same group
    // then answers Replay, as it would have after that complete.
    if !completes.is_empty() {
        let (stmt, args) = (&complete_group, &c_args[..]);
        sent.push(Box::pin(async move {
            client.query(stmt, args).await.map(Ran::Rows)
        }));
    }
    if !begins.is_empty() {
        let (stmt, args) = (&begin_group, &b_args[..]);
        sent.push(Box::pin(async move {
            client.query(stmt, args).await.map(Ran::Rows)
        }));
    }
    sent.push(Box::pin(async move {
        client.batch_execute("COMMIT").await.map(|()| Ran::Done)
    }));
    let mut answers = InOrder::new(sent).await.into_iter();
    answers.next().transpose()?; // BEGIN
    answers.next().transpose()?; // the plan settings
    let mut completed = vec![false; completes.len()];
    if !completes.is_empty() {
        for (slot, _) in by_position(&mut completed, answers.next())? {
            *slot = true;
        }
    }
    let mut began: Vec<Option<Row>> = begins.iter().map(|_| None).collect();
    if !begins.is_empty() {
        place_begin_rows(begins, &mut began, answers.next())?;
    }
    // COMMIT: looked at last, since a statement's error is the cause and
    // the COMMIT (then a rollback) only its consequence.
    answers.next().transpose()?;
    Ok((began, completed))
}

/// A group statement's rows, each with the slot of the job it answers:
/// its first column is the job's 1-based position in the arrays. A
/// position out of range (never sent) is skipped.
fn by_position<'s, T>(
    slots: &'s mut [T],
    answer: Option<Result<Ran, tokio_postgres::Error>>,
) -> Result<Vec<(&'s mut T, Row)>, tokio_postgres::Error> {
    let rows = match answer.transpose()? {
        Some(Ran::Rows(rows)) => rows,
        _ => Vec::new(),
    };
    let mut positions = Vec::with_capacity(rows.len());
    for row in rows {
        positions.push((job_index(&row)?, row));
    }
    let mut slots: Vec<Option<&'s mut T>> = slots.iter_mut().map(Some).collect();
    Ok(positions
        .into_iter()
        .filter_map(|(i, row)| Some((slots.get_mut(i)?.take()?, row)))
        .collect())
}

/// The rows of [`Stmt::BeginGroup`], each in the slot of the job it
/// answers: a claim first (its key names its job), else the key's row as
/// read (its position names its job). A row that names no job is skipped.
fn place_begin_rows(
    begins: &[BeginJob],
    slots: &mut [Option<Row>],
    answer: Option<Result<Ran, tokio_postgres::Error>>,
) -> Result<(), tokio_postgres::Error> {
    let rows = match answer.transpose()? {
        Some(Ran::Rows(rows)) => rows,
        _ => return Ok(()),
    };
    // The keys of a group are distinct.
    let position: std::collections::HashMap<(&[u8], &[u8]), usize> = begins
        .iter()
        .enumerate()
        .map(|(i, j)| ((j.key.scope(), j.key.id()), i))
        .collect();
    let mut read = Vec::new();
    for row in rows {
        if !row.try_get::<_, bool>(1)? {
            read.push(row);
            continue;
        }
        let last = row.len().saturating_sub(1);
        let key: (&[u8], &[u8]) = (row.try_get(last.saturating_sub(1))?, row.try_get(last)?);
        if let Some(slot) = position.get(&key).and_then(|&i| slots.get_mut(i)) {
            slot.get_or_insert(row);
        }
    }
    for row in read {
        if let Some(slot) = slots.get_mut(job_index(&row)?) {
            slot.get_or_insert(row);
        }
    }
    Ok(())
}

/// The 0-based index of the job a group statement's row answers, from its
/// first column (the job's 1-based position; out of range when it is not
/// a position at all).
fn job_index(row: &Row) -> Result<usize, tokio_postgres::Error> {
    let n: i64 = row.try_get(0)?;
    Ok(usize::try_from(n.saturating_sub(1)).unwrap_or(usize::MAX))
}

/// The answer to a group's `begin` from its row in the group statement's
/// answer (its position first, then the lone statement's columns), or
/// `None` when it must run again alone: `BeginStep::answer_of_row`.
fn settle_begin(core: &Core, job: &BeginJob, found: &Row) -> Option<Result<Begin>> {
    let step = BeginStep {
        key: &job.key,
        fingerprint: &job.fingerprint,
        now: job.now,
        lease: job.lease,
        retention: job.retention,
        lock: 0, // not used to read a row
    };
    step.answer_of_row(found, 1)
        .map_err(|err| err.into_error(&core.sql.table))
        .transpose()
}

/// Polls every future in index order until all are ready: the first poll
/// of each sends its request, so the requests reach the socket in order.
/// (`join_all` may poll out of order for long lists.)
struct InOrder<'a> {
    pending: Vec<Option<Sent<'a>>>,
    done: Vec<Option<Result<Ran, tokio_postgres::Error>>>,
}

impl<'a> InOrder<'a> {
    fn new(sent: Vec<Sent<'a>>) -> InOrder<'a> {
        let done = sent.iter().map(|_| None).collect();
        InOrder {
            pending: sent.into_iter().map(Some).collect(),
            done,
        }
    }
}

impl Future for InOrder<'_> {
    type Output = Vec<Result<Ran, tokio_postgres::Error>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let mut all = true;
        for (slot, done) in this.pending.iter_mut().zip(this.done.iter_mut()) {
            if let Some(fut) = slot {
                match fut.as_mut().poll(cx) {
                    Poll::Ready(out) => {
                        *done = Some(out);
                        *slot = None;
                    }
                    Poll::Pending => all = false,
                }
            }
        }
        if !all {
            return Poll::Pending;
        }
        let out = this
            .done
            .iter_mut()
            .map(|d| d.take().unwrap_or(Ok(Ran::Done)))
            .collect();
        Poll::Ready(out)
    }
}
