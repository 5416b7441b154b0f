//! Operator access to a store file (facts, raw scans, verify, evict,
//! import, the export line format), outside the [`Store`](crate::Store)
//! contract; the `idemstore` binary (package `idemstore-cli`) is built on
//! it. Reads see the store file: what was checkpointed ([`Admin::checkpoint`]).
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
mod log;
mod verify;
mod write;

pub use line::{export_line, parse_line};
pub use log::LogCheck;
pub use verify::{Problem, ProblemKind, VerifyReport};
pub use write::Evicted;

use super::RedbStore;
use super::file::engine_error;
use super::meta::STORE_FORMAT_VERSION;
use super::tables::{EXPIRY, RECORDS};
use crate::codec;
use crate::error::Result;
use crate::key::Key;
use crate::record::Record;
use crate::time::Timestamp;
use ::redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata};
use std::fmt;
use std::ops::ControlFlow;

impl RedbStore {
    /// Operator access to this store's file ([`admin`](crate::redb::admin)).
    ///
    /// ```
    /// fn records(store: &idemstore::RedbStore) -> idemstore::Result<u64> {
    ///     Ok(store.admin().facts()?.records)
    /// }
    /// ```
    pub fn admin(&self) -> Admin<'_> {
        Admin { store: self }
    }
}

/// Operator access to one open [`RedbStore`], from [`RedbStore::admin`].
///
/// ```
/// fn is_clean(admin: idemstore::redb::admin::Admin<'_>) -> idemstore::Result<bool> {
///     Ok(admin.verify(|_| {})?.is_clean())
/// }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Admin<'a> {
    store: &'a RedbStore,
}

/// Store-wide facts from the meta table and the table sizes ([`Admin::facts`]).
///
/// ```
/// fn hwm(facts: &idemstore::redb::admin::Facts) -> u64 {
///     facts.token_hwm
/// }
/// ```
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
///
/// ```
/// fn show(key: idemstore::redb::admin::RawKey<'_>) -> String {
///     key.to_string()
/// }
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawKey<'a> {
    bytes: &'a [u8],
}

impl<'a> RawKey<'a> {
    /// The stored bytes.
    ///
    /// ```
    /// # use idemstore::redb::admin::RawKey;
    /// fn first_byte(key: RawKey<'_>) -> Option<u8> {
    ///     key.as_bytes().first().copied() // the scope's length
    /// }
    /// ```
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The [`Key`] these bytes store; [`Error::Corrupt`](crate::Error::Corrupt)
    /// when they do not decode to a valid one.
    ///
    /// ```
    /// # use idemstore::redb::admin::RawKey;
    /// fn scope_of(key: RawKey<'_>) -> idemstore::Result<Vec<u8>> {
    ///     Ok(key.decode()?.scope().to_vec())
    /// }
    /// ```
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
    /// the reads here see the writes made through the store API (see the
    /// [module](crate::redb::admin) example).
    ///
    /// ```
    /// # fn f(store: &idemstore::RedbStore) -> idemstore::Result<()> {
    /// store.admin().checkpoint()
    /// # }
    /// ```
    pub fn checkpoint(&self) -> Result<()> {
        self.store.shared.flush()
    }

    /// Facts from the meta table and the table sizes; a missing or
    /// malformed meta entry is [`Error::Corrupt`](crate::Error::Corrupt).
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let store = idemstore::RedbStore::open(dir.path().join("s.idem"))?;
    /// assert_eq!(store.admin().facts()?.records, 0);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn facts(&self) -> Result<Facts> {
        let db = self.store.shared.db.read_db()?;
        let txn = db.begin_read().map_err(engine_error)?;
        let meta = super::meta::read_meta_entries(&txn)?;
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
    ///
    /// ```
    /// # fn f(store: &idemstore::RedbStore) -> idemstore::Result<()> {
    /// let mut damaged = 0;
    /// store.admin().scan(|_key, record| {
    ///     damaged += u32::from(record.is_err());
    ///     std::ops::ControlFlow::Continue(())
    /// })
    /// # }
    /// ```
    pub fn scan(&self, f: impl FnMut(RawKey<'_>, Result<Record>) -> ControlFlow<()>) -> Result<()> {
        self.scan_prefix(&[], f)
    }

    /// [`scan`](Self::scan) over one scope's records (one key range);
    /// [`Error::InvalidKey`](crate::Error::InvalidKey) for a scope too long.
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
    ///
    /// ```
    /// # fn f(store: &idemstore::RedbStore) -> idemstore::Result<()> {
    /// let record = store.admin().get_raw(&idemstore::Key::new("t", "o-1")?)?;
    /// # Ok(()) }
    /// ```
    pub fn get_raw(&self, key: &Key) -> Result<Option<Record>> {
        self.store.shared.read(&codec::encode_key(key))
    }

    /// The first and the last expiry in the expiry index, `None` when it is
    /// empty.
    ///
    /// ```
    /// # fn f(store: &idemstore::RedbStore) -> idemstore::Result<()> {
    /// if let Some((first, last)) = store.admin().expiry_bounds()? {
    ///     println!("records expire from {first:?} to {last:?}");
    /// }
    /// # Ok(()) }
    /// ```
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
    ///
    /// ```
    /// # fn f(store: &idemstore::RedbStore) -> idemstore::Result<u64> {
    /// store.admin().count_due(idemstore::Timestamp::from_millis(1_000), u64::MAX)
    /// # }
    /// ```
    pub fn count_due(&self, now: Timestamp, limit: u64) -> Result<u64> {
        let db = self.store.shared.db.read_db()?;
        let txn = db.begin_read().map_err(engine_error)?;
        let expiry = txn.open_table(EXPIRY).map_err(engine_error)?;
        // Entries are expires_at BE | key.
        let bound = now.as_millis().saturating_add(1).to_be_bytes();
        let mut n = 0u64;
        for entry in expiry
            .range::<&[u8]>(..bound.as_slice())
            .map_err(engine_error)?
        {
            entry.map_err(engine_error)?;
            n += 1;
            if n >= limit {
                break;
            }
        }
        Ok(n)
    }
}
