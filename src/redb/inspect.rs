//! Operator access to a store file (feature `cli`): raw iteration over the
//! record and index tables, store facts, a full verification, evicting one
//! key, and bulk import. Crate-internal: the `idemstore` binary is the only
//! caller, and none of this is part of the [`Store`](crate::Store) contract.
//!
//! Reads use ordinary read transactions, so they see one consistent
//! snapshot of the store file (after an open the memtable is empty; a
//! command that wrote through the store calls `checkpoint_now` first).
//! Writes here (evict, import) are direct transactions: under the commit
//! lock, so no group commits beside them, taking in the memtable first and
//! retiring the log, and a failed commit poisons the store exactly as a
//! failed group would.

use super::RedbStore;
use super::errors::engine;
use super::open::STORE_FORMAT_VERSION;
use super::tables::{EXPIRY, RECORDS, WriteTables};
use crate::codec;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::record::Record;
use crate::time::Timestamp;
use ::redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata};
use std::ops::ControlFlow;

/// Most problems a [`VerifyReport`] lists one by one; past this it only counts.
pub(crate) const MAX_LISTED_PROBLEMS: usize = 100;
/// Records written per transaction by [`RedbStore::import`]: bounds the
/// memory of one transaction while keeping the fsyncs few.
pub(crate) const IMPORT_BATCH: usize = 10_000;

/// Store-wide facts from the meta table and the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Facts {
    /// The store format version written in the file.
    pub(crate) format_version: u32,
    /// The format version this build writes.
    pub(crate) supported_version: u32,
    /// The store's 16-byte id.
    pub(crate) store_id: [u8; 16],
    /// The largest fencing token ever handed out.
    pub(crate) token_hwm: u64,
    /// Entries in the record table.
    pub(crate) records: u64,
    /// Entries in the expiry index.
    pub(crate) index_entries: u64,
}

/// What kind of disagreement [`RedbStore::verify`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ProblemKind {
    /// redb's page checksums failed and redb repaired the file.
    EngineRepaired,
    /// A meta entry is missing or malformed.
    Meta,
    /// A stored key does not decode to a valid [`Key`].
    BadKey,
    /// A record value does not verify (checksum, version, payload, invariants).
    BadRecord,
    /// A record has no index entry at its expiry: the sweeper never removes it.
    MissingIndex,
    /// An index entry whose record is gone.
    OrphanIndex,
    /// An index entry whose record exists with a different expiry.
    StaleIndex,
    /// An index entry shorter than its fixed layout.
    BadIndexEntry,
    /// A record's fencing token exceeds the high-water mark: a restart could
    /// hand that token out again.
    TokenAboveHighWaterMark,
}

impl ProblemKind {
    /// A stable, short name (used in table and JSON output).
    pub(crate) fn name(self) -> &'static str {
        match self {
            ProblemKind::EngineRepaired => "engine_repaired",
            ProblemKind::Meta => "meta",
            ProblemKind::BadKey => "bad_key",
            ProblemKind::BadRecord => "bad_record",
            ProblemKind::MissingIndex => "missing_index",
            ProblemKind::OrphanIndex => "orphan_index",
            ProblemKind::StaleIndex => "stale_index",
            ProblemKind::BadIndexEntry => "bad_index_entry",
            ProblemKind::TokenAboveHighWaterMark => "token_above_hwm",
        }
    }
}

/// One problem found by [`RedbStore::verify`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Problem {
    pub(crate) kind: ProblemKind,
    /// The key concerned, printable (`scope/id`, or hex), if any.
    pub(crate) key: Option<String>,
    pub(crate) detail: String,
}

/// The outcome of [`RedbStore::verify`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct VerifyReport {
    /// Records read.
    pub(crate) records: u64,
    /// Index entries read.
    pub(crate) index_entries: u64,
    /// Every problem found, counted.
    pub(crate) problem_count: u64,
    /// The first [`MAX_LISTED_PROBLEMS`] problems.
    pub(crate) problems: Vec<Problem>,
}

impl VerifyReport {
    /// True when nothing was found.
    pub(crate) fn is_clean(&self) -> bool {
        self.problem_count == 0
    }

    fn add(&mut self, kind: ProblemKind, key: Option<String>, detail: impl Into<String>) {
        self.problem_count += 1;
        if self.problems.len() < MAX_LISTED_PROBLEMS {
            self.problems.push(Problem {
                kind,
                key,
                detail: detail.into(),
            });
        }
    }
}

/// What [`RedbStore::evict`] removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Evicted {
    /// The record, when it still decoded (`None` for a damaged one).
    pub(crate) record: Option<Record>,
    /// Index entries removed with it.
    pub(crate) index_entries: u64,
}

impl RedbStore {
    /// Writes everything the memtable holds into the store file (durably,
    /// retiring the log), so that the reads below, which read the file,
    /// see writes made through the store API (a sweep). Writes nothing
    /// when the memtable is empty, as it is after an open.
    pub(crate) fn checkpoint_now(&self) -> Result<()> {
        self.shared.flush()
    }

