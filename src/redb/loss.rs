//! [`LossReport`]: what an open with [`accept_loss`](super::RedbStoreBuilder::accept_loss)
//! gave up, written down so that an operator can reconcile it.

use std::fmt;

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
    /// Nothing was found.
    pub(super) fn is_empty(&self) -> bool {
        self.findings.is_empty()
    }

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
        writeln!(
            f,
            "{} frames replayed, {} skipped",
            self.frames_replayed, self.frames_skipped
        )?;
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
