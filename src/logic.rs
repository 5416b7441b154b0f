//! The contract's state machine, written once for every backend.
//!
//! Each function takes the record as the backend read it (inside its own
//! atomic step: a write transaction, a compare-and-swap, a mutex) and says
//! what the answer is and what to write. Backends add storage; they never
//! re-decide the five cases.

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, Claim, Record, State};
use crate::response::Response;
use crate::time::Timestamp;
use std::time::Duration;

/// What `begin` decided.
#[derive(Debug)]
pub(crate) struct BeginStep {
    /// The answer for the caller.
    pub(crate) answer: Begin,
    /// The record to write, when the answer is `Claimed`.
    pub(crate) write: Option<Record>,
}

/// The five `begin` cases. `next_token` is called once, only when the key is
/// claimed; it must return a token larger than any handed out before.
pub(crate) fn begin(
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
        (State::Processing, _) => {
            // Takeover: the owner's lease has run out. Renew the lease under
            // a new token; the expiry never moves earlier.
            let token = next_token()?;
            let record = Record {
                lease_until: Some(now + lease),
                expires_at: record.expires_at.max(now + lease),
                token,
                attempts: record.attempts.saturating_add(1),
                ..record
            };
            Ok(claimed(record, true))
        }
    }
}

fn claimed(record: Record, takeover: bool) -> BeginStep {
    let claim = Claim {
        token: record.token,
        lease_until: record.lease_until.unwrap_or(Timestamp::EPOCH),
        takeover,
        attempt: record.attempts,
    };
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
/// same token) and returns that record.
fn owned(existing: Option<Record>, claim: &Claim, now: Option<Timestamp>) -> Result<Record> {
    match existing {
        Some(r)
            if r.state == State::Processing
                && r.token == claim.token
                && now.is_none_or(|now| !r.is_expired(now)) =>
        {
            Ok(r)
        }
        _ => Err(Error::StaleClaim),
    }
}

/// `complete`: the record to write (DONE, lease cleared, expiry `now + retention`).
pub(crate) fn complete(
    existing: Option<Record>,
    claim: &Claim,
    response: &Response,
    now: Timestamp,
    retention: Duration,
) -> Result<Record> {
    let record = owned(existing, claim, Some(now))?;
    Ok(Record {
        state: State::Done,
        response: Some(response.clone()),
        lease_until: None,
        expires_at: now + retention,
        ..record
    })
}

/// `release`: checks ownership; the caller then deletes the record so that
/// a retry (or a different request under the same key) may run at once.
pub(crate) fn release(existing: Option<Record>, claim: &Claim) -> Result<()> {
    owned(existing, claim, None).map(|_| ())
}

/// Whether a record found by a sweep at `now` is to be deleted.
pub(crate) fn sweepable(record_expires_at: Timestamp, now: Timestamp) -> bool {
    now >= record_expires_at
}

/// The record as `get` shows it: expired records are invisible.
pub(crate) fn visible(existing: Option<Record>, now: Timestamp) -> Option<Record> {
    existing.filter(|r| !r.is_expired(now))
}

/// Checks a response against the store's body limit before any write.
pub(crate) fn check_response(response: &Response, max_body_bytes: usize) -> Result<()> {
    response.check_limits(max_body_bytes)
}
