//! [`Admin::verify`]: every record and index entry read and checked.

use super::Admin;
use crate::codec;
use crate::error::Result;
use crate::redb::file::engine_error;
use crate::redb::overlay::open_overlay;
use crate::redb::tables::{EXPIRY, RECORDS};
use ::redb::{ReadableDatabase, ReadableTable};
use std::path::Path;

/// Most problems a [`VerifyReport`] lists; past this it only counts them.
pub(crate) const MAX_LISTED_PROBLEMS: usize = 100;

/// What kind of disagreement [`Admin::verify`] found.
///
/// ```
/// use idemstore::redb::admin::ProblemKind;
/// assert_eq!(ProblemKind::MissingIndex.name(), "missing_index");
/// assert_eq!(ProblemKind::TokenAboveHighWaterMark.to_string(), "token_above_hwm");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// redb's page checksums failed and redb repaired the file (from its
    /// last good commit).
    EngineRepaired,
    /// redb's page checksums failed and redb could not repair the file
    /// (verify changed nothing: its check ran on a private copy in memory).
    EngineDamaged,
    /// A meta entry is missing or malformed.
    Meta,
    /// A stored key does not decode to a valid [`Key`](crate::Key).
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
    /// A stable, short name (`idemstore verify` prints it; example:
    /// [`ProblemKind`]).
    pub fn name(self) -> &'static str {
        match self {
            ProblemKind::EngineRepaired => "engine_repaired",
            ProblemKind::EngineDamaged => "engine_damaged",
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

impl std::fmt::Display for ProblemKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One problem found by [`Admin::verify`].
///
/// ```
/// fn show(p: &idemstore::redb::admin::Problem) -> String {
///     format!("{}: {} ({})", p.kind, p.key.as_deref().unwrap_or("-"), p.detail)
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// What kind of problem.
    pub kind: ProblemKind,
    /// The key concerned, printable (`scope/id`, or `0x` and hex), if any.
    pub key: Option<String>,
    /// What was found, in words.
    pub detail: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.key {
            Some(key) => write!(f, "{} {key}: {}", self.kind, self.detail),
            None => write!(f, "{}: {}", self.kind, self.detail),
        }
    }
}

/// The outcome of [`Admin::verify`].
///
/// ```
/// let report = idemstore::redb::admin::VerifyReport::default();
/// assert!(report.is_clean() && report.problems.is_empty());
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifyReport {
    /// Records read.
    pub records: u64,
    /// Index entries read.
    pub index_entries: u64,
    /// Every problem found, counted.
    pub problem_count: u64,
    /// The first 100 problems.
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    /// True when nothing was found (example: [`VerifyReport`]).
    pub fn is_clean(&self) -> bool {
        self.problem_count == 0
    }

    fn add(&mut self, kind: ProblemKind, key: Option<&[u8]>, detail: impl Into<String>) {
        self.problem_count += 1;
        if self.problems.len() < MAX_LISTED_PROBLEMS {
            self.problems.push(Problem {
                kind,
                key: key.map(codec::printable_key),
                detail: detail.into(),
            });
        }
    }
}

