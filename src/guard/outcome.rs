//! [`Outcome`]: what a run of the guard answers, and the counters of
//! those answers ([`GuardStats`]).

use crate::error::Error;
use crate::record::Claim;
use crate::response::Response;
use crate::time::Timestamp;
use std::sync::atomic::{AtomicU64, Ordering};

/// The result of [`Guard::run`](super::Guard::run).
///
/// `E` is the handler's error type.
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome<E> {
    /// The handler ran once and its response is stored for replay.
    Executed(Response),
    /// A retry of a completed request: the stored response, handler not run.
    Replayed(Response),
    /// Another owner is executing; retry after `lease_until`. Handler not run.
    InFlight {
        /// When the owner's lease ends.
        lease_until: Timestamp,
    },
    /// The key was used with different parameters. Handler not run.
    Conflicted,
    /// The store could not answer `begin`: fail closed, handler not run.
    Unavailable(Error),
    /// [`TakeoverPolicy::Reconcile`](super::TakeoverPolicy::Reconcile): a previous owner's lease expired with
    /// its outcome unknown. Handler not run; the caller holds the new claim
    /// and must [`complete`](super::Guard::complete) or [`release`](super::Guard::release) it.
    Unknown(Claim),
    /// The handler ran and returned `Err`; the claim was kept or released
    /// per [`OnHandlerError`](super::OnHandlerError).
    HandlerFailed(E),
    /// The handler ran and returned a response, but storing it failed. The
    /// record stays PROCESSING; after the lease a retry runs the handler
    /// again, and the fencing token passed downstream must absorb it.
    NotStored {
        /// What the handler returned.
        response: Response,
        /// Why it was not stored.
        error: Error,
    },
    /// The store was down and this guard is configured to fail open: the
    /// handler ran without protection (counted in [`GuardStats::fail_open`]).
    FailedOpen(std::result::Result<Response, E>),
    /// The handler ran, but while it ran a renewal of its lease found the
    /// claim taken over (its lease had run out and a retry claimed the key:
    /// that retry runs the same intent) or gone. Nothing was stored or
    /// released: the key is the new owner's. The handler could see it
    /// coming ([`Claim::lease_lost`]); what it returned is here, to send or
    /// to log. Counted in [`GuardStats::leases_lost`].
    LeaseLost(std::result::Result<Response, E>),
}

impl<E> Outcome<E> {
    /// The outcome's name in metrics and traces
    /// (`idemstore_guard_outcomes_total`, [observability](crate::observability)).
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Outcome::Executed(_) => "executed",
            Outcome::Replayed(_) => "replayed",
            Outcome::InFlight { .. } => "in_flight",
            Outcome::Conflicted => "conflicted",
            Outcome::Unavailable(_) => "unavailable",
            Outcome::Unknown(_) => "unknown",
            Outcome::HandlerFailed(_) => "handler_failed",
            Outcome::NotStored { .. } => "not_stored",
            Outcome::FailedOpen(_) => "fail_open",
            Outcome::LeaseLost(_) => "lease_lost",
        }
    }

    /// The response to send, if there is one (`Executed`, `Replayed`,
    /// `NotStored`, `FailedOpen(Ok)`, `LeaseLost(Ok)`).
    ///
    /// ```
    /// use idemstore::{Outcome, Response};
    /// let o: Outcome<()> = Outcome::Replayed(Response::new(200, "ok"));
    /// assert_eq!(o.response().map(|r| r.status()), Some(200));
    /// ```
    pub fn response(&self) -> Option<&Response> {
        match self {
            Outcome::Executed(r) | Outcome::Replayed(r) => Some(r),
            Outcome::NotStored { response, .. } => Some(response),
            Outcome::FailedOpen(Ok(r)) | Outcome::LeaseLost(Ok(r)) => Some(r),
            _ => None,
        }
    }

    /// True when this call ran the handler.
    ///
    /// ```
    /// use idemstore::Outcome;
    /// assert!(!Outcome::<()>::Conflicted.ran_handler());
    /// ```
    pub fn ran_handler(&self) -> bool {
        matches!(
            self,
            Outcome::Executed(_)
                | Outcome::HandlerFailed(_)
                | Outcome::NotStored { .. }
                | Outcome::FailedOpen(_)
                | Outcome::LeaseLost(_)
        )
    }
}

/// Counters kept by a guard (and its clones), from [`Guard::stats`](super::Guard::stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GuardStats {
    /// Handler runs under a claim (Executed, HandlerFailed, NotStored).
    pub executed: u64,
    /// Stored responses replayed.
    pub replayed: u64,
    /// InFlight answers.
    pub in_flight: u64,
    /// Conflicted answers.
    pub conflicted: u64,
    /// Unavailable answers (fail closed).
    pub unavailable: u64,
    /// Handler runs without protection because the store was down and fail-open was on.
    pub fail_open: u64,
    /// Claims that took over an expired lease.
    pub takeovers: u64,
    /// Completions or releases refused because the claim had gone stale.
    pub stale: u64,
    /// Duplicates that waited for an owner in this process and replayed its
    /// response ([`GuardBuilder::wait_for_duplicates`](super::GuardBuilder::wait_for_duplicates)); also in `replayed`.
    pub waited: u64,
    /// Leases renewed while a handler ran
    /// ([`GuardBuilder::renew_leases`](super::GuardBuilder::renew_leases)).
    pub renewals: u64,
    /// Runs whose claim a renewal found taken over ([`Outcome::LeaseLost`]).
    pub leases_lost: u64,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) executed: AtomicU64,
    pub(super) replayed: AtomicU64,
    pub(super) in_flight: AtomicU64,
    pub(super) conflicted: AtomicU64,
    pub(super) unavailable: AtomicU64,
    pub(super) fail_open: AtomicU64,
    pub(super) takeovers: AtomicU64,
    pub(super) stale: AtomicU64,
    pub(super) waited: AtomicU64,
    pub(super) renewals: AtomicU64,
    pub(super) leases_lost: AtomicU64,
}

pub(super) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}
