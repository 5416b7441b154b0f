//! [`MemoryStore`]: the reference implementation, in memory.

use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, Record, check_durations};
use crate::response::{DEFAULT_MAX_BODY_BYTES, Response, check_body_limit};
use crate::step::Step;
use crate::store::{MAX_SWEEP_BATCH, Store, StoreFuture};
use crate::time::{Clock, SystemClock, Timestamp};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The reference [`Store`]: every record in a `HashMap` and an expiry index
/// in a `BTreeSet`, behind one mutex.
///
/// Nothing survives the process: use it in tests, or where duplicates only
/// matter within one process's life. It is the model the durable backends
/// are checked against, so it is written as plainly as the contract.
///
/// ```
/// use idemstore::{Begin, Fingerprint, Key, MemoryStore, Store, Timestamp};
/// use std::time::Duration;
///
/// let store = MemoryStore::new();
/// let key = Key::new("", "msg-1")?;
/// let fp = Fingerprint::of(b"payload");
/// let t = Timestamp::from_millis(0);
/// let d = Duration::from_secs(5);
/// assert!(matches!(store.begin(&key, &fp, t, d, d)?, Begin::Claimed(_)));
/// assert!(matches!(store.begin(&key, &fp, t, d, d)?, Begin::InFlight { .. }));
/// assert_eq!(store.len(), 1);
/// # Ok::<(), idemstore::Error>(())
/// ```
pub struct MemoryStore {
    inner: Mutex<Inner>,
    max_body_bytes: usize,
    /// Never read by the store itself: handed out by [`Store::clock`].
    clock: Arc<dyn Clock>,
}

/// The records and their expiry index, behind the store's mutex. Every
/// record has exactly one index entry, `(its expires_at, its key)`: `put`
/// and `remove` are the only writers of either.
#[derive(Default)]
struct Inner {
    records: HashMap<Key, Record>,
    /// Ordered as every backend sweeps: oldest expiry first, then by key.
    expiry: BTreeSet<(Timestamp, Key)>,
    last_token: u64,
}

impl Inner {
    fn put(&mut self, key: &Key, record: Record) {
        let new_at = record.expires_at;
        let old_at = match self.records.get_mut(key) {
            Some(slot) => Some(std::mem::replace(slot, record).expires_at),
            None => {
                self.records.insert(key.clone(), record);
                None
            }
        };
        if old_at != Some(new_at) {
            if let Some(old_at) = old_at {
                self.expiry.remove(&(old_at, key.clone()));
            }
            self.expiry.insert((new_at, key.clone()));
        }
    }

