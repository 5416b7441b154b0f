//! [`RedbStore::check_log`]: what an open would find in a store's write-ahead log,
//! without opening the store and without writing anything.

use super::super::RedbStore;
use super::super::damage::LossReport;
use super::super::file::engine_error;
use super::super::meta::{check_format, read_meta_entries};
use super::super::open::log_to_read;
use super::super::overlay::open_overlay;
use super::super::record_log;
use super::super::recovery::{Found, boot_id, plan_log, walk_live};
use crate::error::{Error, Result};
use ::redb::ReadableDatabase;
use std::path::{Path, PathBuf};

/// What [`RedbStore::check_log`] found: the log's state and every problem an open
/// would refuse.
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
    /// An open would replay the log without refusing it.
    ///
    /// ```
    /// assert!(idemstore::redb::admin::LogCheck::default().is_clean());
    /// ```
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

impl RedbStore {
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
        let meta = {
            let txn = db.begin_read().map_err(engine_error)?;
            read_meta_entries(&txn)?
        };
        check_format(&meta)?;
        let log = log_to_read(store)?;
        let boot = boot_id();
        let found = Found {
            store_id: meta.store_id,
            token_hwm: meta.token_hwm,
            boot: boot.as_deref(),
            name: store,
            heal: false,
        };
        let plan = plan_log(&db, log.as_ref(), &found)?;
        let path = Self::log_path(store);
        let mut check = LogCheck {
            present: path.exists(),
            path,
            bytes: plan.file_len,
            clean_stop: plan.clean_stop,
            frames: 0,
            problems: plan.problems.iter().map(ToString::to_string).collect(),
        };
        // Every frame decoded but not applied; the walk goes on past problems.
        let mut loss = LossReport::default();
        let mut undecodable = Vec::new();
        let (frames, another) = walk_live(
            log.as_ref(),
            &found,
            &plan,
            Some(&mut loss),
            |at, payload| {
                if let Err(e) = record_log::entries(at, payload, |_| Ok(())) {
                    undecodable.push(e.to_string());
                }
                Ok(())
            },
        )?;
        check.frames = frames;
        check.problems.extend(another.map(|d| d.to_string()));
        check.problems.append(&mut loss.findings);
        check.problems.append(&mut undecodable);
        Ok(check)
    }

    /// The write-ahead log beside the store file `store` (`<store>-wal`); the
    /// two are copied, moved and deleted together.
    ///
    /// ```
    /// assert_eq!(idemstore::RedbStore::log_path("/data/orders.idem"), std::path::Path::new("/data/orders.idem-wal"));
    /// ```
    pub fn log_path(store: impl AsRef<Path>) -> PathBuf {
        super::super::file::log_path(store)
    }
}
