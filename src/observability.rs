//! What the crate reports about itself: spans and events through the
//! [`tracing`](https://docs.rs/tracing) facade (feature `tracing`), and
//! counters, histograms and gauges through the
//! [`metrics`](https://docs.rs/metrics) facade (feature `metrics`). Without
//! the features every hook is an empty inline function: nothing is
//! recorded and nothing is linked in. The spans and events with their
//! fields are in `docs/operations.md` ("Tracing").
//!
//! No span or event carries a key's id or a body at any level (they can be
//! personal data); a request's span has the key's scope (the tenant), the
//! outcome, the fencing token, the lease and whether it waited.
//!
//! # Metrics
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `idemstore_guard_outcomes_total` | counter | `outcome` | guarded requests by how they ended: `executed`, `replayed`, `in_flight`, `conflicted`, `unavailable`, `fail_open`, `unknown`, `not_stored`, `handler_failed`, `lease_lost` |
//! | `idemstore_guard_takeovers_total` | counter | | claims taken over after the owner's lease passed |
//! | `idemstore_guard_waited_total` | counter | | duplicates that waited for a local owner's response |
//! | `idemstore_guard_stale_claims_total` | counter | | `complete` or `release` refused as stale (the claim was taken over) |
//! | `idemstore_guard_steps_total` | counter | `how` | steps of guarded runs: `ran` (and recorded), `replayed` (recorded by an earlier attempt) |
//! | `idemstore_guard_begin_seconds` | histogram | | a guarded request's `begin` (for a new key: until its claim is durable) |
//! | `idemstore_guard_complete_seconds` | histogram | | a `complete` (until durable) |
//! | `idemstore_redb_group_size` | histogram | | writes per commit group (`RedbStore`) |
//! | `idemstore_redb_log_sync_seconds` | histogram | | a group's log append and fsync (`RedbStore`) |
//! | `idemstore_redb_checkpoint_seconds` | histogram | | a checkpoint: the memtable into the store file, durably |
//! | `idemstore_redb_memtable_bytes` | gauge | | writes acknowledged, not yet checkpointed |
//! | `idemstore_redb_log_fill_ratio` | gauge | | the active log segment's fill, 0..=1 |
//! | `idemstore_swept_records_total` | counter | `store` | expired records removed by sweeps (`redb`, `sled`, `memory`, `postgres`) |
//! | `idemstore_poisoned_total` | counter | `store` | a failed commit or fsync made a store refuse writes: alert on it |
//! | `idemstore_healed_total` | counter | `store` | a store healed by itself after a failed write (`RedbStore`) |
//! | `idemstore_store_health` | gauge | `store` | 0 healthy, 1 degraded (writes refused while it heals), 2 failed (needs an operator) |
//!
//! ```
//! // With feature `metrics`, whatever recorder the application installed
//! // (a Prometheus exporter, OpenTelemetry, statsd) sees this request:
//! use idemstore::{Fingerprint, Guard, Key, MemoryStore, Response};
//! let guard = Guard::new(MemoryStore::new());
//! let key = Key::new("tenant-42", "order-1")?;
//! guard.run(&key, &Fingerprint::of(b"x"), |_| {
//!     Ok::<_, std::convert::Infallible>(Response::new(201, "ok"))
//! }); // counts one `executed` in idemstore_guard_outcomes_total
//! # Ok::<(), idemstore::Error>(())
//! ```

use std::time::Duration;

/// A guarded request's span (`idemstore.request`, INFO), entered for the
/// request's life, its fields filled as they become known; or a step's
/// (`idemstore.step`, INFO), inside it.
pub(crate) struct Span {
    #[cfg(feature = "tracing")]
    span: tracing::Span,
}

impl Span {
    /// A step's span: its name (the application's, never a key or a body).
    pub(crate) fn step(name: &str) -> Span {
        let _ = name;
        Span {
            #[cfg(feature = "tracing")]
            span: tracing::info_span!("idemstore.step", name, how = tracing::field::Empty),
        }
    }

    /// The span for a request with a key of `scope`.
    pub(crate) fn request(scope: &[u8]) -> Span {
        let _ = scope;
        Span {
            #[cfg(feature = "tracing")]
            span: tracing::info_span!(
                "idemstore.request",
                scope = %String::from_utf8_lossy(scope),
                outcome = tracing::field::Empty,
                token = tracing::field::Empty,
                lease_ms = tracing::field::Empty,
                takeover = tracing::field::Empty,
                waited = tracing::field::Empty,
            ),
        }
    }

