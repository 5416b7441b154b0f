//! The group-commit writer: one thread per store drains whatever is queued
//! into one write transaction and one fsync, then answers every caller in
//! the batch. The fsync is of the write-ahead log's frame for the batch
//! (`wal.rs`), or of a durable redb commit (a checkpoint, no log, or
//! relaxed durability's periodic commit).
//!
//! Requests are applied in queue order inside the one transaction, so a
//! duplicate later in a batch sees the claim made earlier in it. Nobody is
//! answered, and no reader sees the batch, before it is durable: the log's
//! frame is synced before the transaction commits. Large batches are
//! answered by a replier thread, so waking 60 callers does not delay the
//! next batch.
//! Failures are kept as small as they can be:
//!
//! - a request that fails before writing (stale claim, corrupt record, an
//!   invariant check) fails alone; the rest of the batch commits;
//! - a storage error while writing aborts the transaction: every caller in
//!   the batch gets an error and nothing is written;
//! - a failed commit may or may not have reached the disk: every caller in
//!   the batch gets the error and the store is poisoned (every later write is
//!   [`Error::Poisoned`]) until it is reopened.

use super::errors::engine;
use super::tables::{META_TOKEN_HWM, StepError, WriteTables, write_token_hwm};
use super::wal::Wal;
use super::{Durability, Shared};
use crate::codec;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::logic;
use crate::record::{Begin, Claim};
use crate::response::Response;
use crate::time::Timestamp;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::time::{Duration, Instant};

/// A write, as queued for the writer. Keys are already encoded.
#[derive(Debug)]
pub(super) enum Op {
    Begin {
        key: Vec<u8>,
        fingerprint: Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    },
    Complete {
        key: Vec<u8>,
        claim: Claim,
        response: Response,
        now: Timestamp,
        retention: Duration,
    },
    Release {
        key: Vec<u8>,
        claim: Claim,
    },
    Sweep {
        now: Timestamp,
        max: usize,
    },
}

/// The writer's answer to one [`Op`].
#[derive(Debug)]
pub(super) enum Reply {
    Begin(Begin),
    Done,
    Swept(usize),
}

/// Where a caller waits for its answer.
pub(super) type ReplyTx = SyncSender<Result<Reply>>;

/// A batch's answers, each with the caller it goes to.
pub(super) type Answered = Vec<(ReplyTx, Result<Reply>)>;

/// What travels on the queue.
pub(super) enum Msg {
    Op(Op, ReplyTx),
    /// Finish what is queued before this, make everything durable, exit.
    Shutdown,
}

pub(super) struct Writer {
    pub(super) shared: Arc<Shared>,
    pub(super) rx: Receiver<Msg>,
    pub(super) token_hwm: u64,
    pub(super) durability: Durability,
    pub(super) max_batch: usize,
    /// Relaxed durability only: commits made since the last durable one.
    pub(super) unflushed: bool,
    pub(super) last_durable: Instant,
    /// The replier thread's queue (set by [`run`](Self::run)).
    pub(super) replier: Option<std::sync::mpsc::Sender<Answered>>,
}

/// Batches smaller than this are answered by the writer itself: handing
/// them to the replier would add a thread wake-up to each caller's wait.
const REPLIER_MIN_BATCH: usize = 4;

/// Sets the poison flag if the writer thread unwinds: its callers then see
/// [`Error::Poisoned`] rather than a bare [`Error::Closed`].
struct PoisonOnPanic<'a>(&'a Shared);

impl Drop for PoisonOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poisoned.store(true, Ordering::SeqCst);
        }
    }
}

