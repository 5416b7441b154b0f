//! [`CrashBackend`]: a redb storage backend that can lose power.

use super::rng::Rng;
use std::collections::VecDeque;
use std::io::{Error as IoError, ErrorKind};
use std::sync::{Arc, Mutex, MutexGuard};

/// The unit a disk writes atomically: an unsynced write survives a power
/// loss sector by sector, so a write may land torn at these boundaries.
pub const SECTOR_BYTES: u64 = 512;

/// Whether `sync_data` tells the truth.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SyncMode {
    /// `sync_data` makes every write before it durable.
    #[default]
    Honest,
    /// `sync_data` returns `Ok` and persists nothing: a store on this
    /// backend acknowledges before its data is durable. The checks must
    /// catch it (the test of the test).
    Lies,
    /// `sync_data` returns `Ok` but persists only what the previous sync
    /// should have: every image is a consistent, older commit, so only the
    /// check for lost acknowledgements can catch it.
    Lags,
}

/// A write that is in the OS page cache but not yet on the platter.
#[derive(Clone, Debug)]
enum Pending {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
}

/// The file left behind by a power loss taken during a run.
#[derive(Clone, Debug)]
pub struct CrashImage {
    /// Mutating calls (`write`, `set_len`, `sync_data`) that had returned
    /// when power was lost.
    pub at: u64,
    /// The seed that chose which unsynced writes survived.
    pub seed: u64,
    /// The surviving file.
    pub bytes: Vec<u8>,
    /// The surviving files made with [`CrashBackend::sibling`], in order
    /// (a store's write-ahead log): one power loss takes all of them.
    pub siblings: Vec<Vec<u8>>,
}

impl CrashImage {
    /// The disk after reboot: every file of the image, all durable; the
    /// handle returned is the first file's, [`CrashBackend::file`] gives
    /// the others.
    pub fn restore(&self) -> CrashBackend {
        let mut files = vec![self.bytes.clone()];
        files.extend(self.siblings.iter().cloned());
        CrashBackend::from_files(files)
    }
}

/// One file of a simulated disk.
#[derive(Debug, Default)]
struct File {
    /// What reads see: every write applied.
    live: Vec<u8>,
    /// What survives a power loss for certain: the file as of the last sync.
    durable: Vec<u8>,
    /// Writes and length changes since the last (honest) sync, in order.
    pending: Vec<Pending>,
    /// [`SyncMode::Lags`]: the writes the last sync left unsynced.
    lagged: Vec<Pending>,
}

#[derive(Debug, Default)]
struct State {
    /// The disk's files; a handle names one by index. Never empty.
    files: Vec<File>,
    /// Mutating calls so far, on every file.
    mutations: u64,
    /// Planned power losses `(after this many mutations, seed)`, in order.
    plan: VecDeque<(u64, u64)>,
    /// A power loss every so many mutations: `(stride, next point, seeds)`.
    every: Option<(u64, u64, Rng)>,
    images: Vec<CrashImage>,
    sync_mode: SyncMode,
    /// Writes and growth fail with "no space left on device".
    disk_full: bool,
    /// Every write, resize and sync fails with "read-only file system".
    read_only: bool,
    /// Syncs that returned `Ok`.
    syncs: u64,
}

/// A redb [`StorageBackend`](redb::StorageBackend) in memory that keeps the
/// file as last synced plus the writes since, and can "lose power": the
/// surviving file is the synced one plus an arbitrary (seeded) subset of
/// the unsynced writes, each torn at [`SECTOR_BYTES`] boundaries. Test
/// support (feature `test-util`); clones share one file.
///
/// Power losses are planned at mutation counts ([`plan`](Self::plan)); the
/// run goes on afterwards, so one run yields many crash images, each the
/// file a crash at that instant would have left. Besides that: a lying
/// `sync_data` ([`SyncMode::Lies`]) and a full disk
/// ([`set_disk_full`](Self::set_disk_full)).
///
/// ```
/// use idemstore::crash::CrashBackend;
/// use redb::{Database, ReadableDatabase, TableDefinition};
///
/// const T: TableDefinition<u64, u64> = TableDefinition::new("t");
/// let backend = CrashBackend::new();
/// let db = Database::builder().create_with_backend(backend.clone())?;
/// let txn = db.begin_write()?;
/// txn.open_table(T)?.insert(1, 10)?;
/// txn.commit()?;                                   // durable: one sync
/// let image = backend.power_loss(42);              // power fails now
/// drop(db);
/// let db = Database::builder().create_with_backend(CrashBackend::from_image(image))?;
/// assert_eq!(db.begin_read()?.open_table(T)?.get(1)?.map(|v| v.value()), Some(10));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct CrashBackend {
    state: Arc<Mutex<State>>,
    /// Which of the disk's files this handle reads and writes.
    file: usize,
}

