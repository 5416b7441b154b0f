//! The replay cache: completed records kept in memory after their memtable
//! is checkpointed, so that a retry seconds later is answered from memory
//! instead of a redb read transaction and a B-tree walk.
//!
//! It lives in the memtable's `Mem` (memtable.rs), under its lock,
//! and readers consult it after the active and the frozen table and before
//! redb. It is filled at one point only: a checkpoint, after its redb commit
//! and *before* it drops the frozen table, takes that table's entries in
//! (a DONE record goes in, any other entry takes its key out). While that
//! happens the frozen table is still there and shadows the keys, and once
//! it is gone the cache holds what redb holds for them. A later write to a
//! key lands in the active table, which shadows the cache until its own
//! checkpoint replaces the entry. So an entry is never older than the
//! store's state of its key, with three writers that bypass the memtable:
//!
//! - a direct transaction (inbox, admin evict and import, compaction, a
//!   group too large for the log) empties the cache before it writes;
//! - a heal empties it (it rebuilds the state from the file and the log);
//! - a checkpoint whose frozen table was taken away meanwhile (a heal)
//!   stops filling.
//!
//! Eviction is first in, first out, by bytes ([`REPLAY_CACHE_BYTES`] by
//! default, [`replay_cache_bytes`](super::RedbStoreBuilder::replay_cache_bytes)):
//! an evicted key is read from redb, which has it.

use crate::record::{Record, State};
use std::collections::{HashMap, VecDeque};

/// Bytes of completed records the replay cache holds by default (keys,
/// response bodies and a fixed allowance per entry, as the memtable counts
/// them): about 80,000 responses of 64 bytes.
///
/// ```
/// assert_eq!(idemstore::redb::REPLAY_CACHE_BYTES, 16 * 1024 * 1024);
/// ```
pub const REPLAY_CACHE_BYTES: usize = 16 * 1024 * 1024;

/// Places in the eviction order beyond twice the live entries before the
/// stale ones are dropped (a key put in again leaves its old place behind).
const STALE_SLACK: usize = 1024;

/// Completed records by encoded key, evicted first in, first out.
#[derive(Debug, Default)]
pub(super) struct Hot {
    cap: usize,
    /// Each record with the number of its place in `order` and its cost.
    map: HashMap<Vec<u8>, (Record, u64, usize)>,
    /// Keys in the order they came in; a key taken out or put in again
    /// leaves a stale place behind, skipped when it comes up.
    order: VecDeque<(u64, Vec<u8>)>,
    bytes: usize,
    next: u64,
}

impl Hot {
    /// An empty cache of at most `cap` bytes (0: off).
    pub(super) fn new(cap: usize) -> Hot {
        Hot {
            cap,
            ..Hot::default()
        }
    }

    /// The completed record of `key`, if it is held.
    pub(super) fn get(&self, key: &[u8]) -> Option<&Record> {
        self.map.get(key).map(|(record, _, _)| record)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }

    /// Takes in a checkpointed entry (`None`: a deletion) of `entry_bytes`
    /// as the memtable counts them: a DONE record is held (in place of any
    /// older one), anything else (a claim, a deletion) takes the key out.
    pub(super) fn take_in(&mut self, key: &[u8], entry: Option<&Record>, entry_bytes: usize) {
        if self.cap == 0 {
            return;
        }
        self.remove(key);
        let Some(record) = entry.filter(|r| r.state == State::Done) else {
            return;
        };
        // The key's second copy lives in the eviction order.
        let cost = entry_bytes + key.len();
        if cost > self.cap {
            return;
        }
        let place = self.next;
        self.next += 1;
        self.map.insert(key.to_vec(), (record.clone(), place, cost));
        self.order.push_back((place, key.to_vec()));
        self.bytes += cost;
        while self.bytes > self.cap {
            let Some((place, key)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&key).is_some_and(|(_, p, _)| *p == place) {
                self.remove(&key);
            }
        }
        // Stale places are dropped once they outnumber the live ones.
        if self.order.len() > 2 * self.map.len() + STALE_SLACK {
            let map = &self.map;
            self.order
                .retain(|(place, key)| map.get(key).is_some_and(|(_, p, _)| p == place));
        }
    }

