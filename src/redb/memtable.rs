//! The memtable: what groups wrote since the last checkpoint, as the bytes
//! their log frames hold. A group's writes are published after its frame is
//! durable; only the commit lock's holder writes, freezes or empties the
//! active table; a checkpoint drops the frozen table only after its redb
//! commit. So a reader that reads the memtable, then redb, never sees an
//! older state than the memtable held (db.rs: which redb snapshot).

use crate::codec;
use crate::error::Result;
use crate::record::Record;
use crate::sync::{Condvar, Instant, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use crate::time::Timestamp;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// What is in memory, and the background thread's flags and wake-ups.
pub(super) struct Memory {
    tables: RwLock<Mem>,
    /// True once the store is dropped; `bg_cv` wakes the background thread
    /// (a frozen memtable, a failure, shutdown) and those waiting for a
    /// checkpoint to finish.
    bg: Mutex<bool>,
    pub(super) bg_cv: Condvar,
    pub(super) checkpoint_interval: Duration,
}

impl Memory {
    pub(super) fn new(checkpoint_interval: Duration) -> Memory {
        Memory {
            tables: RwLock::new(Mem::default()),
            bg: Mutex::new(false),
            bg_cv: Condvar::new(),
            checkpoint_interval,
        }
    }

    pub(super) fn read_mem(&self) -> RwLockReadGuard<'_, Mem> {
        self.tables.read().unwrap_or_else(|p| p.into_inner())
    }
    pub(super) fn write_mem(&self) -> RwLockWriteGuard<'_, Mem> {
        self.tables.write().unwrap_or_else(|p| p.into_inner())
    }
    pub(super) fn lock_bg(&self) -> MutexGuard<'_, bool> {
        self.bg.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits at most `timeout` ([`UNTIL_WOKEN`]: until a wake-up) on `bg_cv`.
    pub(super) fn wait_bg<'a>(
        &self,
        bg: MutexGuard<'a, bool>,
        timeout: Duration,
    ) -> MutexGuard<'a, bool> {
        let woken = self.bg_cv.wait_timeout(bg, timeout);
        woken.map(|(bg, _)| bg).unwrap_or_else(|p| p.into_inner().0)
    }

    /// Wakes the background thread (a frozen memtable, a failure, shutdown).
    pub(super) fn wake_background(&self) {
        let _bg = self.lock_bg();
        self.bg_cv.notify_all();
    }
}

/// A wait on `bg_cv` that only a wake-up ends (its waiter checks again).
pub(super) const UNTIL_WOKEN: Duration = Duration::from_secs(3600);
/// Bytes of records the active memtable may hold before the next group
/// freezes it: a bound on the memory beyond redb's cache (two tables at
/// most) and on the work of one checkpoint.
pub(crate) const MEMTABLE_BYTES: usize = 4 * 1024 * 1024;

/// One key's latest state: the encoded record that went into the log, or
/// `None` for a deletion (released or swept) that redb must see at the
/// next checkpoint.
pub(super) type Entry = Option<Encoded>;

/// A record as [`codec::encode_record`] wrote it into the log frame; the
/// checkpoint writes these bytes into redb, so a record is encoded once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Encoded {
    pub(super) value: Vec<u8>,
    /// The record's expiry, which names its expiry-index entry.
    pub(super) expires_at: Timestamp,
}

impl Encoded {
    pub(super) fn new(record: &Record) -> Result<Encoded> {
        Ok(Encoded {
            value: codec::encode_record(record)?,
            expires_at: record.expires_at,
        })
    }
}

/// The record `entry` holds for `key`: what redb returns once a checkpoint
/// has written it.
pub(super) fn decode(key: &[u8], entry: &Entry) -> Result<Option<Record>> {
    entry
        .as_ref()
        .map(|e| codec::decode_record(key, &e.value))
        .transpose()
}

/// Records by encoded key. Hashed, not ordered: a group looks keys up
/// several times per op, and only a checkpoint needs them in order (it
/// sorts them once, off the commit path). Keys come from clients, so the
/// hash is std's keyed one.
pub(super) type Table = HashMap<Vec<u8>, Entry>;

/// A memtable being written into redb by a checkpoint.
#[derive(Debug)]
pub(super) struct Frozen {
    pub(super) records: Table,
    /// The log epoch whose frames hold these records: the checkpoint stores
    /// `epoch + 1` as the durable epoch, retiring those frames.
    pub(super) epoch: u64,
    /// The fencing-token high-water mark when it was frozen.
    pub(super) token_hwm: u64,
}

/// Both memtables.
#[derive(Debug, Default)]
pub(super) struct Mem {
    pub(super) active: Table,
    /// Approximate bytes held by `active` (see [`entry_bytes`]).
    pub(super) active_bytes: usize,
    /// When the active table's first record came: its age times a
    /// checkpoint.
    pub(super) since: Option<Instant>,
    pub(super) frozen: Option<Arc<Frozen>>,
}

impl Mem {
    /// The latest state of `key` in memory: `Some(entry)` when the memtable
    /// decides it (a record or a deletion), `None` when redb does.
    pub(super) fn get(&self, key: &[u8]) -> Option<&Entry> {
        self.active
            .get(key)
            .or_else(|| self.frozen.as_deref().and_then(|f| f.records.get(key)))
    }

    /// Neither an active nor a frozen record.
    pub(super) fn is_empty(&self) -> bool {
        self.active.is_empty() && self.frozen.is_none()
    }

