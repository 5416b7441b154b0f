//! The store's health: [`Health`], the poison (`HealthCell`) and the heal's
//! back-off. A failed log append, log sync or engine commit may or may not
//! be on disk, so it poisons the store: the call gets the I/O error, later
//! writes [`Error::Poisoned`] with that cause, reads go on, and the
//! background thread heals (heal.rs). Damage ([`Error::Corrupt`]) does not
//! heal: [`Health::Failed`].

use crate::error::{Cause, Error};
use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::{Instant, Mutex, MutexGuard};
use crate::time::Timestamp;
use std::time::Duration;

/// First wait before the background thread tries to heal a store whose
/// writes failed; each failed attempt doubles it, up to [`HEAL_BACKOFF_MAX`].
pub(crate) const HEAL_BACKOFF_MIN: Duration = Duration::from_millis(10);

/// Longest wait between two attempts to heal: a store writes again at most
/// about this long after the cause went away.
pub(crate) const HEAL_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Whether a [`RedbStore`](crate::RedbStore) is writing, and if not, why.
///
/// ```
/// use idemstore::redb::Health;
/// # let dir = tempfile::tempdir()?;
/// let store = idemstore::RedbStore::open(dir.path().join("s.idem"))?;
/// match store.health() {
///     Health::Healthy => {}
///     Health::Degraded { cause, since } => eprintln!("writes refused since {since}: {cause}"),
///     Health::Failed { cause } => eprintln!("needs an operator: {cause}"),
///     _ => {}
/// }
/// assert!(matches!(store.health(), Health::Healthy));
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Health {
    /// Writes are accepted.
    Healthy,
    /// A write failed: writes are refused ([`Error::Poisoned`] with this
    /// cause) and reads go on, while the store tries to heal by itself
    /// (a full disk that gets space, a transient I/O error).
    Degraded {
        /// The first failure.
        cause: Cause,
        /// When it happened (the store's clock).
        since: Timestamp,
    },
    /// The store found damage it cannot heal from: writes stay refused
    /// until an operator acts (`docs/operations.md`: verify, salvage).
    Failed {
        /// What was found.
        cause: Cause,
    },
}

impl Health {
    /// A short name: `healthy`, `degraded` or `failed` (for `idemstore
    /// stats`, logs and the metrics gauge's documentation).
    ///
    /// ```
    /// assert_eq!(idemstore::redb::Health::Healthy.name(), "healthy");
    /// ```
    pub fn name(&self) -> &'static str {
        match self {
            Health::Healthy => "healthy",
            Health::Degraded { .. } => "degraded",
            Health::Failed { .. } => "failed",
        }
    }
}

#[derive(Debug)]
pub(super) struct Fault {
    pub(super) cause: Cause,
    pub(super) since: Timestamp,
}

/// The flag every write reads (one atomic load) and the fault behind it, set
/// and cleared together under the fault's lock: whoever sees the flag and
/// then locks finds the cause, unless the store healed in between.
#[derive(Debug, Default)]
pub(super) struct HealthCell {
    poisoned: AtomicBool,
    fault: Mutex<Option<Fault>>,
}

impl HealthCell {
    fn lock(&self) -> MutexGuard<'_, Option<Fault>> {
        self.fault.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::SeqCst)
    }

    /// Poisons; the first failure stays the cause. True when this was it.
    pub(super) fn poison(&self, cause: &Cause, since: Timestamp) -> bool {
        let mut fault = self.lock();
        let first = fault.is_none();
        fault.get_or_insert_with(|| Fault {
            cause: cause.clone(),
            since,
        });
        self.poisoned.store(true, Ordering::SeqCst);
        first
    }

    pub(super) fn clear(&self) -> Option<Fault> {
        let mut fault = self.lock();
        self.poisoned.store(false, Ordering::SeqCst);
        fault.take()
    }

    pub(super) fn cause(&self) -> Option<Cause> {
        self.lock().as_ref().map(|f| f.cause.clone())
    }

    /// [`Error::Poisoned`] with the cause while poisoned, never without it
    /// (healed in between: `Ok`); one atomic load while healthy.
    pub(super) fn check(&self) -> Result<(), Error> {
        match self.is_poisoned().then(|| self.cause()).flatten() {
            Some(cause) => Err(Error::Poisoned { cause: Some(cause) }),
            None => Ok(()),
        }
    }

    pub(super) fn health(&self) -> Health {
        // The flag and the fault change together under the fault's lock: a
        // poisoned cell holds its fault.
        match (&*self.lock(), self.is_poisoned()) {
            (Some(f), true) if f.cause.heals() => Health::Degraded {
                cause: f.cause.clone(),
                since: f.since,
            },
            (Some(f), true) => Health::Failed {
                cause: f.cause.clone(),
            },
            _ => Health::Healthy,
        }
    }
}

/// What the last failed attempt to heal saw (one thread heals).
#[derive(Debug, Default)]
pub(super) struct Attempts {
    pub(super) last: Option<Instant>,
    pub(super) free_at_last: Option<u64>,
}

/// The file an operation was on, for the cause's message.
#[derive(Clone, Copy, Debug)]
pub(super) enum On {
    Store,
    Log,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cause(during: &'static str, kind: std::io::ErrorKind) -> Cause {
        Cause::new(
            during,
            Some("s.idem"),
            &Error::Io(std::io::Error::from(kind)),
        )
    }

    /// The first failure stays the cause until the poison is cleared; the
    /// refusal carries it; clearing hands back the fault that healed.
    #[test]
    fn the_first_cause_is_kept_until_cleared() {
        let cell = HealthCell::default();
        assert!(cell.check().is_ok() && !cell.is_poisoned());
        assert!(matches!(cell.health(), Health::Healthy));
        let t = Timestamp::from_millis(5);
        assert!(cell.poison(&cause("log append", std::io::ErrorKind::StorageFull), t));
        assert!(!cell.poison(&cause("checkpoint", std::io::ErrorKind::Other), t));
        assert!(cell.is_poisoned());
        let refused = cell.check();
        assert!(
            matches!(&refused, Err(Error::Poisoned { cause: Some(c) }) if c.during() == "log append"),
            "{refused:?}"
        );
        assert!(matches!(cell.health(), Health::Degraded { since, .. } if since == t));
        let healed = cell.clear();
        assert!(healed.is_some_and(|f| f.cause.during() == "log append"));
        assert!(cell.check().is_ok() && cell.cause().is_none());
        assert!(matches!(cell.health(), Health::Healthy));
    }

    /// Damage does not heal: the cell says Failed.
    #[test]
    fn damage_is_failed_not_degraded() {
        let cell = HealthCell::default();
        let damage = Cause::new("open", None, &Error::corrupt(None, "test damage"));
        cell.poison(&damage, Timestamp::from_millis(1));
        assert!(matches!(cell.health(), Health::Failed { .. }));
    }
}
