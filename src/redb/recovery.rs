//! The log's recovery, at an open and a heal: what is wrong with the log
//! before a frame is read ([`plan_log`]), the walk over its live frames
//! ([`walk_live`]), and their replay in one durable commit that starts a
//! new epoch ([`recover_log`]).

use super::Config;
use super::damage::{Damage, LossReport};
use super::meta::read_wal;
use super::record_log::{self, LogWriter, Seen, applier};
use super::tables::{
    LOG_OPEN, META_LOG_BOOT, META_LOG_BYTES, META_LOG_EPOCH, META_LOG_STATE, commit,
};
use crate::error::{Error, Result};
use ::redb::{Database, StorageBackend};
use std::path::Path;

/// What the open found out before the log's recovery.
pub(super) struct Found<'a> {
    pub(super) store_id: [u8; 16],
    /// As the store file holds it.
    pub(super) token_hwm: u64,
    /// This boot's id, for a log on a real file.
    pub(super) boot: Option<&'a str>,
    pub(super) name: &'a Path,
    /// A heal in a running process: the log's last frame may be one whose
    /// write failed, so a damaged last frame is the end, as after a reboot.
    pub(super) heal: bool,
}

/// How the live frames of a store's log are to be read, and what is wrong
/// with the log before any frame is read: [`plan_log`].
pub(super) struct LogPlan {
    pub(super) file_len: u64,
    /// The durable epoch: its frames, then the next epoch's, are live.
    pub(super) epoch: u64,
    /// The size the frames were laid out for: the file's, unless the store
    /// recorded another.
    pub(super) layout_len: u64,
    /// No reboot since the open that wrote the frames (see `record_log::walk`).
    pub(super) no_reboot: bool,
    pub(super) clean_stop: Option<bool>,
    /// What an open refuses (each an [`Error::Corrupt`]), in order.
    pub(super) problems: Vec<Damage>,
}

/// Checks the log against what the store file says of it. After an
/// unclean stop the log is part of the store: missing, cut short or
/// another store's, a replay would silently drop acknowledged writes.
pub(super) fn plan_log(
    db: &Database,
    file: &dyn StorageBackend,
    found: &Found<'_>,
) -> Result<LogPlan> {
    let name = found.name;
    let len = file.len().map_err(Error::Io)?;
    let wal = read_wal(db)?;
    let mut plan = LogPlan {
        file_len: len,
        epoch: wal.epoch,
        layout_len: len,
        // No reboot since the open that wrote these frames: no power loss
        // can have torn one, so a damaged last frame is damage.
        no_reboot: !found.heal && found.boot.is_some() && wal.boot.as_deref() == found.boot,
        clean_stop: wal.state.map(|s| !s.open),
        problems: Vec::new(),
    };
    let Some(state) = wal.state.filter(|s| s.open) else {
        return Ok(plan);
    };
    match state.bytes {
        // The last open stopped before its log had a size: no frame was
        // ever written, nothing can be missing.
        Some(0) => {}
        _ if len == 0 => plan.problems.push(Damage::LogMissing {
            store: name.to_path_buf(),
        }),
        Some(recorded) if len < recorded => {
            plan.problems.push(Damage::LogCutShort {
                store: name.to_path_buf(),
                len,
                recorded,
            });
            // What is left is read where it was written.
            plan.layout_len = recorded;
        }
        // A longer file (extended by hand) still holds the frames where
        // they were written.
        Some(recorded) => plan.layout_len = recorded,
        None => {}
    }
    Ok(plan)
}

/// Walks the live frames as `plan` says (`record_log::walk`): the durable
/// epoch's and then the next one's (a checkpoint may have been running).
/// Returns the frames handed to `on_frame`, and, after an unclean stop,
/// [`Damage::LogOfAnotherStore`] when the log is another store's: frames
/// verify under this store's id only; one that does not may be this
/// store's first, torn by a crash, but two or more cannot all be. That
/// damage is what an open says of such a log, before what the walk met.
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
        let loss = loss.as_deref_mut();
        match record_log::walk(
            file,
            &found.store_id,
            &layout,
            plan.no_reboot,
            loss,
            &mut seen,
            &mut on_frame,
        ) {
            Ok(n) => frames += n,
            Err(e) => {
                let first = met.take().unwrap_or(e);
                // Damage before any frame of this store's: the log may be
                // another store's, which the next epoch's walk tells.
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

/// What [`recover_log`] leaves: the log, empty, and what the replay did.
pub(super) struct Recovered {
    pub(super) wal: LogWriter,
    pub(super) frames: u64,
    pub(super) token_hwm: u64,
}

/// Replays the log's frames of the current epoch, then commits durably with
/// a new epoch (retiring every frame found, whole or torn), and makes sure
/// the log file has its full size.
pub(super) fn recover_log(
    db: &Database,
    file: std::sync::Arc<dyn StorageBackend>,
    found: &Found<'_>,
    config: &Config,
    loss: &mut LossReport,
) -> Result<Recovered> {
    let (store_id, boot) = (found.store_id, found.boot);
    let mut plan = plan_log(db, file.as_ref(), found)?;
    let len = plan.file_len;
    for problem in std::mem::take(&mut plan.problems) {
        if !config.accept_loss {
            return Err(problem.into());
        }
        loss.findings.push(format!("accepted: {problem}"));
    }
    // Both epochs are retired by the commit; new frames start a fresh one.
    let fresh = plan.epoch.wrapping_add(2);
    let mut token_hwm = found.token_hwm;
    let frames = commit(db, true, |tables| {
        // Replayed with the layout the log was written in, before its size
        // may change below (a larger `log_bytes` moves the segments).
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
        match boot {
            Some(boot) => tables.set_meta(META_LOG_BOOT, boot.as_bytes())?,
            None => tables.remove_meta(META_LOG_BOOT)?,
        }
        // The size as it is: a crash while `preallocate` grows the file
        // below leaves it longer than recorded, which is allowed (no frame
        // of the new epoch exists before the size is recorded again).
        tables.set_meta(META_LOG_BYTES, &len.to_be_bytes())?;
        Ok::<_, Error>(frames)
    })??;
    // A read-only open replayed into memory (an overlay) and leaves the
    // log file as it is.
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
        wal: LogWriter::new(file, store_id, fresh, new_len),
        frames,
        token_hwm,
    })
}

/// This boot of the machine: Linux's random id, new at every boot. An
/// open after a process crash (the same boot) knows the page cache held
/// every write the process made, so no frame can have been torn by a power
/// loss. `None` where the system does not say.
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
