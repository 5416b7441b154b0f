//! `PgInbox` against a real server: the consumer's rows and the message's
//! DONE record commit together or not at all, with the redb inbox's
//! delivery outcomes. Gated like the other PostgreSQL tests.

use crate::postgres::{claimed, enabled, fresh_store, key, pg_url, raw};
use idemstore::postgres::{Delivery, PgInbox};
use idemstore::{Error, Fingerprint, Response, Store};
use std::sync::{Arc, Barrier};
use std::time::Duration;

/// An inbox on a fresh table, with a ledger table of the consumer's own
/// (dropped with the store's table: it is named after it).
fn inbox() -> (PgInbox, String, crate::postgres::DropTable, LedgerDrop) {
    let (store, drop_table) = fresh_store("inbox", 4);
    let url = pg_url().unwrap();
    let ledger = format!("{}_ledger", drop_table.table);
    raw(&url)
        .batch_execute(&format!(
            "CREATE TABLE \"{ledger}\" (id text PRIMARY KEY, amount int NOT NULL)"
        ))
        .unwrap();
    let guard = LedgerDrop {
        url,
        table: ledger.clone(),
    };
    (PgInbox::new(store), ledger, drop_table, guard)
}

struct LedgerDrop {
    url: String,
    table: String,
}

impl Drop for LedgerDrop {
    fn drop(&mut self) {
        if let Ok(mut c) = ::postgres::Client::connect(&self.url, ::postgres::NoTls) {
            let _ = c.batch_execute(&format!("DROP TABLE IF EXISTS \"{}\"", self.table));
        }
    }
}

fn rows(ledger: &str) -> i64 {
    raw(&pg_url().unwrap())
        .query_one(&format!("SELECT count(*) FROM \"{ledger}\""), &[])
        .unwrap()
        .get(0)
}

/// Credits `amount` in the ledger under the message id, in the delivery's
/// transaction.
fn credit(
    inbox: &PgInbox,
    ledger: &str,
    id: &str,
    amount: i32,
    fail: bool,
) -> Result<Delivery, Error> {
    let sql = format!("INSERT INTO \"{ledger}\" (id, amount) VALUES ($1, $2)");
    let row_id = id.to_owned();
    inbox.handle(
        &key(id),
        &Fingerprint::of(amount.to_be_bytes()),
        move |client, claim| {
            Box::pin(async move {
                client
                    .execute(&sql, &[&row_id, &amount])
                    .await
                    .map_err(Error::backend)?;
                if fail {
                    return Err(Error::backend("the consumer failed after its write"));
                }
                Ok(Response::new(
                    200,
                    format!("credited {amount}, token {}", claim.token()),
                ))
            })
        },
    )
}

#[test]
fn handled_once_then_duplicate_and_conflict() {
    if !enabled() {
        return;
    }
    let (inbox, ledger, _t, _l) = inbox();
    let first = credit(&inbox, &ledger, "m1", 10, false).unwrap();
    assert!(matches!(&first, Delivery::Handled(_)), "{first:?}");
    let again = credit(&inbox, &ledger, "m1", 10, false).unwrap();
    assert_eq!(
        again,
        Delivery::Duplicate(first.response().unwrap().clone())
    );
    assert_eq!(
        credit(&inbox, &ledger, "m1", 99, false).unwrap(),
        Delivery::Conflict
    );
    assert_eq!(rows(&ledger), 1);
    let record = inbox.store().get(&key("m1"), inbox_now()).unwrap().unwrap();
    assert_eq!(record.response(), first.response());
}

fn inbox_now() -> idemstore::Timestamp {
    idemstore::Timestamp::from_system_time(std::time::SystemTime::now())
}

/// A handler error after its write leaves neither the write nor the
/// record; the redelivery runs the handler again.
#[test]
fn a_failed_handler_leaves_nothing() {
    if !enabled() {
        return;
    }
    let (inbox, ledger, _t, _l) = inbox();
    let err = credit(&inbox, &ledger, "m1", 10, true).unwrap_err();
    assert!(err.to_string().contains("consumer failed"), "{err}");
    assert_eq!(rows(&ledger), 0);
    assert!(
        inbox
            .store()
            .get(&key("m1"), inbox_now())
            .unwrap()
            .is_none()
    );
    assert!(matches!(
        credit(&inbox, &ledger, "m1", 10, false).unwrap(),
        Delivery::Handled(_)
    ));
    assert_eq!(rows(&ledger), 1);
}

