//! The reference model of the contract, and the checker that runs an
//! operation sequence on a store and on the model side by side.
//!
//! The model is written independently of `idemstore::logic` (a table of the
//! five `begin` cases, kept by hand), so a bug in the shared state machine
//! shows up as a divergence rather than agreeing with itself. The fuzz
//! targets under idemstore's `fuzz/`, the corpus replay under `cargo test`
//! and the property tests ([`check_against_model`], with proptest) all call
//! [`run_ops`].

use crate::conformance::Make;
use crate::{FaultyStore, Op as StoreOp};
use idemstore::{Begin, Claim, Error, Fingerprint, Key, Response, Store, Timestamp};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Turns fuzzer bytes into an operation sequence, the same way in the fuzz
/// target and in the corpus replay under `cargo test`.
pub fn decode_ops(data: &[u8]) -> Vec<Op> {
    use arbitrary::Arbitrary;
    Vec::<Op>::arbitrary_take_rest(arbitrary::Unstructured::new(data)).unwrap_or_default()
}

/// Lease used by [`run_ops`].
pub const LEASE: Duration = Duration::from_millis(1_000);
/// Retention used by [`run_ops`].
pub const RETENTION: Duration = Duration::from_millis(3_000);
/// Start time of [`run_ops`]: 2026-10-19T04:00:00Z.
pub const T0: u64 = 1_760_846_400_000;

/// One step of a store workload. Small integer fields select among a few
/// keys, fingerprints and batch sizes so that sequences collide often.
#[derive(Clone, Debug, arbitrary::Arbitrary)]
pub enum Op {
    /// `begin` on key `key % 4` with fingerprint `fp % 2`.
    Begin {
        /// Key selector.
        key: u8,
        /// Fingerprint selector.
        fp: u8,
    },
    /// `complete` with the key's newest claim, or its oldest when `stale`.
    Complete {
        /// Key selector.
        key: u8,
        /// Use the oldest claim seen for the key.
        stale: bool,
        /// Body byte (the body is `body % 8` copies of it).
        body: u8,
    },
    /// `release` with the newest or oldest claim.
    Release {
        /// Key selector.
        key: u8,
        /// Use the oldest claim seen for the key.
        stale: bool,
    },
    /// `renew` the newest or oldest claim by [`LEASE`].
    Renew {
        /// Key selector.
        key: u8,
        /// Use the oldest claim seen for the key.
        stale: bool,
    },
    /// `get`.
    Get {
        /// Key selector.
        key: u8,
    },
    /// `sweep_expired(now, max % 8)`.
    Sweep {
        /// Batch size selector.
        max: u8,
    },
    /// Move the clock forward.
    Advance {
        /// Milliseconds (`ms % 2000`).
        ms: u16,
    },
    /// Make the next call of one operation fail with an injected error.
    Fault {
        /// Operation selector.
        op: u8,
    },
    /// Close and reopen the store (durable backends only).
    Reopen,
    /// `record_step` with the key's newest claim, or its oldest when
    /// `stale`: the step `s{name % 3}` with the output `[output % 2]`, so
    /// names and outputs collide often. (Last, so that the corpus written
    /// before steps decodes to the operations it always meant.)
    Step {
        /// Key selector.
        key: u8,
        /// Use the oldest claim seen for the key.
        stale: bool,
        /// Step name selector.
        name: u8,
        /// Output selector.
        output: u8,
    },
}

#[derive(Clone, Debug, PartialEq)]
struct ModelRecord {
    fp: u8,
    response: Option<Response>,
    lease_until: u64,
    expires_at: u64,
    token: u64,
    attempts: u32,
    /// Recorded steps, in order: (name, output).
    steps: Steps,
    /// Released with steps kept: PROCESSING, lease over (the store shows
    /// `lease_until == 0`), owned by nobody until the next claim.
    released: bool,
}

/// A model step list: (name, output) in the order recorded.
type Steps = Vec<(String, Vec<u8>)>;

/// What `begin` answered, in the model's terms.
#[derive(Debug, PartialEq)]
enum Answer {
    Claimed {
        takeover: bool,
        attempt: u32,
        steps: Steps,
    },
    Replay(Response),
    InFlight(u64),
    Conflict,
}

