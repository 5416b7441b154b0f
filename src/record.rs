//! [`Record`], [`State`], [`Claim`] and [`Begin`]: what a store keeps and answers.

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::response::Response;
use crate::step::Step;
use crate::time::Timestamp;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The stored state of a key. CONFLICT is an answer ([`Begin::Conflict`]),
/// never a stored state.
///
/// ```
/// use idemstore::State;
/// assert_eq!(State::Processing.to_string(), "PROCESSING");
/// assert_eq!(State::Done.to_string(), "DONE");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// An owner holds a lease and is executing.
    Processing,
    /// Terminal: the response is stored and replayed to every retry.
    Done,
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            State::Processing => "PROCESSING",
            State::Done => "DONE",
        })
    }
}

/// One key's record, as [`Store::get`](crate::Store::get) returns it.
///
/// Invariants (checked before every write and after every read; a stored
/// record that breaks them is [`Error::Corrupt`]):
/// PROCESSING has a lease and no response; DONE has a response, no lease
/// and no steps; the token is non-zero; `attempts >= 1`; steps have unique
/// names and are within their [limits](crate::limits).
///
/// ```
/// use idemstore::{Begin, Fingerprint, Key, MemoryStore, State, Store, Timestamp};
/// use std::time::Duration;
///
/// let store = MemoryStore::new();
/// let key = Key::new("t", "order-1")?;
/// let now = Timestamp::from_millis(1_000);
/// store.begin(&key, &Fingerprint::of(b"x"), now, Duration::from_secs(30), Duration::from_secs(3600))?;
/// let rec = store.get(&key, now)?.expect("claimed");
/// assert_eq!(rec.state(), State::Processing);
/// assert_eq!(rec.lease_until(), Some(now + Duration::from_secs(30)));
/// assert_eq!(rec.expires_at(), now + Duration::from_secs(3600));
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) state: State,
    pub(crate) response: Option<Response>,
    pub(crate) lease_until: Option<Timestamp>,
    pub(crate) expires_at: Timestamp,
    pub(crate) created_at: Timestamp,
    pub(crate) token: u64,
    pub(crate) attempts: u32,
    /// Recorded steps, in the order they were recorded (PROCESSING only).
    pub(crate) steps: Vec<Step>,
}

impl Record {
    /// The fingerprint of the request that created the record.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }
    /// PROCESSING or DONE.
    pub fn state(&self) -> State {
        self.state
    }
    /// The stored response (DONE only).
    pub fn response(&self) -> Option<&Response> {
        self.response.as_ref()
    }
    /// When the owner's lease ends (PROCESSING only).
    pub fn lease_until(&self) -> Option<Timestamp> {
        self.lease_until
    }
    /// When the record stops being recognised; from then on it is invisible
    /// and the key can be claimed anew.
    pub fn expires_at(&self) -> Timestamp {
        self.expires_at
    }
    /// When the key was first claimed (this record's life).
    pub fn created_at(&self) -> Timestamp {
        self.created_at
    }
    /// The fencing token of the latest claim.
    pub fn token(&self) -> u64 {
        self.token
    }
    /// How many claims this record has had (1 + takeovers and claims
    /// after a release that kept steps).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
    /// The steps recorded under this record, in the order they were
    /// recorded (PROCESSING only: a DONE record has none).
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }
    /// True when `now` is at or past the expiry.
    ///
    /// ```
    /// # use idemstore::{Fingerprint, Key, MemoryStore, Store, Timestamp};
    /// # use std::time::Duration;
    /// # let store = MemoryStore::new();
    /// # let key = Key::new("t", "k")?;
    /// # let now = Timestamp::from_millis(0);
    /// # store.begin(&key, &Fingerprint::of(b"x"), now, Duration::from_secs(1), Duration::from_secs(10))?;
    /// let rec = store.get(&key, now)?.unwrap();
    /// assert!(!rec.is_expired(Timestamp::from_millis(9_999)));
    /// assert!(rec.is_expired(Timestamp::from_millis(10_000)));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn is_expired(&self, now: Timestamp) -> bool {
        now >= self.expires_at
    }

    /// Checks the invariants listed on [`Record`].
    pub(crate) fn check(&self) -> std::result::Result<(), &'static str> {
        if self.token == 0 {
            return Err("fencing token is zero");
        }
        if self.attempts == 0 {
            return Err("attempt count is zero");
        }
        if crate::step::check_all(&self.steps).is_err() {
            return Err("steps over their limits or named twice");
        }
        if self.state == State::Done && !self.steps.is_empty() {
            return Err("DONE record must have no steps");
        }
        match (self.state, &self.response, self.lease_until) {
            (State::Processing, None, Some(_)) | (State::Done, Some(_), None) => Ok(()),
            (State::Processing, _, _) => Err("PROCESSING record must have a lease and no response"),
            (State::Done, _, _) => Err("DONE record must have a response and no lease"),
        }
    }
}

