//! `Inbox::handle_batch`: a batch is one durable commit; duplicates inside
//! a batch and across batches are handled once; a conflict or an in-flight
//! id writes nothing; a handler that fails or panics in the middle of a
//! batch leaves none of its writes and takes none of its batch-mates'; and
//! a property test against a model of one-at-a-time handling.

use crate::inbox::{
    Msg, apply, business, clocked_inbox, expected_balances, flaky_inbox, limited_inbox, message,
    msg_fp, msg_key,
};
use idemstore::limits::MAX_INBOX_BATCH;
use idemstore::redb::engine::WriteTransaction;
use idemstore::redb::{Delivery, Inbox, Message};
use idemstore::{Begin, BoxError, Claim, Error, RedbStore, Response, Store};
use idemstore_testkit::conformance::T0;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

fn fresh() -> (Inbox, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::new(RedbStore::open(dir.path().join("b.idem")).unwrap());
    (inbox, dir)
}

fn deliveries(ids: &[u32]) -> Vec<Message<Msg>> {
    ids.iter()
        .map(|&id| {
            let m = message(id);
            Message::new(msg_key(id), msg_fp(&m), m)
        })
        .collect()
}

/// The plain handler: the business write of `apply`.
fn plain(txn: &WriteTransaction, claim: &Claim, m: &Message<Msg>) -> Result<Response, BoxError> {
    apply(txn, &m.payload, claim.token())
}

fn durable_commits(inbox: &Inbox) -> u64 {
    inbox.store().stats().durable_commits
}

#[test]
fn a_batch_of_new_messages_is_handled_in_one_commit() {
    let (inbox, _dir) = fresh();
    let ids: Vec<u32> = (0..50).collect();
    let before = durable_commits(&inbox);
    let mut tokens = Vec::new();
    let answers = inbox
        .handle_batch(&deliveries(&ids), |txn, claim, m| {
            tokens.push(claim.token());
            plain(txn, claim, m)
        })
        .unwrap();
    assert_eq!(answers.len(), ids.len());
    for answer in &answers {
        assert!(matches!(answer, Ok(Delivery::Handled(_))), "{answer:?}");
    }
    assert_eq!(durable_commits(&inbox) - before, 1, "one commit per batch");
    // Tokens increase in batch order.
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
    let state = business(&inbox);
    assert_eq!(state.balances, expected_balances(50));
    assert_eq!(state.handler_commits, 50);
}

#[test]
fn an_empty_batch_commits_nothing_and_an_oversized_one_is_refused() {
    let (inbox, _dir) = fresh();
    let before = inbox.store().stats();
    let answers = inbox.handle_batch(&deliveries(&[]), plain).unwrap();
    assert!(answers.is_empty());
    assert_eq!(inbox.store().stats(), before);
    let ids: Vec<u32> = (0..=MAX_INBOX_BATCH as u32).collect();
    let err = inbox.handle_batch(&deliveries(&ids), plain).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert_eq!(business(&inbox).handler_commits, 0);
}

#[test]
fn duplicates_inside_a_batch_and_across_batches_are_handled_once() {
    let (inbox, _dir) = fresh();
    let mut runs = 0;
    let answers = inbox
        .handle_batch(&deliveries(&[1, 2, 1, 1]), |txn, claim, m| {
            runs += 1;
            plain(txn, claim, m)
        })
        .unwrap();
    assert_eq!(runs, 2);
    let first = match &answers[0] {
        Ok(Delivery::Handled(r)) => r.clone(),
        other => panic!("{other:?}"),
    };
    assert!(matches!(&answers[1], Ok(Delivery::Handled(_))));
    // The redeliveries of 1 in the same batch get 1's result.
    assert!(matches!(&answers[2], Ok(Delivery::Duplicate(r)) if *r == first));
    assert!(matches!(&answers[3], Ok(Delivery::Duplicate(r)) if *r == first));
    // The next batch: 1 and 2 are redeliveries, 3 is new.
    let answers = inbox.handle_batch(&deliveries(&[2, 3, 1]), plain).unwrap();
    assert!(matches!(&answers[0], Ok(Delivery::Duplicate(_))));
    assert!(matches!(&answers[1], Ok(Delivery::Handled(_))));
    assert!(matches!(&answers[2], Ok(Delivery::Duplicate(r)) if *r == first));
    let state = business(&inbox);
    assert_eq!(state.handler_commits, 3);
    assert_eq!(state.applied.keys().copied().collect::<Vec<_>>(), [1, 2, 3]);
}

