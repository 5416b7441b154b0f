//! `PgInbox::handle_batch`'s set-based passes against a real server: the
//! batch's claims and DONE records in one statement each, a failing message
//! rolled back with its pass and the batch run again without it (then in a
//! savepoint per message), concurrent batches over the same ids. Gated like
//! the other PostgreSQL tests.

use crate::postgres::{DropTable, claimed, enabled, fresh_store, key, pg_url, raw};
use idemstore::postgres::{Delivery, PgInbox};
use idemstore::{Error, Fingerprint, PostgresStore, Response, Store, Timestamp};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

/// An inbox on a fresh table, and the name of a `runs` table its handlers
/// write one row to per run (no key: a run that committed twice would
/// show as two rows).
pub(crate) struct Fixture {
    pub(crate) inbox: PgInbox,
    pub(crate) runs: String,
    pub(crate) url: String,
    pub(crate) _table: DropTable,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Ok(mut c) = ::postgres::Client::connect(&self.url, ::postgres::NoTls) {
            let _ = c.batch_execute(&format!("DROP TABLE IF EXISTS \"{}\"", self.runs));
        }
    }
}

pub(crate) fn fixture(pool: u32) -> Fixture {
    let (store, table) = fresh_store("inbatch", pool);
    let url = pg_url().unwrap();
    let runs = format!("{}_runs", table.table);
    raw(&url)
        .batch_execute(&format!(
            "CREATE TABLE \"{runs}\" (id text NOT NULL, token bigint NOT NULL)"
        ))
        .unwrap();
    Fixture {
        inbox: PgInbox::new(store),
        runs,
        url,
        _table: table,
    }
}

impl Fixture {
    /// Committed runs per id, sorted by id.
    pub(crate) fn runs(&self) -> Vec<(String, i64)> {
        raw(&self.url)
            .query(
                &format!(
                    "SELECT id, count(*) FROM \"{}\" GROUP BY id ORDER BY id",
                    self.runs
                ),
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }

    pub(crate) fn record(&self, id: &str) -> Option<idemstore::Record> {
        self.inbox.store().get(&key(id), now()).unwrap()
    }
}

pub(crate) fn now() -> Timestamp {
    Timestamp::from_system_time(std::time::SystemTime::now())
}

/// What a message's handler does after writing its run row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Act {
    /// Answers 200 with "<id> <token> <takeover>".
    Ok,
    Fail,
    Panic,
    /// Answers a body over the store's limit.
    TooLarge,
}

/// Runs `batch` (id, fingerprint seed, act) through `handle_batch`; the
/// handler writes a run row, then acts. Also counts handler calls
/// (committed or not) in `calls`.
fn run_batch(
    f: &Fixture,
    batch: &[(&str, u8, Act)],
    calls: &Arc<AtomicUsize>,
) -> Vec<Result<Delivery, Error>> {
    run_batch_on(&f.inbox, &f.runs, batch, calls).unwrap()
}

fn run_batch_on(
    inbox: &PgInbox,
    runs: &str,
    batch: &[(&str, u8, Act)],
    calls: &Arc<AtomicUsize>,
) -> Result<Vec<Result<Delivery, Error>>, Error> {
    let sql = format!("INSERT INTO \"{runs}\" (id, token) VALUES ($1, $2)");
    let messages = batch
        .iter()
        .map(|&(id, fp, act)| (key(id), Fingerprint::of([fp]), (id.to_owned(), act)))
        .collect();
    let calls = Arc::clone(calls);
    inbox.handle_batch(messages, move |client, claim, (id, act): &(String, Act)| {
        calls.fetch_add(1, Ordering::SeqCst);
        let (sql, id, act) = (sql.clone(), id.clone(), *act);
        Box::pin(async move {
            let token = i64::try_from(claim.token()).unwrap();
            client
                .execute(&sql, &[&id, &token])
                .await
                .map_err(Error::backend)?;
            match act {
                Act::Ok => Ok(Response::new(
                    200,
                    format!("{id} {} {}", claim.token(), claim.is_takeover()),
                )
                .with_header("x-id", id.as_str())),
                Act::Fail => Err(Error::backend("the consumer failed")),
                Act::Panic => panic!("the consumer panicked"),
                Act::TooLarge => Ok(Response::new(200, vec![0u8; 2 << 20])),
            }
        })
    })
}

