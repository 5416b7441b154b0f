//! [`Shared`]: what the callers and the background thread share, composed
//! of parts that each own their locks: [`Line`], [`Log`] (the commit
//! lock), [`Memory`] and [`Db`]. Here: the read path, flush, clean close,
//! and the commit line's data: a write as queued ([`Op`]), its answer
//! ([`Reply`]), the [`Slot`] where its caller waits, the [`InLine`] of them
//! and the line's sizes (its committer is `commit/committer.rs`).
//!
//! Lock order: the line's lock is never held while taking another;
//! otherwise the log, then the background lock, then the memtable, then
//! the engine. One exception, safe: a failure met while the memtable is
//! read-locked wakes the background thread (its lock); no writer of the
//! memtable waits for the background lock.

use super::db::Db;
use super::health::On;
use super::memtable::{self, Memory};
use super::record_log::LogWriter;
use super::tables::{self, META_LOG_STATE};
use super::{Config, Counters, Durability, open};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, Claim, Record};
use crate::response::Response;
use crate::step::Step;
use crate::sync::atomic::AtomicBool;
use crate::sync::{Arc, Condvar, Mutex, MutexGuard};
use crate::time::Timestamp;
use ::redb::StorageBackend;
use std::collections::VecDeque;
use std::path::Path;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// What the callers and the background thread share.
pub(super) struct Shared {
    pub(super) line: Line,
    pub(super) log: Log,
    pub(super) memory: Memory,
    pub(super) db: Db,
    pub(super) stats: Counters,
    /// `Some(path)` for a store opened read-only: every write is refused
    /// ([`Error::ReadOnly`]) before it reaches the commit path.
    pub(super) read_only: Option<String>,
}

/// The record log and the commit lock, and what relaxed durability needs
/// to sync the log later.
pub(super) struct Log {
    /// The commit lock: the committer holds it for a group, a direct
    /// transaction for its transaction.
    core: Mutex<Core>,
    /// Relaxed durability: frames written since the last sync.
    pub(super) unsynced: AtomicBool,
    /// The log file, for the background sync.
    pub(super) file: Arc<dyn StorageBackend>,
    pub(super) durability: Durability,
}

/// What only the holder of the commit lock touches.
pub(super) struct Core {
    pub(super) writer: LogWriter,
    /// The largest fencing token handed out.
    pub(super) token_hwm: u64,
}

