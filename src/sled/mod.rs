//! [`SledStore`]: the store on sled 0.34.7 (feature `sled`).
//!
//! Three trees in one sled database: records (`key → record envelope`), the
//! expiry index (`expires_at BE | key → ()`) and meta (format version, store
//! id, fencing-token high-water mark). Every decision is `logic::*`, every
//! byte layout `codec::*`; this module adds the transaction, the group
//! flush and the files.
//!
//! - **Atomicity.** Each write is one sled transaction over the three trees:
//!   read the record, decide, write the record, move its index entry and
//!   raise the token mark together. sled 0.34 runs transactions under one
//!   process-wide lock and seals each into one log batch, so they are
//!   serialisable and recovered whole or not at all.
//! - **Durability.** See `durable.rs`: sled's flush is not durable on Linux;
//!   after it the store fsyncs new blob files and fdatasyncs the data file,
//!   grouped across concurrent writers by `group.rs`.
//! - **Silent loss.** sled opens a damaged log as a shorter or empty one
//!   without an error; `marker.rs` keeps the store id and token mark outside
//!   sled so that such an open is refused.
//! - **Fast path.** A `begin` whose answer writes nothing (Replay, InFlight,
//!   Conflict) is decided from a plain read, without the transaction lock.
//!   It still waits until everything it may have read is durable, so no
//!   answer rests on a write that a crash could take back.
//!
//! Files: `options.rs` (durability, the builder and `open`), `stats.rs`
//! (the counters), `open.rs` (directory checks, lock, meta tree),
//! `durable.rs`, `group.rs`, `marker.rs`, `tx.rs` (the transaction's
//! record + index helpers); this file holds the public type and the
//! `Store` impl.

mod durable;
mod errors;
mod group;
mod marker;
mod open;
mod options;
mod stats;
mod tx;

pub use durable::Durability;
pub use options::SledStoreBuilder;
pub use stats::SledStats;

use crate::codec::{decode_index, decode_record, encode_key};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::logic;
use crate::record::{Begin, Claim, Record, check_durations};
use crate::response::Response;
use crate::step::Step;
use crate::store::{MAX_SWEEP_BATCH, Store};
use crate::sweeper::Sweeper;
use crate::time::{Clock, Timestamp};
use ::sled::transaction::{ConflictableTransactionError, TransactionError, Transactional};
use durable::DiskSync;
use group::GroupSync;
use marker::Marker;
use open::STORE_FORMAT_VERSION;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tx::{Tx, TxResult};

/// A durable [`Store`] in a sled 0.34.7 directory (feature `sled`).
///
/// Same contract as every store (the conformance suite runs against it
/// unchanged). What is specific to sled:
///
/// - **Durable for real.** sled's own `flush` ends in `sync_file_range` on
///   Linux, which does not survive a power loss. At the default
///   [`Durability::Immediate`] this store follows every flush with an
///   `fdatasync` of the data file (and an fsync of new blob files), and
///   concurrent writers share one flush + fsync: [`SledStore::stats`]
///   counts them.
/// - **Large responses** are made durable, not refused: a page over
///   128 KiB is a blob file in sled, and this store fsyncs those files and
///   their directory too.
/// - **Damage is refused, not forgotten.** sled itself opens a damaged
///   log as a shorter or empty one; this store keeps `idemstore.meta`
///   beside it and refuses such an open with [`Error::Corrupt`].
/// - **One process at a time.** A second open of the same directory is
///   [`Error::Locked`], in this process or another.
/// - **Poisoning.** After a failed flush or fsync every write is
///   [`Error::Poisoned`] until the store is reopened.
/// - **Space.** sled has no explicit compaction; deleted records free log
///   space that sled's background segment cleaner reuses. The README
///   section "Choosing an engine" has measurements.
///
/// ```
/// use idemstore::{Begin, Fingerprint, Key, Response, SledStore, Store, Timestamp};
/// use std::time::Duration;
///
/// let dir = tempfile::tempdir()?;
/// let store = SledStore::open(dir.path().join("orders.sled"))?;
/// let key = Key::new("tenant-42", "order-1")?;
/// let fp = Fingerprint::of(b"sku=A&qty=1");
/// let (lease, keep) = (Duration::from_secs(30), Duration::from_secs(86_400));
/// let now = Timestamp::from_millis(1_700_000_000_000);
/// let Begin::Claimed(claim) = store.begin(&key, &fp, now, lease, keep)? else { unreachable!() };
/// store.complete(&key, &claim, &Response::new(201, "charged"), now, keep)?;
/// drop(store);
///
/// // Reopened, the DONE record replays.
/// let store = SledStore::open(dir.path().join("orders.sled"))?;
/// assert_eq!(store.begin(&key, &fp, now, lease, keep)?, Begin::Replay(Response::new(201, "charged")));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct SledStore {
    // Declared first so it is dropped first: the sweeper thread stops
    // before the store's files close (it holds `inner` too, so the files
    // would otherwise stay open until it noticed).
    sweeper: Option<Sweeper>,
    inner: Arc<Inner>,
    /// The builder's clock: read by the sweeper, handed out by [`Store::clock`].
    clock: Arc<dyn Clock>,
}

