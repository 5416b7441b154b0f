//! Opening a sled directory: refuse foreign directories, lock, open sled
//! without letting it panic, and check or write the meta tree.

use super::durable::{BLOBS_DIR, CONF_FILE, DATA_FILE};
use super::errors::{from_sled, from_tx};
use super::marker::{MARKER_FILE, MARKER_TMP};
use crate::error::{Error, Result};
use crate::time::{Clock, SystemClock};
use std::fs::File;
use std::hash::{BuildHasher, RandomState};
use std::path::Path;

/// The store format this build writes in the meta tree, and the newest it reads.
pub(crate) const STORE_FORMAT_VERSION: u32 = 1;
/// The lock file idemstore holds (besides sled's own lock on `db`) while a
/// store is open, so a second open is [`Error::Locked`] before sled is touched.
pub(crate) const LOCK_FILE: &str = "idemstore.lock";
/// Tree names. The prefix keeps them apart from anything else in the database.
pub(crate) const RECORDS_TREE: &[u8] = b"idemstore/records";
pub(crate) const EXPIRY_TREE: &[u8] = b"idemstore/expiry";
pub(crate) const META_TREE: &[u8] = b"idemstore/meta";
/// sled's own default tree, always present.
const SLED_DEFAULT_TREE: &[u8] = b"__sled__default";
/// Meta keys.
pub(crate) const META_FORMAT_VERSION: &[u8] = b"format_version";
pub(crate) const META_STORE_ID: &[u8] = b"store_id";
pub(crate) const META_LAST_TOKEN: &[u8] = b"last_token";

/// What `open` found in the meta tree.
#[derive(Debug)]
pub(crate) struct Meta {
    pub(crate) store_id: u128,
    pub(crate) last_token: u64,
}

/// Refuses a directory that holds files but no sled data file: creating a
/// store among someone else's files would be a silent mess.
pub(crate) fn check_directory(dir: &Path) -> Result<()> {
    if !dir.exists() {
        std::fs::create_dir_all(dir)?;
        return Ok(());
    }
    if !dir.is_dir() {
        return Err(not_ours(format!(
            "{} is a file; a sled store is a directory",
            dir.display()
        )));
    }
    let mut foreign = Vec::new();
    let mut has_data_file = false;
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        if name == DATA_FILE {
            has_data_file = true;
        } else if ![LOCK_FILE, CONF_FILE, BLOBS_DIR, MARKER_FILE, MARKER_TMP]
            .iter()
            .any(|ours| name == *ours)
        {
            foreign.push(name.to_string_lossy().into_owned());
        }
    }
    if has_data_file || foreign.is_empty() {
        return Ok(());
    }
    foreign.sort();
    foreign.truncate(3);
    Err(not_ours(format!(
        "{} holds {} and no sled `db` file; refusing to create a store among foreign files",
        dir.display(),
        foreign.join(", ")
    )))
}

/// The error for a path that is not an idemstore store, worded as
/// `RedbStore` words it.
fn not_ours(detail: String) -> Error {
    Error::corrupt(None, format!("not an idemstore store directory: {detail}"))
}

/// Takes the store's lock file. The lock is an advisory `flock` that the
/// kernel drops when the process dies, so a killed owner never leaves the
/// store locked.
pub(crate) fn lock(dir: &Path) -> Result<File> {
    let path = dir.join(LOCK_FILE);
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::Locked {
            path: dir.display().to_string(),
            holder: crate::holder::lock_holder(&path),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(Error::Io(e)),
    }
}

/// How long an open waits for sled's own file lock, which a store just
/// dropped in this process may hold a moment longer (see [`open_sled`]).
pub(crate) const SLED_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Opens sled, turning its errors and panics into idemstore errors: sled
/// 0.34 asserts on some damaged files instead of returning an error.
///
/// Called with the store's own lock file held, so no other open store has
/// the directory. sled's file lock can still be held for a moment by the
/// threads of a store this process just dropped (sled 0.34 lets its flusher
/// finish after the last handle goes): that is waited out, up to
/// [`SLED_LOCK_WAIT`], before the directory is reported `Locked`.
pub(crate) fn open_sled(dir: &Path) -> Result<::sled::Db> {
    let config = ::sled::Config::new().path(dir);
    let deadline = std::time::Instant::now() + SLED_LOCK_WAIT;
    let opened = loop {
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| config.open()));
        let held = matches!(&opened, Ok(Err(::sled::Error::Io(e)))
            if e.to_string().contains("could not acquire lock"));
        if !held || std::time::Instant::now() >= deadline {
            break opened;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(::sled::Error::Io(e))) if e.to_string().contains("could not acquire lock") => {
            Err(Error::Locked {
                path: dir.display().to_string(),
                holder: None,
            })
        }
        Ok(Err(e)) => Err(from_sled(e)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Err(Error::corrupt(
                None,
                format!("sled failed to open {}: {what}", dir.display()),
            ))
        }
    }
}

