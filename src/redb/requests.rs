//! The [`Store`] impl of [`RedbStore`]: each call's checks, the read fast
//! path, and the ops a call puts in the line (`commit/`).

use super::shared::{Op, Reply};
use super::{RedbStore, Shared};
use crate::codec;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, Record, check_durations};
use crate::response::Response;
use crate::step::Step;
use crate::store::{MAX_SWEEP_BATCH, Store, StoreFuture, ready};
use crate::sync::Arc;
use crate::sync::atomic::Ordering;
use crate::time::{Clock, Timestamp};
use std::ops::ControlFlow;
use std::time::Duration;

fn begun(reply: Reply) -> Result<Begin> {
    match reply {
        Reply::Begin(answer, _) => Ok(answer),
        other => Err(unexpected(&other)),
    }
}

fn done(reply: Reply) -> Result<()> {
    match reply {
        Reply::Done => Ok(()),
        other => Err(unexpected(&other)),
    }
}

fn unexpected(reply: &Reply) -> Error {
    Error::backend(format!(
        "the commit path answered with the wrong kind of reply: {reply:?}"
    ))
}

impl Shared {
    /// A sweep of up to `max` (at most [`MAX_SWEEP_BATCH`]) expired records
    /// through the line: the store's and the sweeper thread's.
    pub(super) fn sweep(&self, now: Timestamp, max: usize) -> Result<usize> {
        let max = max.min(MAX_SWEEP_BATCH);
        if max == 0 {
            return Ok(0);
        }
        match self.submit(Op::Sweep { now, max })? {
            Reply::Swept(n) => Ok(n),
            other => Err(unexpected(&other)),
        }
    }
}

impl RedbStore {
    /// `begin` up to the line (`Continue` with its op): the checks, then
    /// the read fast path, which answers (`Break`) a `begin` that writes
    /// nothing (Replay, InFlight, Conflict) with the same state machine on
    /// the latest durable state (memtable, then redb). A claim or a
    /// takeover is decided once, by the committer that applies it
    /// (`commit::decide`), never here.
    fn prepare_begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<ControlFlow<Begin, Op>> {
        check_durations(lease, retention)?;
        let key_bytes = codec::encode_key(key);
        let (existing, read_at) = self.shared.read_counted(&key_bytes)?;
        let absent_at = read_at.filter(|_| existing.is_none());
        if let Some(existing) = existing {
            // The token handed to the state machine here is never stored.
            let step = logic::begin(Some(existing), fingerprint, now, lease, retention, || Ok(0))?;
            if step.write.is_none() {
                let counter = match step.answer {
                    Begin::Replay(_) => &self.shared.stats.fast_replays,
                    _ => &self.shared.stats.fast_refusals,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                return Ok(ControlFlow::Break(step.answer));
            }
        }
        Ok(ControlFlow::Continue(Op::Begin {
            key: key_bytes,
            fingerprint: *fingerprint,
            now,
            lease,
            retention,
            absent_at,
        }))
    }

    fn complete_op(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<Op> {
        logic::check_response(response, self.max_body_bytes)?;
        Ok(Op::Complete {
            key: codec::encode_key(key),
            claim: claim.clone(),
            response: response.clone(),
            now,
            retention,
        })
    }

    fn step_op(key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Op {
        Op::Step {
            key: codec::encode_key(key),
            claim: claim.clone(),
            step: step.clone(),
            now,
        }
    }

    fn release_op(key: &Key, claim: &Claim) -> Op {
        Op::Release {
            key: codec::encode_key(key),
            claim: claim.clone(),
        }
    }

    /// `op` through the line as a future mapped by `answer`; refusals
    /// before the line are a ready error.
    fn join_line_async<'a, T: Send + 'a>(
        &self,
        op: Result<Op>,
        answer: fn(Reply) -> Result<T>,
    ) -> StoreFuture<'a, T> {
        match op.and_then(|op| self.shared.submit_async(op)) {
            Ok(submitted) => Box::pin(async move { answer(submitted.await?) }),
            Err(refused) => ready(Err(refused)),
        }
    }
}

impl Store for RedbStore {
    fn begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        match self.prepare_begin(key, fingerprint, now, lease, retention)? {
            ControlFlow::Break(answer) => Ok(answer),
            ControlFlow::Continue(op) => begun(self.shared.submit(op)?),
        }
    }

    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        let op = self.complete_op(key, claim, response, now, retention)?;
        done(self.shared.submit(op)?)
    }

    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        done(self.shared.submit(RedbStore::release_op(key, claim))?)
    }

    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
        let op = Op::Renew {
            key: codec::encode_key(key),
            claim: claim.clone(),
            now,
            lease,
        };
        match self.shared.submit(op)? {
            Reply::Renewed(claim) => Ok(claim),
            other => Err(unexpected(&other)),
        }
    }

    fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()> {
        done(self.shared.submit(Self::step_op(key, claim, step, now))?)
    }

    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        let record = self.shared.read(&codec::encode_key(key))?;
        Ok(logic::visible(record, now))
    }

    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        self.shared.sweep(now, max)
    }

    fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.shared.db.clock)
    }

    /// The fast path (Replay, InFlight, Conflict from memory or a redb
    /// read) answers at once; a claim joins the commit line and the future
    /// completes when its group is durable, with no thread waiting for it.
    /// Dropped before it completes, it leaves no claim: see
    /// [Native async](Store#native-async).
    fn begin_async<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Option<StoreFuture<'a, Begin>> {
        let next = self.prepare_begin(key, fingerprint, now, lease, retention);
        Some(match next {
            Ok(ControlFlow::Break(answer)) => ready(Ok(answer)),
            Ok(ControlFlow::Continue(op)) => self.join_line_async(Ok(op), begun),
            Err(refused) => ready(Err(refused)),
        })
    }

    /// Joins the commit line; completes when the DONE record is durable.
    fn complete_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        response: &'a Response,
        now: Timestamp,
        retention: Duration,
    ) -> Option<StoreFuture<'a, ()>> {
        let op = self.complete_op(key, claim, response, now, retention);
        Some(self.join_line_async(op, done))
    }

    /// Joins the commit line; completes when the release is durable.
    fn release_async<'a>(&'a self, key: &'a Key, claim: &'a Claim) -> Option<StoreFuture<'a, ()>> {
        Some(self.join_line_async(Ok(RedbStore::release_op(key, claim)), done))
    }

    /// Joins the commit line; completes when the step is durable.
    fn record_step_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        step: &'a Step,
        now: Timestamp,
    ) -> Option<StoreFuture<'a, ()>> {
        let op = RedbStore::step_op(key, claim, step, now);
        Some(self.join_line_async(Ok(op), done))
    }
}