#[test]
fn a_batch_of_redeliveries_only_writes_nothing() {
    let (inbox, _dir) = fresh();
    inbox.handle_batch(&deliveries(&[1, 2, 3]), plain).unwrap();
    let before = inbox.store().stats();
    let answers = inbox
        .handle_batch(&deliveries(&[3, 1, 2]), |_, _, _| -> Result<_, BoxError> {
            panic!("a redelivery must not run the handler")
        })
        .unwrap();
    for answer in &answers {
        assert!(matches!(answer, Ok(Delivery::Duplicate(_))), "{answer:?}");
    }
    assert_eq!(inbox.store().stats(), before, "no commit");
}

#[test]
fn a_reused_id_with_another_payload_in_a_batch_is_a_conflict() {
    let (inbox, _dir) = fresh();
    let m = message(1);
    let other = Msg { amount: 999, ..m };
    let batch = vec![
        Message::new(msg_key(1), msg_fp(&m), m),
        Message::new(msg_key(1), msg_fp(&other), other),
    ];
    let answers = inbox.handle_batch(&batch, plain).unwrap();
    assert!(matches!(&answers[0], Ok(Delivery::Handled(_))));
    assert!(matches!(&answers[1], Ok(Delivery::Conflict)));
    // And in a later batch, on the fast path and beside a new message.
    let answers = inbox.handle_batch(&batch[1..], plain).unwrap();
    assert!(matches!(&answers[0], Ok(Delivery::Conflict)));
    let mut mixed = deliveries(&[2]);
    mixed.push(batch[1].clone());
    let answers = inbox.handle_batch(&mixed, plain).unwrap();
    assert!(matches!(&answers[0], Ok(Delivery::Handled(_))));
    assert!(matches!(&answers[1], Ok(Delivery::Conflict)));
    let state = business(&inbox);
    assert_eq!(state.balances.get(&m.account), Some(&m.amount));
    assert_eq!(state.handler_commits, 2);
}

/// What a faulty handler does after writing its rows.
#[derive(Clone, Copy)]
enum Fail {
    Error,
    Panic,
    Oversized,
}

/// A batch of ids 0..10 where the handlers of `bad` write their rows, then
/// fail as `how`; returns the answers and how many times each id's handler ran.
fn batch_with_failures(
    inbox: &Inbox,
    bad: &[u32],
    how: Fail,
) -> (Vec<Result<Delivery, BoxError>>, BTreeMap<u32, u32>) {
    let mut runs = BTreeMap::new();
    let answers = inbox
        .handle_batch(
            &deliveries(&(0..10).collect::<Vec<_>>()),
            |txn, claim, m| {
                *runs.entry(m.payload.id).or_insert(0) += 1;
                let response = plain(txn, claim, m)?;
                if !bad.contains(&m.payload.id) {
                    return Ok(response);
                }
                match how {
                    Fail::Error => Err("injected handler error".into()),
                    Fail::Panic => {
                        panic!("injected panic in {} (expected in this test)", m.payload.id)
                    }
                    Fail::Oversized => Ok(Response::new(200, vec![b'x'; 100])),
                }
            },
        )
        .unwrap();
    (answers, runs)
}

/// Every id but `bad` applied once, in one commit; `bad` left no trace.
fn only_the_failed_are_missing(inbox: &Inbox, bad: &[u32]) {
    let state = business(inbox);
    let good: Vec<u32> = (0..10).filter(|id| !bad.contains(id)).collect();
    assert_eq!(state.applied.keys().copied().collect::<Vec<_>>(), good);
    assert_eq!(state.handler_commits, good.len() as u64);
    let mut balances = BTreeMap::new();
    for id in &good {
        let m = message(*id);
        *balances.entry(m.account).or_insert(0) += m.amount;
    }
    assert_eq!(state.balances, balances);
    for id in bad {
        assert!(inbox.store().get(&msg_key(*id), T0).unwrap().is_none());
    }
    assert!(!inbox.store().is_poisoned());
}