#[derive(Debug)]
struct Inner {
    db: ::sled::Db,
    records: ::sled::Tree,
    expiry: ::sled::Tree,
    meta: ::sled::Tree,
    disk: DiskSync,
    group: GroupSync,
    /// Serialises write transactions (sled does too, process-wide) and
    /// holds the last fencing token handed out.
    writer: Mutex<u64>,
    durability: Durability,
    max_body_bytes: usize,
    store_id: u128,
    path: PathBuf,
    // Declared last so it is released last, after sled has closed.
    _lock: File,
}

impl SledStore {
    /// Opens (or creates) the store in directory `path` with the defaults.
    /// See [`SledStoreBuilder::open`] for the errors.
    ///
    /// ```
    /// let dir = tempfile::tempdir()?;
    /// let store = idemstore::SledStore::open(dir.path())?;
    /// // A second open of the same directory is refused while the first is open.
    /// assert!(matches!(idemstore::SledStore::open(dir.path()), Err(idemstore::Error::Locked { .. })));
    /// # drop(store);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn open(path: impl AsRef<Path>) -> Result<SledStore> {
        SledStore::builder().open(path)
    }

    /// A builder for the options: durability, body limit, sweeper.
    pub fn builder() -> SledStoreBuilder {
        SledStoreBuilder::new()
    }

    /// The store's directory.
    ///
    /// ```
    /// let dir = tempfile::tempdir()?;
    /// let store = idemstore::SledStore::open(dir.path())?;
    /// assert_eq!(store.path(), Some(dir.path()));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    ///
    /// An `Option` like [`RedbStore::path`](crate::RedbStore::path) (which
    /// is `None` for a store on a caller's storage backend); a sled store
    /// always has one.
    pub fn path(&self) -> Option<&Path> {
        Some(&self.inner.path)
    }

    /// The store's id, chosen at creation and kept across reopens.
    ///
    /// ```
    /// let dir = tempfile::tempdir()?;
    /// let id = idemstore::SledStore::open(dir.path())?.store_id();
    /// assert_eq!(idemstore::SledStore::open(dir.path())?.store_id(), id);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn store_id(&self) -> u128 {
        self.inner.store_id
    }

    /// The configured durability level.
    pub fn durability(&self) -> Durability {
        self.inner.durability
    }

    /// Counters of the durable path since open.
    ///
    /// ```
    /// use idemstore::{Fingerprint, Key, SledStore, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let dir = tempfile::tempdir()?;
    /// let store = SledStore::open(dir.path())?;
    /// let before = store.stats();
    /// let d = Duration::from_secs(1);
    /// let _ = store.begin(&Key::new("", "k")?, &Fingerprint::of(b""), Timestamp::EPOCH, d, d)?;
    /// let after = store.stats();
    /// assert_eq!(after.commits, before.commits + 1);
    /// assert_eq!(after.data_fsyncs, before.data_fsyncs + 1, "acknowledged after its own fdatasync");
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn stats(&self) -> SledStats {
        self.inner.disk.counters.snapshot()
    }

    /// Bytes the store's files take on disk, as sled counts them (the data
    /// file, blobs and snapshots).
    ///
    /// ```
    /// let dir = tempfile::tempdir()?;
    /// assert!(idemstore::SledStore::open(dir.path())?.size_on_disk()? > 0);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn size_on_disk(&self) -> Result<u64> {
        self.inner.db.size_on_disk().map_err(errors::from_sled)
    }

    /// True once a failed flush or fsync has poisoned the store: every
    /// write fails with [`Error::Poisoned`] until it is reopened.
    ///
    /// ```
    /// let dir = tempfile::tempdir()?;
    /// assert!(!idemstore::SledStore::open(dir.path())?.is_poisoned());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn is_poisoned(&self) -> bool {
        self.inner.group.is_poisoned()
    }

    /// The background sweeper, when one was configured (to read its counters).
    ///
    /// ```
    /// use idemstore::{SledStore, SweeperConfig};
    /// let dir = tempfile::tempdir()?;
    /// let store = SledStore::builder().sweeper(SweeperConfig::default()).open(dir.path())?;
    /// assert_eq!(store.sweeper().map(|s| s.swept()), Some(0));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn sweeper(&self) -> Option<&Sweeper> {
        self.sweeper.as_ref()
    }

    /// Makes the next `count` data-file fsyncs fail with an I/O error, as a
    /// failing disk would (feature `test-util`): the test seam for
    /// poisoning.
    ///
    /// ```
    /// use idemstore::{Error, Fingerprint, Key, SledStore, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let dir = tempfile::tempdir()?;
    /// let store = SledStore::open(dir.path())?;
    /// store.fail_next_syncs(1);
    /// let (k, fp, d) = (Key::new("", "k")?, Fingerprint::of(b""), Duration::from_secs(1));
    /// assert!(matches!(store.begin(&k, &fp, Timestamp::EPOCH, d, d), Err(Error::Io(_))));
    /// assert!(matches!(store.begin(&k, &fp, Timestamp::EPOCH, d, d), Err(Error::Poisoned { .. })));
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    #[cfg(feature = "test-util")]
    pub fn fail_next_syncs(&self, count: u32) {
        self.inner.disk.fail_next_syncs(count);
    }
}

