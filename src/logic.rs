//! The contract's state machine, written once for every backend, and
//! published for backends written outside this crate, with the future type
//! of a native async entry ([`StoreFuture`]).
//!
//! Each function takes the record as the backend read it (inside its own
//! atomic step: a write transaction, a compare-and-swap, a mutex) and says
//! what the answer is and what to write. Backends add storage; they never
//! re-decide the five cases. [`MemoryStore`](crate::MemoryStore), `RedbStore`,
//! `SledStore` and `PostgresStore`'s tests all go through these functions;
//! a third-party [`Store`](crate::Store) that does the same, and keeps each
//! call's read and write in one atomic step, decides exactly as they do. The
//! `idemstore-testkit` crate's conformance suite then checks the storage side.
//!
//! A complete backend over a `Mutex<HashMap>`:
//!
//! ```
//! use idemstore::{logic, Begin, Claim, Fingerprint, Key, Record, Response, Result, Step, Store, Timestamp};
//! use std::collections::HashMap;
//! use std::sync::Mutex;
//! use std::time::Duration;
//!
//! #[derive(Default)]
//! struct MapStore(Mutex<(HashMap<Key, Record>, u64)>); // records, last token
//!
//! impl Store for MapStore {
//!     fn begin(&self, key: &Key, fp: &Fingerprint, now: Timestamp, lease: Duration, retention: Duration) -> Result<Begin> {
//!         logic::check_durations(lease, retention)?;
//!         let mut g = self.0.lock().expect("not poisoned");
//!         let (records, last_token) = &mut *g;
//!         let step = logic::begin(records.get(key).cloned(), fp, now, lease, retention, || {
//!             *last_token += 1;
//!             Ok(*last_token)
//!         })?;
//!         if let Some(record) = step.write {
//!             records.insert(key.clone(), record);
//!         }
//!         Ok(step.answer)
//!     }
//!     fn complete(&self, key: &Key, claim: &Claim, response: &Response, now: Timestamp, retention: Duration) -> Result<()> {
//!         logic::check_response(response, idemstore::limits::DEFAULT_MAX_BODY_BYTES)?;
//!         let mut g = self.0.lock().expect("not poisoned");
//!         let done = logic::complete(g.0.get(key).cloned(), claim, response, now, retention)?;
//!         g.0.insert(key.clone(), done);
//!         Ok(())
//!     }
//!     fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
//!         let mut g = self.0.lock().expect("not poisoned");
//!         match logic::release(g.0.get(key).cloned(), claim)? {
//!             Some(kept) => g.0.insert(key.clone(), kept), // steps outlive a release
//!             None => g.0.remove(key),
//!         };
//!         Ok(())
//!     }
//!     fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()> {
//!         let mut g = self.0.lock().expect("not poisoned");
//!         if let Some(record) = logic::record_step(g.0.get(key).cloned(), claim, step, now)? {
//!             g.0.insert(key.clone(), record);
//!         }
//!         Ok(())
//!     }
//!     fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
//!         let mut g = self.0.lock().expect("not poisoned");
//!         let step = logic::renew(g.0.get(key).cloned(), claim, now, lease)?;
//!         g.0.insert(key.clone(), step.write);
//!         Ok(step.claim)
//!     }
//!     fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
//!         Ok(logic::visible(self.0.lock().expect("not poisoned").0.get(key).cloned(), now))
//!     }
//!     fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
//!         let mut g = self.0.lock().expect("not poisoned");
//!         // Oldest expiry first, as the contract says.
//!         let mut due: Vec<(Timestamp, Key)> = g.0.iter()
//!             .filter(|(_, r)| logic::sweepable(r.expires_at(), now))
//!             .map(|(k, r)| (r.expires_at(), k.clone()))
//!             .collect();
//!         due.sort();
//!         due.truncate(max.min(idemstore::limits::MAX_SWEEP_BATCH));
//!         for (_, k) in &due {
//!             g.0.remove(k);
//!         }
//!         Ok(due.len())
//!     }
//! }
//!
//! let store = MapStore::default();
//! let (key, fp, t0) = (Key::new("t", "k")?, Fingerprint::of(b"x"), Timestamp::from_millis(0));
//! let d = Duration::from_secs(60);
//! let Begin::Claimed(claim) = store.begin(&key, &fp, t0, d, d)? else { panic!() };
//! store.complete(&key, &claim, &Response::new(200, "ok"), t0, d)?;
//! assert_eq!(store.begin(&key, &fp, t0, d, d)?, Begin::Replay(Response::new(200, "ok")));
//! # Ok::<(), idemstore::Error>(())
//! ```

