//! Time: [`Timestamp`] and the [`Clock`] that produces it.
//!
//! Every deadline is a [`Timestamp`] in milliseconds since the Unix epoch,
//! which is also how it is stored on disk. A store's operations never read
//! a clock: callers pass `now`, so tests are deterministic. A store is built
//! with one clock (for its own background work) and hands it to everything
//! built over it, so one time rules a store, its guard and its inbox.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time, in whole milliseconds since the Unix epoch (UTC).
///
/// ```
/// use idemstore::Timestamp;
/// use std::time::Duration;
///
/// let t = Timestamp::from_millis(1_000);
/// assert_eq!(t + Duration::from_secs(1), Timestamp::from_millis(2_000));
/// assert_eq!(t.as_millis(), 1_000);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The Unix epoch.
    pub const EPOCH: Timestamp = Timestamp(0);
    /// The latest representable time; additions saturate here.
    pub const MAX: Timestamp = Timestamp(u64::MAX);

    /// A timestamp `ms` milliseconds after the Unix epoch.
    ///
    /// ```
    /// assert_eq!(idemstore::Timestamp::from_millis(5).as_millis(), 5);
    /// ```
    pub const fn from_millis(ms: u64) -> Timestamp {
        Timestamp(ms)
    }

    /// Milliseconds since the Unix epoch.
    ///
    /// ```
    /// assert_eq!(idemstore::Timestamp::EPOCH.as_millis(), 0);
    /// ```
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// Converts a `SystemTime`; times before the epoch become the epoch.
    ///
    /// ```
    /// use idemstore::Timestamp;
    /// use std::time::{Duration, UNIX_EPOCH};
    /// let t = Timestamp::from_system_time(UNIX_EPOCH + Duration::from_millis(42));
    /// assert_eq!(t.as_millis(), 42);
    /// ```
    pub fn from_system_time(t: SystemTime) -> Timestamp {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timestamp(duration_millis(d)),
            Err(_) => Timestamp::EPOCH,
        }
    }

    /// This timestamp plus `d`, saturating at [`Timestamp::MAX`].
    ///
    /// ```
    /// use idemstore::Timestamp;
    /// use std::time::Duration;
    /// assert_eq!(Timestamp::MAX.saturating_add(Duration::from_secs(1)), Timestamp::MAX);
    /// ```
    pub fn saturating_add(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_add(duration_millis(d)))
    }

    /// The time from `self` until `later`, or zero when `later` is not after `self`.
    ///
    /// ```
    /// use idemstore::Timestamp;
    /// use std::time::Duration;
    /// let a = Timestamp::from_millis(1_000);
    /// assert_eq!(a.until(Timestamp::from_millis(1_500)), Duration::from_millis(500));
    /// assert_eq!(a.until(Timestamp::EPOCH), Duration::ZERO);
    /// ```
    pub fn until(self, later: Timestamp) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0))
    }

    /// The `SystemTime` this timestamp denotes.
    ///
    /// ```
    /// use idemstore::Timestamp;
    /// use std::time::UNIX_EPOCH;
    /// assert_eq!(Timestamp::EPOCH.to_system_time(), UNIX_EPOCH);
    /// ```
    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0)
    }
}

impl std::ops::Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, d: Duration) -> Timestamp {
        self.saturating_add(d)
    }
}