impl Inner {
    fn writer(&self) -> MutexGuard<'_, u64> {
        // The guarded value (the last token) is only replaced after a
        // committed transaction; a panic cannot leave it half-written.
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails fast on a poisoned store, before any read or write.
    fn check_writable(&self) -> Result<()> {
        if self.group.is_poisoned() {
            return Err(Error::Poisoned { cause: None });
        }
        Ok(())
    }

    fn wait_durable(&self, seq: u64) -> Result<()> {
        if !self.group.is_finished(seq) {
            // A read saw a transaction still in progress (sled blocks
            // transactions while it flushes, for milliseconds): block on the
            // writer lock it holds rather than spin. Once we hold the lock,
            // that transaction has finished.
            drop(self.writer());
        }
        self.group.wait_durable(seq, || self.disk.flush(&self.db))
    }

    /// The record under `key_bytes`, read outside any transaction.
    fn read(&self, key_bytes: &[u8]) -> Result<Option<Record>> {
        match self.records.get(key_bytes).map_err(errors::from_sled)? {
            None => Ok(None),
            Some(bytes) => decode_record(key_bytes, &bytes).map(Some),
        }
    }

    /// Runs `op` as one transaction over the three trees under the writer
    /// lock, then waits until it (or, when it wrote nothing, what it read)
    /// is durable. `op` gets the last token handed out and says what it
    /// answers, the new last token if it took one, and whether it wrote.
    fn write<T>(&self, op: impl Fn(&Tx<'_>, u64) -> TxResult<(T, Option<u64>, bool)>) -> Result<T> {
        let (answer, seq, wrote) = {
            let mut last_token = self.writer();
            self.check_writable()?;
            let ticket = self.group.begin_write();
            let seq = ticket.seq();
            let last = *last_token;
            let outcome = (&self.records, &self.expiry, &self.meta)
                .transaction(|(records, expiry, meta)| op(&Tx::new(records, expiry, meta), last));
            drop(ticket);
            match outcome {
                Ok((value, token, wrote)) => {
                    if let Some(token) = token {
                        *last_token = token;
                    }
                    if wrote {
                        self.disk.counters.commits.fetch_add(1, Ordering::Relaxed);
                    }
                    (Ok(value), seq, wrote)
                }
                // An error decided from the stored state (a stale claim) is
                // an answer too: like any answer, it waits below until that
                // state is durable.
                Err(TransactionError::Abort(e)) => (Err(e), seq, false),
                Err(TransactionError::Storage(e)) => {
                    // A commit that failed half-way may or may not be in
                    // sled's log: nothing after it may be acknowledged.
                    self.group.poison();
                    return Err(errors::from_sled(e));
                }
            }
        };
        self.wait_durable(if wrote { seq } else { seq - 1 })?;
        answer
    }

    fn begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        check_durations(lease, retention)?;
        self.check_writable()?;
        let kb = encode_key(key);
        // Fast path: an answer that writes nothing needs no transaction. The
        // token closure is a placeholder: if logic wants to claim, the claim
        // is redone below under the writer lock with a real token.
        let existing = self.read(&kb)?;
        let horizon = self.group.read_horizon();
        let probe = logic::begin(existing, fingerprint, now, lease, retention, || {
            Ok(u64::MAX)
        })?;
        if probe.write.is_none() {
            self.wait_durable(horizon)?;
            return Ok(probe.answer);
        }
        self.write(|tx, last| {
            let existing = tx.get(&kb)?;
            let next = || logic::next_token(last);
            let step = logic::begin(existing.clone(), fingerprint, now, lease, retention, next)
                .map_err(ConflictableTransactionError::Abort)?;
            match step.write {
                Some(record) => {
                    tx.put(&kb, existing.as_ref(), &record)?;
                    tx.set_last_token(record.token)?;
                    Ok((step.answer, Some(record.token), true))
                }
                None => Ok((step.answer, None, false)),
            }
        })
    }

    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
        self.check_writable()?;
        let kb = encode_key(key);
        self.write(|tx, _| {
            let existing = tx.get(&kb)?;
            let step = logic::renew(existing.clone(), claim, now, lease)
                .map_err(ConflictableTransactionError::Abort)?;
            tx.put(&kb, existing.as_ref(), &step.write)?;
            Ok((step.claim, None, true))
        })
    }

    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        logic::check_response(response, self.max_body_bytes)?;
        self.check_writable()?;
        let kb = encode_key(key);
        self.write(|tx, _| {
            let existing = tx.get(&kb)?;
            let record = logic::complete(existing.clone(), claim, response, now, retention)
                .map_err(ConflictableTransactionError::Abort)?;
            tx.put(&kb, existing.as_ref(), &record)?;
            Ok(((), None, true))
        })
    }

    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        self.check_writable()?;
        let kb = encode_key(key);
        self.write(|tx, _| {
            let existing = tx.get(&kb)?;
            let kept = logic::release(existing.clone(), claim)
                .map_err(ConflictableTransactionError::Abort)?;
            match (&kept, &existing) {
                (Some(kept), _) => tx.put(&kb, existing.as_ref(), kept)?,
                (None, Some(record)) => tx.delete(&kb, record)?,
                (None, None) => {}
            }
            Ok(((), None, true))
        })
    }

    fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()> {
        self.check_writable()?;
        let kb = encode_key(key);
        // A step already recorded writes nothing, and the answer still
        // waits until that earlier write is durable (`write`'s horizon).
        self.write(|tx, _| {
            let existing = tx.get(&kb)?;
            let record = logic::record_step(existing.clone(), claim, step, now)
                .map_err(ConflictableTransactionError::Abort)?;
            match record {
                Some(record) => {
                    tx.put(&kb, existing.as_ref(), &record)?;
                    Ok(((), None, true))
                }
                None => Ok(((), None, false)),
            }
        })
    }

    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        let existing = self.read(&encode_key(key))?;
        self.wait_durable(self.group.read_horizon())?;
        Ok(logic::visible(existing, now))
    }

    /// Candidates come from the index outside the transaction (sled
    /// transactions cannot iterate); the transaction re-checks each record's
    /// stored expiry, so a record claimed again in between is left alone.
    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        let max = max.min(MAX_SWEEP_BATCH);
        if max == 0 {
            return Ok(0);
        }
        self.check_writable()?;
        let mut due = Vec::new();
        for entry in self.expiry.iter() {
            let (index_key, _) = entry.map_err(errors::from_sled)?;
            let (expires_at, key_bytes) = decode_index(&index_key)?;
            if !logic::sweepable(expires_at, now) || due.len() == max {
                break;
            }
            due.push((index_key.to_vec(), expires_at, key_bytes.to_vec()));
        }
        if due.is_empty() {
            return Ok(0);
        }
        self.write(|tx, _| {
            let mut deleted = 0;
            for (index_key, expires_at, key_bytes) in &due {
                match tx.get(key_bytes)? {
                    Some(record) if record.expires_at == *expires_at => {
                        if logic::sweepable(record.expires_at, now) {
                            tx.delete(key_bytes, &record)?;
                            deleted += 1;
                        }
                    }
                    // The record moved on (claimed again, completed) or is
                    // gone: this index entry, if still there, is stale.
                    _ => tx.remove_index(index_key)?,
                }
            }
            Ok((deleted, None, true))
        })
        .inspect(|&n| crate::observability::swept("sled", n))
    }
}

impl Drop for Inner {
    /// A clean close records the final token mark in the marker, so the
    /// next open can tell if sled loses anything written in this session.
    /// Skipped when poisoned: then some of it may not be on disk.
    fn drop(&mut self) {
        if self.group.is_poisoned() || self.disk.sync_now(&self.db).is_err() {
            return;
        }
        let last_token = *self.writer();
        let _ = marker::write(
            &self.path,
            Marker {
                format: STORE_FORMAT_VERSION,
                store_id: self.store_id,
                last_token,
            },
        );
    }
}

impl Store for SledStore {
    fn begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        self.inner.begin(key, fingerprint, now, lease, retention)
    }

    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        self.inner.complete(key, claim, response, now, retention)
    }

    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        self.inner.release(key, claim)
    }

    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
        self.inner.renew(key, claim, now, lease)
    }

    fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()> {
        self.inner.record_step(key, claim, step, now)
    }

    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        self.inner.get(key, now)
    }

    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        self.inner.sweep_expired(now, max)
    }

    fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.clock)
    }
}
