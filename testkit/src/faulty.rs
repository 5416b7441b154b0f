//! [`FaultyStore`]: fault injection around any store.

use idemstore::{
    Begin, Claim, Clock, Error, Fingerprint, Key, Record, Response, Result, Step, Store, Timestamp,
};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// A store operation, as a [`FaultyStore`] hook sees it.
///
/// ```
/// assert_eq!(idemstore_testkit::Op::Complete.to_string(), "complete");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
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
    /// [`Store::record_step`].
    Step,
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
            Op::Step => "record_step",
        })
    }
}

type Hook = Box<dyn Fn(Op) -> Option<Error> + Send + Sync>;

/// Wraps any [`Store`] and fails chosen operations on demand: a hook is called with each operation and may fail it. A failed
/// operation never reaches the inner store, so it has no effect — like a
/// database that refused the connection.
///
/// The conformance suite uses this to run its fault scenarios against every
/// backend unchanged.
///
/// ```
/// use idemstore::{Fingerprint, Key, MemoryStore, Store, Timestamp};
/// use idemstore_testkit::{FaultyStore, Op};
/// use std::time::Duration;
///
/// let store = FaultyStore::new(MemoryStore::new());
/// store.fail_next(Op::Complete, 1);
/// let d = Duration::from_secs(1);
/// let key = Key::new("", "k")?;
/// let begin = store.begin(&key, &Fingerprint::of(b""), Timestamp::EPOCH, d, d)?;
/// let claim = begin.claim().unwrap();
/// let r = idemstore::Response::new(200, "");
/// assert!(store.complete(&key, claim, &r, Timestamp::EPOCH, d).is_err());
/// assert!(store.complete(&key, claim, &r, Timestamp::EPOCH, d).is_ok());
/// # Ok::<(), idemstore::Error>(())
/// ```
pub struct FaultyStore<S> {
    inner: S,
    hook: RwLock<Option<Hook>>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for FaultyStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyStore")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S: Store> FaultyStore<S> {
    /// Wraps `inner` with no faults installed.
    pub fn new(inner: S) -> FaultyStore<S> {
        FaultyStore {
            inner,
            hook: RwLock::new(None),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Installs `hook`: called before each operation; an error it returns
    /// fails that operation.
    pub fn set_fault(&self, hook: impl Fn(Op) -> Option<Error> + Send + Sync + 'static) {
        *self.hook.write().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(hook));
    }

    /// Fails the next `count` calls of `op` with a backend error, then
    /// lets calls through again.
    pub fn fail_next(&self, op: Op, count: u32) {
        let left = std::sync::atomic::AtomicU32::new(count);
        self.set_fault(move |o| {
            let hit = o == op
                && left
                    .fetch_update(
                        std::sync::atomic::Ordering::SeqCst,
                        std::sync::atomic::Ordering::SeqCst,
                        |n| n.checked_sub(1),
                    )
                    .is_ok();
            hit.then(|| Error::backend(format!("injected fault in {op}")))
        });
    }

    /// Fails every operation with a backend error ("connection refused").
    pub fn fail_all(&self) {
        self.set_fault(|op| {
            Some(Error::backend(format!(
                "injected fault in {op}: connection refused"
            )))
        });
    }

    /// Removes the hook.
    pub fn clear_fault(&self) {
        *self.hook.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn check(&self, op: Op) -> Result<()> {
        match self
            .hook
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|h| h(op))
        {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}

impl<S: Store> Store for FaultyStore<S> {
    fn begin(
        &self,
        key: &Key,
        fp: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        self.check(Op::Begin)?;
        self.inner.begin(key, fp, now, lease, retention)
    }
    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        self.check(Op::Complete)?;
        self.inner.complete(key, claim, response, now, retention)
    }
    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        self.check(Op::Release)?;
        self.inner.release(key, claim)
    }
    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
        self.check(Op::Renew)?;
        self.inner.renew(key, claim, now, lease)
    }
    fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()> {
        self.check(Op::Step)?;
        self.inner.record_step(key, claim, step, now)
    }
    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        self.check(Op::Get)?;
        self.inner.get(key, now)
    }
    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        self.check(Op::Sweep)?;
        self.inner.sweep_expired(now, max)
    }
    /// The inner store's clock (never faulted: it is configuration, not an
    /// operation).
    fn clock(&self) -> Arc<dyn Clock> {
        self.inner.clock()
    }
    /// The inner store's: guards over the wrapper and over the inner store
    /// share their in-process runs.
    fn instance(&self) -> usize {
        self.inner.instance()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemstore::MemoryStore;

    /// A hook fails the operations it names, with no effect, until it is
    /// cleared (the test of `MemoryStore`'s own fault hook, which this
    /// type replaces).
    #[test]
    fn a_fault_hook_fails_the_operations_it_names_until_cleared() {
        let store = FaultyStore::new(MemoryStore::new());
        let (key, fp, now, d) = (
            Key::new("t", "k").unwrap(),
            Fingerprint::of(b"x"),
            Timestamp::from_millis(0),
            Duration::from_secs(60),
        );
        store.set_fault(|op| (op == Op::Begin).then(|| Error::backend(format!("down: {op}"))));
        let failed = store.begin(&key, &fp, now, d, d);
        assert!(
            matches!(&failed, Err(Error::Backend(m)) if m.to_string().contains("down: begin")),
            "{failed:?}"
        );
        assert!(store.inner().is_empty(), "a failed begin writes nothing");
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

    #[test]
    fn ops_print_as_the_store_methods_they_name() {
        let names: Vec<String> = [
            Op::Begin,
            Op::Complete,
            Op::Release,
            Op::Renew,
            Op::Get,
            Op::Sweep,
            Op::Step,
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            names,
            [
                "begin",
                "complete",
                "release",
                "renew",
                "get",
                "sweep",
                "record_step"
            ]
        );
    }
}
