//! Who holds a file's lock: for [`Error::Locked`](crate::Error::Locked)'s
//! message, so that an operator told "locked" learns by whom.
//!
//! On Linux the kernel lists every `flock` in `/proc/locks` with the
//! holder's pid and the file's device and inode; the pid's command line is
//! in `/proc/<pid>/cmdline`. Elsewhere, or when those cannot be read (a
//! container without `/proc`, another user's process), the holder is
//! unknown and the message says so.

use std::path::Path;

/// The most of a holder's command line a message shows.
const MAX_COMMAND_CHARS: usize = 160;

/// "pid N (command line)" of a process holding a lock on `path`, or "this
/// process"; `None` when it cannot be told.
pub(crate) fn lock_holder(path: &Path) -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        linux::holder(path)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        None
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use super::MAX_COMMAND_CHARS;
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;

    pub(super) fn holder(path: &Path) -> Option<String> {
        let meta = std::fs::metadata(path).ok()?;
        let locks = std::fs::read_to_string("/proc/locks").ok()?;
        let pid = find_pid(&locks, meta.dev(), meta.ino())?;
        if pid == std::process::id() {
            return Some("this process".to_owned());
        }
        let command = std::fs::read(format!("/proc/{pid}/cmdline"))
            .ok()
            .map(|raw| command_line(&raw))
            .filter(|c| !c.is_empty());
        Some(match command {
            Some(command) => format!("pid {pid} ({command})"),
            None => format!("pid {pid}"),
        })
    }

    /// The pid of the first lock (not a waiter) on the file with this
    /// device and inode in `/proc/locks` text, whose lines read
    /// `1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF` (a waiter has
    /// `->` after the number; major and minor are hex).
    pub(super) fn find_pid(locks: &str, dev: u64, ino: u64) -> Option<u32> {
        let (major, minor) = split_dev(dev);
        locks.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(1) == Some(&"->") {
                return None;
            }
            let pid = fields.get(4)?.parse::<u32>().ok()?;
            let mut id = fields.get(5)?.split(':');
            let (maj, min, file) = (id.next()?, id.next()?, id.next()?);
            let same = u64::from_str_radix(maj, 16).ok()? == major
                && u64::from_str_radix(min, 16).ok()? == minor
                && file.parse::<u64>().ok()? == ino;
            same.then_some(pid)
        })
    }

    /// Linux's `dev_t` encoding (glibc's `major`/`minor`).
    fn split_dev(dev: u64) -> (u64, u64) {
        let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
        let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
        (major, minor)
    }

    /// The NUL-separated arguments as one line, shortened.
    pub(super) fn command_line(raw: &[u8]) -> String {
        let line = String::from_utf8_lossy(raw)
            .split('\0')
            .filter(|a| !a.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        if line.chars().count() <= MAX_COMMAND_CHARS {
            return line;
        }
        let mut short: String = line.chars().take(MAX_COMMAND_CHARS).collect();
        short.push('…');
        short
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::linux::{command_line, find_pid};
    use super::lock_holder;

    #[test]
    fn proc_locks_lines_are_matched_by_device_and_inode() {
        let locks = "1: POSIX  ADVISORY  WRITE 77 fd:01:99 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 4321 08:01:5678 0 EOF\n";
        // dev 8:1 is 0x801 in the old encoding.
        assert_eq!(find_pid(locks, 0x801, 5678), Some(1234));
        assert_eq!(find_pid(locks, 0x801, 5679), None);
        assert_eq!(find_pid(locks, 0x802, 5678), None);
        // 0xfd:1, as device-mapper volumes are numbered.
        assert_eq!(find_pid(locks, 0xfd01, 99), Some(77));
    }

    #[test]
    fn command_lines_are_joined_and_shortened() {
        assert_eq!(
            command_line(b"idemstore\0get\0s.idem\0"),
            "idemstore get s.idem"
        );
        let long = vec![b'x'; 500];
        assert_eq!(
            command_line(&long).chars().count(),
            super::MAX_COMMAND_CHARS + 1
        );
    }

    #[test]
    fn a_lock_held_here_names_this_process() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("held");
        let file = std::fs::File::create(&path).expect("create");
        file.try_lock().expect("lock");
        assert_eq!(lock_holder(&path).as_deref(), Some("this process"));
        drop(file);
        assert_eq!(lock_holder(&path), None);
    }
}
