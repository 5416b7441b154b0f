//! `PostgresStore`'s group commit: bursts of concurrent calls, answered in
//! groups (one transaction, one statement per kind), must get exactly the
//! answers lone calls would get. Needs `IDEMSTORE_PG_URL` (see postgres.rs).

use super::postgres::{claimed, fresh_store, key, pg_url, raw};
use idemstore::{Begin, Claim, Error, Fingerprint, PostgresStore, Response, Step, Store};
use idemstore_testkit::conformance::T0;
use std::sync::{Arc, Barrier};
use std::time::Duration;

const SEC: Duration = Duration::from_secs(1);
const HOUR: Duration = Duration::from_secs(3600);

/// Runs `f(i)` on `n` threads released together, and returns the answers
/// in `i` order.
fn burst<T: Send + 'static>(n: usize, f: impl Fn(usize) -> T + Send + Sync + 'static) -> Vec<T> {
    let (f, gate) = (Arc::new(f), Arc::new(Barrier::new(n)));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (f, gate) = (Arc::clone(&f), Arc::clone(&gate));
            std::thread::spawn(move || {
                gate.wait();
                f(i)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Response `i`: `i % 4` headers (none to three), each a distinct value, so
/// a group's header slices that were off by one would be caught.
fn response(i: usize) -> Response {
    let mut r = Response::new(200 + (i % 7) as u16, format!("body {i}"));
    for h in 0..i % 4 {
        r = r.with_header(format!("x-h{h}"), format!("{i}-{h}"));
    }
    r
}

fn fp(tag: &str) -> Fingerprint {
    Fingerprint::of(tag.as_bytes())
}

#[test]
fn a_burst_gets_the_answers_lone_calls_would_get() {
    if pg_url().is_none() {
        return;
    }
    let (store, _table) = fresh_store("group", 8);
    let store = Arc::new(store);
    const DISTINCT: usize = 40;
    const HOT: usize = 16;
    // Rounds until each kind of burst has formed a group at least once (the
    // first call of a burst usually runs alone, the ones queued behind it
    // together); each round on fresh keys, so every burst is checked in
    // full. A group that failed and fell back to lone calls would still
    // answer right: `connections_lost` (a failed group drops its
    // connection) shows that none did.
    let grouped = |store: &PostgresStore| store.stats().group_commits;
    let mut seen = [false; 4];
    let mut round = 0;
    loop {
        round += 1;
        let before = grouped(&store);
        let s = Arc::clone(&store);
        let tag = format!("r{round}");
        let answers = burst(DISTINCT + HOT, move |i| {
            let (id, f) = if i < DISTINCT {
                (format!("{tag}-k{i}"), fp("a"))
            } else {
                // The hot key: half with one fingerprint, half with another.
                (format!("{tag}-hot"), fp(if i % 2 == 0 { "a" } else { "b" }))
            };
            (i, s.begin(&key(&id), &f, T0, HOUR, HOUR).unwrap())
        });
        let mut tokens = Vec::new();
        let mut hot_claims = Vec::new();
        for (i, answer) in &answers {
            if *i < DISTINCT {
                let claim = claimed(answer.clone());
                assert_eq!(claim.attempt(), 1);
                assert!(!claim.is_takeover());
                tokens.push(claim.token());
            } else if let Begin::Claimed(claim) = answer {
                hot_claims.push((*i, claim.clone()));
            }
        }
        seen[0] |= grouped(&store) > before;
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), DISTINCT, "every claim has its own token");
        assert_eq!(hot_claims.len(), 1, "one claim of the hot key: {answers:?}");
        let winner_fp = if hot_claims[0].0 % 2 == 0 { "a" } else { "b" };
        for (i, answer) in &answers[DISTINCT..] {
            let same = (if i % 2 == 0 { "a" } else { "b" }) == winner_fp;
            match answer {
                Begin::Claimed(_) => assert_eq!(*i, hot_claims[0].0),
                Begin::InFlight { .. } => assert!(same, "{i}: {answer:?}"),
                Begin::Conflict => assert!(!same, "{i}: {answer:?}"),
                Begin::Replay(_) => panic!("{i}: nothing was completed: {answer:?}"),
            }
        }

        // Completes in a burst, responses with none to three headers.
        let claims: Arc<Vec<Claim>> = Arc::new(
            answers[..DISTINCT]
                .iter()
                .map(|(_, a)| claimed(a.clone()))
                .collect(),
        );
        let (s, c, tag) = (Arc::clone(&store), Arc::clone(&claims), format!("r{round}"));
        let before = grouped(&store);
        let done = burst(DISTINCT, move |i| {
            s.complete(&key(&format!("{tag}-k{i}")), &c[i], &response(i), T0, HOUR)
        });
        assert!(done.iter().all(Result::is_ok), "{done:?}");
        seen[1] |= grouped(&store) > before;

        // Completing again with the same claims: stale, every one.
        let (s, c, tag) = (Arc::clone(&store), Arc::clone(&claims), format!("r{round}"));
        let before = grouped(&store);
        let again = burst(DISTINCT, move |i| {
            s.complete(&key(&format!("{tag}-k{i}")), &c[i], &response(i), T0, HOUR)
        });
        assert!(
            again.iter().all(|r| matches!(r, Err(Error::StaleClaim))),
            "{again:?}"
        );
        seen[2] |= grouped(&store) > before;

        // A burst of retries: each replays its own response, headers and all.
        let (s, tag) = (Arc::clone(&store), format!("r{round}"));
        let before = grouped(&store);
        let replays = burst(DISTINCT, move |i| {
            s.begin(&key(&format!("{tag}-k{i}")), &fp("a"), T0 + SEC, HOUR, HOUR)
                .unwrap()
        });
        for (i, answer) in replays.iter().enumerate() {
            assert!(
                matches!(answer, Begin::Replay(r) if *r == response(i)),
                "{i}: {answer:?}"
            );
        }
        seen[3] |= grouped(&store) > before;
        if seen.iter().all(|s| *s) || round == 20 {
            break;
        }
    }
    let stats = store.stats();
    assert_eq!(
        seen, [true; 4],
        "a kind of burst never formed a group: {stats:?}"
    );
    assert!(stats.grouped_calls >= 2 * stats.group_commits, "{stats:?}");
    assert_eq!(stats.connections_lost, 0, "a group failed: {stats:?}");
}

#[test]
fn a_burst_takes_over_run_out_leases_and_renews_expired_records() {
    if pg_url().is_none() {
        return;
    }
    let (store, _table) = fresh_store("group_takeover", 8);
    let store = Arc::new(store);
    const N: usize = 32;
    // Claims with a one-second lease and a one-minute retention.
    let first: Vec<Claim> = (0..N)
        .map(|i| {
            claimed(
                store
                    .begin(&key(&format!("k{i}")), &fp("a"), T0, SEC, 60 * SEC)
                    .unwrap(),
            )
        })
        .collect();
    let first = Arc::new(first);
    // Two seconds on, the leases have run out: the same request takes over
    // (new token, attempt 2); another fingerprint is a conflict.
    let s = Arc::clone(&store);
    let answers = burst(N, move |i| {
        let f = fp(if i % 4 == 3 { "b" } else { "a" });
        s.begin(&key(&format!("k{i}")), &f, T0 + 2 * SEC, SEC, 60 * SEC)
            .unwrap()
    });
    for (i, answer) in answers.iter().enumerate() {
        if i % 4 == 3 {
            assert!(matches!(answer, Begin::Conflict), "{i}: {answer:?}");
            continue;
        }
        let claim = claimed(answer.clone());
        assert!(claim.is_takeover(), "{i}: {claim:?}");
        assert_eq!(claim.attempt(), 2);
        assert!(claim.token() > first[i].token());
    }
    // The first owners' completes are now stale (except where nobody took over).
    let (s, f) = (Arc::clone(&store), Arc::clone(&first));
    let late = burst(N, move |i| {
        s.complete(
            &key(&format!("k{i}")),
            &f[i],
            &response(i),
            T0 + 2 * SEC,
            HOUR,
        )
    });
    for (i, r) in late.iter().enumerate() {
        if i % 4 == 3 {
            assert!(r.is_ok(), "{i}: {r:?}");
        } else {
            assert!(matches!(r, Err(Error::StaleClaim)), "{i}: {r:?}");
        }
    }
    // Past every expiry, a begin starts afresh: attempt 1 again.
    let s = Arc::clone(&store);
    let fresh = burst(N, move |i| {
        s.begin(&key(&format!("k{i}")), &fp("c"), T0 + 2 * HOUR, SEC, HOUR)
            .unwrap()
    });
    for (i, answer) in fresh.iter().enumerate() {
        let claim = claimed(answer.clone());
        assert_eq!(claim.attempt(), 1, "{i}: {claim:?}");
        assert!(!claim.is_takeover());
    }
}

/// Bursts of begins on records released with their steps kept, beside
/// run-out leases and other fingerprints: a group never claims a released
/// record (its job runs again alone), and every answer is a lone call's:
/// the released keys claimed at once, not as takeovers, with their steps;
/// the run-out ones taken over with theirs; the other fingerprints
/// conflicts. Rounds on fresh keys until a burst formed a group.
#[test]
fn a_burst_claims_released_records_without_a_takeover() {
    if pg_url().is_none() {
        return;
    }
    let (store, _table) = fresh_store("group_released", 8);
    let store = Arc::new(store);
    const N: usize = 32;
    let grouped = |store: &PostgresStore| store.stats().group_commits;
    for round in 0..20 {
        let k = move |i: usize| key(&format!("r{round}-{i}"));
        let step = |i: usize| Step::new("charge", vec![i as u8]).unwrap();
        let first: Vec<Claim> = (0..N)
            .map(|i| {
                let c = claimed(store.begin(&k(i), &fp("a"), T0, SEC, HOUR).unwrap());
                store.record_step(&k(i), &c, &step(i), T0).unwrap();
                // Every other key released (steps kept), the rest left to run out.
                if i % 2 == 0 {
                    store.release(&k(i), &c).unwrap();
                }
                c
            })
            .collect();
        let before = grouped(&store);
        let s = Arc::clone(&store);
        let answers = burst(N, move |i| {
            let f = fp(if i % 4 == 3 { "b" } else { "a" });
            s.begin(&k(i), &f, T0 + 2 * SEC, SEC, HOUR).unwrap()
        });
        for (i, answer) in answers.iter().enumerate() {
            if i % 4 == 3 {
                assert!(matches!(answer, Begin::Conflict), "{i}: {answer:?}");
                continue;
            }
            let claim = claimed(answer.clone());
            assert_eq!(claim.is_takeover(), i % 2 == 1, "{i}: {claim:?}");
            assert_eq!(claim.attempt(), 2);
            assert!(claim.token() > first[i].token());
            assert_eq!(claim.steps(), [step(i)]);
        }
        if grouped(&store) > before {
            return;
        }
    }
    panic!("no burst formed a group in 20 rounds");
}

/// A group whose statement fails (here: a statement timeout on a row
/// another transaction holds) commits nothing and runs each of its calls
/// again alone: the others succeed, the blocked one reports the timeout.
#[test]
fn a_failed_group_falls_back_to_lone_calls() {
    let Some(url) = pg_url() else { return };
    let (_, table) = fresh_store("group_fail", 1);
    let store = Arc::new(
        PostgresStore::builder()
            .table(&table.table)
            .max_size(16)
            .connect_timeout(Duration::from_secs(30))
            .statement_timeout(Duration::from_millis(1500))
            .connect(&url)
            .unwrap(),
    );
    const N: usize = 24;
    let claims: Vec<Claim> = (0..N)
        .map(|i| {
            claimed(
                store
                    .begin(&key(&format!("k{i}")), &fp("a"), T0, HOUR, HOUR)
                    .unwrap(),
            )
        })
        .collect();
    let claims = Arc::new(claims);
    let mut other = raw(&url);
    let mut tx = other.transaction().unwrap();
    let locked = key("k7");
    tx.execute(
        &format!(
            "SELECT 1 FROM \"{}\" WHERE scope = $1 AND id = $2 FOR UPDATE",
            table.table
        ),
        &[&locked.scope(), &locked.id()],
    )
    .unwrap();
    let (s, c) = (Arc::clone(&store), Arc::clone(&claims));
    let done = burst(N, move |i| {
        s.complete(&key(&format!("k{i}")), &c[i], &response(i), T0, HOUR)
    });
    tx.rollback().unwrap();
    for (i, r) in done.iter().enumerate() {
        if i == 7 {
            let err = r.as_ref().unwrap_err();
            assert!(matches!(err, Error::Backend(_)), "{err}");
            assert!(err.to_string().contains("statement timeout"), "{err}");
        } else {
            assert!(r.is_ok(), "{i}: {r:?}");
            let record = store.get(&key(&format!("k{i}")), T0).unwrap().unwrap();
            assert_eq!(record.response(), Some(&response(i)));
        }
    }
    // The blocked call's claim is still its own, and completes now.
    store
        .complete(&locked, &claims[7], &response(7), T0, HOUR)
        .unwrap();
}