impl Writer {
    /// The thread's body: runs until [`Msg::Shutdown`] or until every sender is gone.
    pub(super) fn run(mut self) {
        let shared = Arc::clone(&self.shared);
        let _guard = PoisonOnPanic(&shared);
        // Waking each caller is a futex syscall: for a large batch the
        // replier thread does it while this thread goes on with the next
        // batch (its fsync in particular). If it cannot be started, this
        // thread answers.
        let (answers_tx, answers_rx) = std::sync::mpsc::channel::<Answered>();
        let replier = std::thread::Builder::new()
            .name("idemstore-redb-replier".to_owned())
            .spawn(move || {
                for answers in answers_rx {
                    for (reply, answer) in answers {
                        // A caller that gave up waiting is not an error.
                        let _ = reply.send(answer);
                    }
                }
            })
            .ok();
        self.replier = replier.as_ref().map(|_| answers_tx);
        let mut batch: Vec<(Op, ReplyTx)> = Vec::with_capacity(self.max_batch);
        loop {
            let Some(first) = self.next() else { break };
            let mut shutdown = false;
            match first {
                Msg::Op(op, reply) => batch.push((op, reply)),
                Msg::Shutdown => shutdown = true,
            }
            while !shutdown && batch.len() < self.max_batch {
                match self.rx.try_recv() {
                    Ok(Msg::Op(op, reply)) => batch.push((op, reply)),
                    Ok(Msg::Shutdown) => shutdown = true,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            if !batch.is_empty() {
                self.run_batch(&mut batch);
            }
            if shutdown {
                break;
            }
        }
        // A clean shutdown leaves nothing only in memory.
        self.flush();
        // Every answer is delivered before the store's drop returns.
        self.replier = None;
        if let Some(replier) = replier {
            let _ = replier.join();
        }
    }

    /// The next message. Waits no longer than the next time-based durable
    /// commit: the loss window under relaxed durability, the checkpoint
    /// interval of the write-ahead log.
    fn next(&mut self) -> Option<Msg> {
        loop {
            let wait = match self.durability {
                Durability::Periodic { max_loss } if self.unflushed => {
                    Some(max_loss.saturating_sub(self.last_durable.elapsed()))
                }
                Durability::Periodic { .. } => None,
                Durability::Immediate => self
                    .shared
                    .lock_wal()
                    .as_ref()
                    .and_then(Wal::checkpoint_wait),
            };
            let Some(wait) = wait else {
                return self.rx.recv().ok();
            };
            match self.rx.recv_timeout(wait) {
                Ok(msg) => return Some(msg),
                Err(RecvTimeoutError::Timeout) => self.flush(),
                Err(RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// One empty durable commit covers the earlier ones: the non-durable
    /// commits of relaxed durability, and the logged batches (which it
    /// retires from the log).
    fn flush(&mut self) {
        if self.shared.poisoned.load(Ordering::SeqCst) {
            return;
        }
        let shared = Arc::clone(&self.shared);
        let mut wal = shared.lock_wal();
        let logged = wal.as_ref().is_some_and(Wal::is_dirty);
        if !self.unflushed && !logged {
            return;
        }
        let db = shared.read_db();
        let committed = db
            .begin_write()
            .map_err(engine)
            .and_then(|txn| shared.direct_commit(&mut wal, txn));
        match committed {
            Ok(()) => {
                self.unflushed = false;
                self.last_durable = Instant::now();
            }
            // Whether the earlier commits are on disk is now unknown.
            Err(_) => shared.poisoned.store(true, Ordering::SeqCst),
        }
    }

    fn run_batch(&mut self, batch: &mut Vec<(Op, ReplyTx)>) {
        let stats = &self.shared.stats;
        stats.batches.fetch_add(1, Ordering::Relaxed);
        stats
            .requests
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        stats
            .largest_batch
            .fetch_max(batch.len() as u64, Ordering::Relaxed);
        if self.shared.poisoned.load(Ordering::SeqCst) {
            for (_, reply) in batch.drain(..) {
                let _ = reply.send(Err(Error::Poisoned));
            }
            return;
        }
        match self.apply(batch) {
            Ok(answers) => {
                let answered: Answered = batch
                    .drain(..)
                    .map(|(_, reply)| reply)
                    .zip(answers)
                    .collect();
                self.answer(answered);
            }
            Err(BatchError {
                culprit,
                error,
                what,
            }) => {
                // Error is not Clone: the culprit (or the first caller) gets
                // the error itself, the others its message.
                let target = culprit.unwrap_or(0);
                let others = format!("{what}: {error}");
                let mut original = Some(error);
                for (i, (_, reply)) in batch.drain(..).enumerate() {
                    let err = if i == target { original.take() } else { None }
                        .unwrap_or_else(|| Error::backend(others.clone()));
                    let _ = reply.send(Err(err));
                }
            }
        }
    }

    /// Delivers a batch's answers: through the replier thread when the batch
    /// is large enough for that to pay, else here.
    fn answer(&self, answered: Answered) {
        let answered = match &self.replier {
            Some(replier) if answered.len() >= REPLIER_MIN_BATCH => match replier.send(answered) {
                Ok(()) => return,
                Err(std::sync::mpsc::SendError(back)) => back,
            },
            _ => answered,
        };
        for (reply, answer) in answered {
            // A caller that gave up waiting is not an error.
            let _ = reply.send(answer);
        }
    }

    /// One transaction for the whole batch. `Ok` holds one answer per request.
    fn apply(&mut self, batch: &[(Op, ReplyTx)]) -> Result<Vec<Result<Reply>>, BatchError> {
        let shared = Arc::clone(&self.shared);
        let whole = |error: Error, what| BatchError {
            culprit: None,
            error,
            what,
        };
        // Lock order: the log, then the database (see Shared::lock_wal).
        let mut wal = shared.lock_wal();
        let db = shared.read_db();
        let mut txn = db
            .begin_write()
            .map_err(|e| whole(engine(e), "could not start a write transaction"))?;
        let log = self.durability == Durability::Immediate && wal.is_some();

        // An inbox transaction (inbox.rs) may have handed out tokens since
        // the last batch: the committed mark wins over the one in memory.
        let committed = super::inbox::read_token_hwm(&txn)
            .map_err(|e| whole(e, "could not read the token high-water mark"))?;
        self.token_hwm = self.token_hwm.max(committed);
        let mut hwm = self.token_hwm;
        let mut dirty = false;
        let mut answers = Vec::with_capacity(batch.len());
        let (mut failed, mut journal) = {
            let opened = if log {
                WriteTables::journaled(&txn)
            } else {
                WriteTables::open(&txn)
            };
            let mut tables = match opened {
                Ok(t) => t,
                Err(e) => return Err(whole(e, "could not open the tables")),
            };
            let mut failed = None;
            for (i, (op, _)) in batch.iter().enumerate() {
                match step(&mut tables, op, &mut hwm, &mut dirty) {
                    Ok(reply) => answers.push(Ok(reply)),
                    Err(StepError::Request(e)) => answers.push(Err(e)),
                    Err(StepError::Storage(e)) => {
                        failed = Some((i, e));
                        break;
                    }
                }
            }
            (failed, tables.into_journal())
        };
        // The high-water mark moves in the same transaction as the claims.
        if failed.is_none() && hwm != self.token_hwm {
            match write_token_hwm(&txn, hwm) {
                Ok(()) => {
                    if let Some(journal) = &mut journal {
                        journal.meta_put(META_TOKEN_HWM, &hwm.to_be_bytes());
                    }
                }
                Err(StepError::Request(e) | StepError::Storage(e)) => {
                    failed = Some((usize::MAX, e))
                }
            }
        }
        if let Some((i, error)) = failed {
            // Half a pair may be written: nothing of this batch may commit.
            if txn.abort().is_err() {
                shared.poisoned.store(true, Ordering::SeqCst);
            }
            return Err(BatchError {
                culprit: (i != usize::MAX).then_some(i),
                error,
                what: "write batch aborted by a storage error in another request",
            });
        }
        if !dirty {
            // Only answers, no writes: nothing to make durable.
            let _ = txn.abort();
            return Ok(answers);
        }

        // How this batch becomes durable: by the log (one small append and
        // fdatasync, then a commit in memory), or by a durable commit (which
        // also checkpoints the log), or not yet (relaxed durability).
        let how = match (self.durability, wal.as_ref(), journal.as_ref()) {
            (Durability::Periodic { max_loss }, _, _) => {
                if self.last_durable.elapsed() >= max_loss {
                    How::Durable
                } else {
                    How::Later
                }
            }
            (Durability::Immediate, Some(w), Some(j)) if !w.needs_checkpoint(j.len()) => {
                How::Logged
            }
            (Durability::Immediate, _, _) => How::Durable,
        };
        let level = match how {
            How::Durable => ::redb::Durability::Immediate,
            How::Logged | How::Later => ::redb::Durability::None,
        };
        txn.set_durability(level)
            .map_err(|e| whole(engine(e), "could not set the durability"))?;
        let retire = how == How::Durable && wal.as_ref().is_some_and(Wal::is_dirty);
        if retire && let Some(w) = wal.as_ref() {
            w.stamp(&txn)
                .map_err(|e| whole(e, "could not write the log epoch"))?;
        }
        if how == How::Logged
            && let (Some(w), Some(j)) = (wal.as_mut(), journal.as_mut())
            && let Err(e) = w.append(j)
        {
            // The frame may or may not be on disk; the batch is not committed.
            let _ = txn.abort();
            shared.poisoned.store(true, Ordering::SeqCst);
            return Err(whole(
                e,
                "writing the log failed; the store is poisoned until reopened",
            ));
        }
        if let Err(e) = txn.commit() {
            // It may or may not be on disk: refuse every later write.
            shared.poisoned.store(true, Ordering::SeqCst);
            return Err(whole(
                engine(e),
                "commit failed; the store is poisoned until reopened",
            ));
        }
        if retire && let Some(w) = wal.as_mut() {
            w.checkpointed();
        }
        self.token_hwm = hwm;
        let stats = &shared.stats;
        let swept: usize = answers
            .iter()
            .map(|a| match a {
                Ok(Reply::Swept(n)) => *n,
                _ => 0,
            })
            .sum();
        stats.swept.fetch_add(swept as u64, Ordering::Relaxed);
        stats.commits.fetch_add(1, Ordering::Relaxed);
        match how {
            How::Durable => {
                stats.durable_commits.fetch_add(1, Ordering::Relaxed);
                self.unflushed = false;
                self.last_durable = Instant::now();
            }
            How::Logged => {
                stats.logged_commits.fetch_add(1, Ordering::Relaxed);
            }
            How::Later => self.unflushed = true,
        }
        Ok(answers)
    }
}

/// How a batch's commit is made durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    /// A durable redb commit (fsync), retiring the log's frames.
    Durable,
    /// A frame appended to the write-ahead log and synced, then a
    /// non-durable redb commit.
    Logged,
    /// A non-durable commit, made durable by a later one (relaxed durability).
    Later,
}

/// A failure that takes the whole batch down.
struct BatchError {
    /// The request that caused it (it gets `error` itself), or `None` when
    /// the batch as a whole failed (the first caller gets `error`).
    culprit: Option<usize>,
    error: Error,
    /// What the other callers are told happened.
    what: &'static str,
}

/// Applies one request inside the batch's transaction, deciding with
/// `logic::*` and writing record and index together.
fn step(
    tables: &mut WriteTables<'_>,
    op: &Op,
    hwm: &mut u64,
    dirty: &mut bool,
) -> Result<Reply, StepError> {
    match op {
        Op::Begin {
            key,
            fingerprint,
            now,
            lease,
            retention,
        } => {
            let existing = tables.read(key)?;
            let old_expiry = existing.as_ref().map(|r| r.expires_at);
            let last = *hwm;
            let decided = logic::begin(existing, fingerprint, *now, *lease, *retention, || {
                last.checked_add(1)
                    .ok_or_else(|| Error::invalid_argument("fencing tokens exhausted"))
            })?;
            if let Some(record) = decided.write {
                tables.put(key, old_expiry, &record)?;
                *hwm = record.token;
                *dirty = true;
            }
            Ok(Reply::Begin(decided.answer))
        }
        Op::Complete {
            key,
            claim,
            response,
            now,
            retention,
        } => {
            let existing = tables.read(key)?;
            let old_expiry = existing.as_ref().map(|r| r.expires_at);
            let record = logic::complete(existing, claim, response, *now, *retention)?;
            tables.put(key, old_expiry, &record)?;
            *dirty = true;
            Ok(Reply::Done)
        }
        Op::Release { key, claim } => {
            let existing = tables.read(key)?;
            let old_expiry = existing.as_ref().map(|r| r.expires_at);
            logic::release(existing, claim)?;
            if let Some(old_expiry) = old_expiry {
                tables.delete(key, old_expiry)?;
                *dirty = true;
            }
            Ok(Reply::Done)
        }
        Op::Sweep { now, max } => {
            // Decide everything first (reads can fail as a request error),
            // then delete (only storage errors from here on).
            let mut records = Vec::new();
            let mut stale = Vec::new();
            for index_key in tables.due(*now, *max)? {
                let (expires_at, key) = codec::decode_index(&index_key)?;
                match tables.read(key)? {
                    // Re-check the record itself: the index only nominates.
                    Some(r)
                        if r.expires_at == expires_at && logic::sweepable(r.expires_at, *now) =>
                    {
                        records.push((key.to_vec(), r.expires_at));
                    }
                    _ => stale.push(index_key),
                }
            }
            for (key, expires_at) in &records {
                tables.delete(key, *expires_at)?;
            }
            for index_key in &stale {
                tables.unindex(index_key)?;
            }
            *dirty |= !records.is_empty() || !stale.is_empty();
            Ok(Reply::Swept(records.len()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redb::{Counters, RedbStoreBuilder, open};
    use std::path::Path;
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc::{Receiver, sync_channel};
    use std::sync::{Mutex, RwLock};

    const T: Timestamp = Timestamp::from_millis(1_000_000);
    const D: Duration = Duration::from_secs(10);

    fn begin(id: &[u8]) -> Op {
        Op::Begin {
            key: id.to_vec(),
            fingerprint: Fingerprint::of(b"fp"),
            now: T,
            lease: D,
            retention: D,
        }
    }

    /// Queues `ops` and a shutdown, then runs the writer on this thread, so
    /// that all of them are one batch.
    fn run_one_batch(ops: Vec<Op>) -> (Vec<Result<Reply>>, Arc<Shared>) {
        let config = RedbStoreBuilder::default().config;
        let backend = ::redb::backends::InMemoryBackend::new();
        let opened = open::open_backend(backend, None, &config, Path::new("memory")).unwrap();
        let shared = Arc::new(Shared {
            db: RwLock::new(opened.db),
            poisoned: AtomicBool::new(false),
            stats: Counters::default(),
            wal: Mutex::new(None),
        });
        let (tx, rx) = sync_channel(64);
        let replies: Vec<Receiver<Result<Reply>>> = ops
            .into_iter()
            .map(|op| {
                let (reply_tx, reply_rx) = sync_channel(1);
                tx.send(Msg::Op(op, reply_tx)).unwrap();
                reply_rx
            })
            .collect();
        tx.send(Msg::Shutdown).unwrap();
        Writer {
            shared: Arc::clone(&shared),
            rx,
            token_hwm: opened.token_hwm,
            durability: Durability::Immediate,
            max_batch: 64,
            unflushed: false,
            last_durable: Instant::now(),
            replier: None,
        }
        .run();
        (replies.iter().map(|r| r.recv().unwrap()).collect(), shared)
    }

    #[test]
    fn one_batch_applies_in_order_and_a_bad_request_fails_alone() {
        let bogus = Claim {
            token: 99,
            lease_until: T,
            takeover: false,
            attempt: 1,
        };
        let (answers, shared) = run_one_batch(vec![
            begin(b"\0a"),
            // A duplicate in the same batch sees the claim made just before it.
            begin(b"\0a"),
            // Fails validation: it fails alone, the batch still commits.
            Op::Complete {
                key: b"\0b".to_vec(),
                claim: bogus,
                response: Response::new(200, ""),
                now: T,
                retention: D,
            },
            begin(b"\0c"),
        ]);
        let mut it = answers.into_iter();
        assert!(matches!(it.next(), Some(Ok(Reply::Begin(Begin::Claimed(c)))) if c.token == 1));
        assert!(matches!(
            it.next(),
            Some(Ok(Reply::Begin(Begin::InFlight { .. })))
        ));
        assert!(matches!(it.next(), Some(Err(Error::StaleClaim))));
        assert!(matches!(it.next(), Some(Ok(Reply::Begin(Begin::Claimed(c)))) if c.token == 2));
        let stats = &shared.stats;
        assert_eq!(stats.batches.load(Ordering::Relaxed), 1);
        assert_eq!(stats.commits.load(Ordering::Relaxed), 1);
        // The high-water mark was committed with the claims.
        let db = shared.read_db();
        let txn = ::redb::ReadableDatabase::begin_read(&*db).unwrap();
        let meta = txn.open_table(super::super::tables::META).unwrap();
        let hwm = meta
            .get(super::super::tables::META_TOKEN_HWM)
            .unwrap()
            .unwrap();
        assert_eq!(hwm.value(), 2u64.to_be_bytes().as_slice());
    }

    #[test]
    fn a_batch_of_answers_only_commits_nothing() {
        let (answers, shared) = run_one_batch(vec![Op::Sweep { now: T, max: 10 }]);
        assert!(matches!(answers.as_slice(), [Ok(Reply::Swept(0))]));
        assert_eq!(shared.stats.commits.load(Ordering::Relaxed), 0);
    }
}