/// An independent model of the contract's table (not built on `idemstore::logic`).
#[derive(Default)]
struct Model {
    records: HashMap<u8, ModelRecord>,
    now: u64,
}

impl Model {
    fn begin(&mut self, key: u8, fp: u8, token: u64) -> Answer {
        let (now, lease) = (self.now, ms(LEASE));
        match self.records.get_mut(&key) {
            Some(r) if now < r.expires_at => {
                if r.fp != fp {
                    Answer::Conflict
                } else if let Some(resp) = &r.response {
                    Answer::Replay(resp.clone())
                } else if !r.released && now < r.lease_until {
                    Answer::InFlight(r.lease_until)
                } else {
                    // A lease that ran out is a takeover; a release that
                    // kept steps hands the key on at once, not as one.
                    let takeover = !r.released;
                    r.released = false;
                    r.lease_until = now + lease;
                    r.expires_at = r.expires_at.max(now + lease);
                    r.attempts += 1;
                    r.token = token;
                    Answer::Claimed {
                        takeover,
                        attempt: r.attempts,
                        steps: r.steps.clone(),
                    }
                }
            }
            _ => {
                let record = ModelRecord {
                    fp,
                    response: None,
                    lease_until: now + lease,
                    expires_at: now + ms(RETENTION),
                    token,
                    attempts: 1,
                    steps: Vec::new(),
                    released: false,
                };
                self.records.insert(key, record);
                Answer::Claimed {
                    takeover: false,
                    attempt: 1,
                    steps: Vec::new(),
                }
            }
        }
    }

    /// The lease end after `token`'s renewal, or `None` when it does not
    /// own the key (the model of `logic::renew`, written apart from it).
    fn renew(&mut self, key: u8, token: u64) -> Option<u64> {
        if !self.owns(key, token, true) {
            return None;
        }
        let until = self.now + ms(LEASE);
        let r = self.records.get_mut(&key)?;
        r.lease_until = r.lease_until.max(until);
        r.expires_at = r.expires_at.max(r.lease_until);
        Some(r.lease_until)
    }

    fn owns(&self, key: u8, token: u64, check_expiry: bool) -> bool {
        self.records.get(&key).is_some_and(|r| {
            r.response.is_none()
                && !r.released
                && r.token == token
                && (!check_expiry || self.now < r.expires_at)
        })
    }

    /// `release` by `token`: `false` when it does not own the key. Without
    /// steps the record goes; with steps it stays, released.
    fn release(&mut self, key: u8, token: u64) -> bool {
        if !self.owns(key, token, false) {
            return false;
        }
        if self.records.get(&key).is_some_and(|r| r.steps.is_empty()) {
            self.records.remove(&key);
        } else if let Some(r) = self.records.get_mut(&key) {
            r.released = true;
            r.lease_until = 0;
        }
        true
    }

    /// `record_step` by `token` (the model of `logic::record_step`,
    /// written apart from it).
    fn record_step(&mut self, key: u8, token: u64, name: &str, output: &[u8]) -> StepAnswer {
        if !self.owns(key, token, true) {
            return StepAnswer::Stale;
        }
        let Some(r) = self.records.get_mut(&key) else {
            return StepAnswer::Stale;
        };
        match r.steps.iter().find(|(n, _)| n == name) {
            Some((_, o)) if o == output => StepAnswer::Recorded,
            Some(_) => StepAnswer::OtherOutput,
            None => {
                let bytes: usize = r.steps.iter().map(|(n, o)| n.len() + o.len()).sum();
                if r.steps.len() >= idemstore::limits::MAX_STEPS
                    || bytes + name.len() + output.len() > idemstore::limits::MAX_STEPS_BYTES
                {
                    return StepAnswer::Limit;
                }
                r.steps.push((name.to_owned(), output.to_vec()));
                StepAnswer::Recorded
            }
        }
    }
}

