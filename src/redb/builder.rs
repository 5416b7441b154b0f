//! [`RedbStoreBuilder`]: a store's options, checked, and the opens.

use super::{Config, Durability, RecoveryPolicy, RedbStore, open, record_log::MIN_WAL_BYTES};
use crate::error::{Error, Result};
use crate::response::{DEFAULT_MAX_BODY_BYTES, check_body_limit};
use crate::sweeper::SweeperConfig;
use crate::time::{Clock, SystemClock};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Options for opening a [`RedbStore`]; from [`RedbStore::builder`]. The
/// example shows each option without one of its own.
///
/// ```
/// use idemstore::{Guard, ManualClock, RedbStore, SweeperConfig, Timestamp};
/// use idemstore::redb::{Durability, RecoveryPolicy};
/// use std::time::Duration;
///
/// # let dir = tempfile::tempdir()?;
/// let store = RedbStore::builder()
///     .durability(Durability::Immediate)
///     .cache_bytes(16 << 20)
///     .max_body_bytes(64 * 1024)
///     .recovery(RecoveryPolicy::ExpireLeases)
///     .sweeper(SweeperConfig::default().interval(Duration::from_secs(30)))
///     .clock(ManualClock::new(Timestamp::from_millis(42)))
///     .verify_on_open(true)
///     .checkpoint_interval(Duration::from_secs(2))
///     .log_bytes(1 << 20)
///     .open(dir.path().join("orders.idem"))?;
/// assert_eq!(std::fs::metadata(dir.path().join("orders.idem-wal"))?.len(), 1 << 20);
/// assert_eq!(store.sweeper().map(|s| s.swept()), Some(0));
/// assert_eq!(store.stats().leases_expired_on_open, 0);
/// assert_eq!(Guard::new(store).now(), Timestamp::from_millis(42));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Default)]
#[must_use = "a builder does nothing until `open`"]
pub struct RedbStoreBuilder {
    pub(super) config: Config,
}

/// redb's page cache unless [`RedbStoreBuilder::cache_bytes`] says otherwise.
const DEFAULT_CACHE_BYTES: usize = 64 * 1024 * 1024;

impl Default for Config {
    fn default() -> Self {
        Config {
            durability: Durability::Immediate,
            cache_bytes: DEFAULT_CACHE_BYTES,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            recovery: RecoveryPolicy::WaitForLease,
            sweeper: None,
            clock: Arc::new(SystemClock),
            verify_on_open: false,
            checkpoint_interval: super::record_log::CHECKPOINT_INTERVAL,
            log_bytes: super::record_log::WAL_BYTES,
            accept_loss: false,
            read_only: false,
        }
    }
}

