//! The background thread: checkpoints, heals, and relaxed durability's
//! log sync (docs/design.md, "Checkpoints in the background").
//!
//! A checkpoint writes a frozen memtable into redb in one durable commit
//! that also stores the next log epoch, retiring the table's frames; only
//! then is the table dropped and its log segment free for reuse. A failed
//! checkpoint poisons the store (its frames are still in the log, so a heal
//! replays them); the thread then heals with back-off, asleep in between.

use super::health::{HEAL_BACKOFF_MAX, HEAL_BACKOFF_MIN, On};
use super::memtable::{Frozen, UNTIL_WOKEN};
use super::tables::commit;
use super::{Durability, Shared};
use crate::error::{Error, Result};
use crate::sync::atomic::Ordering;
use crate::sync::{Arc, Instant};
use std::time::Duration;

/// The thread's body: runs until the store is dropped (after writing out a
/// frozen memtable that is still waiting, when it can) or fails for good.
pub(super) fn run(shared: Arc<Shared>) {
    let (memory, mut last_sync, mut backoff) = (&shared.memory, Instant::now(), HEAL_BACKOFF_MIN);
    let mut stopping = memory.lock_bg();
    loop {
        // Wakes whoever waits for a checkpoint: done, or never to come.
        memory.bg_cv.notify_all();
        // Not in the `if let`: its read guard would live through the branch.
        let frozen = memory.read_mem().frozen.clone();
        if shared.db.health.is_poisoned() {
            if *stopping || !shared.db.heals() {
                break;
            }
            stopping = memory.wait_bg(stopping, backoff);
            if *stopping {
                break;
            }
            drop(stopping);
            backoff = match shared.heal() {
                Ok(()) => HEAL_BACKOFF_MIN,
                Err(e) => {
                    crate::observability::heal_failed("redb", &e, backoff);
                    next_backoff(backoff)
                }
            };
        } else if let Some(frozen) = frozen {
            drop(stopping);
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
        } else if *stopping {
            break;
        } else {
            // Relaxed durability: the log is synced once its window passed.
            let left = match shared.log.durability {
                Durability::Periodic { max_loss } => max_loss.saturating_sub(last_sync.elapsed()),
                Durability::Immediate => UNTIL_WOKEN,
            };
            if !left.is_zero() {
                stopping = memory.wait_bg(stopping, left);
                continue;
            }
            drop(stopping);
            last_sync = Instant::now();
            if shared.log.unsynced.swap(false, Ordering::SeqCst)
                && let Err(e) = shared.log.file.sync_data()
            {
                // The loop goes on to heal.
                let _ = shared.fail("log sync", On::Log, Error::Io(e));
            }
        }
        stopping = memory.lock_bg();
    }
}

fn next_backoff(backoff: Duration) -> Duration {
    (backoff * 2).min(HEAL_BACKOFF_MAX)
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
    use super::super::commit::tests::commit_one;
    use super::*;
    use crate::redb::RedbStoreBuilder;
    use crate::redb::shared::Op;

    /// A claim of `a` with a 10 s lease.
    fn begin_a() -> Op {
        Op::Begin {
            key: b"\0a".to_vec(),
            fingerprint: crate::fingerprint::Fingerprint::of(b"fp"),
            now: crate::time::Timestamp::from_millis(1_000),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(10),
            absent_at: None,
        }
    }

    /// A key reads the same from the memtable (the log's encoded bytes,
    /// decoded) as from redb once a checkpoint wrote those bytes there.
    #[test]
    fn a_key_reads_the_same_before_and_after_its_checkpoint() {
        use crate::redb::shared::Reply;
        let shared = super::super::commit::tests::shared();
        let Ok(Reply::Begin(crate::Begin::Claimed(claim), _)) = commit_one(&shared, begin_a())
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
        commit_one(&shared, complete).unwrap();
        let mut begin_b = begin_a();
        if let Op::Begin { key, .. } = &mut begin_b {
            *key = b"\0b".to_vec();
        }
        commit_one(&shared, begin_b).unwrap();
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

    /// Each failed heal doubles the wait before the next, up to
    /// [`HEAL_BACKOFF_MAX`]: a wait that shrank instead would retry a
    /// persistent failure in a busy loop.
    #[test]
    fn the_heal_backoff_doubles_up_to_its_maximum() {
        assert_eq!(next_backoff(HEAL_BACKOFF_MIN), HEAL_BACKOFF_MIN * 2);
        assert_eq!(next_backoff(HEAL_BACKOFF_MAX), HEAL_BACKOFF_MAX);
        assert_eq!(next_backoff(HEAL_BACKOFF_MAX * 3 / 4), HEAL_BACKOFF_MAX);
    }

    /// A store under `Durability::Periodic { max_loss }`, its checkpoints
    /// an hour apart.
    fn relaxed(dir: &tempfile::TempDir, max_loss: Duration) -> crate::RedbStore {
        RedbStoreBuilder::default()
            .durability(Durability::Periodic { max_loss })
            .checkpoint_interval(Duration::from_secs(3600))
            .open(dir.path().join("store.redb"))
            .unwrap()
    }

    /// Under relaxed durability this thread syncs the log within the loss
    /// window even when no checkpoint is due: a loop that did not count the
    /// window as work left an idle store's writes unsynced until the next
    /// checkpoint.
    #[test]
    fn an_idle_relaxed_store_syncs_its_log_within_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let max_loss = Duration::from_millis(10);
        let store = relaxed(&dir, max_loss);
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

    /// ... and not before the window has passed: a thread that synced at
    /// every wake-up would make relaxed durability pay a sync per write.
    #[test]
    fn a_relaxed_store_leaves_its_log_unsynced_within_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let store = relaxed(&dir, Duration::from_secs(3600));
        let _ = store.shared.submit(begin_a()).unwrap();
        // Wake the thread as a freeze or a failure would.
        store.shared.memory.wake_background();
        std::thread::sleep(Duration::from_millis(50));
        assert!(store.shared.log.unsynced.load(Ordering::SeqCst));
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
        assert!(shared.db.health.is_poisoned());
        assert!(matches!(
            shared.db.health.check(),
            Err(Error::Poisoned { .. })
        ));
    }
}