pub(crate) fn handled(d: &Result<Delivery, Error>) -> &Response {
    match d {
        Ok(Delivery::Handled(r)) => r,
        other => panic!("expected Handled, got {other:?}"),
    }
}

pub(crate) fn runs_of(pairs: &[(&str, i64)]) -> Vec<(String, i64)> {
    pairs.iter().map(|&(id, n)| (id.to_owned(), n)).collect()
}

/// One failing message in the middle: the batch runs again without it (its
/// batch-mates' handlers run twice, their first run rolled back), it
/// leaves no write and no record, its batch-mates commit theirs once.
#[test]
fn a_failed_message_leaves_nothing_and_its_batch_mates_commit_once() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let answers = run_batch(
        &f,
        &[("a", 1, Act::Ok), ("b", 1, Act::Fail), ("c", 1, Act::Ok)],
        &calls,
    );
    assert!(handled(&answers[0]).body().starts_with(b"a "));
    assert!(matches!(&answers[1], Err(e) if e.to_string().contains("consumer failed")));
    assert!(handled(&answers[2]).body().starts_with(b"c "));
    // a, b (failed, rolled back with a's first run), then a and c again.
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_eq!(f.runs(), runs_of(&[("a", 1), ("c", 1)]));
    assert!(f.record("b").is_none());
    for id in ["a", "c"] {
        let record = f.record(id).unwrap();
        assert_eq!(record.state(), idemstore::State::Done);
        // The stored response is the second run's, headers included.
        let answer = if id == "a" { &answers[0] } else { &answers[2] };
        assert_eq!(record.response(), Some(handled(answer)));
        assert_eq!(
            handled(answer).header("x-id").map(<[u8]>::to_vec),
            Some(id.as_bytes().to_vec())
        );
    }
    // The failed one runs when redelivered.
    let again = run_batch(&f, &[("b", 1, Act::Ok)], &calls);
    assert!(handled(&again[0]).body().starts_with(b"b "));
    assert_eq!(f.runs(), runs_of(&[("a", 1), ("b", 1), ("c", 1)]));
}

/// A panicking message, and one whose result is over the limits, likewise.
#[test]
fn a_panicking_or_oversized_message_leaves_nothing() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let answers = run_batch(&f, &[("a", 1, Act::Panic), ("b", 1, Act::Ok)], &calls);
    assert!(
        matches!(&answers[0], Err(Error::HandlerPanicked { message }) if message.contains("panicked")),
        "{answers:?}"
    );
    handled(&answers[1]);
    assert_eq!(f.runs(), runs_of(&[("b", 1)]));
    assert!(f.record("a").is_none());

    let answers = run_batch(&f, &[("c", 1, Act::Ok), ("d", 1, Act::TooLarge)], &calls);
    handled(&answers[0]);
    assert!(
        matches!(&answers[1], Err(Error::ResponseTooLarge { .. })),
        "{answers:?}"
    );
    assert_eq!(f.runs(), runs_of(&[("b", 1), ("c", 1)]));
    assert!(f.record("d").is_none());
}

