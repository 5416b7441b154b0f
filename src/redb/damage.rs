//! [`Damage`]: what the store finds wrong with its files, in the operator's
//! words, always [`Error::Corrupt`]; and the [`LossReport`] of an open that
//! accepted loss. A bottom module.

use super::file::log_path;
use crate::error::Error;
use std::fmt;
use std::path::PathBuf;

/// Damage found in a store's files, at an open, a heal, an inspection or
/// a replay: it does not heal by itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Damage {
    /// The store file `what` ("is missing", "is empty") while its log holds frames.
    StoreLostBesideLog { store: PathBuf, what: &'static str },
    /// The store file is unusable as it is: "{store} {what}" (empty, truncated,
    /// unreadable, without the store's tables).
    Store { store: PathBuf, what: &'static str },
    /// The meta table is damaged (a format version 0, an entry missing or
    /// of the wrong size): the message, as meta.rs words it.
    Meta(String),
    /// After an unclean stop, the log is missing or empty.
    LogMissing { store: PathBuf },
    /// After an unclean stop, the log is shorter than the store left it.
    LogCutShort {
        store: PathBuf,
        len: u64,
        recorded: u64,
    },
    /// After an unclean stop, none of the log's frames verifies for the store.
    LogOfAnotherStore { store: PathBuf, seen: u64 },
    /// An epoch's frames stop at `at` (`stop`: "fails its checksum",
    /// "ends"), but a later one verifies at `later`.
    FrameGap {
        stop: &'static str,
        at: u64,
        later: u64,
    },
    /// The last frame fails its checksum with no reboot since it was written.
    LastFrameDamaged { at: u64 },
    /// A log frame verifies but its entries do not parse.
    FrameEntries { at: u64, detail: String },
}

impl Damage {
    /// The [`LossReport`] line for this damage, met and skipped in `epoch`.
    pub(super) fn finding(&self, epoch: u64) -> String {
        let done = match self {
            Damage::FrameGap { .. } => {
                " (with accept_loss, the bytes between are skipped and replay goes on)"
            }
            Damage::LastFrameDamaged { .. } => " (with accept_loss, it is skipped)",
            _ => "",
        };
        format!("epoch {epoch}: {self}{done}")
    }

    /// [`Damage::Store`] as the error it is.
    pub(super) fn store(store: &std::path::Path, what: &'static str) -> Error {
        Damage::Store {
            store: store.into(),
            what,
        }
        .into()
    }
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Damage::StoreLostBesideLog { store, what } => write!(
                f,
                "{} {what}, but its write-ahead log {} is beside it and holds frames: the \
                 store file was lost or replaced, and a new store here would overwrite the \
                 only copy of the writes in that log. Restore the store file that belongs \
                 to the log, or move the log away to start a new store; see \
                 docs/operations.md",
                store.display(),
                log_path(store).display()
            ),
            Damage::Store { store, what } => write!(f, "{} {what}", store.display()),
            Damage::Meta(what) => f.write_str(what),
            Damage::LogMissing { store } => write!(
                f,
                "{} was not closed cleanly, and its log is missing or empty ({}): the writes acknowledged since its \
                 last checkpoint are only in that log. Put back the log that belongs to this \
                 store (a store and its log are copied together, with no process holding \
                 them); see docs/operations.md",
                store.display(),
                log_path(store).display()
            ),
            Damage::LogCutShort {
                store,
                len,
                recorded,
            } => write!(
                f,
                "{} was not closed cleanly, and its write-ahead log {} is {len} bytes where \
                 the store left it at {recorded}: the log was cut short, or another file is \
                 in its place, so the writes acknowledged since the last checkpoint cannot \
                 all be found in it. Put back the log that belongs to this store (a store \
                 and its log are copied together); see docs/operations.md",
                store.display(),
                log_path(store).display()
            ),
            Damage::LogOfAnotherStore { store, seen } => write!(
                f,
                "{} was not closed cleanly, and none of the {seen} frames in its \
                 write-ahead log {} verifies for this store: the log belongs to another \
                 store, so the writes acknowledged since the last checkpoint are not in \
                 it. Put back the log that belongs to this store; see docs/operations.md",
                store.display(),
                log_path(store).display()
            ),
            Damage::FrameGap { stop, at, later } => write!(
                f,
                "the write-ahead log {stop} at offset {at}, but a later frame of the same \
                 epoch at offset {later} verifies: the log is damaged, and replaying only up \
                 to offset {at} would lose acknowledged writes"
            ),
            Damage::LastFrameDamaged { at } => write!(
                f,
                "the last write-ahead log frame, at offset {at}, fails its checksum, and the \
                 machine has not restarted since the store was opened: no power loss can have \
                 torn it, and a process killed while writing a frame of one block leaves it \
                 whole or absent. It was damaged after it was written and may hold \
                 acknowledged writes"
            ),
            Damage::FrameEntries { at, detail } => write!(
                f,
                "write-ahead log frame at offset {at} verifies but {detail}"
            ),
        }
    }
}