    /// Facts from the meta table and the table sizes.
    pub(crate) fn facts(&self) -> Result<Facts> {
        let db = self.shared.read_db();
        let txn = db.begin_read().map_err(engine)?;
        let meta = super::open::read_meta_entries(&txn)?;
        let records = txn
            .open_table(RECORDS)
            .map_err(engine)?
            .len()
            .map_err(engine)?;
        let index_entries = txn
            .open_table(EXPIRY)
            .map_err(engine)?
            .len()
            .map_err(engine)?;
        Ok(Facts {
            format_version: meta.format_version,
            supported_version: STORE_FORMAT_VERSION,
            store_id: meta.store_id,
            token_hwm: meta.token_hwm,
            records,
            index_entries,
        })
    }

    /// Calls `f` with every stored record whose key starts with `prefix`
    /// (encoded key bytes; empty for all), in key order, from one snapshot.
    /// A record that does not verify is passed as its error, not skipped.
    pub(crate) fn scan(
        &self,
        prefix: &[u8],
        mut f: impl FnMut(&[u8], Result<Record>) -> ControlFlow<()>,
    ) -> Result<()> {
        let db = self.shared.read_db();
        let txn = db.begin_read().map_err(engine)?;
        let table = txn.open_table(RECORDS).map_err(engine)?;
        for entry in table.range::<&[u8]>(prefix..).map_err(engine)? {
            let (k, v) = entry.map_err(engine)?;
            let key_bytes = k.value();
            if !key_bytes.starts_with(prefix) {
                break;
            }
            if f(key_bytes, codec::decode_record(key_bytes, v.value())).is_break() {
                break;
            }
        }
        Ok(())
    }

    /// The stored record for `key` whether or not it has expired (an
    /// operator asks about what is on disk; [`Store::get`](crate::Store::get)
    /// hides expired records).
    pub(crate) fn get_raw(&self, key: &Key) -> Result<Option<Record>> {
        self.shared.read(&codec::encode_key(key))
    }

    /// The expiry of the first and the last index entries, `None` when
    /// empty: two lookups at the ends of the index, not a scan.
    pub(crate) fn expiry_bounds(&self) -> Result<Option<(Timestamp, Timestamp)>> {
        let db = self.shared.read_db();
        let txn = db.begin_read().map_err(engine)?;
        let expiry = txn.open_table(EXPIRY).map_err(engine)?;
        let first = expiry.first().map_err(engine)?;
        let last = expiry.last().map_err(engine)?;
        match (first, last) {
            (Some((a, _)), Some((b, _))) => Ok(Some((
                codec::decode_index(a.value())?.0,
                codec::decode_index(b.value())?.0,
            ))),
            _ => Ok(None),
        }
    }

    /// Index entries due at `now` (expiry at or before it), counted up to
    /// `limit`: what a sweep at `now` will visit.
    pub(crate) fn count_due(&self, now: Timestamp, limit: u64) -> Result<u64> {
        let db = self.shared.read_db();
        let txn = db.begin_read().map_err(engine)?;
        let expiry = txn.open_table(EXPIRY).map_err(engine)?;
        // Entries are (expires_at BE | key): every one due sorts below now + 1.
        let bound = now.as_millis().saturating_add(1).to_be_bytes();
        let mut n = 0u64;
        for entry in expiry.range::<&[u8]>(..bound.as_slice()).map_err(engine)? {
            entry.map_err(engine)?;
            n += 1;
            if n >= limit {
                break;
            }
        }
        Ok(n)
    }

