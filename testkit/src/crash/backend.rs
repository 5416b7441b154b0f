//! [`CrashBackend`]: a redb storage backend that can lose power.

use super::rng::Rng;
use std::collections::VecDeque;
use std::io::{Error as IoError, ErrorKind};
use std::sync::{Arc, Mutex, MutexGuard};

/// The unit a disk writes: an unsynced write survives a power loss sector
/// by sector, so a write may land torn at these boundaries. Whether a
/// sector itself is written atomically is [`TornSectors`].
pub const SECTOR_BYTES: u64 = 512;

/// What a sector that was being written when power failed reads back as.
///
/// "Being written" means touched by any write since the file's last sync
/// (the whole sector, also the bytes of it the write did not cover).
/// Sectors no pending write touched never change: synced data is durable
/// in both modes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TornSectors {
    /// The disk writes a sector atomically: it reads back old or new as a
    /// whole, and the bytes of a sector outside a write never change
    /// (SQLite's "powersafe overwrite", which redb's design also assumes).
    #[default]
    OldOrNew,
    /// The disk does not: a sector being written may also read back as
    /// garbage (seeded random bytes), the bytes of it outside the write
    /// included, as on a device that loses power mid-sector. Each image
    /// draws, from its seed, a share of the touched sectors to garble
    /// (0–100 %), over the same old/new choice [`OldOrNew`](Self::OldOrNew)
    /// makes for that seed.
    Garbage,
}

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
    /// The seed that chose which unsynced writes survived (and, with
    /// [`TornSectors::Garbage`], which sectors were garbled).
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

/// Which kind of call of a file an injected [`Fault`] fails
/// ([`CrashBackend::fail_next`], [`Injection::on`]), and the kinds of call
/// [`IoCounts`] counts.
///
/// ```
/// use idemstore_testkit::crash::FaultOn;
/// assert_eq!(FaultOn::ALL.len(), 4);
/// assert_eq!(FaultOn::SetLen.to_string(), "set_len");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultOn {
    /// A `read`.
    Read,
    /// A `write` (nothing of it is written).
    Write,
    /// A `sync_data` (nothing more becomes durable).
    Sync,
    /// A `set_len` (the length does not change).
    SetLen,
}

impl FaultOn {
    /// Every kind, in the order [`IoCounts`] lists them.
    pub const ALL: [FaultOn; 4] = [
        FaultOn::Read,
        FaultOn::Write,
        FaultOn::Sync,
        FaultOn::SetLen,
    ];

    fn index(self) -> usize {
        match self {
            FaultOn::Read => 0,
            FaultOn::Write => 1,
            FaultOn::Sync => 2,
            FaultOn::SetLen => 3,
        }
    }

    /// The name of the `StorageBackend` method: `read`, `write`,
    /// `sync_data`, `set_len`.
    pub fn name(self) -> &'static str {
        match self {
            FaultOn::Read => "read",
            FaultOn::Write => "write",
            FaultOn::Sync => "sync_data",
            FaultOn::SetLen => "set_len",
        }
    }
}

impl std::fmt::Display for FaultOn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The error an injected failure returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `EIO`: the device failed the request.
    Eio,
    /// `ENOSPC`: no space left on the device.
    Enospc,
}

impl Fault {
    /// The [`ErrorKind`] of the error this fault returns: for EIO the kind
    /// the operating system's own EIO has (on Unix; std does not name it,
    /// and it is not `Other`, so an error a store makes up in its place is
    /// told apart), `StorageFull` for ENOSPC.
    ///
    /// ```
    /// use idemstore_testkit::crash::Fault;
    /// use std::io::ErrorKind;
    /// if cfg!(unix) {
    ///     assert_eq!(Fault::Eio.kind(), std::io::Error::from_raw_os_error(5).kind());
    ///     assert_ne!(Fault::Eio.kind(), ErrorKind::Other);
    /// }
    /// assert_eq!(Fault::Enospc.kind(), ErrorKind::StorageFull);
    /// ```
    pub fn kind(self) -> ErrorKind {
        match self {
            Fault::Eio => eio_kind(),
            Fault::Enospc => ErrorKind::StorageFull,
        }
    }

