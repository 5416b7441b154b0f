//! [`Guard::run`]: the synchronous run.

use super::decide::{Settle, Start};
use super::outcome::Outcome;
use super::{Guard, StepRun};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::observability::{Span, store_op};
use crate::record::{Begin, Claim};
use crate::response::Response;
use crate::store::Store;
use std::sync::Arc;

impl<S: Store + 'static> Guard<S> {
    /// Runs `handler` at most once per intent: claims `key`, calls the
    /// handler with the claim, stores its response. See the table on [`Guard`].
    pub fn run<E>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        handler: impl FnOnce(&Claim) -> std::result::Result<Response, E>,
    ) -> Outcome<E> {
        let span = Span::request(key.scope());
        span.in_scope(|| {
            let outcome = self.run_in_span(key, fingerprint, handler);
            crate::observability::outcome(outcome.label());
            outcome
        })
    }

    fn run_in_span<E>(
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
            let now = self.clock.now();
            let mut entry = self.enter(key, fingerprint, now);
            let begun = match entry.local_owner() {
                // A live run of this process owns the key: in flight,
                // whatever the wall clock says (flights.rs).
                Some(lease_until) => Ok(Begin::InFlight { lease_until }),
                None => store_op("begin", || {
                    self.store
                        .begin(key, fingerprint, now, self.lease, self.retention)
                }),
            };
            match self.classify(begun, &mut entry) {
                Start::Answer(outcome) => return outcome,
                Start::Wait { lease_until } => {
                    let waited = entry.wait_blocking(deadline);
                    match self.after_wait(waited, lease_until) {
                        Some(outcome) => return outcome,
                        None => continue,
                    }
                }
                Start::FailOpen => {
                    let claim =
                        StepRun::attach(Claim::unprotected(), key, None, self.clock.clone());
                    return Outcome::FailedOpen(handler(&claim));
                }
                Start::Execute(claim) => {
                    // Renewed in the background until the handler is done
                    // (returned, failed or panicked: the drop stops it).
                    let (claim, renewing) = self.renewing(key, claim, true);
                    entry.renewed(&claim);
                    let store: Arc<dyn Store> = self.store.clone();
                    let claim = StepRun::attach(claim, key, Some(store), self.clock.clone());
                    let result = handler(&claim);
                    drop(renewing);
                    let written = match self.settle(&result, |_| false, &claim) {
                        Settle::Complete(response) => store_op("complete", || {
                            self.store.complete(
                                key,
                                &claim,
                                response,
                                self.clock.now(),
                                self.retention,
                            )
                        }),
                        Settle::Release => store_op("release", || self.store.release(key, &claim)),
                        Settle::Keep => Ok(()),
                    };
                    return self.conclude(result, written, &mut entry, &claim);
                }
            }
        }
    }
}