#[test]
fn a_failing_handler_in_the_middle_takes_nothing_with_it() {
    let (inbox, _dir) = fresh();
    let before = durable_commits(&inbox);
    let (answers, runs) = batch_with_failures(&inbox, &[4], Fail::Error);
    for (id, answer) in answers.iter().enumerate() {
        if id == 4 {
            let err = answer.as_ref().unwrap_err();
            assert_eq!(err.to_string(), "injected handler error");
        } else {
            assert!(
                matches!(answer, Ok(Delivery::Handled(_))),
                "{id}: {answer:?}"
            );
        }
    }
    // Two passes: the aborted one (0..=4) and the re-run without 4.
    assert_eq!(runs[&0], 2);
    assert_eq!(runs[&4], 1);
    assert_eq!(runs[&9], 1);
    assert_eq!(durable_commits(&inbox) - before, 1);
    only_the_failed_are_missing(&inbox, &[4]);
    // The redelivery of 4 alone is handled.
    let answers = inbox.handle_batch(&deliveries(&[4]), plain).unwrap();
    assert!(matches!(&answers[0], Ok(Delivery::Handled(_))));
}

#[test]
fn a_panicking_handler_in_the_middle_takes_nothing_with_it() {
    let (inbox, _dir) = fresh();
    let (answers, _) = batch_with_failures(&inbox, &[0, 6], Fail::Panic);
    for (id, answer) in answers.iter().enumerate() {
        if id == 0 || id == 6 {
            let err = answer.as_ref().unwrap_err();
            assert!(
                matches!(err.downcast_ref::<Error>(), Some(Error::HandlerPanicked { message })
                    if message == &format!("injected panic in {id} (expected in this test)")),
                "{err}"
            );
        } else {
            assert!(
                matches!(answer, Ok(Delivery::Handled(_))),
                "{id}: {answer:?}"
            );
        }
    }
    only_the_failed_are_missing(&inbox, &[0, 6]);
    // Not poisoned: the next batch commits.
    let answers = inbox.handle_batch(&deliveries(&[0, 6]), plain).unwrap();
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, Ok(Delivery::Handled(_))))
    );
}

#[test]
fn an_oversized_result_fails_its_message_alone() {
    let (inbox, _dir) = limited_inbox(64);
    let (answers, _) = batch_with_failures(&inbox, &[9], Fail::Oversized);
    let err = answers[9].as_ref().unwrap_err();
    assert!(
        matches!(
            err.downcast_ref::<Error>(),
            Some(Error::ResponseTooLarge { .. })
        ),
        "{err}"
    );
    only_the_failed_are_missing(&inbox, &[9]);
}

#[test]
fn every_handler_failing_is_n_plus_one_passes_and_no_commit_of_rows() {
    let (inbox, _dir) = fresh();
    let all: Vec<u32> = (0..10).collect();
    let (answers, runs) = batch_with_failures(&inbox, &all, Fail::Error);
    assert!(answers.iter().all(Result::is_err));
    // Pass k runs only message k (its predecessors are set aside): one run each.
    assert!(runs.values().all(|&n| n == 1), "{runs:?}");
    only_the_failed_are_missing(&inbox, &all);
}

#[test]
fn tokens_of_an_aborted_pass_are_never_handed_out_again() {
    // A handler that passed its token downstream in a pass that was then
    // aborted must not see another message get the same token.
    let (inbox, _dir) = fresh();
    let mut seen: BTreeMap<u64, u32> = BTreeMap::new();
    let answers = inbox
        .handle_batch(&deliveries(&[0, 1, 2, 3]), |txn, claim, m| {
            if let Some(other) = seen.insert(claim.token(), m.payload.id) {
                assert_eq!(other, m.payload.id, "token {} reused", claim.token());
            }
            let response = plain(txn, claim, m)?;
            if m.payload.id == 2 {
                return Err::<Response, BoxError>("no".into());
            }
            Ok(response)
        })
        .unwrap();
    assert!(answers[2].is_err());
    let state = business(&inbox);
    let tokens: BTreeSet<u64> = state.applied.values().copied().collect();
    assert_eq!(tokens.len(), 3);
    // Every committed token is larger than every token of the aborted pass.
    assert!(state.applied[&0] > 3, "{:?}", state.applied);
}

