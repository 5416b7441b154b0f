//! The commit path: leader/follower group commit (LevelDB's write queue).
//!
//! A caller queues its request. The first caller in line becomes the
//! *leader* on its own thread: it takes the waiting group (up to
//! [`MAX_WRITE_BATCH`](super::MAX_WRITE_BATCH)), decides each request in
//! order with the one state machine (`logic`), appends one frame to the
//! write-ahead log, `fdatasync`s it, publishes the group's records into the
//! memtable, hands the leader role to the next caller in line and wakes
//! its followers. A lone caller pays no thread hand-off; under load the
//! role moves from caller to caller.
//!
//! Futures (the native async entry, native.rs) join the same line but
//! never lead: a runtime thread must not wait on an fsync. The role goes
//! to the first blocked thread in line, and when the line holds only
//! futures, to the store's one committer thread; a leader wakes each
//! future's task when its group is durable. So the threads involved are the
//! blocked callers plus one, however many futures wait.
//!
//! Requests in one group apply in order: a duplicate later in a group sees
//! the claim made earlier in it (the group's own writes are an overlay on
//! the memtable and redb).
//!
//! Durability reasoning:
//!
//! - nobody is answered, and no reader sees a group, before its frame is
//!   durable: the memtable is published after the log's `fdatasync`;
//! - a frame that cannot be written or synced may or may not be on disk:
//!   every caller in the group gets the error, nothing is published, and
//!   the store is poisoned (every later write is [`Error::Poisoned`], with the cause) until
//!   it heals (health.rs, heal.rs: the log is replayed as an open would);
//! - a request that fails while being decided (stale claim, corrupt record,
//!   an invariant check, a read error) fails alone and writes nothing;
//! - a panic while leading poisons the store and answers the whole group,
//!   so no follower waits forever.
//!
//! Without a log (`write_ahead_log(false)` or a bare storage backend) the
//! leader applies the group to a redb write transaction and commits it
//! durably (or, under [`Durability::Periodic`], in memory, made durable by
//! the background thread within the loss window).

use super::errors::engine;
use super::health::On;
use super::memtable::{Entry, MEMTABLE_BYTES, Mem};
use super::record_log::{Journal, Wal};
use super::tables::{META, META_TOKEN_HWM, META_WAL_EPOCH, ReadTables, Source, WriteTables};
use super::{Durability, Shared};
use crate::codec;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::logic;
use crate::record::{Begin, Claim, Record};
use crate::response::Response;
use crate::sync::atomic::Ordering;
use crate::sync::{Arc, Condvar, Instant, Mutex, MutexGuard};
use crate::time::Timestamp;
use ::redb::{ReadableDatabase, WriteTransaction};
use std::collections::{BTreeMap, VecDeque};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// A write, as queued. Keys are already encoded.
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

/// The answer to one [`Op`].
#[derive(Debug)]
pub(super) enum Reply {
    Begin(Begin),
    Done,
    Swept(usize),
}

/// Who waits on a [`Slot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Waiter {
    /// A blocked thread (`submit`): it may be made the leader.
    #[default]
    Thread,
    /// A future (`submit_async`, native.rs): woken through its waker; it
    /// never leads, since leading would block its runtime thread on an fsync.
    Task,
    /// Nobody: a release queued on behalf of a dropped future.
    Nobody,
}

/// Where one queued caller waits.
#[derive(Debug, Default)]
pub(super) struct Slot {
    state: Mutex<SlotInner>,
    cv: Condvar,
    waiter: Waiter,
}

#[derive(Debug, Default)]
struct SlotInner {
    state: SlotState,
    /// A task's waker, from its latest poll.
    waker: Option<Waker>,
    /// Nobody will take the answer (a dropped future, a detached op): the
    /// leader keeps it (see [`Slot::answer`]).
    abandoned: bool,
}

#[derive(Debug, Default)]
enum SlotState {
    #[default]
    Waiting,
    /// The caller is now the leader.
    Lead,
    Done(Result<Reply>),
}

impl Slot {
    pub(super) fn new(waiter: Waiter) -> Slot {
        Slot {
            state: Mutex::new(SlotInner {
                abandoned: waiter == Waiter::Nobody,
                ..SlotInner::default()
            }),
            cv: Condvar::new(),
            waiter,
        }
    }

    fn lock(&self) -> MutexGuard<'_, SlotInner> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sleeps until this caller is answered (`Some`) or made the leader
    /// (`None`).
    fn wait(&self) -> Option<Result<Reply>> {
        let mut inner = self.lock();
        loop {
            match std::mem::take(&mut inner.state) {
                SlotState::Waiting => {
                    inner = self.cv.wait(inner).unwrap_or_else(|p| p.into_inner());
                }
                SlotState::Lead => return None,
                SlotState::Done(answer) => return Some(answer),
            }
        }
    }

    /// Makes this (thread) caller the leader.
    fn lead(&self) {
        self.lock().state = SlotState::Lead;
        self.cv.notify_one();
    }

    /// Hands the caller its answer and wakes it. An abandoned slot's answer
    /// comes back: nobody else will see it.
    fn answer(&self, answer: Result<Reply>) -> Option<Result<Reply>> {
        let waker = {
            let mut inner = self.lock();
            if inner.abandoned {
                return Some(answer);
            }
            inner.state = SlotState::Done(answer);
            inner.waker.take()
        };
        match waker {
            Some(waker) => waker.wake(),
            None => self.cv.notify_one(),
        }
        None
    }

