//! [`Sweeper`]: a background thread that is a thin loop over
//! [`Store::sweep_expired`]. Every backend uses this one loop. `Sweeper` and
//! [`SweeperConfig`] are also at the crate root; [`SweeperErrors`] says how
//! its sweeps failed.
//!
//! ```
//! use idemstore::sweeper::SweeperErrors;
//! use idemstore::{MemoryStore, Sweeper, SweeperConfig};
//! use std::sync::Arc;
//!
//! let sweeper = Sweeper::spawn(Arc::new(MemoryStore::new()), SweeperConfig::default())?;
//! assert_eq!(sweeper.errors(), SweeperErrors::default());
//! # Ok::<(), idemstore::Error>(())
//! ```

use crate::error::{Error, Result};
use crate::store::{MAX_SWEEP_BATCH, Store};
use crate::time::{Clock, Timestamp};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::limits::{DEFAULT_SWEEP_BATCH, DEFAULT_SWEEP_INTERVAL};

/// How long dropping a sweeper waits for its thread to finish a batch.
const SWEEPER_JOIN_TIMEOUT: Duration = Duration::from_secs(5);

/// How often and how much a [`Sweeper`] sweeps.
///
/// ```
/// use idemstore::SweeperConfig;
/// use std::time::Duration;
/// let c = SweeperConfig::default().interval(Duration::from_secs(5)).batch(500);
/// assert_eq!(c.get_batch(), 500);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SweeperConfig {
    interval: Duration,
    batch: usize,
}

impl Default for SweeperConfig {
    fn default() -> Self {
        SweeperConfig {
            interval: DEFAULT_SWEEP_INTERVAL,
            batch: DEFAULT_SWEEP_BATCH,
        }
    }
}

impl SweeperConfig {
    /// Pause between sweeps (after a sweep that found less than a full
    /// batch); one minute by default.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }
    /// Records per `sweep_expired` call (1,000 by default), clamped to
    /// 1..=[`MAX_SWEEP_BATCH`].
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.clamp(1, MAX_SWEEP_BATCH);
        self
    }
    /// The configured interval.
    pub fn get_interval(&self) -> Duration {
        self.interval
    }
    /// The configured batch.
    pub fn get_batch(&self) -> usize {
        self.batch
    }
}

#[derive(Debug, Default)]
struct Shared {
    stop: Mutex<bool>,
    wake: Condvar,
    /// Set by the thread as its last act, so `shutdown` can wait with a bound.
    finished: Mutex<bool>,
    finished_cv: Condvar,
    swept: AtomicU64,
    errors: AtomicU64,
    last_error: Mutex<Option<String>>,
}

/// A named background thread that deletes expired records: every interval
/// it calls `sweep_expired(now, batch)` until a call deletes less than a full
/// batch. Stops when dropped (or [`stop`](Sweeper::stop)ped), waiting at most
/// 5 seconds for a batch in progress.
///
/// Expired records are invisible whether or not the sweeper has run, so it
/// only reclaims space; an error (a poisoned store, say) is counted and the
/// loop goes on.
///
/// ```
/// use idemstore::{Fingerprint, Key, MemoryStore, Store, Sweeper, SweeperConfig, Timestamp};
/// use std::{sync::Arc, time::Duration};
///
/// let store = Arc::new(MemoryStore::new());
/// let d = Duration::from_millis(1);
/// store.begin(&Key::new("", "k")?, &Fingerprint::of(b""), Timestamp::EPOCH, d, d)?; // expired long ago
/// let sweeper = Sweeper::spawn(Arc::clone(&store), SweeperConfig::default().interval(Duration::from_millis(10)))?;
/// // The count moves after the record is gone: wait for the count.
/// while sweeper.swept() < 1 { std::thread::sleep(Duration::from_millis(5)); }
/// assert_eq!((sweeper.swept(), store.len()), (1, 0));
/// sweeper.stop();
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Debug)]
pub struct Sweeper {
    shared: Arc<Shared>,
    handle: Option<JoinHandle<()>>,
}

