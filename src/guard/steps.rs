//! Steps in a guarded run: [`Claim::step`] and its async and JSON forms.
//!
//! A run's claim carries a [`StepRun`]: the key, the store to record
//! through, and the names used so far. A step whose name the claim's
//! earlier attempts recorded ([`Claim::steps`]) returns that output without
//! running; any other runs, and its output is recorded under the claim
//! (durably, fenced by the claim's token) before the step returns. So a
//! recorded step never runs again for this key, and after a crash only the
//! step that was running can run twice: give its downstream call the step
//! key the closure is handed ([`Key::step_key`]).

use crate::error::{Error, Result};
use crate::key::Key;
use crate::observability::Span;
use crate::record::Claim;
use crate::step::{self, Step};
use crate::store::Store;
use crate::time::Clock;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::{Arc, Mutex, Weak};

/// A guard's run, as its claim carries it for the steps.
pub(crate) struct StepRun {
    key: Key,
    /// `None` when the guard failed open: steps run, nothing is recorded.
    /// Weak: a claim never keeps its store alive. Copies of a claim go
    /// where its store sends them (a redb commit op on the committer
    /// thread), and the last owner of a store must not be that thread.
    store: Option<Weak<dyn Store>>,
    clock: Arc<dyn Clock>,
    /// The step names used in this run.
    used: Mutex<Vec<String>>,
}

impl std::fmt::Debug for StepRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepRun").field("key", &self.key).finish()
    }
}

impl StepRun {
    /// The store to record through: `None` in a fail-open run; closed
    /// when the guard and every other owner of the store are gone.
    fn store(&self) -> Result<Option<Arc<dyn Store>>> {
        match &self.store {
            None => Ok(None),
            Some(weak) => weak.upgrade().map(Some).ok_or(Error::Closed),
        }
    }

    /// `claim` with a run over `key` attached; `store` is `None` for a
    /// fail-open run.
    pub(crate) fn attach(
        mut claim: Claim,
        key: &Key,
        store: Option<Arc<dyn Store>>,
        clock: Arc<dyn Clock>,
    ) -> Claim {
        claim.run = Some(Arc::new(StepRun {
            key: key.clone(),
            store: store.as_ref().map(Arc::downgrade),
            clock,
            used: Mutex::new(Vec::new()),
        }));
        claim
    }
}

/// What a step does, decided before it runs.
pub(crate) enum Next<'a> {
    /// An earlier attempt recorded it: its output.
    Replay(Vec<u8>),
    /// Run it, then record through `run`.
    Run(&'a StepRun),
}

