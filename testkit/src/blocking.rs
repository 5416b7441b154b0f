//! [`BlockingOnly`]: a store seen without its native async entry.

use idemstore::{
    Begin, Claim, Clock, Fingerprint, Key, Record, Response, Result, Step, Store, Timestamp,
};
use std::sync::Arc;
use std::time::Duration;

/// Any [`Store`] with its native async entry hidden
/// ([`Store::begin_async`] and friends answer `None`), so that
/// `Guard::run_async` runs its calls on tokio's blocking pool, as it does
/// for a store written without one. For comparing the two paths (the
/// thread-count test, the `async` bench) and for testing the fallback.
/// It is a store object of its own ([`Store::instance`] is not
/// forwarded): guards over it and over the inner store share no runs in
/// flight, as guards in two processes over the same records would not.
///
/// ```
/// use idemstore::{Fingerprint, Key, MemoryStore, Store, Timestamp};
/// use idemstore_testkit::BlockingOnly;
/// use std::time::Duration;
///
/// let store = BlockingOnly(MemoryStore::new());
/// let (key, d) = (Key::new("", "k")?, Duration::from_secs(1));
/// assert!(store.begin_async(&key, &Fingerprint::of(b""), Timestamp::EPOCH, d, d).is_none());
/// assert!(store.begin(&key, &Fingerprint::of(b""), Timestamp::EPOCH, d, d).is_ok());
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct BlockingOnly<S>(pub S);

impl<S: Store> Store for BlockingOnly<S> {
    fn begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        self.0.begin(key, fingerprint, now, lease, retention)
    }
    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        self.0.complete(key, claim, response, now, retention)
    }
    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        self.0.release(key, claim)
    }
    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
        self.0.renew(key, claim, now, lease)
    }
    fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()> {
        self.0.record_step(key, claim, step, now)
    }
    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        self.0.get(key, now)
    }
    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        self.0.sweep_expired(now, max)
    }
    fn clock(&self) -> Arc<dyn Clock> {
        self.0.clock()
    }
}
