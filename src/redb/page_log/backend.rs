//! [`PageLog`], the page log's writer: a redb [`StorageBackend`] over the
//! store file and the log (the directory's module docs say why what it
//! acknowledges is durable):
//!
//! - `write` and `set_len` land in memory: the latest image of every page
//!   written since the last checkpoint (reads see them), and the operations
//!   in order;
//! - `sync_data` appends the operations since the last sync as one frame to
//!   the log and syncs the log, nothing else;
//! - when a frame would not fit in the log ([`PAGE_LOG_BYTES`]), a
//!   checkpoint instead writes every page image into the store file, syncs
//!   it, and starts a new run of the log with a marker frame at its start;
//! - `close` (redb's last call, after a clean stop) checkpoints.

use super::PAGE_LOG_BYTES;
use super::frame::{HEADER, encode_set_len, encode_write, replay, seal};
use super::page_images::Pages;
use crate::error::Result;
use ::redb::StorageBackend;
use std::io::ErrorKind;
use std::sync::Mutex;

/// The store file behind a page log. See the module docs.
pub(in crate::redb) struct PageLog {
    file: Box<dyn StorageBackend>,
    log: Box<dyn StorageBackend>,
    capacity: u64,
    state: Mutex<State>,
    /// Held through a `sync_data`: one frame or checkpoint at a time.
    syncing: Mutex<()>,
}

struct State {
    /// The length redb sees.
    len: u64,
    /// The store file's length on disk.
    file_len: u64,
    /// Bytes at or past this offset that no page image covers read as
    /// zeros: redb cut the file there since the last checkpoint.
    zero_from: u64,
    /// The latest image of every page written since the last checkpoint.
    pages: Pages,
    /// Operations since the last sync, encoded, after [`HEADER`] bytes
    /// reserved for their frame's header (empty when there are none).
    pending: Vec<u8>,
    /// Where the next frame goes.
    at: u64,
    epoch: u64,
    seq: u64,
}

impl std::fmt::Debug for PageLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageLog")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// The state's pending operations, with their frame's header reserved.
fn pending(s: &mut State) -> &mut Vec<u8> {
    if s.pending.is_empty() {
        s.pending.resize(HEADER, 0);
    }
    &mut s.pending
}

/// An epoch no frame left in the log has: above the last run's (0 when
/// none was readable) and the clock's nanoseconds.
fn next_epoch(last: u64) -> u64 {
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    last.wrapping_add(1).max(clock)
}

impl PageLog {
    /// Replays `log`'s current run into `file` (see [`replay`]), makes
    /// sure `log` is [`PAGE_LOG_BYTES`] long, and starts a new run.
    pub(in crate::redb) fn open(
        file: Box<dyn StorageBackend>,
        log: Box<dyn StorageBackend>,
    ) -> Result<PageLog> {
        PageLog::with_capacity(file, log, PAGE_LOG_BYTES)
    }