impl Claim {
    /// Runs the step `name` of a guarded run at most once per key: if an
    /// earlier attempt recorded it ([`Claim::steps`]), returns its output
    /// without calling `f`; otherwise calls `f` with the step's stable key
    /// ([`Key::step_key`]), records its output under this claim (durable on
    /// return, fenced: a claim taken over records nothing) and returns it.
    ///
    /// A name is used once per run (1..=[`MAX_STEP_NAME_BYTES`](crate::limits::MAX_STEP_NAME_BYTES)
    /// bytes); an output is at most
    /// [`MAX_STEP_OUTPUT_BYTES`](crate::limits::MAX_STEP_OUTPUT_BYTES), a
    /// record holds at most [`MAX_STEPS`](crate::limits::MAX_STEPS) steps.
    /// An `Err` from `f` records nothing and is returned as is; a refusal
    /// (a limit, a name used twice, a claim that is not a guard's) or a
    /// store error after `f` ran comes back through `E: From<Error>`, and
    /// the handler should return it: its step's side effect happened but
    /// was not recorded, so a later attempt runs it again with the same
    /// step key. In a run that failed open (the store was down), steps run
    /// and nothing is recorded.
    ///
    /// ```
    /// use idemstore::{Error, Fingerprint, Guard, Key, MemoryStore, Outcome, Response};
    ///
    /// let guard = Guard::new(MemoryStore::new());
    /// let key = Key::new("tenant-42", "order-1")?;
    /// let out = guard.run(&key, &Fingerprint::of(b"qty=1"), |claim| {
    ///     // `step_key` goes to the payment provider as its idempotency key.
    ///     let charge = claim.step("charge", |step_key| Ok::<_, Error>(format!("ch_{step_key}").into_bytes()))?;
    ///     let _email = claim.step("email", |_| Ok::<_, Error>(Vec::new()))?;
    ///     Ok::<_, Error>(Response::new(201, charge))
    /// });
    /// assert!(matches!(out, Outcome::Executed(_)));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn step<E: From<Error>>(
        &self,
        name: &str,
        f: impl FnOnce(&str) -> std::result::Result<Vec<u8>, E>,
    ) -> std::result::Result<Vec<u8>, E> {
        Span::step(name).in_scope(|| {
            let run = match self.next_step(name)? {
                Next::Replay(output) => return Ok(output),
                Next::Run(run) => run,
            };
            let output = f(&run.key.step_key(name))?;
            let step = Step::new(name, output)?;
            if let Some(store) = run.store()? {
                crate::observability::store_op("record_step", || {
                    store.record_step(&run.key, self, &step, run.clock.now())
                })?;
            }
            crate::observability::step(false);
            Ok(step.output)
        })
    }

    /// [`step`](Claim::step) with a typed output, through JSON
    /// (`serde_json`): the recorded bytes are `f`'s value as JSON, and a
    /// replay decodes them (a recorded output that does not decode as `T`
    /// is [`Error::Corrupt`]).
    ///
    /// ```
    /// use idemstore::{Error, Fingerprint, Guard, Key, MemoryStore, Response};
    ///
    /// let guard = Guard::new(MemoryStore::new());
    /// let key = Key::new("", "order-2")?;
    /// guard.run(&key, &Fingerprint::of(b"x"), |claim| {
    ///     let (charge_id, cents): (String, u64) = claim.step_json("charge", |_| Ok::<_, Error>(("ch_9".into(), 500)))?;
    ///     Ok::<_, Error>(Response::new(201, format!("{charge_id} {cents}")))
    /// });
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn step_json<T, E>(
        &self,
        name: &str,
        f: impl FnOnce(&str) -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let mut made = None;
        let bytes = self.step(name, |step_key| -> std::result::Result<Vec<u8>, E> {
            let value = f(step_key)?;
            let bytes = to_json(name, &value)?;
            made = Some(value);
            Ok(bytes)
        })?;
        match made {
            Some(value) => Ok(value),
            None => Ok(from_json(name, &bytes)?),
        }
    }

    /// The async [`step`](Claim::step) (feature `tokio`), for
    /// [`Guard::run_async`](crate::Guard::run_async) and the HTTP layer's
    /// handlers (`Extension<Claim>`): `f` gets the step key as a `String`
    /// and its future is awaited on the caller's task; the record goes
    /// through the store's native async entry
    /// ([`Store::record_step_async`]) or tokio's blocking pool, so no
    /// runtime worker waits on an fsync.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idemstore::Error> {
    /// use idemstore::{Error, Fingerprint, Guard, Key, MemoryStore, Outcome, Response};
    ///
    /// let guard = Guard::new(MemoryStore::new());
    /// let key = Key::new("", "order-3")?;
    /// let out = guard
    ///     .run_async(&key, &Fingerprint::of(b"x"), |claim| async move {
    ///         let id = claim.step_async("charge", |k| async move { Ok::<_, Error>(k.into_bytes()) }).await?;
    ///         Ok::<_, Error>(Response::new(201, id))
    ///     })
    ///     .await;
    /// assert!(matches!(out, Outcome::Executed(_)));
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "tokio")]
    pub async fn step_async<E, F, Fut>(&self, name: &str, f: F) -> std::result::Result<Vec<u8>, E>
    where
        E: From<Error>,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = std::result::Result<Vec<u8>, E>>,
    {
        Span::step(name)
            .instrument(async {
                let run = match self.next_step(name)? {
                    Next::Replay(output) => return Ok(output),
                    Next::Run(run) => run,
                };
                let output = f(run.key.step_key(name)).await?;
                let step = Step::new(name, output)?;
                if let Some(store) = run.store()? {
                    let store = &store;
                    let now = run.clock.now();
                    let native = store.record_step_async(&run.key, self, &step, now);
                    let call = super::native_or_blocking(native, || {
                        let (store, key, claim) =
                            (Arc::clone(store), run.key.clone(), self.clone());
                        let step = step.clone();
                        move || store.record_step(&key, &claim, &step, now)
                    });
                    crate::observability::store_op_async("record_step", call).await?;
                }
                crate::observability::step(false);
                Ok(step.output)
            })
            .await
    }

    /// The async [`step_json`](Claim::step_json) (feature `tokio`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idemstore::Error> {
    /// use idemstore::{Error, Fingerprint, Guard, Key, MemoryStore, Response};
    ///
    /// let guard = Guard::new(MemoryStore::new());
    /// let key = Key::new("", "order-4")?;
    /// guard
    ///     .run_async(&key, &Fingerprint::of(b"x"), |claim| async move {
    ///         let n: u32 = claim.step_json_async("reserve", |_| async { Ok::<_, Error>(3) }).await?;
    ///         Ok::<_, Error>(Response::new(201, n.to_string()))
    ///     })
    ///     .await;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "tokio")]
    pub async fn step_json_async<T, E, F, Fut>(&self, name: &str, f: F) -> std::result::Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = std::result::Result<T, E>>,
    {
        let mut made = None;
        let bytes = self
            .step_async(name, |step_key| {
                let made = &mut made;
                async move {
                    let value = f(step_key).await?;
                    let bytes = to_json(name, &value)?;
                    *made = Some(value);
                    Ok::<_, E>(bytes)
                }
            })
            .await?;
        match made {
            Some(value) => Ok(value),
            None => Ok(from_json(name, &bytes)?),
        }
    }

    /// Checks `name` and claims it for this run; says whether to replay.
    pub(crate) fn next_step(&self, name: &str) -> Result<Next<'_>> {
        let Some(run) = self.run.as_deref() else {
            return Err(Error::invalid_argument(
                "a step needs the claim of a guard's run; with a bare store, call Store::record_step",
            ));
        };
        step::check_name(name)?;
        let mut used = run.used.lock().unwrap_or_else(|p| p.into_inner());
        if used.iter().any(|n| n == name) {
            return Err(Error::invalid_argument(format!(
                "step `{name}` is run twice in one run: step names are unique within a run"
            )));
        }
        used.push(name.to_owned());
        drop(used);
        if let Some(recorded) = self.steps.iter().find(|s| s.name == name) {
            crate::observability::step(true);
            return Ok(Next::Replay(recorded.output.clone()));
        }
        Ok(Next::Run(run))
    }
}

fn to_json<T: Serialize>(name: &str, value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| {
        Error::invalid_argument(format!("step `{name}`'s output does not serialise: {e}"))
    })
}

fn from_json<T: DeserializeOwned>(name: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| {
        Error::corrupt(
            None,
            format!("step `{name}`'s recorded output does not decode as its type: {e}"),
        )
    })
}