/// Three failing messages: two fast passes, then the savepoint pass, where
/// the third failure rolls back only its own message.
#[test]
fn many_failed_messages_each_leave_nothing() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let batch = [
        ("a", 1, Act::Ok),
        ("b", 1, Act::Fail),
        ("c", 1, Act::Ok),
        ("d", 1, Act::Panic),
        ("e", 1, Act::Ok),
        ("g", 1, Act::Fail),
        ("h", 1, Act::Ok),
    ];
    let answers = run_batch(&f, &batch, &calls);
    for i in [0, 2, 4, 6] {
        handled(&answers[i]);
    }
    assert!(matches!(&answers[1], Err(e) if e.to_string().contains("consumer failed")));
    assert!(matches!(&answers[3], Err(Error::HandlerPanicked { .. })));
    assert!(matches!(&answers[5], Err(e) if e.to_string().contains("consumer failed")));
    // Pass 1 stops at b (2 calls), pass 2 at d (3), pass 3 runs the 5 left.
    assert_eq!(calls.load(Ordering::SeqCst), 2 + 3 + 5);
    assert_eq!(f.runs(), runs_of(&[("a", 1), ("c", 1), ("e", 1), ("h", 1)]));
    for failed in ["b", "d", "g"] {
        assert!(f.record(failed).is_none(), "{failed}");
    }
    for ok in ["a", "c", "e", "h"] {
        assert_eq!(f.record(ok).unwrap().state(), idemstore::State::Done);
    }
}

/// The same id more than once in a batch: handled once, the later ones
/// Duplicate of it (Conflict under another fingerprint); after a failed
/// first, a later one with its fingerprint is tried afresh and one with
/// another is Conflict.
#[test]
fn duplicate_ids_in_one_batch() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let answers = run_batch(
        &f,
        &[
            ("a", 1, Act::Ok),
            ("x", 1, Act::Fail),
            ("a", 1, Act::Ok),
            ("x", 2, Act::Ok),
            ("a", 2, Act::Ok),
            ("x", 1, Act::Ok),
            ("x", 1, Act::Ok),
        ],
        &calls,
    );
    let first = handled(&answers[0]).clone();
    assert!(matches!(&answers[1], Err(e) if e.to_string().contains("consumer failed")));
    assert_eq!(answers[2].as_ref().unwrap(), &Delivery::Duplicate(first));
    assert_eq!(answers[3].as_ref().unwrap(), &Delivery::Conflict);
    assert_eq!(answers[4].as_ref().unwrap(), &Delivery::Conflict);
    let retried = handled(&answers[5]).clone();
    assert!(retried.body().starts_with(b"x "));
    assert_eq!(answers[6].as_ref().unwrap(), &Delivery::Duplicate(retried));
    assert_eq!(f.runs(), runs_of(&[("a", 1), ("x", 1)]));
}

/// A redelivered batch: every message Duplicate with its stored response,
/// no handler called.
#[test]
fn a_redelivered_batch_runs_no_handler() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let batch: Vec<String> = (0..20).map(|i| format!("m{i:02}")).collect();
    let batch: Vec<(&str, u8, Act)> = batch.iter().map(|id| (id.as_str(), 1, Act::Ok)).collect();
    let first = run_batch(&f, &batch, &calls);
    assert_eq!(calls.load(Ordering::SeqCst), 20);
    let again = run_batch(&f, &batch, &calls);
    assert_eq!(calls.load(Ordering::SeqCst), 20, "no handler ran again");
    for (a, b) in first.iter().zip(&again) {
        assert_eq!(
            b.as_ref().unwrap(),
            &Delivery::Duplicate(handled(a).clone())
        );
    }
    assert_eq!(f.runs().len(), 20);
}