pub use crate::store::StoreFuture;

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, Claim, Record, State};
use crate::response::Response;
use crate::step::Step;
use crate::time::Timestamp;
use std::time::Duration;

/// What [`begin`] decided: the answer, and the record to write with it.
///
/// ```
/// use idemstore::{logic, Begin, Fingerprint, Timestamp};
/// use std::time::Duration;
///
/// let d = Duration::from_secs(10);
/// let step = logic::begin(None, &Fingerprint::of(b"x"), Timestamp::EPOCH, d, d, || Ok(1))?;
/// assert!(matches!(step.answer, Begin::Claimed(_)));
/// assert_eq!(step.write.expect("a claim writes").token(), 1);
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct BeginStep {
    /// The answer for the caller.
    pub answer: Begin,
    /// The record to write, when the answer is `Claimed` (a new claim or a
    /// takeover); `None` when nothing is to be written.
    pub write: Option<Record>,
}

/// The five `begin` cases, given the record stored under the key (`None`
/// when there is none; an expired one counts as none).
///
/// `next_token` is called once, only when the key is claimed; it must
/// return a token larger than any handed out before by the store, and the
/// store must keep that promise across restarts (store the high-water mark
/// in the same atomic step as the record).
///
/// ```
/// use idemstore::{logic, Begin, Fingerprint, Timestamp};
/// use std::time::Duration;
///
/// let (lease, keep) = (Duration::from_secs(1), Duration::from_secs(60));
/// let t0 = Timestamp::from_millis(0);
/// let first = logic::begin(None, &Fingerprint::of(b"x"), t0, lease, keep, || Ok(7))?;
/// let stored = first.write.expect("claimed");
/// // Another fingerprint under the same key is a conflict, and writes nothing.
/// let other = logic::begin(Some(stored.clone()), &Fingerprint::of(b"y"), t0, lease, keep, || Ok(8))?;
/// assert_eq!(other.answer, Begin::Conflict);
/// assert!(other.write.is_none());
/// // The lease ran out: a takeover under a new token.
/// let again = logic::begin(Some(stored), &Fingerprint::of(b"x"), t0 + lease, lease, keep, || Ok(8))?;
/// assert!(again.answer.claim().is_some_and(|c| c.is_takeover() && c.token() == 8));
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn begin(
    existing: Option<Record>,
    fingerprint: &Fingerprint,
    now: Timestamp,
    lease: Duration,
    retention: Duration,
    next_token: impl FnOnce() -> Result<u64>,
) -> Result<BeginStep> {
    let live = existing.filter(|r| !r.is_expired(now));
    let Some(record) = live else {
        let token = next_token()?;
        let lease_until = now + lease;
        let record = Record {
            fingerprint: *fingerprint,
            state: State::Processing,
            response: None,
            lease_until: Some(lease_until),
            expires_at: now + retention,
            created_at: now,
            token,
            attempts: 1,
            steps: Vec::new(),
        };
        return Ok(claimed(record, false));
    };
    if record.fingerprint != *fingerprint {
        return Ok(answer(Begin::Conflict));
    }
    match (record.state, record.lease_until) {
        (State::Done, _) => {
            let response = record.response.unwrap_or_default();
            Ok(answer(Begin::Replay(response)))
        }
        (State::Processing, Some(lease_until)) if now < lease_until => {
            Ok(answer(Begin::InFlight { lease_until }))
        }
        (State::Processing, lease_until) => {
            // Takeover: the owner's lease has run out (or the owner released
            // the key and kept its steps: not a takeover). Renew the lease
            // under a new token; the expiry never moves earlier.
            let takeover = lease_until != Some(RELEASED);
            let token = next_token()?;
            let record = Record {
                lease_until: Some(now + lease),
                expires_at: record.expires_at.max(now + lease),
                token,
                attempts: record.attempts.saturating_add(1),
                ..record
            };
            Ok(claimed(record, takeover))
        }
    }
}

fn claimed(record: Record, takeover: bool) -> BeginStep {
    let mut claim = Claim::new(
        record.token,
        record.lease_until.unwrap_or(Timestamp::EPOCH),
        takeover,
        record.attempts,
    );
    claim.steps.clone_from(&record.steps);
    BeginStep {
        answer: Begin::Claimed(claim),
        write: Some(record),
    }
}

