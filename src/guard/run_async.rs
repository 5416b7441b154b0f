//! [`Guard::run_async`] (feature `tokio`): the same decisions as
//! [`Guard::run`], with the store calls through the store's native async
//! entry ([`Store::begin_async`] and friends) where it has one, and on
//! tokio's blocking pool where it has not.

use super::decide::{Settle, Start};
use super::flights::{Entered, Waited};
use super::outcome::Outcome;
use super::{Guard, StepRun, native_or_blocking};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::observability::{Span, store_op_async};
use crate::record::{Begin, Claim};
use crate::response::Response;
use crate::store::Store;
use std::sync::Arc;
use std::time::Instant;

impl<S: Store + 'static> Guard<S> {
    /// The async [`run`](Guard::run) (feature `tokio`), with the same
    /// decisions. No runtime worker ever waits on an fsync: a store with a
    /// native async entry ([`Store::begin_async`]: `MemoryStore`,
    /// `RedbStore`) is awaited without any thread per request (`RedbStore`
    /// wakes the task when its commit group is durable); any other store's
    /// calls run on tokio's blocking pool. The handler is awaited on the
    /// caller's task. It is named `run_async` rather than `run` because one
    /// type cannot have both.
    ///
    /// **Cancellation.** The future may be dropped at any await point. Dropped
    /// while `begin` is pending, it leaves no claim behind on a store with a
    /// native entry (on a blocking-pool store, a `begin` already running
    /// finishes, and a claim it made stays PROCESSING until its lease ends).
    /// Dropped while the handler runs or the response is being stored, the
    /// claim stays PROCESSING until its lease ends, as for a process that
    /// died there: the handler may have done part of its side effect, so a
    /// retry is not let in early (a `complete` already queued is stored
    /// whole or not at all).
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
    pub fn run_async<E, F, Fut>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        handler: F,
    ) -> impl Future<Output = Outcome<E>>
    where
        F: FnOnce(Claim) -> Fut,
        Fut: Future<Output = std::result::Result<Response, E>>,
    {
        self.run_async_with(key, fingerprint, |_| false, handler)
    }

    /// [`run_async`](Guard::run_async), where `release(&err)` releases the
    /// claim for chosen handler errors whatever the [`OnHandlerError`]
    /// policy (the HTTP layer uses it for responses it must not store).
    ///
    /// Neither is an `async fn`: each would hold the handler and the inner
    /// future twice (as its argument and as what it awaits), and a guarded
    /// request holds this state, boxed, for as long as it waits.
    pub(crate) fn run_async_with<E, F, Fut>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        release: impl Fn(&E) -> bool,
        handler: F,
    ) -> impl Future<Output = Outcome<E>>
    where
        F: FnOnce(Claim) -> Fut,
        Fut: Future<Output = std::result::Result<Response, E>>,
    {
        Span::request(key.scope()).instrument(self.run_async_in_span(
            key,
            fingerprint,
            release,
            handler,
        ))
    }

    async fn run_async_in_span<E, F, Fut>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        release: impl Fn(&E) -> bool,
        handler: F,
    ) -> Outcome<E>
    where
        F: FnOnce(Claim) -> Fut,
        Fut: Future<Output = std::result::Result<Response, E>>,
    {
        let deadline = self.wait_deadline();
        // One store call per turn, as in `run`.
        let outcome = loop {
            let (now, lease, retention) = (self.clock.now(), self.lease, self.retention);
            let mut entry = self.enter(key, fingerprint, now);
            let begun = match entry.local_owner() {
                // A live run of this process owns the key (flights.rs).
                Some(lease_until) => Ok(Begin::InFlight { lease_until }),
                None => {
                    let native = self
                        .store
                        .begin_async(key, fingerprint, now, lease, retention);
                    store_op_async(
                        "begin",
                        native_or_blocking(native, || {
                            let (store, k, fp) =
                                (Arc::clone(&self.store), key.clone(), *fingerprint);
                            move || store.begin(&k, &fp, now, lease, retention)
                        }),
                    )
                    .await
                }
            };
            match self.classify(begun, &mut entry) {
                Start::Answer(outcome) => break outcome,
                Start::Wait { lease_until } => {
                    let waited = wait_async(&entry, deadline).await;
                    match self.after_wait(waited, lease_until) {
                        Some(outcome) => break outcome,
                        None => continue,
                    }
                }
                Start::FailOpen => {
                    let claim =
                        StepRun::attach(Claim::unprotected(), key, None, self.clock.clone());
                    break Outcome::FailedOpen(handler(claim).await);
                }
                Start::Execute(claim) => {
                    // Renewed by the process's timer thread while the
                    // handler future runs; dropping the registration (the
                    // handler is done, or this future was dropped) stops it.
                    let (claim, renewing) = self.renewing(key, claim, false);
                    entry.renewed(&claim);
                    let steps_to: Arc<dyn Store> = self.store.clone();
                    let claim = StepRun::attach(claim, key, Some(steps_to), self.clock.clone());
                    let result = handler(claim.clone()).await;
                    drop(renewing);
                    let store = &self.store;
                    let written = match self.settle(&result, &release, &claim) {
                        Settle::Complete(response) => {
                            let now = self.clock.now();
                            let native =
                                store.complete_async(key, &claim, response, now, retention);
                            let call = native_or_blocking(native, || {
                                // The blocking pool needs its own copies.
                                let (store, k) = (Arc::clone(store), key.clone());
                                let (claim, response) = (claim.clone(), response.clone());
                                move || store.complete(&k, &claim, &response, now, retention)
                            });
                            store_op_async("complete", call).await
                        }
                        Settle::Release => {
                            let native = store.release_async(key, &claim);
                            let call = native_or_blocking(native, || {
                                let (store, k, claim) =
                                    (Arc::clone(store), key.clone(), claim.clone());
                                move || store.release(&k, &claim)
                            });
                            store_op_async("release", call).await
                        }
                        Settle::Keep => Ok(()),
                    };
                    break self.conclude(result, written, &mut entry, &claim);
                }
            }
        };
        crate::observability::outcome(outcome.label());
        outcome
    }
}

/// Waits for the flight's answer without blocking a runtime worker.
async fn wait_async(entry: &Entered, deadline: Instant) -> Waited {
    let answer = std::future::poll_fn(|cx| entry.poll_answer(cx));
    tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), answer)
        .await
        .unwrap_or(Waited::InFlight)
}
