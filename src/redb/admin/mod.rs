//! Operator access to a store file (facts, raw scans, verify, evict,
//! import, the export line format), outside the [`Store`](crate::Store)
//! contract; the `idemstore` binary (package `idemstore-cli`) is built on
//! it, and [`RedbStore::check_log`]. Reads see the store file: what was
//! checkpointed ([`Admin::checkpoint`]). The example uses each reader
//! without an example of its own.
//!
//! ```
//! use idemstore::{Fingerprint, Key, RedbStore, Store, Timestamp};
//! use std::ops::ControlFlow;
//! # let dir = tempfile::tempdir()?;
//! let store = RedbStore::open(dir.path().join("orders.idem"))?;
//! let (hour, key) = (std::time::Duration::from_secs(3600), Key::new("t", "o-1")?);
//! store.begin(&key, &Fingerprint::of(b"x"), Timestamp::EPOCH, hour, hour)?;
//!
//! let admin = store.admin();
//! admin.checkpoint()?; // make the write part of the file
//! let facts = admin.facts()?;
//! assert_eq!((facts.records, facts.index_entries, facts.token_hwm), (1, 1, 1));
//! assert_eq!((facts.format_version, facts.store_id), (facts.supported_version, store.store_id()));
//! assert!(admin.verify(|_| {})?.is_clean());
//! assert!(admin.get_raw(&key)?.is_some());
//! let end = Timestamp::EPOCH + hour;
//! assert_eq!(admin.expiry_bounds()?, Some((end, end)));
//! assert_eq!((admin.count_due(end, 10)?, admin.count_due(Timestamp::EPOCH, 10)?), (1, 0));
//! admin.scan(|key, record| {
//!     assert_eq!(key.as_bytes(), b"\x01to-1");
//!     assert_eq!(key.decode().expect("valid"), Key::new("t", "o-1").expect("valid"));
//!     assert_eq!(key.to_string(), "t/o-1");
//!     assert!(record.is_ok());
//!     ControlFlow::Continue(())
//! })?;
//! # Ok::<(), idemstore::Error>(())
//! ```

mod line;
mod verify;

pub use line::{export_line, parse_line};
pub use verify::{Problem, ProblemKind, VerifyReport};

use super::RedbStore;
use super::damage::LossReport;
use super::file::engine_error;
use super::meta::{STORE_FORMAT_VERSION, check_format, read_meta_entries};
use super::open::log_to_read;
use super::overlay::open_overlay;
use super::record_log;
use super::recovery::{Found, boot_id, plan_log, walk_live};
use super::tables::{EXPIRY, RECORDS, ReadTables};
use crate::codec;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::record::Record;
use crate::time::Timestamp;
use ::redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata};
use std::fmt;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

/// Operator access to one open [`RedbStore`], from [`RedbStore::admin`]
/// (example: the [module](crate::redb::admin)'s).
#[derive(Clone, Copy, Debug)]
pub struct Admin<'a> {
    store: &'a RedbStore,
}

/// Store-wide facts from the meta table and the table sizes ([`Admin::facts`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Facts {
    /// The store format version written in the file.
    pub format_version: u32,
    /// The store format version this build writes (and the only one it reads).
    pub supported_version: u32,
    /// The store's id, as [`RedbStore::store_id`] returns it.
    pub store_id: u128,
    /// The largest fencing token ever handed out (the high-water mark).
    pub token_hwm: u64,
    /// Entries in the record table.
    pub records: u64,
    /// Entries in the expiry index.
    pub index_entries: u64,
}

/// A key as stored (`scope_len u8 | scope | id`), as [`Admin::scan`] passes
/// it (a damaged file may hold bytes that are not a valid [`Key`]). Its
/// `Display` is `scope/id` (escaped) when it decodes, else `0x` and hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawKey<'a> {
    bytes: &'a [u8],
}

impl<'a> RawKey<'a> {
    /// The stored bytes.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The [`Key`] these bytes store; [`Error::Corrupt`]
    /// when they do not decode to a valid one.
    pub fn decode(&self) -> Result<Key> {
        codec::decode_key(self.bytes)
    }
}

impl fmt::Display for RawKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&codec::printable_key(self.bytes))
    }
}

impl fmt::Debug for RawKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RawKey({self})")
    }
}

