//! The log's recovery at an open, a heal and `check_log`: [`plan_log`],
//! [`walk_live`], and [`recover_log`]'s replay in one durable commit that
//! starts a new epoch.

use super::Config;
use super::damage::{Damage, LossReport};
use super::file::engine_error;
use super::meta::{MetaEntries, entry, table_error};
use super::record_log::{self, LogWriter, Seen, applier};
use super::tables::{
    LOG_OPEN, META, META_LOG_BOOT, META_LOG_BYTES, META_LOG_EPOCH, META_LOG_STATE, commit,
};
use crate::error::{Error, Result};
use ::redb::{Database, ReadableDatabase, StorageBackend};
use std::path::Path;

/// What the open found out before the log's recovery.
pub(super) struct Found<'a> {
    pub(super) meta: &'a MetaEntries,
    /// [`boot_id`], for a log on a real file.
    pub(super) boot: Option<&'a str>,
    pub(super) name: &'a Path,
    /// A heal in a running process: the log's last frame may be one whose
    /// write failed, so a damaged last frame is the end, as after a reboot.
    pub(super) heal: bool,
}

/// How the live frames are to be read, and what is wrong with the log
/// before any frame is read.
pub(super) struct LogPlan {
    pub(super) file_len: u64,
    /// The durable epoch: its frames, then the next epoch's, are live.
    pub(super) epoch: u64,
    /// The size the frames were laid out for (the store's record of it).
    pub(super) layout_len: u64,
    pub(super) no_reboot: bool,
    pub(super) clean_stop: Option<bool>,
    /// What an open refuses, in order.
    pub(super) problems: Vec<Damage>,
}

/// Checks the log against what the store file's meta entries say of it:
/// after an unclean stop, a missing or cut-short log would drop
/// acknowledged writes.
pub(super) fn plan_log(
    db: &Database,
    file: &dyn StorageBackend,
    found: &Found<'_>,
) -> Result<LogPlan> {
    let len = file.len().map_err(Error::Io)?;
    let txn = db.begin_read().map_err(engine_error)?;
    let meta = txn.open_table(META).map_err(table_error)?;
    // This boot's id at the log's last open.
    let boot = meta.get(META_LOG_BOOT).map_err(engine_error)?;
    let same_boot = boot.is_some_and(|b| Some(&*String::from_utf8_lossy(b.value())) == found.boot);
    // The log may hold acknowledged frames (the last stop was not clean);
    // `None` when no open has recorded it.
    let open = entry::<1>(&meta, META_LOG_STATE)?.map(|[state]| state == LOG_OPEN);
    // The log's size as the last open left it (read only with a state).
    let bytes = match open {
        Some(_) => entry(&meta, META_LOG_BYTES)?.map(u64::from_be_bytes),
        None => None,
    };
    let mut plan = LogPlan {
        file_len: len,
        epoch: entry(&meta, META_LOG_EPOCH)?.map_or(0, u64::from_be_bytes),
        layout_len: len,
        no_reboot: !found.heal && same_boot,
        clean_stop: open.map(|open| !open),
        problems: Vec::new(),
    };
    if open != Some(true) {
        return Ok(plan);
    }
    match bytes {
        // The last open stopped before its log had a size: no frame exists.
        Some(0) => {}
        _ if len == 0 => plan.problems.push(Damage::LogMissing {
            store: found.name.to_path_buf(),
        }),
        Some(recorded) if len < recorded => {
            plan.problems.push(Damage::LogCutShort {
                store: found.name.to_path_buf(),
                len,
                recorded,
            });
            // What is left is read where it was written.
            plan.layout_len = recorded;
        }
        Some(recorded) => plan.layout_len = recorded,
        None => {}
    }
    Ok(plan)
}