impl Default for CrashBackend {
    fn default() -> CrashBackend {
        CrashBackend::from_files(vec![Vec::new()])
    }
}

impl CrashBackend {
    /// An empty file.
    pub fn new() -> CrashBackend {
        CrashBackend::default()
    }

    /// A file holding `bytes`, all of them durable (a disk after reboot).
    pub fn from_image(bytes: Vec<u8>) -> CrashBackend {
        CrashBackend::from_files(vec![bytes])
    }

    /// A disk holding these files, all durable; the handle is the first's.
    pub fn from_files(files: Vec<Vec<u8>>) -> CrashBackend {
        let mut state = State::default();
        for bytes in files {
            state.files.push(File {
                durable: bytes.clone(),
                live: bytes,
                ..File::default()
            });
        }
        if state.files.is_empty() {
            state.files.push(File::default());
        }
        CrashBackend {
            state: Arc::new(Mutex::new(state)),
            file: 0,
        }
    }

    /// A new empty file on the same disk: it counts mutations, loses power
    /// and fills up together with this one (a store's write-ahead log).
    ///
    /// ```
    /// use idemstore::crash::CrashBackend;
    /// use redb::StorageBackend;
    /// let disk = CrashBackend::new();
    /// let log = disk.sibling();
    /// log.write(0, b"frame")?;
    /// log.sync_data()?;
    /// let image = disk.power_loss_all(7);
    /// assert_eq!(image.siblings, vec![b"frame".to_vec()]);
    /// assert_eq!(image.restore().file(1).unwrap().live_image(), b"frame");
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn sibling(&self) -> CrashBackend {
        let mut s = self.lock();
        s.files.push(File::default());
        CrashBackend {
            state: Arc::clone(&self.state),
            file: s.files.len() - 1,
        }
    }