    /// Reads every record and index entry: redb's page checksums (redb
    /// repairs what it can, which is reported), every record's envelope and
    /// invariants, and that the record table and the expiry index agree one
    /// to one. `progress` is called with the number of entries read so far.
    pub(crate) fn verify(&self, mut progress: impl FnMut(u64)) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        {
            // check_integrity needs no live transaction: the exclusive lock
            // waits out every transaction, as compact does.
            let mut db = self.shared.db.write().unwrap_or_else(|p| p.into_inner());
            if !db.check_integrity().map_err(engine)? {
                report.add(
                    ProblemKind::EngineRepaired,
                    None,
                    "redb's page checksums failed; redb repaired the file from its last good commit",
                );
            }
        }
        let facts = match self.facts() {
            Ok(facts) => Some(facts),
            Err(e) => {
                report.add(ProblemKind::Meta, None, e.to_string());
                None
            }
        };
        let db = self.shared.read_db();
        let txn = db.begin_read().map_err(engine)?;
        let records = txn.open_table(RECORDS).map_err(engine)?;
        let expiry = txn.open_table(EXPIRY).map_err(engine)?;
        let mut read = 0u64;
        for entry in records.iter().map_err(engine)? {
            let (k, v) = entry.map_err(engine)?;
            let key_bytes = k.value();
            let name = codec::printable_key(key_bytes);
            report.records += 1;
            read += 1;
            progress(read);
            if let Err(e) = codec::decode_key(key_bytes) {
                report.add(ProblemKind::BadKey, Some(name.clone()), e.to_string());
            }
            let record = match codec::decode_record(key_bytes, v.value()) {
                Ok(r) => r,
                Err(e) => {
                    report.add(ProblemKind::BadRecord, Some(name), e.to_string());
                    continue;
                }
            };
            let index_key = codec::encode_index(record.expires_at, key_bytes);
            if expiry.get(index_key.as_slice()).map_err(engine)?.is_none() {
                report.add(
                    ProblemKind::MissingIndex,
                    Some(name.clone()),
                    format!(
                        "no index entry at its expiry ({} ms)",
                        record.expires_at.as_millis()
                    ),
                );
            }
            if let Some(facts) = &facts
                && record.token > facts.token_hwm
            {
                report.add(
                    ProblemKind::TokenAboveHighWaterMark,
                    Some(name),
                    format!(
                        "token {} is above the high-water mark {}",
                        record.token, facts.token_hwm
                    ),
                );
            }
        }
        for entry in expiry.iter().map_err(engine)? {
            let (k, _) = entry.map_err(engine)?;
            let index_key = k.value();
            report.index_entries += 1;
            read += 1;
            progress(read);
            let (at, key_bytes) = match codec::decode_index(index_key) {
                Ok(pair) => pair,
                Err(e) => {
                    report.add(ProblemKind::BadIndexEntry, None, e.to_string());
                    continue;
                }
            };
            let name = codec::printable_key(key_bytes);
            let Some(value) = records.get(key_bytes).map_err(engine)? else {
                report.add(
                    ProblemKind::OrphanIndex,
                    Some(name),
                    format!("index entry at {} ms has no record", at.as_millis()),
                );
                continue;
            };
            // A record that does not decode was reported above.
            if let Ok(record) = codec::decode_record(key_bytes, value.value())
                && record.expires_at != at
            {
                report.add(
                    ProblemKind::StaleIndex,
                    Some(name),
                    format!(
                        "index entry at {} ms, record expires at {} ms",
                        at.as_millis(),
                        record.expires_at.as_millis()
                    ),
                );
            }
        }
        Ok(report)
    }

    /// Removes `key`'s record and its index entry, whatever the record's
    /// state, and even when the record no longer decodes (then every index
    /// entry naming the key is found by a scan of the index). `Ok(None)`
    /// when there is no record.
    pub(crate) fn evict(&self, key: &Key) -> Result<Option<Evicted>> {
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let key_bytes = codec::encode_key(key);
        // A direct transaction: it takes in the memtable first, so the
        // record removed is the latest, and it retires the log.
        self.shared.direct(|txn, _| {
            let mut records = txn.open_table(RECORDS).map_err(engine)?;
            let mut expiry = txn.open_table(EXPIRY).map_err(engine)?;
            let Some(value) = records.remove(key_bytes.as_slice()).map_err(engine)? else {
                return Ok(None);
            };
            let record = codec::decode_record(&key_bytes, value.value()).ok();
            drop(value);
            let stale: Vec<Vec<u8>> = match &record {
                Some(r) => vec![codec::encode_index(r.expires_at, &key_bytes)],
                None => {
                    let mut found = Vec::new();
                    for entry in expiry.iter().map_err(engine)? {
                        let (k, _) = entry.map_err(engine)?;
                        if matches!(codec::decode_index(k.value()), Ok((_, kb)) if kb == key_bytes)
                        {
                            found.push(k.value().to_vec());
                        }
                    }
                    found
                }
            };
            let mut index_entries = 0;
            for index_key in stale {
                if expiry
                    .remove(index_key.as_slice())
                    .map_err(engine)?
                    .is_some()
                {
                    index_entries += 1;
                }
            }
            Ok(Some(Evicted {
                record,
                index_entries,
            }))
        })
    }

    /// Writes `records` as they are (state, token, times: nothing is
    /// re-decided), each with its index entry, [`IMPORT_BATCH`] per
    /// transaction, and raises the token high-water mark to the largest
    /// imported token. A record already stored under the same key is
    /// replaced (its index entry moves).
    ///
    /// Takes the store by value: an import is an operator's bulk load,
    /// not something to run beside live traffic.
    /// Returns how many records were written.
    pub(crate) fn import(
        self,
        records: impl IntoIterator<Item = Result<(Key, Record)>>,
    ) -> Result<u64> {
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let mut hwm = self.facts()?.token_hwm;
        let mut written = 0u64;
        let mut records = records.into_iter().peekable();
        while records.peek().is_some() {
            self.shared.direct(|txn, token_hwm| {
                let mut tables = WriteTables::open(txn)?;
                for item in records.by_ref().take(IMPORT_BATCH) {
                    let (key, record) = item?;
                    // A stored record that does not decode is replaced
                    // (see WriteTables::apply).
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
