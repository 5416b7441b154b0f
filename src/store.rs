//! The [`Store`] trait: the contract every backend honours.

use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::{Begin, Claim, Record};
use crate::response::Response;
use crate::time::{Clock, SystemClock, Timestamp};
use std::sync::Arc;
use std::time::Duration;

/// Most records one [`Store::sweep_expired`] call may be asked to delete.
/// Larger requests are clamped, so one sweep never holds a commit group for long.
pub const MAX_SWEEP_BATCH: usize = 10_000;

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
    fn release(&self, key: &Key, claim: &Claim) -> Result<()>;

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
    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        (**self).get(key, now)
    }
    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        (**self).sweep_expired(now, max)
    }
    fn clock(&self) -> Arc<dyn Clock> {
        (**self).clock()
    }
}
