//! [`Guard`] and what configures and reports on it: [`GuardBuilder`], the
//! policies [`OnHandlerError`] and [`TakeoverPolicy`], the [`Outcome`] of a
//! run and the counters ([`GuardStats`]). `Guard` and `Outcome` are also at
//! the crate root.
//!
//! ```
//! use idemstore::guard::{OnHandlerError, TakeoverPolicy};
//! use idemstore::{Guard, MemoryStore};
//!
//! let guard = Guard::builder(MemoryStore::new())
//!     .on_handler_error(OnHandlerError::Release)
//!     .takeover(TakeoverPolicy::Reconcile)
//!     .build()?;
//! assert_eq!(guard.stats().executed, 0);
//! # Ok::<(), idemstore::Error>(())
//! ```

// The decision logic is written once (`decide.rs`: `Guard::classify`
// before the handler, `Guard::conclude` after it); the synchronous
// `Guard::run` (`sync.rs`) and the async `Guard::run_async` (`run_async.rs`,
// feature `tokio`) only differ in how they call the store and the handler.
// `flights.rs` holds the runs of a key in this process (a live local owner
// holds off its duplicates whatever the wall clock says; duplicates waiting
// for it); `renew.rs` the process's timer that renews a running handler's
// lease.

mod builder;
mod decide;
mod flights;
mod outcome;
mod renew;
#[cfg(feature = "tokio")]
mod run_async;
mod steps;
mod sync;

pub use builder::{GuardBuilder, OnHandlerError, TakeoverPolicy};
use outcome::{Counters, bump};
pub use outcome::{GuardStats, Outcome};
use renew::RENEW_FRACTION;
#[cfg(any(feature = "redb", feature = "postgres"))]
pub(crate) use steps::Next;
pub(crate) use steps::StepRun;

use crate::error::{Error, Result};
use crate::key::Key;
use crate::record::Claim;
use crate::response::Response;
use crate::store::Store;
use crate::time::{Clock, Timestamp};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub(crate) use crate::limits::{DEFAULT_LEASE, DEFAULT_RETENTION};

/// Puts a store in front of a handler: claim first, execute, write the
/// terminal state last.
///
/// | situation | handler runs? | outcome |
/// |---|---|---|
/// | store cannot answer `begin` | no — fail closed | [`Outcome::Unavailable`] |
/// | claimed | yes, once | [`Outcome::Executed`] |
/// | DONE | no | [`Outcome::Replayed`] |
/// | same fingerprint, lease live | no | [`Outcome::InFlight`]; with [`GuardBuilder::wait_for_duplicates`] and the owner in this process, [`Outcome::Replayed`] once it is done |
/// | different fingerprint | no | [`Outcome::Conflicted`] |
/// | handler returns `Err` | — | [`Outcome::HandlerFailed`]; claim kept until the lease ends, or released ([`OnHandlerError`]) |
/// | handler `Ok`, `complete` fails | — | [`Outcome::NotStored`]; record stays PROCESSING |
/// | a renewal found the claim taken over while the handler ran | — | [`Outcome::LeaseLost`]; nothing written |
///
/// While the handler runs, its claim's lease is renewed in the background
/// every third of the lease ([`GuardBuilder::renew_leases`], on by
/// default), so a handler that runs longer than the lease keeps its key:
/// retries meanwhile are `InFlight`, and a takeover happens only one lease
/// after the last renewal (the owner process died, or its store calls
/// failed for a whole lease).
///
/// A deterministic failure (say, 409 out of stock) is an `Ok` response: it is
/// stored and replayed like any other. Clones share the store and counters.
///
/// # Clock steps
///
/// A lease ends at a wall-clock time (it must outlive the process), so a
/// clock that steps forward by more than the lease left (NTP correcting a
/// slow clock, a VM resumed from a snapshot or migrated) makes a running
/// claim look expired. Within one process that cannot let a retry in: while
/// a run holds its claim, a retry of the same key and fingerprint through
/// any guard over the same store object ([`Store::instance`]) answers
/// [`Outcome::InFlight`] (or waits, with
/// [`wait_for_duplicates`](GuardBuilder::wait_for_duplicates)) without
/// asking the store — for as long as the run lives with renewal on (the
/// default; the next renewal stores a lease from the new time), or for the
/// lease measured on the monotonic clock since the claim with renewal off.
/// Only an owner in another process, or a dead one, is judged by the wall
/// clock; `docs/operations.md` ("Clocks") says what to configure there.
///
/// ```
/// use idemstore::{Fingerprint, Guard, Key, ManualClock, MemoryStore, Outcome, Response, Timestamp};
/// use std::{convert::Infallible, time::Duration};
///
/// let clock = ManualClock::new(Timestamp::from_millis(0));
/// let guard = Guard::builder(MemoryStore::with_clock(clock.clone()))
///     .lease(Duration::from_secs(30))
///     .build()?;
/// let (key, fp) = (Key::new("", "order-1")?, Fingerprint::of(b"qty=1"));
/// let first = guard.run(&key, &fp, |_| {
///     clock.advance(Duration::from_secs(600)); // the wall clock jumps 20 leases
///     let retry = guard.run(&key, &fp, |_| -> Result<Response, Infallible> { unreachable!() });
///     assert!(matches!(retry, Outcome::InFlight { .. }));
///     Ok::<_, Infallible>(Response::new(201, "created"))
/// });
/// assert!(matches!(first, Outcome::Executed(_)));
/// # Ok::<(), idemstore::Error>(())
/// ```
///
/// ```
/// use idemstore::{Fingerprint, Guard, Key, MemoryStore, Outcome, Response};
///
/// let guard = Guard::new(MemoryStore::new());
/// let key = Key::new("tenant-42", "order-1")?;
/// let fp = Fingerprint::of(b"sku=A&qty=1");
///
/// let first = guard.run(&key, &fp, |claim| {
///     // charge(order, idempotency_key = claim.token()) ...
///     Ok::<_, std::convert::Infallible>(Response::new(201, format!("charged #{}", claim.token())))
/// });
/// assert!(matches!(first, Outcome::Executed(_)));
///
/// let retry = guard.run(&key, &fp, |_| -> Result<Response, std::convert::Infallible> {
///     unreachable!("a retry never runs the handler")
/// });
/// assert!(matches!(retry, Outcome::Replayed(ref r) if r.body() == b"charged #1"));
/// assert_eq!(guard.stats().executed, 1);
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Debug)]
pub struct Guard<S> {
    store: Arc<S>,
    clock: Arc<dyn Clock>,
    lease: Duration,
    retention: Duration,
    on_handler_error: OnHandlerError,
    takeover: TakeoverPolicy,
    fail_open: bool,
    /// Renew a claim's lease while its handler runs (renew.rs).
    renew: bool,
    /// `Some` when duplicates wait for a local owner: the longest wait.
    waiting: Option<Duration>,
    counters: Arc<Counters>,
}