impl Log {
    // A panic while committing poisons the store, so a poisoned lock is taken
    // as it is (as every lock of the store's).
    pub(super) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Shared {
    pub(super) fn new(opened: open::Opened, config: &Config, path: Option<&Path>) -> Arc<Shared> {
        let db = Db::new(opened.db, opened.source, opened.witness, config, path);
        Arc::new(Shared {
            line: Line::default(),
            log: Log {
                file: opened.recovered.wal.file(),
                core: Mutex::new(Core {
                    writer: opened.recovered.wal,
                    token_hwm: opened.recovered.token_hwm,
                }),
                unsynced: AtomicBool::new(false),
                durability: config.durability,
            },
            memory: Memory::new(config.checkpoint_interval),
            stats: Counters::default(),
            read_only: config.read_only.then(|| db.file_name(On::Store)),
            db,
        })
    }

    /// The latest state of `key_bytes`: the memtable, then redb (verified).
    pub(super) fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>> {
        self.read_counted(key_bytes).map(|(record, _)| record)
    }

    /// [`read`](Self::read), with the count of redb commits that redb was
    /// read under (`None`: the memtable answered). A key absent under
    /// count `c` is still absent while the count is `c` and the memtable
    /// does not hold it (db.rs): a write reaches redb only through a
    /// counted commit, and leaves the memtable only after it is counted.
    pub(super) fn read_counted(&self, key_bytes: &[u8]) -> Result<(Option<Record>, Option<u64>)> {
        if let Some(entry) = self.memory.read_mem().get(key_bytes) {
            return Ok((memtable::decode(key_bytes, entry)?, None));
        }
        // Counted after the memtable was read (db.rs).
        let seen = self.db.snapshot.count();
        self.db
            .read_tables(seen, |tables| tables.read(key_bytes))
            .and_then(|read| read)
            .map(|record| (record, Some(seen)))
            .map_err(|e| self.engine_failed("read", e))
    }

    /// An engine error met `during` an operation: an I/O error (after which
    /// redb refuses every use until reopened) poisons the store, so that it
    /// heals; a store already poisoned answers with its cause.
    pub(super) fn engine_failed(&self, during: &'static str, error: Error) -> Error {
        match error {
            Error::Io(_) if self.db.health.is_poisoned() => self.db.poisoned_error(),
            Error::Io(_) => self.fail(during, On::Store, error),
            other => other,
        }
    }

    /// Poisons the store with `error` (see [`Db::poison`]) and wakes the
    /// background thread, which heals (it may be asleep for long).
    pub(super) fn fail(&self, during: &'static str, on: On, error: Error) -> Error {
        let error = self.db.poison(during, on, error);
        self.memory.wake_background();
        error
    }

    /// Makes everything in memory durable in redb and retires the log.
    pub(super) fn flush(&self) -> Result<()> {
        self.flush_locked(&mut self.log.lock())
    }

    /// The last commit of a clean stop: memory goes into the file durably,
    /// and the same commit marks the log closed ([`META_LOG_STATE`]), so
    /// the next open needs nothing from it. A read-only view writes nothing.
    pub(super) fn close(&self) -> Result<()> {
        self.direct(|t, _| t.set_meta(META_LOG_STATE, &[tables::LOG_CLOSED]))
    }

    /// [`flush`](Self::flush) with the commit lock held.
    pub(super) fn flush_locked(&self, core: &mut Core) -> Result<()> {
        if !self.memory.read_mem().is_empty() || core.writer.is_dirty() {
            self.direct_locked(core, true, |_, _| Ok::<_, Error>(()))?;
        }
        Ok(())
    }
}

/// The line of callers waiting to commit, and its wake-ups.
#[derive(Default)]
pub(super) struct Line {
    callers: Mutex<InLine>,
    /// Signalled when the committer takes a group out of a full line.
    pub(super) room: Condvar,
    /// Wakes the committer thread (commit/committer.rs): a caller joined an
    /// empty line, or the line closes.
    pub(super) committer: Condvar,
}

impl Line {
    pub(super) fn lock(&self) -> MutexGuard<'_, InLine> {
        self.callers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A write in line. Keys are already encoded.
#[derive(Debug)]
pub(super) enum Op {
    Begin {
        key: Vec<u8>,
        fingerprint: Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
        /// The count of redb commits under which the fast path found no
        /// record of the key ([`Shared::read_counted`]): while the count
        /// is the same, the committer need not ask redb again.
        absent_at: Option<u64>,
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
    Renew {
        key: Vec<u8>,
        claim: Claim,
        now: Timestamp,
        lease: Duration,
    },
    Step {
        key: Vec<u8>,
        claim: Claim,
        step: Step,
        now: Timestamp,
    },
    Sweep {
        now: Timestamp,
        max: usize,
    },
}

/// The answer to one [`Op`].
#[derive(Debug)]
pub(super) enum Reply {
    /// With the op's key, back to its caller's thread: a claim whose
    /// caller has gone is released with it (commit/committer.rs).
    Begin(Begin, Vec<u8>),
    Done,
    Renewed(Claim),
    Swept(usize),
}

/// Requests that may wait in a store's line (a caller that finds it full waits).
pub(crate) const WRITE_QUEUE_DEPTH: usize = 4_096;
/// Most requests the committer commits in one group (one log frame).
pub(crate) const MAX_GROUP_OPS: usize = 1_024;

/// Where one queued caller waits: a thread on the condvar, a task
/// through its waker.
#[derive(Debug, Default)]
pub(in crate::redb) struct Slot {
    state: Mutex<SlotInner>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct SlotInner {
    answer: Option<Result<Reply>>,
    /// A task's waker, from its latest poll.
    waker: Option<Waker>,
    /// Nobody will take the answer (a dropped future, a release nobody
    /// waits for): the committer keeps it (see [`Slot::answer`]).
    abandoned: bool,
}

impl Slot {
    /// A slot whose answer nobody waits for.
    pub(in crate::redb) fn unseen() -> Slot {
        let slot = Slot::default();
        slot.lock().abandoned = true;
        slot
    }

    fn lock(&self) -> MutexGuard<'_, SlotInner> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sleeps until this (thread) caller is answered.
    pub(in crate::redb) fn wait(&self) -> Result<Reply> {
        let mut inner = self.lock();
        loop {
            if let Some(answer) = inner.answer.take() {
                return answer;
            }
            inner = self.cv.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Hands the caller its answer and wakes it. An abandoned slot's answer
    /// comes back: nobody else will see it.
    pub(in crate::redb) fn answer(&self, answer: Result<Reply>) -> Option<Result<Reply>> {
        let waker = {
            let mut inner = self.lock();
            if inner.abandoned {
                return Some(answer);
            }
            inner.answer = Some(answer);
            inner.waker.take()
        };
        match waker {
            Some(waker) => waker.wake(),
            None => self.cv.notify_one(),
        }
        None
    }

    /// A task's poll: its answer, or `Pending` with its waker kept.
    pub(in crate::redb) fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<Reply>> {
        let mut inner = self.lock();
        if let Some(answer) = inner.answer.take() {
            return Poll::Ready(answer);
        }
        match &inner.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => inner.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// A dropped future gives its slot up: the answer if it came already
    /// (its caller must deal with it), or `None` and the committer will.
    pub(in crate::redb) fn abandon(&self) -> Option<Result<Reply>> {
        let mut inner = self.lock();
        inner.abandoned = true;
        inner.waker = None;
        inner.answer.take()
    }
}

/// The line of callers.
#[derive(Debug, Default)]
pub(in crate::redb) struct InLine {
    pub(in crate::redb) waiting: VecDeque<(Op, Arc<Slot>)>,
    /// The committer is at work, or has been woken to work: whoever joins
    /// the line need not wake it.
    pub(in crate::redb) awake: bool,
    /// The store is being dropped: no caller joins the line any more.
    pub(in crate::redb) closed: bool,
    /// The committer has stopped: nothing joins the line at all.
    pub(in crate::redb) stopped: bool,
    /// Tasks waiting for room in a full line.
    pub(in crate::redb) room: Vec<Waker>,
}
