//! The group's decisions ([`decide`]): each op through the state machine
//! (`logic`) once, against the group's own earlier writes, then the
//! memtable, then redb. Each record written is encoded here once (the log
//! frame, the memtable and the checkpoint carry those bytes); nothing is
//! written here: `commit/mod.rs` makes the frame durable.

use super::super::memtable::{self, Encoded, Entry, Mem};
use super::super::record_log::FrameBuf;
use super::{Op, Reply};
use crate::codec;
use crate::error::{Error, Result};
use crate::logic;
use crate::record::Record;
use crate::redb::tables::ReadTables;
use crate::time::Timestamp;
use std::collections::BTreeMap;

/// What deciding a group produced.
#[derive(Debug, Default)]
pub(super) struct Decided {
    /// One per op, in order.
    pub(super) answers: Vec<Result<Reply>>,
    /// Each written key's final state (a deletion is `None`).
    pub(super) writes: BTreeMap<Vec<u8>, Entry>,
    /// The writes in the order they were made, for the log.
    pub(super) frame: FrameBuf,
    /// Records deleted by sweeps.
    pub(super) swept: usize,
}

/// Decides every op of a group in order (see the module docs).
pub(super) fn decide(ops: &[Op], mem: &Mem, base: &ReadTables, hwm: &mut u64) -> Decided {
    let mut group = Group {
        mem,
        base,
        out: Decided::default(),
    };
    for op in ops {
        let answer = group.step(op, hwm);
        group.out.answers.push(answer);
    }
    group.out
}

struct Group<'a> {
    mem: &'a Mem,
    base: &'a ReadTables,
    out: Decided,
}

