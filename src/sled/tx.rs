//! The three trees inside one sled transaction, with the paired writes
//! (record + index entry) as single calls so they cannot drift apart.

use super::open::META_LAST_TOKEN;
use crate::codec::{decode_record, encode_index, encode_record};
use crate::error::Error;
use crate::record::Record;
use ::sled::transaction::{ConflictableTransactionError, TransactionalTree};

/// What a transaction body returns: an abort carries an idemstore error.
pub(crate) type TxResult<T> = Result<T, ConflictableTransactionError<Error>>;

/// The records, expiry and meta trees of one transaction.
pub(crate) struct Tx<'a> {
    records: &'a TransactionalTree,
    expiry: &'a TransactionalTree,
    meta: &'a TransactionalTree,
}

impl<'a> Tx<'a> {
    pub(crate) fn new(
        records: &'a TransactionalTree,
        expiry: &'a TransactionalTree,
        meta: &'a TransactionalTree,
    ) -> Tx<'a> {
        Tx {
            records,
            expiry,
            meta,
        }
    }

    /// The decoded record; a record that fails verification aborts the
    /// transaction with [`Error::Corrupt`].
    pub(crate) fn get(&self, key_bytes: &[u8]) -> TxResult<Option<Record>> {
        match self.records.get(key_bytes)? {
            None => Ok(None),
            Some(bytes) => decode_record(key_bytes, &bytes)
                .map(Some)
                .map_err(ConflictableTransactionError::Abort),
        }
    }

    /// Writes `new` over `old` and moves the index entry with it.
    pub(crate) fn put(&self, key_bytes: &[u8], old: Option<&Record>, new: &Record) -> TxResult<()> {
        let bytes = encode_record(new).map_err(ConflictableTransactionError::Abort)?;
        if let Some(old) = old.filter(|old| old.expires_at != new.expires_at) {
            self.expiry
                .remove(encode_index(old.expires_at, key_bytes))?;
        }
        self.expiry
            .insert(encode_index(new.expires_at, key_bytes), &[])?;
        self.records.insert(key_bytes, bytes)?;
        Ok(())
    }

    /// Deletes `old` and its index entry.
    pub(crate) fn delete(&self, key_bytes: &[u8], old: &Record) -> TxResult<()> {
        self.records.remove(key_bytes)?;
        self.expiry
            .remove(encode_index(old.expires_at, key_bytes))?;
        Ok(())
    }

    /// Removes an index entry whose record has moved on (sweep repair).
    pub(crate) fn remove_index(&self, index_key: &[u8]) -> TxResult<()> {
        self.expiry.remove(index_key)?;
        Ok(())
    }

    /// Raises the fencing-token high-water mark in the same transaction as
    /// the claim that used the token, so a reopened store never reissues it.
    pub(crate) fn set_last_token(&self, token: u64) -> TxResult<()> {
        self.meta.insert(META_LAST_TOKEN, &token.to_be_bytes())?;
        Ok(())
    }
}
