//! The three tables of a store file and the helpers that keep a record and
//! its expiry-index entry moving together.
//!
//! | table | key | value |
//! |---|---|---|
//! | `idemstore.records` | [`codec::encode_key`] | [`codec::encode_record`] envelope |
//! | `idemstore.expiry` | [`codec::encode_index`] `(expires_at BE, key)` | `()` |
//! | `idemstore.meta` | name | big-endian value (format version, store id, token high-water mark) |
//!
//! The names carry an `idemstore.` prefix so that a caller's own tables can
//! share the file (the co-transactional inbox) without a clash.

use super::errors::engine_error;
use crate::codec;
use crate::error::Result;
use crate::record::Record;
use crate::time::Timestamp;
use ::redb::{
    ReadOnlyTable, ReadTransaction, ReadableTable, Table, TableDefinition, WriteTransaction,
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
/// Meta key: the write-ahead log's epoch, u64 BE (see `record_log/`); absent in
/// a store that never had a log, read as 0.
pub(crate) const META_WAL_EPOCH: &str = "wal_epoch";
/// Meta key: whether the log may hold acknowledged frames not yet in this
/// file: one byte, [`WAL_OPEN`] from the open that recovered the log until a clean
/// close writes [`WAL_CLOSED`] in its last durable commit. Absent in a
/// store no build with this check has opened with a log.
pub(crate) const META_WAL_STATE: &str = "wal_state";
/// Meta key: the log file's size as the open that recovered it left it
/// (u64 BE), which fixes its segments' layout. After an unclean stop the log must have this size.
pub(crate) const META_WAL_BYTES: &str = "wal_bytes";
/// Meta key: the machine's boot id when the log was opened from a file
/// (Linux; absent elsewhere and for storage backends). An open in the same
/// boot follows a process crash, not a power loss.
pub(crate) const META_WAL_BOOT: &str = "wal_boot_id";
/// [`META_WAL_STATE`]: the store was opened with its log and not closed
/// cleanly since: the log may hold acknowledged writes.
pub(crate) const WAL_OPEN: u8 = 0;
/// [`META_WAL_STATE`]: the last close put everything in this file; the log
/// holds nothing that is needed.
pub(crate) const WAL_CLOSED: u8 = 1;

/// The record and index tables of one write transaction.
pub(super) struct WriteTables<'txn> {
    records: Table<'txn, &'static [u8], &'static [u8]>,
    expiry: Table<'txn, &'static [u8], ()>,
}

impl<'txn> WriteTables<'txn> {
    /// Opens (creating if needed) both tables in `txn`.
    pub(super) fn open(txn: &'txn WriteTransaction) -> Result<WriteTables<'txn>> {
        Ok(WriteTables {
            records: txn.open_table(RECORDS).map_err(engine_error)?,
            expiry: txn.open_table(EXPIRY).map_err(engine_error)?,
        })
    }

    /// Stores `entry` (a record, or `None` for a deletion) as the latest
    /// state of `key_bytes`, moving its expiry-index entry from the stored
    /// record's expiry: the one way every writer (a checkpoint, a direct
    /// transaction, replay, the inbox, import)
    /// keeps a record and its index entry together. The record is encoded
    /// (and its invariants checked) before the first write, so an encoding
    /// failure writes nothing.
    pub(super) fn apply(&mut self, key_bytes: &[u8], entry: Option<&Record>) -> Result<()> {
        match entry {
            Some(record) => {
                let value = codec::encode_record(record)?;
                self.apply_encoded(key_bytes, Some((&value, record.expires_at)))
            }
            None => self.apply_encoded(key_bytes, None),
        }
    }

    /// [`apply`](Self::apply) for a record already encoded (`value`, whose
    /// expiry is `expires_at`). A stored record that does not decode is
    /// replaced; its index entry (unknown) is left for the sweep, which
    /// re-checks every entry it finds.
    pub(super) fn apply_encoded(
        &mut self,
        key_bytes: &[u8],
        entry: Option<(&[u8], Timestamp)>,
    ) -> Result<()> {
        // One descent of the tree: the insert or remove hands back the
        // value it replaced, whose expiry names the index entry to move.
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
            self.unindex(&codec::encode_index(old, key_bytes))?;
        }
        if let Some(new) = new {
            self.index(&codec::encode_index(new, key_bytes))?;
        }
        Ok(())
    }

    /// Removes one index entry (its record moved or went).
    fn unindex(&mut self, index_key: &[u8]) -> Result<()> {
        self.expiry.remove(index_key).map_err(engine_error)?;
        Ok(())
    }

    /// Adds one index entry (a record's).
    fn index(&mut self, index_key: &[u8]) -> Result<()> {
        self.expiry.insert(index_key, ()).map_err(engine_error)?;
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
}

/// Where decisions read what redb holds: the kept snapshot (snapshot.rs)
/// for a group, the inbox's own write transaction for its batch.
pub(super) trait Source {
    /// The stored record for `key_bytes`, verified ([`Error::Corrupt`](crate::Error::Corrupt) if not).
    fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>>;
    /// Calls `f` with each index entry of an expiry at or before `now`,
    /// oldest first, while it returns `true`.
    fn due(&self, now: Timestamp, f: &mut dyn FnMut(&[u8]) -> Result<bool>) -> Result<()>;
}

fn read_from(
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    key_bytes: &[u8],
) -> Result<Option<Record>> {
    match records.get(key_bytes).map_err(engine_error)? {
        Some(guard) => Ok(Some(codec::decode_record(key_bytes, guard.value())?)),
        None => Ok(None),
    }
}

fn due_from(
    expiry: &impl ReadableTable<&'static [u8], ()>,
    now: Timestamp,
    f: &mut dyn FnMut(&[u8]) -> Result<bool>,
) -> Result<()> {
    // Every index entry of an expiry <= now sorts before this bound:
    // entries are (expires_at BE | key) and the bound is (now + 1 BE).
    let bound = now.as_millis().saturating_add(1).to_be_bytes();
    for entry in expiry
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

impl Source for WriteTables<'_> {
    fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>> {
        read_from(&self.records, key_bytes)
    }
    fn due(&self, now: Timestamp, f: &mut dyn FnMut(&[u8]) -> Result<bool>) -> Result<()> {
        due_from(&self.expiry, now, f)
    }
}

/// The record and index tables of one read transaction (the kept
/// snapshot's).
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
}

impl Source for ReadTables {
    fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>> {
        read_from(&self.records, key_bytes)
    }
    fn due(&self, now: Timestamp, f: &mut dyn FnMut(&[u8]) -> Result<bool>) -> Result<()> {
        due_from(&self.expiry, now, f)
    }
}
