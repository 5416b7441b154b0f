//! An independent model of the contract (a `HashMap`, written from the
//! DESIGN.md table, not from the crate's `logic` module), and a property
//! test that drives a store and the model with the same operations.

use crate::conformance::{Make, T0};
use idemstore::{Begin, Claim, Error, Fingerprint, Key, Response, Store, Timestamp};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::collections::HashMap;
use std::time::Duration;

const LEASE: Duration = Duration::from_millis(1_000);
const RETENTION: Duration = Duration::from_millis(3_000);

#[derive(Clone, Debug)]
pub enum Op {
    Begin {
        key: u8,
        fp: u8,
    },
    /// Complete with the key's newest claim (`stale: false`) or its oldest.
    Complete {
        key: u8,
        stale: bool,
        body: u8,
    },
    Release {
        key: u8,
        stale: bool,
    },
    Get {
        key: u8,
    },
    Sweep {
        max: u8,
    },
    Advance {
        ms: u16,
    },
}

pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..4u8, 0..2u8).prop_map(|(key, fp)| Op::Begin { key, fp }),
        3 => (0..4u8, any::<bool>(), any::<u8>()).prop_map(|(key, stale, body)| Op::Complete { key, stale, body }),
        1 => (0..4u8, any::<bool>()).prop_map(|(key, stale)| Op::Release { key, stale }),
        2 => (0..4u8).prop_map(|key| Op::Get { key }),
        1 => (0..4u8).prop_map(|max| Op::Sweep { max }),
        2 => (0..2_000u16).prop_map(|ms| Op::Advance { ms }),
    ]
}

#[derive(Clone, Debug, PartialEq)]
struct ModelRecord {
    fp: u8,
    response: Option<Response>,
    lease_until: u64,
    expires_at: u64,
    token: u64,
    attempts: u32,
}

/// The model. Tokens are the store's (the model only checks they increase).
#[derive(Default)]
pub struct Model {
    records: HashMap<u8, ModelRecord>,
    now: u64,
}

#[derive(Debug, PartialEq)]
enum Answer {
    Claimed { takeover: bool, attempt: u32 },
    Replay(Response),
    InFlight(u64),
    Conflict,
}

impl Model {
    fn begin(&mut self, key: u8, fp: u8, token: Option<u64>) -> Answer {
        let now = self.now;
        let lease = LEASE.as_millis() as u64;
        match self.records.get_mut(&key) {
            Some(r) if now < r.expires_at => {
                if r.fp != fp {
                    Answer::Conflict
                } else if let Some(resp) = &r.response {
                    Answer::Replay(resp.clone())
                } else if now < r.lease_until {
                    Answer::InFlight(r.lease_until)
                } else {
                    r.lease_until = now + lease;
                    r.expires_at = r.expires_at.max(now + lease);
                    r.attempts += 1;
                    r.token = token.unwrap_or(0);
                    Answer::Claimed {
                        takeover: true,
                        attempt: r.attempts,
                    }
                }
            }
            _ => {
                self.records.insert(
                    key,
                    ModelRecord {
                        fp,
                        response: None,
                        lease_until: now + lease,
                        expires_at: now + RETENTION.as_millis() as u64,
                        token: token.unwrap_or(0),
                        attempts: 1,
                    },
                );
                Answer::Claimed {
                    takeover: false,
                    attempt: 1,
                }
            }
        }
    }

    fn owns(&self, key: u8, token: u64, check_expiry: bool) -> bool {
        self.records.get(&key).is_some_and(|r| {
            r.response.is_none() && r.token == token && (!check_expiry || self.now < r.expires_at)
        })
    }
}

fn k(key: u8) -> Key {
    Key::new("model", [b'k', key]).unwrap()
}