    /// Runs `f` inside the span.
    pub(crate) fn in_scope<T>(&self, f: impl FnOnce() -> T) -> T {
        #[cfg(feature = "tracing")]
        {
            self.span.in_scope(f)
        }
        #[cfg(not(feature = "tracing"))]
        {
            f()
        }
    }

    /// `fut`, entering the span at each poll. Not an `async fn`, which
    /// would hold `fut` twice (its argument and the future it awaits).
    #[cfg(feature = "tokio")]
    pub(crate) fn instrument<F: std::future::Future>(
        &self,
        fut: F,
    ) -> impl std::future::Future<Output = F::Output> + use<F> {
        #[cfg(feature = "tracing")]
        {
            tracing::Instrument::instrument(fut, self.span.clone())
        }
        #[cfg(not(feature = "tracing"))]
        {
            fut
        }
    }
}

/// The current request span's claim fields (a claim was taken).
pub(crate) fn claimed(token: u64, lease: Duration, takeover: bool, attempt: u32) {
    let _ = (token, lease, takeover, attempt);
    #[cfg(feature = "tracing")]
    {
        let span = tracing::Span::current();
        span.record("token", token);
        span.record(
            "lease_ms",
            u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
        );
        span.record("takeover", takeover);
        if takeover {
            tracing::info!(
                token,
                attempt,
                "claim taken over after the owner's lease passed"
            );
        }
    }
    #[cfg(feature = "metrics")]
    if takeover {
        metrics::counter!("idemstore_guard_takeovers_total").increment(1);
    }
}

/// A guarded request ended as `outcome` (a label of `idemstore_guard_outcomes_total`).
pub(crate) fn outcome(outcome: &'static str) {
    let _ = outcome;
    #[cfg(feature = "tracing")]
    {
        tracing::Span::current().record("outcome", outcome);
        tracing::debug!(outcome, "request answered");
    }
    #[cfg(feature = "metrics")]
    metrics::counter!("idemstore_guard_outcomes_total", "outcome" => outcome).increment(1);
}

/// A duplicate waited for a local owner's response and got it.
pub(crate) fn waited() {
    #[cfg(feature = "tracing")]
    tracing::Span::current().record("waited", true);
    #[cfg(feature = "metrics")]
    metrics::counter!("idemstore_guard_waited_total").increment(1);
}

/// `call()` as store operation `op` (`begin`, `complete`, `release`): a
/// DEBUG span `idemstore.store` around it, and its time in the histograms.
pub(crate) fn store_op<T>(op: &'static str, call: impl FnOnce() -> T) -> T {
    let _ = op;
    #[cfg(feature = "tracing")]
    let _span = tracing::debug_span!("idemstore.store", op).entered();
    // The clock is read only when a histogram wants it.
    #[cfg(feature = "metrics")]
    let started = std::time::Instant::now();
    let out = call();
    #[cfg(feature = "metrics")]
    store_call(op, started.elapsed());
    out
}

/// [`store_op`] for a store call that is a future.
#[cfg(feature = "tokio")]
pub(crate) async fn store_op_async<F: std::future::Future>(op: &'static str, call: F) -> F::Output {
    let _ = op;
    #[cfg(feature = "metrics")]
    let started = std::time::Instant::now();
    #[cfg(feature = "tracing")]
    let out =
        tracing::Instrument::instrument(call, tracing::debug_span!("idemstore.store", op)).await;
    #[cfg(not(feature = "tracing"))]
    let out = call.await;
    #[cfg(feature = "metrics")]
    store_call(op, started.elapsed());
    out
}

/// The store could not answer `begin` and the guard fails open: the
/// handler runs unprotected.
pub(crate) fn failed_open(error: &crate::Error) {
    let _ = error;
    #[cfg(feature = "tracing")]
    tracing::warn!(%error, "store unavailable: running the handler without protection (fail open)");
}

/// A step of a guarded run ran and was recorded, or was `replayed` from
/// an earlier attempt's record (in the step's span: its `how`).
pub(crate) fn step(replayed: bool) {
    let how = if replayed { "replayed" } else { "ran" };
    let _ = how;
    #[cfg(feature = "tracing")]
    tracing::Span::current().record("how", how);
    #[cfg(feature = "metrics")]
    metrics::counter!("idemstore_guard_steps_total", "how" => how).increment(1);
}