/// A panicking handler: the panic reaches the caller, and neither the
/// write nor the record is left; the inbox keeps working.
#[test]
fn a_panicking_handler_leaves_nothing() {
    if !enabled() {
        return;
    }
    let (inbox, ledger, _t, _l) = inbox();
    let sql = format!("INSERT INTO \"{ledger}\" (id, amount) VALUES ('m1', 1)");
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        inbox.handle(&key("m1"), &Fingerprint::of(b"1"), move |client, _claim| {
            Box::pin(async move {
                client.execute(&sql, &[]).await.map_err(Error::backend)?;
                panic!("the consumer panicked after its write");
                #[allow(unreachable_code, reason = "the future's output type")]
                Ok::<_, Error>(Response::new(200, ""))
            })
        })
    }));
    assert!(caught.is_err(), "the panic did not reach the caller");
    assert_eq!(rows(&ledger), 0);
    assert!(
        inbox
            .store()
            .get(&key("m1"), inbox_now())
            .unwrap()
            .is_none()
    );
    assert!(matches!(
        credit(&inbox, &ledger, "m1", 1, false).unwrap(),
        Delivery::Handled(_)
    ));
}

/// An id claimed through the Store API with a live lease: InFlight, and
/// the handler does not run.
#[test]
fn an_id_claimed_through_the_store_is_in_flight() {
    if !enabled() {
        return;
    }
    let (inbox, ledger, _t, _l) = inbox();
    let now = inbox_now();
    let _ = claimed(
        inbox
            .store()
            .begin(
                &key("m1"),
                &Fingerprint::of(10i32.to_be_bytes()),
                now,
                Duration::from_secs(60),
                Duration::from_secs(3600),
            )
            .unwrap(),
    );
    assert!(matches!(
        credit(&inbox, &ledger, "m1", 10, false).unwrap(),
        Delivery::InFlight { .. }
    ));
    assert_eq!(rows(&ledger), 0);
}