/// A message whose claim through the Store API has a live lease is
/// InFlight (its handler does not run); one whose lease ran out is taken
/// over inside the batch: a new, larger token, attempt 2, and the old
/// owner's completion is stale.
#[test]
fn in_flight_and_taken_over_claims_inside_a_batch() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let store = f.inbox.store();
    let (lease, keep) = (Duration::from_secs(1), Duration::from_secs(3600));
    let live = claimed(
        store
            .begin(
                &key("live"),
                &Fingerprint::of([1]),
                now(),
                Duration::from_secs(600),
                keep,
            )
            .unwrap(),
    );
    let old = now() - Duration::from_secs(10);
    let expired = claimed(
        store
            .begin(&key("expired"), &Fingerprint::of([1]), old, lease, keep)
            .unwrap(),
    );
    let calls = Arc::new(AtomicUsize::new(0));
    let answers = run_batch(
        &f,
        &[
            ("live", 1, Act::Ok),
            ("expired", 1, Act::Ok),
            ("fresh", 1, Act::Ok),
        ],
        &calls,
    );
    assert!(
        matches!(answers[0], Ok(Delivery::InFlight { lease_until }) if lease_until == live.lease_until()),
        "{answers:?}"
    );
    let body = String::from_utf8(handled(&answers[1]).body().to_vec()).unwrap();
    let token: u64 = body.split(' ').nth(1).unwrap().parse().unwrap();
    assert!(token > expired.token(), "{body}");
    assert!(body.ends_with(" true"), "a takeover: {body}");
    assert_eq!(f.record("expired").unwrap().attempts(), 2);
    assert!(handled(&answers[2]).body().ends_with(b" false"));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(f.runs(), runs_of(&[("expired", 1), ("fresh", 1)]));
    assert!(matches!(
        store.complete(
            &key("expired"),
            &expired,
            &Response::new(200, "late"),
            now(),
            keep
        ),
        Err(Error::StaleClaim)
    ));
}

/// Two consumers (stores of their own on one table) race over the same
/// ids, one in the reverse order of the other: every message is handled
/// by exactly one of them (one committed run row), the other answers
/// Duplicate of its response, and neither batch fails (no deadlock).
#[test]
fn racing_consumers_never_both_handle_a_message() {
    if !enabled() {
        return;
    }
    let f = Arc::new(fixture(2));
    let url = pg_url().unwrap();
    let second = Arc::new(PgInbox::new(
        PostgresStore::builder()
            .table(&f._table.table)
            .connect(&url)
            .unwrap(),
    ));
    let ids: Vec<String> = (0..60).map(|i| format!("r{i:02}")).collect();
    for round in 0..3 {
        let ids: Vec<String> = ids.iter().map(|id| format!("{id}-{round}")).collect();
        let barrier = Arc::new(Barrier::new(2));
        let calls = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = [false, true]
            .into_iter()
            .map(|reverse| {
                let (f, second, barrier, calls) = (
                    Arc::clone(&f),
                    Arc::clone(&second),
                    Arc::clone(&barrier),
                    Arc::clone(&calls),
                );
                let mut ids = ids.clone();
                if reverse {
                    ids.reverse();
                }
                std::thread::spawn(move || {
                    let batch: Vec<(&str, u8, Act)> =
                        ids.iter().map(|id| (id.as_str(), 1, Act::Ok)).collect();
                    let inbox = if reverse { &*second } else { &f.inbox };
                    barrier.wait();
                    let answers = run_batch_on(inbox, &f.runs, &batch, &calls).unwrap();
                    ids.into_iter()
                        .zip(answers.into_iter().map(Result::unwrap))
                        .collect::<std::collections::HashMap<String, Delivery>>()
                })
            })
            .collect();
        let answers: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for id in &ids {
            let (a, b) = (&answers[0][id], &answers[1][id]);
            let ok = matches!(
                (a, b),
                (Delivery::Handled(x), Delivery::Duplicate(y))
                    | (Delivery::Duplicate(y), Delivery::Handled(x)) if x == y
            );
            assert!(ok, "{id}: {a:?} / {b:?}");
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            ids.len(),
            "no handler ran twice"
        );
    }
    let runs = f.runs();
    assert_eq!(runs.len(), 180);
    assert!(runs.iter().all(|(_, n)| *n == 1), "{runs:?}");
}

