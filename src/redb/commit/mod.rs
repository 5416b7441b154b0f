//! Group commit: one group under the commit lock is decided ([`decide`]),
//! appended as one log frame, `fdatasync`ed, then published into the
//! memtable; `committer.rs` queues the ops and answers them. Also the
//! direct transaction ([`Shared::direct`]): a redb write transaction of its
//! own under the commit lock, outside the line.
//!
//! What must hold:
//! - nobody is answered and no reader sees a group before its frame is
//!   durable (the memtable is published after the `fdatasync`);
//! - a frame that cannot be written or synced may be on disk or not: the
//!   whole group gets the error, nothing is published, and the store is
//!   poisoned until it heals (heal.rs replays the log as an open would);
//! - a request that fails while being decided fails alone, writing nothing;
//! - a panic while committing poisons the store and answers the whole group.

mod committer;

use super::health::On;
use super::memtable::{self, Encoded, Entry, MEMTABLE_BYTES, Mem, UNTIL_WOKEN};
use super::record_log::FrameBuf;
use super::shared::{Core, Op, Reply};
use super::tables::{META_TOKEN_HWM, ReadTables, WriteTables, commit};
use super::{Durability, Shared};
use crate::codec;
use crate::error::{Error, Result};
use crate::logic;
use crate::record::Record;
use crate::sync::Instant;
use crate::sync::atomic::Ordering::{Relaxed, SeqCst};
use crate::time::Timestamp;
use std::collections::HashMap;
use std::time::Duration;

impl Shared {
    /// One group, under the commit lock: an answer per op.
    fn commit_group(&self, ops: &mut [Op]) -> Vec<Result<Reply>> {
        let n = ops.len() as u64;
        self.stats.groups.fetch_add(1, Relaxed);
        self.stats.requests.fetch_add(n, Relaxed);
        self.stats.largest_group.fetch_max(n, Relaxed);
        let mut core = self.log.lock();
        let healthy = self.db.health.check();
        let committed = healthy.and_then(|()| self.commit_logged(&mut core, ops));
        match committed {
            Ok(answers) => {
                // An I/O error of the engine's while deciding leaves redb
                // refusing every use until it is reopened: the store heals.
                if let Some(Err(e)) = answers.iter().find(|a| matches!(a, Err(Error::Io(_)))) {
                    self.fail("read", On::Store, e.replicate());
                }
                answers
            }
            Err(error) => ops.iter().map(|_| Err(error.replicate())).collect(),
        }
    }

    /// Decides against memtable + redb, appends one frame, publishes.
    fn commit_logged(&self, core: &mut Core, ops: &mut [Op]) -> Result<Vec<Result<Reply>>> {
        let mut hwm = core.token_hwm;
        let decided = {
            // The memtable, then the count (db.rs).
            let mem = self.memory.read_mem();
            let counted = self.db.snapshot.count();
            self.db
                .read_tables(counted, |base| decide(ops, &mem, base, counted, &mut hwm))
                .map_err(|e| self.engine_failed("read", e))?
        };
        if decided.writes.is_empty() {
            return Ok(decided.answers);
        }
        let mut frame = decided.frame;
        if hwm != core.token_hwm {
            frame.meta_put(META_TOKEN_HWM, &hwm.to_be_bytes());
        }
        let sync = self.log.durability == Durability::Immediate;
        if !core.writer.fits_at_all(frame.len()) {
            // Larger than a whole segment: straight into redb, durably.
            let writes = decided.writes;
            self.direct_locked(core, true, |tables, token_hwm| {
                tables.take_in(&writes)?;
                *token_hwm = (*token_hwm).max(hwm);
                Ok::<_, Error>(())
            })?;
            return Ok(decided.answers);
        }
        if !core.writer.fits(frame.len()) {
            self.freeze(core)?;
        }
        let appending = Instant::now();
        if let Err(e) = core.writer.append(&mut frame, sync) {
            // The frame may be on disk: its tokens are never handed out
            // again (a heal replays what reached the log).
            core.token_hwm = hwm;
            return Err(self.fail("log append", On::Log, e));
        }
        let (log_sync, log_fill) = (appending.elapsed(), core.writer.fill());
        if !sync {
            self.log.unsynced.store(true, SeqCst);
        }
        let (bytes, free, left) = {
            let mut mem = self.memory.write_mem();
            mem.publish(decided.writes);
            let left = mem.checkpoint_left(self.memory.checkpoint_interval);
            (mem.active_bytes, mem.frozen.is_none(), left)
        };
        core.token_hwm = hwm;
        self.stats.commits.fetch_add(1, Relaxed);
        self.stats.logged_commits.fetch_add(1, Relaxed);
        self.stats.swept.fetch_add(decided.swept as u64, Relaxed);
        crate::observability::group_committed(ops.len(), log_sync, bytes, log_fill);
        crate::observability::swept("redb", decided.swept);
        // Freeze when large or old enough and the checkpointer is free;
        // past twice the budget, wait for it (back-pressure on memory).
        let due = bytes >= MEMTABLE_BYTES || left == Some(Duration::ZERO);
        if (due && free) || bytes >= 2 * MEMTABLE_BYTES {
            self.freeze(core)?;
        }
        Ok(decided.answers)
    }