/// Walks the durable epoch's frames, then the next one's; returns how many,
/// and, after an unclean stop, [`Damage::LogOfAnotherStore`] when two or
/// more headers and none verify for this store (one may be a torn first
/// frame): that damage is reported before what the walk met.
pub(super) fn walk_live(
    file: &dyn StorageBackend,
    found: &Found<'_>,
    plan: &LogPlan,
    mut loss: Option<&mut LossReport>,
    mut on_frame: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<(u64, Option<Damage>)> {
    let (mut frames, mut seen, mut met) = (0, Seen::default(), None);
    for epoch in [plan.epoch, plan.epoch.wrapping_add(1)] {
        let layout = record_log::Layout::segment(plan.layout_len, epoch);
        match record_log::walk(
            file,
            &found.meta.store_id,
            &layout,
            plan.no_reboot,
            loss.as_deref_mut(),
            &mut seen,
            &mut on_frame,
        ) {
            Ok(n) => frames += n,
            Err(e) => {
                let first = met.take().unwrap_or(e);
                // Before any frame of ours: maybe another store's log.
                if seen.ours > 0 || !matches!(first, Error::Corrupt { .. }) {
                    return Err(first);
                }
                met = Some(first);
            }
        }
    }
    if plan.clean_stop == Some(false) && seen.headers >= 2 && seen.ours == 0 {
        let store = found.name.to_path_buf();
        let damage = Damage::LogOfAnotherStore {
            store,
            seen: seen.headers,
        };
        return Ok((frames, Some(damage)));
    }
    met.map_or(Ok((frames, None)), Err)
}

/// The log, empty, and what the replay did.
pub(super) struct Recovered {
    pub(super) wal: LogWriter,
    pub(super) frames: u64,
    pub(super) token_hwm: u64,
}

/// Replays the live frames and commits durably with a new epoch (retiring
/// every frame found), then gives the log file its full size.
pub(super) fn recover_log(
    db: &Database,
    file: std::sync::Arc<dyn StorageBackend>,
    found: &Found<'_>,
    config: &Config,
    loss: &mut LossReport,
) -> Result<Recovered> {
    let mut plan = plan_log(db, file.as_ref(), found)?;
    let len = plan.file_len;
    for problem in std::mem::take(&mut plan.problems) {
        if !config.accept_loss {
            return Err(problem.into());
        }
        loss.findings.push(format!("accepted: {problem}"));
    }
    let fresh = plan.epoch.wrapping_add(2);
    let mut token_hwm = found.meta.token_hwm;
    let frames = commit(db, true, |tables| {
        // In the layout the frames were written in, before a resize.
        let before = loss.findings.len();
        let accepting = config.accept_loss.then_some(&mut *loss);
        let apply = applier(tables, &mut token_hwm);
        let (frames, another) = walk_live(file.as_ref(), found, &plan, accepting, apply)?;
        if let Some(damage) = another {
            if !config.accept_loss {
                return Err(damage.into());
            }
            loss.findings.insert(before, format!("accepted: {damage}"));
        }
        tables.set_meta(META_LOG_EPOCH, &fresh.to_be_bytes())?;
        tables.set_meta(META_LOG_STATE, &[LOG_OPEN])?;
        match found.boot {
            Some(boot) => tables.set_meta(META_LOG_BOOT, boot.as_bytes())?,
            None => tables.remove_meta(META_LOG_BOOT)?,
        }
        // The size as it is: a crash while it grows leaves a longer file,
        // which is allowed (no frame exists before the new size is recorded).
        tables.set_meta(META_LOG_BYTES, &len.to_be_bytes())?;
        Ok::<_, Error>(frames)
    })??;
    // A read-only open replayed into an overlay: the log stays as it is.
    let new_len = if config.read_only {
        len
    } else {
        super::file::preallocate(file.as_ref(), config.log_bytes)?
    };
    if new_len != len {
        // The new size, durably, before any frame is laid out for it.
        commit(db, true, |t| {
            t.set_meta(META_LOG_BYTES, &new_len.to_be_bytes())
        })??;
    }
    Ok(Recovered {
        wal: LogWriter::new(file, found.meta.store_id, fresh, new_len),
        frames,
        token_hwm,
    })
}

/// Linux's random id of this boot: an open in the same boot follows a
/// process crash, not a power loss, so no frame was torn. `None` elsewhere.
pub(super) fn boot_id() -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .map(|id| id.trim().to_owned())
            .filter(|id| !id.is_empty())
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}
