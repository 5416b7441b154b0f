//! The background thread: checkpoints, heals, and relaxed durability's
//! timers (docs/design.md, "Checkpoints in the background").
//!
//! A checkpoint writes a frozen memtable into redb in one durable commit
//! that also stores the next log epoch, retiring the table's frames; only
//! then is the table dropped and its log segment free for reuse. A failed
//! checkpoint poisons the store (its frames are still in the log, so a heal
//! replays them); the thread then heals with back-off, asleep in between.

use super::health::{HEAL_BACKOFF_MAX, HEAL_BACKOFF_MIN, On};
use super::memtable::{Bg, Frozen};
use super::tables::commit;
use super::{Durability, Shared};
use crate::error::{Error, Result};
use crate::sync::atomic::Ordering;
use crate::sync::{Arc, Instant, MutexGuard};
use std::time::Duration;

/// The thread's body: runs until the store is dropped (after writing out a
/// frozen memtable that is still waiting, when it can) or fails for good.
pub(super) fn run(shared: Arc<Shared>) {
    let mut last_sync = Instant::now();
    let mut backoff = HEAL_BACKOFF_MIN;
    // The last tick found the commit lock held.
    let mut busy = false;
    let mut bg = shared.memory.lock_bg();
    loop {
        if shared.db.is_poisoned() {
            // Wake anyone waiting for a checkpoint that will not come.
            shared.memory.bg_cv.notify_all();
            if bg.shutdown || !shared.db.heals() {
                break;
            }
            bg = wait(&shared, bg, backoff);
            if bg.shutdown {
                break;
            }
            drop(bg);
            backoff = match shared.heal() {
                Ok(()) => HEAL_BACKOFF_MIN,
                Err(e) => {
                    crate::observability::heal_failed("redb", &e, backoff);
                    next_backoff(backoff)
                }
            };
            bg = shared.memory.lock_bg();
            shared.memory.bg_cv.notify_all();
            continue;
        }
        let frozen = shared.memory.read_mem().frozen.clone();
        if let Some(frozen) = frozen {
            drop(bg);
            let started = Instant::now();
            match checkpoint(&shared, &frozen) {
                Ok(()) => {
                    shared.stats.checkpoints.fetch_add(1, Ordering::Relaxed);
                    shared.stats.durable_commits.fetch_add(1, Ordering::Relaxed);
                    crate::observability::checkpointed(frozen.records.len(), started.elapsed());
                }
                // The loop goes on to heal, not to retry.
                Err(e) => _ = shared.fail("checkpoint", On::Store, e),
            }
            bg = shared.memory.lock_bg();
            shared.memory.bg_cv.notify_all();
            continue;
        }
        if bg.shutdown {
            shared.memory.bg_cv.notify_all();
            break;
        }
        let mut wait = Duration::from_secs(3600);
        let mut work = false;
        if shared.memory.read_mem().active.is_empty() {
            // Woken by the first publish; the interval is a backstop.
            wait = wait.min(shared.memory.checkpoint_interval);
        } else {
            let left = shared.memory.checkpoint_left();
            work |= left.is_zero();
            wait = wait.min(left);
        }
        if let Durability::Periodic { max_loss } = shared.log.durability {
            let left = max_loss.saturating_sub(last_sync.elapsed());
            work |= left.is_zero();
            wait = wait.min(left.max(Duration::from_millis(1)));
        }
        if std::mem::take(&mut busy) {
            // The commit lock was held: wait, not spin. Its holder freezes a
            // due memtable itself (waking this thread); the wait is a backstop.
            work = false;
            wait = busy_backoff(&shared);
        }
        if !work {
            bg = self::wait(&shared, bg, wait.max(Duration::from_millis(1)));
            continue;
        }
        drop(bg);
        // A failure poisons the store where it happens; the loop then heals.
        let result = tick(&shared, &mut last_sync);
        busy = matches!(result, Ok(Tick::Busy));
        bg = shared.memory.lock_bg();
    }
}

/// Waits at most `timeout` for the thread to be woken.
fn wait<'a>(shared: &'a Shared, bg: MutexGuard<'a, Bg>, timeout: Duration) -> MutexGuard<'a, Bg> {
    let woken = shared.memory.bg_cv.wait_timeout(bg, timeout);
    woken.map(|(bg, _)| bg).unwrap_or_else(|p| p.into_inner().0)
}

fn next_backoff(backoff: Duration) -> Duration {
    (backoff * 2).min(HEAL_BACKOFF_MAX)
}

