//! The [`Store`] trait: the contract every backend honours.

use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::{Begin, Claim, Record};
use crate::response::Response;
use crate::step::Step;
use crate::time::{Clock, SystemClock, Timestamp};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// Most records one [`Store::sweep_expired`] call may be asked to delete.
/// Larger requests are clamped, so one sweep never holds a commit group for long.
pub const MAX_SWEEP_BATCH: usize = 10_000;

/// The answer of a store's native async entry ([`Store::begin_async`],
/// [`Store::complete_async`], [`Store::release_async`]): a boxed future that
/// may borrow the store and the call's arguments (`'a`) and may be sent to
/// another thread.
///
/// It is runtime-agnostic: whoever fills it in wakes it through the
/// [`Waker`](std::task::Waker) it was polled with, so it runs on tokio,
/// async-std or a hand-written executor alike.
///
/// ```
/// use idemstore::logic::StoreFuture;
/// use idemstore::{Begin, Fingerprint, Key, MemoryStore, Store, Timestamp};
/// use std::time::Duration;
///
/// let store = MemoryStore::new();
/// let (key, fp, d) = (Key::new("", "k")?, Fingerprint::of(b""), Duration::from_secs(5));
/// // It borrows `store`, `key` and `fp`: the store outlives every future of its own.
/// let future: StoreFuture<'_, Begin> = store
///     .begin_async(&key, &fp, Timestamp::EPOCH, d, d)
///     .expect("MemoryStore answers natively");
/// # let _ = future;
/// # Ok::<(), idemstore::Error>(())
/// ```
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// A durable idempotency store.
///
/// Synchronous, `Send + Sync`, shared between threads by reference or `Arc`.
/// Every backend ([`MemoryStore`](crate::MemoryStore), `RedbStore`,
/// `SledStore`, `PostgresStore`) passes the same conformance suite; the
/// contract is in the method docs below. Callers pass `now`: the operations
/// never read a clock, so tests are deterministic. A store is built with the
/// [`Clock`] its own background work reads (recovery at open, the sweeper),
/// and [`Store::clock`] hands it out, so a [`Guard`](crate::Guard) or an
/// `Inbox` over the store reads the same time unless told otherwise.
///
/// Durations are taken in whole milliseconds. `lease` must be at least 1 ms
/// and `retention` at least `lease`, or the call is
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) before any I/O.
///
/// # Native async
///
/// The writes have an optional async entry: [`begin_async`](Store::begin_async),
/// [`complete_async`](Store::complete_async) and
/// [`release_async`](Store::release_async). Each returns `None` by default,
/// meaning "no native async here": an async caller such as
/// [`Guard::run_async`](crate::Guard) then runs the blocking method on a
/// blocking thread (tokio's `spawn_blocking`). A store that can answer
/// without a thread per waiting caller returns `Some(future)`:
/// [`MemoryStore`](crate::MemoryStore) answers at once, `RedbStore` joins
/// its commit line and is woken when its group is durable. A store written
/// outside this crate needs none of this to work with the async guard.
///
/// The contract of the async entry is the blocking method's (same answers,
/// same durability when the future completes), plus **cancellation**: a
/// future dropped before it completes leaves no claim its caller cannot
/// see and no half-applied write (a claim made while its future was being
/// dropped may be released just after the drop, so a retry may see it for
/// that long; a future that does its work on its first
/// poll and answers in that same poll, as `MemoryStore`'s does, has no
/// window to be dropped in). A dropped `begin_async` whose request
/// would claim (or did claim) the key must not leave the key claimed: the
/// claim is released (or never made). A dropped `complete_async` or
/// `release_async` writes everything or nothing; the caller does not learn
/// which, and finds out with [`get`](Store::get).
///
/// ```
/// use idemstore::{Begin, Fingerprint, Key, MemoryStore, Response, Store, Timestamp};
/// use std::time::Duration;
///
/// let store = MemoryStore::new();
/// let key = Key::new("tenant-42", "order-1")?;
/// let fp = Fingerprint::of(b"sku=A&qty=1");
/// let (lease, retention) = (Duration::from_secs(30), Duration::from_secs(24 * 3600));
/// let now = Timestamp::from_millis(1_700_000_000_000);
///
/// match store.begin(&key, &fp, now, lease, retention)? {
///     Begin::Claimed(claim) => {
///         let response = Response::new(201, "charged");   // execute the side effect here
///         store.complete(&key, &claim, &response, now, retention)?;
///     }
///     other => unreachable!("first request: {other:?}"),
/// }
/// // A retry gets the first result back.
/// assert_eq!(store.begin(&key, &fp, now, lease, retention)?, Begin::Replay(Response::new(201, "charged")));
/// // The same key with other parameters is not a retry.
/// assert_eq!(store.begin(&key, &Fingerprint::of(b"sku=A&qty=2"), now, lease, retention)?, Begin::Conflict);
/// # Ok::<(), idemstore::Error>(())
/// ```
pub trait Store: Send + Sync {
    /// Claims `key` or says why not, in one atomic step.
    ///
    /// | stored record | answer | effect |
    /// |---|---|---|
    /// | none, or expired (`now >= expires_at`) | `Claimed` | new PROCESSING record: lease `now + lease`, expiry `now + retention`, new token |
    /// | fingerprint differs | `Conflict` | none |
    /// | DONE | `Replay(response)` | none |
    /// | PROCESSING, `now < lease_until` | `InFlight { lease_until }` | none |
    /// | PROCESSING, `now >= lease_until` | `Claimed` (takeover) | lease renewed, new token, expiry kept (never earlier than the new lease) |
    ///
    /// **Atomicity:** concurrent `begin`s on one key are serialised; at most
    /// one of them is `Claimed` per lease. **Durability:** `Claimed` is
    /// returned only after the new record is durable at the store's
    /// configured durability level. **Visibility:** answers reflect every
    /// write acknowledged before the call began.
    fn begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin>;