    fn with_capacity(
        file: Box<dyn StorageBackend>,
        log: Box<dyn StorageBackend>,
        capacity: u64,
    ) -> Result<PageLog> {
        let replayed = replay(&*log, &*file)?;
        let capacity = super::super::file::preallocate(&*log, capacity)?;
        let file_len = file.len()?;
        let paged = PageLog {
            file,
            log,
            capacity,
            syncing: Mutex::new(()),
            state: Mutex::new(State {
                len: file_len,
                file_len,
                zero_from: file_len,
                pages: Pages::default(),
                pending: Vec::new(),
                at: 0,
                epoch: replayed.epoch.unwrap_or(0),
                seq: 0,
            }),
        };
        {
            let mut s = paged.lock();
            paged.marker(&mut s)?;
        }
        Ok(paged)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fills `out` from the store file at `offset`: zeros at and past
    /// `valid` (its length, or a cut since the last checkpoint).
    fn read_file(&self, valid: u64, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let n = valid.saturating_sub(offset).min(out.len() as u64) as usize;
        let (head, tail) = out.split_at_mut(n);
        if !head.is_empty() {
            self.file.read(offset, head)?;
        }
        tail.fill(0);
        Ok(())
    }

    /// Appends an empty frame (a marker) as the run's next and syncs the log.
    fn frame(&self, s: &mut State) -> std::io::Result<()> {
        let mut at_seq = (s.at, s.epoch, s.seq);
        self.write_frame(&mut at_seq, &mut [0u8; HEADER])?;
        (s.at, s.seq) = (at_seq.0, at_seq.2);
        Ok(())
    }

    /// Seals `frame` (header reserved, then payload) as frame `(epoch, seq)`,
    /// writes it at `at` and syncs the log; on success `at` and `seq` move
    /// past it.
    fn write_frame(
        &self,
        (at, epoch, seq): &mut (u64, u64, u64),
        frame: &mut [u8],
    ) -> std::io::Result<()> {
        seal(frame, *epoch, *seq)?;
        self.log.write(*at, frame)?;
        self.log.sync_data()?;
        *at += frame.len() as u64;
        *seq += 1;
        Ok(())
    }

    /// A new run: its marker at the log's start, synced. Only once the
    /// store file holds everything the old run held.
    fn marker(&self, s: &mut State) -> std::io::Result<()> {
        s.epoch = next_epoch(s.epoch);
        s.seq = 0;
        s.at = 0;
        self.frame(s)
    }

    /// Every page image (and the pending writes) into the store file,
    /// synced; then a new run.
    fn checkpoint(&self, s: &mut State) -> std::io::Result<()> {
        if s.zero_from < s.file_len {
            self.file.set_len(s.zero_from)?;
        }
        if s.zero_from.min(s.file_len) != s.len {
            self.file.set_len(s.len)?;
        }
        for (at, page) in s.pages.in_order() {
            if at >= s.len {
                continue;
            }
            let n = (s.len - at).min(page.len() as u64) as usize;
            self.file.write(at, page.get(..n).unwrap_or_default())?;
        }
        self.file.sync_data()?;
        s.pages.clear();
        s.pending.clear();
        s.file_len = s.len;
        s.zero_from = s.len;
        self.marker(s)
    }
}

impl StorageBackend for PageLog {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.lock().len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let s = self.lock();
        if offset + out.len() as u64 > s.len {
            return Err(ErrorKind::UnexpectedEof.into());
        }
        let valid = s.file_len.min(s.zero_from);
        s.pages
            .read(offset, out, |at, to| self.read_file(valid, at, to))
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        let mut s = self.lock();
        if len < s.len {
            s.zero_from = s.zero_from.min(len);
            s.pages.cut(len);
        }
        s.len = len;
        encode_set_len(pending(&mut s), len);
        Ok(())
    }

    fn sync_data(&self) -> std::io::Result<()> {
        // One sync at a time; reads and writes go on meanwhile (the state
        // lock is not held while the frame is written and synced).
        let _syncing = self.syncing.lock().unwrap_or_else(|p| p.into_inner());
        let (mut frame, mut at_seq) = {
            let mut s = self.lock();
            if s.pending.is_empty() {
                return Ok(());
            }
            if s.at + s.pending.len() as u64 > self.capacity {
                return self.checkpoint(&mut s);
            }
            let frame = std::mem::take(&mut s.pending);
            (frame, (s.at, s.epoch, s.seq))
        };
        match self.write_frame(&mut at_seq, &mut frame) {
            Ok(()) => {
                let mut s = self.lock();
                (s.at, s.seq) = (at_seq.0, at_seq.2);
                Ok(())
            }
            Err(e) => {
                // Not durable: put back in front of anything written since,
                // so that a retried sync writes it again, in order.
                let mut s = self.lock();
                let later = std::mem::replace(&mut s.pending, frame);
                s.pending
                    .extend_from_slice(later.get(HEADER..).unwrap_or_default());
                Err(e)
            }
        }
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let mut s = self.lock();
        let valid = s.file_len.min(s.zero_from);
        s.pages
            .write(offset, data, |at, to| self.read_file(valid, at, to))?;
        s.len = s.len.max(offset + data.len() as u64);
        encode_write(pending(&mut s), offset, data);
        Ok(())
    }

    fn close(&self) -> std::io::Result<()> {
        let checkpointed = {
            let _syncing = self.syncing.lock().unwrap_or_else(|p| p.into_inner());
            let mut s = self.lock();
            self.checkpoint(&mut s)
        };
        let closed = self.file.close();
        checkpointed.and(closed)
    }

    super::super::file::forward_locks!(file);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::redb::{Database, ReadableDatabase, TableDefinition};
    use std::io::Error as IoError;
    use std::sync::Arc;