    /// Forgets everything (before a write that bypasses the memtable).
    pub(super) fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
        self.bytes = 0;
    }

    fn remove(&mut self, key: &[u8]) {
        if let Some((_, _, cost)) = self.map.remove(key) {
            self.bytes -= cost;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::response::Response;
    use crate::time::Timestamp;

    /// Stands in for the memtable's count, which the cache takes as given.
    fn entry_bytes(key: &[u8], entry: &Option<Record>) -> usize {
        let body = entry.as_ref().and_then(|r| r.response.as_ref());
        key.len() + 100 + body.map_or(0, |r| r.body().len())
    }

    /// What a checkpoint does: hands in the entry with its bytes.
    fn take(hot: &mut Hot, key: &[u8], entry: &Option<Record>) {
        hot.take_in(key, entry.as_ref(), entry_bytes(key, entry));
    }

    /// What one entry costs the cache: its bytes and the key's second copy.
    fn cost(key: &[u8], entry: &Option<Record>) -> usize {
        entry_bytes(key, entry) + key.len()
    }

    fn record(state: State, body: &str) -> Record {
        Record {
            fingerprint: Fingerprint::of(b"f"),
            state,
            response: (state == State::Done).then(|| Response::new(200, body)),
            lease_until: (state == State::Processing).then(|| Timestamp::from_millis(5)),
            expires_at: Timestamp::from_millis(10),
            created_at: Timestamp::from_millis(1),
            token: 1,
            attempts: 1,
        }
    }

    fn body(hot: &Hot, key: &[u8]) -> Option<Vec<u8>> {
        hot.get(key)
            .and_then(|r| r.response.as_ref())
            .map(|r| r.body().to_vec())
    }

    #[test]
    fn done_records_are_held_and_anything_else_takes_the_key_out() {
        let mut hot = Hot::new(1 << 20);
        take(&mut hot, b"a", &Some(record(State::Done, "one")));
        take(&mut hot, b"b", &Some(record(State::Processing, "")));
        assert_eq!(body(&hot, b"a"), Some(b"one".to_vec()));
        assert!(hot.get(b"b").is_none());
        // A newer DONE record replaces the older one.
        take(&mut hot, b"a", &Some(record(State::Done, "two")));
        assert_eq!(body(&hot, b"a"), Some(b"two".to_vec()));
        assert_eq!(hot.len(), 1);
        // A claim on the key (its record expired and was taken over) and
        // a deletion both take it out.
        take(&mut hot, b"a", &Some(record(State::Processing, "")));
        assert!(hot.get(b"a").is_none());
        take(&mut hot, b"c", &Some(record(State::Done, "c")));
        take(&mut hot, b"c", &None);
        assert!(hot.get(b"c").is_none());
        assert_eq!((hot.len(), hot.bytes), (0, 0));
        take(&mut hot, b"d", &Some(record(State::Done, "d")));
        hot.clear();
        assert!(hot.get(b"d").is_none());
        assert_eq!((hot.len(), hot.bytes, hot.order.len()), (0, 0, 0));
    }

    #[test]
    fn the_oldest_entries_go_first_and_the_bytes_stay_under_the_cap() {
        let one = cost(b"k0", &Some(record(State::Done, "x")));
        let mut hot = Hot::new(3 * one);
        for i in 0..3 {
            take(
                &mut hot,
                format!("k{i}").as_bytes(),
                &Some(record(State::Done, "x")),
            );
        }
        assert_eq!(hot.len(), 3);
        // k0 put in again: it is now the newest, so k1 goes first.
        take(&mut hot, b"k0", &Some(record(State::Done, "x")));
        take(&mut hot, b"k3", &Some(record(State::Done, "x")));
        assert!(hot.get(b"k1").is_none());
        for kept in [&b"k0"[..], b"k2", b"k3"] {
            assert!(hot.get(kept).is_some(), "{kept:?}");
        }
        assert_eq!(hot.bytes, 3 * one);
        // An entry larger than the whole cache is not held, and evicts nothing.
        let big = "y".repeat(4 * one);
        take(&mut hot, b"big", &Some(record(State::Done, &big)));
        assert!(hot.get(b"big").is_none());
        assert_eq!(hot.len(), 3);
    }

    #[test]
    fn an_entry_as_large_as_the_cache_is_held_and_costs_its_key_twice() {
        let entry = Some(record(State::Done, "x"));
        let one = entry_bytes(b"k0", &entry) + 2;
        let mut hot = Hot::new(one);
        take(&mut hot, b"k0", &entry);
        assert!(hot.get(b"k0").is_some());
        assert_eq!(hot.bytes, one);
        take(&mut hot, b"k0", &None);
        assert_eq!(hot.bytes, 0);
    }

    #[test]
    fn stale_places_are_dropped_exactly_past_the_slack() {
        let mut hot = Hot::new(1 << 20);
        let done = Some(record(State::Done, "a"));
        for key in [&b"a"[..], b"b", b"c"] {
            take(&mut hot, key, &done);
        }
        // Three live keys: the order may hold 2 * 3 + STALE_SLACK places.
        let bound = 2 * 3 + STALE_SLACK;
        while hot.order.len() < bound {
            take(&mut hot, b"a", &done);
        }
        assert_eq!(hot.order.len(), bound);
        take(&mut hot, b"a", &done);
        assert_eq!(hot.order.len(), 3, "only the live places are left");
        let keys: Vec<&[u8]> = hot.order.iter().map(|(_, k)| k.as_slice()).collect();
        assert_eq!(keys, [&b"b"[..], b"c", b"a"]);
        assert!([&b"a"[..], b"b", b"c"].iter().all(|k| hot.get(k).is_some()));
    }

    #[test]
    fn off_holds_nothing_and_stale_places_are_dropped() {
        let mut off = Hot::new(0);
        take(&mut off, b"a", &Some(record(State::Done, "a")));
        assert!(off.get(b"a").is_none());
        let mut hot = Hot::new(1 << 20);
        for _ in 0..5_000 {
            take(&mut hot, b"same", &Some(record(State::Done, "a")));
        }
        assert_eq!(hot.len(), 1);
        assert!(
            hot.order.len() <= 2 * hot.len() + 1024,
            "{}",
            hot.order.len()
        );
        assert_eq!(hot.bytes, cost(b"same", &Some(record(State::Done, "a"))));
    }
}