impl From<Damage> for Error {
    fn from(damage: Damage) -> Error {
        Error::corrupt(None, damage.to_string())
    }
}

/// What an open that accepted loss dropped, from
/// [`RedbStore::loss_report`](super::RedbStore::loss_report).
///
/// An open refuses a damaged or incomplete log with
/// [`Error::Corrupt`](crate::Error::Corrupt). With
/// [`RedbStoreBuilder::accept_loss`](super::RedbStoreBuilder::accept_loss) it
/// opens with whatever verifies instead, and lists here each thing it could
/// not use. Every key named in `keys_possibly_lost` may have lost
/// acknowledged writes: check it against the system it protects (the
/// payment provider, the ledger) before retries reach it.
///
/// ```
/// use idemstore::RedbStore;
/// # let dir = tempfile::tempdir()?;
/// let store = RedbStore::builder().accept_loss(true).open(dir.path().join("s.idem"))?;
/// // Nothing was damaged: nothing to report.
/// assert!(store.loss_report().is_none());
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LossReport {
    /// What was wrong and what the open did about it, one entry per
    /// finding, in the order found.
    pub findings: Vec<String>,
    /// Log frames that verified and were replayed.
    pub frames_replayed: u64,
    /// Log frames (or stretches of the log) that did not verify and were
    /// skipped.
    pub frames_skipped: u64,
    /// Keys (`scope/id`) read from the skipped frames as far as they could
    /// be parsed: their last writes may be lost. Empty when nothing could
    /// be read (a missing log names no keys).
    pub keys_possibly_lost: Vec<String>,
}

impl LossReport {
    /// The report as one JSON object (what `idemstore recover` writes).
    ///
    /// ```
    /// let report = idemstore::redb::LossReport::default();
    /// let json: serde_json::Value = serde_json::from_str(&report.to_json())?;
    /// assert_eq!(json["frames_skipped"], 0);
    /// # Ok::<(), serde_json::Error>(())
    /// ```
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "findings": self.findings,
            "frames_replayed": self.frames_replayed,
            "frames_skipped": self.frames_skipped,
            "keys_possibly_lost": self.keys_possibly_lost,
        })
        .to_string()
    }
}

impl fmt::Display for LossReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (replayed, skipped) = (self.frames_replayed, self.frames_skipped);
        writeln!(f, "{replayed} frames replayed, {skipped} skipped")?;
        for finding in &self.findings {
            writeln!(f, "- {finding}")?;
        }
        if !self.keys_possibly_lost.is_empty() {
            writeln!(f, "keys whose last writes may be lost:")?;
            for key in &self.keys_possibly_lost {
                writeln!(f, "  {key}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::meta;
    use super::*;

    /// Every kind is `Corrupt`, with its own words; a walk's finding names
    /// the epoch and what an open that accepts loss did.
    #[test]
    fn damage_is_corrupt_and_a_finding_names_its_epoch() {
        let gap = Damage::FrameGap {
            stop: "fails its checksum",
            at: 4096,
            later: 12288,
        };
        let error = Error::from(gap.clone());
        assert!(matches!(&error, Error::Corrupt { key: None, detail }
            if detail.starts_with("the write-ahead log fails its checksum at offset 4096, but a later frame")
                && detail.contains("offset 12288 verifies")));
        let finding = gap.finding(7);
        assert!(
            finding.starts_with("epoch 7: the write-ahead log fails its checksum at offset 4096")
        );
        assert!(finding.ends_with("the bytes between are skipped and replay goes on)"));
        let last = Damage::LastFrameDamaged { at: 8192 }.finding(3);
        assert!(last.starts_with("epoch 3: the last write-ahead log frame, at offset 8192, fails"));
        assert!(last.ends_with("acknowledged writes (with accept_loss, it is skipped)"));
        let zero = Damage::Meta("meta format version is 0".into());
        assert_eq!(zero.finding(1), "epoch 1: meta format version is 0");
        let ends = Damage::FrameGap {
            stop: "ends",
            at: 0,
            later: 4096,
        };
        assert!(
            ends.to_string()
                .starts_with("the write-ahead log ends at offset 0")
        );
        let short = meta::fixed::<8>("token_hwm", &[0; 3]).unwrap_err();
        assert!(matches!(&short, Error::Corrupt { key: None, detail }
            if detail == "meta entry \"token_hwm\" is 3 bytes, not 8"));
        let zero = meta::MetaEntries {
            format_version: 0,
            store_id: [0; 16],
            token_hwm: 0,
        };
        let zero = meta::check_format(&zero).unwrap_err();
        assert!(matches!(&zero, Error::Corrupt { key: None, detail }
            if detail == "meta format version is 0"));
    }
}