    const T: TableDefinition<u64, u64> = TableDefinition::new("t");

    /// A disk in memory: what was written (`live`) and what a power cut
    /// keeps (`durable`: the image at the last sync). A lying disk's syncs
    /// keep nothing; a tearing one keeps half of the last write after the
    /// last sync.
    #[derive(Debug, Default)]
    struct Disk {
        live: Vec<u8>,
        durable: Vec<u8>,
        /// The last write since the last sync, for a torn power cut.
        last: Option<(u64, Vec<u8>)>,
        lies: bool,
        /// The next sync fails (a full disk, an I/O error).
        fail_next_sync: bool,
    }

    #[derive(Clone, Debug, Default)]
    struct MemDisk(Arc<Mutex<Disk>>);

    impl MemDisk {
        fn lying() -> MemDisk {
            let d = MemDisk::default();
            d.0.lock().expect("disk").lies = true;
            d
        }

        /// The disk after a power cut: the durable image, and with `tear`
        /// the first half of the last unsynced write on top of it.
        fn power_cut(&self, tear: bool) -> MemDisk {
            let d = self.0.lock().expect("disk");
            let mut image = d.durable.clone();
            if tear && let Some((offset, data)) = &d.last {
                let half = data.get(..data.len() / 2).unwrap_or_default();
                let start = *offset as usize;
                if image.len() < start + half.len() {
                    image.resize(start + half.len(), 0);
                }
                if let Some(dst) = image.get_mut(start..start + half.len()) {
                    dst.copy_from_slice(half);
                }
            }
            MemDisk(Arc::new(Mutex::new(Disk {
                live: image.clone(),
                durable: image,
                last: None,
                lies: d.lies,
                fail_next_sync: false,
            })))
        }
    }

