//! The commit line under the Shuttle model checker: the production code of
//! `commit/`, checkpoint.rs, shared.rs's `Shared` and mod.rs's `Drop`
//! under many schedules (docs/testing.md, "The commit line under a model
//! checker"; src/sync.rs for the switch of primitives).
//!
//! ```sh
//! RUSTFLAGS="--cfg shuttle" cargo test --lib shuttle
//! ```
//!
//! A deadlock fails a run, and so does a spin ([`MAX_STEPS`]); a failure
//! prints its schedule, which replays alone from `IDEMSTORE_SHUTTLE_REPLAY`.

use super::shared::{Op, Reply};
use super::{MIN_WAL_BYTES, RedbStore};
use crate::codec;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::Begin;
use crate::response::Response;
use crate::shuttle_support::explore;
use crate::store::Store;
use crate::sync::thread;
use crate::time::Timestamp;
use ::redb::StorageBackend;
use ::redb::backends::InMemoryBackend;
use shuttle::rand::{Rng, thread_rng};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

const T: Timestamp = Timestamp::from_millis(1_000_000);
const D: Duration = Duration::from_secs(10);

/// redb's in-memory backend, shared (a store reopened on it sees what the
/// last one wrote) and able to fail: once `fail` is set every write, length
/// change and sync is an I/O error. Only std primitives, and no scheduling
/// point: redb calls it holding its own std locks (src/sync.rs).
#[derive(Debug, Clone, Default)]
struct Disk {
    inner: Arc<InMemoryBackend>,
    fail: Arc<AtomicBool>,
}

impl Disk {
    fn check(&self) -> std::io::Result<()> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("injected write failure"));
        }
        Ok(())
    }
}

impl StorageBackend for Disk {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.check()?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.check()?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.check()?;
        self.inner.write(offset, data)
    }
}

/// A store with both of its threads, a log of two segments of two frames
/// (a freeze every few groups) and a 1 ms checkpoint interval.
fn open(file: &Disk, log: &Disk) -> RedbStore {
    RedbStore::builder()
        .log_bytes(MIN_WAL_BYTES)
        .checkpoint_interval(Duration::from_millis(1))
        .open_backend(file.clone(), log.clone())
        .expect("open")
}

fn key(id: &str) -> Key {
    Key::new("t", id).expect("key")
}

fn begin_op(id: &str) -> Op {
    Op::Begin {
        key: codec::encode_key(&key(id)),
        fingerprint: Fingerprint::of(b"fp"),
        now: T,
        lease: D,
        retention: D,
        absent_at: None,
    }
}

/// A claim through the blocking line, completed with `id` as the body.
fn claim_and_complete(store: &RedbStore, id: &str) -> Result<Begin, Error> {
    let k = key(id);
    let answer = store.begin(&k, &Fingerprint::of(b"fp"), T, D, D)?;
    if let Begin::Claimed(claim) = &answer {
        store.complete(&k, claim, &Response::new(201, id), T, D)?;
    }
    Ok(answer)
}

/// The same through the async entry.
async fn claim_and_complete_async(store: &RedbStore, id: &str) -> Result<Begin, Error> {
    let k = key(id);
    let fp = Fingerprint::of(b"fp");
    let answer = store
        .begin_async(&k, &fp, T, D, D)
        .expect("native async")
        .await?;
    if let Begin::Claimed(claim) = &answer {
        let response = Response::new(201, id);
        store
            .complete_async(&k, claim, &response, T, D)
            .expect("native async")
            .await?;
    }
    Ok(answer)
}

fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
}