impl<S> Clone for Guard<S> {
    fn clone(&self) -> Self {
        self.with_store(Arc::clone(&self.store))
    }
}

impl<S> Guard<S> {
    /// This guard's settings, counters and in-process flights over `store`.
    fn with_store<T>(&self, store: Arc<T>) -> Guard<T> {
        Guard {
            store,
            clock: Arc::clone(&self.clock),
            lease: self.lease,
            retention: self.retention,
            on_handler_error: self.on_handler_error,
            takeover: self.takeover,
            fail_open: self.fail_open,
            renew: self.renew,
            waiting: self.waiting,
            counters: Arc::clone(&self.counters),
        }
    }
}

impl<S: Store> Guard<S> {
    /// A guard with the defaults: lease [`DEFAULT_LEASE`], retention
    /// [`DEFAULT_RETENTION`], the store's clock ([`Store::clock`]), fail
    /// closed.
    ///
    /// A store shared elsewhere goes in as an `Arc` (`Arc<S>` is a
    /// [`Store`] too):
    ///
    /// ```
    /// use idemstore::{Guard, MemoryStore};
    /// use std::sync::Arc;
    /// let store = Arc::new(MemoryStore::new());
    /// let guard = Guard::new(Arc::clone(&store));
    /// assert!(Arc::ptr_eq(&**guard.store(), &store));
    /// ```
    pub fn new(store: S) -> Guard<S> {
        let store = Arc::new(store);
        Guard {
            clock: store.clock(),
            store,
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            on_handler_error: OnHandlerError::default(),
            takeover: TakeoverPolicy::default(),
            fail_open: false,
            renew: true,
            waiting: None,
            counters: Arc::default(),
        }
    }

    /// A builder over `store` with the defaults of [`Guard::new`].
    pub fn builder(store: S) -> GuardBuilder<S> {
        GuardBuilder {
            guard: Guard::new(store),
        }
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// The configured lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The configured retention.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// How often a running handler's lease is renewed: every third of the
    /// lease (at least every millisecond), or `None` when renewal is off
    /// ([`GuardBuilder::renew_leases`]).
    ///
    /// ```
    /// use idemstore::{Guard, MemoryStore};
    /// use std::time::Duration;
    /// let guard = Guard::builder(MemoryStore::new()).lease(Duration::from_secs(30)).build()?;
    /// assert_eq!(guard.renewal_interval(), Some(Duration::from_secs(10)));
    /// let off = Guard::builder(MemoryStore::new()).renew_leases(false).build()?;
    /// assert_eq!(off.renewal_interval(), None);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn renewal_interval(&self) -> Option<Duration> {
        self.renew
            .then(|| (self.lease / RENEW_FRACTION).max(Duration::from_millis(1)))
    }