impl std::ops::Sub<Duration> for Timestamp {
    type Output = Timestamp;
    fn sub(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_sub(duration_millis(d)))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// Whole milliseconds in `d`, saturating at `u64::MAX`.
pub(crate) fn duration_millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A source of the current time.
///
/// The guard, the inbox, the sweeper and recovery at open read time only
/// through a `Clock`, so tests can drive leases and expiry with a
/// `ManualClock` (feature `test-util`).
///
/// **One clock per store.** A store is built with its clock (each store's
/// builder has a `clock` option; [`MemoryStore::with_clock`](crate::MemoryStore::with_clock);
/// [`SystemClock`] by default), and [`Store::clock`](crate::Store::clock)
/// hands it out: [`Guard::new`](crate::Guard::new), `Inbox::new` and
/// [`Sweeper::spawn`](crate::Sweeper::spawn) use the store's clock unless
/// given another one explicitly. So a test that injects a `ManualClock`
/// into the store builder drives the guard, recovery and sweeping with it,
/// and cannot get wall time for one of them by omission.
///
/// ```
/// use idemstore::{Clock, Fingerprint, Guard, Key, ManualClock, MemoryStore, Outcome, Response, SystemClock, Timestamp};
/// use std::{convert::Infallible, time::Duration};
///
/// assert!(SystemClock.now() > Timestamp::from_millis(1_600_000_000_000));
///
/// // The store is built with the clock; the guard over it reads the same one.
/// let clock = ManualClock::new(Timestamp::from_millis(0));
/// let guard = Guard::builder(MemoryStore::with_clock(clock.clone()))
///     .lease(Duration::from_secs(30))
///     .build()?;
/// let (key, fp) = (Key::new("", "order-1")?, Fingerprint::of(b"qty=1"));
/// let crashed = guard.run(&key, &fp, |_| Err::<Response, _>("owner died"));
/// assert!(matches!(crashed, Outcome::HandlerFailed(_)));
/// // The lease ends on the manual clock, not after 30 real seconds.
/// clock.advance(Duration::from_secs(30));
/// let retry = guard.run(&key, &fp, |_| Ok::<_, Infallible>(Response::new(201, "done")));
/// assert!(matches!(retry, Outcome::Executed(_)));
/// # Ok::<(), idemstore::Error>(())
/// ```
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The operating system's wall clock. The only place idemstore calls
/// `SystemTime::now()`.
///
/// A wall clock can jump backwards (NTP) or forwards; the store stays safe
/// either way because only the holder of the current fencing token may
/// complete a record (see [`Store::complete`](crate::Store::complete)).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_system_time(SystemTime::now())
    }
}

impl<C: Clock + ?Sized> Clock for std::sync::Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

#[cfg(any(test, feature = "test-util"))]
pub use manual::ManualClock;

#[cfg(any(test, feature = "test-util"))]
mod manual {
    use super::{Clock, Timestamp, duration_millis};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    /// A clock that moves only when told to (feature `test-util`). Clones share
    /// one time, so a test can hand a clone to a guard and keep one to advance.
    ///
    /// ```
    /// use idemstore::{Clock, ManualClock, Timestamp};
    /// use std::time::Duration;
    ///
    /// let clock = ManualClock::new(Timestamp::from_millis(1_000));
    /// let seen_by_guard = clock.clone();
    /// clock.advance(Duration::from_secs(2));
    /// assert_eq!(seen_by_guard.now(), Timestamp::from_millis(3_000));
    /// clock.set(Timestamp::from_millis(10)); // jump backwards
    /// assert_eq!(seen_by_guard.now(), Timestamp::from_millis(10));
    /// ```
    #[derive(Clone, Debug, Default)]
    pub struct ManualClock {
        ms: Arc<AtomicU64>,
    }

    impl ManualClock {
        /// A clock showing `start`.
        pub fn new(start: Timestamp) -> ManualClock {
            ManualClock {
                ms: Arc::new(AtomicU64::new(start.as_millis())),
            }
        }

        /// Moves the clock forwards by `d`.
        pub fn advance(&self, d: Duration) {
            self.ms.fetch_add(duration_millis(d), Ordering::SeqCst);
        }

        /// Sets the clock to `t`, forwards or backwards.
        pub fn set(&self, t: Timestamp) {
            self.ms.store(t.as_millis(), Ordering::SeqCst);
        }
    }

    impl Clock for ManualClock {
        fn now(&self) -> Timestamp {
            Timestamp::from_millis(self.ms.load(Ordering::SeqCst))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        assert_eq!(Timestamp::MAX + Duration::from_millis(1), Timestamp::MAX);
        assert_eq!(
            Timestamp::EPOCH - Duration::from_millis(1),
            Timestamp::EPOCH
        );
        assert_eq!(
            Timestamp::EPOCH + Duration::MAX,
            Timestamp::MAX,
            "a huge duration saturates instead of wrapping"
        );
    }

    #[test]
    fn pre_epoch_is_epoch() {
        let t = UNIX_EPOCH - Duration::from_secs(5);
        assert_eq!(Timestamp::from_system_time(t), Timestamp::EPOCH);
    }
}
