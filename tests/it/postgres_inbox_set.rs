//! `PgInbox::handle_set`: one handler call over every claimed message of a
//! transaction, a failing set halved down to the message that fails alone,
//! the same id twice, takeovers, racing consumers. The same answers as
//! `handle_batch` gives (postgres_inbox_batch.rs) wherever the two can be
//! compared. Gated like the other PostgreSQL tests.

use crate::postgres::{claimed, enabled, key, pg_url};
use crate::postgres_inbox_batch::{Act, Fixture, fixture, handled, now, runs_of};
use idemstore::postgres::{Claimed, Delivery, PgInbox};
use idemstore::{Error, Fingerprint, PostgresStore, Response, Store};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

/// Runs `batch` (id, fingerprint seed, act) through `handle_set`: the
/// handler writes every claimed message's run row in one statement, then
/// fails (or panics) if any message of the set does, else answers each
/// (`Act::TooLarge`: a body over the limit). `calls` counts handler calls.
fn run_set_on(
    inbox: &PgInbox,
    runs: &str,
    batch: &[(&str, u8, Act)],
    calls: &Arc<AtomicUsize>,
) -> Result<Vec<Result<Delivery, Error>>, Error> {
    let sql = format!(
        "INSERT INTO \"{runs}\" (id, token) SELECT * FROM unnest($1::text[], $2::bigint[])"
    );
    let messages = batch
        .iter()
        .map(|&(id, fp, act)| (key(id), Fingerprint::of([fp]), (id.to_owned(), act)))
        .collect();
    let calls = Arc::clone(calls);
    inbox.handle_set(
        messages,
        move |client, set: &[Claimed<'_, (String, Act)>]| {
            calls.fetch_add(1, Ordering::SeqCst);
            let ids: Vec<String> = set.iter().map(|m| m.payload.0.clone()).collect();
            let tokens: Vec<i64> = set
                .iter()
                .map(|m| i64::try_from(m.claim.token()).unwrap())
                .collect();
            let answers: Vec<(Act, Response)> = set
                .iter()
                .map(|m| {
                    let (id, act) = m.payload;
                    let body = format!("{id} {} {}", m.claim.token(), m.claim.is_takeover());
                    let ok = Response::new(200, body).with_header("x-id", id.as_str());
                    (*act, ok)
                })
                .collect();
            let sql = sql.clone();
            Box::pin(async move {
                client
                    .execute(&sql, &[&ids, &tokens])
                    .await
                    .map_err(Error::backend)?;
                let mut responses = Vec::new();
                for (act, ok) in answers {
                    match act {
                        Act::Ok => responses.push(ok),
                        Act::Fail => return Err(Error::backend("the consumer failed")),
                        Act::Panic => panic!("the consumer panicked"),
                        Act::TooLarge => responses.push(Response::new(200, vec![0u8; 2 << 20])),
                    }
                }
                Ok(responses)
            })
        },
    )
}

fn run_set(
    f: &Fixture,
    batch: &[(&str, u8, Act)],
    calls: &Arc<AtomicUsize>,
) -> Vec<Result<Delivery, Error>> {
    run_set_on(&f.inbox, &f.runs, batch, calls).unwrap()
}

fn failed(d: &Result<Delivery, Error>) -> bool {
    matches!(d, Err(e) if e.to_string().contains("consumer failed"))
}

/// One failing message among eight: the set is halved down to it in
/// savepoints of one transaction (7 handler calls, counted below); it
/// leaves no write and no record, every other message commits its run
/// once, headers included in its record, in one commit.
#[test]
fn a_failing_message_is_found_by_halving_and_leaves_nothing() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let ids: Vec<String> = (0..8).map(|i| format!("h{i}")).collect();
    let batch: Vec<(&str, u8, Act)> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), 1, if i == 5 { Act::Fail } else { Act::Ok }))
        .collect();
    let answers = run_set(&f, &batch, &calls);
    for (i, answer) in answers.iter().enumerate() {
        if i == 5 {
            assert!(failed(answer), "{answer:?}");
        } else {
            let stored = f.record(&ids[i]).unwrap();
            assert_eq!(stored.state(), idemstore::State::Done);
            assert_eq!(stored.response(), Some(handled(answer)));
            assert_eq!(handled(answer).header("x-id"), Some(ids[i].as_bytes()));
        }
    }
    // All 8 (fail, rolled back), then in one transaction, each set in a
    // savepoint: 0..4 (ok), 4..8 (fail), 4..6 (fail), 4, 5 (fails alone),
    // 6..8.
    assert_eq!(calls.load(Ordering::SeqCst), 7);
    // One commit for the seven: their records share a transaction id.
    let xids = crate::postgres::raw(&f.url)
        .query_one(
            &format!(
                "SELECT count(DISTINCT xmin::text) FROM \"{}\"",
                f._table.table
            ),
            &[],
        )
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(xids, 1, "the halves committed together");
    assert!(f.record("h5").is_none());
    let ok: Vec<(&str, i64)> = ids
        .iter()
        .filter(|id| *id != "h5")
        .map(|id| (id.as_str(), 1))
        .collect();
    assert_eq!(f.runs(), runs_of(&ok));
    // The failed one runs when redelivered.
    let again = run_set(&f, &[("h5", 1, Act::Ok)], &calls);
    handled(&again[0]);
}