    /// Hands the active memtable to the checkpointer (after the previous
    /// checkpoint) and moves the log to the next epoch (the other segment).
    /// Nothing to do when nothing was logged since the last checkpoint.
    pub(super) fn freeze(&self, core: &mut Core) -> Result<()> {
        self.wait_checkpointed()?;
        {
            let mut mem = self.memory.write_mem();
            if mem.active.is_empty() && !core.writer.is_dirty() {
                return Ok(());
            }
            mem.freeze(core.writer.epoch(), core.token_hwm);
        }
        core.writer.rotate();
        self.memory.wake_background();
        Ok(())
    }

    /// Runs `f` in a durable redb write transaction of its own. It first
    /// takes in the memtable (after any running checkpoint), so `f` reads
    /// the current state, then retires the log's frames (a new epoch):
    /// replaying them over `f`'s writes would undo them. `f` gets the token
    /// high-water mark. An error from `f` aborts everything; a failed
    /// commit poisons the store.
    pub(in crate::redb) fn direct<T, E: From<Error>>(
        &self,
        f: impl FnOnce(&mut WriteTables<'_>, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        self.direct_locked(&mut self.log.lock(), true, f)
    }

    /// [`direct`](Self::direct) with the commit lock already held, choosing
    /// redb's quick-repair for the commit (see [`commit`]; on for every
    /// caller but an inbox that switched it off).
    pub(in crate::redb) fn direct_locked<T, E: From<Error>>(
        &self,
        core: &mut Core,
        quick_repair: bool,
        f: impl FnOnce(&mut WriteTables<'_>, &mut u64) -> Result<T, E>,
    ) -> Result<T, E> {
        self.check_submit()?;
        self.wait_checkpointed()?;
        let db = self.db.write_ready_db()?;
        let mut hwm = core.token_hwm;
        // An I/O error in this transaction's own writes poisons the store.
        let own = |e| self.engine_failed("commit", e);
        let committed = commit(&db, quick_repair, |tables| {
            tables
                .take_in(&self.memory.read_mem().active)
                .map_err(own)?;
            let out = f(tables, &mut hwm)?;
            hwm = hwm.max(core.token_hwm);
            let next = core.writer.epoch().wrapping_add(1);
            tables.retire(hwm, next).map_err(own)?;
            Ok::<_, E>(out)
        });
        let out = committed.map_err(|e| self.fail("commit", On::Store, e))??;
        // Before the active memtable is cleared (db.rs).
        self.db.snapshot.committed();
        core.token_hwm = hwm;
        // Nothing is frozen: it waited for the checkpoint, under the lock.
        *self.memory.write_mem() = Mem::default();
        core.writer.rotate();
        self.stats.commits.fetch_add(1, Relaxed);
        self.stats.durable_commits.fetch_add(1, Relaxed);
        Ok(out)
    }

    /// Waits until no frozen memtable is waiting for its checkpoint.
    pub(in crate::redb) fn wait_checkpointed(&self) -> Result<()> {
        let mut bg = self.memory.lock_bg();
        loop {
            self.db.health.check()?;
            if self.memory.read_mem().frozen.is_none() {
                return Ok(());
            }
            bg = self.memory.wait_bg(bg, UNTIL_WOKEN);
        }
    }
}

/// What deciding a group produced.
#[derive(Debug, Default)]
struct Decided {
    /// One per op, in order.
    answers: Vec<Result<Reply>>,
    /// Each written key's final state (a deletion is `None`).
    writes: HashMap<Vec<u8>, Entry>,
    /// The writes in the order they were made, for the log.
    frame: FrameBuf,
    /// Records deleted by sweeps.
    swept: usize,
}

/// The group's decisions: each op through the state machine (`logic`)
/// once, in order, against the group's own earlier writes, the memtable,
/// then redb. Each record is encoded here once (the log frame, memtable and
/// checkpoint carry those bytes), its key and response taken from the op (a
/// begin's key goes back in its reply, for committer.rs);
/// [`Shared::commit_logged`] writes.
fn decide(ops: &mut [Op], mem: &Mem, base: &ReadTables, counted: u64, hwm: &mut u64) -> Decided {
    let mut group = Group {
        mem,
        base,
        counted,
        out: Decided {
            answers: Vec::with_capacity(ops.len()),
            writes: HashMap::with_capacity(ops.len()),
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
    mem: &'a Mem,
    base: &'a ReadTables,
    /// The count of redb commits `base` was read under (db.rs).
    counted: u64,
    out: Decided,
}

impl Group<'_> {
    /// The current state of `key`: this group's writes, the memtable, redb
    /// (not asked about a key found absent under the count `base` was read
    /// under: `Op::Begin`).
    fn current(&self, key: &[u8], absent_at: Option<u64>) -> Result<Option<Record>> {
        if let Some(entry) = self.out.writes.get(key).or_else(|| self.mem.get(key)) {
            return memtable::decode(key, entry);
        }
        if absent_at == Some(self.counted) {
            return Ok(None);
        }
        self.base.read(key)
    }

    /// Encodes `record` (checking its invariants) once: the log frame,
    /// the memtable and, at the checkpoint, redb all get these bytes.
    fn put(&mut self, key: Vec<u8>, record: &Record) -> Result<()> {
        let encoded = Encoded::new(record)?;
        self.out.frame.record_put(&key, &encoded.value);
        self.out.writes.insert(key, Some(encoded));
        Ok(())
    }

    fn delete(&mut self, key: Vec<u8>) {
        self.out.frame.record_del(&key);
        self.out.writes.insert(key, None);
    }

    fn step(&mut self, op: &mut Op, hwm: &mut u64) -> Result<Reply> {
        match op {
            Op::Begin {
                key,
                fingerprint,
                now,
                lease,
                retention,
                absent_at,
            } => {
                let existing = self.current(key, *absent_at)?;
                let next = || logic::next_token(*hwm);
                let decided = logic::begin(existing, fingerprint, *now, *lease, *retention, next)?;
                if let Some(record) = decided.write {
                    self.put(key.clone(), &record)?;
                    *hwm = (*hwm).max(record.token);
                }
                Ok(Reply::Begin(decided.answer, std::mem::take(key)))
            }
            Op::Complete {
                key,
                claim,
                response,
                now,
                retention,
            } => {
                let existing = self.current(key, None)?;
                let response = std::mem::take(response);
                let record = logic::complete_owned(existing, claim, response, *now, *retention)?;
                self.put(std::mem::take(key), &record)?;
                Ok(Reply::Done)
            }
            Op::Release { key, claim } => {
                // `None` only for a record it owned (never for an absent one).
                match logic::release(self.current(key, None)?, claim)? {
                    Some(kept) => self.put(std::mem::take(key), &kept)?,
                    None => self.delete(std::mem::take(key)),
                }
                Ok(Reply::Done)
            }
            // A step already recorded writes nothing: what this group reads
            // is durable by the time the group's answers go out.
            Op::Step {
                key,
                claim,
                step,
                now,
            } => {
                let existing = self.current(key, None)?;
                if let Some(record) = logic::record_step(existing, claim, step, *now)? {
                    self.put(std::mem::take(key), &record)?;
                }
                Ok(Reply::Done)
            }
            Op::Renew {
                key,
                claim,
                now,
                lease,
            } => {
                let existing = self.current(key, None)?;
                let step = logic::renew(existing, claim, *now, *lease)?;
                self.put(std::mem::take(key), &step.write)?;
                Ok(Reply::Renewed(step.claim))
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
        let mut candidates = self.mem.due(now);
        for (key, entry) in &self.out.writes {
            if let Some(e) = entry
                && logic::sweepable(e.expires_at, now)
            {
                candidates.push((e.expires_at, key.clone()));
            }
        }
        // redb's index, in (expiry, key) order: its first `max` live
        // entries are all it can contribute. Keys in memory were nominated
        // above; an entry whose record has another expiry (damage) is not.
        let mut from_base = 0;
        self.base.due(now, |index_key| {
            let (expires_at, key) = codec::decode_index(index_key)?;
            if self.out.writes.contains_key(key) || self.mem.get(key).is_some() {
                return Ok(true);
            }
            match self.base.read(key)? {
                Some(r) if r.expires_at == expires_at && logic::sweepable(r.expires_at, now) => {
                    candidates.push((expires_at, key.to_vec()));
                    from_base += 1;
                }
                _ => {}
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
            match self.current(&key, None)? {
                Some(r) if r.expires_at == expires_at && logic::sweepable(r.expires_at, now) => {
                    self.delete(key);
                    swept += 1;
                }
                _ => {}
            }
        }
        Ok(swept)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::record::Begin;
    use crate::redb::RedbStoreBuilder;
    use crate::redb::open;
    use crate::sync::Arc;
    use crate::sync::atomic::Ordering;
    use crate::time::Timestamp;
    use std::path::Path;
    use std::time::Duration;

    pub(super) const T: Timestamp = Timestamp::from_millis(1_000_000);
    pub(super) const D: Duration = Duration::from_secs(10);

    pub(super) fn begin(id: &[u8]) -> Op {
        Op::Begin {
            key: id.to_vec(),
            fingerprint: Fingerprint::of(b"fp"),
            now: T,
            lease: D,
            retention: D,
            absent_at: None,
        }
    }

    /// One op committed as a group of its own, as the committer would.
    pub(in crate::redb) fn commit_one(shared: &Shared, op: Op) -> Result<Reply> {
        let answer = shared.commit_group(&mut [op]).pop();
        answer.unwrap_or_else(|| Err(Error::backend("no answer")))
    }

    /// A store's shared state on in-memory backends, with no thread
    /// started: the tests commit groups themselves.
    pub(in crate::redb) fn shared() -> Arc<Shared> {
        shared_with(RedbStoreBuilder::default())
    }

    /// A shared state on in-memory backends opened with `builder`'s
    /// configuration.
    pub(in crate::redb) fn shared_with(builder: RedbStoreBuilder) -> Arc<Shared> {
        let config = builder.config;
        let log = Box::new(::redb::backends::InMemoryBackend::new());
        let backend = ::redb::backends::InMemoryBackend::new();
        let opened = open::open_backend(backend, log, None, &config, Path::new("memory")).unwrap();
        Shared::new(opened, &config, None)
    }

    /// An engine I/O error met by a store already poisoned answers with
    /// the store's first cause ([`Error::Poisoned`]), not as an I/O error
    /// of its own.
    #[test]
    fn an_io_error_after_poisoning_answers_with_the_first_cause() {
        let shared = shared();
        let first = Error::Io(std::io::Error::other("first"));
        assert!(matches!(shared.fail("test", On::Log, first), Error::Io(_)));
        let second = Error::Io(std::io::Error::other("second"));
        let answer = shared.engine_failed("read", second);
        assert!(matches!(answer, Error::Poisoned { .. }), "{answer:?}");
    }

    /// `begin` of `id` that the fast path found absent under `count`.
    fn begin_absent_at(id: &[u8], count: u64) -> Op {
        let mut op = begin(id);
        if let Op::Begin { absent_at, .. } = &mut op {
            *absent_at = Some(count);
        }
        op
    }

    /// A key found absent before a redb commit may be there after it (a
    /// claim checkpointed in between): the committer asks redb again, and
    /// the second claim is refused. Under the count it was found absent
    /// under, it does not ask: shown here with an absence that is false.
    #[test]
    fn an_absence_is_trusted_only_under_the_count_it_was_found_under() {
        let shared = shared();
        let before = shared.db.snapshot.count();
        assert!(matches!(
            commit_one(&shared, begin(b"k")),
            Ok(Reply::Begin(Begin::Claimed(_), _))
        ));
        shared.flush().unwrap();
        assert!(shared.memory.read_mem().is_empty(), "in redb only");
        let now = shared.db.snapshot.count();
        assert_ne!(before, now);
        assert!(matches!(
            commit_one(&shared, begin_absent_at(b"k", before)),
            Ok(Reply::Begin(Begin::InFlight { .. }, _))
        ));
        assert!(matches!(
            commit_one(&shared, begin_absent_at(b"k", now)),
            Ok(Reply::Begin(Begin::Claimed(_), _))
        ));
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
            let shared = shared_with(RedbStoreBuilder::default().durability(durability));
            let answers = shared.commit_group(&mut [begin(b"a")]);
            assert!(matches!(
                answers.as_slice(),
                [Ok(Reply::Begin(Begin::Claimed(_), _))]
            ));
            assert_eq!(
                shared.log.unsynced.load(Ordering::SeqCst),
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
        let shared =
            shared_with(RedbStoreBuilder::default().checkpoint_interval(Duration::from_secs(3600)));
        shared.commit_group(&mut [begin(b"a")]);
        assert!(
            shared.memory.read_mem().frozen.is_none(),
            "small and young: kept"
        );
        // A deletion whose key alone fills the budget.
        let big = vec![7u8; crate::redb::MEMTABLE_BYTES];
        shared.memory.write_mem().publish([(big, None)]);
        shared.commit_group(&mut [begin(b"b")]);
        assert!(shared.memory.read_mem().frozen.is_some(), "full: frozen");
    }

    /// `op`'s group committed on a thread of its own; its answers come on
    /// the channel.
    fn commit_aside(shared: &Arc<Shared>, op: Op) -> std::sync::mpsc::Receiver<Vec<Result<Reply>>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::clone(shared);
        std::thread::spawn(move || {
            let _ = tx.send(shared.commit_group(&mut [op]));
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
        let shared =
            shared_with(RedbStoreBuilder::default().checkpoint_interval(Duration::from_secs(3600)));
        shared
            .memory
            .write_mem()
            .publish([(b"first".to_vec(), None)]);
        shared.freeze(&mut shared.log.lock()).unwrap();
        assert!(shared.memory.read_mem().frozen.is_some());
        // Over the budget, under twice it: no wait.
        let budget = crate::redb::MEMTABLE_BYTES;
        shared
            .memory
            .write_mem()
            .publish([(vec![7u8; budget + 1024], None)]);
        let answers = commit_aside(&shared, begin(b"a")).recv_timeout(WAIT);
        assert!(matches!(answers.as_deref(), Ok([Ok(_)])), "{answers:?}");
        // Past twice the budget: the group waits for the checkpoint.
        shared
            .memory
            .write_mem()
            .publish([(vec![8u8; budget], None)]);
        let waiting = commit_aside(&shared, begin(b"b"));
        assert!(
            waiting.recv_timeout(Duration::from_millis(200)).is_err(),
            "waits while the frozen memtable is not written"
        );
        assert!(
            shared.memory.read_mem().get(b"first").is_some(),
            "the frozen memtable is still there"
        );
        // What the checkpointer does once its commit is durable.
        {
            let _bg = shared.memory.lock_bg();
            shared.memory.write_mem().frozen = None;
            shared.memory.bg_cv.notify_all();
        }
        let answers = waiting.recv_timeout(WAIT);
        assert!(matches!(answers.as_deref(), Ok([Ok(_)])), "{answers:?}");
        let mem = shared.memory.read_mem();
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
        let shared = shared();
        let mut core = shared.log.lock();
        let epoch = core.writer.epoch();
        shared.freeze(&mut core).unwrap();
        assert!(shared.memory.read_mem().frozen.is_none());
        assert_eq!(core.writer.epoch(), epoch);
    }
}

/// The group's decisions ([`decide`]).
#[cfg(test)]
mod decide_tests {
    use super::tests::{D, T, begin, shared};
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::record::{Begin, Claim};
    use crate::response::Response;
    use crate::sync::atomic::Ordering;
    use std::time::Duration;

    /// An index entry whose record has another expiry (left by damage or
    /// by a bug) never gets its record swept early: the sweep checks each
    /// nominee against its record, and sweeps the record once, when it is
    /// due.
    #[test]
    fn a_sweep_ignores_an_index_entry_that_names_another_expiry() {
        let shared = shared();
        shared.commit_group(&mut [short_claim(b"\0r", 10)]);
        // Into redb, where the index is.
        shared.flush().unwrap();
        plant_stale_index_entry(&shared, b"\0r", 5);
        // Before the record's own expiry: nothing is swept.
        assert_eq!(swept(&shared, 8, 10), 0);
        assert!(shared.read(b"\0r").unwrap().is_some(), "not swept early");
        // Past it: the record goes, once.
        assert_eq!(swept(&shared, 1_000, 10), 1);
        assert!(shared.read(b"\0r").unwrap().is_none());
        assert_eq!(swept(&shared, 1_000, 10), 0);
    }

    /// A claim at `at` ms whose lease and retention are 1 ms each.
    fn short_claim(id: &[u8], at: u64) -> Op {
        Op::Begin {
            key: id.to_vec(),
            fingerprint: Fingerprint::of(b"fp"),
            now: Timestamp::from_millis(at),
            lease: Duration::from_millis(1),
            retention: Duration::from_millis(1),
            absent_at: None,
        }
    }

    /// A sweep at `at` ms of up to 10 records.
    fn sweep_at(at: u64) -> Op {
        Op::Sweep {
            now: Timestamp::from_millis(at),
            max: 10,
        }
    }

    /// A sweep at `at` ms of up to `max` records, alone in its group: how
    /// many it deleted.
    fn swept(shared: &crate::redb::Shared, at: u64, max: usize) -> usize {
        let answers = shared.commit_group(&mut [Op::Sweep {
            now: Timestamp::from_millis(at),
            max,
        }]);
        match answers.as_slice() {
            [Ok(Reply::Swept(n))] => *n,
            other => panic!("{other:?}"),
        }
    }

    /// An expiry index entry for `key` at `at` ms that its record does not
    /// have, written into redb directly.
    fn plant_stale_index_entry(shared: &crate::redb::Shared, key: &[u8], at: u64) {
        let stale = codec::encode_index(Timestamp::from_millis(at), key);
        shared.direct(|tables, _| tables.index(&stale)).unwrap();
    }

    /// A sweep in the same group as a new claim of an expired key checks
    /// the memtable's nominee against the group's own write: the new claim
    /// stays.
    #[test]
    fn a_sweep_keeps_a_claim_made_earlier_in_its_group() {
        let shared = shared();
        shared.commit_group(&mut [short_claim(b"\0x", 10)]);
        let answers = shared.commit_group(&mut [short_claim(b"\0x", 1_000), sweep_at(1_000)]);
        assert!(
            matches!(
                answers.as_slice(),
                [Ok(Reply::Begin(Begin::Claimed(_), _)), Ok(Reply::Swept(0))]
            ),
            "{answers:?}"
        );
        let record = shared.read(b"\0x").unwrap();
        assert!(record.is_some_and(|r| r.state == crate::State::Processing));
    }

    /// A memtable nominee whose key the group has since rewritten (with
    /// an expiry that is due too) is checked against its current expiry:
    /// it is not swept under its old one, and with `max` 1 the record
    /// whose nomination holds is the one that goes.
    #[test]
    fn a_sweep_checks_a_memtable_nominee_against_its_current_expiry() {
        let shared = shared();
        shared.commit_group(&mut [short_claim(b"\0x", 10), short_claim(b"\0y", 100)]);
        let answers = shared.commit_group(&mut [
            short_claim(b"\0x", 500),
            Op::Sweep {
                now: Timestamp::from_millis(1_000),
                max: 1,
            },
        ]);
        assert!(
            matches!(
                answers.as_slice(),
                [Ok(Reply::Begin(Begin::Claimed(_), _)), Ok(Reply::Swept(1))]
            ),
            "{answers:?}"
        );
        assert!(shared.read(b"\0x").unwrap().is_some(), "x is not due first");
        assert!(shared.read(b"\0y").unwrap().is_none(), "y was due first");
    }

    /// An index entry in redb for a key the memtable holds a newer record
    /// of nominates nothing and does not count against `max`: the due
    /// record after it in the index is swept.
    #[test]
    fn a_sweep_passes_over_an_index_entry_shadowed_by_the_memtable() {
        let shared = shared();
        shared.commit_group(&mut [short_claim(b"\0r", 10), short_claim(b"\0s", 20)]);
        shared.flush().unwrap();
        // r again, in the memtable only, due long after the sweep.
        shared.commit_group(&mut [short_claim(b"\0r", 300)]);
        assert_eq!(swept(&shared, 200, 1), 1);
        assert!(shared.read(b"\0r").unwrap().is_some());
        assert!(shared.read(b"\0s").unwrap().is_none());
    }

    #[test]
    fn one_group_applies_in_order_and_a_bad_request_fails_alone() {
        let shared = shared();
        let bogus = Claim::new(99, T, false, 1);
        let answers = shared.commit_group(&mut [
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
        assert!(matches!(it.next(), Some(Ok(Reply::Begin(Begin::Claimed(c), _))) if c.token == 1));
        assert!(matches!(
            it.next(),
            Some(Ok(Reply::Begin(Begin::InFlight { .. }, _)))
        ));
        assert!(matches!(it.next(), Some(Err(Error::StaleClaim))));
        assert!(matches!(it.next(), Some(Ok(Reply::Begin(Begin::Claimed(c), _))) if c.token == 2));
        assert_eq!(shared.stats.commits.load(Ordering::Relaxed), 1);
        assert_eq!(shared.log.lock().token_hwm, 2);
        assert_eq!(shared.memory.read_mem().active.len(), 2, "in the memtable");
    }

    #[test]
    fn a_group_of_answers_only_commits_nothing() {
        let shared = shared();
        let answers = shared.commit_group(&mut [Op::Sweep { now: T, max: 10 }]);
        assert!(matches!(answers.as_slice(), [Ok(Reply::Swept(0))]));
        assert_eq!(shared.stats.commits.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_sweep_takes_expired_records_from_memory_and_redb_in_order() {
        let shared = shared();
        let claim = short_claim;
        shared.commit_group(&mut [claim(b"\0r1", 10), claim(b"\0r2", 20)]);
        // Into redb: the memtable is checkpointed by a direct transaction.
        shared.direct(|_, _| Ok::<_, Error>(())).unwrap();
        assert!(shared.memory.read_mem().is_empty());
        shared.commit_group(&mut [claim(b"\0m1", 15), claim(b"\0m2", 25)]);
        assert_eq!(swept(&shared, 1_000, 3), 3);
        // Oldest first: r1 (11), m1 (16), r2 (21) went; m2 (26) is left.
        let mem = shared.memory.read_mem();
        assert!(matches!(mem.get(b"\0r1"), Some(None)));
        assert!(matches!(mem.get(b"\0m1"), Some(None)));
        assert!(matches!(mem.get(b"\0r2"), Some(None)));
        assert!(matches!(mem.get(b"\0m2"), Some(Some(_))));
        drop(mem);
        assert_eq!(swept(&shared, 1_000, 3), 1);
        assert_eq!(shared.stats.swept.load(Ordering::Relaxed), 4);
    }

    /// A sweep of one passes over an index entry whose record has another
    /// expiry: it does not count against `max`, and the due record behind
    /// it is swept.
    #[test]
    fn a_sweep_of_one_passes_over_an_index_entry_that_names_another_expiry() {
        let shared = shared();
        shared.commit_group(&mut [short_claim(b"\0r", 10)]);
        shared.flush().unwrap();
        plant_stale_index_entry(&shared, b"\0r", 5);
        assert_eq!(swept(&shared, 1_000, 1), 1);
        assert!(shared.read(b"\0r").unwrap().is_none());
    }
}
