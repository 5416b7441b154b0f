//! [`GuardBuilder`] and the policies it sets.

use super::Guard;
#[cfg(doc)]
use super::{DEFAULT_LEASE, DEFAULT_RETENTION, GuardStats, Outcome};
use crate::error::{Error, Result};
#[cfg(doc)]
use crate::record::Claim;
use crate::record::check_durations;
#[cfg(doc)]
use crate::store::Store;
use crate::time::Clock;
use std::sync::Arc;
use std::time::Duration;

/// What happens to the claim when the handler returns `Err`.
///
/// ```
/// use idemstore::guard::OnHandlerError;
/// assert_eq!(OnHandlerError::default(), OnHandlerError::KeepClaim);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnHandlerError {
    /// The record stays PROCESSING until its lease ends, then a retry takes
    /// over — the same recovery path as a crash (the default: the handler
    /// may have done part of its work).
    #[default]
    KeepClaim,
    /// The claim is released at once so that a retry runs immediately. Use
    /// only when a handler error means nothing happened.
    Release,
}

/// What a retry does when it finds an owner's lease expired.
///
/// ```
/// use idemstore::guard::TakeoverPolicy;
/// assert_eq!(TakeoverPolicy::default(), TakeoverPolicy::Retake);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TakeoverPolicy {
    /// Run the handler again (the default: the lease is the recovery path
    /// after a crash). Safe when the handler's downstream calls are
    /// themselves idempotent on the fencing token or key.
    #[default]
    Retake,
    /// Do not run the handler: answer [`Outcome::Unknown`] with the new claim,
    /// so the caller checks the authoritative system (did the payment go
    /// through?) and then completes or releases the claim.
    Reconcile,
}

/// Configures a [`Guard`]; from [`Guard::builder`].
///
/// ```
/// use idemstore::guard::{OnHandlerError, TakeoverPolicy};
/// use idemstore::{Guard, MemoryStore};
/// use std::time::Duration;
///
/// let guard = Guard::builder(MemoryStore::new())
///     .lease(Duration::from_secs(10))
///     .retention(Duration::from_secs(7 * 24 * 3600))
///     .on_handler_error(OnHandlerError::Release)
///     .takeover(TakeoverPolicy::Reconcile)
///     .build()?;
/// assert_eq!(guard.lease(), Duration::from_secs(10));
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Debug)]
pub struct GuardBuilder<S> {
    pub(super) guard: Guard<S>,
}