/// An id another consumer is handling right now: the batch waits for that
/// transaction, then answers Duplicate of its response, and handles the
/// rest.
#[test]
fn an_id_being_handled_elsewhere_is_waited_for() {
    if !enabled() {
        return;
    }
    let f = Arc::new(fixture(2));
    let url = pg_url().unwrap();
    let second = PgInbox::new(
        PostgresStore::builder()
            .table(&f._table.table)
            .connect(&url)
            .unwrap(),
    );
    let (claimed_tx, claimed_rx) = std::sync::mpsc::channel();
    let slow = {
        let f = Arc::clone(&f);
        std::thread::spawn(move || {
            f.inbox.handle::<Error, _>(
                &key("busy"),
                &Fingerprint::of([1]),
                move |_client, _claim| {
                    Box::pin(async move {
                        let _ = claimed_tx.send(());
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        Ok(Response::new(201, "slow"))
                    })
                },
            )
        })
    };
    claimed_rx.recv().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let answers = run_batch_on(
        &second,
        &f.runs,
        &[("busy", 1, Act::Ok), ("other", 1, Act::Ok)],
        &calls,
    )
    .unwrap();
    assert_eq!(
        slow.join().unwrap().unwrap(),
        Delivery::Handled(Response::new(201, "slow"))
    );
    assert_eq!(
        answers[0].as_ref().unwrap(),
        &Delivery::Duplicate(Response::new(201, "slow"))
    );
    handled(&answers[1]);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// The previous owner of a claim the batch takes over (its lease ran out)
/// completes it while the batch's handler runs: the batch's DONE write
/// finds the row no longer claimable, rolls the pass back, decides again,
/// and answers Duplicate of the owner's response; the takeover's write is
/// gone and its handler does not run again.
#[test]
fn an_owner_completing_during_a_takeover_wins() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let url = pg_url().unwrap();
    // Another replica's store on the same table (a runtime of its own, so
    // the handler below can call it while the batch holds this one's).
    let owner_store = Arc::new(
        PostgresStore::builder()
            .table(&f._table.table)
            .connect(&url)
            .unwrap(),
    );
    let keep = Duration::from_secs(3600);
    let old = now() - Duration::from_secs(10);
    let owner = claimed(
        owner_store
            .begin(
                &key("t"),
                &Fingerprint::of([1]),
                old,
                Duration::from_secs(1),
                keep,
            )
            .unwrap(),
    );
    let calls = Arc::new(AtomicUsize::new(0));
    let sql = format!("INSERT INTO \"{}\" (id, token) VALUES ($1, $2)", f.runs);
    let answers = {
        let (calls, owner_store, owner) =
            (Arc::clone(&calls), Arc::clone(&owner_store), owner.clone());
        f.inbox
            .handle_batch(
                vec![
                    (key("t"), Fingerprint::of([1]), "t"),
                    (key("u"), Fingerprint::of([1]), "u"),
                ],
                move |client, claim, id: &&str| {
                    let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
                    let (sql, owner_store, owner, id) =
                        (sql.clone(), Arc::clone(&owner_store), owner.clone(), *id);
                    Box::pin(async move {
                        let token = i64::try_from(claim.token()).unwrap();
                        client
                            .execute(&sql, &[&id, &token])
                            .await
                            .map_err(Error::backend)?;
                        if first {
                            assert!(claim.is_takeover());
                            // The old owner, late but within the record's life.
                            owner_store
                                .complete(
                                    &key("t"),
                                    &owner,
                                    &Response::new(200, "late"),
                                    now(),
                                    keep,
                                )
                                .unwrap();
                        }
                        Ok::<_, Error>(Response::new(200, "ours"))
                    })
                },
            )
            .unwrap()
    };
    assert_eq!(
        answers[0].as_ref().unwrap(),
        &Delivery::Duplicate(Response::new(200, "late"))
    );
    assert_eq!(handled(&answers[1]), &Response::new(200, "ours"));
    // t's handler ran once (rolled back), u's twice (the first rolled back).
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(f.runs(), runs_of(&[("u", 1)]));
    assert_eq!(f.record("t").unwrap().token(), owner.token());
}