impl RedbStoreBuilder {
    /// What an acknowledged write survives; [`Durability::Immediate`] by default.
    pub fn durability(mut self, durability: Durability) -> Self {
        self.config.durability = durability;
        self
    }
    /// redb's page cache, in bytes (64 MiB by default).
    pub fn cache_bytes(mut self, bytes: usize) -> Self {
        self.config.cache_bytes = bytes;
        self
    }
    /// The largest response body stored ([`DEFAULT_MAX_BODY_BYTES`](crate::limits::DEFAULT_MAX_BODY_BYTES)
    /// by default, at most [`MAX_BODY_BYTES_HARD_CAP`](crate::limits::MAX_BODY_BYTES_HARD_CAP)).
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.config.max_body_bytes = bytes;
        self
    }
    /// What opening does with PROCESSING records ([`RecoveryPolicy::WaitForLease`] by default).
    pub fn recovery(mut self, policy: RecoveryPolicy) -> Self {
        self.config.recovery = policy;
        self
    }
    /// Runs a background [`Sweeper`](crate::Sweeper) with this configuration for the life
    /// of the store (none by default: call [`Store::sweep_expired`](crate::Store::sweep_expired) yourself).
    pub fn sweeper(mut self, config: SweeperConfig) -> Self {
        self.config.sweeper = Some(config);
        self
    }
    /// The store's clock ([`SystemClock`] by default), for the sweeper, the
    /// recovery policy, and a [`Guard`](crate::Guard) or an
    /// [`Inbox`](crate::redb::Inbox) over the store.
    pub fn clock(mut self, clock: impl Clock + 'static) -> Self {
        self.config.clock = Arc::new(clock);
        self
    }
    /// Verifies every page's checksum at open (reads the whole file); off
    /// by default.
    pub fn verify_on_open(mut self, verify: bool) -> Self {
        self.config.verify_on_open = verify;
        self
    }
    /// Longest time a logged write waits for its checkpoint into the store
    /// file (500 ms by default; under a millisecond is refused). Longer
    /// means fewer checkpoints and more log to replay at an open after a
    /// crash.
    pub fn checkpoint_interval(mut self, interval: Duration) -> Self {
        self.config.checkpoint_interval = interval;
        self
    }
    /// Size of the write-ahead log file (8 MiB by default, at least 16 KiB):
    /// two segments; a full one starts a checkpoint.
    pub fn log_bytes(mut self, bytes: u64) -> Self {
        self.config.log_bytes = bytes;
        self
    }
    /// Where an open would refuse a damaged or incomplete write-ahead log
    /// ([`Error::Corrupt`](crate::Error::Corrupt)), open with whatever
    /// verifies and say what was given up in
    /// [`RedbStore::loss_report`](crate::RedbStore::loss_report). Off by
    /// default: an operator's choice for one open (`docs/operations.md`).
    ///
    /// ```
    /// # fn f(path: &std::path::Path) -> idemstore::Result<()> {
    /// let store = idemstore::RedbStore::builder().accept_loss(true).open(path)?;
    /// if let Some(report) = store.loss_report() {
    ///     eprintln!("opened with loss:\n{report}");
    /// }
    /// # Ok(()) }
    /// ```
    pub fn accept_loss(mut self, accept: bool) -> Self {
        self.config.accept_loss = accept;
        self
    }
    /// Opens the store file at `path`, creating it (mode 0600 on Unix) if it
    /// does not exist (example: [`RedbStoreBuilder`]). Errors, none of which touch the file:
    /// [`Error::Locked`] when another open store holds it; [`Error::Corrupt`]
    /// for a foreign or damaged file; [`Error::UnsupportedFormat`] for
    /// another format version.
    pub fn open(self, path: impl AsRef<Path>) -> Result<RedbStore> {
        let path = path.as_ref();
        self.check()?;
        let opened = open::open_path(path, &self.config)?;
        RedbStore::start(opened, self.config, Some(path.to_path_buf()))
    }

    /// Opens the existing store file at `path` for reading only (an
    /// inspection, a backup, a file the caller may not write). No byte of
    /// either file changes and no file is created: recovery and the log's
    /// replay happen in memory, so the view holds everything a writer's open
    /// would. Every write (a claiming `begin`, `complete`, `release`, sweeps,
    /// [`compact`](RedbStore::compact), evict, import, an [`Inbox`]) is
    /// [`Error::ReadOnly`]; the cache size, the clock and
    /// [`accept_loss`](Self::accept_loss) apply, and no lease ends.
    ///
    /// It holds a shared lock: writers' opens are [`Error::Locked`]
    /// meanwhile, and so is this open while a writer holds the file. A
    /// missing file is [`Error::Io`] (`NotFound`); an empty, foreign or
    /// damaged one, or a log an open would refuse, is [`Error::Corrupt`];
    /// another format is [`Error::UnsupportedFormat`].
    ///
    /// ```
    /// use idemstore::{Error, Fingerprint, Key, RedbStore, Store, Timestamp};
    /// # let dir = tempfile::tempdir()?;
    /// let (path, hour) = (dir.path().join("orders.idem"), std::time::Duration::from_secs(3600));
    /// let begin = |store: &RedbStore, id| store.begin(&Key::new("t", id)?, &Fingerprint::of(b"x"), Timestamp::EPOCH, hour, hour);
    /// begin(&RedbStore::open(&path)?, "order-1")?; // the store is dropped: closed
    /// let before = std::fs::read(&path)?;
    ///
    /// let view = RedbStore::builder().open_read_only(&path)?;
    /// assert!(view.is_read_only() && view.admin().get_raw(&Key::new("t", "order-1")?)?.is_some());
    /// assert!(matches!(begin(&view, "order-2"), Err(Error::ReadOnly { .. })));
    /// drop(view);
    /// assert_eq!(std::fs::read(&path)?, before, "not a byte changed");
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    ///
    /// [`Inbox`]: crate::redb::Inbox
    pub fn open_read_only(mut self, path: impl AsRef<Path>) -> Result<RedbStore> {
        let path = path.as_ref();
        self.check()?;
        self.config.read_only = true;
        self.config.sweeper = None;
        self.config.verify_on_open = false;
        let opened = open::open_read_only(path, &self.config)?;
        RedbStore::start(opened, self.config, Some(path.to_path_buf()))
    }

    /// Opens a store over redb [`StorageBackend`](::redb::StorageBackend)s,
    /// the store file on `backend` and its write-ahead log on `log` (both of
    /// the same store): the seam for simulated power loss and custom
    /// storage. It follows redb's major version.
    ///
    /// ```
    /// use idemstore::RedbStore;
    /// use redb::backends::InMemoryBackend;
    /// let store = RedbStore::builder().open_backend(InMemoryBackend::new(), InMemoryBackend::new())?;
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn open_backend(
        self,
        backend: impl ::redb::StorageBackend,
        log: impl ::redb::StorageBackend,
    ) -> Result<RedbStore> {
        use super::file::{Origin, SharedBackend};
        self.check()?;
        let name = Path::new(super::file::BACKEND);
        // Kept, shared with the engine, so that a heal can open it again.
        let store: Arc<dyn ::redb::StorageBackend> = Arc::new(backend);
        let shared = SharedBackend(Arc::clone(&store));
        let mut opened = open::open_backend(shared, Box::new(log), None, &self.config, name)?;
        opened.source = Origin::Backend(store);
        RedbStore::start(opened, self.config, None)
    }

    fn check(&self) -> Result<()> {
        check_body_limit(self.config.max_body_bytes)?;
        if let Durability::Periodic { max_loss } = self.config.durability
            && max_loss.as_millis() == 0
        {
            return Err(Error::invalid_argument(
                "Durability::Periodic needs a loss window of at least 1 ms",
            ));
        }
        if self.config.log_bytes < MIN_WAL_BYTES {
            return Err(Error::invalid_argument(format!(
                "the write-ahead log must be at least {MIN_WAL_BYTES} bytes, not {}",
                self.config.log_bytes
            )));
        }
        if self.config.checkpoint_interval.as_millis() == 0 {
            return Err(Error::invalid_argument(
                "the checkpoint interval must be at least 1 ms",
            ));
        }
        Ok(())
    }
}