/// A panicking set is halved like a failing one; a response over the
/// limits names its message at once (one more call, not a halving).
#[test]
fn a_panicking_or_oversized_message_leaves_nothing() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let answers = run_set(&f, &[("a", 1, Act::Panic), ("b", 1, Act::Ok)], &calls);
    assert!(
        matches!(&answers[0], Err(Error::HandlerPanicked { message }) if message.contains("panicked")),
        "{answers:?}"
    );
    handled(&answers[1]);
    assert_eq!(f.runs(), runs_of(&[("b", 1)]));
    assert!(f.record("a").is_none());

    calls.store(0, Ordering::SeqCst);
    let answers = run_set(&f, &[("c", 1, Act::Ok), ("d", 1, Act::TooLarge)], &calls);
    handled(&answers[0]);
    assert!(
        matches!(&answers[1], Err(Error::ResponseTooLarge { .. })),
        "{answers:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(f.runs(), runs_of(&[("b", 1), ("c", 1)]));
    assert!(f.record("d").is_none());
}

/// A handler that answers the wrong number of responses: every message's
/// answer is InvalidArgument, and nothing is written.
#[test]
fn a_wrong_number_of_responses_fails_each_message() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let messages = ["p", "q", "r"]
        .iter()
        .map(|id| (key(id), Fingerprint::of([1]), ()))
        .collect();
    let answers = f
        .inbox
        .handle_set(messages, |_client, _set: &[Claimed<'_, ()>]| {
            Box::pin(async { Ok::<_, Error>(Vec::new()) })
        })
        .unwrap();
    for answer in &answers {
        assert!(
            matches!(answer, Err(Error::InvalidArgument { .. })),
            "{answer:?}"
        );
    }
    for id in ["p", "q", "r"] {
        assert!(f.record(id).is_none());
    }
}

/// The same id more than once: the answers `handle_batch` gives for the
/// same batch (postgres_inbox_batch.rs, duplicate_ids_in_one_batch).
#[test]
fn duplicate_ids_in_one_batch() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let answers = run_set(
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
    assert!(failed(&answers[1]), "{answers:?}");
    assert_eq!(answers[2].as_ref().unwrap(), &Delivery::Duplicate(first));
    assert_eq!(answers[3].as_ref().unwrap(), &Delivery::Conflict);
    assert_eq!(answers[4].as_ref().unwrap(), &Delivery::Conflict);
    let retried = handled(&answers[5]).clone();
    assert!(retried.body().starts_with(b"x "));
    assert_eq!(answers[6].as_ref().unwrap(), &Delivery::Duplicate(retried));
    assert_eq!(f.runs(), runs_of(&[("a", 1), ("x", 1)]));
}

/// A redelivered batch: every message Duplicate of its stored response, no
/// handler call; an empty batch calls nothing either.
#[test]
fn a_redelivered_batch_runs_no_handler() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let ids: Vec<String> = (0..20).map(|i| format!("m{i:02}")).collect();
    let batch: Vec<(&str, u8, Act)> = ids.iter().map(|id| (id.as_str(), 1, Act::Ok)).collect();
    let first = run_set(&f, &batch, &calls);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one call for the set");
    let again = run_set(&f, &batch, &calls);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "no handler ran again");
    for (a, b) in first.iter().zip(&again) {
        assert_eq!(
            b.as_ref().unwrap(),
            &Delivery::Duplicate(handled(a).clone())
        );
    }
    assert!(run_set(&f, &[], &calls).is_empty());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(f.runs().len(), 20);
}

