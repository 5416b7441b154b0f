//! The three tables of a store file (`idemstore.records`, `.expiry`,
//! `.meta`; layouts in `docs/format.md`) and the helpers that keep a record
//! and its expiry-index entry moving together. The `idemstore.` prefix lets
//! a caller's own tables share the file (the inbox) without a clash.

use super::file::engine_error;
use crate::codec;
use crate::error::Result;
use crate::record::Record;
use crate::time::Timestamp;
use ::redb::{
    Database, ReadOnlyTable, ReadTransaction, ReadableTable, Table, TableDefinition,
    WriteTransaction,
};

/// Records by key.
pub(crate) const RECORDS: TableDefinition<'static, &'static [u8], &'static [u8]> =
    TableDefinition::new("idemstore.records");
/// The expiry index: one entry per record, `(expires_at BE, key)`.
pub(crate) const EXPIRY: TableDefinition<'static, &'static [u8], ()> =
    TableDefinition::new("idemstore.expiry");
/// Store-wide facts.
pub(crate) const META: TableDefinition<'static, &'static str, &'static [u8]> =
    TableDefinition::new("idemstore.meta");

/// Meta key: the store format version, u32 BE.
pub(crate) const META_FORMAT_VERSION: &str = "format_version";
/// Meta key: 16 bytes naming this store file for its life.
pub(crate) const META_STORE_ID: &str = "store_id";
/// Meta key: the largest fencing token ever handed out, u64 BE.
pub(crate) const META_TOKEN_HWM: &str = "token_high_water_mark";
/// Meta key: the log's durable epoch, u64 BE (`record_log/`); absent: 0.
pub(crate) const META_LOG_EPOCH: &str = "wal_epoch";
/// Meta key: [`LOG_OPEN`] from the open that recovered the log until a
/// clean close's last durable commit stores [`LOG_CLOSED`].
pub(crate) const META_LOG_STATE: &str = "wal_state";
/// Meta key: the log file's size as its last open left it (u64 BE), which
/// fixes its segments' layout; after an unclean stop the log must have it.
pub(crate) const META_LOG_BYTES: &str = "wal_bytes";
/// Meta key: the boot id when the log was opened from a file (Linux): an
/// open in the same boot follows a process crash, not a power loss.
pub(crate) const META_LOG_BOOT: &str = "wal_boot_id";
/// [`META_LOG_STATE`]: not closed cleanly since its log was opened.
pub(crate) const LOG_OPEN: u8 = 0;
/// [`META_LOG_STATE`]: the last close put everything in this file.
pub(crate) const LOG_CLOSED: u8 = 1;

/// The one way into redb: `write` runs in a write transaction with the
/// tables open, which then commits durably (`fsync` before this returns).
/// Quick-repair on: two fsyncs, and an open after a crash does not walk
/// the file; off (an inbox's choice): one fsync, as durable.
///
/// `Err`: the engine failed (to begin, or to commit: the commit may or may
/// not be on disk). `Ok(Err)`: `write` refused, nothing was written.
pub(super) fn commit<T, E>(
    db: &Database,
    quick_repair: bool,
    write: impl FnOnce(&mut WriteTables<'_>) -> std::result::Result<T, E>,
) -> Result<std::result::Result<T, E>> {
    let mut txn = db.begin_write().map_err(engine_error)?;
    txn.set_durability(::redb::Durability::Immediate)
        .map_err(engine_error)?;
    txn.set_quick_repair(quick_repair);
    // The tables close at the end of the statement, before the commit.
    let out = write(&mut WriteTables::open(&txn)?);
    if out.is_ok() {
        txn.commit().map_err(engine_error)?;
    }
    Ok(out)
}

/// The tables of a write transaction ([`commit`]).
pub(super) struct WriteTables<'txn> {
    /// The transaction, for the inbox's handler (its own tables).
    pub(super) txn: &'txn WriteTransaction,
    records: Table<'txn, &'static [u8], &'static [u8]>,
    expiry: Table<'txn, &'static [u8], ()>,
    meta: Table<'txn, &'static str, &'static [u8]>,
}