impl Group<'_> {
    /// The current state of `key`: this group's writes, the memtable, redb.
    fn current(&self, key: &[u8]) -> Result<Option<Record>> {
        if let Some(entry) = self.out.writes.get(key).or_else(|| self.mem.get(key)) {
            return memtable::decode(key, entry);
        }
        self.base.read(key)
    }

    /// Encodes `record` (checking its invariants) once: the log frame,
    /// the memtable and, at the checkpoint, redb all get these bytes.
    fn put(&mut self, key: &[u8], record: &Record) -> Result<()> {
        let encoded = Encoded::new(record)?;
        self.out.frame.record_put(key, &encoded.value);
        self.out.writes.insert(key.to_vec(), Some(encoded));
        Ok(())
    }

    fn delete(&mut self, key: &[u8]) {
        self.out.frame.record_del(key);
        self.out.writes.insert(key.to_vec(), None);
    }

    fn step(&mut self, op: &Op, hwm: &mut u64) -> Result<Reply> {
        match op {
            Op::Begin {
                key,
                fingerprint,
                now,
                lease,
                retention,
            } => {
                let existing = self.current(key)?;
                let last = *hwm;
                let decided =
                    logic::begin(existing, fingerprint, *now, *lease, *retention, || {
                        last.checked_add(1)
                            .ok_or_else(|| Error::invalid_argument("fencing tokens exhausted"))
                    })?;
                if let Some(record) = decided.write {
                    self.put(key, &record)?;
                    *hwm = (*hwm).max(record.token);
                }
                Ok(Reply::Begin(decided.answer))
            }
            Op::Complete {
                key,
                claim,
                response,
                now,
                retention,
            } => {
                let existing = self.current(key)?;
                let record = logic::complete(existing, claim, response, *now, *retention)?;
                self.put(key, &record)?;
                Ok(Reply::Done)
            }
            Op::Release { key, claim } => {
                let existing = self.current(key)?;
                let present = existing.is_some();
                match logic::release(existing, claim)? {
                    Some(kept) => self.put(key, &kept)?,
                    None if present => self.delete(key),
                    None => {}
                }
                Ok(Reply::Done)
            }
            // A step already recorded writes nothing: what this group reads
            // is durable by the time the group's answers go out.
            Op::Step {
                key,
                claim,
                step,
                now,
            } => {
                let existing = self.current(key)?;
                if let Some(record) = logic::record_step(existing, claim, step, *now)? {
                    self.put(key, &record)?;
                }
                Ok(Reply::Done)
            }
            Op::Renew {
                key,
                claim,
                now,
                lease,
            } => {
                let existing = self.current(key)?;
                let step = logic::renew(existing, claim, *now, *lease)?;
                self.put(key, &step.write)?;
                Ok(Reply::Renewed(step.claim))
            }
            Op::Sweep { now, max } => {
                let swept = self.sweep(*now, *max)?;
                self.out.swept += swept;
                Ok(Reply::Swept(swept))
            }
        }
    }

    /// Deletes up to `max` expired records, oldest expiry first (ties in
    /// key order), wherever they are: this group, the memtable, redb.
    fn sweep(&mut self, now: Timestamp, max: usize) -> Result<usize> {
        let mut candidates = self.mem.due(now);
        for (key, entry) in &self.out.writes {
            if let Some(e) = entry
                && logic::sweepable(e.expires_at, now)
            {
                candidates.push((e.expires_at, key.clone()));
            }
        }
        // redb's index, in (expiry, key) order: its first `max` live
        // entries are all it can contribute. Keys in memory were nominated
        // above; an entry whose record has another expiry (damage) is not.
        let mut from_base = 0;
        self.base.due(now, |index_key| {
            let (expires_at, key) = codec::decode_index(index_key)?;
            if self.out.writes.contains_key(key) || self.mem.get(key).is_some() {
                return Ok(true);
            }
            match self.base.read(key)? {
                Some(r) if r.expires_at == expires_at && logic::sweepable(r.expires_at, now) => {
                    candidates.push((expires_at, key.to_vec()));
                    from_base += 1;
                }
                _ => {}
            }
            Ok(from_base < max)
        })?;
        candidates.sort();
        candidates.dedup();
        let mut swept = 0;
        for (expires_at, key) in candidates {
            if swept >= max {
                break;
            }
            // Re-check against the current state: the index and the
            // memtable only nominate.
            match self.current(&key)? {
                Some(r) if r.expires_at == expires_at && logic::sweepable(r.expires_at, now) => {
                    self.delete(&key);
                    swept += 1;
                }
                _ => {}
            }
        }
        Ok(swept)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{D, T, begin, shared};
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::record::{Begin, Claim};
    use crate::response::Response;
    use crate::sync::atomic::Ordering;
    use std::time::Duration;

    /// An index entry whose record has another expiry (left by damage or
    /// by a bug) never gets its record swept early: the sweep checks each
    /// nominee against its record, and sweeps the record once, when it is
    /// due.
    #[test]
    fn a_sweep_ignores_an_index_entry_that_names_another_expiry() {
        let shared = shared();
        shared.commit_group(&[short_claim(b"\0r", 10)]);
        // Into redb, where the index is.
        shared.flush().unwrap();
        plant_stale_index_entry(&shared, b"\0r", 5);
        // Before the record's own expiry: nothing is swept.
        assert_eq!(swept(&shared, 8, 10), 0);
        assert!(shared.read(b"\0r").unwrap().is_some(), "not swept early");
        // Past it: the record goes, once.
        assert_eq!(swept(&shared, 1_000, 10), 1);
        assert!(shared.read(b"\0r").unwrap().is_none());
        assert_eq!(swept(&shared, 1_000, 10), 0);
    }

    /// A claim at `at` ms whose lease and retention are 1 ms each.
    fn short_claim(id: &[u8], at: u64) -> Op {
        Op::Begin {
            key: id.to_vec(),
            fingerprint: Fingerprint::of(b"fp"),
            now: Timestamp::from_millis(at),
            lease: Duration::from_millis(1),
            retention: Duration::from_millis(1),
        }
    }

    /// A sweep at `at` ms of up to 10 records.
    fn sweep_at(at: u64) -> Op {
        Op::Sweep {
            now: Timestamp::from_millis(at),
            max: 10,
        }
    }

    /// A sweep at `at` ms of up to `max` records, alone in its group: how
    /// many it deleted.
    fn swept(shared: &crate::redb::Shared, at: u64, max: usize) -> usize {
        let answers = shared.commit_group(&[Op::Sweep {
            now: Timestamp::from_millis(at),
            max,
        }]);
        match answers.as_slice() {
            [Ok(Reply::Swept(n))] => *n,
            other => panic!("{other:?}"),
        }
    }

    /// An expiry index entry for `key` at `at` ms that its record does not
    /// have, written into redb directly.
    fn plant_stale_index_entry(shared: &crate::redb::Shared, key: &[u8], at: u64) {
        let stale = codec::encode_index(Timestamp::from_millis(at), key);
        shared.direct(|tables, _| tables.index(&stale)).unwrap();
    }

    /// A sweep in the same group as a new claim of an expired key checks
    /// the memtable's nominee against the group's own write: the new claim
    /// stays.
    #[test]
    fn a_sweep_keeps_a_claim_made_earlier_in_its_group() {
        let shared = shared();
        shared.commit_group(&[short_claim(b"\0x", 10)]);
        let answers = shared.commit_group(&[short_claim(b"\0x", 1_000), sweep_at(1_000)]);
        assert!(
            matches!(
                answers.as_slice(),
                [Ok(Reply::Begin(Begin::Claimed(_))), Ok(Reply::Swept(0))]
            ),
            "{answers:?}"
        );
        let record = shared.read(b"\0x").unwrap();
        assert!(record.is_some_and(|r| r.state == crate::State::Processing));
    }

    /// A memtable nominee whose key the group has since rewritten (with
    /// an expiry that is due too) is checked against its current expiry:
    /// it is not swept under its old one, and with `max` 1 the record
    /// whose nomination holds is the one that goes.
    #[test]
    fn a_sweep_checks_a_memtable_nominee_against_its_current_expiry() {
        let shared = shared();
        shared.commit_group(&[short_claim(b"\0x", 10), short_claim(b"\0y", 100)]);
        let answers = shared.commit_group(&[
            short_claim(b"\0x", 500),
            Op::Sweep {
                now: Timestamp::from_millis(1_000),
                max: 1,
            },
        ]);
        assert!(
            matches!(
                answers.as_slice(),
                [Ok(Reply::Begin(Begin::Claimed(_))), Ok(Reply::Swept(1))]
            ),
            "{answers:?}"
        );
        assert!(shared.read(b"\0x").unwrap().is_some(), "x is not due first");
        assert!(shared.read(b"\0y").unwrap().is_none(), "y was due first");
    }

    /// An index entry in redb for a key the memtable holds a newer record
    /// of nominates nothing and does not count against `max`: the due
    /// record after it in the index is swept.
    #[test]
    fn a_sweep_passes_over_an_index_entry_shadowed_by_the_memtable() {
        let shared = shared();
        shared.commit_group(&[short_claim(b"\0r", 10), short_claim(b"\0s", 20)]);
        shared.flush().unwrap();
        // r again, in the memtable only, due long after the sweep.
        shared.commit_group(&[short_claim(b"\0r", 300)]);
        assert_eq!(swept(&shared, 200, 1), 1);
        assert!(shared.read(b"\0r").unwrap().is_some());
        assert!(shared.read(b"\0s").unwrap().is_none());
    }

    #[test]
    fn one_group_applies_in_order_and_a_bad_request_fails_alone() {
        let shared = shared();
        let bogus = Claim::new(99, T, false, 1);
        let answers = shared.commit_group(&[
            begin(b"\0a"),
            // A duplicate in the same group sees the claim made just before it.
            begin(b"\0a"),
            // Fails validation: it fails alone, the group still commits.
            Op::Complete {
                key: b"\0b".to_vec(),
                claim: bogus,
                response: Response::new(200, ""),
                now: T,
                retention: D,
            },
            begin(b"\0c"),
        ]);
        let mut it = answers.into_iter();
        assert!(matches!(it.next(), Some(Ok(Reply::Begin(Begin::Claimed(c)))) if c.token == 1));
        assert!(matches!(
            it.next(),
            Some(Ok(Reply::Begin(Begin::InFlight { .. })))
        ));
        assert!(matches!(it.next(), Some(Err(Error::StaleClaim))));
        assert!(matches!(it.next(), Some(Ok(Reply::Begin(Begin::Claimed(c)))) if c.token == 2));
        assert_eq!(shared.stats.commits.load(Ordering::Relaxed), 1);
        assert_eq!(shared.log.lock().token_hwm, 2);
        assert_eq!(shared.memory.read_mem().active.len(), 2, "in the memtable");
    }

    #[test]
    fn a_group_of_answers_only_commits_nothing() {
        let shared = shared();
        let answers = shared.commit_group(&[Op::Sweep { now: T, max: 10 }]);
        assert!(matches!(answers.as_slice(), [Ok(Reply::Swept(0))]));
        assert_eq!(shared.stats.commits.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_sweep_takes_expired_records_from_memory_and_redb_in_order() {
        let shared = shared();
        let claim = short_claim;
        shared.commit_group(&[claim(b"\0r1", 10), claim(b"\0r2", 20)]);
        // Into redb: the memtable is checkpointed by a direct transaction.
        shared.direct(|_, _| Ok::<_, Error>(())).unwrap();
        assert!(shared.memory.read_mem().is_empty());
        shared.commit_group(&[claim(b"\0m1", 15), claim(b"\0m2", 25)]);
        assert_eq!(swept(&shared, 1_000, 3), 3);
        // Oldest first: r1 (11), m1 (16), r2 (21) went; m2 (26) is left.
        let mem = shared.memory.read_mem();
        assert!(matches!(mem.get(b"\0r1"), Some(None)));
        assert!(matches!(mem.get(b"\0m1"), Some(None)));
        assert!(matches!(mem.get(b"\0r2"), Some(None)));
        assert!(matches!(mem.get(b"\0m2"), Some(Some(_))));
        drop(mem);
        assert_eq!(swept(&shared, 1_000, 3), 1);
        assert_eq!(shared.stats.swept.load(Ordering::Relaxed), 4);
    }

    /// A sweep of one passes over an index entry whose record has another
    /// expiry: it does not count against `max`, and the due record behind
    /// it is swept.
    #[test]
    fn a_sweep_of_one_passes_over_an_index_entry_that_names_another_expiry() {
        let shared = shared();
        shared.commit_group(&[short_claim(b"\0r", 10)]);
        shared.flush().unwrap();
        plant_stale_index_entry(&shared, b"\0r", 5);
        assert_eq!(swept(&shared, 1_000, 1), 1);
        assert!(shared.read(b"\0r").unwrap().is_none());
    }
}