    /// The handle of the disk's file number `index` (0 is the first file,
    /// then the siblings in order), if there is one.
    pub fn file(&self, index: usize) -> Option<CrashBackend> {
        (index < self.lock().files.len()).then(|| CrashBackend {
            state: Arc::clone(&self.state),
            file: index,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held (a failed assertion in a test)
        // leaves the images consistent: every method updates them last.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `sync_data` honest or a liar from now on.
    pub fn set_sync_mode(&self, mode: SyncMode) {
        self.lock().sync_mode = mode;
    }

    /// Makes writes and growth fail with `StorageFull` (ENOSPC) while `full`.
    pub fn set_disk_full(&self, full: bool) {
        self.lock().disk_full = full;
    }

    /// Makes every write, resize and sync fail with `ReadOnlyFilesystem`
    /// (EROFS) while `read_only`: a volume mounted read-only.
    pub fn set_read_only(&self, read_only: bool) {
        self.lock().read_only = read_only;
    }

    /// Mutating calls (`write`, `set_len`, `sync_data`) so far. Read after
    /// an operation returns, it bounds the crash points the operation's
    /// durability is owed to: every image taken at `at >= this` must hold it.
    pub fn mutations(&self) -> u64 {
        self.lock().mutations
    }

    /// `sync_data` calls that returned `Ok`.
    pub fn syncs(&self) -> u64 {
        self.lock().syncs
    }

    /// Plans power losses: for each `(at, seed)`, the image a crash would
    /// leave once `at` mutating calls have returned. Points already passed
    /// are taken at once.
    pub fn plan(&self, points: impl IntoIterator<Item = (u64, u64)>) {
        let mut s = self.lock();
        let mut all: Vec<(u64, u64)> = s.plan.drain(..).chain(points).collect();
        all.sort_unstable();
        s.plan = all.into();
        s.take_due();
    }

    /// Plans a power loss every `stride` mutations (from a seeded offset
    /// below `stride`), each with its own seed drawn from `seed`.
    pub fn plan_every(&self, stride: u64, seed: u64) {
        let mut rng = Rng::new(seed);
        let stride = stride.max(1);
        let first = rng.below(stride);
        let mut s = self.lock();
        let first = s.mutations + first;
        s.every = Some((stride, first, rng));
        s.take_due();
    }

    /// The images taken so far; points planned with [`plan`](Self::plan)
    /// beyond the current count are taken now (a crash after the last
    /// call), so call this after the run. [`plan_every`](Self::plan_every)
    /// stops.
    pub fn take_images(&self) -> Vec<CrashImage> {
        let mut s = self.lock();
        s.every = None;
        let now = s.mutations;
        while let Some((_, seed)) = s.plan.pop_front() {
            let image = s.image(now, seed);
            s.images.push(image);
        }
        std::mem::take(&mut s.images)
    }

    /// This file as a power loss now would leave it, chosen by `seed`.
    pub fn power_loss(&self, seed: u64) -> Vec<u8> {
        let s = self.lock();
        s.files
            .get(self.file)
            .map(|f| f.surviving(seed))
            .unwrap_or_default()
    }

    /// Every file of the disk as a power loss now would leave them.
    pub fn power_loss_all(&self, seed: u64) -> CrashImage {
        let s = self.lock();
        s.image(s.mutations, seed)
    }

    /// The file as the running program sees it (every write applied).
    pub fn live_image(&self) -> Vec<u8> {
        self.lock()
            .files
            .get(self.file)
            .map(|f| f.live.clone())
            .unwrap_or_default()
    }
}

fn disk_full() -> IoError {
    IoError::new(
        ErrorKind::StorageFull,
        "no space left on device (simulated)",
    )
}

fn read_only() -> IoError {
    IoError::new(
        ErrorKind::ReadOnlyFilesystem,
        "read-only file system (simulated)",
    )
}

fn to_usize(n: u64) -> Result<usize, IoError> {
    usize::try_from(n).map_err(|_| IoError::new(ErrorKind::InvalidInput, "offset too large"))
}

impl State {
    /// Takes every planned image whose point has been reached.
    fn take_due(&mut self) {
        while let Some((stride, at, rng)) = self.every.as_mut() {
            if *at > self.mutations {
                break;
            }
            *at += *stride;
            let seed = rng.next_u64();
            let image = self.image(self.mutations, seed);
            self.images.push(image);
        }
        while let Some(&(at, seed)) = self.plan.front() {
            if at > self.mutations {
                break;
            }
            self.plan.pop_front();
            let image = self.image(self.mutations, seed);
            self.images.push(image);
        }
    }

    /// Every file as a power loss now would leave it. Each file draws its
    /// own survivors from `seed` (the first file exactly as a lone file would).
    fn image(&self, at: u64, seed: u64) -> CrashImage {
        let mut files = self
            .files
            .iter()
            .enumerate()
            .map(|(i, f)| f.surviving(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        let bytes = files.next().unwrap_or_default();
        CrashImage {
            at,
            seed,
            bytes,
            siblings: files.collect(),
        }
    }

    /// Counts a mutating call; images due before it are taken first.
    fn mutate(&mut self) -> Result<(), IoError> {
        self.take_due();
        self.mutations += 1;
        if self.read_only {
            return Err(read_only());
        }
        Ok(())
    }
}

impl File {
    /// The durable file plus a seeded subset of the pending writes, each
    /// write split at sector boundaries and each piece kept or lost on its
    /// own, applied in order. How much survives varies with the seed:
    /// nothing, everything, a random subset, or an in-order prefix (a disk
    /// that writes back in order and stopped part-way).
    fn surviving(&self, seed: u64) -> Vec<u8> {
        let mut rng = Rng::new(seed);
        let mode = rng.below(4);
        let percent = rng.below(101);
        let changes = || self.lagged.iter().chain(&self.pending);
        let mut image = self.durable.clone();
        match mode {
            0 => {}
            1 => changes().for_each(|p| apply(&mut image, p.as_piece())),
            _ => {
                let count: u64 = changes().map(|p| sectors(p).count() as u64).sum();
                let cut = rng.below(count + 1);
                for (i, piece) in changes().flat_map(sectors).enumerate() {
                    let keep = if mode == 2 {
                        rng.chance(percent)
                    } else {
                        (i as u64) < cut
                    };
                    if keep {
                        apply(&mut image, piece);
                    }
                }
            }
        }
        image
    }
}

/// A pending change, or a sector-sized part of one, borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Piece<'a> {
    Write { offset: u64, data: &'a [u8] },
    SetLen(u64),
}

impl Pending {
    fn as_piece(&self) -> Piece<'_> {
        match self {
            Pending::Write { offset, data } => Piece::Write {
                offset: *offset,
                data,
            },
            Pending::SetLen(len) => Piece::SetLen(*len),
        }
    }
}

/// A pending change as the pieces a power loss can separate: a write
/// split at sector boundaries, a length change whole.
fn sectors(p: &Pending) -> impl Iterator<Item = Piece<'_>> {
    let (mut at, mut rest, mut set_len) = match p {
        Pending::Write { offset, data } => (*offset, data.as_slice(), None),
        Pending::SetLen(len) => (0, &[][..], Some(*len)),
    };
    std::iter::from_fn(move || {
        if let Some(len) = set_len.take() {
            return Some(Piece::SetLen(len));
        }
        if rest.is_empty() {
            return None;
        }
        let room = SECTOR_BYTES - at % SECTOR_BYTES;
        let n = usize::try_from(room).unwrap_or(usize::MAX).min(rest.len());
        let (head, tail) = rest.split_at(n);
        let piece = Piece::Write {
            offset: at,
            data: head,
        };
        at += n as u64;
        rest = tail;
        Some(piece)
    })
}

fn apply(image: &mut Vec<u8>, p: Piece<'_>) {
    match p {
        Piece::SetLen(len) => image.resize(usize::try_from(len).unwrap_or(usize::MAX), 0),
        Piece::Write { offset, data } => {
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            let end = start.saturating_add(data.len());
            if image.len() < end {
                image.resize(end, 0);
            }
            if let Some(dst) = image.get_mut(start..end) {
                dst.copy_from_slice(data);
            }
        }
    }
}

impl redb::StorageBackend for CrashBackend {
    fn len(&self) -> Result<u64, IoError> {
        let s = self.lock();
        Ok(file(&s, self.file)?.live.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), IoError> {
        let s = self.lock();
        let start = to_usize(offset)?;
        let src = start
            .checked_add(out.len())
            .and_then(|end| file(&s, self.file).ok()?.live.get(start..end))
            .ok_or_else(|| IoError::from(ErrorKind::UnexpectedEof))?;
        out.copy_from_slice(src);
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), IoError> {
        let mut s = self.lock();
        s.mutate()?;
        let full = s.disk_full;
        let f = file_mut(&mut s, self.file)?;
        if full && len > f.live.len() as u64 {
            return Err(disk_full());
        }
        let p = Pending::SetLen(len);
        apply(&mut f.live, p.as_piece());
        f.pending.push(p);
        Ok(())
    }

    fn sync_data(&self) -> Result<(), IoError> {
        let mut s = self.lock();
        s.mutate()?;
        s.syncs += 1;
        let mode = s.sync_mode;
        let f = file_mut(&mut s, self.file)?;
        let to_persist = match mode {
            SyncMode::Honest => std::mem::take(&mut f.pending),
            SyncMode::Lies => Vec::new(),
            SyncMode::Lags => {
                let pending = std::mem::take(&mut f.pending);
                std::mem::replace(&mut f.lagged, pending)
            }
        };
        for p in &to_persist {
            apply(&mut f.durable, p.as_piece());
        }
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), IoError> {
        let mut s = self.lock();
        s.mutate()?;
        if s.disk_full {
            return Err(disk_full());
        }
        to_usize(offset.saturating_add(data.len() as u64))?;
        let f = file_mut(&mut s, self.file)?;
        let p = Pending::Write {
            offset,
            data: data.to_vec(),
        };
        apply(&mut f.live, p.as_piece());
        f.pending.push(p);
        Ok(())
    }
}

fn no_such_file() -> IoError {
    IoError::new(ErrorKind::NotFound, "no such file on the simulated disk")
}

fn file(s: &State, index: usize) -> Result<&File, IoError> {
    s.files.get(index).ok_or_else(no_such_file)
}

fn file_mut(s: &mut State, index: usize) -> Result<&mut File, IoError> {
    s.files.get_mut(index).ok_or_else(no_such_file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::StorageBackend;

    #[test]
    fn writes_are_torn_at_sector_boundaries() {
        let write = Pending::Write {
            offset: 500,
            data: vec![1; 1100],
        };
        let spans: Vec<(u64, usize)> = sectors(&write)
            .map(|p| match p {
                Piece::Write { offset, data } => (offset, data.len()),
                Piece::SetLen(_) => unreachable!(),
            })
            .collect();
        assert_eq!(spans, [(500, 12), (512, 512), (1024, 512), (1536, 64)]);
    }

    #[test]
    fn synced_writes_always_survive_and_unsynced_ones_vary_with_the_seed() {
        let b = CrashBackend::new();
        b.write(0, &[1; 1024]).unwrap();
        b.sync_data().unwrap();
        b.write(0, &[2; 1024]).unwrap();
        let mut seen = std::collections::HashSet::new();
        for seed in 0..64 {
            let image = b.power_loss(seed);
            assert_eq!(image.len(), 1024);
            // Each sector is old or new as a whole.
            for sector in image.chunks(512) {
                assert!(sector.iter().all(|&x| x == sector[0]) && [1, 2].contains(&sector[0]));
            }
            seen.insert(image);
        }
        assert_eq!(seen.len(), 4, "all four sector combinations occur");
    }

    #[test]
    fn a_lying_sync_persists_nothing() {
        let b = CrashBackend::new();
        b.set_sync_mode(SyncMode::Lies);
        b.write(0, &[1; 10]).unwrap();
        b.sync_data().unwrap();
        assert!(b.power_loss(0).len() <= 10);
        assert!((0..64).any(|seed| b.power_loss(seed).is_empty()));
    }

    #[test]
    fn planned_images_are_taken_at_their_point() {
        let b = CrashBackend::new();
        b.plan([(1, 0), (2, 0), (9, 0)]);
        b.write(0, &[1]).unwrap();
        b.sync_data().unwrap();
        b.write(0, &[2]).unwrap();
        let images = b.take_images();
        let at: Vec<u64> = images.iter().map(|i| i.at).collect();
        assert_eq!(at, [1, 2, 3]);
        // After the sync (point 2) the first byte is durable.
        assert_eq!(images[1].bytes, [1]);
        assert_eq!(b.mutations(), 3);
        b.plan_every(2, 5);
        for _ in 0..10 {
            b.sync_data().unwrap();
        }
        assert_eq!(b.take_images().len(), 5);
    }

    #[test]
    fn a_full_disk_refuses_writes_and_growth_and_a_read_only_one_everything() {
        let b = CrashBackend::new();
        b.set_disk_full(true);
        assert_eq!(b.write(0, &[1]).unwrap_err().kind(), ErrorKind::StorageFull);
        assert_eq!(b.set_len(10).unwrap_err().kind(), ErrorKind::StorageFull);
        b.set_disk_full(false);
        b.set_len(10).unwrap();
        assert_eq!(b.len().unwrap(), 10);
        b.set_read_only(true);
        assert_eq!(
            b.sync_data().unwrap_err().kind(),
            ErrorKind::ReadOnlyFilesystem
        );
        assert_eq!(
            b.write(0, &[1]).unwrap_err().kind(),
            ErrorKind::ReadOnlyFilesystem
        );
    }
}
