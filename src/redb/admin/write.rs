//! The admin's writes, each a direct transaction (`Shared::direct`): under
//! the commit lock, after the memtable is taken in, so what is written is
//! the latest state and no replay undoes it; a failed commit poisons.

use super::Admin;
use crate::codec;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::record::Record;

/// Records written per transaction by [`Admin::import`].
pub(crate) const IMPORT_BATCH: usize = 10_000;

/// What [`Admin::evict`] removed.
///
/// ```
/// fn damaged(evicted: &idemstore::redb::admin::Evicted) -> bool {
///     evicted.record.is_none()
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Evicted {
    /// The record, when it still decoded (`None` for a damaged one).
    pub record: Option<Record>,
    /// Index entries removed with it.
    pub index_entries: u64,
}

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
        self.store.shared.db.check_healthy()?;
        let key_bytes = codec::encode_key(key);
        self.store.shared.direct(|tables, _| {
            Ok::<_, Error>(
                tables
                    .evict(&key_bytes)?
                    .map(|(record, index_entries)| Evicted {
                        record,
                        index_entries,
                    }),
            )
        })
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
    /// is stored under their keys, 10,000 per transaction, and
    /// raises the token high-water mark to the largest imported token.
    /// Returns how many were written; the first `Err` item stops the import
    /// (the batches before it stay written). Each batch holds the commit
    /// lock: an operator's bulk load, not something to run beside traffic.
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
        self.store.shared.db.check_healthy()?;
        let mut hwm = self.facts()?.token_hwm;
        let mut written = 0u64;
        let mut records = records.into_iter().peekable();
        while records.peek().is_some() {
            self.store.shared.direct(|tables, token_hwm| {
                for item in records.by_ref().take(IMPORT_BATCH) {
                    let (key, record) = item?;
                    tables.apply(&codec::encode_key(&key), Some(&record))?;
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