impl Admin<'_> {
    /// Writes what the memtable holds into the store file durably, so that
    /// the reads here see the writes made through the store API.
    pub fn checkpoint(&self) -> Result<()> {
        self.store.shared.flush()
    }

    /// Facts from the meta table and the table sizes; a missing or
    /// malformed meta entry is [`Error::Corrupt`].
    pub fn facts(&self) -> Result<Facts> {
        let db = self.store.shared.db.read_db()?;
        let txn = db.begin_read().map_err(engine_error)?;
        let meta = read_meta_entries(&txn)?;
        let records = txn.open_table(RECORDS).map_err(engine_error)?;
        let index = txn.open_table(EXPIRY).map_err(engine_error)?;
        Ok(Facts {
            format_version: meta.format_version,
            supported_version: STORE_FORMAT_VERSION,
            store_id: u128::from_be_bytes(meta.store_id),
            token_hwm: meta.token_hwm,
            records: records.len().map_err(engine_error)?,
            index_entries: index.len().map_err(engine_error)?,
        })
    }

    /// Calls `f` with every record in the store file, in key order, until
    /// it returns [`ControlFlow::Break`]; a record that does not verify is
    /// passed as its error, and expired ones not yet swept are included.
    pub fn scan(&self, f: impl FnMut(RawKey<'_>, Result<Record>) -> ControlFlow<()>) -> Result<()> {
        self.scan_prefix(&[], f)
    }

    /// [`scan`](Self::scan) over one scope's records (one key range);
    /// [`Error::InvalidKey`] for a scope too long.
    ///
    /// ```
    /// use idemstore::{Fingerprint, Key, RedbStore, Store, Timestamp};
    /// # let dir = tempfile::tempdir()?;
    /// let (store, hour) = (RedbStore::open(dir.path().join("s.idem"))?, std::time::Duration::from_secs(3600));
    /// for scope in ["a", "ab", "b"] {
    ///     store.begin(&Key::new(scope, "o-1")?, &Fingerprint::of(b"x"), Timestamp::EPOCH, hour, hour)?;
    /// }
    /// store.admin().checkpoint()?;
    /// let mut seen = Vec::new();
    /// store.admin().scan_scope("a", |key, _| {
    ///     seen.push(key.to_string());
    ///     std::ops::ControlFlow::Continue(())
    /// })?;
    /// assert_eq!(seen, ["a/o-1"]);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn scan_scope(
        &self,
        scope: impl AsRef<[u8]>,
        f: impl FnMut(RawKey<'_>, Result<Record>) -> ControlFlow<()>,
    ) -> Result<()> {
        let scope = scope.as_ref();
        // A key with the scope validates it.
        let mut prefix = codec::encode_key(&Key::new(scope, "x")?);
        prefix.truncate(1 + scope.len());
        self.scan_prefix(&prefix, f)
    }

    fn scan_prefix(
        &self,
        prefix: &[u8],
        mut f: impl FnMut(RawKey<'_>, Result<Record>) -> ControlFlow<()>,
    ) -> Result<()> {
        let db = self.store.shared.db.read_db()?;
        let txn = db.begin_read().map_err(engine_error)?;
        let table = txn.open_table(RECORDS).map_err(engine_error)?;
        for entry in table.range::<&[u8]>(prefix..).map_err(engine_error)? {
            let (k, v) = entry.map_err(engine_error)?;
            let key_bytes = k.value();
            if !key_bytes.starts_with(prefix) {
                break;
            }
            let record = codec::decode_record(key_bytes, v.value());
            if f(RawKey { bytes: key_bytes }, record).is_break() {
                break;
            }
        }
        Ok(())
    }

    /// The latest record for `key`, expired or not (unlike
    /// [`Store::get`](crate::Store::get)).
    pub fn get_raw(&self, key: &Key) -> Result<Option<Record>> {
        self.store.shared.read(&codec::encode_key(key))
    }

    /// The first and the last expiry in the expiry index, `None` when it is
    /// empty.
    pub fn expiry_bounds(&self) -> Result<Option<(Timestamp, Timestamp)>> {
        let db = self.store.shared.db.read_db()?;
        let txn = db.begin_read().map_err(engine_error)?;
        let expiry = txn.open_table(EXPIRY).map_err(engine_error)?;
        let first = expiry.first().map_err(engine_error)?;
        let last = expiry.last().map_err(engine_error)?;
        match (first, last) {
            (Some((a, _)), Some((b, _))) => Ok(Some((
                codec::decode_index(a.value())?.0,
                codec::decode_index(b.value())?.0,
            ))),
            _ => Ok(None),
        }
    }

    /// Expiry-index entries due at `now`, counted up to `limit`: what a
    /// sweep at `now` will visit.
    pub fn count_due(&self, now: Timestamp, limit: u64) -> Result<u64> {
        let db = self.store.shared.db.read_db()?;
        let mut n = 0u64;
        ReadTables::open(&db.begin_read().map_err(engine_error)?)?.due(now, |_| {
            n += 1;
            Ok(n < limit)
        })?;
        Ok(n)
    }
}

/// Records written per transaction by [`Admin::import`].
const IMPORT_BATCH: usize = 10_000;

/// What [`Admin::evict`] (see its example) removed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Evicted {
    /// The record, when it still decoded (`None` for a damaged one).
    pub record: Option<Record>,
    /// Index entries removed with it.
    pub index_entries: u64,
}

