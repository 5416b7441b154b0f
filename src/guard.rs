//! [`Guard`]: the request-level contract — claim first, execute, write the
//! terminal state last.
//!
//! The decision logic is written once ([`Guard::classify`] before the
//! handler, [`Guard::conclude`] after it); the synchronous [`Guard::run`] and
//! the async [`Guard::run_async`] (feature `tokio`) only differ in how they
//! call the store and the handler.

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::{Begin, Claim, check_durations};
use crate::response::Response;
use crate::store::Store;
use crate::time::{Clock, SystemClock, Timestamp};
use crate::waiting::{Entered, Flights, Waited};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Default lease: how long an owner may run before its claim can be taken over.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Default retention: how long duplicates are recognised (24 h, the longest
/// common client and gateway retry horizon).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// What happens to the claim when the handler returns `Err`.
///
/// ```
/// use idemstore::OnHandlerError;
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
/// use idemstore::TakeoverPolicy;
/// assert_eq!(TakeoverPolicy::default(), TakeoverPolicy::Retake);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TakeoverPolicy {
    /// Run the handler again (the seeds' behaviour). Safe when the handler's
    /// downstream calls are themselves idempotent on the fencing token or key.
    #[default]
    Retake,
    /// Do not run the handler: answer [`Outcome::Unknown`] with the new claim,
    /// so the caller checks the authoritative system (did the payment go
    /// through?) and then completes or releases the claim.
    Reconcile,
}

/// The result of [`Guard::run`].
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
    /// [`TakeoverPolicy::Reconcile`]: a previous owner's lease expired with
    /// its outcome unknown. Handler not run; the caller holds the new claim
    /// and must [`complete`](Guard::complete) or [`release`](Guard::release) it.
    Unknown(Claim),
    /// The handler ran and returned `Err`; the claim was kept or released
    /// per [`OnHandlerError`].
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
}

impl<E> Outcome<E> {
    /// The response to send, if there is one (`Executed`, `Replayed`,
    /// `NotStored`, `FailedOpen(Ok)`).
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
            Outcome::FailedOpen(Ok(r)) => Some(r),
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
        )
    }
}

/// Counters kept by a guard (and its clones), from [`Guard::stats`].
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
    /// response ([`GuardBuilder::wait_for_duplicates`]); also in `replayed`.
    pub waited: u64,
}

#[derive(Debug, Default)]
struct Counters {
    executed: AtomicU64,
    replayed: AtomicU64,
    in_flight: AtomicU64,
    conflicted: AtomicU64,
    unavailable: AtomicU64,
    fail_open: AtomicU64,
    takeovers: AtomicU64,
    stale: AtomicU64,
    waited: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

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
///
/// A deterministic failure (say, 409 out of stock) is an `Ok` response: it is
/// stored and replayed like any other. Clones share the store and counters.
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
    /// `Some` when duplicates wait for a local owner: the longest wait and
    /// the in-process flights (shared by clones).
    waiting: Option<(Duration, Arc<Flights>)>,
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
            waiting: self.waiting.clone(),
            counters: Arc::clone(&self.counters),
        }
    }
}