fn run_case(store: &dyn Store, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut model = Model {
        now: T0.as_millis(),
        ..Model::default()
    };
    let mut claims: HashMap<u8, Vec<Claim>> = HashMap::new();
    let mut last_token = 0u64;
    for (i, op) in ops.iter().enumerate() {
        let now = Timestamp::from_millis(model.now);
        match *op {
            Op::Begin { key, fp } => {
                let got = store
                    .begin(&k(key), &Fingerprint::of([fp]), now, LEASE, RETENTION)
                    .unwrap();
                let token = got.claim().map(Claim::token);
                if let Some(t) = token {
                    prop_assert!(t > last_token, "op {i}: token {t} after {last_token}");
                    last_token = t;
                }
                let want = model.begin(key, fp, token);
                let got_answer = match got {
                    Begin::Claimed(c) => {
                        let a = Answer::Claimed {
                            takeover: c.is_takeover(),
                            attempt: c.attempt(),
                        };
                        claims.entry(key).or_default().push(c);
                        a
                    }
                    Begin::Replay(r) => Answer::Replay(r),
                    Begin::InFlight { lease_until } => Answer::InFlight(lease_until.as_millis()),
                    Begin::Conflict => Answer::Conflict,
                };
                prop_assert_eq!(got_answer, want, "op {} {:?}", i, op);
            }
            Op::Complete { key, stale, body } => {
                let Some(c) = pick(&claims, key, stale) else {
                    continue;
                };
                let resp = Response::new(200, vec![body; usize::from(body % 8)]);
                let got = store.complete(&k(key), &c, &resp, now, RETENTION);
                if model.owns(key, c.token(), true) {
                    prop_assert!(got.is_ok(), "op {i} {op:?}: {got:?}");
                    let r = model.records.get_mut(&key).unwrap();
                    r.response = Some(resp);
                    r.expires_at = model.now + RETENTION.as_millis() as u64;
                } else {
                    prop_assert!(
                        matches!(got, Err(Error::StaleClaim)),
                        "op {i} {op:?}: {got:?}"
                    );
                }
            }
            Op::Release { key, stale } => {
                let Some(c) = pick(&claims, key, stale) else {
                    continue;
                };
                let got = store.release(&k(key), &c);
                if model.owns(key, c.token(), false) {
                    prop_assert!(got.is_ok(), "op {i} {op:?}: {got:?}");
                    model.records.remove(&key);
                } else {
                    prop_assert!(
                        matches!(got, Err(Error::StaleClaim)),
                        "op {i} {op:?}: {got:?}"
                    );
                }
            }
            Op::Get { key } => {
                let got = store.get(&k(key), now).unwrap();
                let want = model.records.get(&key).filter(|r| model.now < r.expires_at);
                prop_assert_eq!(got.is_some(), want.is_some(), "op {} {:?}", i, op);
                if let (Some(g), Some(w)) = (got, want) {
                    prop_assert_eq!(g.response(), w.response.as_ref());
                    prop_assert_eq!(g.expires_at().as_millis(), w.expires_at);
                    prop_assert_eq!(g.token(), w.token);
                    prop_assert_eq!(g.attempts(), w.attempts);
                    prop_assert_eq!(g.fingerprint(), &Fingerprint::of([w.fp]));
                    let lease = w.response.is_none().then_some(w.lease_until);
                    prop_assert_eq!(g.lease_until().map(Timestamp::as_millis), lease);
                }
            }
            Op::Sweep { max } => {
                let got = store.sweep_expired(now, usize::from(max)).unwrap();
                let mut due: Vec<(u64, u8)> = model
                    .records
                    .iter()
                    .filter(|(_, r)| r.expires_at <= model.now)
                    .map(|(key, r)| (r.expires_at, *key))
                    .collect();
                due.sort();
                due.truncate(usize::from(max));
                prop_assert_eq!(got, due.len(), "op {} {:?}", i, op);
                for (_, key) in due {
                    model.records.remove(&key);
                }
            }
            Op::Advance { ms } => model.now += u64::from(ms),
        }
    }
    Ok(())
}

fn pick(claims: &HashMap<u8, Vec<Claim>>, key: u8, stale: bool) -> Option<Claim> {
    let list = claims.get(&key)?;
    if stale { list.first() } else { list.last() }.cloned()
}

/// Runs `cases` random sequences of up to `len` operations, each on a fresh store.
pub fn check_against_model(make: Make<'_>, cases: u32, len: usize) {
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&proptest::collection::vec(op(), 1..len), |ops| {
            let subject = make();
            run_case(&*subject.store, &ops)
        })
        .unwrap();
}

#[test]
fn model_itself_follows_the_table() {
    let mut m = Model {
        now: 0,
        ..Model::default()
    };
    assert!(matches!(
        m.begin(1, 0, Some(1)),
        Answer::Claimed {
            takeover: false,
            attempt: 1
        }
    ));
    assert_eq!(m.begin(1, 1, None), Answer::Conflict);
    assert_eq!(m.begin(1, 0, None), Answer::InFlight(1_000));
    m.now = 1_000;
    assert!(matches!(
        m.begin(1, 0, Some(2)),
        Answer::Claimed {
            takeover: true,
            attempt: 2
        }
    ));
    m.now = 3_000;
    assert!(matches!(
        m.begin(1, 1, Some(3)),
        Answer::Claimed {
            takeover: false,
            attempt: 1
        }
    ));
}
