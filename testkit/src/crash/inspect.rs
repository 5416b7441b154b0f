//! Reading a store file image the way a crash checker needs it: below the
//! store's API, with every record verified and the record table and the
//! expiry index compared entry by entry.

use super::backend::CrashBackend;
use idemstore::Record;
use idemstore::unstable as codec;
use redb::{Database, ReadableDatabase, ReadableTable, TableError};
use std::collections::{BTreeMap, BTreeSet};
use std::panic::{AssertUnwindSafe, catch_unwind};

// The store's own table names (idemstore's unstable internals): one
// definition, so this reader cannot drift from the writer.
use idemstore::unstable::redb_tables::{EXPIRY, META, META_TOKEN_HWM, RECORDS};

/// What a store file holds, verified.
#[derive(Clone, Debug, Default)]
pub struct Inspection {
    /// Every record by encoded key, decoded and checked.
    pub records: BTreeMap<Vec<u8>, Record>,
    /// The largest fencing token ever handed out (`None` before the store
    /// was first initialised).
    pub token_hwm: Option<u64>,
}

/// Opens `image` with plain redb and checks it: the open does not panic,
/// redb's integrity check passes, every record decodes (checksum, version,
/// invariants), every record has exactly its one expiry-index entry and no
/// index entry is left without its record, and no record's token is above
/// the stored high-water mark. Runs redb's crash recovery on a copy: the
/// image itself is not changed.
pub fn inspect(image: &[u8]) -> Result<Inspection, String> {
    let backend = CrashBackend::from_image(image.to_vec());
    let opened = catch_unwind(AssertUnwindSafe(|| {
        Database::builder().create_with_backend(backend)
    }))
    .map_err(|_| "redb panicked opening the image".to_owned())?;
    let mut db = opened.map_err(|e| format!("redb refused the image: {e}"))?;
    match db.check_integrity() {
        Ok(true) => {}
        Ok(false) => return Err("redb had to repair the image after its own recovery".into()),
        Err(e) => return Err(format!("integrity check: {e}")),
    }
    let txn = db.begin_read().map_err(|e| e.to_string())?;
    let mut out = Inspection::default();
    match txn.open_table(META) {
        Ok(meta) => {
            if let Some(v) = meta.get(META_TOKEN_HWM).map_err(|e| e.to_string())? {
                let bytes: [u8; 8] = v
                    .value()
                    .try_into()
                    .map_err(|_| "token high-water mark is not 8 bytes".to_owned())?;
                out.token_hwm = Some(u64::from_be_bytes(bytes));
            }
        }
        Err(TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(format!("meta table: {e}")),
    }
    let mut want_index = BTreeSet::new();
    match txn.open_table(RECORDS) {
        Ok(records) => {
            for entry in records.iter().map_err(|e| e.to_string())? {
                let (k, v) = entry.map_err(|e| e.to_string())?;
                let key = k.value().to_vec();
                let record = codec::decode_record(&key, v.value())
                    .map_err(|e| format!("a record does not verify: {e}"))?;
                if out.token_hwm.is_none_or(|hwm| record.token() > hwm) {
                    return Err(format!(
                        "record {} has token {} above the high-water mark {:?}",
                        codec::printable_key(&key),
                        record.token(),
                        out.token_hwm
                    ));
                }
                want_index.insert(codec::encode_index(record.expires_at(), &key));
                out.records.insert(key, record);
            }
        }
        Err(TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(format!("records table: {e}")),
    }
    let mut index = BTreeSet::new();
    match txn.open_table(EXPIRY) {
        Ok(expiry) => {
            for entry in expiry.iter().map_err(|e| e.to_string())? {
                let (k, _) = entry.map_err(|e| e.to_string())?;
                index.insert(k.value().to_vec());
            }
        }
        Err(TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(format!("expiry table: {e}")),
    }
    if index != want_index {
        let missing = want_index.difference(&index).count();
        let orphans = index.difference(&want_index).count();
        return Err(format!(
            "records and expiry index disagree: {missing} entries missing, {orphans} orphaned"
        ));
    }
    Ok(out)
}