/// The same message delivered to many consumers at once: one Handled, the
/// rest Duplicate of it, one ledger row.
#[test]
fn concurrent_deliveries_handle_once() {
    if !enabled() {
        return;
    }
    const CONSUMERS: usize = 8;
    let (inbox, ledger, _t, _l) = inbox();
    let inbox = Arc::new(inbox);
    let barrier = Arc::new(Barrier::new(CONSUMERS));
    let answers: Vec<Delivery> = (0..CONSUMERS)
        .map(|_| {
            let (inbox, barrier, ledger) =
                (Arc::clone(&inbox), Arc::clone(&barrier), ledger.clone());
            std::thread::spawn(move || {
                barrier.wait();
                credit(&inbox, &ledger, "m1", 5, false).unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let handled: Vec<&Delivery> = answers
        .iter()
        .filter(|d| matches!(d, Delivery::Handled(_)))
        .collect();
    assert_eq!(handled.len(), 1, "{answers:?}");
    for d in &answers {
        assert_eq!(d.response(), handled[0].response(), "{answers:?}");
    }
    assert_eq!(rows(&ledger), 1);
}

/// The async entry, inside a tokio runtime.
#[test]
fn handle_async_inside_a_runtime() {
    if !enabled() {
        return;
    }
    let (inbox, ledger, _t, _l) = inbox();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let sql = format!("INSERT INTO \"{ledger}\" (id, amount) VALUES ('a1', 1)");
        let d: Result<Delivery, Error> = inbox
            .handle_async(
                &key("a1"),
                &Fingerprint::of(b"a1"),
                move |client, _claim| {
                    Box::pin(async move {
                        client.execute(&sql, &[]).await.map_err(Error::backend)?;
                        Ok(Response::new(201, "async"))
                    })
                },
            )
            .await;
        assert_eq!(d.unwrap(), Delivery::Handled(Response::new(201, "async")));
    });
    assert_eq!(rows(&ledger), 1);
}

/// What a batch message does in the test handler.
#[derive(Clone, Copy, Debug)]
enum Act {
    Credit(i32),
    FailAfterWrite,
    PanicAfterWrite,
}

/// Runs `batch` (ids and acts) through `handle_batch`, each new message
/// inserting its ledger row before it acts.
fn credit_batch(
    inbox: &PgInbox,
    ledger: &str,
    batch: &[(&str, Act)],
) -> Vec<Result<Delivery, Error>> {
    let sql = format!("INSERT INTO \"{ledger}\" (id, amount) VALUES ($1, $2)");
    let messages = batch
        .iter()
        .map(|(id, act)| {
            let fp = match act {
                Act::Credit(n) => Fingerprint::of(n.to_be_bytes()),
                _ => Fingerprint::of(b"bad"),
            };
            (key(id), fp, ((*id).to_owned(), *act))
        })
        .collect();
    inbox
        .handle_batch(
            messages,
            move |client, _claim, (id, act): &(String, Act)| {
                let (sql, id, act) = (sql.clone(), id.clone(), *act);
                Box::pin(async move {
                    let amount = match act {
                        Act::Credit(n) => n,
                        _ => 1,
                    };
                    client
                        .execute(&sql, &[&id, &amount])
                        .await
                        .map_err(Error::backend)?;
                    match act {
                        Act::Credit(n) => Ok(Response::new(200, format!("credited {n}"))),
                        Act::FailAfterWrite => Err(Error::backend("the consumer failed")),
                        Act::PanicAfterWrite => panic!("the consumer panicked"),
                    }
                })
            },
        )
        .unwrap()
}

/// One transaction for the batch: a failing and a panicking message in the
/// middle leave none of their writes and take none of their batch-mates'
/// with them; the same id twice is handled once; a redelivered batch is
/// all duplicates.
#[test]
fn a_batch_commits_once_and_a_failed_message_takes_nothing_with_it() {
    if !enabled() {
        return;
    }
    let (inbox, ledger, _t, _l) = inbox();
    let batch = [
        ("b1", Act::Credit(1)),
        ("b2", Act::FailAfterWrite),
        ("b3", Act::Credit(3)),
        ("b4", Act::PanicAfterWrite),
        ("b1", Act::Credit(1)),
        ("b1", Act::Credit(7)),
        ("b5", Act::Credit(5)),
    ];
    let answers = credit_batch(&inbox, &ledger, &batch);
    assert_eq!(answers.len(), batch.len());
    assert!(matches!(&answers[0], Ok(Delivery::Handled(r)) if r.body() == b"credited 1"));
    assert!(matches!(&answers[1], Err(e) if e.to_string().contains("consumer failed")));
    assert!(matches!(&answers[2], Ok(Delivery::Handled(_))));
    assert!(
        matches!(&answers[3], Err(Error::HandlerPanicked { message }) if message.contains("panicked"))
    );
    assert!(matches!(&answers[4], Ok(Delivery::Duplicate(r)) if r.body() == b"credited 1"));
    assert!(matches!(&answers[5], Ok(Delivery::Conflict)));
    assert!(matches!(&answers[6], Ok(Delivery::Handled(_))));
    assert_eq!(rows(&ledger), 3, "b1, b3, b5: nothing of b2 or b4");
    for failed in ["b2", "b4"] {
        assert!(
            inbox
                .store()
                .get(&key(failed), inbox_now())
                .unwrap()
                .is_none()
        );
    }
    // Redelivered: nothing runs again.
    let again = credit_batch(
        &inbox,
        &ledger,
        &[("b1", Act::Credit(1)), ("b3", Act::Credit(3))],
    );
    assert!(
        again
            .iter()
            .all(|a| matches!(a, Ok(Delivery::Duplicate(_)))),
        "{again:?}"
    );
    assert_eq!(rows(&ledger), 3);
    // The failed ones run when redelivered well.
    let fixed = credit_batch(
        &inbox,
        &ledger,
        &[("b2", Act::Credit(2)), ("b4", Act::Credit(4))],
    );
    assert!(
        fixed.iter().all(|a| matches!(a, Ok(Delivery::Handled(_)))),
        "{fixed:?}"
    );
    assert_eq!(rows(&ledger), 5);
    assert!(credit_batch(&inbox, &ledger, &[]).is_empty());
}

/// `PgInbox::handle_batch` throughput at batch 100 (fresh messages, one
/// ledger insert each), printed for the docs: not a timed assertion.
#[test]
fn batch_throughput_is_reported() {
    if !enabled() {
        return;
    }
    let (inbox, ledger, _t, _l) = inbox();
    let batches = 20;
    let started = std::time::Instant::now();
    for b in 0..batches {
        let ids: Vec<String> = (0..100).map(|i| format!("t{b}-{i}")).collect();
        let batch: Vec<(&str, Act)> = ids.iter().map(|id| (id.as_str(), Act::Credit(1))).collect();
        let answers = credit_batch(&inbox, &ledger, &batch);
        assert!(
            answers
                .iter()
                .all(|a| matches!(a, Ok(Delivery::Handled(_))))
        );
    }
    let per_s = f64::from(batches * 100) / started.elapsed().as_secs_f64();
    println!("PgInbox::handle_batch, batch 100: {per_s:.0} messages/s (debug build)");
    assert_eq!(rows(&ledger), i64::from(batches * 100));
}

/// A record released with its steps kept (by a `Store` caller) is claimed
/// by a delivery of the same request at once, not as a takeover, with the
/// steps; its DONE record has none. Alone (`handle`) and in a batch
/// (`handle_batch`, whose claims and DONE records are set-based).
#[test]
fn a_delivery_claims_a_released_record_with_its_steps() {
    if !enabled() {
        return;
    }
    let (store, _table) = fresh_store("inbox_steps", 4);
    let inbox = PgInbox::new(store);
    let store = Arc::clone(inbox.store());
    let fp = Fingerprint::of(b"+1");
    let now = || idemstore::Timestamp::from_system_time(std::time::SystemTime::now());
    let hour = Duration::from_secs(3600);
    let release_with_a_step = |id: &str| {
        let c = claimed(store.begin(&key(id), &fp, now(), hour, 2 * hour).unwrap());
        let s = idemstore::Step::new("charge", id.as_bytes().to_vec()).unwrap();
        store.record_step(&key(id), &c, &s, now()).unwrap();
        store.release(&key(id), &c).unwrap();
    };
    let seen = |claim: &idemstore::Claim| {
        let steps: Vec<String> = claim
            .steps()
            .iter()
            .map(|s| format!("{}={}", s.name(), String::from_utf8_lossy(s.output())))
            .collect();
        format!(
            "{} {} {}",
            claim.is_takeover(),
            claim.attempt(),
            steps.join(",")
        )
    };
    let body = |d: &Delivery| match d {
        Delivery::Handled(r) => String::from_utf8_lossy(r.body()).into_owned(),
        other => panic!("{other:?}"),
    };

    release_with_a_step("alone");
    let answer = inbox
        .handle(&key("alone"), &fp, move |_client, claim| {
            let text = seen(&claim);
            Box::pin(async move { Ok::<_, Error>(Response::new(200, text)) })
        })
        .unwrap();
    assert_eq!(body(&answer), "false 2 charge=alone");
    let done = store.get(&key("alone"), now()).unwrap().unwrap();
    assert!(done.steps().is_empty());

    release_with_a_step("b1");
    release_with_a_step("b2");
    let messages = ["b1", "b2", "b3"]
        .iter()
        .map(|id| (key(id), fp, ()))
        .collect();
    let answers = inbox
        .handle_batch(messages, move |_client, claim, _: &()| {
            let text = seen(&claim);
            Box::pin(async move { Ok::<_, Error>(Response::new(200, text)) })
        })
        .unwrap();
    let bodies: Vec<String> = answers.iter().map(|a| body(a.as_ref().unwrap())).collect();
    assert_eq!(
        bodies,
        ["false 2 charge=b1", "false 2 charge=b2", "false 1 "]
    );
    for id in ["b1", "b2", "b3"] {
        let done = store.get(&key(id), now()).unwrap().unwrap();
        assert!(done.steps().is_empty(), "{id}");
    }
}