/// Failed sweeps of a [`Sweeper`], from [`Sweeper::errors`]. The sweeper
/// keeps going after a failure (the next sweep retries), so these say
/// whether it has been failing and why.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SweeperErrors {
    /// Sweeps that failed so far.
    pub count: u64,
    /// The last failure's message, if any.
    pub last: Option<String>,
}

impl Sweeper {
    /// Starts a sweeper over `store` reading the store's clock
    /// ([`Store::clock`]).
    pub fn spawn<S: Store + 'static>(store: Arc<S>, config: SweeperConfig) -> Result<Sweeper> {
        let clock = store.clock();
        Sweeper::spawn_with_clock(store, clock, config)
    }

    /// Starts a sweeper over `store` reading time from `clock` instead of
    /// the store's.
    pub fn spawn_with_clock<S: Store + 'static>(
        store: Arc<S>,
        clock: Arc<dyn Clock>,
        config: SweeperConfig,
    ) -> Result<Sweeper> {
        Sweeper::spawn_fn("idemstore-sweeper", clock, config, move |now, max| {
            store.sweep_expired(now, max)
        })
    }

    /// Starts the loop over any sweep step. Backends use this to sweep
    /// their shared inner state without a reference cycle.
    pub(crate) fn spawn_fn(
        name: &str,
        clock: Arc<dyn Clock>,
        config: SweeperConfig,
        mut sweep: impl FnMut(Timestamp, usize) -> Result<usize> + Send + 'static,
    ) -> Result<Sweeper> {
        let shared = Arc::new(Shared::default());
        let thread_shared = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let shared = thread_shared;
                sweep_loop(&shared, &*clock, config, &mut sweep);
                *lock(&shared.finished) = true;
                shared.finished_cv.notify_all();
            })
            .map_err(Error::Io)?;
        Ok(Sweeper {
            shared,
            handle: Some(handle),
        })
    }

    /// Records deleted so far.
    pub fn swept(&self) -> u64 {
        self.shared.swept.load(Ordering::Relaxed)
    }

    /// Sweeps that failed so far, and the last error's message.
    ///
    /// ```
    /// use idemstore::{MemoryStore, Sweeper, SweeperConfig};
    /// use std::sync::Arc;
    ///
    /// let sweeper = Sweeper::spawn(Arc::new(MemoryStore::new()), SweeperConfig::default())?;
    /// let errors = sweeper.errors();
    /// assert_eq!((errors.count, errors.last), (0, None));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn errors(&self) -> SweeperErrors {
        SweeperErrors {
            count: self.shared.errors.load(Ordering::Relaxed),
            last: lock(&self.shared.last_error).clone(),
        }
    }

    /// Stops the thread and waits (bounded) for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        *lock(&self.shared.stop) = true;
        self.shared.wake.notify_all();
        let Some(handle) = self.handle.take() else {
            return;
        };
        // Join only if the thread finishes within the bound; otherwise leave
        // it detached rather than hang the caller.
        let finished = lock(&self.shared.finished);
        let (finished, _) = self
            .shared
            .finished_cv
            .wait_timeout_while(finished, SWEEPER_JOIN_TIMEOUT, |f| !*f)
            .unwrap_or_else(|p| p.into_inner());
        if *finished {
            drop(finished);
            let _ = handle.join();
        }
    }
}

const _: () = {
    // A store holding a sweeper must stay Send + Sync.
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Sweeper>();
};

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Sweeps until a batch comes back short, waits an interval, repeats; returns when stopped.
fn sweep_loop(
    shared: &Shared,
    clock: &dyn Clock,
    config: SweeperConfig,
    sweep: &mut impl FnMut(Timestamp, usize) -> Result<usize>,
) {
    loop {
        loop {
            if *lock(&shared.stop) {
                return;
            }
            match sweep(clock.now(), config.batch) {
                Ok(n) => {
                    shared.swept.fetch_add(n as u64, Ordering::Relaxed);
                    if n < config.batch {
                        break;
                    }
                }
                Err(e) => {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    *lock(&shared.last_error) = Some(e.to_string());
                    break;
                }
            }
        }
        let stopped = lock(&shared.stop);
        let (stopped, _) = shared
            .wake
            .wait_timeout_while(stopped, config.interval, |s| !*s)
            .unwrap_or_else(|p| p.into_inner());
        if *stopped {
            return;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