impl Admin<'_> {
    /// Checks the store file: redb's page checksums (for a file, on a
    /// private in-memory copy, so a repair never touches it), every
    /// record's envelope and invariants, every token against the high-water
    /// mark, and that records and expiry index agree one to one. `progress`
    /// gets the number of entries read so far. `Err` is for what ends the
    /// check (an I/O error, damage redb cannot read past).
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// let store = idemstore::RedbStore::open(dir.path().join("s.idem"))?;
    /// let mut read = 0;
    /// let report = store.admin().verify(|n| read = n)?;
    /// assert!(report.is_clean(), "{:?}", report.problems);
    /// assert_eq!(read, report.records + report.index_entries);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn verify(&self, mut progress: impl FnMut(u64)) -> Result<VerifyReport> {
        let shared = &self.store.shared;
        let mut report = VerifyReport::default();
        // Every transaction waited out and none begun until the check ends:
        // the file then holds whole commits only.
        let mut engine = shared.db.write_db();
        // redb's repair rolls the file back (and can fail): a file is checked
        // on an overlay, a caller's backend in place.
        let (checked, repair) = match self.store.path() {
            Some(path) => (
                engine_check_without_writing(path)?,
                "could repair the file from its last good commit (verify changed nothing)",
            ),
            None => (
                Ok(engine.db.check_integrity().map_err(engine_error)?),
                "repaired the file from its last good commit",
            ),
        };
        match checked {
            Ok(true) => {}
            Ok(false) => report.add(
                ProblemKind::EngineRepaired,
                None,
                format!("redb's page checksums failed; redb {repair}"),
            ),
            Err(detail) => report.add(
                ProblemKind::EngineDamaged,
                None,
                format!("redb's page checksums failed and it cannot repair the file: {detail} (verify changed nothing)"),
            ),
        }
        drop(engine);
        let db = shared.db.read_db()?;
        // One transaction: the mark is checked against the records it covers.
        let txn = db.begin_read().map_err(engine_error)?;
        let meta = crate::redb::meta::read_meta_entries(&txn);
        if let Err(e) = &meta {
            report.add(ProblemKind::Meta, None, e.to_string());
        }
        let records = txn.open_table(RECORDS).map_err(engine_error)?;
        let expiry = txn.open_table(EXPIRY).map_err(engine_error)?;
        for entry in records.iter().map_err(engine_error)? {
            let (k, v) = entry.map_err(engine_error)?;
            let key = k.value();
            report.records += 1;
            progress(report.records);
            if let Err(e) = codec::decode_key(key) {
                report.add(ProblemKind::BadKey, Some(key), e.to_string());
            }
            let record = match codec::decode_record(key, v.value()) {
                Ok(r) => r,
                Err(e) => {
                    report.add(ProblemKind::BadRecord, Some(key), e.to_string());
                    continue;
                }
            };
            let at = record.expires_at.as_millis();
            let index_key = codec::encode_index(record.expires_at, key);
            let indexed = expiry.get(index_key.as_slice()).map_err(engine_error)?;
            if indexed.is_none() {
                let detail = format!("no index entry at its expiry ({at} ms)");
                report.add(ProblemKind::MissingIndex, Some(key), detail);
            }
            if let Ok(meta) = &meta
                && record.token > meta.token_hwm
            {
                let (token, hwm) = (record.token, meta.token_hwm);
                let detail = format!("token {token} is above the high-water mark {hwm}");
                report.add(ProblemKind::TokenAboveHighWaterMark, Some(key), detail);
            }
        }
        for entry in expiry.iter().map_err(engine_error)? {
            let (k, _) = entry.map_err(engine_error)?;
            report.index_entries += 1;
            progress(report.records + report.index_entries);
            let (at, key) = match codec::decode_index(k.value()) {
                Ok(pair) => pair,
                Err(e) => {
                    report.add(ProblemKind::BadIndexEntry, None, e.to_string());
                    continue;
                }
            };
            let at_ms = at.as_millis();
            let Some(value) = records.get(key).map_err(engine_error)? else {
                let detail = format!("index entry at {at_ms} ms has no record");
                report.add(ProblemKind::OrphanIndex, Some(key), detail);
                continue;
            };
            // A record that does not decode was reported above.
            if let Ok(record) = codec::decode_record(key, value.value())
                && record.expires_at != at
            {
                let expires = record.expires_at.as_millis();
                let detail = format!("index entry at {at_ms} ms, record expires at {expires} ms");
                report.add(ProblemKind::StaleIndex, Some(key), detail);
            }
        }
        Ok(report)
    }
}

/// redb's integrity check of the file at `path` on an in-memory overlay:
/// `Ok(true)` sound, `Ok(false)` repairable, `Err` why it is not.
fn engine_check_without_writing(path: &Path) -> Result<std::result::Result<bool, String>> {
    Ok(open_overlay(path)?.and_then(|mut db| {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| db.check_integrity())) {
            Ok(checked) => checked.map_err(|e| e.to_string()),
            Err(_) => Err("the storage engine panicked checking it".to_owned()),
        }
    }))
}
