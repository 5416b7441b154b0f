//! A new store built under a temporary name beside its target and moved
//! into place only when it is complete: `import` and `salvage` are all or
//! nothing. On any error (or a panic) the temporary files are removed and
//! the target is as it was.

use super::{EXIT_REFUSED, Failure};
use idemstore::RedbStore;
use std::path::{Path, PathBuf};

/// A store being built for `target`.
pub(crate) struct Building {
    temp: PathBuf,
    target: PathBuf,
    store: Option<RedbStore>,
}

/// `<target>.partial-<pid>`: beside the target (so the final rename stays
/// on one file system), and this process's own.
fn temp_name(target: &Path) -> PathBuf {
    let mut name = target.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".partial-{}", std::process::id()));
    target.with_file_name(name)
}

fn remove_if_exists(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Makes the directory entries under `path`'s directory durable.
fn sync_parent(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        std::fs::File::open(parent)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

impl Building {
    /// Creates an empty store under the temporary name.
    pub(crate) fn start(target: &Path) -> Result<Building, Failure> {
        let temp = temp_name(target);
        // Only a run of this pid that did not finish can have left these.
        remove_if_exists(&temp)?;
        remove_if_exists(&RedbStore::log_path(&temp))?;
        let mut building = Building {
            temp,
            target: target.to_path_buf(),
            store: None,
        };
        building.store = Some(RedbStore::open(&building.temp)?);
        Ok(building)
    }

    /// The store being built.
    pub(crate) fn store(&self) -> Result<&RedbStore, Failure> {
        self.store
            .as_ref()
            .ok_or_else(|| Failure::new(super::EXIT_ERROR, "the new store is already closed"))
    }

    /// Closes the new store (a clean close: everything durable, its log
    /// marked closed and then removed, as a closed store needs none) and
    /// moves it to the target.
    ///
    /// `replace`: the target is an existing store that was closed cleanly
    /// (the caller checked), so its log holds nothing: the log is removed
    /// first (a crash right after leaves the old store, which opens without
    /// it) and the new file is renamed over the old one (atomic). Without
    /// `replace` the target must not exist: the new file is linked to it
    /// (a link never replaces a name) and its temporary name removed.
    pub(crate) fn finish(mut self, replace: bool) -> Result<(), Failure> {
        drop(self.store.take());
        remove_if_exists(&RedbStore::log_path(&self.temp))?;
        if replace {
            remove_if_exists(&RedbStore::log_path(&self.target))?;
            std::fs::rename(&self.temp, &self.target)?;
        } else {
            match std::fs::hard_link(&self.temp, &self.target) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    return Err(Failure::new(
                        EXIT_REFUSED,
                        format!(
                            "{} appeared while the new store was built; nothing was replaced",
                            self.target.display()
                        ),
                    ));
                }
                Err(e) => return Err(e.into()),
            }
            std::fs::remove_file(&self.temp)?;
        }
        sync_parent(&self.target)?;
        Ok(())
    }
}

impl Drop for Building {
    fn drop(&mut self) {
        // Unfinished: nothing of it stays (after `finish` the temporary
        // name is gone already and these find nothing).
        drop(self.store.take());
        let _ = remove_if_exists(&self.temp);
        let _ = remove_if_exists(&RedbStore::log_path(&self.temp));
    }
}