fn answer(answer: Begin) -> BeginStep {
    BeginStep {
        answer,
        write: None,
    }
}

/// Checks that `claim` is the current owner of `existing` (live, PROCESSING,
/// same token, not released) and returns that record.
fn owned(existing: Option<Record>, claim: &Claim, now: Option<Timestamp>) -> Result<Record> {
    match existing {
        Some(r)
            if r.state == State::Processing
                && r.token == claim.token
                && r.lease_until != Some(RELEASED)
                && now.is_none_or(|now| !r.is_expired(now)) =>
        {
            Ok(r)
        }
        _ => Err(Error::StaleClaim),
    }
}

/// `complete`: the record to write (DONE, lease cleared, expiry
/// `now + retention`), or [`Error::StaleClaim`] when `claim` is not the
/// current owner of a live PROCESSING record.
///
/// ```
/// use idemstore::{logic, Error, Fingerprint, Response, State, Timestamp};
/// use std::time::Duration;
///
/// let d = Duration::from_secs(10);
/// let step = logic::begin(None, &Fingerprint::of(b"x"), Timestamp::EPOCH, d, d, || Ok(1))?;
/// let claim = step.answer.claim().expect("claimed").clone();
/// let done = logic::complete(step.write.clone(), &claim, &Response::new(200, "ok"), Timestamp::EPOCH, d)?;
/// assert_eq!(done.state(), State::Done);
/// // Completing against a record that is already DONE is stale.
/// let again = logic::complete(Some(done), &claim, &Response::new(200, "ok"), Timestamp::EPOCH, d);
/// assert!(matches!(again, Err(Error::StaleClaim)));
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn complete(
    existing: Option<Record>,
    claim: &Claim,
    response: &Response,
    now: Timestamp,
    retention: Duration,
) -> Result<Record> {
    let record = owned(existing, claim, Some(now))?;
    Ok(done(record, response.clone(), now, retention))
}

/// [`complete`] taking the response it stores (a caller that owns it
/// spares a copy).
#[cfg(feature = "redb")]
pub(crate) fn complete_owned(
    existing: Option<Record>,
    claim: &Claim,
    response: Response,
    now: Timestamp,
    retention: Duration,
) -> Result<Record> {
    let record = owned(existing, claim, Some(now))?;
    Ok(done(record, response, now, retention))
}

/// The DONE record `complete` writes over its owner's `record`.
fn done(record: Record, response: Response, now: Timestamp, retention: Duration) -> Record {
    Record {
        state: State::Done,
        response: Some(response),
        lease_until: None,
        expires_at: now + retention,
        steps: Vec::new(),
        ..record
    }
}

/// The lease end of a record whose owner released it but whose steps are
/// kept: over, so the next `begin` claims it at once, and told apart from
/// a lease that ran out, so that claim is not a takeover.
const RELEASED: Timestamp = Timestamp::EPOCH;

/// `release`: checks ownership and says what to write. `None`: delete the
/// record, so a retry (or a different request under the same key) may run
/// at once. `Some(record)` when steps are recorded: they must outlive the
/// release (the side effects they stand for happened), so the record stays
/// PROCESSING with its lease over; the next `begin` with the same
/// fingerprint claims it at once (not as a takeover) and gets the steps,
/// and another fingerprint is a conflict.
///
/// ```
/// use idemstore::{logic, Error, Fingerprint, Step, Timestamp};
/// use std::time::Duration;
///
/// let (d, t0) = (Duration::from_secs(10), Timestamp::EPOCH);
/// let step = logic::begin(None, &Fingerprint::of(b"x"), t0, d, d, || Ok(1))?;
/// let claim = step.answer.claim().expect("claimed").clone();
/// assert_eq!(logic::release(step.write.clone(), &claim)?, None);
/// assert!(matches!(logic::release(None, &claim), Err(Error::StaleClaim)));
/// // With a step recorded, the record stays for the next claim.
/// let charged = logic::record_step(step.write, &claim, &Step::new("charge", vec![1])?, t0)?;
/// let kept = logic::release(charged, &claim)?.expect("steps are kept");
/// let again = logic::begin(Some(kept), &Fingerprint::of(b"x"), t0, d, d, || Ok(2))?;
/// let next = again.answer.claim().expect("claimed at once");
/// assert!(!next.is_takeover());
/// assert_eq!(next.steps()[0].name(), "charge");
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn release(existing: Option<Record>, claim: &Claim) -> Result<Option<Record>> {
    let record = owned(existing, claim, None)?;
    if record.steps.is_empty() {
        return Ok(None);
    }
    Ok(Some(Record {
        lease_until: Some(RELEASED),
        ..record
    }))
}