/// Proof of ownership of a key, handed out by [`Begin::Claimed`].
///
/// Only the holder of the current claim can [`complete`](crate::Store::complete)
/// or [`release`](crate::Store::release) the key. The fencing
/// [`token`](Claim::token) increases monotonically for the life of the store
/// (across restarts too), so downstream systems can use it as their own
/// idempotency key or to reject writes from a stale owner.
///
/// ```
/// use idemstore::{Begin, Fingerprint, Key, MemoryStore, Store, Timestamp};
/// use std::time::Duration;
///
/// let store = MemoryStore::new();
/// let key = Key::new("t", "k")?;
/// let fp = Fingerprint::of(b"x");
/// let (lease, keep) = (Duration::from_secs(1), Duration::from_secs(60));
/// let t0 = Timestamp::from_millis(0);
/// let Begin::Claimed(first) = store.begin(&key, &fp, t0, lease, keep)? else { panic!() };
/// assert!(!first.is_takeover());
/// // The lease runs out: the next begin takes over with a higher token.
/// let Begin::Claimed(second) = store.begin(&key, &fp, t0 + lease, lease, keep)? else { panic!() };
/// assert!(second.is_takeover());
/// assert!(second.token() > first.token());
/// assert_eq!(second.attempt(), 2);
/// # Ok::<(), idemstore::Error>(())
/// ```
///
/// Two claims are equal when their token, lease, takeover flag, attempt and
/// steps are: what a guard's run added (renewals, steps recorded since) is
/// not compared.
#[derive(Clone)]
pub struct Claim {
    pub(crate) token: u64,
    pub(crate) lease_until: Timestamp,
    pub(crate) takeover: bool,
    pub(crate) attempt: u32,
    /// The steps recorded by earlier attempts when this claim was made.
    pub(crate) steps: Vec<Step>,
    /// The guard's run this claim belongs to (its steps are recorded
    /// through it); `None` for a claim from [`Store::begin`](crate::Store::begin).
    pub(crate) run: Option<Arc<crate::guard::StepRun>>,
    /// What a guard's renewals of this claim's lease learned; `None`
    /// outside a run with renewal on (a claim from [`Store::begin`](crate::Store::begin)).
    pub(crate) renewal: Option<Arc<Renewal>>,
}

/// The lease of a claim being renewed in the background (a guard's run):
/// the latest lease end a renewal stored, and whether a renewal found the
/// claim taken over. Written by the renewer, read by the handler.
#[derive(Debug)]
pub(crate) struct Renewal {
    lease_until_ms: AtomicU64,
    lost: AtomicBool,
}

impl Renewal {
    pub(crate) fn new(lease_until: Timestamp) -> Renewal {
        Renewal {
            lease_until_ms: AtomicU64::new(lease_until.as_millis()),
            lost: AtomicBool::new(false),
        }
    }
    /// A renewal stored the lease up to `lease_until`.
    pub(crate) fn renewed(&self, lease_until: Timestamp) {
        self.lease_until_ms
            .fetch_max(lease_until.as_millis(), Ordering::SeqCst);
    }
    /// A renewal found the claim taken over (or completed, released or
    /// expired): it is no longer this owner's.
    pub(crate) fn lose(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
    fn lease_until(&self) -> Timestamp {
        Timestamp::from_millis(self.lease_until_ms.load(Ordering::SeqCst))
    }
}

impl PartialEq for Claim {
    fn eq(&self, other: &Claim) -> bool {
        self.key_fields() == other.key_fields()
    }
}

impl Eq for Claim {}

impl std::hash::Hash for Claim {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key_fields().hash(state);
    }
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Claim");
        d.field("token", &self.token)
            .field("lease_until", &self.lease_until())
            .field("takeover", &self.takeover)
            .field("attempt", &self.attempt);
        if !self.steps.is_empty() {
            d.field("steps", &self.steps);
        }
        if self.lease_lost() {
            d.field("lease_lost", &true);
        }
        d.finish()
    }
}

