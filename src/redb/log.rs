//! [`Log`]: the record log as the store holds it while open: the writer
//! and the token high-water mark behind the commit lock, and what relaxed
//! durability needs to sync it later.

use super::Durability;
use super::record_log::LogWriter;
use crate::sync::atomic::AtomicBool;
use crate::sync::{Arc, Mutex, MutexGuard, TryLockError};
use ::redb::StorageBackend;

/// The log and the commit lock.
pub(super) struct Log {
    /// The commit lock: the leader holds it for a group, a direct
    /// transaction for its transaction.
    core: Mutex<Core>,
    /// Relaxed durability: frames written since the last sync.
    pub(super) unsynced: AtomicBool,
    /// The log file, for the background sync.
    pub(super) file: Arc<dyn StorageBackend>,
    pub(super) durability: Durability,
}

/// What only the holder of the commit lock touches.
#[derive(Debug)]
pub(super) struct Core {
    pub(super) writer: LogWriter,
    /// The largest fencing token handed out.
    pub(super) token_hwm: u64,
}

impl Log {
    pub(super) fn new(wal: LogWriter, token_hwm: u64, durability: Durability) -> Log {
        Log {
            file: wal.file(),
            core: Mutex::new(Core {
                writer: wal,
                token_hwm,
            }),
            unsynced: AtomicBool::new(false),
            durability,
        }
    }

    // A panic while leading poisons the store, so a poisoned lock is taken
    // as it is (as every lock of the store's).
    pub(super) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn try_lock(&self) -> Option<MutexGuard<'_, Core>> {
        match self.core.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }
}
