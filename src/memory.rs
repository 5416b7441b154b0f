//! [`MemoryStore`]: the reference implementation, in memory.

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, Record, check_durations};
use crate::response::{DEFAULT_MAX_BODY_BYTES, Response, check_body_limit};
use crate::store::{MAX_SWEEP_BATCH, Store, StoreFuture};
use crate::time::{Clock, SystemClock, Timestamp};
use hashbrown::HashTable;
use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// A store operation, as seen by a fault hook (feature `test-util`).
///
/// ```
/// assert_eq!(idemstore::Op::Complete.to_string(), "complete");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[cfg_attr(
    not(feature = "test-util"),
    allow(
        unreachable_pub,
        reason = "exported with test-util only; the fault check uses it in every build"
    )
)]
pub enum Op {
    /// [`Store::begin`].
    Begin,
    /// [`Store::complete`].
    Complete,
    /// [`Store::release`].
    Release,
    /// [`Store::renew`].
    Renew,
    /// [`Store::get`].
    Get,
    /// [`Store::sweep_expired`].
    Sweep,
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::Begin => "begin",
            Op::Complete => "complete",
            Op::Release => "release",
            Op::Renew => "renew",
            Op::Get => "get",
            Op::Sweep => "sweep",
        })
    }
}

#[cfg(feature = "test-util")]
type FaultHook = Box<dyn Fn(Op) -> Option<Error> + Send + Sync>;

/// The reference [`Store`]: every record in a hash table behind one mutex,
/// with a `BTreeMap` expiry index.
///
/// Nothing survives the process: use it in tests, or where duplicates only
/// matter within one process's life. It is the model the durable backends
/// are checked against, and it has a fault hook (feature `test-util`) that
/// fails chosen operations on demand.
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
    #[cfg(feature = "test-util")]
    fault: std::sync::RwLock<Option<FaultHook>>,
}

/// The records and their expiry index, behind the store's mutex.
///
/// The records live in a hash table whose slots keep their key's hash:
/// a table that grows (every fresh key, until the first records expire)
/// moves its slots without hashing a key again. Under load, hashing every
/// key again at each doubling (reading each key's bytes back in, a cache
/// miss per key) was a third of what inserting a fresh key cost
/// (docs/performance.md, "`MemoryStore`'s table keeps its keys' hashes").
#[derive(Default)]
struct Inner {
    records: HashTable<Slot>,
    /// The keys' hasher: SipHash with keys chosen at random per store, as
    /// `std`'s `HashMap` uses, since the keys come from clients.
    hasher: RandomState,
    /// The expiry index, by (expiry, fencing token), to the record's key
    /// hash: a record's token is unique in the store (`begin` is the only
    /// place one is minted, each one above the last), so the pair names one
    /// record, compares as two integers (many records share an expiry
    /// millisecond under load), and with the hash finds its slot without a
    /// copy of the key.
    index: BTreeMap<(Timestamp, u64), u64>,
    last_token: u64,
}

/// One record under its key, with the key's hash.
struct Slot {
    hash: u64,
    key: Key,
    record: Record,
}

impl Inner {
    fn hash(&self, key: &Key) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The record under `key`, whose hash is `hash`.
    fn get(&self, hash: u64, key: &Key) -> Option<&Record> {
        self.records
            .find(hash, |slot| slot.key == *key)
            .map(|slot| &slot.record)
    }

    /// Runs `decide` on the record under `key` (hash `hash`) and stores
    /// what it returns to write, if anything: a record found is looked up
    /// once and replaced in its slot, which keeps its key, and its index
    /// entry moves with it; a new key gets a slot. `decide` gets its own
    /// copy of the record (the `logic` functions take one); an error writes
    /// nothing. (hashbrown's `entry`, one probe for a new key too, measured
    /// slower on `store/memory/fill_200k` than a miss and an insert.)
    fn apply<T>(
        &mut self,
        hash: u64,
        key: &Key,
        decide: impl FnOnce(Option<Record>) -> Result<(Option<Record>, T)>,
    ) -> Result<T> {
        let Inner { records, index, .. } = self;
        if let Some(found) = records.find_mut(hash, |slot| slot.key == *key) {
            let (write, out) = decide(Some(found.record.clone()))?;
            if let Some(record) = write {
                let old = (found.record.expires_at, found.record.token);
                let new = (record.expires_at, record.token);
                found.record = record;
                if old != new {
                    index.remove(&old);
                    index.insert(new, hash);
                }
            }
            return Ok(out);
        }
        let (write, out) = decide(None)?;
        if let Some(record) = write {
            index.insert((record.expires_at, record.token), hash);
            let slot = Slot {
                hash,
                key: key.clone(),
                record,
            };
            records.insert_unique(hash, slot, |slot| slot.hash);
        }
        Ok(out)
    }