/// A thread per id in `threads` claiming and completing its key, and one
/// thread driving a future that does the same for `task`.
#[allow(
    clippy::type_complexity,
    reason = "two join handles of one answer type"
)]
fn race(
    store: &Arc<RedbStore>,
    threads: &[&'static str],
    task: &'static str,
) -> (
    Vec<thread::JoinHandle<Result<Begin, Error>>>,
    thread::JoinHandle<Result<Begin, Error>>,
) {
    let callers = threads
        .iter()
        .map(|&id| {
            let store = Arc::clone(store);
            thread::spawn(move || claim_and_complete(&store, id))
        })
        .collect();
    let store = Arc::clone(store);
    let future =
        thread::spawn(move || shuttle::future::block_on(claim_and_complete_async(&store, task)));
    (callers, future)
}

/// Yields to the scheduler 0 to 3 times: the caller's next step lands at a
/// point the schedule picks.
fn dawdle() {
    for _ in 0..thread_rng().gen_range(0..4) {
        thread::yield_now();
    }
}

/// Runs in which a checkpoint was written: the scenario reached the
/// checkpointer, not just the line.
static CHECKPOINTED_RUNS: AtomicUsize = AtomicUsize::new(0);

/// Callers in the line with both threads running: two threads race for one
/// key (one claim, the other InFlight or the Replay), a third claims its
/// own, a task claims through the committer; every completed record is
/// there after the drop and after a reopen, and the drop returns. It caught
/// two bugs of the checkpointer's timed freeze, which the committer now
/// does itself (docs/testing.md, "What it caught").
#[test]
fn shuttle_callers_the_committer_and_the_checkpointer() {
    explore("callers, committer, checkpointer", || {
        let (file, log) = (Disk::default(), Disk::default());
        let store = Arc::new(open(&file, &log));
        let (racers, task) = race(&store, &["a", "a", "b"], "c");
        let answers: Vec<_> = racers
            .into_iter()
            .map(|t| t.join().expect("a caller"))
            .collect();
        let claims = answers
            .iter()
            .take(2)
            .filter(|a| matches!(a, Ok(Begin::Claimed(_))))
            .count();
        assert_eq!(claims, 1, "one claim for key a: {answers:?}");
        assert!(
            answers.iter().take(2).all(|a| matches!(
                a,
                Ok(Begin::Claimed(_) | Begin::InFlight { .. } | Begin::Replay(_))
            )),
            "{answers:?}"
        );
        assert!(matches!(answers.get(2), Some(Ok(Begin::Claimed(_)))));
        let task = task.join().expect("the task");
        assert!(matches!(task, Ok(Begin::Claimed(_))), "{task:?}");
        let store = Arc::into_inner(store).expect("every caller is done");
        if store.stats().checkpoints > 0 {
            CHECKPOINTED_RUNS.fetch_add(1, Ordering::Relaxed);
        }
        drop(store);
        let reopened = open(&file, &log);
        for id in ["a", "b", "c"] {
            let record = reopened.get(&key(id), T).expect("get");
            assert!(
                record.is_some_and(|r| r.response() == Some(&Response::new(201, id))),
                "{id} is done"
            );
        }
    });
    assert!(
        CHECKPOINTED_RUNS.load(Ordering::Relaxed) > 0,
        "no run reached a checkpoint"
    );
}

/// A future dropped at a point the schedule picks (still in line, taken by
/// the committer, answered but unread) leaves no claim behind, while a thread
/// claims beside it; the drop returns.
#[test]
fn shuttle_a_future_dropped_mid_commit_gives_its_claim_back() {
    explore("a dropped future", || {
        let (file, log) = (Disk::default(), Disk::default());
        let store = Arc::new(open(&file, &log));
        let dropper = {
            let shared = Arc::clone(&store.shared);
            thread::spawn(move || {
                let mut submitted = shared.submit_async(begin_op("gone")).expect("queued");
                if let Poll::Ready(answer) = poll_once(&mut submitted) {
                    return Some(answer);
                }
                dawdle();
                drop(submitted);
                None
            })
        };
        let other = {
            let store = Arc::clone(&store);
            thread::spawn(move || claim_and_complete(&store, "kept"))
        };
        let read = dropper.join().expect("the dropper");
        assert!(matches!(
            other.join().expect("the other"),
            Ok(Begin::Claimed(_))
        ));
        let store = Arc::into_inner(store).expect("every caller is done");
        let shared = Arc::clone(&store.shared);
        // The committer commits every release queued for the dropped future
        // before it stops.
        drop(store);
        let gone = shared.read(&codec::encode_key(&key("gone"))).expect("read");
        match read {
            // Answered before it was dropped: the claim is its caller's.
            Some(answer) => {
                assert!(matches!(answer, Ok(Reply::Begin(Begin::Claimed(_), _))));
                assert!(gone.is_some());
            }
            None => assert!(gone.is_none(), "a claim nobody saw stayed: {gone:?}"),
        }
        drop(shared);
        let reopened = open(&file, &log);
        assert!(reopened.get(&key("kept"), T).expect("get").is_some());
    });
}

/// The store dropped while futures are in line or joining it: every future
/// is answered (its claim, or Closed), every claim answered survives the
/// close (a reopen sees it), and the drop returns.
#[test]
fn shuttle_dropping_the_store_answers_every_caller_in_line() {
    explore("drop with callers in line", || {
        let (file, log) = (Disk::default(), Disk::default());
        let store = open(&file, &log);
        // One queued before the drop begins, two that join while it runs.
        let queued = store.shared.submit_async(begin_op("q")).expect("queued");
        let mut waiting = vec![(
            "q",
            thread::spawn(move || shuttle::future::block_on(queued)),
        )];
        for id in ["x", "y"] {
            let shared = Arc::clone(&store.shared);
            waiting.push((
                id,
                thread::spawn(move || {
                    let submitted = shared.submit_async(begin_op(id))?;
                    shuttle::future::block_on(submitted)
                }),
            ));
        }
        dawdle();
        drop(store);
        let mut claimed = Vec::new();
        for (id, t) in waiting {
            match t.join().expect("a caller") {
                Ok(Reply::Begin(Begin::Claimed(_), _)) => claimed.push(id),
                Err(Error::Closed) => {}
                other => panic!("{id}: {other:?}"),
            }
        }
        assert!(
            claimed.contains(&"q"),
            "a future in line before the drop is answered"
        );
        let reopened = open(&file, &log);
        for id in claimed {
            assert!(
                reopened.get(&key(id), T).expect("get").is_some(),
                "{id} was claimed, then lost"
            );
        }
    });
}

/// Every answer a caller gets once the store's disk fails: its claim, or
/// the error.
fn answered_or_failed(answer: &Result<Begin, Error>) -> bool {
    matches!(
        answer,
        Ok(Begin::Claimed(_)) | Err(Error::Poisoned { .. } | Error::Backend(_) | Error::Io(_))
    )
}

/// The log's disk fails while callers are in line: the group's callers get
/// the error, later ones Poisoned, nobody waits forever, and the drop
/// returns (the checkpointer stops: the store file still works).
#[test]
fn shuttle_a_failed_log_write_answers_everyone_and_the_drop_returns() {
    explore("a failed log write", || {
        let (file, log) = (Disk::default(), Disk::default());
        let store = Arc::new(open(&file, &log));
        let (callers, task) = race(&store, &["a", "b"], "c");
        dawdle();
        log.fail.store(true, Ordering::SeqCst);
        for t in callers {
            let answer = t.join().expect("a caller");
            assert!(answered_or_failed(&answer), "{answer:?}");
        }
        let answer = task.join().expect("the task");
        assert!(answered_or_failed(&answer), "{answer:?}");
        drop(Arc::into_inner(store).expect("every caller is done"));
    });
}

/// The store file's disk fails, so a checkpoint fails, then the store is
/// dropped: the drop must return and no thread may spin. The failed
/// checkpoint poisons the store; the background thread then tries to heal
/// with back-off, asleep in between, and stops when the drop wakes it.
#[test]
fn shuttle_a_failed_checkpoint_then_a_drop_returns() {
    explore("a failed checkpoint", || {
        let (file, log) = (Disk::default(), Disk::default());
        let store = Arc::new(open(&file, &log));
        // From now on redb cannot write the store file: the first
        // checkpoint fails (the log still works, so groups commit).
        file.fail.store(true, Ordering::SeqCst);
        let callers: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|id| {
                let store = Arc::clone(&store);
                thread::spawn(move || {
                    let first = claim_and_complete(&store, &format!("{id}1"));
                    let second = claim_and_complete(&store, &format!("{id}2"));
                    (first, second)
                })
            })
            .collect();
        for t in callers {
            let (first, second) = t.join().expect("a caller");
            assert!(answered_or_failed(&first), "{first:?}");
            assert!(answered_or_failed(&second), "{second:?}");
        }
        drop(Arc::into_inner(store).expect("every caller is done"));
    });
}