    fn error(self) -> IoError {
        match self {
            Fault::Eio => IoError::new(eio_kind(), "input/output error (injected EIO)"),
            Fault::Enospc => {
                IoError::new(ErrorKind::StorageFull, "no space left on device (injected)")
            }
        }
    }
}

/// A planned, counted failure ([`CrashBackend::inject`]): the `nth` call
/// of kind `on` on file `file` (or on any file of the disk), counted from
/// the moment it is armed, fails with `fault`; once, or from then on.
///
/// The shape of SQLite's I/O-error tests: count the calls of a clean run
/// of a workload ([`CrashBackend::io_counts`]), then run it once for every
/// `nth` up to that count.
///
/// ```
/// use idemstore_testkit::crash::{CrashBackend, Fault, FaultOn, Injection};
/// use redb::StorageBackend;
///
/// let disk = CrashBackend::new();
/// disk.inject(Injection { file: Some(0), on: FaultOn::Write, nth: 2, fault: Fault::Enospc, persistent: false });
/// assert!(disk.write(0, b"a").is_ok());  // the 1st
/// assert!(disk.write(1, b"b").is_err()); // the 2nd fails
/// assert!(disk.write(1, b"b").is_ok());  // transient: once
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Injection {
    /// The file whose calls count and fail (0 is the first file, then the
    /// siblings in order); `None`: the calls of every file count.
    pub file: Option<usize>,
    /// The kind of call that counts and fails.
    pub on: FaultOn,
    /// Which of those calls fails first, from 1 (the next one); 0 is read
    /// as 1.
    pub nth: u64,
    /// The error it returns.
    pub fault: Fault,
    /// `false`: the `nth` call fails and the later ones work (a transient
    /// error); `true`: it and every later call of that kind fail until
    /// [`CrashBackend::clear_injection`] (a dead sector, a full disk).
    pub persistent: bool,
}

impl Injection {
    /// Whether a call of kind `on` on file `file` counts for this injection.
    fn matches(&self, file: usize, on: FaultOn) -> bool {
        self.on == on && self.file.is_none_or(|f| f == file)
    }
}

/// An armed [`Injection`] and its progress.
#[derive(Clone, Copy, Debug)]
struct Armed {
    plan: Injection,
    /// Matching calls since it was armed.
    seen: u64,
    /// Matching calls it failed.
    failed: u64,
}

/// Calls of each kind on each file of a disk since it was made
/// ([`CrashBackend::io_counts`]); every call counts, also those that
/// failed. Its `Display` is a table, a row per file.
///
/// ```
/// use idemstore_testkit::crash::{CrashBackend, FaultOn};
/// use redb::StorageBackend;
///
/// let disk = CrashBackend::new();
/// let log = disk.sibling();
/// log.write(0, b"frame")?;
/// log.sync_data()?;
/// disk.set_len(4096)?;
/// let counts = disk.io_counts();
/// assert_eq!(counts.files(), 2);
/// assert_eq!(counts.get(1, FaultOn::Write), 1);
/// assert_eq!(counts.get(1, FaultOn::Sync), 1);
/// assert_eq!(counts.get(0, FaultOn::Write), 0);
/// assert_eq!(counts.total(FaultOn::SetLen), 1);
/// assert!(counts.to_string().contains("sync_data"));
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IoCounts {
    /// Per file, the calls of each kind in [`FaultOn::ALL`] order.
    per_file: Vec<[u64; 4]>,
}

impl IoCounts {
    /// Calls of kind `on` on file number `file` (0 when there is no such file).
    pub fn get(&self, file: usize, on: FaultOn) -> u64 {
        self.per_file
            .get(file)
            .and_then(|c| c.get(on.index()))
            .copied()
            .unwrap_or(0)
    }

    /// Calls of kind `on` on every file.
    pub fn total(&self, on: FaultOn) -> u64 {
        (0..self.files()).map(|f| self.get(f, on)).sum()
    }