    /// Removes the record under `key` (hash `hash`), if any.
    fn remove(&mut self, hash: u64, key: &Key) {
        if let Ok(found) = self.records.find_entry(hash, |slot| slot.key == *key) {
            let (old, _) = found.remove();
            self.index
                .remove(&(old.record.expires_at, old.record.token));
        }
    }

    /// The key of the record indexed at `(expires_at, token)` with hash
    /// `hash`: the token names the record.
    fn indexed_key(&self, (expires_at, token): (Timestamp, u64), hash: u64) -> Option<&Key> {
        self.records
            .find(hash, |slot| {
                slot.record.token == token && slot.record.expires_at == expires_at
            })
            .map(|slot| &slot.key)
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
    pub fn new() -> MemoryStore {
        MemoryStore {
            inner: Mutex::new(Inner::default()),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            clock: Arc::new(SystemClock),
            #[cfg(feature = "test-util")]
            fault: std::sync::RwLock::new(None),
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

    /// Installs a fault hook (feature `test-util`): before each operation the
    /// hook is called with it, and an error it returns fails that operation
    /// with no effect, as a store whose database is down would.
    ///
    /// ```
    /// use idemstore::{Error, Fingerprint, Key, MemoryStore, Op, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let store = MemoryStore::new();
    /// store.set_fault(|op| (op == Op::Begin).then(|| Error::backend("connection refused")));
    /// let d = Duration::from_secs(1);
    /// let err = store.begin(&Key::new("", "k")?, &Fingerprint::of(b""), Timestamp::EPOCH, d, d);
    /// assert!(matches!(err, Err(Error::Backend(_))));
    /// store.clear_fault();
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    #[cfg(feature = "test-util")]
    pub fn set_fault(&self, hook: impl Fn(Op) -> Option<Error> + Send + Sync + 'static) {
        *self.fault.write().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(hook));
    }

    /// Removes the fault hook (feature `test-util`).
    #[cfg(feature = "test-util")]
    pub fn clear_fault(&self) {
        *self.fault.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn fault(&self, _op: Op) -> Result<()> {
        #[cfg(feature = "test-util")]
        if let Some(err) = self
            .fault
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|hook| hook(_op))
        {
            return Err(err);
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every mutation below is applied whole or not at all (no early
        // return between paired writes), so a panic elsewhere while the lock
        // was held cannot leave a half-written state: recover the guard.
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
        self.fault(Op::Begin)?;
        let mut inner = self.lock();
        let hash = inner.hash(key);
        let last = inner.last_token;
        let (answer, token) = inner.apply(hash, key, |existing| {
            let step = logic::begin(existing, fingerprint, now, lease, retention, || {
                last.checked_add(1)
                    .ok_or_else(|| Error::invalid_argument("fencing tokens exhausted"))
            })?;
            let token = step.write.as_ref().map(|record| record.token);
            Ok((step.write, (step.answer, token)))
        })?;
        if let Some(token) = token {
            inner.last_token = token;
        }
        Ok(answer)
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
        self.fault(Op::Complete)?;
        let mut inner = self.lock();
        let hash = inner.hash(key);
        inner.apply(hash, key, |existing| {
            let record = logic::complete(existing, claim, response, now, retention)?;
            Ok((Some(record), ()))
        })
    }

    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        self.fault(Op::Release)?;
        let mut inner = self.lock();
        let hash = inner.hash(key);
        logic::release(inner.get(hash, key).cloned(), claim)?;
        inner.remove(hash, key);
        Ok(())
    }

    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
        self.fault(Op::Renew)?;
        let mut inner = self.lock();
        let hash = inner.hash(key);
        inner.apply(hash, key, |existing| {
            let step = logic::renew(existing, claim, now, lease)?;
            Ok((Some(step.write), step.claim))
        })
    }

    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        self.fault(Op::Get)?;
        let inner = self.lock();
        let hash = inner.hash(key);
        Ok(logic::visible(inner.get(hash, key).cloned(), now))
    }

    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        self.fault(Op::Sweep)?;
        let max = max.min(MAX_SWEEP_BATCH);
        let mut inner = self.lock();
        // Oldest expiry first and, among records of one expiry, by key, as
        // every backend sweeps: the index orders ties by token, so the
        // last expiry taken is read whole and sorted before the cut.
        let mut due: Vec<(Timestamp, Key, u64)> = Vec::new();
        for (&(expires_at, token), &hash) in &inner.index {
            if !logic::sweepable(expires_at, now)
                || (due.len() >= max && due.last().is_some_and(|(at, ..)| *at != expires_at))
            {
                break;
            }
            let key = inner
                .indexed_key((expires_at, token), hash)
                .expect("every index entry names a stored record");
            due.push((expires_at, key.clone(), hash));
        }
        due.sort_unstable();
        due.truncate(max);
        for (_, key, hash) in &due {
            inner.remove(*hash, key);
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

    fn record(token: u64, expires_at: u64) -> Record {
        Record {
            fingerprint: Fingerprint::of(b"x"),
            state: State::Processing,
            response: None,
            lease_until: Some(Timestamp::from_millis(expires_at)),
            expires_at: Timestamp::from_millis(expires_at),
            created_at: Timestamp::from_millis(0),
            token,
            attempts: 1,
        }
    }

    /// Two keys whose hashes are equal stay apart: every lookup compares
    /// the key (or, from the expiry index, the token) of the slots under
    /// one hash. Equal 64-bit hashes are rare but not impossible, and
    /// `RandomState` cannot be made to produce them, so the slots are put
    /// in under one chosen hash.
    #[test]
    fn records_whose_key_hashes_collide_stay_apart() {
        let store = MemoryStore::new();
        let (a, b) = (Key::new("t", "a").unwrap(), Key::new("t", "b").unwrap());
        const HASH: u64 = 7;
        {
            let mut inner = store.lock();
            // Stores `record` under `key`; the token of the record found.
            let put = |inner: &mut Inner, key: &Key, record: Record| {
                inner
                    .apply(HASH, key, |seen| Ok((Some(record), seen.map(|r| r.token))))
                    .unwrap()
            };
            assert_eq!(put(&mut inner, &a, record(1, 100)), None);
            assert_eq!(put(&mut inner, &b, record(2, 100)), None);
            assert_eq!(inner.get(HASH, &a).map(|r| r.token), Some(1));
            assert_eq!(inner.get(HASH, &b).map(|r| r.token), Some(2));
            // In place: b's record moves in the index, a's does not.
            assert_eq!(put(&mut inner, &b, record(3, 50)), Some(2));
            assert_eq!(inner.get(HASH, &a).map(|r| r.token), Some(1));
            assert_eq!(inner.get(HASH, &b).map(|r| r.token), Some(3));
            assert_eq!(
                inner.indexed_key((Timestamp::from_millis(50), 3), HASH),
                Some(&b)
            );
            assert_eq!(
                inner.indexed_key((Timestamp::from_millis(100), 1), HASH),
                Some(&a)
            );
            assert_eq!(
                inner.indexed_key((Timestamp::from_millis(100), 3), HASH),
                None
            );
            assert_eq!(inner.index.len(), 2);
        }
        // The sweep takes b (expired at 50), through the index, and only b.
        assert_eq!(
            store.sweep_expired(Timestamp::from_millis(60), 10).unwrap(),
            1
        );
        let mut inner = store.lock();
        assert!(inner.get(HASH, &b).is_none());
        assert_eq!(inner.get(HASH, &a).map(|r| r.token), Some(1));
        inner.remove(HASH, &a);
        assert!(inner.get(HASH, &a).is_none());
        assert!(inner.index.is_empty());
        assert_eq!(inner.records.len(), 0);
    }

    /// The hash depends on the key, and only on it (found by mutation
    /// testing: a constant hash keeps every answer right, in one chain).
    #[test]
    fn keys_hash_apart_and_each_key_always_alike() {
        let inner = MemoryStore::new();
        let inner = inner.lock();
        let (a, b) = (Key::new("t", "a").unwrap(), Key::new("t", "b").unwrap());
        assert_eq!(inner.hash(&a), inner.hash(&a.clone()));
        assert_ne!(inner.hash(&a), inner.hash(&b));
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

    #[test]
    fn ops_print_as_the_store_methods_they_name() {
        let names: Vec<String> = [
            Op::Begin,
            Op::Complete,
            Op::Release,
            Op::Renew,
            Op::Get,
            Op::Sweep,
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            names,
            ["begin", "complete", "release", "renew", "get", "sweep"]
        );
    }

    #[cfg(feature = "test-util")]
    #[test]
    fn a_fault_hook_fails_the_operations_it_names_until_cleared() {
        let store = MemoryStore::new();
        let (key, fp, now, d) = parts();
        store.set_fault(|op| (op == Op::Begin).then(|| Error::backend(format!("down: {op}"))));
        let failed = store.begin(&key, &fp, now, d, d);
        assert!(
            matches!(&failed, Err(Error::Backend(m)) if m.to_string().contains("down: begin")),
            "{failed:?}"
        );
        assert!(store.is_empty(), "a failed begin writes nothing");
        assert!(
            matches!(store.get(&key, now), Ok(None)),
            "other operations run"
        );
        store.clear_fault();
        assert!(matches!(
            store.begin(&key, &fp, now, d, d),
            Ok(Begin::Claimed(_))
        ));
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
