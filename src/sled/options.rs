//! Opening options: the builder, whose [`open`](SledStoreBuilder::open)
//! checks, locks and opens the directory.

use super::durable::{DiskSync, Durability};
use super::group::GroupSync;
use super::marker::{self, Marker};
use super::open::{self, EXPIRY_TREE, META_TREE, RECORDS_TREE, STORE_FORMAT_VERSION};
use super::{Inner, SledStore};
use crate::error::Result;
use crate::response::{DEFAULT_MAX_BODY_BYTES, check_body_limit};
use crate::sweeper::{Sweeper, SweeperConfig};
use crate::time::{Clock, SystemClock};
#[cfg(doc)]
use crate::{error::Error, store::Store};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// How a [`SledStore`] is opened: [`SledStore::builder`].
///
/// ```
/// use idemstore::{SledStore, SweeperConfig};
/// use idemstore::sled::Durability;
/// use std::time::Duration;
///
/// let dir = tempfile::tempdir()?;
/// let store = SledStore::builder()
///     .durability(Durability::Immediate)
///     .max_body_bytes(256 * 1024)
///     .sweeper(SweeperConfig::default().interval(Duration::from_secs(30)))
///     .open(dir.path())?;
/// assert_eq!(store.durability(), Durability::Immediate);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until `open` is called"]
pub struct SledStoreBuilder {
    durability: Durability,
    max_body_bytes: usize,
    sweeper: Option<SweeperConfig>,
    clock: Arc<dyn Clock>,
}

impl SledStoreBuilder {
    /// The defaults.
    pub(super) fn new() -> SledStoreBuilder {
        SledStoreBuilder {
            durability: Durability::default(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            sweeper: None,
            clock: Arc::new(SystemClock),
        }
    }

    /// The durability level (default [`Durability::Immediate`]).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// The largest response body the store accepts (default
    /// [`DEFAULT_MAX_BODY_BYTES`], at most
    /// [`MAX_BODY_BYTES_HARD_CAP`](crate::limits::MAX_BODY_BYTES_HARD_CAP), checked by `open`).
    pub fn max_body_bytes(mut self, max_body_bytes: usize) -> Self {
        self.max_body_bytes = max_body_bytes;
        self
    }

    /// Runs a background [`Sweeper`] with this configuration while the store
    /// is open (default: none; call [`Store::sweep_expired`] yourself).
    pub fn sweeper(mut self, config: SweeperConfig) -> Self {
        self.sweeper = Some(config);
        self
    }

    /// The store's clock (default [`SystemClock`]): the background sweeper
    /// reads it, and [`Store::clock`] hands it to a
    /// [`Guard`](crate::Guard) over the store. The store's operations take
    /// `now` from their caller.
    ///
    /// ```
    /// use idemstore::{Guard, ManualClock, SledStore, Timestamp};
    /// let dir = tempfile::tempdir()?;
    /// let clock = ManualClock::new(Timestamp::from_millis(42));
    /// let store = SledStore::builder().clock(clock.clone()).open(dir.path())?;
    /// assert_eq!(Guard::new(store).now(), Timestamp::from_millis(42));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Opens (or creates) the store.
    ///
    /// Errors: [`Error::Locked`] when another open store holds the
    /// directory; [`Error::Corrupt`] for a path that is not an idemstore
    /// store (a file, a non-empty directory without a sled data file, a
    /// sled database without idemstore's meta tree: nothing is written to
    /// it), as `RedbStore` does for foreign files;
    /// [`Error::UnsupportedFormat`] for a store written by a newer format;
    /// [`Error::Corrupt`] also when sled or the meta tree finds damage, or when
    /// sled recovered less than the store held at its last open or clean
    /// close (sled opens a damaged log as a shorter or empty one, silently;
    /// the `idemstore.meta` file beside it notices).
    pub fn open(self, path: impl AsRef<Path>) -> Result<SledStore> {
        let path = path.as_ref();
        let max_body_bytes = check_body_limit(self.max_body_bytes)?;
        open::check_directory(path)?;
        let lock = open::lock(path)?;
        let recorded = marker::read(path)?;
        let db = open::open_sled(path)?;
        if let (Some(recorded), false) = (recorded, open::has_meta_tree(&db)) {
            // sled recovered nothing of ours, yet the marker says a store
            // lived here: refuse before creating any tree.
            return Err(marker::lost_everything(path, recorded));
        }
        open::check_foreign(&db)?;
        let tree = |name: &[u8]| db.open_tree(name).map_err(super::errors::from_sled);
        let (meta, records, expiry) = (tree(META_TREE)?, tree(RECORDS_TREE)?, tree(EXPIRY_TREE)?);
        let found = match (open::read_meta(&meta, &records, &expiry)?, recorded) {
            (Some(found), Some(recorded)) => {
                marker::check(path, recorded, found.store_id, found.last_token)?;
                found
            }
            (Some(found), None) => found,
            (None, Some(recorded)) => return Err(marker::lost_everything(path, recorded)),
            (None, None) => open::init_meta(&meta)?,
        };
        let disk = DiskSync::open(path, self.durability)?;
        // Whatever open wrote (trees, a fresh meta), and what an earlier
        // session left unsynced at `OsBuffered`, is durable before the first
        // answer, and before the marker vouches for it.
        disk.sync_now(&db)?;
        marker::write(
            path,
            Marker {
                format: STORE_FORMAT_VERSION,
                store_id: found.store_id,
                last_token: found.last_token,
            },
        )?;
        let inner = Arc::new(Inner {
            db,
            records,
            expiry,
            meta,
            disk,
            group: GroupSync::default(),
            writer: Mutex::new(found.last_token),
            durability: self.durability,
            max_body_bytes,
            store_id: found.store_id,
            path: path.to_path_buf(),
            _lock: lock,
        });
        let sweeper = match self.sweeper {
            None => None,
            Some(config) => {
                let swept = Arc::clone(&inner);
                Some(Sweeper::spawn_fn(
                    "idemstore-sled-sweeper",
                    Arc::clone(&self.clock),
                    config,
                    move |now, max| swept.sweep_expired(now, max),
                )?)
            }
        };
        Ok(SledStore {
            sweeper,
            inner,
            clock: self.clock,
        })
    }
}