    /// A task's poll: its answer, or `Pending` with its waker kept.
    pub(super) fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<Reply>> {
        let mut inner = self.lock();
        match std::mem::take(&mut inner.state) {
            SlotState::Done(answer) => Poll::Ready(answer),
            other => {
                inner.state = other;
                match &inner.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => inner.waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }

    /// A dropped future gives its slot up: the answer if it came already
    /// (its caller must deal with it), or `None` and the leader will.
    pub(super) fn abandon(&self) -> Option<Result<Reply>> {
        let mut inner = self.lock();
        inner.abandoned = true;
        inner.waker = None;
        match std::mem::take(&mut inner.state) {
            SlotState::Done(answer) => Some(answer),
            _ => None,
        }
    }
}

/// The line of callers.
#[derive(Debug, Default)]
pub(super) struct Queue {
    pub(super) waiting: VecDeque<(Op, Arc<Slot>)>,
    /// Someone holds the leader role. When false the line is empty, so a
    /// caller that finds no leader is at the front of the line.
    leading: bool,
    /// Threads ([`Waiter::Thread`]) in the line: only they, or the
    /// committer, can take the role.
    threads: usize,
    /// The committer thread holds the role (native.rs).
    pub(super) committer: bool,
    /// The store is being dropped: no caller joins the line any more.
    pub(super) closed: bool,
    /// The committer has stopped: nothing joins the line at all.
    pub(super) stopped: bool,
    /// Tasks waiting for room in a full line.
    pub(super) room: Vec<Waker>,
}

/// What only the leader (or a direct transaction) touches: held for the
/// whole of a group's commit. Lock order: the queue is never held while
/// taking this; this, then the memtable, then the database.
#[derive(Debug)]
pub(super) struct Core {
    pub(super) wal: Option<Wal>,
    /// The largest fencing token handed out.
    pub(super) token_hwm: u64,
    /// No log, relaxed durability: commits made since the last durable one.
    pub(super) unflushed: bool,
    pub(super) last_durable: Instant,
}

impl Shared {
    /// [`Error::ReadOnly`] for a store opened read-only.
    pub(super) fn check_writable(&self) -> Result<()> {
        match &self.read_only {
            Some(path) => Err(Error::ReadOnly { path: path.clone() }),
            None => Ok(()),
        }
    }

    /// The checks before a request joins the line: writable, not poisoned.
    pub(super) fn check_submit(&self) -> Result<()> {
        self.check_writable()?;
        self.check_healthy()
    }

    /// Queues `op` and returns its answer, leading groups while this caller
    /// is at the front of the line. A full line (`WRITE_QUEUE_DEPTH`) waits
    /// for room.
    pub(super) fn submit(&self, op: Op) -> Result<Reply> {
        self.check_submit()?;
        let mine = Arc::new(Slot::new(Waiter::Thread));
        let lead = {
            let mut q = self.lock_queue();
            while q.waiting.len() >= super::WRITE_QUEUE_DEPTH && !q.closed {
                q = self.queue_room.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if q.closed {
                return Err(Error::Closed);
            }
            let lead = !q.leading;
            self.push(&mut q, op, Arc::clone(&mine));
            lead
        };
        if !lead && let Some(answer) = mine.wait() {
            return answer;
        }
        loop {
            if let Some(answer) = self.lead_once(Some(&mine)) {
                return answer;
            }
            // Not in this group (the line was longer than a group): wait
            // for the role to come back, or for an answer.
            if let Some(answer) = mine.wait() {
                return answer;
            }
        }
    }

    /// Puts `op` at the back of the line. A thread that finds no leader
    /// takes the role itself (its caller leads); a task or a detached op
    /// hands it to the committer thread.
    pub(super) fn push(&self, q: &mut Queue, op: Op, slot: Arc<Slot>) {
        let waiter = slot.waiter;
        q.waiting.push_back((op, slot));
        if waiter == Waiter::Thread {
            q.threads += 1;
        }
        if !std::mem::replace(&mut q.leading, true) && waiter != Waiter::Thread {
            self.wake_committer(q);
        }
    }

    /// Gives the leader role to the committer thread.
    fn wake_committer(&self, q: &mut Queue) {
        if !std::mem::replace(&mut q.committer, true) {
            self.committer_cv.notify_one();
        }
    }

    /// Queues a release nobody waits for (a dropped future's claim); the
    /// committer leads it if no one else does. Nothing is queued once the
    /// committer has stopped: the claim then ends with its lease.
    pub(super) fn detach(&self, op: Op) {
        let mut q = self.lock_queue();
        if !q.stopped {
            self.push(&mut q, op, Arc::new(Slot::new(Waiter::Nobody)));
        }
    }

    /// One turn of the role: commits the group at the front of the line,
    /// passes the role on, answers the group. Returns `mine`'s answer when
    /// it was in the group.
    pub(super) fn lead_once(&self, mine: Option<&Arc<Slot>>) -> Option<Result<Reply>> {
        let (group, room) = {
            let mut q = self.lock_queue();
            let full = q.waiting.len() >= super::WRITE_QUEUE_DEPTH;
            let n = q.waiting.len().min(self.max_batch);
            let group: Vec<(Op, Arc<Slot>)> = q.waiting.drain(..n).collect();
            let threads = group
                .iter()
                .filter(|(_, s)| s.waiter == Waiter::Thread)
                .count();
            q.threads = q.threads.saturating_sub(threads);
            // A notify is a syscall even with nobody waiting: only a
            // full line can have callers waiting for room.
            if full {
                self.queue_room.notify_all();
            }
            (
                group,
                if full {
                    std::mem::take(&mut q.room)
                } else {
                    Vec::new()
                },
            )
        };
        room.into_iter().for_each(Waker::wake);
        let (ops, slots): (Vec<Op>, Vec<Arc<Slot>>) = group.into_iter().unzip();
        // A dropped future can empty the line under the committer.
        let answers = if ops.is_empty() {
            Vec::new()
        } else {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.commit_group(&ops)))
                .unwrap_or_else(|_| {
                    // A bug while leading: what was written is unknown.
                    let error = Error::backend("a panic while committing a group");
                    let error = self.fail("commit", On::Store, error);
                    ops.iter().map(|_| Err(error.replicate())).collect()
                })
        };
        // Pass the role on first: the next group's commit overlaps the
        // wake-ups of this one's followers.
        self.pass_role(&mut self.lock_queue());
        let mut own = None;
        for ((op, slot), answer) in ops.into_iter().zip(slots).zip(answers) {
            if mine.is_some_and(|m| Arc::ptr_eq(m, &slot)) {
                own = Some(answer);
            } else if let Some(unseen) = slot.answer(answer) {
                // Its future was dropped while the group committed: a claim
                // nobody will see is given back at once.
                if let (Op::Begin { key, .. }, Ok(Reply::Begin(Begin::Claimed(claim)))) =
                    (op, unseen)
                {
                    self.detach(Op::Release { key, claim });
                }
            }
        }
        own
    }

    /// The role goes to the first thread in line (it is blocked anyway),
    /// else to the committer while the line holds tasks, else to nobody.
    fn pass_role(&self, q: &mut Queue) {
        if q.waiting.is_empty() {
            q.leading = false;
            q.committer = false;
            return;
        }
        if q.threads > 0
            && let Some((_, next)) = q.waiting.iter().find(|(_, s)| s.waiter == Waiter::Thread)
        {
            q.committer = false;
            next.lead();
            return;
        }
        self.wake_committer(q);
    }

    /// One group, under the commit lock: an answer per op.
    fn commit_group(&self, ops: &[Op]) -> Vec<Result<Reply>> {
        let stats = &self.stats;
        stats.batches.fetch_add(1, Ordering::Relaxed);
        stats
            .requests
            .fetch_add(ops.len() as u64, Ordering::Relaxed);
        stats
            .largest_batch
            .fetch_max(ops.len() as u64, Ordering::Relaxed);
        let mut core = self.lock_core();
        if let Err(refused) = self.check_healthy() {
            return ops.iter().map(|_| Err(refused.replicate())).collect();
        }
        let result = if core.wal.is_some() {
            self.commit_logged(&mut core, ops)
        } else {
            self.commit_direct(&mut core, ops)
        };
        match result {
            Ok(answers) => {
                // A request that failed on an I/O error of the engine's
                // (a read while deciding) leaves redb refusing every later
                // use until it is reopened: the store heals.
                if let Some(Err(e @ Error::Io(_))) =
                    answers.iter().find(|a| matches!(a, Err(Error::Io(_))))
                {
                    self.fail("read", On::Store, e.replicate());
                }
                answers
            }
            Err(error) => ops.iter().map(|_| Err(error.replicate())).collect(),
        }
    }

    /// With the log: decide against memtable + redb, one frame, publish.
    fn commit_logged(&self, core: &mut Core, ops: &[Op]) -> Result<Vec<Result<Reply>>> {
        let mut hwm = core.token_hwm;
        let decided = {
            // The memtable first, then the read transaction (see memtable.rs).
            let mem = self.read_mem();
            let db = self.read_db()?;
            let txn = db
                .begin_read()
                .map_err(|e| self.engine_failed("read", engine(e)))?;
            let base = ReadTables::open(&txn).map_err(|e| self.engine_failed("read", e))?;
            decide(ops, Some(&mem), &base, &mut hwm, true)
        };
        if decided.writes.is_empty() {
            return Ok(decided.answers);
        }
        let mut journal = decided.journal.unwrap_or_default();
        if hwm != core.token_hwm {
            journal.meta_put(META_TOKEN_HWM, &hwm.to_be_bytes());
        }
        let sync = self.durability == Durability::Immediate;
        let n = journal.len();
        let (fits_a_segment, fits_here) = core
            .wal
            .as_ref()
            .map_or((false, false), |w| (w.fits_at_all(n), w.fits(n)));
        if !fits_a_segment {
            // Larger than a whole segment: straight into redb, durably,
            // with everything in memory before it.
            let writes = decided.writes;
            self.direct_locked(core, |txn, token_hwm| {
                let mut tables = WriteTables::open(txn)?;
                for (key, entry) in &writes {
                    tables.apply(key, entry.as_ref())?;
                }
                *token_hwm = (*token_hwm).max(hwm);
                Ok::<_, Error>(())
            })?;
            return Ok(decided.answers);
        }
        if !fits_here {
            self.freeze(core)?;
        }
        let Some(wal) = core.wal.as_mut() else {
            return Err(Error::backend("the write-ahead log is gone"));
        };
        let appending = Instant::now();
        if let Err(e) = wal.append(&mut journal, sync) {
            // The frame may or may not be on disk. Its tokens are never
            // handed out again (a heal replays what reached the log).
            core.token_hwm = hwm;
            return Err(self.fail("log append", On::Log, e));
        }
        let (log_sync, log_fill) = (appending.elapsed(), wal.fill());
        if !sync {
            self.log_unsynced.store(true, Ordering::SeqCst);
        }
        let (bytes, first) = {
            let mut mem = self.write_mem();
            let first = mem.active.is_empty();
            mem.publish(decided.writes);
            (mem.active_bytes, first)
        };
        if first {
            // The memtable's age counts from its first record; the
            // background thread (asleep with nothing in memory) times the
            // next checkpoint from it.
            self.start_memtable_clock();
            self.wake_background();
        }
        core.token_hwm = hwm;
        self.stats.commits.fetch_add(1, Ordering::Relaxed);
        self.stats.logged_commits.fetch_add(1, Ordering::Relaxed);
        self.stats
            .swept
            .fetch_add(decided.swept as u64, Ordering::Relaxed);
        crate::observability::group_committed(ops.len(), log_sync, bytes, log_fill);
        crate::observability::swept("redb", decided.swept);
        // Hand the memtable to the checkpointer when it is large enough,
        // or old enough, and the checkpointer is free. Past twice the
        // budget, wait for it (back-pressure on memory).
        let free = self.read_mem().frozen.is_none();
        let due = bytes >= MEMTABLE_BYTES || self.checkpoint_due();
        if (due && free) || bytes >= 2 * MEMTABLE_BYTES {
            self.freeze(core)?;
        }
        Ok(decided.answers)
    }

    /// Without the log: the group is one redb write transaction.
    fn commit_direct(&self, core: &mut Core, ops: &[Op]) -> Result<Vec<Result<Reply>>> {
        let mut hwm = core.token_hwm;
        let db = self.write_ready_db()?;
        let mut txn = db
            .begin_write()
            .map_err(|e| self.engine_failed("commit", engine(e)))?;
        let decided = {
            let tables = WriteTables::open(&txn)?;
            decide(ops, None, &tables, &mut hwm, false)
        };
        if decided.writes.is_empty() && decided.stale.is_empty() {
            let _ = txn.abort();
            return Ok(decided.answers);
        }
        let written = (|| -> Result<()> {
            let mut tables = WriteTables::open(&txn)?;
            for (key, entry) in &decided.writes {
                tables.apply(key, entry.as_ref())?;
            }
            for index_key in &decided.stale {
                tables.unindex(index_key)?;
            }
            drop(tables);
            if hwm != core.token_hwm {
                let mut meta = txn.open_table(META).map_err(engine)?;
                meta.insert(META_TOKEN_HWM, hwm.to_be_bytes().as_slice())
                    .map_err(engine)?;
            }
            Ok(())
        })();
        if let Err(e) = written {
            // A storage failure while writing (redb may sync while it
            // allocates): what reached the disk is unknown.
            let _ = txn.abort();
            return Err(self.fail("commit", On::Store, e));
        }
        let durable = match self.durability {
            Durability::Periodic { max_loss } => core.last_durable.elapsed() >= max_loss,
            Durability::Immediate => true,
        };
        let level = if durable {
            ::redb::Durability::Immediate
        } else {
            ::redb::Durability::None
        };
        txn.set_durability(level).map_err(engine)?;
        txn.set_quick_repair(durable);
        if let Err(e) = txn.commit() {
            // It may or may not be on disk: refuse every later write.
            return Err(self.fail("commit", On::Store, engine(e)));
        }
        core.token_hwm = hwm;
        self.stats.commits.fetch_add(1, Ordering::Relaxed);
        self.stats
            .swept
            .fetch_add(decided.swept as u64, Ordering::Relaxed);
        crate::observability::swept("redb", decided.swept);
        if durable {
            self.stats.durable_commits.fetch_add(1, Ordering::Relaxed);
            core.unflushed = false;
            core.last_durable = Instant::now();
        } else {
            core.unflushed = true;
        }
        Ok(decided.answers)
    }

    /// Hands the active memtable to the checkpointer: waits for the
    /// previous checkpoint to finish, freezes, and moves the log to the
    /// next epoch (the other segment). Nothing to do when nothing was
    /// logged since the last checkpoint.
    pub(super) fn freeze(&self, core: &mut Core) -> Result<()> {
        self.wait_checkpointed()?;
        let Some(wal) = core.wal.as_mut() else {
            return Ok(());
        };
        {
            let mut mem = self.write_mem();
            if mem.active.is_empty() && !wal.is_dirty() {
                return Ok(());
            }
            mem.freeze(wal.epoch(), core.token_hwm);
        }
        wal.rotate();
        self.start_memtable_clock();
        self.wake_background();
        Ok(())
    }

    /// Runs `f` in a durable write transaction of its own (the inbox, the
    /// admin evict and import, compaction, a group too large for the log),
    /// outside the line but under the commit lock.
    ///
    /// The transaction first takes in every record the memtable holds (it
    /// waits for a running checkpoint), so `f` reads the current state;
    /// then it retires the log's frames (a new epoch), since replaying
    /// older frames over `f`'s writes would undo them. `f` gets the token
    /// high-water mark to hand out tokens from. An error from `f` aborts
    /// everything; a failed commit poisons the store.
    pub(super) fn direct<T, E: From<Error>>(
        &self,
        f: impl FnOnce(&WriteTransaction, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        let mut core = self.lock_core();
        self.direct_locked(&mut core, f)
    }

    /// [`direct`](Self::direct) with the commit lock already held.
    pub(super) fn direct_locked<T, E: From<Error>>(
        &self,
        core: &mut Core,
        f: impl FnOnce(&WriteTransaction, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        self.direct_locked_with(core, true, f)
    }

    /// [`direct_locked`](Self::direct_locked), choosing redb's quick-repair
    /// for the commit. On (every caller but an inbox that switched it off):
    /// redb saves its allocator state with the commit and commits in two
    /// phases (two fsyncs), so an open after a crash does not walk the
    /// file. Off: one fsync (redb's one-phase commit with checksums, as
    /// durable), and an open after a crash that follows it walks the file
    /// (redb's full repair).
    pub(super) fn direct_locked_with<T, E: From<Error>>(
        &self,
        core: &mut Core,
        quick_repair: bool,
        f: impl FnOnce(&WriteTransaction, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        self.check_writable()?;
        self.check_healthy()?;
        self.wait_checkpointed()?;
        let db = self.write_ready_db()?;
        let mut txn = db
            .begin_write()
            .map_err(|e| self.engine_failed("commit", engine(e)))?;
        txn.set_durability(::redb::Durability::Immediate)
            .map_err(engine)?;
        txn.set_quick_repair(quick_repair);
        {
            let mem = self.read_mem();
            let mut tables = WriteTables::open(&txn)?;
            for (key, entry) in &mem.active {
                tables.apply(key, entry.as_ref())?;
            }
        }
        let mut hwm = core.token_hwm;
        let out = f(&txn, &mut hwm)?;
        let hwm = hwm.max(core.token_hwm);
        {
            let mut meta = txn.open_table(META).map_err(engine)?;
            meta.insert(META_TOKEN_HWM, hwm.to_be_bytes().as_slice())
                .map_err(engine)?;
            if let Some(wal) = &core.wal {
                let next = wal.epoch().wrapping_add(1);
                meta.insert(META_WAL_EPOCH, next.to_be_bytes().as_slice())
                    .map_err(engine)?;
            }
        }
        if let Err(e) = txn.commit() {
            return Err(self.fail("commit", On::Store, engine(e)).into());
        }
        core.token_hwm = hwm;
        core.unflushed = false;
        core.last_durable = Instant::now();
        {
            let mut mem = self.write_mem();
            mem.active.clear();
            mem.active_bytes = 0;
        }
        if let Some(wal) = core.wal.as_mut() {
            wal.rotate();
        }
        self.start_memtable_clock();
        self.stats.commits.fetch_add(1, Ordering::Relaxed);
        self.stats.durable_commits.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }

    /// Waits until no frozen memtable is waiting for its checkpoint.
    pub(super) fn wait_checkpointed(&self) -> Result<()> {
        let mut bg = self.lock_bg();
        loop {
            self.check_healthy()?;
            if self.read_mem().frozen.is_none() {
                return Ok(());
            }
            bg = self.bg_cv.wait(bg).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// What deciding a group produced.
#[derive(Debug, Default)]
pub(super) struct Decided {
    /// One per op, in order.
    pub(super) answers: Vec<Result<Reply>>,
    /// Each written key's final state (a deletion is `None`).
    pub(super) writes: BTreeMap<Vec<u8>, Entry>,
    /// The writes in the order they were made, for the log.
    pub(super) journal: Option<Journal>,
    /// Expiry-index entries whose record no longer matches (no log only:
    /// with the log, redb's index lags the memtable by design).
    pub(super) stale: Vec<Vec<u8>>,
    /// Records deleted by sweeps.
    pub(super) swept: usize,
}

/// Decides every op of a group in order, against the group's own earlier
/// writes, then `mem`, then `base`. Writes nothing anywhere: the caller
/// makes [`Decided::writes`] durable.
pub(super) fn decide(
    ops: &[Op],
    mem: Option<&Mem>,
    base: &dyn Source,
    hwm: &mut u64,
    journal: bool,
) -> Decided {
    let mut group = Group {
        mem,
        base,
        out: Decided {
            journal: journal.then(Journal::default),
            ..Decided::default()
        },
    };
    for op in ops {
        let answer = group.step(op, hwm);
        group.out.answers.push(answer);
    }
    group.out
}

struct Group<'a> {
    mem: Option<&'a Mem>,
    base: &'a dyn Source,
    out: Decided,
}

impl Group<'_> {
    /// The current state of `key`: this group's writes, the memtable, redb.
    fn current(&self, key: &[u8]) -> Result<Option<Record>> {
        if let Some(entry) = self.out.writes.get(key) {
            return Ok(entry.clone());
        }
        if let Some(entry) = self.mem.and_then(|m| m.get(key)) {
            return Ok(entry.clone());
        }
        self.base.read(key)
    }

    /// True when redb's copy of `key` is hidden by a newer one in memory.
    fn shadowed(&self, key: &[u8]) -> bool {
        self.out.writes.contains_key(key) || self.mem.is_some_and(|m| m.get(key).is_some())
    }

    fn put(&mut self, key: &[u8], record: Record) -> Result<()> {
        // Encoded (and its invariants checked) before anything is kept.
        let value = codec::encode_record(&record)?;
        if let Some(journal) = &mut self.out.journal {
            journal.record_put(key, &value);
        }
        self.out.writes.insert(key.to_vec(), Some(record));
        Ok(())
    }

    fn delete(&mut self, key: &[u8]) {
        if let Some(journal) = &mut self.out.journal {
            journal.record_del(key);
        }
        self.out.writes.insert(key.to_vec(), None);
    }

    fn step(&mut self, op: &Op, hwm: &mut u64) -> Result<Reply> {
        match op {
            Op::Begin {
                key,
                fingerprint,
                now,
                lease,
                retention,
            } => {
                let existing = self.current(key)?;
                let last = *hwm;
                let decided =
                    logic::begin(existing, fingerprint, *now, *lease, *retention, || {
                        last.checked_add(1)
                            .ok_or_else(|| Error::invalid_argument("fencing tokens exhausted"))
                    })?;
                if let Some(record) = decided.write {
                    let token = record.token;
                    self.put(key, record)?;
                    *hwm = (*hwm).max(token);
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
                let existing = self.current(key)?;
                let record = logic::complete(existing, claim, response, *now, *retention)?;
                self.put(key, record)?;
                Ok(Reply::Done)
            }
            Op::Release { key, claim } => {
                let existing = self.current(key)?;
                let present = existing.is_some();
                logic::release(existing, claim)?;
                if present {
                    self.delete(key);
                }
                Ok(Reply::Done)
            }
            Op::Sweep { now, max } => {
                let swept = self.sweep(*now, *max)?;
                self.out.swept += swept;
                Ok(Reply::Swept(swept))
            }
        }
    }

    /// Deletes up to `max` expired records, oldest expiry first (ties in
    /// key order), wherever they are: this group, the memtable, redb.
    fn sweep(&mut self, now: Timestamp, max: usize) -> Result<usize> {
        let mut candidates: Vec<(Timestamp, Vec<u8>)> = Vec::new();
        if let Some(mem) = self.mem {
            candidates.extend(mem.due(now));
        }
        for (key, entry) in &self.out.writes {
            if let Some(r) = entry
                && logic::sweepable(r.expires_at, now)
            {
                candidates.push((r.expires_at, key.clone()));
            }
        }
        // redb's index, in (expiry, key) order: its first `max` live
        // entries are all it can contribute. Keys decided in memory are
        // the memtable's business above.
        let mut from_base = 0;
        let mut stale = Vec::new();
        self.base.due(now, &mut |index_key| {
            let (expires_at, key) = codec::decode_index(index_key)?;
            if self.shadowed(key) {
                return Ok(true);
            }
            match self.base.read(key)? {
                Some(r) if r.expires_at == expires_at && logic::sweepable(r.expires_at, now) => {
                    candidates.push((expires_at, key.to_vec()));
                    from_base += 1;
                }
                _ => stale.push(index_key.to_vec()),
            }
            Ok(from_base < max)
        })?;
        candidates.sort();
        candidates.dedup();
        let mut swept = 0;
        for (expires_at, key) in candidates {
            if swept >= max {
                break;
            }
            // Re-check against the current state: the index and the
            // memtable only nominate.
            match self.current(&key)? {
                Some(r) if r.expires_at == expires_at && logic::sweepable(r.expires_at, now) => {
                    self.delete(&key);
                    swept += 1;
                }
                _ => {}
            }
        }
        if self.out.journal.is_none() {
            self.out.stale.extend(stale);
        }
        Ok(swept)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::redb::RedbStoreBuilder;
    use crate::redb::open;
    use std::path::Path;

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

    /// A store's shared state on in-memory backends, with no thread
    /// started: the tests lead groups themselves.
    pub(in crate::redb) fn shared(log: bool) -> Arc<Shared> {
        shared_with(RedbStoreBuilder::default(), log)
    }

    /// A shared state on in-memory backends opened with `builder`'s
    /// configuration, with the log or without.
    pub(in crate::redb) fn shared_with(builder: RedbStoreBuilder, log: bool) -> Arc<Shared> {
        let config = builder.config;
        let wal: Option<Box<dyn ::redb::StorageBackend>> =
            log.then(|| Box::new(::redb::backends::InMemoryBackend::new()) as _);
        let backend = ::redb::backends::InMemoryBackend::new();
        let opened = open::open_backend(backend, wal, None, &config, Path::new("memory")).unwrap();
        Shared::new(opened, &config, None)
    }

    /// Counts its wakes.
    #[derive(Default)]
    struct Wakes(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A future polled again with another waker (a task moved between
    /// executors, or `select!` polling it from a new task) is woken through
    /// the last one: a slot that kept the first waker would leave its
    /// future asleep with its answer.
    #[test]
    fn a_slot_wakes_the_waker_of_its_last_poll() {
        let slot = Slot::new(Waiter::Task);
        let (first, last) = (Arc::new(Wakes::default()), Arc::new(Wakes::default()));
        for wakes in [&first, &first, &last] {
            let waker = std::task::Waker::from(Arc::clone(wakes));
            let mut cx = Context::from_waker(&waker);
            assert!(slot.poll(&mut cx).is_pending());
        }
        assert!(slot.answer(Ok(Reply::Done)).is_none(), "not abandoned");
        let count = |w: &Arc<Wakes>| w.0.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!((count(&first), count(&last)), (0, 1));
        let waker = std::task::Waker::from(Arc::clone(&last));
        let mut cx = Context::from_waker(&waker);
        assert!(matches!(slot.poll(&mut cx), Poll::Ready(Ok(Reply::Done))));
    }

    /// A thread that finds the line full waits for room
    /// (`WRITE_QUEUE_DEPTH`): the line never grows past it. Closing the
    /// line lets the waiter go with `Error::Closed`.
    #[test]
    fn a_full_line_makes_a_thread_wait_for_room() {
        let shared = shared(true);
        {
            let mut q = shared.lock_queue();
            for i in 0..crate::redb::WRITE_QUEUE_DEPTH {
                let id = format!("k{i}");
                shared.push(
                    &mut q,
                    begin(id.as_bytes()),
                    Arc::new(Slot::new(Waiter::Nobody)),
                );
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let submitter = Arc::clone(&shared);
        std::thread::spawn(move || {
            let _ = tx.send(submitter.submit(begin(b"late")));
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(100)).is_err(),
            "the caller waits"
        );
        assert_eq!(
            shared.lock_queue().waiting.len(),
            crate::redb::WRITE_QUEUE_DEPTH
        );
        shared.lock_queue().closed = true;
        shared.queue_room.notify_all();
        let answer = rx.recv_timeout(Duration::from_secs(10));
        assert!(matches!(answer, Ok(Err(Error::Closed))), "{answer:?}");
        assert_eq!(
            shared.lock_queue().waiting.len(),
            crate::redb::WRITE_QUEUE_DEPTH
        );
    }

    /// After its group, a leader passes the role to the first thread in
    /// line (it is blocked anyway), past the tasks before it: not to the
    /// committer, which would cost that thread a wake-up round trip.
    #[test]
    fn the_role_passes_to_the_first_thread_in_line() {
        let mut shared = shared(true);
        Arc::get_mut(&mut shared).expect("not shared yet").max_batch = 1;
        let slot = |waiter| Arc::new(Slot::new(waiter));
        let (leader, task, next) = (
            slot(Waiter::Thread),
            slot(Waiter::Task),
            slot(Waiter::Thread),
        );
        {
            let mut q = shared.lock_queue();
            shared.push(&mut q, begin(b"a"), Arc::clone(&leader));
            shared.push(&mut q, begin(b"b"), Arc::clone(&task));
            shared.push(&mut q, begin(b"c"), Arc::clone(&next));
            // A thread leads: the task behind it does not call the committer.
            assert!(!q.committer);
        }
        let own = shared.lead_once(Some(&leader));
        assert!(
            matches!(own, Some(Ok(Reply::Begin(Begin::Claimed(_))))),
            "{own:?}"
        );
        assert!(
            matches!(next.lock().state, SlotState::Lead),
            "the thread leads next"
        );
        assert!(matches!(task.lock().state, SlotState::Waiting));
        let q = shared.lock_queue();
        assert!(!q.committer, "the committer was not asked");
        assert_eq!((q.waiting.len(), q.threads), (2, 1));
    }

    /// Under `Durability::Periodic` a group's frame is appended without a
    /// sync, and the store marks the log for the background thread's sync
    /// within the loss window; under `Immediate` the frame is synced
    /// before the answer and nothing is left to sync.
    #[test]
    fn an_unsynced_append_is_left_to_the_background_sync() {
        let periodic = crate::redb::Durability::Periodic {
            max_loss: Duration::from_millis(50),
        };
        for (durability, unsynced) in [
            (crate::redb::Durability::Immediate, false),
            (periodic, true),
        ] {
            let shared = shared_with(RedbStoreBuilder::default().durability(durability), true);
            let answers = shared.commit_group(&[begin(b"a")]);
            assert!(matches!(
                answers.as_slice(),
                [Ok(Reply::Begin(Begin::Claimed(_)))]
            ));
            assert_eq!(
                shared.log_unsynced.load(Ordering::SeqCst),
                unsynced,
                "{durability:?}"
            );
        }
    }

    /// A memtable that reaches its budget (`MEMTABLE_BYTES`) is handed to
    /// the checkpointer at the next group, however long before the
    /// checkpoint interval ends.
    #[test]
    fn a_full_memtable_is_frozen_before_the_interval_ends() {
        let shared = shared_with(
            RedbStoreBuilder::default().checkpoint_interval(Duration::from_secs(3600)),
            true,
        );
        shared.commit_group(&[begin(b"a")]);
        assert!(shared.read_mem().frozen.is_none(), "small and young: kept");
        // A deletion whose key alone fills the budget.
        let big = vec![7u8; crate::redb::MEMTABLE_BYTES];
        shared.write_mem().publish([(big, None)]);
        shared.commit_group(&[begin(b"b")]);
        assert!(shared.read_mem().frozen.is_some(), "full: frozen");
    }

    /// `op`'s group committed on a thread of its own; its answers come on
    /// the channel.
    fn commit_aside(shared: &Arc<Shared>, op: Op) -> std::sync::mpsc::Receiver<Vec<Result<Reply>>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::clone(shared);
        std::thread::spawn(move || {
            let _ = tx.send(shared.commit_group(&[op]));
        });
        rx
    }

    /// While the checkpointer writes a frozen memtable, the active one may
    /// grow to twice the budget without anyone waiting; past that, a group
    /// waits for the checkpoint (back-pressure on memory) and then freezes
    /// the full memtable. A freeze never replaces a frozen memtable that
    /// is not written yet: its records would exist nowhere but in the log.
    #[test]
    fn past_twice_the_budget_a_group_waits_for_the_checkpoint() {
        const WAIT: Duration = Duration::from_secs(10);
        let shared = shared_with(
            RedbStoreBuilder::default().checkpoint_interval(Duration::from_secs(3600)),
            true,
        );
        shared.write_mem().publish([(b"first".to_vec(), None)]);
        shared.freeze(&mut shared.lock_core()).unwrap();
        assert!(shared.read_mem().frozen.is_some());
        // Over the budget, under twice it: no wait.
        let budget = crate::redb::MEMTABLE_BYTES;
        shared
            .write_mem()
            .publish([(vec![7u8; budget + 1024], None)]);
        let answers = commit_aside(&shared, begin(b"a")).recv_timeout(WAIT);
        assert!(matches!(answers.as_deref(), Ok([Ok(_)])), "{answers:?}");
        // Past twice the budget: the group waits for the checkpoint.
        shared.write_mem().publish([(vec![8u8; budget], None)]);
        let waiting = commit_aside(&shared, begin(b"b"));
        assert!(
            waiting.recv_timeout(Duration::from_millis(200)).is_err(),
            "waits while the frozen memtable is not written"
        );
        assert!(
            shared.read_mem().get(b"first").is_some(),
            "the frozen memtable is still there"
        );
        // What the checkpointer does once its commit is durable.
        {
            let _bg = shared.lock_bg();
            shared.write_mem().frozen = None;
            shared.bg_cv.notify_all();
        }
        let answers = waiting.recv_timeout(WAIT);
        assert!(matches!(answers.as_deref(), Ok([Ok(_)])), "{answers:?}");
        let mem = shared.read_mem();
        assert!(
            mem.frozen.is_some() && mem.active.is_empty(),
            "frozen in turn"
        );
    }

    /// A freeze with nothing logged since the last one (an idle store's
    /// timed checkpoint) does nothing: no empty memtable for the
    /// checkpointer, no new log epoch.
    #[test]
    fn a_freeze_with_nothing_logged_does_nothing() {
        let shared = shared(true);
        let mut core = shared.lock_core();
        let epoch = core.wal.as_ref().map(Wal::epoch);
        shared.freeze(&mut core).unwrap();
        assert!(shared.read_mem().frozen.is_none());
        assert_eq!(core.wal.as_ref().map(Wal::epoch), epoch);
    }

    /// Without the log, `Durability::Periodic` commits a group without an
    /// fsync while its window is open, and durably once it has passed.
    #[test]
    fn without_the_log_a_periodic_group_is_durable_once_its_window_has_passed() {
        let window = Duration::from_millis(200);
        let shared = shared_with(
            RedbStoreBuilder::default()
                .durability(crate::redb::Durability::Periodic { max_loss: window }),
            false,
        );
        let durable = || shared.stats.durable_commits.load(Ordering::SeqCst);
        let before = durable();
        shared.commit_group(&[begin(b"a")]);
        assert_eq!(durable(), before, "inside the window: not durable");
        assert!(shared.lock_core().unflushed);
        std::thread::sleep(window + Duration::from_millis(20));
        shared.commit_group(&[begin(b"b")]);
        assert_eq!(durable(), before + 1, "past the window: durable");
        assert!(!shared.lock_core().unflushed);
    }

    /// An index entry whose record has another expiry (left by damage or
    /// by a bug) never gets its record swept early: the sweep checks each
    /// nominee against its record, drops the stale entry, and sweeps the
    /// record through its own entry.
    #[test]
    fn a_sweep_drops_an_index_entry_that_names_another_expiry() {
        use ::redb::{ReadableDatabase, ReadableTableMetadata};
        let shared = shared(false);
        let index_len = || {
            let db = shared.read_db().unwrap();
            let txn = db.begin_read().unwrap();
            let index = txn.open_table(super::super::tables::EXPIRY).unwrap();
            index.len().unwrap()
        };
        shared.commit_group(&[short_claim(b"\0r", 10)]);
        plant_stale_index_entry(&shared, b"\0r", 5);
        assert_eq!(index_len(), 2);
        // Before the record's own expiry: nothing is swept, the stale
        // entry goes.
        let answers = shared.commit_group(&[sweep_at(8)]);
        assert!(
            matches!(answers.as_slice(), [Ok(Reply::Swept(0))]),
            "{answers:?}"
        );
        assert_eq!(index_len(), 1, "the stale entry is gone");
        assert!(shared.read(b"\0r").unwrap().is_some(), "not swept early");
        // Past it: the record goes through its own entry.
        let answers = shared.commit_group(&[sweep_at(1_000)]);
        assert!(
            matches!(answers.as_slice(), [Ok(Reply::Swept(1))]),
            "{answers:?}"
        );
        assert_eq!(index_len(), 0);
        // A stale entry met when its record is due as well: the record goes
        // once, through its own entry, and the stale entry goes too.
        shared.commit_group(&[short_claim(b"\0q", 10)]);
        plant_stale_index_entry(&shared, b"\0q", 5);
        let answers = shared.commit_group(&[sweep_at(1_000)]);
        assert!(
            matches!(answers.as_slice(), [Ok(Reply::Swept(1))]),
            "{answers:?}"
        );
        assert_eq!(index_len(), 0, "both entries are gone");
    }

    /// A claim at `at` ms whose lease and retention are 1 ms each.
    fn short_claim(id: &[u8], at: u64) -> Op {
        Op::Begin {
            key: id.to_vec(),
            fingerprint: Fingerprint::of(b"fp"),
            now: Timestamp::from_millis(at),
            lease: Duration::from_millis(1),
            retention: Duration::from_millis(1),
        }
    }

    /// A sweep at `at` ms of up to 10 records.
    fn sweep_at(at: u64) -> Op {
        Op::Sweep {
            now: Timestamp::from_millis(at),
            max: 10,
        }
    }

    /// An expiry index entry for `key` at `at` ms that its record does not
    /// have, written into redb directly.
    fn plant_stale_index_entry(shared: &Shared, key: &[u8], at: u64) {
        let stale = codec::encode_index(Timestamp::from_millis(at), key);
        shared
            .direct(|txn, _| {
                let mut index = txn
                    .open_table(super::super::tables::EXPIRY)
                    .map_err(engine)?;
                index.insert(stale.as_slice(), ()).map_err(engine)?;
                Ok::<_, Error>(())
            })
            .unwrap();
    }

    /// A sweep in the same group as a new claim of an expired key checks
    /// the memtable's nominee against the group's own write: the new claim
    /// stays.
    #[test]
    fn a_sweep_keeps_a_claim_made_earlier_in_its_group() {
        let shared = shared(true);
        shared.commit_group(&[short_claim(b"\0x", 10)]);
        let answers = shared.commit_group(&[short_claim(b"\0x", 1_000), sweep_at(1_000)]);
        assert!(
            matches!(
                answers.as_slice(),
                [Ok(Reply::Begin(Begin::Claimed(_))), Ok(Reply::Swept(0))]
            ),
            "{answers:?}"
        );
        let record = shared.read(b"\0x").unwrap();
        assert!(record.is_some_and(|r| r.state == crate::State::Processing));
    }

    /// The checkpointer's timed freeze, when a leader froze the memtable
    /// just before: it must return (the frozen table is its own to write),
    /// not wait for that table holding the commit lock. Before the fix
    /// every writer stopped behind it (found by the HTTP load benchmark).
    #[test]
    fn a_timed_freeze_never_waits_for_the_checkpoint_it_must_write() {
        let shared = shared_with(
            RedbStoreBuilder::default().checkpoint_interval(Duration::from_millis(1)),
            true,
        );
        let answers = shared.commit_group(&[begin(b"a")]);
        assert!(matches!(
            answers.as_slice(),
            [Ok(Reply::Begin(Begin::Claimed(_)))]
        ));
        {
            let mut core = shared.lock_core();
            shared.freeze(&mut core).unwrap();
        }
        assert!(shared.read_mem().frozen.is_some());
        // Due again: the (1 ms) interval has passed since the freeze.
        std::thread::sleep(Duration::from_millis(20));
        assert!(shared.checkpoint_due());
        let (tx, rx) = std::sync::mpsc::channel();
        let ticking = Arc::clone(&shared);
        std::thread::spawn(move || {
            let _ = tx.send(super::super::checkpoint::tick(
                &ticking,
                &mut Instant::now(),
            ));
        });
        let ticked = rx.recv_timeout(Duration::from_secs(10));
        assert!(
            matches!(ticked, Ok(Ok(super::super::checkpoint::Tick::Done))),
            "the tick hung: {ticked:?}"
        );
        // The commit lock is free: a writer gets through.
        assert!(shared.try_lock_core().is_some());
    }

    #[test]
    fn one_group_applies_in_order_and_a_bad_request_fails_alone() {
        for log in [true, false] {
            let shared = shared(log);
            let bogus = Claim {
                token: 99,
                lease_until: T,
                takeover: false,
                attempt: 1,
            };
            let answers = shared.commit_group(&[
                begin(b"\0a"),
                // A duplicate in the same group sees the claim made just before it.
                begin(b"\0a"),
                // Fails validation: it fails alone, the group still commits.
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
            assert_eq!(shared.stats.commits.load(Ordering::Relaxed), 1);
            assert_eq!(shared.lock_core().token_hwm, 2);
            // With the log the records are in the memtable, without it in redb.
            assert_eq!(shared.read_mem().active.len(), if log { 2 } else { 0 });
        }
    }

    #[test]
    fn a_group_of_answers_only_commits_nothing() {
        for log in [true, false] {
            let shared = shared(log);
            let answers = shared.commit_group(&[Op::Sweep { now: T, max: 10 }]);
            assert!(matches!(answers.as_slice(), [Ok(Reply::Swept(0))]));
            assert_eq!(shared.stats.commits.load(Ordering::Relaxed), 0);
        }
    }

    #[test]
    fn a_sweep_takes_expired_records_from_memory_and_redb_in_order() {
        let shared = shared(true);
        let claim = short_claim;
        shared.commit_group(&[claim(b"\0r1", 10), claim(b"\0r2", 20)]);
        // Into redb: the memtable is checkpointed by a direct transaction.
        shared.direct(|_, _| Ok::<_, Error>(())).unwrap();
        assert!(shared.read_mem().is_empty());
        shared.commit_group(&[claim(b"\0m1", 15), claim(b"\0m2", 25)]);
        let later = Timestamp::from_millis(1_000);
        let answers = shared.commit_group(&[Op::Sweep { now: later, max: 3 }]);
        assert!(matches!(answers.as_slice(), [Ok(Reply::Swept(3))]));
        // Oldest first: r1 (11), m1 (16), r2 (21) went; m2 (26) is left.
        let mem = shared.read_mem();
        assert!(matches!(mem.get(b"\0r1"), Some(None)));
        assert!(matches!(mem.get(b"\0m1"), Some(None)));
        assert!(matches!(mem.get(b"\0r2"), Some(None)));
        assert!(matches!(mem.get(b"\0m2"), Some(Some(_))));
        drop(mem);
        let answers = shared.commit_group(&[Op::Sweep { now: later, max: 3 }]);
        assert!(matches!(answers.as_slice(), [Ok(Reply::Swept(1))]));
    }
}