impl<'txn> WriteTables<'txn> {
    fn open(txn: &'txn WriteTransaction) -> Result<WriteTables<'txn>> {
        Ok(WriteTables {
            txn,
            records: txn.open_table(RECORDS).map_err(engine_error)?,
            expiry: txn.open_table(EXPIRY).map_err(engine_error)?,
            meta: txn.open_table(META).map_err(engine_error)?,
        })
    }

    pub(super) fn set_meta(&mut self, name: &str, value: &[u8]) -> Result<()> {
        self.meta.insert(name, value).map_err(engine_error)?;
        Ok(())
    }

    pub(super) fn remove_meta(&mut self, name: &str) -> Result<()> {
        self.meta.remove(name).map_err(engine_error)?;
        Ok(())
    }

    /// Writes a memtable's records, the bytes their log frames hold, in
    /// key order (each insert then lands beside the last in redb's tree).
    pub(super) fn take_in(&mut self, records: &super::memtable::Table) -> Result<()> {
        let mut sorted: Vec<_> = records.iter().collect();
        sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (key, entry) in sorted {
            self.apply_encoded(key, entry.as_ref().map(|e| (&e.value[..], e.expires_at)))?;
        }
        Ok(())
    }

    /// Stores the token high-water mark and `next_epoch` as the log's
    /// durable epoch, which retires every frame of the epochs before it
    /// (their records are in this commit).
    pub(super) fn retire(&mut self, token_hwm: u64, next_epoch: u64) -> Result<()> {
        self.set_meta(META_TOKEN_HWM, &token_hwm.to_be_bytes())?;
        self.set_meta(META_LOG_EPOCH, &next_epoch.to_be_bytes())
    }

    /// Stores `record` as the latest state of `key_bytes`, encoded (and
    /// checked) before the first write, so an encoding failure writes nothing.
    pub(super) fn put(&mut self, key_bytes: &[u8], record: &Record) -> Result<()> {
        let value = codec::encode_record(record)?;
        self.apply_encoded(key_bytes, Some((&value, record.expires_at)))
    }

    /// Stores an encoded record (`None`: a deletion) as the latest state of
    /// `key_bytes`, moving its expiry-index entry: how every writer keeps a
    /// record and its index entry together. A stored record that does not
    /// decode is replaced; its unknown index entry is left to the sweep,
    /// which re-checks every entry it finds.
    pub(super) fn apply_encoded(
        &mut self,
        key_bytes: &[u8],
        entry: Option<(&[u8], Timestamp)>,
    ) -> Result<()> {
        let old = match entry {
            Some((value, _)) => self.records.insert(key_bytes, value),
            None => self.records.remove(key_bytes),
        }
        .map_err(engine_error)?
        .and_then(|v| codec::decode_record(key_bytes, v.value()).ok())
        .map(|r| r.expires_at);
        let new = entry.map(|(_, expires_at)| expires_at);
        if old == new {
            return Ok(());
        }
        if let Some(old) = old {
            let index_key = codec::encode_index(old, key_bytes);
            self.expiry.remove(&index_key[..]).map_err(engine_error)?;
        }
        if let Some(new) = new {
            let index_key = codec::encode_index(new, key_bytes);
            self.expiry
                .insert(&index_key[..], ())
                .map_err(engine_error)?;
        }
        Ok(())
    }

    /// Every `(key bytes, record)` pair, for the open-time recovery pass.
    pub(super) fn all(&self) -> Result<Vec<(Vec<u8>, Record)>> {
        let mut out = Vec::new();
        for entry in self.records.iter().map_err(engine_error)? {
            let (k, v) = entry.map_err(engine_error)?;
            let key_bytes = k.value().to_vec();
            let record = codec::decode_record(&key_bytes, v.value())?;
            out.push((key_bytes, record));
        }
        Ok(out)
    }

    /// Removes `key_bytes`' record and its index entries: `None` when there
    /// was none, else the record (`None` if it did not decode: its index
    /// entries are then found by a scan) and how many entries went.
    pub(super) fn evict(&mut self, key_bytes: &[u8]) -> Result<Option<(Option<Record>, u64)>> {
        let Some(value) = self.records.remove(key_bytes).map_err(engine_error)? else {
            return Ok(None);
        };
        let record = codec::decode_record(key_bytes, value.value()).ok();
        drop(value);
        let stale: Vec<Vec<u8>> = match &record {
            Some(r) => vec![codec::encode_index(r.expires_at, key_bytes)],
            None => {
                let mut found = Vec::new();
                for entry in self.expiry.iter().map_err(engine_error)? {
                    let (k, _) = entry.map_err(engine_error)?;
                    if matches!(codec::decode_index(k.value()), Ok((_, kb)) if kb == key_bytes) {
                        found.push(k.value().to_vec());
                    }
                }
                found
            }
        };
        let mut removed = 0;
        for index_key in stale {
            let gone = self.expiry.remove(index_key.as_slice());
            removed += u64::from(gone.map_err(engine_error)?.is_some());
        }
        Ok(Some((record, removed)))
    }

    /// The stored record for `key_bytes` in this transaction (the inbox's
    /// decisions), verified.
    pub(super) fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>> {
        read_from(&self.records, key_bytes)
    }
}

/// The stored record for `key_bytes`, verified ([`Error::Corrupt`](crate::Error::Corrupt) if not).
fn read_from(
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    key_bytes: &[u8],
) -> Result<Option<Record>> {
    match records.get(key_bytes).map_err(engine_error)? {
        Some(guard) => Ok(Some(codec::decode_record(key_bytes, guard.value())?)),
        None => Ok(None),
    }
}

/// The record and index tables of one read transaction: the kept snapshot
/// (db.rs), where a group's decisions read what redb holds.
pub(super) struct ReadTables {
    records: ReadOnlyTable<&'static [u8], &'static [u8]>,
    expiry: ReadOnlyTable<&'static [u8], ()>,
}

impl ReadTables {
    pub(super) fn open(txn: &ReadTransaction) -> Result<ReadTables> {
        Ok(ReadTables {
            records: txn.open_table(RECORDS).map_err(engine_error)?,
            expiry: txn.open_table(EXPIRY).map_err(engine_error)?,
        })
    }

    /// The stored record for `key_bytes`, verified.
    pub(super) fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>> {
        read_from(&self.records, key_bytes)
    }

    /// Calls `f` with each index entry of an expiry at or before `now`,
    /// oldest first, while it returns `true`.
    pub(super) fn due(
        &self,
        now: Timestamp,
        mut f: impl FnMut(&[u8]) -> Result<bool>,
    ) -> Result<()> {
        // Every index entry of an expiry <= now sorts before this bound:
        // entries are (expires_at BE | key) and the bound is (now + 1 BE).
        let bound = now.as_millis().saturating_add(1).to_be_bytes();
        for entry in self
            .expiry
            .range::<&[u8]>(..bound.as_slice())
            .map_err(engine_error)?
        {
            let (index_key, _) = entry.map_err(engine_error)?;
            if !f(index_key.value())? {
                break;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Result, WriteTables, engine_error};

    impl WriteTables<'_> {
        /// Adds one index entry without its record (a test's damage).
        pub(in crate::redb) fn index(&mut self, index_key: &[u8]) -> Result<()> {
            self.expiry
                .insert(index_key, ())
                .map(drop)
                .map_err(engine_error)
        }
    }
}