// The writes are direct transactions (`Shared::direct`): under the commit
// lock, after the memtable is taken in, so what is written is the latest
// state and no replay undoes it; a failed commit poisons.
impl Admin<'_> {
    /// Removes `key`'s record and its index entries, whatever its state,
    /// even when it no longer decodes; `Ok(None)` when there is none. A
    /// retry of an evicted key runs its side effect again.
    ///
    /// ```
    /// use idemstore::{Fingerprint, Key, RedbStore, Store, Timestamp};
    /// # let dir = tempfile::tempdir()?;
    /// let store = RedbStore::open(dir.path().join("s.idem"))?;
    /// let (key, hour) = (Key::new("t", "o-1")?, std::time::Duration::from_secs(3600));
    /// store.begin(&key, &Fingerprint::of(b"x"), Timestamp::EPOCH, hour, hour)?;
    /// let evicted = store.admin().evict(&key)?.expect("it was there");
    /// assert_eq!(evicted.index_entries, 1);
    /// assert!(store.admin().evict(&key)?.is_none());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn evict(&self, key: &Key) -> Result<Option<Evicted>> {
        let shared = &self.store.shared;
        shared.db.health.check()?;
        let key_bytes = codec::encode_key(key);
        let evicted = shared.direct(|tables, _| tables.evict(&key_bytes))?;
        Ok(evicted.map(|(record, index_entries)| Evicted {
            record,
            index_entries,
        }))
    }

    /// Raises the token high-water mark to at least `at_least`, durably,
    /// and returns it: a store that takes over another's records raises it
    /// to the other's mark, so no token the old store handed out is handed
    /// out again.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let store = idemstore::RedbStore::open(dir.path().join("s.idem"))?;
    /// assert_eq!(store.admin().raise_token_high_water_mark(41)?, 41);
    /// assert_eq!(store.admin().raise_token_high_water_mark(7)?, 41);
    /// assert_eq!(store.admin().facts()?.token_hwm, 41);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn raise_token_high_water_mark(&self, at_least: u64) -> Result<u64> {
        let stored = self.facts()?.token_hwm;
        if stored >= at_least {
            return Ok(stored);
        }
        self.store.shared.direct(|_, token_hwm| {
            *token_hwm = (*token_hwm).max(at_least);
            Ok::<_, Error>(*token_hwm)
        })
    }

    /// Writes `records` as they are (nothing is re-decided), replacing what
    /// is stored under their keys, 10,000 per transaction, and raises the
    /// token high-water mark to the largest imported token. Returns how many
    /// were written; the first `Err` item stops the import (the batches
    /// before it stay written). Each batch holds the commit lock: an
    /// operator's bulk load, not something to run beside traffic.
    ///
    /// ```
    /// use idemstore::redb::admin::{export_line, parse_line};
    /// use idemstore::{Fingerprint, Key, RedbStore, Store, Timestamp};
    /// # let dir = tempfile::tempdir()?;
    /// let (from, hour) = (RedbStore::open(dir.path().join("from.idem"))?, std::time::Duration::from_secs(3600));
    /// from.begin(&Key::new("t", "o-1")?, &Fingerprint::of(b"x"), Timestamp::EPOCH, hour, hour)?;
    /// from.admin().checkpoint()?;
    /// let mut lines = Vec::new();
    /// from.admin().scan(|key, record| {
    ///     lines.push(export_line(&key.decode().expect("key"), &record.expect("record")));
    ///     std::ops::ControlFlow::Continue(())
    /// })?;
    ///
    /// let to = RedbStore::open(dir.path().join("to.idem"))?;
    /// assert_eq!(to.admin().import(lines.iter().map(|l| parse_line(l)))?, 1);
    /// assert_eq!(to.admin().facts()?.token_hwm, from.admin().facts()?.token_hwm);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn import(&self, records: impl IntoIterator<Item = Result<(Key, Record)>>) -> Result<u64> {
        self.store.shared.db.health.check()?;
        let mut hwm = self.facts()?.token_hwm;
        let mut written = 0u64;
        let mut records = records.into_iter().peekable();
        while records.peek().is_some() {
            self.store.shared.direct(|tables, token_hwm| {
                for item in records.by_ref().take(IMPORT_BATCH) {
                    let (key, record) = item?;
                    tables.put(&codec::encode_key(&key), &record)?;
                    hwm = hwm.max(record.token);
                    written += 1;
                }
                *token_hwm = (*token_hwm).max(hwm);
                Ok::<_, Error>(())
            })?;
        }
        Ok(written)
    }
}

