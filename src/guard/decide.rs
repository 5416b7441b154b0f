//! The guard's decisions, written once for [`Guard::run`] and
//! `Guard::run_async`: what to do with the answer of `begin`, what to write
//! after the handler, and what the owner answers.

use super::flights::{Entered, FLIGHTS, Waited};
use super::{Guard, OnHandlerError, Outcome, TakeoverPolicy, bump};
use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::{Begin, Claim};
use crate::response::Response;
use crate::store::Store;
use crate::time::Timestamp;
use std::time::Instant;

/// What to do after `begin`, decided once for both `run`s.
pub(super) enum Start<E> {
    Execute(Claim),
    Answer(Outcome<E>),
    FailOpen,
    /// InFlight, and this guard waits for a local owner.
    Wait {
        lease_until: Timestamp,
    },
}

/// What to write after the handler, decided once for both `run`s. It
/// borrows the handler's response: the sync path stores it without a copy.
pub(super) enum Settle<'a> {
    Complete(&'a Response),
    Release,
    Keep,
}

impl<S: Store> Guard<S> {
    /// When a waiting duplicate gives up (now, when waiting is off).
    pub(super) fn wait_deadline(&self) -> Instant {
        let now = Instant::now();
        match self.waiting {
            Some(max_wait) => now.checked_add(max_wait).unwrap_or(now),
            None => now,
        }
    }

    /// Enters the flight of `key` on this guard's store (shared by every
    /// guard over it) at `now`.
    pub(super) fn enter(&self, key: &Key, fingerprint: &Fingerprint, now: Timestamp) -> Entered {
        FLIGHTS.enter(self.store.instance(), key, fingerprint, now)
    }

    /// Turns the answer of `begin` into what to do next, tells the flight
    /// whether this run owns the key, and counts the answer.
    pub(super) fn classify<E>(&self, begun: Result<Begin>, entry: &mut Entered) -> Start<E> {
        let start = self.decide(begun, self.waiting.is_some());
        let claimed = match &start {
            Start::Execute(claim) => Some((claim, self.lease)),
            _ => None,
        };
        entry.begun(claimed);
        start
    }

    /// What a duplicate that waited answers; `None`: ask the store again.
    pub(super) fn after_wait<E>(
        &self,
        waited: Waited,
        lease_until: Timestamp,
    ) -> Option<Outcome<E>> {
        let c = &self.counters;
        match waited {
            Waited::Stored(response) => {
                bump(&c.replayed);
                bump(&c.waited);
                crate::observability::waited();
                Some(Outcome::Replayed(response))
            }
            Waited::Retry => None,
            Waited::InFlight => {
                bump(&c.in_flight);
                Some(Outcome::InFlight { lease_until })
            }
        }
    }

    fn decide<E>(&self, begun: Result<Begin>, may_wait: bool) -> Start<E> {
        let c = &self.counters;
        match begun {
            Err(error) if self.fail_open => {
                bump(&c.fail_open);
                crate::observability::failed_open(&error);
                Start::FailOpen
            }
            Err(error) => {
                bump(&c.unavailable);
                Start::Answer(Outcome::Unavailable(error))
            }
            Ok(Begin::Replay(response)) => {
                bump(&c.replayed);
                Start::Answer(Outcome::Replayed(response))
            }
            // Counted once the wait says how it ended.
            Ok(Begin::InFlight { lease_until }) if may_wait => Start::Wait { lease_until },
            Ok(Begin::InFlight { lease_until }) => {
                bump(&c.in_flight);
                Start::Answer(Outcome::InFlight { lease_until })
            }
            Ok(Begin::Conflict) => {
                bump(&c.conflicted);
                Start::Answer(Outcome::Conflicted)
            }
            Ok(Begin::Claimed(claim)) => {
                crate::observability::claimed(
                    claim.token(),
                    self.lease,
                    claim.is_takeover(),
                    claim.attempt(),
                );
                if claim.is_takeover() {
                    bump(&c.takeovers);
                    if self.takeover == TakeoverPolicy::Reconcile {
                        return Start::Answer(Outcome::Unknown(claim));
                    }
                }
                bump(&c.executed);
                Start::Execute(claim)
            }
        }
    }

    /// `release` lets a caller inside the crate release the claim for some
    /// errors whatever the guard's [`OnHandlerError`] (the HTTP layer's
    /// "do not store this response").
    /// A claim a renewal found lost writes nothing: the key is another
    /// owner's.
    pub(super) fn settle<'r, E>(
        &self,
        result: &'r std::result::Result<Response, E>,
        release: impl Fn(&E) -> bool,
        claim: &Claim,
    ) -> Settle<'r> {
        if claim.lease_lost() {
            return Settle::Keep;
        }
        match (result, self.on_handler_error) {
            (Ok(response), _) => Settle::Complete(response),
            (Err(e), _) if release(e) => Settle::Release,
            (Err(_), OnHandlerError::Release) => Settle::Release,
            (Err(_), OnHandlerError::KeepClaim) => Settle::Keep,
        }
    }

    /// The owner's outcome; its waiters (if any) learn whether it was stored.
    pub(super) fn conclude<E>(
        &self,
        result: std::result::Result<Response, E>,
        written: Result<()>,
        entry: &mut Entered,
        claim: &Claim,
    ) -> Outcome<E> {
        self.count_stale(&written);
        let lost = claim.lease_lost();
        let stored = match (&result, &written) {
            // Copied only for the duplicates waiting on it.
            (Ok(response), Ok(())) if !lost && self.waiting.is_some() => Some(response.clone()),
            _ => None,
        };
        entry.land(stored);
        if lost {
            return Outcome::LeaseLost(result);
        }
        match (result, written) {
            (Ok(response), Ok(())) => Outcome::Executed(response),
            (Ok(response), Err(error)) => Outcome::NotStored { response, error },
            // A failed release leaves the claim to expire with its lease,
            // which is the default path anyway.
            (Err(e), _) => Outcome::HandlerFailed(e),
        }
    }
}