/// Configures a [`Guard`]; from [`Guard::builder`].
///
/// ```
/// use idemstore::{Guard, MemoryStore, OnHandlerError, TakeoverPolicy};
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
    guard: Guard<S>,
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
    /// The clock (default [`SystemClock`]).
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
    /// [`Guard::run_async`] needs tokio's timer for the deadline.
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
        self.guard.waiting = Some((max_wait, Arc::default()));
        self
    }
    /// The guard; [`Error::InvalidArgument`] when the lease is under 1 ms,
    /// the retention is shorter than the lease, or the wait for duplicates
    /// is under 1 ms or longer than the lease.
    pub fn build(self) -> Result<Guard<S>> {
        check_durations(self.guard.lease, self.guard.retention)?;
        if let Some((max_wait, _)) = &self.guard.waiting
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

/// What to do after `begin`, decided once for both `run`s.
enum Start<E> {
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
enum Settle<'a> {
    Complete(&'a Response),
    Release,
    Keep,
}

impl<S: Store> Guard<S> {
    /// A guard with the defaults: lease [`DEFAULT_LEASE`], retention
    /// [`DEFAULT_RETENTION`], the system clock, fail closed.
    pub fn new(store: S) -> Guard<S> {
        Guard::from_arc(Arc::new(store))
    }

    /// Like [`Guard::new`], for a store that is shared elsewhere.
    ///
    /// ```
    /// use idemstore::{Guard, MemoryStore};
    /// use std::sync::Arc;
    /// let store = Arc::new(MemoryStore::new());
    /// let guard = Guard::from_arc(Arc::clone(&store));
    /// assert!(Arc::ptr_eq(guard.store(), &store));
    /// ```
    pub fn from_arc(store: Arc<S>) -> Guard<S> {
        Guard {
            store,
            clock: Arc::new(SystemClock),
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            on_handler_error: OnHandlerError::default(),
            takeover: TakeoverPolicy::default(),
            fail_open: false,
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

    /// Runs `handler` at most once per intent: claims `key`, calls the
    /// handler with the claim, stores its response. See the table on [`Guard`].
    pub fn run<E>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        handler: impl FnOnce(&Claim) -> std::result::Result<Response, E>,
    ) -> Outcome<E> {
        let deadline = self.wait_deadline();
        // Each turn asks the store once; a second turn happens only after a
        // local owner finished without storing, so the loop ends by the
        // deadline at the latest.
        loop {
            let mut entry = self.enter(key);
            let now = self.clock.now();
            let begun = self
                .store
                .begin(key, fingerprint, now, self.lease, self.retention);
            match self.classify(begun, entry.as_mut()) {
                Start::Answer(outcome) => return outcome,
                Start::Wait { lease_until } => {
                    let waited = match &entry {
                        Some(entry) => entry.wait_blocking(deadline),
                        None => Waited::InFlight,
                    };
                    match self.after_wait(waited, lease_until) {
                        Some(outcome) => return outcome,
                        None => continue,
                    }
                }
                Start::FailOpen => return Outcome::FailedOpen(handler(&Claim::unprotected())),
                Start::Execute(claim) => {
                    let result = handler(&claim);
                    let written = match self.settle(&result, |_| false) {
                        Settle::Complete(response) => self.store.complete(
                            key,
                            &claim,
                            response,
                            self.clock.now(),
                            self.retention,
                        ),
                        Settle::Release => self.store.release(key, &claim),
                        Settle::Keep => Ok(()),
                    };
                    return self.conclude(result, written, entry.as_mut());
                }
            }
        }
    }

    /// Completes a claim handed out as [`Outcome::Unknown`] (or held by the
    /// caller otherwise), with this guard's clock and retention.
    ///
    /// ```
    /// use idemstore::{Fingerprint, Guard, Key, ManualClock, MemoryStore, Outcome, Response, TakeoverPolicy, Timestamp};
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

    /// When a waiting duplicate gives up (now, when waiting is off).
    fn wait_deadline(&self) -> Instant {
        let now = Instant::now();
        match &self.waiting {
            Some((max_wait, _)) => now.checked_add(*max_wait).unwrap_or(now),
            None => now,
        }
    }

    /// Enters the in-process flight of `key` when this guard waits for duplicates.
    fn enter(&self, key: &Key) -> Option<Entered> {
        self.waiting.as_ref().map(|(_, flights)| flights.enter(key))
    }

    /// Turns the answer of `begin` into what to do next, tells the flight
    /// (if any) whether this run owns the key, and counts the answer.
    fn classify<E>(&self, begun: Result<Begin>, entry: Option<&mut Entered>) -> Start<E> {
        let start = self.decide(begun, entry.is_some());
        if let Some(entry) = entry {
            entry.begun(matches!(start, Start::Execute(_)));
        }
        start
    }

    /// What a duplicate that waited answers; `None`: ask the store again.
    fn after_wait<E>(&self, waited: Waited, lease_until: Timestamp) -> Option<Outcome<E>> {
        let c = &self.counters;
        match waited {
            Waited::Stored(response) => {
                bump(&c.replayed);
                bump(&c.waited);
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
            Err(_) if self.fail_open => {
                bump(&c.fail_open);
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
    fn settle<'r, E>(
        &self,
        result: &'r std::result::Result<Response, E>,
        release: impl Fn(&E) -> bool,
    ) -> Settle<'r> {
        match (result, self.on_handler_error) {
            (Ok(response), _) => Settle::Complete(response),
            (Err(e), _) if release(e) => Settle::Release,
            (Err(_), OnHandlerError::Release) => Settle::Release,
            (Err(_), OnHandlerError::KeepClaim) => Settle::Keep,
        }
    }

    /// The owner's outcome; its waiters (if any) learn whether it was stored.
    fn conclude<E>(
        &self,
        result: std::result::Result<Response, E>,
        written: Result<()>,
        entry: Option<&mut Entered>,
    ) -> Outcome<E> {
        self.count_stale(&written);
        if let Some(entry) = entry {
            let stored = match (&result, &written) {
                (Ok(response), Ok(())) => Some(response.clone()),
                _ => None,
            };
            entry.land(stored);
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

#[cfg(feature = "tokio")]
impl<S: Store + 'static> Guard<S> {
    /// The async [`run`](Guard::run) (feature `tokio`), with the same
    /// decisions. Store calls run on tokio's blocking pool, so no runtime
    /// worker ever waits on an fsync; the handler is awaited on the caller's
    /// task. It is named `run_async` rather than `run` because one type
    /// cannot have both.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idemstore::Error> {
    /// use idemstore::{Fingerprint, Guard, Key, MemoryStore, Outcome, Response};
    ///
    /// let guard = Guard::new(MemoryStore::new());
    /// let key = Key::new("tenant-42", "order-1")?;
    /// let out = guard
    ///     .run_async(&key, &Fingerprint::of(b"qty=1"), |claim| async move {
    ///         Ok::<_, std::io::Error>(Response::new(201, format!("token {}", claim.token())))
    ///     })
    ///     .await;
    /// assert!(matches!(out, Outcome::Executed(_)));
    /// # Ok(()) }
    /// ```
    pub async fn run_async<E, F, Fut>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        handler: F,
    ) -> Outcome<E>
    where
        F: FnOnce(Claim) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<Response, E>>,
    {
        self.run_async_with(key, fingerprint, |_| false, handler)
            .await
    }

    /// [`run_async`](Guard::run_async), where `release(&err)` releases the
    /// claim for chosen handler errors whatever the [`OnHandlerError`]
    /// policy (the HTTP layer uses it for responses it must not store).
    pub(crate) async fn run_async_with<E, F, Fut>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        release: impl Fn(&E) -> bool,
        handler: F,
    ) -> Outcome<E>
    where
        F: FnOnce(Claim) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<Response, E>>,
    {
        let deadline = self.wait_deadline();
        // One store call per turn, as in `run`.
        loop {
            let mut entry = self.enter(key);
            let (store, k, fp) = (Arc::clone(&self.store), key.clone(), *fingerprint);
            let (now, lease, retention) = (self.clock.now(), self.lease, self.retention);
            let begun = blocking(move || store.begin(&k, &fp, now, lease, retention)).await;
            match self.classify(begun, entry.as_mut()) {
                Start::Answer(outcome) => return outcome,
                Start::Wait { lease_until } => {
                    let waited = match &entry {
                        Some(entry) => wait_async(entry, deadline).await,
                        None => Waited::InFlight,
                    };
                    match self.after_wait(waited, lease_until) {
                        Some(outcome) => return outcome,
                        None => continue,
                    }
                }
                Start::FailOpen => {
                    return Outcome::FailedOpen(handler(Claim::unprotected()).await);
                }
                Start::Execute(claim) => {
                    let result = handler(claim.clone()).await;
                    let (store, k) = (Arc::clone(&self.store), key.clone());
                    let written = match self.settle(&result, &release) {
                        Settle::Complete(response) => {
                            // The blocking pool needs its own copy.
                            let (response, now) = (response.clone(), self.clock.now());
                            blocking(move || store.complete(&k, &claim, &response, now, retention))
                                .await
                        }
                        Settle::Release => blocking(move || store.release(&k, &claim)).await,
                        Settle::Keep => Ok(()),
                    };
                    return self.conclude(result, written, entry.as_mut());
                }
            }
        }
    }
}

/// Waits for the flight's answer without blocking a runtime worker.
#[cfg(feature = "tokio")]
async fn wait_async(entry: &Entered, deadline: Instant) -> Waited {
    let answer = std::future::poll_fn(|cx| entry.poll_answer(cx));
    tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), answer)
        .await
        .unwrap_or(Waited::InFlight)
}

#[cfg(feature = "tokio")]
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(join) => Err(Error::backend(format!("store call did not finish: {join}"))),
    }
}