    /// Stores `response` as the final answer for `key`: the record becomes
    /// DONE, its lease is cleared and its expiry moves to `now + retention`.
    ///
    /// Only the current owner may complete: if the claim's token is not the
    /// record's (a takeover happened), the key was released, or the record
    /// expired, this is [`Error::StaleClaim`](crate::Error::StaleClaim) and
    /// nothing changes. A response over the limits is
    /// [`Error::ResponseTooLarge`](crate::Error::ResponseTooLarge), also
    /// before any write. Returns after the DONE record is durable.
    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()>;

    /// Gives the claim up: the record is deleted, so a retry may claim the
    /// key at once (as a fresh claim, not a takeover). A stale claim is
    /// [`Error::StaleClaim`](crate::Error::StaleClaim). Durable on return.
    ///
    /// A record with [steps](Store::record_step) is kept instead, PROCESSING
    /// with its lease over: the next `begin` with the same fingerprint
    /// claims it at once (not as a takeover) and starts with those steps,
    /// and another fingerprint is a `Conflict`; the steps stand for side
    /// effects that happened.
    fn release(&self, key: &Key, claim: &Claim) -> Result<()>;

    /// Extends the claim's lease to `now + lease` (never shortening it) and
    /// returns the claim with its new [`lease_until`](Claim::lease_until);
    /// the record's expiry moves too if the lease would outlive it. The
    /// token does not change. A long handler's owner calls it before its
    /// lease ends (a [`Guard`](crate::Guard) does, in the background), so
    /// that no retry takes the key over while it still runs.
    ///
    /// Only the claim's own token renews, and only while the record is
    /// PROCESSING under it and not expired: after a takeover, a
    /// `complete`, a `release` or a sweep it is
    /// [`Error::StaleClaim`](crate::Error::StaleClaim) and nothing changes.
    /// A lease that ran out but was not taken over yet may be renewed. A
    /// `lease` under 1 ms is
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument). Durable
    /// on return, like `begin`'s claim; decided by
    /// [`logic::renew`](crate::logic::renew).
    ///
    /// ```
    /// use idemstore::{Begin, Fingerprint, Key, MemoryStore, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let store = MemoryStore::new();
    /// let (key, fp) = (Key::new("t", "export-7")?, Fingerprint::of(b"all"));
    /// let (lease, keep) = (Duration::from_secs(30), Duration::from_secs(3600));
    /// let t0 = Timestamp::from_millis(0);
    /// let Begin::Claimed(claim) = store.begin(&key, &fp, t0, lease, keep)? else { panic!() };
    /// // 20 s in, the work goes on: 30 s more from now.
    /// let renewed = store.renew(&key, &claim, t0 + Duration::from_secs(20), lease)?;
    /// assert_eq!(renewed.lease_until(), Timestamp::from_millis(50_000));
    /// // A retry at 40 s (past the first lease) still finds it in flight.
    /// let retry = store.begin(&key, &fp, t0 + Duration::from_secs(40), lease, keep)?;
    /// assert_eq!(retry, Begin::InFlight { lease_until: Timestamp::from_millis(50_000) });
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim>;

    /// Records `step` (a step's name and output) on the PROCESSING record
    /// `claim` owns, so that a later claim of the key starts with it
    /// ([`Claim::steps`]). Durable on return, like `begin`'s claim.
    ///
    /// Only the current owner records: after a takeover, a `complete`, a
    /// `release` or an expiry it is [`Error::StaleClaim`](crate::Error::StaleClaim)
    /// and nothing changes. Recording the same step again (same name and
    /// output) is `Ok` and writes nothing; a step of that name with another
    /// output is [`Error::InvalidArgument`](crate::Error::InvalidArgument);
    /// a record over [`MAX_STEPS`](crate::limits::MAX_STEPS) or
    /// [`MAX_STEPS_BYTES`](crate::limits::MAX_STEPS_BYTES) is
    /// [`Error::StepLimit`](crate::Error::StepLimit). Decided by
    /// [`logic::record_step`](crate::logic::record_step). A
    /// [`Guard`](crate::Guard)'s handler calls it through
    /// [`Claim::step`].
    ///
    /// ```
    /// use idemstore::{Begin, Error, Fingerprint, Key, MemoryStore, Step, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let store = MemoryStore::new();
    /// let (key, fp, d) = (Key::new("t", "order-1")?, Fingerprint::of(b"qty=1"), Duration::from_secs(30));
    /// let t0 = Timestamp::from_millis(0);
    /// let Begin::Claimed(claim) = store.begin(&key, &fp, t0, d, d * 10)? else { panic!() };
    /// store.record_step(&key, &claim, &Step::new("charge", b"ch_1".to_vec())?, t0)?;
    /// assert_eq!(store.get(&key, t0)?.expect("kept").steps()[0].output(), b"ch_1");
    /// // After a takeover the old owner can no longer record.
    /// let Begin::Claimed(_new) = store.begin(&key, &fp, t0 + d, d, d * 10)? else { panic!() };
    /// let late = store.record_step(&key, &claim, &Step::new("email", vec![])?, t0 + d);
    /// assert!(matches!(late, Err(Error::StaleClaim)));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()>;

    /// The record for `key` as of `now`; `None` when there is none or it
    /// has expired (expired records are invisible before any sweep).
    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>>;

    /// Deletes up to `max` records (clamped to [`MAX_SWEEP_BATCH`]) whose
    /// expiry is at or before `now`, oldest expiry first, and returns how
    /// many it deleted. Records and their expiry-index entries go together.
    /// A deterministic step: call it until it returns less than `max` to
    /// sweep everything.
    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize>;

    /// The clock this store was built with: the one its own background work
    /// reads (recovery at open, a sweeper), and the default clock of a
    /// [`Guard`](crate::Guard) or an `Inbox` over it, so that one time rules
    /// leases, recovery and expiry unless a caller chooses another on
    /// purpose. [`SystemClock`] unless the store's builder was given one; a
    /// store that wraps another answers the inner store's clock.
    ///
    /// ```
    /// use idemstore::{Clock, Guard, ManualClock, MemoryStore, Store, Timestamp};
    ///
    /// let clock = ManualClock::new(Timestamp::from_millis(1_000));
    /// let store = MemoryStore::with_clock(clock.clone());
    /// assert_eq!(store.clock().now(), Timestamp::from_millis(1_000));
    /// // A guard over the store reads the store's clock: no `.clock(..)` needed.
    /// let guard = Guard::new(store);
    /// clock.advance(std::time::Duration::from_secs(1));
    /// assert_eq!(guard.now(), Timestamp::from_millis(2_000));
    /// ```
    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(SystemClock)
    }

    /// Names this store object within the process: every
    /// [`Guard`](crate::Guard) over one store object shares its table of the
    /// runs in flight in this process, so that a retry never takes over a
    /// key whose owner still runs here, whatever the wall clock did
    /// (see [Clock steps](crate::Guard#clock-steps)).
    ///
    /// The default, the object's address, is right for every store. A
    /// wrapper that forwards every call to one inner store forwards this
    /// too (as `Arc<S>` does), so that guards over the wrapper and over the
    /// inner store share the table.
    ///
    /// ```
    /// use idemstore::{MemoryStore, Store};
    /// use std::sync::Arc;
    ///
    /// let store = Arc::new(MemoryStore::new());
    /// let shared = Arc::new(Arc::clone(&store));
    /// assert_eq!(shared.instance(), store.instance());
    /// assert_ne!(MemoryStore::new().instance(), store.instance());
    /// ```
    fn instance(&self) -> usize {
        std::ptr::from_ref(self).cast::<()>().addr()
    }

    /// [`begin`](Store::begin) as a future that blocks no thread, or `None`
    /// (the default) when this store has no native async entry and the
    /// caller should run `begin` on a blocking thread. See
    /// [Native async](Store#native-async) for the contract; a dropped future
    /// never leaves a claim behind.
    ///
    /// Checks that need no I/O (durations, a poisoned store) may fail
    /// before the future is made: the future then answers the error.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idemstore::Error> {
    /// use idemstore::{Begin, Fingerprint, Key, MemoryStore, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let store = MemoryStore::new();
    /// let (key, fp, d) = (Key::new("", "k")?, Fingerprint::of(b"x"), Duration::from_secs(5));
    /// let begun = match store.begin_async(&key, &fp, Timestamp::EPOCH, d, d) {
    ///     Some(native) => native.await?,
    ///     // What a caller does for a store without it (tokio shown).
    ///     None => store.begin(&key, &fp, Timestamp::EPOCH, d, d)?,
    /// };
    /// assert!(matches!(begun, Begin::Claimed(_)));
    /// # Ok(()) }
    /// ```
    fn begin_async<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Option<StoreFuture<'a, Begin>> {
        let _ = (key, fingerprint, now, lease, retention);
        None
    }

    /// [`complete`](Store::complete) as a future that blocks no thread, or
    /// `None` (the default): see [`begin_async`](Store::begin_async). A
    /// dropped future stores the response whole or not at all.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idemstore::Error> {
    /// use idemstore::{Begin, Fingerprint, Key, MemoryStore, Response, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let store = MemoryStore::new();
    /// let (key, fp, d, t) = (Key::new("", "k")?, Fingerprint::of(b"x"), Duration::from_secs(5), Timestamp::EPOCH);
    /// let Begin::Claimed(claim) = store.begin(&key, &fp, t, d, d)? else { unreachable!() };
    /// let response = Response::new(200, "ok");
    /// store.complete_async(&key, &claim, &response, t, d).expect("native").await?;
    /// assert!(matches!(store.begin(&key, &fp, t, d, d)?, Begin::Replay(_)));
    /// # Ok(()) }
    /// ```
    fn complete_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        response: &'a Response,
        now: Timestamp,
        retention: Duration,
    ) -> Option<StoreFuture<'a, ()>> {
        let _ = (key, claim, response, now, retention);
        None
    }

    /// [`release`](Store::release) as a future that blocks no thread, or
    /// `None` (the default): see [`begin_async`](Store::begin_async). A
    /// dropped future releases the claim or leaves it as it was.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idemstore::Error> {
    /// use idemstore::{Begin, Fingerprint, Key, MemoryStore, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let store = MemoryStore::new();
    /// let (key, fp, d, t) = (Key::new("", "k")?, Fingerprint::of(b"x"), Duration::from_secs(5), Timestamp::EPOCH);
    /// let Begin::Claimed(claim) = store.begin(&key, &fp, t, d, d)? else { unreachable!() };
    /// store.release_async(&key, &claim).expect("native").await?;
    /// assert!(store.get(&key, t)?.is_none());
    /// # Ok(()) }
    /// ```
    fn release_async<'a>(&'a self, key: &'a Key, claim: &'a Claim) -> Option<StoreFuture<'a, ()>> {
        let _ = (key, claim);
        None
    }

    /// [`record_step`](Store::record_step) as a future that blocks no
    /// thread, or `None` (the default): see [`begin_async`](Store::begin_async).
    /// A dropped future records the step whole or not at all.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idemstore::Error> {
    /// use idemstore::{Begin, Fingerprint, Key, MemoryStore, Step, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let store = MemoryStore::new();
    /// let (key, fp, d, t) = (Key::new("", "k")?, Fingerprint::of(b"x"), Duration::from_secs(5), Timestamp::EPOCH);
    /// let Begin::Claimed(claim) = store.begin(&key, &fp, t, d, d)? else { unreachable!() };
    /// let step = Step::new("charge", b"ch_1".to_vec())?;
    /// store.record_step_async(&key, &claim, &step, t).expect("native").await?;
    /// assert_eq!(store.get(&key, t)?.expect("kept").steps(), [step]);
    /// # Ok(()) }
    /// ```
    fn record_step_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        step: &'a Step,
        now: Timestamp,
    ) -> Option<StoreFuture<'a, ()>> {
        let _ = (key, claim, step, now);
        None
    }
}