/// What [`RedbStore::check_log`] (see its example) found: the log's state
/// and every problem an open would refuse.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LogCheck {
    /// The log file (`<store>-wal`).
    pub path: PathBuf,
    /// The log file exists.
    pub present: bool,
    /// Its size in bytes (0 when missing).
    pub bytes: u64,
    /// Whether the store was last closed cleanly (the log holds nothing it
    /// needs); `None` when no open has recorded it.
    pub clean_stop: Option<bool>,
    /// Frames an open would replay.
    pub frames: u64,
    /// What an open would refuse, one line each.
    pub problems: Vec<String>,
}

impl LogCheck {
    /// An open would replay the log without refusing it (example:
    /// [`RedbStore::check_log`]).
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

impl RedbStore {
    /// Operator access to this store's file ([`admin`](crate::redb::admin)).
    pub fn admin(&self) -> Admin<'_> {
        Admin { store: self }
    }

    /// Checks the write-ahead log of the store at `store` as an open would
    /// replay it, reporting every problem instead of stopping at the first.
    /// Writes nothing and takes no lock: run it on a store no process holds,
    /// or on a copy. Errors: what an open would say about the store file.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let path = dir.path().join("s.idem");
    /// drop(idemstore::RedbStore::open(&path)?);
    /// let check = idemstore::RedbStore::check_log(&path)?;
    /// assert!(check.is_clean());
    /// assert_eq!(check.clean_stop, Some(true));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn check_log(store: impl AsRef<Path>) -> Result<LogCheck> {
        let store = store.as_ref();
        let db = open_overlay(store)?.map_err(|detail| {
            Error::corrupt(None, format!("{} is damaged: {detail}", store.display()))
        })?;
        let meta = read_meta_entries(&db.begin_read().map_err(engine_error)?)?;
        check_format(&meta)?;
        let log = log_to_read(store)?;
        let boot = boot_id();
        let found = Found {
            meta: &meta,
            boot: boot.as_deref(),
            name: store,
            heal: false,
        };
        let plan = plan_log(&db, log.as_ref(), &found)?;
        let mut problems: Vec<String> = plan.problems.iter().map(ToString::to_string).collect();
        // Every frame decoded but not applied; the walk goes on past problems.
        let mut loss = LossReport::default();
        let mut undecodable = Vec::new();
        let decode = |at, payload: &[u8]| {
            if let Err(e) = record_log::entries(at, payload, |_| Ok(())) {
                undecodable.push(e.to_string());
            }
            Ok(())
        };
        let (frames, another) = walk_live(log.as_ref(), &found, &plan, Some(&mut loss), decode)?;
        problems.extend(another.map(|d| d.to_string()));
        problems.append(&mut loss.findings);
        problems.append(&mut undecodable);
        let path = Self::log_path(store);
        Ok(LogCheck {
            present: path.exists(),
            path,
            bytes: plan.file_len,
            clean_stop: plan.clean_stop,
            frames,
            problems,
        })
    }

    /// The write-ahead log beside the store file `store` (`<store>-wal`); the
    /// two are copied, moved and deleted together.
    ///
    /// ```
    /// assert_eq!(idemstore::RedbStore::log_path("/data/orders.idem"), std::path::Path::new("/data/orders.idem-wal"));
    /// ```
    pub fn log_path(store: impl AsRef<Path>) -> PathBuf {
        super::file::log_path(store)
    }
}