/// What `record_step` answered, in the model's terms.
#[derive(Debug, PartialEq)]
enum StepAnswer {
    /// `Ok` (recorded now, or the same step was there already).
    Recorded,
    /// `StaleClaim`.
    Stale,
    /// `InvalidArgument`: the name is recorded with another output.
    OtherOutput,
    /// `StepLimit`.
    Limit,
}

fn steps_of(steps: &[idemstore::Step]) -> Steps {
    steps
        .iter()
        .map(|s| (s.name().to_owned(), s.output().to_vec()))
        .collect()
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn key(k: u8) -> Key {
    // Two bytes, never empty: always a valid key.
    Key::new("model", [b'k', k % 4]).unwrap_or_else(|_| unreachable!())
}

fn fault_op(op: u8) -> StoreOp {
    match op % 7 {
        0 => StoreOp::Begin,
        1 => StoreOp::Complete,
        2 => StoreOp::Release,
        3 => StoreOp::Get,
        4 => StoreOp::Renew,
        5 => StoreOp::Sweep,
        _ => StoreOp::Step,
    }
}

/// Applies `ops` to a store made by `open` and to the model, and returns a
/// description of the first divergence. `open` is called once at the start
/// and again for each [`Op::Reopen`] when `durable` (after the previous
/// store was dropped); for a non-durable store `Reopen` is skipped.
/// Injected faults must fail the call with no effect.
pub fn run_ops(
    open: &mut dyn FnMut() -> Arc<dyn Store>,
    durable: bool,
    ops: &[Op],
) -> Result<(), String> {
    let mut store = Some(FaultyStore::new(open()));
    let mut model = Model {
        now: T0,
        ..Model::default()
    };
    let mut claims: HashMap<u8, Vec<Claim>> = HashMap::new();
    let mut last_token = 0u64;
    let mut pending_fault: Option<StoreOp> = None;
    for (i, op) in ops.iter().enumerate() {
        let s = store.as_ref().ok_or("store missing")?;
        let now = Timestamp::from_millis(model.now);
        let fail = |what: StoreOp| pending_fault == Some(what);
        let err = |e: &dyn std::fmt::Debug| format!("op {i} {op:?}: {e:?}");
        match *op {
            Op::Begin { key: k, fp } => {
                let got = s.begin(&key(k), &Fingerprint::of([fp % 2]), now, LEASE, RETENTION);
                if fail(StoreOp::Begin) {
                    expect_injected(&got).map_err(|e| err(&e))?;
                    pending_fault = None;
                    continue;
                }
                let got = got.map_err(|e| err(&e))?;
                let token = got.claim().map_or(0, Claim::token);
                if token != 0 {
                    if token <= last_token {
                        return Err(err(&format!("token {token} after {last_token}")));
                    }
                    last_token = token;
                }
                let want = model.begin(k % 4, fp % 2, token);
                let got = match got {
                    Begin::Claimed(c) => {
                        let a = Answer::Claimed {
                            takeover: c.is_takeover(),
                            attempt: c.attempt(),
                            steps: steps_of(c.steps()),
                        };
                        claims.entry(k % 4).or_default().push(c);
                        a
                    }
                    Begin::Replay(r) => Answer::Replay(r),
                    Begin::InFlight { lease_until } => Answer::InFlight(lease_until.as_millis()),
                    Begin::Conflict => Answer::Conflict,
                };
                if got != want {
                    return Err(err(&format!("store {got:?}, model {want:?}")));
                }
            }
            Op::Complete {
                key: k,
                stale,
                body,
            } => {
                let Some(c) = pick(&claims, k % 4, stale) else {
                    continue;
                };
                let resp = Response::new(200, vec![body; usize::from(body % 8)]);
                let got = s.complete(&key(k), &c, &resp, now, RETENTION);
                if fail(StoreOp::Complete) {
                    expect_injected(&got).map_err(|e| err(&e))?;
                    pending_fault = None;
                } else if model.owns(k % 4, c.token(), true) {
                    got.map_err(|e| err(&e))?;
                    if let Some(r) = model.records.get_mut(&(k % 4)) {
                        r.response = Some(resp);
                        r.expires_at = model.now + ms(RETENTION);
                        r.steps.clear();
                    }
                } else if !matches!(got, Err(Error::StaleClaim)) {
                    return Err(err(&format!("expected StaleClaim, got {got:?}")));
                }
            }
            Op::Release { key: k, stale } => {
                let Some(c) = pick(&claims, k % 4, stale) else {
                    continue;
                };
                let got = s.release(&key(k), &c);
                if fail(StoreOp::Release) {
                    expect_injected(&got).map_err(|e| err(&e))?;
                    pending_fault = None;
                } else if model.release(k % 4, c.token()) {
                    got.map_err(|e| err(&e))?;
                } else if !matches!(got, Err(Error::StaleClaim)) {
                    return Err(err(&format!("expected StaleClaim, got {got:?}")));
                }
            }
            Op::Renew { key: k, stale } => {
                let Some(c) = pick(&claims, k % 4, stale) else {
                    continue;
                };
                let got = s.renew(&key(k), &c, now, LEASE);
                if fail(StoreOp::Renew) {
                    expect_injected(&got).map_err(|e| err(&e))?;
                    pending_fault = None;
                    continue;
                }
                match (model.renew(k % 4, c.token()), got) {
                    (Some(until), Ok(renewed)) => {
                        if renewed.lease_until().as_millis() != until
                            || renewed.token() != c.token()
                        {
                            return Err(err(&format!("renewed {renewed:?}, model until {until}")));
                        }
                    }
                    (None, Err(Error::StaleClaim)) => {}
                    (want, got) => {
                        return Err(err(&format!("store {got:?}, model {want:?}")));
                    }
                }
            }
            Op::Get { key: k } => {
                let got = s.get(&key(k), now);
                if fail(StoreOp::Get) {
                    expect_injected(&got).map_err(|e| err(&e))?;
                    pending_fault = None;
                    continue;
                }
                let got = got.map_err(|e| err(&e))?;
                let want = model
                    .records
                    .get(&(k % 4))
                    .filter(|r| model.now < r.expires_at);
                let same = match (&got, want) {
                    (None, None) => true,
                    (Some(g), Some(w)) => {
                        g.response() == w.response.as_ref()
                            && g.expires_at().as_millis() == w.expires_at
                            && g.token() == w.token
                            && g.attempts() == w.attempts
                            && g.fingerprint() == &Fingerprint::of([w.fp])
                            && steps_of(g.steps()) == w.steps
                            && g.lease_until().map(Timestamp::as_millis)
                                == w.response.is_none().then_some(w.lease_until)
                    }
                    _ => false,
                };
                if !same {
                    return Err(err(&format!("store {got:?}, model {want:?}")));
                }
            }
            Op::Sweep { max } => {
                let max = usize::from(max % 8);
                let got = s.sweep_expired(now, max);
                if fail(StoreOp::Sweep) {
                    expect_injected(&got).map_err(|e| err(&e))?;
                    pending_fault = None;
                    continue;
                }
                let got = got.map_err(|e| err(&e))?;
                let mut due: Vec<(u64, u8)> = model
                    .records
                    .iter()
                    .filter(|(_, r)| r.expires_at <= model.now)
                    .map(|(k, r)| (r.expires_at, *k))
                    .collect();
                due.sort_unstable();
                due.truncate(max);
                if got != due.len() {
                    return Err(err(&format!("swept {got}, model {}", due.len())));
                }
                for (_, k) in due {
                    model.records.remove(&k);
                }
            }
            Op::Advance { ms } => model.now += u64::from(ms % 2000),
            Op::Fault { op: which } => {
                let which = fault_op(which);
                s.fail_next(which, 1);
                pending_fault = Some(which);
            }
            Op::Reopen if durable => {
                drop(store.take()); // close before reopening: the file is locked while open
                let fresh = FaultyStore::new(open());
                if let Some(which) = pending_fault {
                    fresh.fail_next(which, 1);
                }
                store = Some(fresh);
            }
            Op::Reopen => {}
            Op::Step {
                key: k,
                stale,
                name,
                output,
            } => {
                let Some(c) = pick(&claims, k % 4, stale) else {
                    continue;
                };
                let (name, output) = (format!("s{}", name % 3), vec![output % 2]);
                let step =
                    idemstore::Step::new(name.as_str(), output.clone()).map_err(|e| err(&e))?;
                let got = s.record_step(&key(k), &c, &step, now);
                if fail(StoreOp::Step) {
                    expect_injected(&got).map_err(|e| err(&e))?;
                    pending_fault = None;
                    continue;
                }
                let want = model.record_step(k % 4, c.token(), &name, &output);
                let same = matches!(
                    (&want, &got),
                    (StepAnswer::Recorded, Ok(()))
                        | (StepAnswer::Stale, Err(Error::StaleClaim))
                        | (StepAnswer::OtherOutput, Err(Error::InvalidArgument { .. }))
                        | (StepAnswer::Limit, Err(Error::StepLimit { .. }))
                );
                if !same {
                    return Err(err(&format!("store {got:?}, model {want:?}")));
                }
            }
        }
    }
    Ok(())
}

fn expect_injected<T: std::fmt::Debug>(got: &Result<T, Error>) -> Result<(), String> {
    match got {
        Err(Error::Backend(e)) if e.to_string().starts_with("injected fault") => Ok(()),
        other => Err(format!("expected the injected fault, got {other:?}")),
    }
}

fn pick(claims: &HashMap<u8, Vec<Claim>>, key: u8, stale: bool) -> Option<Claim> {
    let list = claims.get(&key)?;
    if stale { list.first() } else { list.last() }.cloned()
}

/// Operations without faults or reopen: the conformance suite checks the
/// plain contract; fault and reopen sequences run per backend.
pub fn plain_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..4u8, 0..2u8).prop_map(|(key, fp)| Op::Begin { key, fp }),
        3 => (0..4u8, any::<bool>(), any::<u8>()).prop_map(|(key, stale, body)| Op::Complete { key, stale, body }),
        1 => (0..4u8, any::<bool>()).prop_map(|(key, stale)| Op::Release { key, stale }),
        1 => (0..4u8, any::<bool>()).prop_map(|(key, stale)| Op::Renew { key, stale }),
        2 => (0..4u8).prop_map(|key| Op::Get { key }),
        1 => (0..8u8).prop_map(|max| Op::Sweep { max }),
        2 => (0..2_000u16).prop_map(|ms| Op::Advance { ms }),
        3 => (0..4u8, any::<bool>(), 0..3u8, 0..2u8)
            .prop_map(|(key, stale, name, output)| Op::Step { key, stale, name, output }),
    ]
}