impl Claim {
    /// A claim as a store hands it out (no renewal attached).
    pub(crate) fn new(token: u64, lease_until: Timestamp, takeover: bool, attempt: u32) -> Claim {
        Claim {
            token,
            lease_until,
            takeover,
            attempt,
            steps: Vec::new(),
            run: None,
            renewal: None,
        }
    }

    fn key_fields(&self) -> (u64, Timestamp, bool, u32, &[Step]) {
        (
            self.token,
            self.lease_until,
            self.takeover,
            self.attempt,
            &self.steps,
        )
    }

    /// The fencing token: unique in the store, and larger than every token
    /// handed out before it.
    pub fn token(&self) -> u64 {
        self.token
    }
    /// When this claim's lease ends: as handed out, or, while a
    /// [`Guard`](crate::Guard) renews it in the background, the end of the
    /// lease its latest renewal stored.
    pub fn lease_until(&self) -> Timestamp {
        match &self.renewal {
            Some(renewal) => renewal.lease_until().max(self.lease_until),
            None => self.lease_until,
        }
    }

    /// True when a renewal of this claim's lease (by the
    /// [`Guard`](crate::Guard) running the handler) found the claim no
    /// longer its own: another caller took the key over after the lease
    /// ran out, or the record was completed, released or expired. A handler
    /// that runs long checks it before it commits its side effect: the new
    /// owner is running the same intent. Always false for a claim no guard
    /// renews ([`GuardBuilder::renew_leases`](crate::guard::GuardBuilder::renew_leases)
    /// off, or a claim from [`Store::begin`](crate::Store::begin)).
    ///
    /// ```
    /// use idemstore::{Fingerprint, Guard, Key, MemoryStore, Response};
    ///
    /// let guard = Guard::new(MemoryStore::new());
    /// let key = Key::new("tenant-42", "export-7")?;
    /// let out = guard.run(&key, &Fingerprint::of(b"all"), |claim| {
    ///     // ... long work ...
    ///     if claim.lease_lost() {
    ///         return Err("taken over: not committing");
    ///     }
    ///     Ok(Response::new(200, "exported"))
    /// });
    /// assert!(out.ran_handler());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn lease_lost(&self) -> bool {
        self.renewal.as_ref().is_some_and(|r| r.is_lost())
    }
    /// True when this claim took over an expired lease of an earlier owner,
    /// whose side effects may or may not have happened.
    pub fn is_takeover(&self) -> bool {
        self.takeover
    }
    /// 1 for the first claim of the record, 2 after one takeover, ...
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
    /// The steps earlier attempts recorded under this key, as they were
    /// when this claim was made: what a takeover (or a claim after a
    /// release) need not do again. Under
    /// [`TakeoverPolicy::Reconcile`](crate::guard::TakeoverPolicy::Reconcile)
    /// they tell the new owner how far the last one got: every step listed
    /// finished, and the next one may have started.
    ///
    /// ```
    /// use idemstore::{Begin, Fingerprint, Key, MemoryStore, Step, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let store = MemoryStore::new();
    /// let (key, fp, d) = (Key::new("t", "k")?, Fingerprint::of(b"x"), Duration::from_secs(1));
    /// let t0 = Timestamp::from_millis(0);
    /// let Begin::Claimed(first) = store.begin(&key, &fp, t0, d, d * 60)? else { panic!() };
    /// store.record_step(&key, &first, &Step::new("charge", b"ch_1".to_vec())?, t0)?;
    /// // The owner dies; its lease runs out and a retry takes over.
    /// let Begin::Claimed(second) = store.begin(&key, &fp, t0 + d, d, d * 60)? else { panic!() };
    /// assert_eq!(second.steps(), [Step::new("charge", b"ch_1".to_vec())?]);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// True for the stand-in claim a fail-open guard hands its handler when
    /// the store is down: token 0, no protection, nothing to complete.
    ///
    /// ```
    /// # use idemstore::{Begin, Fingerprint, Key, MemoryStore, Store, Timestamp};
    /// # use std::time::Duration;
    /// # let store = MemoryStore::new();
    /// # let d = Duration::from_secs(1);
    /// let Begin::Claimed(claim) = store.begin(&Key::new("", "k")?, &Fingerprint::of(b""), Timestamp::EPOCH, d, d)?
    ///     else { panic!() };
    /// assert!(!claim.is_unprotected());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn is_unprotected(&self) -> bool {
        self.token == 0
    }

    pub(crate) fn unprotected() -> Claim {
        Claim::new(0, Timestamp::EPOCH, false, 0)
    }
}