    /// A snapshot of the counters (shared by clones of this guard).
    pub fn stats(&self) -> GuardStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        GuardStats {
            executed: get(&c.executed),
            replayed: get(&c.replayed),
            in_flight: get(&c.in_flight),
            conflicted: get(&c.conflicted),
            unavailable: get(&c.unavailable),
            fail_open: get(&c.fail_open),
            takeovers: get(&c.takeovers),
            stale: get(&c.stale),
            waited: get(&c.waited),
            renewals: get(&c.renewals),
            leases_lost: get(&c.leases_lost),
        }
    }

    /// The time on this guard's clock (what it passes to the store as `now`).
    ///
    /// ```
    /// use idemstore::{Guard, ManualClock, MemoryStore, Timestamp};
    /// let clock = ManualClock::new(Timestamp::from_millis(7));
    /// let guard = Guard::builder(MemoryStore::new()).clock(clock).build()?;
    /// assert_eq!(guard.now(), Timestamp::from_millis(7));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn now(&self) -> Timestamp {
        self.clock.now()
    }

    /// Completes a claim handed out as [`Outcome::Unknown`] (or held by the
    /// caller otherwise), with this guard's clock and retention.
    ///
    /// ```
    /// use idemstore::guard::TakeoverPolicy;
    /// use idemstore::{Fingerprint, Guard, Key, ManualClock, MemoryStore, Outcome, Response, Timestamp};
    /// use std::{convert::Infallible, time::Duration};
    ///
    /// let clock = ManualClock::new(Timestamp::from_millis(0));
    /// let guard = Guard::builder(MemoryStore::new())
    ///     .clock(clock.clone())
    ///     .lease(Duration::from_secs(1))
    ///     .takeover(TakeoverPolicy::Reconcile)
    ///     .build()?;
    /// let (key, fp) = (Key::new("", "pay-1")?, Fingerprint::of(b"100 EUR"));
    /// // The first owner "crashes": its handler errors and the claim is kept.
    /// let first = guard.run(&key, &fp, |_| Err::<Response, _>("process died"));
    /// assert!(matches!(first, Outcome::HandlerFailed(_)));
    /// clock.advance(Duration::from_secs(2));
    /// // The retry does not blindly charge again: it is told the outcome is unknown.
    /// let Outcome::Unknown(claim) = guard.run(&key, &fp, |_| -> Result<Response, Infallible> { unreachable!() })
    ///     else { panic!("expected Unknown") };
    /// // ... the caller asks the payment provider, which says it went through:
    /// guard.complete(&key, &claim, &Response::new(200, "paid"))?;
    /// assert!(matches!(guard.run(&key, &fp, |_| -> Result<Response, Infallible> { unreachable!() }),
    ///                  Outcome::Replayed(_)));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn complete(&self, key: &Key, claim: &Claim, response: &Response) -> Result<()> {
        let r = self
            .store
            .complete(key, claim, response, self.clock.now(), self.retention);
        self.count_stale(&r);
        r
    }

    /// Releases a claim held by the caller, so that a retry runs at once.
    ///
    /// ```
    /// # use idemstore::{Begin, Fingerprint, Guard, Key, MemoryStore, Store, Timestamp};
    /// # use std::time::Duration;
    /// let guard = Guard::new(MemoryStore::new());
    /// let key = Key::new("", "k")?;
    /// let now = Timestamp::from_millis(0);
    /// let d = Duration::from_secs(5);
    /// let Begin::Claimed(claim) = guard.store().begin(&key, &Fingerprint::of(b""), now, d, d)? else { panic!() };
    /// guard.release(&key, &claim)?;
    /// assert!(guard.store().get(&key, now)?.is_none());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        let r = self.store.release(key, claim);
        self.count_stale(&r);
        r
    }

    fn count_stale(&self, r: &Result<()>) {
        if matches!(r, Err(Error::StaleClaim)) {
            bump(&self.counters.stale);
            crate::observability::stale_claim();
        }
    }

    /// This guard over its store seen as `dyn Store`, sharing the
    /// configuration, counters and waiting duplicates (so the HTTP service
    /// type does not carry the store type).
    #[cfg(feature = "tower")]
    pub(crate) fn erased(&self) -> Guard<Arc<dyn Store>>
    where
        S: 'static,
    {
        let store: Arc<dyn Store> = Arc::clone(&self.store) as Arc<dyn Store>;
        self.with_store(Arc::new(store))
    }
}

/// Awaits the store's native future, or, for a store without one, runs the
/// blocking call that `make` builds (only then are its owned copies made)
/// on tokio's blocking pool.
#[cfg(feature = "tokio")]
async fn native_or_blocking<T, B>(
    native: Option<crate::store::StoreFuture<'_, T>>,
    make: impl FnOnce() -> B,
) -> Result<T>
where
    T: Send + 'static,
    B: FnOnce() -> Result<T> + Send + 'static,
{
    match native {
        Some(future) => future.await,
        None => blocking(make()).await,
    }
}

#[cfg(feature = "tokio")]
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(join) => Err(Error::backend(format!("store call did not finish: {join}"))),
    }
}