/// Checks that an opened database is an idemstore store (or empty) before
/// any tree is created in it.
pub(crate) fn check_foreign(db: &::sled::Db) -> Result<()> {
    if has_meta_tree(db) {
        return Ok(());
    }
    let names = db.tree_names();
    let others = names
        .iter()
        .any(|n| ![SLED_DEFAULT_TREE, RECORDS_TREE, EXPIRY_TREE].contains(&n.as_ref()));
    if others || !db.is_empty() {
        let mut trees: Vec<String> = names
            .iter()
            .map(|n| String::from_utf8_lossy(n).into_owned())
            .collect();
        trees.sort();
        return Err(not_ours(format!(
            "a sled database without idemstore's meta tree (trees: {})",
            trees.join(", ")
        )));
    }
    Ok(())
}

/// Reads the meta tree: `None` on a fresh store, one whose meta tree has
/// no format version and whose records and index are empty (a crash
/// between creating the trees and writing the meta leaves exactly that).
pub(crate) fn read_meta(
    meta: &::sled::Tree,
    records: &::sled::Tree,
    expiry: &::sled::Tree,
) -> Result<Option<Meta>> {
    let corrupt = |what: &str| Error::corrupt(None, format!("meta tree: {what}"));
    let Some(v) = meta.get(META_FORMAT_VERSION).map_err(from_sled)? else {
        if records.is_empty() && expiry.is_empty() {
            return Ok(None);
        }
        return Err(corrupt("no format version, but the store holds records"));
    };
    let version = u32::from_be_bytes(
        v.as_ref()
            .try_into()
            .map_err(|_| corrupt("format version is not 4 bytes"))?,
    );
    if version > STORE_FORMAT_VERSION || version == 0 {
        return Err(Error::UnsupportedFormat {
            found: version,
            supported: STORE_FORMAT_VERSION,
        });
    }
    let id = meta
        .get(META_STORE_ID)
        .map_err(from_sled)?
        .ok_or_else(|| corrupt("store id missing"))?;
    let store_id = u128::from_be_bytes(
        id.as_ref()
            .try_into()
            .map_err(|_| corrupt("store id is not 16 bytes"))?,
    );
    let token = meta
        .get(META_LAST_TOKEN)
        .map_err(from_sled)?
        .ok_or_else(|| corrupt("fencing-token high-water mark missing"))?;
    let last_token = u64::from_be_bytes(
        token
            .as_ref()
            .try_into()
            .map_err(|_| corrupt("fencing-token high-water mark is not 8 bytes"))?,
    );
    Ok(Some(Meta {
        store_id,
        last_token,
    }))
}

/// Writes the meta of a fresh store in one transaction.
pub(crate) fn init_meta(meta: &::sled::Tree) -> Result<Meta> {
    let store_id = new_store_id();
    meta.transaction(|m| {
        m.insert(META_FORMAT_VERSION, &STORE_FORMAT_VERSION.to_be_bytes())?;
        m.insert(META_STORE_ID, &store_id.to_be_bytes())?;
        m.insert(META_LAST_TOKEN, &0u64.to_be_bytes())?;
        Ok::<_, ::sled::transaction::ConflictableTransactionError<Error>>(())
    })
    .map_err(from_tx)?;
    Ok(Meta {
        store_id,
        last_token: 0,
    })
}

/// True when the database has an idemstore meta tree (checked before
/// `open_tree` would create one).
pub(crate) fn has_meta_tree(db: &::sled::Db) -> bool {
    db.tree_names().iter().any(|n| n.as_ref() == META_TREE)
}

/// A random-enough 128-bit id: two independently seeded std hashes of the
/// time and the process id. It names a store in logs; nothing depends on
/// it being unpredictable.
fn new_store_id() -> u128 {
    let seed = (SystemClock.now().as_millis(), std::process::id());
    let hi = RandomState::new().hash_one(seed);
    let lo = RandomState::new().hash_one(seed);
    (u128::from(hi) << 64) | u128::from(lo)
}