/// A `complete` or `release` refused as stale.
pub(crate) fn stale_claim() {
    #[cfg(feature = "tracing")]
    tracing::warn!(
        "the claim was taken over or ended before the handler finished: its result was not stored"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!("idemstore_guard_stale_claims_total").increment(1);
}

/// How long a store call took, for the request's histograms.
#[cfg(feature = "metrics")]
fn store_call(op: &'static str, took: Duration) {
    match op {
        "begin" => metrics::histogram!("idemstore_guard_begin_seconds").record(took.as_secs_f64()),
        "complete" => {
            metrics::histogram!("idemstore_guard_complete_seconds").record(took.as_secs_f64())
        }
        _ => {}
    }
}

/// A store refuses further writes after `why` (a failed commit or fsync).
#[cfg(any(feature = "redb", test))]
pub(crate) fn poisoned(store: &'static str, why: &dyn std::fmt::Display) {
    let _ = (store, why);
    #[cfg(feature = "tracing")]
    tracing::error!(store, error = %why, "store poisoned: it refuses writes until it heals");
    #[cfg(feature = "metrics")]
    metrics::counter!("idemstore_poisoned_total", "store" => store).increment(1);
}

/// A store that was poisoned by `cause` writes again, `after` it failed.
#[cfg(feature = "redb")]
pub(crate) fn healed(store: &'static str, cause: &dyn std::fmt::Display, after: Duration) {
    let _ = (store, cause, after);
    #[cfg(feature = "tracing")]
    tracing::warn!(store, cause = %cause, after_ms = after.as_millis() as u64, "store healed: it writes again");
    #[cfg(feature = "metrics")]
    metrics::counter!("idemstore_healed_total", "store" => store).increment(1);
}

/// An attempt to heal a poisoned store failed (the cause is still there);
/// the next comes after `retry_in` doubled, at most `HEAL_BACKOFF_MAX`.
#[cfg(feature = "redb")]
pub(crate) fn heal_failed(store: &'static str, error: &dyn std::fmt::Display, retry_in: Duration) {
    let _ = (store, error, retry_in);
    #[cfg(feature = "tracing")]
    tracing::debug!(store, error = %error, retry_in_ms = retry_in.as_millis() as u64, "store not healed yet");
}

/// A store's health changed: 0 healthy, 1 degraded, 2 failed.
#[cfg(feature = "redb")]
pub(crate) fn health(store: &'static str, level: u8) {
    let _ = (store, level);
    #[cfg(feature = "metrics")]
    metrics::gauge!("idemstore_store_health", "store" => store).set(f64::from(level));
}

/// A sweep removed `removed` records.
pub(crate) fn swept(store: &'static str, removed: usize) {
    let _ = store;
    if removed > 0 {
        #[cfg(feature = "tracing")]
        tracing::debug!(store, removed, "expired records swept");
        #[cfg(feature = "metrics")]
        metrics::counter!("idemstore_swept_records_total", "store" => store)
            .increment(removed as u64);
    }
}

/// A commit group: `size` writes, and the log append and sync's time.
#[cfg(feature = "redb")]
pub(crate) fn group_committed(
    size: usize,
    log_sync: Duration,
    memtable_bytes: usize,
    log_fill: f64,
) {
    let _ = (size, log_sync, memtable_bytes, log_fill);
    #[cfg(feature = "metrics")]
    {
        metrics::histogram!("idemstore_redb_group_size").record(size as f64);
        metrics::histogram!("idemstore_redb_log_sync_seconds").record(log_sync.as_secs_f64());
        metrics::gauge!("idemstore_redb_memtable_bytes").set(memtable_bytes as f64);
        metrics::gauge!("idemstore_redb_log_fill_ratio").set(log_fill);
    }
}

/// A checkpoint wrote `records` records into the store file in `took`.
#[cfg(feature = "redb")]
pub(crate) fn checkpointed(records: usize, took: Duration) {
    let _ = (records, took);
    #[cfg(feature = "tracing")]
    tracing::debug!(
        records,
        took_ms = took.as_millis() as u64,
        "checkpoint written"
    );
    #[cfg(feature = "metrics")]
    {
        metrics::histogram!("idemstore_redb_checkpoint_seconds").record(took.as_secs_f64());
        metrics::gauge!("idemstore_redb_log_fill_ratio").set(0.0);
    }
}

/// A store was opened: what its recovery did.
#[cfg(feature = "redb")]
pub(crate) fn opened(
    path: Option<&std::path::Path>,
    frames_replayed: u64,
    leases_ended: u64,
    read_only: bool,
) {
    let _ = (path, frames_replayed, leases_ended, read_only);
    #[cfg(feature = "tracing")]
    tracing::info!(
        path = %path.map_or_else(|| "<storage backend>".into(), |p| p.display().to_string()),
        frames_replayed,
        leases_ended,
        read_only,
        "store opened"
    );
}