/// Runs in which a read was answered from redb (the kept snapshot or a
/// new one) after the completion.
static SNAPSHOT_RUNS: AtomicUsize = AtomicUsize::new(0);

/// The read path's kept redb snapshot (db.rs) across checkpoints
/// (a read of a checkpointed key goes to redb): `a` is claimed and pushed out to the store file by other keys'
/// groups, then completed and pushed out again. A reader that starts
/// after the completion returned must read it at every point of those
/// checkpoints, never the claim a snapshot kept from before them (a
/// checkpoint that counts its commit only after it retires its frozen
/// table fails this).
#[test]
fn shuttle_a_read_after_a_completion_never_sees_the_claim_a_kept_snapshot_holds() {
    explore("kept snapshot", || {
        let (file, log) = (Disk::default(), Disk::default());
        let store = Arc::new(open(&file, &log));
        let answer = store
            .begin(&key("a"), &Fingerprint::of(b"fp"), T, D, D)
            .expect("claim");
        let Begin::Claimed(claim) = answer else {
            panic!("{answer:?}");
        };
        for id in ["x1", "x2", "x3"] {
            let _ = claim_and_complete(&store, id).expect("x");
        }
        let completed = Arc::new(AtomicBool::new(false));
        let reader = {
            let (store, completed) = (Arc::clone(&store), Arc::clone(&completed));
            thread::spawn(move || {
                for _ in 0..12 {
                    let after = completed.load(Ordering::SeqCst);
                    let record = store.admin().get_raw(&key("a")).expect("read");
                    let state = record.map(|r| r.state());
                    if after {
                        assert_eq!(state, Some(crate::record::State::Done));
                        if store
                            .shared
                            .memory
                            .read_mem()
                            .get(&codec::encode_key(&key("a")))
                            .is_none()
                        {
                            SNAPSHOT_RUNS.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    dawdle();
                }
            })
        };
        store
            .complete(&key("a"), &claim, &Response::new(201, "a"), T, D)
            .expect("complete");
        completed.store(true, Ordering::SeqCst);
        for id in ["y1", "y2", "y3", "y4", "y5"] {
            let _ = claim_and_complete(&store, id).expect("y");
        }
        reader.join().expect("the reader");
    });
    assert!(
        SNAPSHOT_RUNS.load(Ordering::Relaxed) > 0,
        "no run read the completion from redb"
    );
}

/// Runs of the two claimers in which a checkpoint was written.
static TWO_CLAIMERS_CHECKPOINTED: AtomicUsize = AtomicUsize::new(0);

/// Two threads claim `a` while a third pushes groups through the log, so
/// that checkpoints move `a`'s claim out of the memtable into the store
/// file at any point between the second claimer's read and its group:
/// exactly one claim, whatever the schedule.
#[test]
fn shuttle_two_claims_of_one_key_across_checkpoints_make_one_claim() {
    explore("two claimers", || {
        let (file, log) = (Disk::default(), Disk::default());
        let store = Arc::new(open(&file, &log));
        let claimers: Vec<_> = (0..2)
            .map(|_| {
                let store = Arc::clone(&store);
                thread::spawn(move || {
                    store
                        .begin(&key("a"), &Fingerprint::of(b"fp"), T, D, D)
                        .expect("begin")
                })
            })
            .collect();
        let pusher = {
            let store = Arc::clone(&store);
            thread::spawn(move || {
                for id in ["x1", "x2", "x3", "x4"] {
                    let _ = claim_and_complete(&store, id).expect("x");
                }
            })
        };
        let answers: Vec<_> = claimers
            .into_iter()
            .map(|t| t.join().expect("a claimer"))
            .collect();
        pusher.join().expect("the pusher");
        let claims = answers
            .iter()
            .filter(|a| matches!(a, Begin::Claimed(_)))
            .count();
        assert_eq!(claims, 1, "{answers:?}");
        assert!(
            answers
                .iter()
                .all(|a| matches!(a, Begin::Claimed(_) | Begin::InFlight { .. })),
            "{answers:?}"
        );
        if store.stats().checkpoints > 0 {
            TWO_CLAIMERS_CHECKPOINTED.fetch_add(1, Ordering::Relaxed);
        }
    });
    assert!(
        TWO_CLAIMERS_CHECKPOINTED.load(Ordering::Relaxed) > 0,
        "no run reached a checkpoint"
    );
}