    fn remove(&mut self, key: &Key) {
        if let Some(old) = self.records.remove(key) {
            self.expiry.remove(&(old.expires_at, key.clone()));
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .field("max_body_bytes", &self.max_body_bytes)
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// An empty store with the default response body limit.
    ///
    /// ```
    /// assert!(idemstore::MemoryStore::new().is_empty());
    /// ```
    pub fn new() -> MemoryStore {
        MemoryStore {
            inner: Mutex::new(Inner::default()),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            clock: Arc::new(SystemClock),
        }
    }

    /// An empty store built with `clock`: [`Store::clock`] answers it, so a
    /// [`Guard`](crate::Guard) over the store reads it too (tests drive
    /// leases and expiry with a `ManualClock`, feature `test-util`, this
    /// way). The store's operations still take `now` from their caller.
    ///
    /// ```
    /// use idemstore::{Clock, ManualClock, MemoryStore, Store, Timestamp};
    ///
    /// let clock = ManualClock::new(Timestamp::from_millis(5));
    /// let store = MemoryStore::with_clock(clock.clone());
    /// clock.advance(std::time::Duration::from_millis(10));
    /// assert_eq!(store.clock().now(), Timestamp::from_millis(15));
    /// ```
    pub fn with_clock(clock: impl Clock + 'static) -> MemoryStore {
        MemoryStore {
            clock: Arc::new(clock),
            ..MemoryStore::new()
        }
    }

    /// An empty store whose response bodies may be up to `max_body_bytes`
    /// (at most [`MAX_BODY_BYTES_HARD_CAP`](crate::limits::MAX_BODY_BYTES_HARD_CAP)).
    ///
    /// ```
    /// use idemstore::MemoryStore;
    /// use idemstore::limits::MAX_BODY_BYTES_HARD_CAP;
    /// assert!(MemoryStore::with_max_body_bytes(4096).is_ok());
    /// assert!(MemoryStore::with_max_body_bytes(MAX_BODY_BYTES_HARD_CAP + 1).is_err());
    /// ```
    pub fn with_max_body_bytes(max_body_bytes: usize) -> Result<MemoryStore> {
        Ok(MemoryStore {
            max_body_bytes: check_body_limit(max_body_bytes)?,
            ..MemoryStore::new()
        })
    }

    /// Records held, expired ones included until swept.
    ///
    /// ```
    /// assert_eq!(idemstore::MemoryStore::new().len(), 0);
    /// ```
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    /// True when no record is held.
    ///
    /// ```
    /// assert!(idemstore::MemoryStore::new().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every mutation is applied whole or not at all (`put` and `remove`
        // have no early return between their paired writes), so a panic
        // elsewhere while the lock was held cannot leave a half-written
        // state: recover the guard.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Store for MemoryStore {
    fn begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        check_durations(lease, retention)?;
        let mut inner = self.lock();
        let (last, existing) = (inner.last_token, inner.records.get(key).cloned());
        let next = || logic::next_token(last);
        let step = logic::begin(existing, fingerprint, now, lease, retention, next)?;
        if let Some(record) = step.write {
            inner.last_token = record.token;
            inner.put(key, record);
        }
        Ok(step.answer)
    }

    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        logic::check_response(response, self.max_body_bytes)?;
        let mut inner = self.lock();
        let existing = inner.records.get(key).cloned();
        let record = logic::complete(existing, claim, response, now, retention)?;
        inner.put(key, record);
        Ok(())
    }

    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        let mut inner = self.lock();
        match logic::release(inner.records.get(key).cloned(), claim)? {
            Some(kept) => inner.put(key, kept),
            None => inner.remove(key),
        }
        Ok(())
    }

    fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()> {
        let mut inner = self.lock();
        if let Some(record) = logic::record_step(inner.records.get(key).cloned(), claim, step, now)?
        {
            inner.put(key, record);
        }
        Ok(())
    }

    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
        let mut inner = self.lock();
        let step = logic::renew(inner.records.get(key).cloned(), claim, now, lease)?;
        inner.put(key, step.write);
        Ok(step.claim)
    }

    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        let inner = self.lock();
        Ok(logic::visible(inner.records.get(key).cloned(), now))
    }

    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        let mut inner = self.lock();
        let due: Vec<Key> = inner
            .expiry
            .iter()
            .take_while(|(expires_at, _)| logic::sweepable(*expires_at, now))
            .take(max.min(MAX_SWEEP_BATCH))
            .map(|(_, key)| key.clone())
            .collect();
        for key in &due {
            inner.remove(key);
        }
        crate::observability::swept("memory", due.len());
        Ok(due.len())
    }

    fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.clock)
    }

    // The async entry answers inline: every call is a short critical
    // section in memory. The work happens on the first poll and answers in
    // it, so a future dropped unpolled did nothing and one that was polled
    // has answered: there is no window for a claim nobody sees.
    fn begin_async<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Option<StoreFuture<'a, Begin>> {
        Some(Box::pin(async move {
            self.begin(key, fingerprint, now, lease, retention)
        }))
    }

    fn complete_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        response: &'a Response,
        now: Timestamp,
        retention: Duration,
    ) -> Option<StoreFuture<'a, ()>> {
        Some(Box::pin(async move {
            self.complete(key, claim, response, now, retention)
        }))
    }

    fn release_async<'a>(&'a self, key: &'a Key, claim: &'a Claim) -> Option<StoreFuture<'a, ()>> {
        Some(Box::pin(async move { self.release(key, claim) }))
    }

    fn record_step_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        step: &'a Step,
        now: Timestamp,
    ) -> Option<StoreFuture<'a, ()>> {
        Some(Box::pin(
            async move { self.record_step(key, claim, step, now) },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::State;
    use crate::time::ManualClock;

    /// The clock given is the one handed out (found by mutation testing:
    /// the constructor's field could go unnoticed outside the doc tests).
    #[test]
    fn with_clock_hands_out_its_clock() {
        let clock = ManualClock::new(Timestamp::from_millis(5));
        let store = MemoryStore::with_clock(clock.clone());
        clock.advance(Duration::from_millis(10));
        assert_eq!(store.clock().now(), Timestamp::from_millis(15));
    }

    /// A key, a fingerprint, an instant and a lease (and retention).
    fn parts() -> (Key, Fingerprint, Timestamp, Duration) {
        (
            Key::new("t", "k").unwrap(),
            Fingerprint::of(b"x"),
            Timestamp::from_millis(0),
            Duration::from_secs(60),
        )
    }

    /// Every record has one index entry, under its own expiry, and the
    /// sweep takes them oldest first and, within one expiry, by key (the
    /// model's order, which every backend's sweep must match).
    #[test]
    fn the_index_follows_each_record_and_the_sweep_takes_ties_by_key() {
        let store = MemoryStore::new();
        let (_, fp, t0, d) = parts();
        let short = Duration::from_millis(10);
        let [a, b, c] = ["a", "b", "c"].map(|id| Key::new("t", id).unwrap());
        // c then b claimed with a short retention (same expiry), a with a long one.
        for key in [&c, &b] {
            assert!(matches!(
                store.begin(key, &fp, t0, short, short),
                Ok(Begin::Claimed(_))
            ));
        }
        let Ok(Begin::Claimed(claim)) = store.begin(&a, &fp, t0, short, short) else {
            panic!("a claim");
        };
        // Completing a moves its index entry to its new expiry.
        store
            .complete(&a, &claim, &Response::new(200, "ok"), t0, d)
            .unwrap();
        {
            let inner = store.lock();
            let index: Vec<_> = inner.expiry.iter().cloned().collect();
            let expected_short = t0 + short;
            assert_eq!(
                index,
                [
                    (expected_short, b.clone()),
                    (expected_short, c.clone()),
                    (t0 + d, a.clone())
                ]
            );
            assert_eq!(inner.records.len(), 3);
        }
        let later = t0 + Duration::from_secs(1);
        assert_eq!(store.sweep_expired(later, 1).unwrap(), 1);
        assert!(!store.lock().records.contains_key(&b), "b before c");
        assert_eq!(store.sweep_expired(later, 10).unwrap(), 1);
        assert!(!store.lock().records.contains_key(&c));
        assert_eq!(store.len(), 1);
        assert_eq!(store.lock().expiry.len(), 1);
    }

    /// The async entries answer on their first poll, without a blocking
    /// thread (`None` would send every call to tokio's blocking pool).
    #[test]
    fn the_async_entries_answer_on_their_first_poll() {
        use std::task::{Context, Poll, Waker};
        let store = MemoryStore::new();
        let (key, fp, now, d) = parts();
        let mut cx = Context::from_waker(Waker::noop());
        let mut begin = store.begin_async(&key, &fp, now, d, d).expect("native");
        let Poll::Ready(Ok(Begin::Claimed(claim))) = begin.as_mut().poll(&mut cx) else {
            panic!("a claim at the first poll");
        };
        let other = Key::new("t", "other").unwrap();
        let Begin::Claimed(other_claim) = store.begin(&other, &fp, now, d, d).unwrap() else {
            panic!("a claim");
        };
        let response = Response::new(201, *b"ok");
        let mut complete = store
            .complete_async(&key, &claim, &response, now, d)
            .expect("native");
        assert!(matches!(
            complete.as_mut().poll(&mut cx),
            Poll::Ready(Ok(()))
        ));
        let mut release = store.release_async(&other, &other_claim).expect("native");
        assert!(matches!(
            release.as_mut().poll(&mut cx),
            Poll::Ready(Ok(()))
        ));
        assert_eq!(store.len(), 1);
        assert!(!store.is_empty());
        store.release(&key, &claim).unwrap_err();
        assert!(matches!(store.get(&key, now), Ok(Some(r)) if r.state() == State::Done));
    }

    #[test]
    fn len_counts_records_and_is_empty_says_none() {
        let store = MemoryStore::new();
        assert!(store.is_empty());
        assert_eq!(store.len(), 0);
        let (now, d) = (Timestamp::from_millis(0), Duration::from_secs(60));
        for id in ["a", "b"] {
            let key = Key::new("t", id).unwrap();
            let begun = store.begin(&key, &Fingerprint::of(b"x"), now, d, d);
            assert!(matches!(begun, Ok(Begin::Claimed(_))), "{begun:?}");
        }
        assert_eq!(store.len(), 2);
        assert!(!store.is_empty());
        let printed = format!("{store:?}");
        assert!(
            printed.starts_with("MemoryStore { records: 2,"),
            "{printed}"
        );
    }

    /// The body limit given is the one `complete` checks.
    #[test]
    fn with_max_body_bytes_bounds_what_complete_stores() {
        let store = MemoryStore::with_max_body_bytes(8).unwrap();
        let (key, now, d) = (
            Key::new("t", "k").unwrap(),
            Timestamp::from_millis(0),
            Duration::from_secs(60),
        );
        let Begin::Claimed(claim) = store
            .begin(&key, &Fingerprint::of(b"x"), now, d, d)
            .unwrap()
        else {
            panic!("a claim");
        };
        let large = store.complete(&key, &claim, &Response::new(201, [0u8; 9]), now, d);
        assert!(large.is_err(), "{large:?}");
        let fits = store.complete(&key, &claim, &Response::new(201, [0u8; 8]), now, d);
        assert!(fits.is_ok(), "{fits:?}");
    }
}