impl<S> GuardBuilder<S> {
    /// How long an owner may run before a retry may take over (default [`DEFAULT_LEASE`]).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.guard.lease = lease;
        self
    }
    /// How long duplicates are recognised (default [`DEFAULT_RETENTION`]).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.guard.retention = retention;
        self
    }
    /// The clock the guard reads `now` from (default: the store's,
    /// [`Store::clock`]). Only for a guard that must see another time than
    /// its store's background work (recovery, the sweeper); a test that
    /// drives time builds the store with its `ManualClock` instead.
    pub fn clock(mut self, clock: impl Clock + 'static) -> Self {
        self.guard.clock = Arc::new(clock);
        self
    }
    /// What a handler error does to the claim (default [`OnHandlerError::KeepClaim`]).
    pub fn on_handler_error(mut self, policy: OnHandlerError) -> Self {
        self.guard.on_handler_error = policy;
        self
    }
    /// What a retry does with an expired lease (default [`TakeoverPolicy::Retake`]).
    pub fn takeover(mut self, policy: TakeoverPolicy) -> Self {
        self.guard.takeover = policy;
        self
    }
    /// Runs the handler unprotected when the store cannot answer (default
    /// off: fail closed). Only for operations that are naturally idempotent
    /// or reconciled elsewhere; every such run is counted in
    /// [`GuardStats::fail_open`] and its claim has token 0
    /// ([`Claim::is_unprotected`]).
    pub fn fail_open(mut self, on: bool) -> Self {
        self.guard.fail_open = on;
        self
    }
    /// Renews the claim's lease while the handler runs (default on): every
    /// third of the lease ([`Guard::renewal_interval`]), one timer
    /// thread for the whole process calls [`Store::renew`] for every running
    /// handler (no thread per request, sync or async), until the handler
    /// returns, fails, panics or its future is dropped. So a handler that
    /// runs longer than the lease keeps its key: retries meanwhile are
    /// [`Outcome::InFlight`] with the renewed lease end, and a retry takes
    /// over only one lease after the last renewal (the owner died). If a
    /// renewal finds the claim taken over anyway (the store was unreachable
    /// for a whole lease), [`Claim::lease_lost`] turns true for the handler
    /// and the run answers [`Outcome::LeaseLost`].
    ///
    /// Off: the lease is what `begin` set, and a handler that outlives it
    /// may be taken over while it runs (its fencing token then stops its
    /// result, not its side effect).
    ///
    /// ```
    /// use idemstore::{Fingerprint, Guard, Key, MemoryStore, Outcome, Response};
    /// use std::time::Duration;
    ///
    /// let guard = Guard::builder(MemoryStore::new())
    ///     .lease(Duration::from_millis(300))
    ///     .build()?;
    /// let key = Key::new("", "export-1")?;
    /// let out = guard.run(&key, &Fingerprint::of(b"all"), |claim| {
    ///     let first = claim.lease_until();
    ///     std::thread::sleep(Duration::from_millis(500)); // longer than the lease
    ///     assert!(claim.lease_until() > first, "renewed meanwhile");
    ///     Ok::<_, std::convert::Infallible>(Response::new(200, "done"))
    /// });
    /// assert!(matches!(out, Outcome::Executed(_)));
    /// assert!(guard.stats().renewals >= 1);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn renew_leases(mut self, on: bool) -> Self {
        self.guard.renew = on;
        self
    }
    /// Lets a duplicate that finds the key in flight *with its owner in this
    /// process* (this guard or a clone) wait up to `max_wait` for the owner's
    /// result and answer [`Outcome::Replayed`] with it, instead of
    /// [`Outcome::InFlight`] (default: off).
    ///
    /// Waiting costs no store calls: the owner signals its waiters in
    /// memory when it has stored (or given up) its result. If the owner is
    /// in another process, the answer is InFlight at once; if the deadline
    /// passes, InFlight; if the owner finishes without storing (its handler
    /// failed, or it released the claim), the duplicate asks the store
    /// again and may run the handler itself. `max_wait` is monotonic time,
    /// not the guard's [`Clock`]; it must be at least 1 ms and at most the
    /// lease (past the lease the owner's claim no longer protects anything).
    /// `Guard::run_async` needs tokio's timer for the deadline.
    ///
    /// ```
    /// use idemstore::{Fingerprint, Guard, Key, MemoryStore, Outcome, Response};
    /// use std::{convert::Infallible, sync::Barrier, time::Duration};
    ///
    /// let guard = Guard::builder(MemoryStore::new())
    ///     .wait_for_duplicates(Duration::from_secs(5))
    ///     .build()?;
    /// let (key, fp) = (Key::new("", "order-1")?, Fingerprint::of(b"qty=1"));
    /// let started = Barrier::new(2);
    /// std::thread::scope(|s| {
    ///     let owner = s.spawn(|| guard.run(&key, &fp, |_| {
    ///         started.wait(); // the duplicate arrives while this runs
    ///         std::thread::sleep(Duration::from_millis(50));
    ///         Ok::<_, Infallible>(Response::new(201, "created"))
    ///     }));
    ///     started.wait();
    ///     let dup = guard.run(&key, &fp, |_| -> Result<Response, Infallible> { unreachable!() });
    ///     assert!(matches!(dup, Outcome::Replayed(ref r) if r.body() == b"created"));
    ///     assert!(matches!(owner.join().unwrap(), Outcome::Executed(_)));
    /// });
    /// assert_eq!(guard.stats().waited, 1);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn wait_for_duplicates(mut self, max_wait: Duration) -> Self {
        self.guard.waiting = Some(max_wait);
        self
    }
    /// The guard; [`Error::InvalidArgument`] when the lease is under 1 ms,
    /// the retention is shorter than the lease, or the wait for duplicates
    /// is under 1 ms or longer than the lease.
    pub fn build(self) -> Result<Guard<S>> {
        check_durations(self.guard.lease, self.guard.retention)?;
        if let Some(max_wait) = &self.guard.waiting
            && (*max_wait < Duration::from_millis(1) || *max_wait > self.guard.lease)
        {
            return Err(Error::invalid_argument(format!(
                "wait for duplicates {max_wait:?} must be between 1 ms and the lease ({:?})",
                self.guard.lease
            )));
        }
        Ok(self.guard)
    }
}
