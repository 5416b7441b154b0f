//! A backend written outside idemstore, tested the way its authors would:
//! a `Store` over a `Mutex<HashMap>` built on `idemstore::logic`, run
//! through the whole conformance suite with one macro line. Then the test of
//! the test: a variant that never answers `Conflict` (it lets a request with
//! other parameters take over the key) must fail the suite, and must fail it
//! in the cases that check conflicts; so must a variant whose `release`
//! forgets recorded steps (it deletes the record, as before steps), in the
//! cases that check steps.
#![allow(
    clippy::unwrap_used,
    reason = "a panic in a test is a failure with a location"
)]

use idemstore::{
    Begin, Claim, Fingerprint, Key, Record, Response, Result, Step, Store, Timestamp, logic,
};
use idemstore_testkit::conformance::{Subject, run_all};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Records and the last fencing token handed out, behind one mutex: each
/// call's read and write are one atomic step.
#[derive(Default)]
struct MapStore {
    inner: Mutex<(HashMap<Key, Record>, u64)>,
    /// The broken variant: a different fingerprint claims the key as if it
    /// were absent, instead of answering `Conflict`.
    never_conflict: bool,
    /// The second broken variant: `release` deletes the record even when
    /// steps are recorded, so a retry starts without them (and with any
    /// fingerprint) although their side effects happened.
    release_forgets_steps: bool,
}

impl Store for MapStore {
    fn begin(
        &self,
        key: &Key,
        fp: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        logic::check_durations(lease, retention)?;
        let mut g = self.inner.lock().unwrap();
        let (records, last_token) = &mut *g;
        let mut existing = records.get(key).cloned();
        if self.never_conflict && existing.as_ref().is_some_and(|r| r.fingerprint() != fp) {
            existing = None;
        }
        let step = logic::begin(existing, fp, now, lease, retention, || {
            *last_token += 1;
            Ok(*last_token)
        })?;
        if let Some(record) = step.write {
            records.insert(key.clone(), record);
        }
        Ok(step.answer)
    }

    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        logic::check_response(response, idemstore::limits::DEFAULT_MAX_BODY_BYTES)?;
        let mut g = self.inner.lock().unwrap();
        let done = logic::complete(g.0.get(key).cloned(), claim, response, now, retention)?;
        g.0.insert(key.clone(), done);
        Ok(())
    }

    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        let mut g = self.inner.lock().unwrap();
        match logic::release(g.0.get(key).cloned(), claim)? {
            Some(kept) if !self.release_forgets_steps => g.0.insert(key.clone(), kept),
            _ => g.0.remove(key),
        };
        Ok(())
    }

    fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()> {
        let mut g = self.inner.lock().unwrap();
        if let Some(record) = logic::record_step(g.0.get(key).cloned(), claim, step, now)? {
            g.0.insert(key.clone(), record);
        }
        Ok(())
    }

    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
        let mut g = self.inner.lock().unwrap();
        let step = logic::renew(g.0.get(key).cloned(), claim, now, lease)?;
        g.0.insert(key.clone(), step.write);
        Ok(step.claim)
    }

    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        Ok(logic::visible(
            self.inner.lock().unwrap().0.get(key).cloned(),
            now,
        ))
    }

    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        let mut g = self.inner.lock().unwrap();
        // Oldest expiry first, as the contract says (a real backend keeps
        // an expiry index rather than sorting).
        let mut due: Vec<(Timestamp, Key)> =
            g.0.iter()
                .filter(|(_, r)| logic::sweepable(r.expires_at(), now))
                .map(|(k, r)| (r.expires_at(), k.clone()))
                .collect();
        due.sort();
        due.truncate(max.min(idemstore::limits::MAX_SWEEP_BATCH));
        for (_, k) in &due {
            g.0.remove(k);
        }
        Ok(due.len())
    }
}

fn map_store() -> Subject {
    Subject::new(MapStore::default(), ())
}

fn broken_map_store() -> Subject {
    Subject::new(
        MapStore {
            never_conflict: true,
            ..MapStore::default()
        },
        (),
    )
}

fn step_forgetting_map_store() -> Subject {
    Subject::new(
        MapStore {
            release_forgets_steps: true,
            ..MapStore::default()
        },
        (),
    )
}

// The whole suite, one #[test] per case.
idemstore_testkit::conformance!(map_store);

#[test]
fn run_all_passes_the_map_store() {
    assert_eq!(run_all(&map_store), vec![]);
}

#[test]
fn a_store_that_never_answers_conflict_fails_the_suite() {
    let failed: Vec<&str> = run_all(&broken_map_store).iter().map(|f| f.case).collect();
    assert!(
        failed.contains(&"begin_conflict_leaves_record_untouched"),
        "the conflict case let a store without conflicts pass: {failed:?}"
    );
    assert!(
        failed.contains(&"sequential_ops_match_model"),
        "the model check let a store without conflicts pass: {failed:?}"
    );
}

#[test]
fn a_store_whose_release_forgets_steps_fails_the_suite() {
    let failures = run_all(&step_forgetting_map_store);
    let failed: Vec<&str> = failures.iter().map(|f| f.case).collect();
    assert!(
        failed.contains(&"release_keeps_recorded_steps"),
        "the release case let a store that forgets steps pass: {failed:?}"
    );
    // Only step cases notice: without steps its release is the real one.
    for case in &failed {
        assert!(
            case.contains("step") || *case == "sequential_ops_match_model",
            "{case} failed for a store that only mishandles steps: {failures:?}"
        );
    }
}