    /// How many files the disk has.
    pub fn files(&self) -> usize {
        self.per_file.len()
    }
}

impl std::fmt::Display for IoCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:>6}", "file")?;
        for on in FaultOn::ALL {
            write!(f, " {:>10}", on.name())?;
        }
        writeln!(f)?;
        for file in 0..self.files() {
            write!(f, "{file:>6}")?;
            for on in FaultOn::ALL {
                write!(f, " {:>10}", self.get(file, on))?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// The kind of the operating system's EIO (5 on every Unix); `Other`
/// elsewhere.
fn eio_kind() -> ErrorKind {
    if cfg!(unix) {
        IoError::from_raw_os_error(5).kind()
    } else {
        ErrorKind::Other
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
    /// What a sector being written reads back as after a power loss.
    torn: TornSectors,
    /// Injected failures still to come, each for the next call of its kind.
    faults: Vec<(FaultOn, Fault)>,
    /// Calls so far of each kind, in [`FaultOn::ALL`] order.
    calls: [u64; 4],
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
    /// What a sector being written reads back as after a power loss, on
    /// files made from now on ([`CrashBackend::sibling`]).
    torn: TornSectors,
    /// Writes and growth fail with "no space left on device".
    disk_full: bool,
    /// Every write, resize and sync fails with "read-only file system".
    read_only: bool,
    /// Syncs that returned `Ok`.
    syncs: u64,
    /// The planned failure in force ([`CrashBackend::inject`]).
    injection: Option<Armed>,
}

/// A redb [`StorageBackend`](redb::StorageBackend) in memory that keeps the
/// file as last synced plus the writes since, and can "lose power": the
/// surviving file is the synced one plus an arbitrary (seeded) subset of
/// the unsynced writes, each torn at [`SECTOR_BYTES`] boundaries (and with
/// [`TornSectors::Garbage`], sectors being written garbled). Test support
/// (feature `test-util`); clones share one file.
///
/// Power losses are planned at mutation counts ([`plan`](Self::plan)); the
/// run goes on afterwards, so one run yields many crash images, each the
/// file a crash at that instant would have left. Besides that: a lying
/// `sync_data` ([`SyncMode::Lies`]), a full disk
/// ([`set_disk_full`](Self::set_disk_full)), one-shot faults
/// ([`fail_next`](Self::fail_next)) and a planned fault at the n-th call
/// of a kind ([`inject`](Self::inject), with per-file call counts in
/// [`io_counts`](Self::io_counts)).
///
/// ```
/// use idemstore_testkit::crash::CrashBackend;
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
    /// use idemstore_testkit::crash::CrashBackend;
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
        let torn = s.torn;
        s.files.push(File {
            torn,
            ..File::default()
        });
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

    /// Sets what a sector being written reads back as in the power-loss
    /// images taken from now on, on every file of the disk (this one, its
    /// siblings, and siblings made later). [`TornSectors::OldOrNew`] by
    /// default; a disk restored from an image starts over with it.
    ///
    /// ```
    /// use idemstore_testkit::crash::{CrashBackend, TornSectors};
    /// use redb::StorageBackend;
    /// let disk = CrashBackend::new();
    /// disk.set_torn_sectors(TornSectors::Garbage);
    /// disk.write(0, &[1; 512])?;
    /// disk.sync_data()?;
    /// disk.write(0, &[2; 8])?; // rewrites the first 8 bytes of a synced sector
    /// // The bytes the write did not cover may change too, once in a while.
    /// let garbled = (0..64).any(|seed| disk.power_loss(seed)[8..] != [1; 504]);
    /// assert!(garbled);
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn set_torn_sectors(&self, torn: TornSectors) {
        let mut s = self.lock();
        s.torn = torn;
        for f in &mut s.files {
            f.torn = torn;
        }
    }

    /// Sets what a sector being written reads back as on this handle's file
    /// only (say, garbage in a log beside a store file whose engine assumes
    /// sectors are written atomically). The last call wins over
    /// [`set_torn_sectors`](Self::set_torn_sectors) for this file.
    pub fn set_file_torn_sectors(&self, torn: TornSectors) {
        if let Some(f) = self.lock().files.get_mut(self.file) {
            f.torn = torn;
        }
    }

    /// Makes writes and growth fail with `StorageFull` (ENOSPC) while `full`.
    pub fn set_disk_full(&self, full: bool) {
        self.lock().disk_full = full;
    }

    /// Makes the next `on` call of this handle's file fail with `fault`
    /// (once; several calls queue up in order). Failures beyond power loss:
    /// an `EIO` on a log append or a read during replay, an `ENOSPC` on a
    /// sync. For the n-th call, or every call from then on, see
    /// [`inject`](Self::inject).
    ///
    /// ```
    /// use idemstore_testkit::crash::{CrashBackend, Fault, FaultOn};
    /// use redb::StorageBackend;
    ///
    /// let disk = CrashBackend::new();
    /// disk.fail_next(FaultOn::Write, Fault::Eio);
    /// assert!(disk.write(0, b"x").is_err());
    /// assert!(disk.write(0, b"x").is_ok()); // once
    /// ```
    pub fn fail_next(&self, on: FaultOn, fault: Fault) {
        let mut s = self.lock();
        if let Ok(f) = file_mut(&mut s, self.file) {
            f.faults.push((on, fault));
        }
    }

    /// Arms a planned failure (replacing the one in force, if any): the
    /// [`nth`](Injection::nth) call of its kind on its file from now on
    /// fails, and with [`persistent`](Injection::persistent) every later
    /// one too, until [`clear_injection`](Self::clear_injection). Any
    /// handle of the disk arms it. Queued [`fail_next`](Self::fail_next)
    /// faults still apply, after it.
    ///
    /// ```
    /// use idemstore_testkit::crash::{CrashBackend, Fault, FaultOn, Injection};
    /// use redb::StorageBackend;
    /// use std::io::ErrorKind;
    ///
    /// let disk = CrashBackend::new();
    /// let log = disk.sibling();
    /// disk.inject(Injection { file: None, on: FaultOn::Sync, nth: 2, fault: Fault::Eio, persistent: true });
    /// assert!(disk.sync_data().is_ok());  // the 1st sync on any file
    /// assert!(log.sync_data().is_err());  // the 2nd
    /// assert!(disk.sync_data().is_err()); // and from then on
    /// assert_eq!(disk.clear_injection(), 2);
    /// assert!(log.sync_data().is_ok());
    ///
    /// disk.inject(Injection { file: Some(1), on: FaultOn::SetLen, nth: 1, fault: Fault::Enospc, persistent: false });
    /// assert!(disk.set_len(10).is_ok()); // file 0 does not count
    /// assert_eq!(log.set_len(10).unwrap_err().kind(), ErrorKind::StorageFull);
    /// assert_eq!(log.len()?, 0, "the failed call changed nothing");
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn inject(&self, injection: Injection) {
        self.lock().injection = Some(Armed {
            plan: injection,
            seen: 0,
            failed: 0,
        });
    }

    /// Disarms the planned failure, returning how many calls it failed
    /// (0: the run never reached its call).
    ///
    /// ```
    /// use idemstore_testkit::crash::{CrashBackend, Fault, FaultOn, Injection};
    /// use redb::StorageBackend;
    ///
    /// let disk = CrashBackend::new();
    /// disk.inject(Injection { file: Some(0), on: FaultOn::Read, nth: 5, fault: Fault::Eio, persistent: true });
    /// disk.write(0, b"x")?;
    /// disk.read(0, &mut [0; 1])?; // the 1st read: fine
    /// assert_eq!(disk.clear_injection(), 0, "the 5th read never came");
    /// assert_eq!(disk.clear_injection(), 0, "nothing armed");
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn clear_injection(&self) -> u64 {
        self.lock().injection.take().map_or(0, |a| a.failed)
    }

    /// Calls the planned failure in force has failed so far (0 when none is
    /// armed): whether a run reached its call.
    ///
    /// ```
    /// use idemstore_testkit::crash::{CrashBackend, Fault, FaultOn, Injection};
    /// use redb::StorageBackend;
    ///
    /// let disk = CrashBackend::new();
    /// disk.inject(Injection { file: None, on: FaultOn::Write, nth: 1, fault: Fault::Eio, persistent: false });
    /// assert_eq!(disk.injected_failures(), 0);
    /// assert!(disk.write(0, b"x").is_err());
    /// assert_eq!(disk.injected_failures(), 1);
    /// ```
    pub fn injected_failures(&self) -> u64 {
        self.lock().injection.map_or(0, |a| a.failed)
    }

    /// Calls of each kind on each file of the disk so far, failed ones
    /// included (see [`IoCounts`]): a clean run's counts bound the `nth`
    /// a sweep of [`inject`](Self::inject) goes through.
    pub fn io_counts(&self) -> IoCounts {
        IoCounts {
            per_file: self.lock().files.iter().map(|f| f.calls).collect(),
        }
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

    /// Every file of the disk as the running program sees them: what a
    /// process that stops now (a crash, or a store never closed) leaves on
    /// a disk that keeps power. [`CrashImage::restore`] it for a disk
    /// without this one's faults and counters. `at` is the mutation count,
    /// `seed` 0.
    ///
    /// ```
    /// use idemstore_testkit::crash::CrashBackend;
    /// use redb::StorageBackend;
    /// let disk = CrashBackend::new();
    /// let log = disk.sibling();
    /// disk.write(0, b"store")?;
    /// log.write(0, b"log")?; // never synced: still there without a power loss
    /// let image = disk.live_image_all();
    /// assert_eq!((image.bytes.as_slice(), image.siblings.as_slice()), (&b"store"[..], &[b"log".to_vec()][..]));
    /// assert_eq!(image.restore().file(1).unwrap().live_image(), b"log");
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn live_image_all(&self) -> CrashImage {
        let s = self.lock();
        let mut files = s.files.iter().map(|f| f.live.clone());
        CrashImage {
            at: s.mutations,
            seed: 0,
            bytes: files.next().unwrap_or_default(),
            siblings: files.collect(),
        }
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

    /// Counts a call of kind `on` on file `file`, and fails it when the
    /// planned failure says so.
    fn count(&mut self, file: usize, on: FaultOn) -> Result<(), IoError> {
        if let Some(c) = self
            .files
            .get_mut(file)
            .and_then(|f| f.calls.get_mut(on.index()))
        {
            *c += 1;
        }
        let Some(armed) = self.injection.as_mut() else {
            return Ok(());
        };
        if !armed.plan.matches(file, on) {
            return Ok(());
        }
        armed.seen += 1;
        let nth = armed.plan.nth.max(1);
        if armed.seen == nth || (armed.plan.persistent && armed.seen > nth) {
            armed.failed += 1;
            return Err(armed.plan.fault.error());
        }
        Ok(())
    }

    /// Counts a mutating call of kind `on` on file `file`; images due
    /// before it are taken first.
    fn mutate(&mut self, file: usize, on: FaultOn) -> Result<(), IoError> {
        self.take_due();
        self.mutations += 1;
        self.count(file, on)?;
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
    /// that writes back in order and stopped part-way). With
    /// [`TornSectors::Garbage`], some of the sectors the pending writes
    /// touched are then garbled ([`garble`]); the old/new choice is the same
    /// as without, for the same seed.
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
        if self.torn == TornSectors::Garbage {
            garble(&mut image, changes(), seed);
        }
        image
    }
}

/// Overwrites with seeded random bytes a seeded share (0–100 %) of the
/// sectors that `changes` write to, as far as they lie inside `image`.
/// Its generator is derived from `seed` but apart from the one that chose
/// the surviving writes, so that choice does not depend on the mode.
fn garble<'a>(image: &mut [u8], changes: impl Iterator<Item = &'a Pending>, seed: u64) {
    let mut rng = Rng::new(seed ^ 0x6A09_E667_F3BC_C908);
    let percent = rng.below(101);
    let touched: std::collections::BTreeSet<u64> = changes
        .filter_map(|p| match p {
            Pending::Write { offset, data } if !data.is_empty() => {
                let last = offset.saturating_add(data.len() as u64 - 1);
                Some(offset / SECTOR_BYTES..=last / SECTOR_BYTES)
            }
            _ => None,
        })
        .flatten()
        .collect();
    for sector in touched {
        if !rng.chance(percent) {
            continue;
        }
        let start = usize::try_from(sector * SECTOR_BYTES).unwrap_or(usize::MAX);
        let end = start.saturating_add(SECTOR_BYTES as usize).min(image.len());
        let Some(bytes) = image.get_mut(start..end) else {
            break; // this sector and the rest lie past the image's end
        };
        for chunk in bytes.chunks_mut(8) {
            let noise = rng.next_u64().to_le_bytes();
            chunk.copy_from_slice(noise.get(..chunk.len()).unwrap_or_default());
        }
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
        let mut s = self.lock();
        s.count(self.file, FaultOn::Read)?;
        injected(file_mut(&mut s, self.file)?, FaultOn::Read)?;
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
        s.mutate(self.file, FaultOn::SetLen)?;
        injected(file_mut(&mut s, self.file)?, FaultOn::SetLen)?;
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
        s.mutate(self.file, FaultOn::Sync)?;
        injected(file_mut(&mut s, self.file)?, FaultOn::Sync)?;
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
        s.mutate(self.file, FaultOn::Write)?;
        injected(file_mut(&mut s, self.file)?, FaultOn::Write)?;
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

/// Fails with the first fault queued for `on`, consuming it.
fn injected(f: &mut File, on: FaultOn) -> Result<(), IoError> {
    match f.faults.iter().position(|(o, _)| *o == on) {
        Some(i) => Err(f.faults.remove(i).1.error()),
        None => Ok(()),
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

    /// Garbage mode: a sector a pending write touched comes back old, new or
    /// garbage (also the bytes of it the write did not cover); a sector no
    /// pending write touched, synced or not, never changes; the old/new
    /// choice is the one the default mode makes; and every file of the
    /// disk is subject to it.
    #[test]
    fn garbage_mode_garbles_only_sectors_being_written() {
        let disk = CrashBackend::new();
        let log = disk.sibling();
        disk.set_torn_sectors(TornSectors::Garbage);
        for f in [&disk, &log] {
            f.write(0, &[1; 2048]).unwrap();
            f.sync_data().unwrap();
            // Sector 0 whole, the middle of sector 1 (bytes 600..700 only),
            // and a new sector 4 past the synced end; 2 and 3 untouched.
            f.write(0, &[2; 512]).unwrap();
            f.write(600, &[2; 100]).unwrap();
            f.write(2048, &[2; 512]).unwrap();
        }
        let (mut old, mut new, mut garbage) = ([0; 5], [0; 5], [0; 5]);
        for seed in 0..256 {
            let all = disk.power_loss_all(seed);
            for image in [&all.bytes, &all.siblings[0]] {
                assert!(image.len() == 2048 || image.len() == 2560);
                // Synced and untouched: always the synced bytes.
                assert!(image[1024..2048].iter().all(|&x| x == 1));
                let sector1_old = image[512..1024].iter().all(|&x| x == 1);
                let sector1_new = image[512..600].iter().all(|&x| x == 1)
                    && image[600..700].iter().all(|&x| x == 2)
                    && image[700..1024].iter().all(|&x| x == 1);
                for (i, sector) in image.chunks(512).enumerate() {
                    if (2..4).contains(&i) {
                        continue;
                    }
                    let (is_old, is_new) = if i == 1 {
                        (sector1_old, sector1_new)
                    } else {
                        (
                            sector.iter().all(|&x| x == 1),
                            sector.iter().all(|&x| x == 2),
                        )
                    };
                    if is_old {
                        old[i] += 1;
                    } else if is_new {
                        new[i] += 1;
                    } else {
                        // Garbage is random bytes, not a mix of old and new.
                        assert!(sector.iter().filter(|&&x| x == 1 || x == 2).count() < 64);
                        garbage[i] += 1;
                    }
                }
            }
            // The same seed in the default mode makes the same old/new
            // choice, with no garbage: where the garbage mode left a sector
            // old or new, the default mode left it the same.
            disk.set_torn_sectors(TornSectors::OldOrNew);
            let plain = disk.power_loss(seed);
            disk.set_torn_sectors(TornSectors::Garbage);
            assert_eq!(plain.len(), all.bytes.len());
            for (p, g) in plain.chunks(512).zip(all.bytes.chunks(512)) {
                let p_ok = p.iter().all(|&x| x == 1 || x == 2);
                assert!(p_ok, "the default mode never garbles");
                let g_ok = g.iter().all(|&x| x == 1 || x == 2);
                assert!(!g_ok || p == g);
            }
            assert_eq!(disk.power_loss_all(seed).bytes, all.bytes, "deterministic");
        }
        for i in [0, 1, 4] {
            // Sector 4 is new or garbage when it exists (there is no old).
            assert!(
                new[i] > 0 && garbage[i] > 0,
                "sector {i}: {new:?} {garbage:?}"
            );
        }
        assert!(old[0] > 0 && old[1] > 0);
        // Once synced, garbage is gone for good.
        disk.sync_data().unwrap();
        let synced = disk.live_image();
        assert!((0..64).all(|seed| disk.power_loss(seed) == synced));
        // One file only: the store file keeps atomic sectors, the log not.
        disk.set_torn_sectors(TornSectors::OldOrNew);
        log.set_file_torn_sectors(TornSectors::Garbage);
        disk.write(0, &[3; 512]).unwrap();
        let (mut store_garbled, mut log_garbled) = (false, false);
        for seed in 0..64 {
            let all = disk.power_loss_all(seed);
            // Random bytes, not old (1, 2) or new (3) ones.
            let garbled = |s: &[u8]| s.iter().filter(|x| !(1..=3).contains(*x)).count() > 64;
            store_garbled |= all.bytes.chunks(512).any(garbled);
            log_garbled |= all.siblings[0].chunks(512).any(garbled);
        }
        assert!(!store_garbled && log_garbled);
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

    fn plan(file: Option<usize>, on: FaultOn, nth: u64, persistent: bool) -> Injection {
        Injection {
            file,
            on,
            nth,
            fault: Fault::Eio,
            persistent,
        }
    }

    /// One call of `on` on `b`, with arguments that work on any file.
    fn call(b: &CrashBackend, on: FaultOn) -> Result<(), IoError> {
        match on {
            FaultOn::Read => b.read(0, &mut []),
            FaultOn::Write => b.write(0, &[7]),
            FaultOn::Sync => b.sync_data(),
            FaultOn::SetLen => b.set_len(1),
        }
    }

    #[test]
    fn a_transient_injection_fails_exactly_the_nth_call_of_its_kind_and_file() {
        for on in FaultOn::ALL {
            for nth in 1..=4 {
                let disk = CrashBackend::new();
                let log = disk.sibling();
                disk.inject(plan(Some(1), on, nth, false));
                let mut failed = Vec::new();
                for i in 1..=6 {
                    // Calls of other kinds and of the other file never count.
                    for other in FaultOn::ALL {
                        call(&disk, other).unwrap();
                        if other != on {
                            call(&log, other).unwrap();
                        }
                    }
                    if call(&log, on).is_err() {
                        failed.push(i);
                    }
                }
                assert_eq!(failed, [nth], "{on} nth {nth}");
                assert_eq!(disk.injected_failures(), 1);
                assert_eq!(disk.clear_injection(), 1);
            }
        }
    }

    #[test]
    fn a_persistent_injection_fails_from_the_nth_call_until_cleared() {
        let disk = CrashBackend::new();
        let log = disk.sibling();
        disk.inject(Injection {
            fault: Fault::Enospc,
            ..plan(None, FaultOn::Write, 3, true)
        });
        let results: Vec<bool> = (0..6)
            .map(|i| call(if i % 2 == 0 { &disk } else { &log }, FaultOn::Write).is_ok())
            .collect();
        assert_eq!(results, [true, true, false, false, false, false]);
        let err = log.write(0, &[1]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::StorageFull);
        assert_eq!(err.kind(), Fault::Enospc.kind());
        assert_eq!(log.clear_injection(), 5);
        assert_eq!(disk.injected_failures(), 0);
        call(&disk, FaultOn::Write).unwrap();
        call(&log, FaultOn::Write).unwrap();
    }

    /// A failed call changes nothing: a write writes no byte, a sync makes
    /// nothing durable, a set_len keeps the length.
    #[test]
    fn an_injected_failure_changes_nothing() {
        let b = CrashBackend::new();
        b.write(0, &[1; 4]).unwrap();
        b.sync_data().unwrap();
        b.write(0, &[2; 4]).unwrap();
        b.inject(plan(Some(0), FaultOn::Sync, 1, false));
        b.sync_data().unwrap_err();
        assert!(
            (0..32).any(|seed| b.power_loss(seed) == [1; 4]),
            "not durable"
        );
        b.inject(plan(Some(0), FaultOn::Write, 1, false));
        b.write(0, &[3; 8]).unwrap_err();
        assert_eq!(b.live_image(), [2; 4]);
        b.inject(plan(Some(0), FaultOn::SetLen, 1, false));
        b.set_len(0).unwrap_err();
        assert_eq!(b.len().unwrap(), 4);
        b.inject(plan(Some(0), FaultOn::Read, 1, false));
        let mut out = [9; 4];
        b.read(0, &mut out).unwrap_err();
        assert_eq!(out, [9; 4]);
        b.read(0, &mut out).unwrap();
        assert_eq!(out, [2; 4]);
    }

    #[test]
    fn io_counts_count_every_call_failed_ones_included() {
        let disk = CrashBackend::new();
        let log = disk.sibling();
        disk.fail_next(FaultOn::SetLen, Fault::Eio);
        disk.set_len(10).unwrap_err();
        disk.set_len(10).unwrap();
        log.write(0, &[1]).unwrap();
        log.read(5, &mut [0; 1]).unwrap_err(); // past the end
        disk.set_read_only(true);
        log.sync_data().unwrap_err();
        disk.set_read_only(false);
        let counts = disk.io_counts();
        assert_eq!(counts.files(), 2);
        let table: Vec<[u64; 4]> = (0..2)
            .map(|f| FaultOn::ALL.map(|on| counts.get(f, on)))
            .collect();
        assert_eq!(table, [[0, 0, 0, 2], [1, 1, 1, 0]]);
        assert_eq!(counts.total(FaultOn::SetLen), 2);
        assert_eq!(counts.get(9, FaultOn::Read), 0);
        assert_eq!(disk.mutations(), 4);
        let text = counts.to_string();
        assert_eq!(text.lines().count(), 3, "{text}");
        // A restored image starts counting afresh.
        assert_eq!(
            disk.live_image_all()
                .restore()
                .io_counts()
                .total(FaultOn::SetLen),
            0
        );
    }

    /// The planned failure and the one-shot queue work side by side: the
    /// planned one decides first, a one-shot fault waits for a call the
    /// planned one lets through.
    #[test]
    fn fail_next_still_works_beside_an_injection() {
        let b = CrashBackend::new();
        b.fail_next(FaultOn::Write, Fault::Enospc);
        b.inject(plan(Some(0), FaultOn::Write, 1, false));
        assert_eq!(b.write(0, &[1]).unwrap_err().kind(), Fault::Eio.kind());
        assert_eq!(b.write(0, &[1]).unwrap_err().kind(), ErrorKind::StorageFull);
        b.write(0, &[1]).unwrap();
        // nth 0 is read as 1; a new injection replaces the old.
        b.inject(plan(Some(0), FaultOn::Read, 0, false));
        b.inject(plan(Some(0), FaultOn::Read, 2, false));
        b.read(0, &mut [0; 1]).unwrap();
        b.read(0, &mut [0; 1]).unwrap_err();
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