    /// Publishes one group's writes (already durable in the log).
    pub(super) fn publish(&mut self, writes: impl IntoIterator<Item = (Vec<u8>, Entry)>) {
        self.since.get_or_insert_with(Instant::now);
        for (key, entry) in writes {
            let key_len = key.len();
            self.active_bytes += entry_bytes(key_len, &entry);
            if let Some(old) = self.active.insert(key, entry) {
                // The key is counted once: the old entry's bytes go.
                self.active_bytes = self.active_bytes.saturating_sub(entry_bytes(key_len, &old));
            }
        }
    }

    /// How long until the active table is old enough to checkpoint;
    /// `None` while it is empty.
    pub(super) fn checkpoint_left(&self, interval: Duration) -> Option<Duration> {
        Some(interval.saturating_sub(self.since?.elapsed()))
    }

    /// Moves the active table to the frozen slot (which must be empty).
    pub(super) fn freeze(&mut self, epoch: u64, token_hwm: u64) {
        // The next table is sized as this one: it need not grow again.
        let next = Table::with_capacity(self.active.len());
        self.frozen = Some(Arc::new(Frozen {
            records: std::mem::replace(&mut self.active, next),
            epoch,
            token_hwm,
        }));
        self.active_bytes = 0;
        self.since = None;
    }

    /// Records in memory whose expiry is at or before `now` (candidates for
    /// a sweep), with the key they are stored under. A key in the active
    /// table hides its frozen entry.
    pub(super) fn due(&self, now: Timestamp) -> Vec<(Timestamp, Vec<u8>)> {
        let frozen = self.frozen.iter().flat_map(|f| &f.records);
        let hidden = frozen.filter(|(key, _)| !self.active.contains_key(*key));
        self.active
            .iter()
            .chain(hidden)
            .filter_map(|(key, entry)| Some((entry.as_ref()?.expires_at, key)))
            .filter(|(at, _)| crate::logic::sweepable(*at, now))
            .map(|(at, key)| (at, key.clone()))
            .collect()
    }
}

/// Approximate memory of one entry: key, encoded record and a fixed
/// allowance for the map node and the allocations.
pub(super) fn entry_bytes(key_len: usize, entry: &Entry) -> usize {
    const OVERHEAD: usize = 96;
    key_len + OVERHEAD + entry.as_ref().map_or(0, |e| e.value.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::record::State;

    fn record(expires: u64) -> Record {
        Record {
            fingerprint: Fingerprint::of(b"x"),
            state: State::Processing,
            response: None,
            lease_until: Some(Timestamp::from_millis(expires)),
            expires_at: Timestamp::from_millis(expires),
            created_at: Timestamp::from_millis(0),
            token: 1,
            attempts: 1,
            steps: Vec::new(),
        }
    }

    fn entry(expires: u64) -> Entry {
        Some(Encoded::new(&record(expires)).unwrap())
    }

    #[test]
    fn active_hides_frozen_and_deletions_are_answers() {
        let mut mem = Mem::default();
        mem.publish([(b"a".to_vec(), entry(10)), (b"b".to_vec(), None)]);
        assert!(!mem.is_empty());
        mem.freeze(7, 1);
        let frozen = mem.frozen.clone().expect("frozen");
        assert_eq!((frozen.epoch, frozen.records.len()), (7, 2));
        assert_eq!(mem.active_bytes, 0);
        mem.publish([(b"a".to_vec(), None)]);
        assert!(matches!(mem.get(b"a"), Some(None)));
        assert!(matches!(mem.get(b"b"), Some(None)));
        assert!(mem.get(b"c").is_none());
        // Only the frozen record of a key the active table does not hide is due.
        mem.publish([(b"c".to_vec(), entry(5))]);
        let due = mem.due(Timestamp::from_millis(10));
        assert_eq!(due, vec![(Timestamp::from_millis(5), b"c".to_vec())]);
    }

    #[test]
    fn an_entry_decodes_to_the_record_it_was_encoded_from() {
        assert_eq!(decode(b"k", &entry(9)).unwrap(), Some(record(9)));
        assert_eq!(decode(b"k", &None).unwrap(), None);
    }

    #[test]
    fn bytes_count_each_key_once() {
        let mut mem = Mem::default();
        mem.publish([(b"k".to_vec(), entry(1))]);
        let once = mem.active_bytes;
        assert_eq!(once, entry_bytes(1, &entry(1)));
        mem.publish([(b"k".to_vec(), entry(2))]);
        assert_eq!(mem.active_bytes, once);
    }

    /// The memtable freezes on its size ([`MEMTABLE_BYTES`]): a size that
    /// ignored the record's bytes or the key would let a table of large
    /// responses grow without bound.
    #[test]
    fn entry_bytes_count_the_key_and_the_record() {
        let mut with_body = record(1);
        with_body.state = State::Done;
        with_body.lease_until = None;
        with_body.response = Some(crate::response::Response::new(200, vec![0; 1000]));
        let with_body = Some(Encoded::new(&with_body).unwrap());
        let deletion = entry_bytes(3, &None);
        assert!(entry_bytes(3, &with_body) - deletion >= 1000);
        assert_eq!(entry_bytes(4, &None) - deletion, 1);
        assert_eq!(MEMTABLE_BYTES, 4 << 20);
    }
}