#[test]
fn a_message_claimed_through_the_store_api_is_in_flight_in_a_batch() {
    let (inbox, clock, _dir) = clocked_inbox();
    let lease = Duration::from_secs(30);
    let m = message(2);
    let Begin::Claimed(_) = inbox
        .store()
        .begin(&msg_key(2), &msg_fp(&m), T0, lease, lease * 10)
        .unwrap()
    else {
        panic!("expected a claim");
    };
    let answers = inbox.handle_batch(&deliveries(&[1, 2, 3]), plain).unwrap();
    assert!(matches!(&answers[0], Ok(Delivery::Handled(_))));
    assert!(
        matches!(&answers[1], Ok(Delivery::InFlight { lease_until }) if *lease_until == T0 + lease)
    );
    assert!(matches!(&answers[2], Ok(Delivery::Handled(_))));
    clock.advance(lease);
    let answers = inbox.handle_batch(&deliveries(&[2]), plain).unwrap();
    assert!(matches!(&answers[0], Ok(Delivery::Handled(_))));
}

#[test]
fn a_poisoned_store_refuses_a_batch_and_runs_no_handler() {
    let (inbox, fail) = flaky_inbox();
    fail.store(true, std::sync::atomic::Ordering::SeqCst);
    let err = inbox.handle_batch(&deliveries(&[1, 2]), plain).unwrap_err();
    assert!(
        !matches!(err, Error::Poisoned { .. }),
        "the cause first: {err}"
    );
    assert!(inbox.store().is_poisoned());
    let err = inbox
        .handle_batch(&deliveries(&[3]), |_, _, _| -> Result<_, BoxError> {
            panic!("must not run")
        })
        .unwrap_err();
    assert!(matches!(err, Error::Poisoned { .. }), "{err}");
}

/// The model: messages handled one at a time, in batch order, by
/// `handle`'s rules; a failing message changes nothing.
#[derive(Default)]
struct Model {
    /// id -> (fingerprint amount, stored response)
    done: BTreeMap<u32, (u64, String)>,
    balances: BTreeMap<u8, u64>,
}

#[test]
fn batches_match_one_at_a_time_handling() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestCaseError, TestRunner};

    // A delivery: (id, payload variant, the handler fails).
    let delivery = (0u32..12, 0u64..2, prop::bool::weighted(0.15));
    let batches = prop::collection::vec(prop::collection::vec(delivery, 0..8), 1..6);
    let mut runner = TestRunner::new(Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&batches, |batches| {
            let inbox = Inbox::new(
                RedbStore::builder()
                    .open_backend(
                        idemstore::redb::engine::backends::InMemoryBackend::new(),
                        idemstore::redb::engine::backends::InMemoryBackend::new(),
                    )
                    .unwrap(),
            );
            let mut model = Model::default();
            for batch in batches {
                let messages: Vec<Message<(Msg, bool)>> = batch
                    .iter()
                    .map(|&(id, variant, fails)| {
                        let m = Msg {
                            amount: message(id).amount + variant,
                            ..message(id)
                        };
                        Message::new(msg_key(id), msg_fp(&m), (m, fails))
                    })
                    .collect();
                let answers = inbox
                    .handle_batch(&messages, |txn, claim, msg| {
                        let (m, fails) = &msg.payload;
                        let response = apply(txn, m, claim.token())?;
                        if *fails {
                            return Err::<Response, BoxError>("injected".into());
                        }
                        Ok(response)
                    })
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                for (msg, answer) in messages.iter().zip(&answers) {
                    let (m, fails) = &msg.payload;
                    let expected = match model.done.get(&m.id) {
                        Some((amount, r)) if *amount == m.amount => format!("dup {r}"),
                        Some(_) => "conflict".to_owned(),
                        None if *fails => "error".to_owned(),
                        None => {
                            let balance = model.balances.entry(m.account).or_insert(0);
                            *balance += m.amount;
                            let r = format!("account {} now {}", m.account, balance);
                            model.done.insert(m.id, (m.amount, r.clone()));
                            format!("handled {r}")
                        }
                    };
                    let got = match answer {
                        Ok(Delivery::Handled(r)) => {
                            format!("handled {}", String::from_utf8_lossy(r.body()))
                        }
                        Ok(Delivery::Duplicate(r)) => {
                            format!("dup {}", String::from_utf8_lossy(r.body()))
                        }
                        Ok(Delivery::Conflict) => "conflict".to_owned(),
                        Ok(other) => format!("{other:?}"),
                        Err(_) => "error".to_owned(),
                    };
                    prop_assert_eq!(got, expected, "message {}", m.id);
                }
            }
            prop_assert_eq!(business(&inbox).balances, model.balances);
            Ok(())
        })
        .unwrap();
}