/// A future that is already answered (an error found before any I/O).
#[cfg_attr(
    not(feature = "redb"),
    allow(dead_code, reason = "the redb backend answers early errors with it")
)]
pub(crate) fn ready<'a, T: Send + 'a>(answer: Result<T>) -> StoreFuture<'a, T> {
    Box::pin(std::future::ready(answer))
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        (**self).begin(key, fingerprint, now, lease, retention)
    }
    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        (**self).complete(key, claim, response, now, retention)
    }
    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        (**self).release(key, claim)
    }
    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
        (**self).renew(key, claim, now, lease)
    }
    fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()> {
        (**self).record_step(key, claim, step, now)
    }
    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        (**self).get(key, now)
    }
    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        (**self).sweep_expired(now, max)
    }
    fn clock(&self) -> Arc<dyn Clock> {
        (**self).clock()
    }
    fn instance(&self) -> usize {
        (**self).instance()
    }
    fn begin_async<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Option<StoreFuture<'a, Begin>> {
        (**self).begin_async(key, fingerprint, now, lease, retention)
    }
    fn complete_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        response: &'a Response,
        now: Timestamp,
        retention: Duration,
    ) -> Option<StoreFuture<'a, ()>> {
        (**self).complete_async(key, claim, response, now, retention)
    }
    fn release_async<'a>(&'a self, key: &'a Key, claim: &'a Claim) -> Option<StoreFuture<'a, ()>> {
        (**self).release_async(key, claim)
    }
    fn record_step_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        step: &'a Step,
        now: Timestamp,
    ) -> Option<StoreFuture<'a, ()>> {
        (**self).record_step_async(key, claim, step, now)
    }
}
