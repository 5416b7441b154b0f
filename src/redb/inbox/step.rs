//! [`RedbStore::atomic_step`]: a step whose writes to the application's own
//! tables commit in the same transaction as its record, the inbox's
//! mechanism for one step of a guarded run.

use super::super::RedbStore;
use super::super::tables::Source;
use crate::codec;
use crate::error::Error;
use crate::guard::Next;
use crate::key::Key;
use crate::logic;
use crate::record::Claim;
use crate::step::{self, Step};
use crate::store::Store;
use ::redb::WriteTransaction;

impl RedbStore {
    /// Runs the step `name` of `claim`'s run as an atomic phase: `f`'s
    /// writes to the application's tables (through the transaction it is
    /// given) and the step's record commit in one durable redb
    /// transaction, so a crash leaves both or neither, and a retry never
    /// applies them twice. A step an earlier attempt recorded
    /// ([`Claim::steps`]) returns its output without calling `f`.
    ///
    /// `f` gets the transaction and the step key ([`Key::step_key`]) and
    /// returns the step's output. An `Err` from `f` (or a panic) aborts the
    /// transaction: nothing of it is written, no step is recorded. A claim
    /// that no longer owns `key` (taken over, released, expired) is
    /// [`Error::StaleClaim`], with `f`'s writes rolled back. The limits and
    /// the one-name-per-run rule are [`Claim::step`]'s; a claim from
    /// [`Store::begin`] (no guard) may be used too.
    ///
    /// Like the [`Inbox`](super::Inbox), it commits a transaction of its
    /// own under the store's commit lock: `f` must not call this store,
    /// and should be short. It blocks: from async code, call it on a
    /// blocking thread.
    ///
    /// ```
    /// use idemstore::redb::engine::{ReadableTable, TableDefinition};
    /// use idemstore::{BoxError, Fingerprint, Guard, Key, RedbStore, Response};
    /// use std::sync::Arc;
    ///
    /// const STOCK: TableDefinition<&str, u64> = TableDefinition::new("shop.stock");
    ///
    /// # let dir = tempfile::tempdir()?;
    /// let store = Arc::new(RedbStore::open(dir.path().join("shop.idem"))?);
    /// let guard = Guard::new(Arc::clone(&store));
    /// let key = Key::new("orders", "o-1")?;
    /// guard.run(&key, &Fingerprint::of(b"apple x2"), |claim| {
    ///     let left = store.atomic_step(&key, claim, "reserve", |txn, _| -> Result<_, BoxError> {
    ///         let mut stock = txn.open_table(STOCK)?;
    ///         let left = stock.get("apple")?.map_or(10, |v| v.value()) - 2;
    ///         stock.insert("apple", left)?;
    ///         Ok(left.to_string().into_bytes())
    ///     })?;
    ///     Ok::<_, BoxError>(Response::new(201, left))
    /// });
    /// # Ok::<(), BoxError>(())
    /// ```
    pub fn atomic_step<E: From<Error>>(
        &self,
        key: &Key,
        claim: &Claim,
        name: &str,
        f: impl FnOnce(&WriteTransaction, &str) -> std::result::Result<Vec<u8>, E>,
    ) -> std::result::Result<Vec<u8>, E> {
        if claim.run.is_some() {
            if let Next::Replay(output) = claim.next_step(name)? {
                return Ok(output);
            }
        } else {
            step::check_name(name)?;
            if let Some(recorded) = claim.steps.iter().find(|s| s.name == name) {
                return Ok(recorded.output.clone());
            }
        }
        let key_bytes = codec::encode_key(key);
        let step_key = key.step_key(name);
        let now = self.clock().now();
        let output = self.shared.direct(|tables, _| {
            let output = f(tables.txn, &step_key)?;
            let step = Step::new(name, output)?;
            let existing = tables.read(&key_bytes)?;
            if let Some(record) = logic::record_step(existing, claim, &step, now)? {
                tables.apply(&key_bytes, Some(&record))?;
            }
            Ok::<_, E>(step.output)
        })?;
        crate::observability::step(false);
        Ok(output)
    }
}