    impl StorageBackend for MemDisk {
        fn len(&self) -> std::io::Result<u64> {
            Ok(self.0.lock().expect("disk").live.len() as u64)
        }

        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            let d = self.0.lock().expect("disk");
            let start = offset as usize;
            let src = d
                .live
                .get(start..start + out.len())
                .ok_or_else(|| IoError::from(ErrorKind::UnexpectedEof))?;
            out.copy_from_slice(src);
            Ok(())
        }

        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.0.lock().expect("disk").live.resize(len as usize, 0);
            Ok(())
        }

        fn sync_data(&self) -> std::io::Result<()> {
            let mut d = self.0.lock().expect("disk");
            if std::mem::take(&mut d.fail_next_sync) {
                return Err(IoError::other("injected sync failure"));
            }
            if !d.lies {
                d.durable = d.live.clone();
            }
            d.last = None;
            Ok(())
        }

        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            let mut d = self.0.lock().expect("disk");
            let start = offset as usize;
            if d.live.len() < start + data.len() {
                d.live.resize(start + data.len(), 0);
            }
            if let Some(dst) = d.live.get_mut(start..start + data.len()) {
                dst.copy_from_slice(data);
            }
            d.last = Some((offset, data.to_vec()));
            Ok(())
        }
    }

    /// A small log, so that the runs below cross several checkpoints.
    const SMALL: u64 = 256 * 1024;

    fn open(file: &MemDisk, log: &MemDisk) -> Database {
        let paged = PageLog::with_capacity(Box::new(file.clone()), Box::new(log.clone()), SMALL)
            .expect("page log");
        Database::builder()
            .create_with_backend(paged)
            .expect("redb")
    }

    /// Commits `keys` one durable transaction each, every value 1 KiB-ish
    /// apart in the tree, and returns how many were acknowledged.
    fn commit_each(db: &Database, keys: std::ops::Range<u64>) -> u64 {
        let mut acked = 0;
        for k in keys {
            let txn = db.begin_write().expect("txn");
            {
                let mut t = txn.open_table(T).expect("table");
                t.insert(k, k * 7).expect("insert");
            }
            txn.commit().expect("commit");
            acked += 1;
        }
        acked
    }

    /// Keys `0..n` missing or wrong after a reopen.
    fn missing(db: &Database, n: u64) -> Vec<u64> {
        let txn = db.begin_read().expect("read");
        let Ok(t) = txn.open_table(T) else {
            return (0..n).collect();
        };
        (0..n)
            .filter(|&k| t.get(k).ok().flatten().map(|v| v.value()) != Some(k * 7))
            .collect()
    }

    /// Power cuts after 1 to 600 acknowledged commits (across checkpoints
    /// of a 256 KiB log), with and without a torn last write: every
    /// acknowledged commit is there after the replay.
    #[test]
    fn every_acknowledged_commit_survives_a_power_cut() {
        for (n, tear) in [(1, false), (7, true), (90, false), (333, true), (600, true)] {
            let (file, log) = (MemDisk::default(), MemDisk::default());
            let db = open(&file, &log);
            let acked = commit_each(&db, 0..n);
            // A commit that was never synced (redb's Durability::None):
            // allowed to be lost, never to damage what came before.
            let txn = db.begin_write().expect("txn");
            {
                let mut t = txn.open_table(T).expect("table");
                t.insert(u64::MAX, 1).expect("insert");
            }
            let mut txn = txn;
            txn.set_durability(::redb::Durability::None)
                .expect("durability");
            txn.commit().expect("commit");
            let (file, log) = (file.power_cut(tear), log.power_cut(tear));
            std::mem::forget(db); // the process is gone: no close
            let db = open(&file, &log);
            assert_eq!(
                missing(&db, acked),
                Vec::<u64>::new(),
                "after {n} commits, tear {tear}"
            );
            // And it goes on: more commits, a clean close, a reopen.
            commit_each(&db, acked..acked + 50);
            drop(db);
            let db = open(&file, &log);
            assert_eq!(missing(&db, acked + 50), Vec::<u64>::new());
        }
    }

    /// The same run on a disk whose log syncs keep nothing loses
    /// acknowledged commits (a log large enough that no checkpoint syncs
    /// the store file meanwhile): the test above can fail.
    #[test]
    fn a_lying_log_loses_acknowledged_commits() {
        let (file, log) = (MemDisk::default(), MemDisk::lying());
        let big = 8 << 20;
        let paged = PageLog::with_capacity(Box::new(file.clone()), Box::new(log.clone()), big)
            .expect("page log");
        let db = Database::builder()
            .create_with_backend(paged)
            .expect("redb");
        let acked = commit_each(&db, 0..40);
        let (file, log) = (file.power_cut(false), log.power_cut(false));
        std::mem::forget(db);
        let lost = PageLog::with_capacity(Box::new(file), Box::new(log), big)
            .map_err(|e| e.to_string())
            .and_then(|p| {
                Database::builder()
                    .create_with_backend(p)
                    .map_err(|e| e.to_string())
            })
            .map_or(acked as usize, |db| missing(&db, acked).len());
        assert_eq!(
            lost, acked as usize,
            "a lying log loses every commit since the last checkpoint"
        );
    }

    /// A clean close leaves everything in the store file: it opens as a
    /// plain redb file, with no log at all.
    #[test]
    fn a_clean_close_leaves_a_complete_store_file() {
        let (file, log) = (MemDisk::default(), MemDisk::default());
        let shown = format!(
            "{:?}",
            PageLog::with_capacity(Box::new(file.clone()), Box::new(log.clone()), SMALL)
                .expect("page log")
        );
        assert!(shown.contains(&format!("capacity: {SMALL}")), "{shown}");
        let db = open(&file, &log);
        commit_each(&db, 0..120);
        drop(db);
        let plain = Database::builder()
            .create_with_backend(file.power_cut(false))
            .expect("plain redb");
        assert_eq!(missing(&plain, 120), Vec::<u64>::new());
    }

    /// A length set since the last checkpoint (a grow, then a cut) is in
    /// the log's frames: after a power cut, the replay gives the file the
    /// length the engine last set, not the one its writes reach.
    #[test]
    fn a_power_cut_keeps_the_length_last_set() {
        let (file, log) = (MemDisk::default(), MemDisk::default());
        let paged = PageLog::with_capacity(Box::new(file.clone()), Box::new(log.clone()), SMALL)
            .expect("page log");
        paged.set_len(3 * 4096).expect("grow");
        paged.write(100, &[7u8; 9000]).expect("write");
        paged.sync_data().expect("sync");
        paged.set_len(4096 + 10).expect("cut");
        paged.sync_data().expect("sync");
        let (file, log) = (file.power_cut(false), log.power_cut(false));
        let reopened =
            PageLog::with_capacity(Box::new(file), Box::new(log), SMALL).expect("replayed");
        assert_eq!(reopened.len().expect("len"), 4096 + 10);
        let mut out = vec![0u8; 4096 + 10];
        reopened.read(0, &mut out).expect("read");
        assert!(out.get(100..).expect("written").iter().all(|&b| b == 7));
    }

    /// A cut and a regrowth read zeros where the cut was, before and after
    /// a checkpoint, and the checkpointed file agrees.
    #[test]
    fn a_cut_file_reads_zeros_past_the_cut() {
        let (file, log) = (MemDisk::default(), MemDisk::default());
        let paged =
            PageLog::with_capacity(Box::new(file.clone()), Box::new(log), SMALL).expect("page log");
        paged.set_len(3 * 4096).expect("grow");
        paged.write(100, &[7u8; 9000]).expect("write");
        paged.sync_data().expect("sync");
        {
            let mut s = paged.lock();
            paged.checkpoint(&mut s).expect("checkpoint");
        }
        paged.set_len(4096 + 10).expect("cut");
        paged.set_len(3 * 4096).expect("regrow");
        let mut out = vec![1u8; 3 * 4096];
        paged.read(0, &mut out).expect("read");
        assert!(out.get(100..4106).expect("kept").iter().all(|&b| b == 7));
        assert!(out.get(4106..).expect("cut").iter().all(|&b| b == 0));
        paged.sync_data().expect("sync");
        {
            let mut s = paged.lock();
            paged.checkpoint(&mut s).expect("checkpoint");
        }
        let mut on_disk = vec![1u8; 3 * 4096];
        file.read(0, &mut on_disk).expect("file");
        assert_eq!(on_disk, out);
    }

    /// A sync that fails keeps what it held: the next sync writes it, in
    /// order before what came after, and the replay has both.
    #[test]
    fn a_failed_sync_keeps_its_writes_for_the_next() {
        let (file, log) = (MemDisk::default(), MemDisk::default());
        let paged =
            PageLog::with_capacity(Box::new(file), Box::new(log.clone()), SMALL).expect("page log");
        paged.set_len(8192).expect("len");
        paged.write(0, &[1u8; 100]).expect("write");
        log.0.lock().expect("disk").fail_next_sync = true;
        assert!(paged.sync_data().is_err());
        paged.write(50, &[2u8; 100]).expect("write");
        paged.sync_data().expect("sync");
        let target = MemDisk::default();
        assert_eq!(
            replay(&log.power_cut(false), &target)
                .expect("replay")
                .frames,
            1
        );
        let mut out = [0u8; 150];
        target.read(0, &mut out).expect("read");
        assert!(out.get(..50).expect("a").iter().all(|&b| b == 1));
        assert!(out.get(50..).expect("b").iter().all(|&b| b == 2));
    }

    /// Replay applies one run from its marker, in order, and stops at a
    /// frame that does not verify or belongs to another run.
    #[test]
    fn replay_stops_at_the_first_frame_that_does_not_follow() {
        let log = MemDisk::default();
        let file = MemDisk::default();
        let paged = PageLog::with_capacity(Box::new(file.clone()), Box::new(log.clone()), SMALL)
            .expect("page log");
        paged.set_len(8192).expect("len");
        paged.write(0, &[1u8; 100]).expect("write");
        paged.sync_data().expect("frame 1");
        paged.write(100, &[2u8; 100]).expect("write");
        paged.sync_data().expect("frame 2");
        let target = MemDisk::default();
        let r = replay(&log, &target).expect("replay");
        assert_eq!(r.frames, 2);
        let mut out = [0u8; 200];
        target.read(0, &mut out).expect("read");
        assert!(out.get(..100).expect("a").iter().all(|&b| b == 1));
        assert!(out.get(100..).expect("b").iter().all(|&b| b == 2));
        // Flip a byte of frame 2's payload: only frame 1 applies.
        let at = (HEADER + HEADER + 1 + 8 + 8 + 8 + 100 + HEADER + 20) as u64;
        let mut b = [0u8; 1];
        log.read(at, &mut b).expect("read");
        log.write(at, &[b[0] ^ 0xFF]).expect("flip");
        let target = MemDisk::default();
        assert_eq!(replay(&log, &target).expect("replay").frames, 1);
        // The store file itself was never written: frames only.
        assert_eq!(file.len().expect("len"), 0);
    }
}