/// How long the thread waits after [`tick`] found the commit lock held:
/// the checkpoint interval, and under relaxed durability no longer than
/// the loss window (the log's sync does not wait for the lock).
fn busy_backoff(shared: &Shared) -> Duration {
    let backoff = match shared.log.durability {
        Durability::Periodic { max_loss } => shared.memory.checkpoint_interval.min(max_loss),
        Durability::Immediate => shared.memory.checkpoint_interval,
    };
    backoff.max(Duration::from_millis(1))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tick {
    Done,
    /// Work under the commit lock was due and another thread held the lock.
    Busy,
}

/// The timed work: an old memtable is frozen; under relaxed durability the
/// log is synced. The commit lock is only tried ([`Tick::Busy`] if held):
/// its holder may be waiting for this thread's checkpoint. Under the lock,
/// a frozen table already waiting means nothing is to be frozen: `freeze`
/// would wait for that table, which only this thread writes.
pub(super) fn tick(shared: &Shared, last_sync: &mut Instant) -> Result<Tick> {
    let mut done = Tick::Done;
    if shared.memory.checkpoint_due() {
        match shared.log.try_lock() {
            Some(mut core) => {
                if shared.memory.read_mem().frozen.is_none() {
                    shared.freeze(&mut core)?;
                }
            }
            None => done = Tick::Busy,
        }
    }
    if let Durability::Periodic { max_loss } = shared.log.durability
        && last_sync.elapsed() >= max_loss
    {
        *last_sync = Instant::now();
        if shared.log.unsynced.swap(false, Ordering::SeqCst)
            && let Err(e) = shared.log.file.sync_data()
        {
            return Err(shared.fail("log sync", On::Log, Error::Io(e)));
        }
    }
    Ok(done)
}

/// Writes `frozen` into redb in one durable commit that also retires its
/// log epoch, then drops it, unless a heal took it away meanwhile (and a
/// later freeze may have put another in its place).
fn checkpoint(shared: &Shared, frozen: &std::sync::Arc<Frozen>) -> Result<()> {
    let db = shared.db.write_ready_db()?;
    // The frozen table's mark is the store's: every durable commit before
    // this one stored a mark from before this table was frozen.
    commit(&db, true, |tables| {
        tables.take_in(&frozen.records)?;
        tables.retire(frozen.token_hwm, frozen.epoch.wrapping_add(1))
    })??;
    // Before the frozen table goes (db.rs).
    shared.db.snapshot.committed();
    // The memtable's lock comes before the engine's (lock order: shared.rs).
    drop(db);
    let mut mem = shared.memory.write_mem();
    mem.frozen.take_if(|f| std::sync::Arc::ptr_eq(f, frozen));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redb::RedbStoreBuilder;
    use crate::redb::open;
    use crate::redb::shared::Op;
    use std::path::Path;

    /// A claim of `a` with a 10 s lease.
    fn begin_a() -> Op {
        Op::Begin {
            key: b"\0a".to_vec(),
            fingerprint: crate::fingerprint::Fingerprint::of(b"fp"),
            now: crate::time::Timestamp::from_millis(1_000),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(10),
        }
    }

    /// A key reads the same from the memtable (the log's encoded bytes,
    /// decoded) as from redb once a checkpoint wrote those bytes there.
    #[test]
    fn a_key_reads_the_same_before_and_after_its_checkpoint() {
        use crate::redb::shared::Reply;
        let shared = super::super::commit::tests::shared();
        let Ok(Reply::Begin(crate::Begin::Claimed(claim))) =
            super::super::commit::tests::commit_one(&shared, begin_a())
        else {
            panic!("claimed");
        };
        let now = crate::time::Timestamp::from_millis(2_000);
        let response = crate::response::Response::new(201, "body");
        let complete = Op::Complete {
            key: b"\0a".to_vec(),
            claim,
            response,
            now,
            retention: Duration::from_secs(10),
        };
        super::super::commit::tests::commit_one(&shared, complete).unwrap();
        let mut begin_b = begin_a();
        if let Op::Begin { key, .. } = &mut begin_b {
            *key = b"\0b".to_vec();
        }
        super::super::commit::tests::commit_one(&shared, begin_b).unwrap();
        let before = (shared.read(b"\0a").unwrap(), shared.read(b"\0b").unwrap());
        assert!(
            shared.memory.read_mem().get(b"\0a").is_some(),
            "read from memory"
        );
        let frozen = {
            let mut core = shared.log.lock();
            shared.freeze(&mut core).unwrap();
            shared.memory.read_mem().frozen.clone().unwrap()
        };
        checkpoint(&shared, &frozen).unwrap();
        assert!(shared.memory.read_mem().is_empty(), "read from redb");
        let after = (shared.read(b"\0a").unwrap(), shared.read(b"\0b").unwrap());
        assert!(before.0.as_ref().is_some_and(|r| r.response.is_some()));
        assert_eq!(before, after);
    }

    /// A tick that finds the commit lock held with a memtable due says so,
    /// so that the loop waits instead of spinning for as long as the lock
    /// is held.
    #[test]
    fn a_tick_that_finds_the_commit_lock_held_says_so() {
        let shared = super::super::commit::tests::shared_with(
            RedbStoreBuilder::default().checkpoint_interval(Duration::from_millis(1)),
        );
        let _ = super::super::commit::tests::commit_one(&shared, begin_a()).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(shared.memory.checkpoint_due());
        let held = shared.log.lock();
        let ticked = tick(&shared, &mut Instant::now());
        assert!(matches!(ticked, Ok(Tick::Busy)), "{ticked:?}");
        drop(held);
        // With the lock free the due memtable is frozen.
        let ticked = tick(&shared, &mut Instant::now());
        assert!(matches!(ticked, Ok(Tick::Done)), "{ticked:?}");
        assert!(shared.memory.read_mem().frozen.is_some());
    }

    /// After a tick found the commit lock held, the thread waits the
    /// checkpoint interval, and under relaxed durability no longer than the
    /// loss window: a zero wait would poll the lock every millisecond for
    /// as long as it is held.
    #[test]
    fn a_busy_tick_waits_the_interval_or_the_loss_window() {
        let shared = |builder: RedbStoreBuilder| {
            let config = builder
                .checkpoint_interval(Duration::from_millis(500))
                .config;
            let backend = ::redb::backends::InMemoryBackend::new();
            let log = Box::new(::redb::backends::InMemoryBackend::new());
            let opened =
                open::open_backend(backend, log, None, &config, Path::new("memory")).unwrap();
            Shared::new(opened, &config, None)
        };
        let immediate = shared(RedbStoreBuilder::default());
        assert_eq!(busy_backoff(&immediate), Duration::from_millis(500));
        let max_loss = Duration::from_millis(20);
        let periodic =
            shared(RedbStoreBuilder::default().durability(Durability::Periodic { max_loss }));
        assert_eq!(busy_backoff(&periodic), max_loss);
    }

    /// Each failed heal doubles the wait before the next, up to
    /// [`HEAL_BACKOFF_MAX`]: a wait that shrank instead would retry a
    /// persistent failure in a busy loop.
    #[test]
    fn the_heal_backoff_doubles_up_to_its_maximum() {
        assert_eq!(next_backoff(HEAL_BACKOFF_MIN), HEAL_BACKOFF_MIN * 2);
        assert_eq!(next_backoff(HEAL_BACKOFF_MAX), HEAL_BACKOFF_MAX);
        assert_eq!(next_backoff(HEAL_BACKOFF_MAX * 3 / 4), HEAL_BACKOFF_MAX);
    }

    /// Under relaxed durability this thread syncs the log within the loss
    /// window even when no checkpoint is due: a loop that did not count the
    /// window as work left an idle store's writes unsynced until the next
    /// checkpoint.
    #[test]
    fn an_idle_relaxed_store_syncs_its_log_within_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let max_loss = Duration::from_millis(10);
        let store = RedbStoreBuilder::default()
            .durability(Durability::Periodic { max_loss })
            .checkpoint_interval(Duration::from_secs(3600))
            .open(dir.path().join("store.redb"))
            .unwrap();
        let shared = &store.shared;
        let _ = shared.submit(begin_a()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while shared.log.unsynced.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
            std::thread::sleep(max_loss);
        }
        assert!(!shared.log.unsynced.load(Ordering::SeqCst));
        // Nothing was due: the record is still in the active memtable.
        assert!(!shared.memory.read_mem().active.is_empty());
    }

    /// Damage does not heal: the thread stops rather than reopening the
    /// store, which would let writes resume over a corrupt file.
    #[test]
    fn a_damaged_store_stays_poisoned() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStoreBuilder::default()
            .open(dir.path().join("store.redb"))
            .unwrap();
        let shared = &store.shared;
        let _ = shared.fail("test", On::Store, Error::corrupt(None, "test damage"));
        assert!(!shared.db.heals());
        std::thread::sleep(HEAL_BACKOFF_MIN * 10);
        assert!(shared.db.is_poisoned());
        assert!(matches!(
            shared.db.check_healthy(),
            Err(Error::Poisoned { .. })
        ));
    }
}