/// `record_step`: the record with `step` appended, or `None` when the
/// same step (name and output) is already recorded and nothing is to be
/// written. [`Error::StaleClaim`] when `claim` is not the current owner of
/// a live PROCESSING record; [`Error::StepLimit`] when the record would
/// hold more steps or step bytes than its limits; [`Error::InvalidArgument`]
/// when a step of that name is recorded with another output.
///
/// ```
/// use idemstore::{logic, Error, Fingerprint, Step, Timestamp};
/// use std::time::Duration;
///
/// let (d, t0) = (Duration::from_secs(10), Timestamp::EPOCH);
/// let begun = logic::begin(None, &Fingerprint::of(b"x"), t0, d, d, || Ok(1))?;
/// let claim = begun.answer.claim().expect("claimed").clone();
/// let charge = Step::new("charge", b"ch_1".to_vec())?;
/// let written = logic::record_step(begun.write, &claim, &charge, t0)?.expect("a write");
/// assert_eq!(written.steps(), [charge.clone()]);
/// // Recording it again (a retried call) writes nothing.
/// assert_eq!(logic::record_step(Some(written.clone()), &claim, &charge, t0)?, None);
/// let other = Step::new("charge", b"ch_2".to_vec())?;
/// let clash = logic::record_step(Some(written), &claim, &other, t0);
/// assert!(matches!(clash, Err(Error::InvalidArgument { .. })));
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn record_step(
    existing: Option<Record>,
    claim: &Claim,
    step: &Step,
    now: Timestamp,
) -> Result<Option<Record>> {
    let mut record = owned(existing, claim, Some(now))?;
    if let Some(recorded) = record.steps.iter().find(|s| s.name == step.name) {
        if recorded.output == step.output {
            return Ok(None);
        }
        return Err(Error::invalid_argument(format!(
            "step `{}` is already recorded with another output",
            step.name
        )));
    }
    record.steps.push(step.clone());
    crate::step::check_all(&record.steps)?;
    Ok(Some(record))
}

/// What [`renew`] decided: the record to write (its lease extended) and
/// the claim to hand back (same token, the new lease end).
///
/// ```
/// use idemstore::{logic, Fingerprint, Timestamp};
/// use std::time::Duration;
///
/// let (lease, keep) = (Duration::from_secs(10), Duration::from_secs(60));
/// let t0 = Timestamp::from_millis(0);
/// let begun = logic::begin(None, &Fingerprint::of(b"x"), t0, lease, keep, || Ok(1))?;
/// let claim = begun.answer.claim().expect("claimed").clone();
/// let step = logic::renew(begun.write, &claim, t0 + Duration::from_secs(5), lease)?;
/// assert_eq!(step.claim.lease_until(), Timestamp::from_millis(15_000));
/// assert_eq!(step.claim.token(), claim.token());
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct RenewStep {
    /// The claim with its new lease end, for the caller.
    pub claim: Claim,
    /// The record to write.
    pub write: Record,
}

/// `renew`: the claim's lease extended to `now + lease` (never shortened),
/// with the record's expiry kept at least that late; or
/// [`Error::StaleClaim`] when `claim` is not the current owner of a live
/// PROCESSING record (another caller took the key over, or it was
/// completed, released or swept). A lease that ran out but was not taken
/// over yet may still be renewed: nobody else owns the key. The token does
/// not change. `lease` must be at least 1 ms
/// ([`Error::InvalidArgument`]).
///
/// ```
/// use idemstore::{logic, Error, Fingerprint, Timestamp};
/// use std::time::Duration;
///
/// let d = Duration::from_secs(10);
/// let t0 = Timestamp::from_millis(0);
/// let first = logic::begin(None, &Fingerprint::of(b"x"), t0, d, d, || Ok(1))?;
/// let mine = first.answer.claim().expect("claimed").clone();
/// // The lease runs out and another caller takes over under token 2 ...
/// let second = logic::begin(first.write, &Fingerprint::of(b"x"), t0 + d, d, d, || Ok(2))?;
/// // ... so the first owner can no longer renew.
/// let late = logic::renew(second.write, &mine, t0 + d, d);
/// assert!(matches!(late, Err(Error::StaleClaim)));
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn renew(
    existing: Option<Record>,
    claim: &Claim,
    now: Timestamp,
    lease: Duration,
) -> Result<RenewStep> {
    crate::record::check_lease(lease)?;
    let record = owned(existing, claim, Some(now))?;
    // A PROCESSING record always has a lease; it is never shortened.
    let lease_until = (now + lease).max(record.lease_until.unwrap_or(Timestamp::EPOCH));
    let write = Record {
        lease_until: Some(lease_until),
        expires_at: record.expires_at.max(lease_until),
        ..record
    };
    let mut claim = claim.clone();
    claim.lease_until = lease_until;
    Ok(RenewStep { claim, write })
}