/// A live Store claim is InFlight and not in the set; an expired one is
/// taken over in it (larger token, attempt 2), and its old owner's
/// completion is stale.
#[test]
fn in_flight_and_taken_over_claims_in_a_set() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let store = f.inbox.store();
    let keep = Duration::from_secs(3600);
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
            .begin(
                &key("expired"),
                &Fingerprint::of([1]),
                old,
                Duration::from_secs(1),
                keep,
            )
            .unwrap(),
    );
    let calls = Arc::new(AtomicUsize::new(0));
    let answers = run_set(
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
    assert_eq!(calls.load(Ordering::SeqCst), 1);
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

/// Two consumers race over the same ids in opposite orders, each message
/// failing once in one of them now and then: every message is committed by
/// exactly one (one run row), the other answers Duplicate of its response
/// (or the error of its own failing run), and no batch fails (no deadlock).
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
    for round in 0..3 {
        let ids: Vec<String> = (0..60).map(|i| format!("r{i:02}-{round}")).collect();
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
                    let batch: Vec<(&str, u8, Act)> = ids
                        .iter()
                        .enumerate()
                        .map(|(i, id)| {
                            let act = if reverse && i % 17 == 3 {
                                Act::Fail
                            } else {
                                Act::Ok
                            };
                            (id.as_str(), 1, act)
                        })
                        .collect();
                    let inbox = if reverse { &*second } else { &f.inbox };
                    barrier.wait();
                    let answers = run_set_on(inbox, &f.runs, &batch, &calls).unwrap();
                    ids.into_iter()
                        .zip(answers)
                        .collect::<std::collections::HashMap<String, Result<Delivery, Error>>>()
                })
            })
            .collect();
        let answers: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for id in &ids {
            let (a, b) = (&answers[0][id], &answers[1][id]);
            let ok = matches!(
                (a, b),
                (Ok(Delivery::Handled(x)), Ok(Delivery::Duplicate(y)))
                    | (Ok(Delivery::Duplicate(y)), Ok(Delivery::Handled(x))) if x == y
            ) || (matches!(a, Ok(Delivery::Handled(_))) && failed(b));
            assert!(ok, "{id}: {a:?} / {b:?}");
        }
    }
    let runs = f.runs();
    assert_eq!(runs.len(), 180);
    assert!(runs.iter().all(|(_, n)| *n == 1), "{runs:?}");
}

/// A row that appears for a new id while the handler runs, written without
/// the id's lock (a hand-written INSERT copying another id's record): the
/// plain insert of the DONE records fails with the `COMMIT` sent beside
/// it, nothing of the pass is committed, and the pass runs again and
/// answers from that row. Through both `handle_set` and `handle_batch`.
#[test]
fn a_row_written_behind_the_locks_reruns_the_pass() {
    if !enabled() {
        return;
    }
    let f = fixture(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let first = run_set(&f, &[("origin", 1, Act::Ok)], &calls);
    let origin = handled(&first[0]).clone();
    let table = f._table.table.clone();
    let copy = move |id: &str| {
        format!(
            "INSERT INTO \"{table}\" (scope, id, fingerprint, state, lease_until, expires_at, \
             created_at, token, attempts, status, header_names, header_values, body) \
             SELECT scope, convert_to('{id}', 'UTF8'), fingerprint, state, lease_until, \
             expires_at, created_at, token, attempts, status, header_names, header_values, body \
             FROM \"{table}\" WHERE id = convert_to('origin', 'UTF8')"
        )
    };
    let url = pg_url().unwrap();
    for via_set in [true, false] {
        let (target, other) = if via_set { ("s1", "s2") } else { ("b1", "b2") };
        let (sql, url) = (copy(target), url.clone());
        let once = Arc::new(AtomicUsize::new(0));
        // The copy, once, from a connection of its own (committed at once).
        let act = move || {
            if once.fetch_add(1, Ordering::SeqCst) == 0 {
                let mut c = ::postgres::Client::connect(&url, ::postgres::NoTls).unwrap();
                c.batch_execute(&sql).unwrap();
            }
        };
        let messages = vec![
            (key(target), Fingerprint::of([1]), target.to_owned()),
            (key(other), Fingerprint::of([1]), other.to_owned()),
        ];
        let handler_calls = Arc::clone(&calls);
        let retries = f.inbox.store().stats().snapshot_retries;
        let answers = if via_set {
            f.inbox
                .handle_set(messages, move |_client, set: &[Claimed<'_, String>]| {
                    handler_calls.fetch_add(1, Ordering::SeqCst);
                    let n = set.len();
                    let act = act.clone();
                    Box::pin(async move {
                        tokio::task::spawn_blocking(act).await.unwrap();
                        Ok::<_, Error>(vec![Response::new(201, "new"); n])
                    })
                })
                .unwrap()
        } else {
            f.inbox
                .handle_batch(messages, move |_client, _claim, _id: &String| {
                    handler_calls.fetch_add(1, Ordering::SeqCst);
                    let act = act.clone();
                    Box::pin(async move {
                        tokio::task::spawn_blocking(act).await.unwrap();
                        Ok::<_, Error>(Response::new(201, "new"))
                    })
                })
                .unwrap()
        };
        assert_eq!(
            answers[0].as_ref().unwrap(),
            &Delivery::Duplicate(origin.clone()),
            "{answers:?}"
        );
        assert_eq!(
            answers[1].as_ref().unwrap(),
            &Delivery::Handled(Response::new(201, "new"))
        );
        assert_eq!(
            f.record(other).unwrap().response(),
            Some(&Response::new(201, "new"))
        );
        assert_eq!(
            f.inbox.store().stats().snapshot_retries,
            retries + 1,
            "one pass ran again"
        );
    }
}
