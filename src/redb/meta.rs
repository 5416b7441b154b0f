//! The meta table: the store format ([`STORE_FORMAT_VERSION`]), reading,
//! checking and writing a store's meta entries (the record log's are read
//! where the log is planned, `recovery::plan_log`).

use super::Config;
use super::damage::Damage;
use super::file::{engine_error, not_ours};
use super::tables::{
    EXPIRY, META, META_FORMAT_VERSION, META_STORE_ID, META_TOKEN_HWM, RECORDS, commit,
};
use crate::error::{Error, Result};
use ::redb::{Database, ReadOnlyTable, ReadableDatabase, TableError, TableHandle};
use std::hash::{BuildHasher, RandomState};

/// The store format this build writes and the only one it opens (tables,
/// meta entries, write-ahead log; records carry their own version).
pub(super) const STORE_FORMAT_VERSION: u32 = 3;

/// The meta entries as stored (no version policy applied).
pub(super) struct MetaEntries {
    pub(super) format_version: u32,
    pub(super) store_id: [u8; 16],
    pub(super) token_hwm: u64,
}

/// The meta entries, or `None` for a file with no tables at all (new, or
/// created just before a crash); other tables only: someone else's database.
pub(super) fn read_meta(db: &Database) -> Result<Option<MetaEntries>> {
    let txn = db.begin_read().map_err(engine_error)?;
    let names: Vec<String> = txn
        .list_tables()
        .map_err(engine_error)?
        .map(|t| t.name().to_owned())
        .collect();
    if !names.iter().any(|n| n == META.name()) {
        if names.is_empty() {
            return Ok(None);
        }
        return Err(not_ours(format!(
            "a redb database without idemstore's meta table (tables: {})",
            names.join(", ")
        )));
    }
    let meta = read_meta_entries(&txn)?;
    check_format(&meta)?;
    // Opening the record tables proves they have our layout.
    txn.open_table(RECORDS).map_err(table_error)?;
    txn.open_table(EXPIRY).map_err(table_error)?;
    Ok(Some(meta))
}

/// [`Error::UnsupportedFormat`] unless the store is of
/// [`STORE_FORMAT_VERSION`]; a version 0 is damage.
pub(super) fn check_format(meta: &MetaEntries) -> Result<()> {
    match meta.format_version {
        STORE_FORMAT_VERSION => Ok(()),
        0 => Err(Damage::Meta("meta format version is 0".into()).into()),
        found => Err(Error::UnsupportedFormat {
            found,
            supported: STORE_FORMAT_VERSION,
        }),
    }
}

/// Reads the meta entries; a missing or mis-sized entry is `Corrupt`.
pub(super) fn read_meta_entries(txn: &::redb::ReadTransaction) -> Result<MetaEntries> {
    let meta = txn.open_table(META).map_err(table_error)?;
    Ok(MetaEntries {
        format_version: u32::from_be_bytes(required(&meta, META_FORMAT_VERSION)?),
        store_id: required(&meta, META_STORE_ID)?,
        token_hwm: u64::from_be_bytes(required(&meta, META_TOKEN_HWM)?),
    })
}

/// `bytes` as the fixed-size value of the meta entry `name`, or damage.
pub(super) fn fixed<const N: usize>(name: &str, bytes: &[u8]) -> Result<[u8; N]> {
    let len = bytes.len();
    bytes
        .try_into()
        .map_err(|_| Damage::Meta(format!("meta entry {name:?} is {len} bytes, not {N}")).into())
}

pub(super) fn table_error(err: TableError) -> Error {
    match err {
        TableError::TableTypeMismatch { .. } | TableError::TableIsMultimap(_) => {
            not_ours(format!("a table has a foreign layout ({err})"))
        }
        other => engine_error(other),
    }
}

/// Writes the meta table and the empty record tables of a new store.
pub(super) fn init_meta(db: &Database, config: &Config) -> Result<MetaEntries> {
    let store_id = new_store_id(config);
    commit(db, true, |tables| {
        tables.set_meta(META_FORMAT_VERSION, &STORE_FORMAT_VERSION.to_be_bytes())?;
        tables.set_meta(META_STORE_ID, &store_id)?;
        tables.set_meta(META_TOKEN_HWM, &0u64.to_be_bytes())
    })??;
    Ok(MetaEntries {
        format_version: STORE_FORMAT_VERSION,
        store_id,
        token_hwm: 0,
    })
}

/// 16 bytes unlikely to repeat: the std hasher's random keys, the time and
/// the process id, through SHA-256.
fn new_store_id(config: &Config) -> [u8; 16] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let now = config.clock.now().as_millis();
    for _ in 0..2 {
        h.update(RandomState::new().hash_one(now).to_be_bytes());
    }
    h.update(std::process::id().to_be_bytes());
    h.update(now.to_be_bytes());
    let digest = h.finalize();
    digest.first_chunk::<16>().copied().unwrap_or_default()
}

/// The fixed-size meta entry `name`, `None` when absent.
pub(super) fn entry<const N: usize>(
    meta: &ReadOnlyTable<&str, &[u8]>,
    name: &str,
) -> Result<Option<[u8; N]>> {
    let value = meta.get(name).map_err(engine_error)?;
    value.map(|v| fixed(name, v.value())).transpose()
}

/// The fixed-size meta entry `name`; a missing one is damage.
fn required<const N: usize>(meta: &ReadOnlyTable<&str, &[u8]>, name: &str) -> Result<[u8; N]> {
    let missing = || Damage::Meta(format!("meta entry {name:?} is missing")).into();
    entry(meta, name)?.ok_or_else(missing)
}