/// Any operation, faults and reopen included.
pub fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => plain_op(),
        1 => any::<u8>().prop_map(|op| Op::Fault { op }),
        1 => Just(Op::Reopen),
    ]
}

/// Runs `cases` random sequences of up to `len` plain operations, each on a
/// fresh store from `make`, against the model; panics with the shrunk
/// sequence on the first divergence.
pub fn check_against_model(make: Make<'_>, cases: u32, len: usize) {
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&proptest::collection::vec(plain_op(), 1..len), |ops| {
        let subject = make();
        let store = Arc::clone(&subject.store);
        let mut open = || -> Arc<dyn Store> { Arc::clone(&store) };
        run_ops(&mut open, false, &ops).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("the store diverged from the model: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_follows_the_table() {
        let mut m = Model {
            now: 0,
            ..Model::default()
        };
        assert_eq!(
            m.begin(1, 0, 1),
            Answer::Claimed {
                takeover: false,
                attempt: 1,
                steps: Vec::new(),
            }
        );
        assert_eq!(m.begin(1, 1, 0), Answer::Conflict);
        assert_eq!(m.begin(1, 0, 0), Answer::InFlight(1_000));
        m.now = 1_000;
        assert_eq!(
            m.begin(1, 0, 2),
            Answer::Claimed {
                takeover: true,
                attempt: 2,
                steps: Vec::new(),
            }
        );
        m.now = 3_000;
        assert_eq!(
            m.begin(1, 1, 3),
            Answer::Claimed {
                takeover: false,
                attempt: 1,
                steps: Vec::new(),
            }
        );
    }

    #[test]
    fn model_keeps_steps_across_a_release_and_drops_them_at_completion() {
        let mut m = Model {
            now: 0,
            ..Model::default()
        };
        let _ = m.begin(0, 0, 1);
        assert_eq!(m.record_step(0, 1, "a", b"1"), StepAnswer::Recorded);
        assert_eq!(m.record_step(0, 1, "a", b"1"), StepAnswer::Recorded);
        assert_eq!(m.record_step(0, 1, "a", b"2"), StepAnswer::OtherOutput);
        assert_eq!(m.record_step(0, 2, "b", b"1"), StepAnswer::Stale);
        assert!(m.release(0, 1));
        assert!(!m.release(0, 1), "a released claim is stale");
        assert_eq!(m.record_step(0, 1, "b", b"1"), StepAnswer::Stale);
        assert_eq!(m.begin(0, 1, 0), Answer::Conflict);
        let steps = vec![("a".to_owned(), b"1".to_vec())];
        assert_eq!(
            m.begin(0, 0, 2),
            Answer::Claimed {
                takeover: false,
                attempt: 2,
                steps: steps.clone(),
            }
        );
        m.now = 1_000;
        assert_eq!(
            m.begin(0, 0, 3),
            Answer::Claimed {
                takeover: true,
                attempt: 3,
                steps,
            }
        );
        // A release without steps deletes the record.
        let _ = m.begin(1, 0, 4);
        assert!(m.release(1, 4));
        assert!(!m.records.contains_key(&1));
    }

    #[test]
    fn memory_store_matches_model_with_faults() {
        let ops = [
            Op::Begin { key: 0, fp: 0 },
            Op::Fault { op: 1 },
            Op::Complete {
                key: 0,
                stale: false,
                body: 3,
            },
            Op::Complete {
                key: 0,
                stale: false,
                body: 3,
            },
            Op::Get { key: 0 },
            Op::Advance { ms: 1999 },
            Op::Advance { ms: 1999 },
            Op::Sweep { max: 7 },
            Op::Begin { key: 0, fp: 1 },
        ];
        let mut open = || -> Arc<dyn Store> { Arc::new(idemstore::MemoryStore::new()) };
        run_ops(&mut open, false, &ops).expect("no divergence");
    }

    #[test]
    fn a_wrong_store_is_caught() {
        // A store that forgets every completion must diverge from the model.
        struct Forgetful(idemstore::MemoryStore);
        impl Store for Forgetful {
            fn begin(
                &self,
                k: &Key,
                f: &Fingerprint,
                n: Timestamp,
                l: Duration,
                r: Duration,
            ) -> idemstore::Result<Begin> {
                self.0.begin(k, f, n, l, r)
            }
            fn complete(
                &self,
                _: &Key,
                _: &Claim,
                _: &Response,
                _: Timestamp,
                _: Duration,
            ) -> idemstore::Result<()> {
                Ok(())
            }
            fn release(&self, k: &Key, c: &Claim) -> idemstore::Result<()> {
                self.0.release(k, c)
            }
            fn record_step(
                &self,
                k: &Key,
                c: &Claim,
                s: &idemstore::Step,
                n: Timestamp,
            ) -> idemstore::Result<()> {
                self.0.record_step(k, c, s, n)
            }
            fn renew(
                &self,
                k: &Key,
                c: &Claim,
                n: Timestamp,
                l: Duration,
            ) -> idemstore::Result<Claim> {
                self.0.renew(k, c, n, l)
            }
            fn get(&self, k: &Key, n: Timestamp) -> idemstore::Result<Option<idemstore::Record>> {
                self.0.get(k, n)
            }
            fn sweep_expired(&self, n: Timestamp, m: usize) -> idemstore::Result<usize> {
                self.0.sweep_expired(n, m)
            }
        }
        let ops = [
            Op::Begin { key: 0, fp: 0 },
            Op::Complete {
                key: 0,
                stale: false,
                body: 1,
            },
            Op::Begin { key: 0, fp: 0 },
        ];
        let mut open = || -> Arc<dyn Store> { Arc::new(Forgetful(idemstore::MemoryStore::new())) };
        assert!(run_ops(&mut open, false, &ops).is_err());
    }
}