/// Whether a record found by a sweep at `now` is to be deleted.
///
/// ```
/// use idemstore::{logic, Timestamp};
/// let at = Timestamp::from_millis(100);
/// assert!(!logic::sweepable(at, Timestamp::from_millis(99)));
/// assert!(logic::sweepable(at, at));
/// ```
pub fn sweepable(record_expires_at: Timestamp, now: Timestamp) -> bool {
    now >= record_expires_at
}

/// The fencing token after the high-water mark `last`, for a store that
/// counts its own tokens (`begin`'s `next_token`); [`Error::InvalidArgument`]
/// once they run out.
///
/// ```
/// use idemstore::logic;
/// assert_eq!(logic::next_token(41)?, 42);
/// assert!(logic::next_token(u64::MAX).is_err());
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn next_token(last: u64) -> Result<u64> {
    last.checked_add(1)
        .ok_or_else(|| Error::invalid_argument("fencing tokens exhausted"))
}

/// The record as `get` shows it: expired records are invisible.
///
/// ```
/// use idemstore::{logic, Fingerprint, Timestamp};
/// use std::time::Duration;
///
/// let d = Duration::from_secs(10);
/// let rec = logic::begin(None, &Fingerprint::of(b"x"), Timestamp::EPOCH, d, d, || Ok(1))?.write;
/// assert!(logic::visible(rec.clone(), Timestamp::EPOCH).is_some());
/// assert!(logic::visible(rec, Timestamp::EPOCH + d).is_none());
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn visible(existing: Option<Record>, now: Timestamp) -> Option<Record> {
    existing.filter(|r| !r.is_expired(now))
}

/// Checks a response against the store's body limit (and the header
/// limits) before any write: [`Error::ResponseTooLarge`] or
/// [`Error::InvalidArgument`].
///
/// ```
/// use idemstore::{logic, Error, Response};
/// assert!(logic::check_response(&Response::new(200, vec![0; 10]), 10).is_ok());
/// let big = logic::check_response(&Response::new(200, vec![0; 11]), 10);
/// assert!(matches!(big, Err(Error::ResponseTooLarge { what: "body bytes", .. })));
/// ```
pub fn check_response(response: &Response, max_body_bytes: usize) -> Result<()> {
    response.check_limits(max_body_bytes)
}

/// Checks `begin`'s durations before any I/O: `lease` at least 1 ms and
/// `retention` at least `lease`, else [`Error::InvalidArgument`].
///
/// ```
/// use idemstore::logic;
/// use std::time::Duration;
/// assert!(logic::check_durations(Duration::from_secs(1), Duration::from_secs(1)).is_ok());
/// assert!(logic::check_durations(Duration::ZERO, Duration::from_secs(1)).is_err());
/// assert!(logic::check_durations(Duration::from_secs(2), Duration::from_secs(1)).is_err());
/// ```
pub fn check_durations(lease: Duration, retention: Duration) -> Result<()> {
    crate::record::check_durations(lease, retention)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The public check is the stores' own (found by mutation testing:
    /// only its doc test called it).
    #[test]
    fn check_durations_refuses_a_zero_lease_and_a_short_retention() {
        let s = Duration::from_secs;
        assert!(check_durations(s(1), s(1)).is_ok());
        assert!(matches!(
            check_durations(Duration::ZERO, s(1)),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            check_durations(s(2), s(1)),
            Err(Error::InvalidArgument { .. })
        ));
    }
}