/// The answer of [`Store::begin`](crate::Store::begin).
///
/// | stored record | answer |
/// |---|---|
/// | none, or expired | `Claimed` (new record, new token) |
/// | fingerprint differs | `Conflict` (record untouched) |
/// | DONE | `Replay(response)` |
/// | PROCESSING, lease live | `InFlight { lease_until }` |
/// | PROCESSING, lease expired | `Claimed` with [`Claim::is_takeover`] |
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "a Claimed answer must be completed or released"]
pub enum Begin {
    /// The caller owns the key and should execute.
    Claimed(Claim),
    /// The key is DONE with the same fingerprint: send this response again.
    Replay(Response),
    /// Another owner holds a live lease.
    InFlight {
        /// When that lease ends (a `Retry-After` hint).
        lease_until: Timestamp,
    },
    /// The key exists with a different fingerprint: not a retry.
    Conflict,
}

impl Begin {
    /// The claim, if this answer is `Claimed`.
    ///
    /// ```
    /// # use idemstore::{Fingerprint, Key, MemoryStore, Store, Timestamp};
    /// # use std::time::Duration;
    /// # let store = MemoryStore::new();
    /// let b = store.begin(&Key::new("", "k")?, &Fingerprint::of(b""), Timestamp::EPOCH,
    ///                     Duration::from_secs(1), Duration::from_secs(2))?;
    /// assert!(b.claim().is_some());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn claim(&self) -> Option<&Claim> {
        match self {
            Begin::Claimed(c) => Some(c),
            _ => None,
        }
    }
}

/// A lease of at least 1 ms (durations are taken in whole milliseconds),
/// else [`Error::InvalidArgument`]: `begin`'s and `renew`'s check.
pub(crate) fn check_lease(lease: std::time::Duration) -> Result<()> {
    if lease.as_millis() == 0 {
        return Err(Error::invalid_argument("lease must be at least 1 ms"));
    }
    Ok(())
}

/// Checks `lease` and `retention` as every store requires them: lease at
/// least 1 ms, retention at least the lease (a record must not vanish while
/// its owner still holds the lease).
pub(crate) fn check_durations(
    lease: std::time::Duration,
    retention: std::time::Duration,
) -> Result<()> {
    check_lease(lease)?;
    if retention < lease {
        return Err(Error::invalid_argument(format!(
            "retention ({retention:?}) must be at least the lease ({lease:?})"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, RandomState};

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    /// Claims are equal (and hash alike) by token, lease, takeover and
    /// attempt, each of which counts; what a guard's renewals learned does
    /// not. Debug shows the live lease and a lost lease.
    #[test]
    fn claims_compare_by_their_fields_not_their_renewal() {
        let hasher = RandomState::new();
        let a = Claim::new(7, at(100), false, 1);
        let mut renewed = a.clone();
        let cell = Arc::new(Renewal::new(at(100)));
        cell.renewed(at(500));
        cell.lose();
        renewed.renewal = Some(cell);
        assert_eq!(a, renewed);
        assert_eq!(hasher.hash_one(&a), hasher.hash_one(&renewed));
        for other in [
            Claim::new(8, at(100), false, 1),
            Claim::new(7, at(101), false, 1),
            Claim::new(7, at(100), true, 1),
            Claim::new(7, at(100), false, 2),
        ] {
            assert_ne!(a, other);
            assert_ne!(hasher.hash_one(&a), hasher.hash_one(&other), "{other:?}");
        }
        assert_eq!(
            format!("{a:?}"),
            format!(
                "Claim {{ token: 7, lease_until: {:?}, takeover: false, attempt: 1 }}",
                at(100)
            )
        );
        let shown = format!("{renewed:?}");
        assert!(
            shown.contains(&format!("lease_until: {:?}", at(500))),
            "{shown}"
        );
        assert!(shown.ends_with("lease_lost: true }"), "{shown}");
        assert!(renewed.lease_lost() && !a.lease_lost());
        assert_eq!((renewed.lease_until(), a.lease_until()), (at(500), at(100)));
        assert_eq!((a.token(), a.attempt(), a.is_takeover()), (7, 1, false));
        assert!(!a.is_unprotected() && Claim::unprotected().is_unprotected());
    }
}
