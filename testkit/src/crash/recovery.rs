//! Power loss under the real `RedbStore`: run a logged workload over a
//! [`CrashBackend`], take crash images along the way, and check each one
//! after reopening it.

use super::backend::{CrashBackend, CrashImage, SyncMode, TornSectors};
use super::rng::Rng;
use super::workload::{Clock, LEASE, RunLog, Slot, Step, T0, describe, run_thread};
use idemstore::Fingerprint;
use idemstore::Key;
use idemstore::RedbStore;
use idemstore::Store;
use idemstore::redb::RecoveryPolicy;
use idemstore::{Begin, Record, State};
use idemstore::{ManualClock, Timestamp};
use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

/// How one run is shaped.
#[derive(Clone, Copy, Debug)]
pub struct RunConfig {
    /// Seeds the steps and the crash images.
    pub seed: u64,
    /// Threads sharing the store (its group commit batches them).
    pub threads: usize,
    /// Steps each thread takes.
    pub steps_per_thread: usize,
    /// Keys each thread owns (at most `MAX_KEYS_PER_THREAD`).
    pub keys_per_thread: u8,
    /// A crash image every this many backend mutations.
    pub stride: u64,
    /// Whether the backend's fsync tells the truth.
    pub sync: SyncMode,
    /// What a sector of the store file (redb's) being written at a crash
    /// reads back as: old or new, or also garbage.
    pub torn_store_file: TornSectors,
    /// The same for the write-ahead log. Set both to
    /// [`TornSectors::Garbage`] for a disk that never writes a sector
    /// atomically.
    pub torn_log: TornSectors,
    /// Leaves out the token high-water-mark check, so that the test of the
    /// test can show the per-key check catches lost writes on its own.
    pub skip_token_check: bool,
    /// How long each step on a key waits between reading the shared clock
    /// and its call: widens the window in which another thread sweeps at a later
    /// time than a step in flight. Zero by default.
    pub step_delay: Duration,
}

/// The write-ahead log size in crash runs: small, so that runs cross many
/// log-full checkpoints.
pub const TEST_WAL_BYTES: u64 = 16 * 1024;

impl Default for RunConfig {
    fn default() -> RunConfig {
        RunConfig {
            seed: 0,
            threads: 4,
            steps_per_thread: 60,
            keys_per_thread: 3,
            stride: 3,
            sync: SyncMode::Honest,
            torn_store_file: TornSectors::OldOrNew,
            torn_log: TornSectors::OldOrNew,
            skip_token_check: false,
            step_delay: Duration::ZERO,
        }
    }
}

/// What runs checked (summed with `+=`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunReport {
    /// Crash images reopened and checked.
    pub crash_points: u64,
    /// Acknowledged writes (claims, completions, releases) that an image
    /// was checked to hold, summed over images.
    pub acked_checked: u64,
    /// Keys whose acknowledged claim was live in an image, on which a new
    /// `begin` after reopening was checked to be `InFlight` (not `Claimed`).
    pub inflight_checked: u64,
    /// Keys whose acknowledged completion was replayed, intact, after reopening.
    pub replays_checked: u64,
    /// Surviving claims taken over at once after a reopen with
    /// `RecoveryPolicy::ExpireLeases`, each with a larger fencing token.
    pub takeovers_checked: u64,
    /// Backend mutations (writes, resizes, fsyncs) the runs made.
    pub mutations: u64,
    /// Crash images taken while the store file was being created.
    pub creation_points: u64,
    /// Of those, the ones the next open refused (`Error::Corrupt`).
    pub creation_refused: u64,
    /// Fresh claims over a record that another thread's sweep, at a later
    /// time, deleted while the claiming step was in flight.
    pub swept_in_flight: u64,
}

impl std::ops::AddAssign for RunReport {
    fn add_assign(&mut self, o: RunReport) {
        self.crash_points += o.crash_points;
        self.acked_checked += o.acked_checked;
        self.inflight_checked += o.inflight_checked;
        self.replays_checked += o.replays_checked;
        self.takeovers_checked += o.takeovers_checked;
        self.mutations += o.mutations;
        self.creation_points += o.creation_points;
        self.creation_refused += o.creation_refused;
        self.swept_in_flight += o.swept_in_flight;
    }
}

/// A crash image that failed its checks, from [`store_run_all_points`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedPoint {
    /// The run's seed ([`RunConfig::seed`]).
    pub run_seed: u64,
    /// Backend mutations that had returned when power was lost.
    pub at: u64,
    /// The image's seed (which unsynced writes survived, which sectors
    /// were garbled).
    pub image_seed: u64,
    /// What the checks found.
    pub error: String,
}

impl std::fmt::Display for FailedPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seed {}: crash at mutation {} (seed {}): {}",
            self.run_seed, self.at, self.image_seed, self.error
        )
    }
}

/// Runs `cfg.threads` threads of seeded steps against one `RedbStore`
/// (group commit, `Durability::Immediate`) over a [`CrashBackend`] that
/// takes a crash image every `cfg.stride` mutations, then checks every
/// image with the checks listed at `check_image`. The first failure is returned as a
/// description with the seed and the crash point.
pub fn store_run(cfg: &RunConfig) -> Result<RunReport, String> {
    let (report, failures) = run_config(cfg, false)?;
    match failures.into_iter().next() {
        Some(failed) => Err(failed.to_string()),
        None => Ok(report),
    }
}

/// [`store_run`], but checking every crash image even after one fails: the
/// report sums the images that passed, and each failed image is listed.
/// `Err` is a failure of the run itself (the store did not open, a thread
/// failed), not of an image.
pub fn store_run_all_points(cfg: &RunConfig) -> Result<(RunReport, Vec<FailedPoint>), String> {
    run_config(cfg, true)
}

fn run_config(cfg: &RunConfig, every_point: bool) -> Result<(RunReport, Vec<FailedPoint>), String> {
    let mut rng = Rng::new(cfg.seed);
    let plans: Vec<Vec<Step>> = (0..cfg.threads)
        .map(|_| {
            (0..cfg.steps_per_thread)
                .map(|_| Step::random(&mut rng))
                .collect()
        })
        .collect();
    let backend = CrashBackend::new();
    backend.set_sync_mode(cfg.sync);
    backend.plan_every(cfg.stride, rng.next_u64());
    // After the plan: an image due at once (mutation 0) is the empty disk
    // as before, with an empty log file.
    set_torn_sectors(&backend, cfg.torn_store_file, cfg.torn_log);
    let checks = Checks {
        tokens: !cfg.skip_token_check,
        every_point,
    };
    let (report, failures) =
        run_and_check(&backend, cfg.keys_per_thread, cfg.step_delay, plans, checks)
            .map_err(|e| format!("seed {}: {e}", cfg.seed))?;
    let failures = failures
        .into_iter()
        .map(|(image, error)| FailedPoint {
            run_seed: cfg.seed,
            at: image.at,
            image_seed: image.seed,
            error,
        })
        .collect();
    Ok((report, failures))
}

/// Sets what sectors being written read back as on `disk`'s store file
/// and on its log (made now, as [`open_disk`] would).
fn set_torn_sectors(disk: &CrashBackend, store_file: TornSectors, log_file: TornSectors) {
    disk.set_file_torn_sectors(store_file);
    disk.file(1)
        .unwrap_or_else(|| disk.sibling())
        .set_file_torn_sectors(log_file);
}

/// One thread's `steps` with crash images at the given `(mutation count,
/// seed)` points (a point past the end is taken after the store closed):
/// the deterministic form the `crash_recovery` fuzz target drives. `torn`
/// is what sectors being written read back as, on the store file and on
/// the log.
pub fn store_run_steps(
    steps: Vec<Step>,
    keys: u8,
    points: &[(u64, u64)],
    sync: SyncMode,
    torn: (TornSectors, TornSectors),
) -> Result<RunReport, String> {
    let backend = CrashBackend::new();
    backend.set_sync_mode(sync);
    backend.plan(points.iter().copied());
    set_torn_sectors(&backend, torn.0, torn.1);
    let checks = Checks {
        tokens: true,
        every_point: false,
    };
    let (report, failures) = run_and_check(&backend, keys, Duration::ZERO, vec![steps], checks)?;
    match failures.into_iter().next() {
        Some((image, e)) => Err(format!(
            "crash at mutation {} (seed {}): {e}",
            image.at, image.seed
        )),
        None => Ok(report),
    }
}

/// Opens a store over `disk` as the crash runs do: its write-ahead log is
/// the disk's second file ([`TEST_WAL_BYTES`] long, so that it fills and
/// checkpoints often; made now if the disk has none yet).
pub(super) fn open_disk(
    builder: idemstore::redb::RedbStoreBuilder,
    disk: &CrashBackend,
) -> idemstore::Result<RedbStore> {
    let file = disk.file(1).unwrap_or_else(|| disk.sibling());
    builder
        .log_bytes(TEST_WAL_BYTES)
        .open_backend(disk.clone(), file)
}

/// Reopens a crash image through `builder`, catching a panic. Returns the
/// store and the restored disk.
fn reopen(
    image: &CrashImage,
    builder: idemstore::redb::RedbStoreBuilder,
) -> Result<(idemstore::Result<RedbStore>, CrashBackend), String> {
    let disk = image.restore();
    let opened = catch_unwind(AssertUnwindSafe(|| open_disk(builder, &disk)))
        .map_err(|_| "RedbStore panicked opening the image".to_owned())?;
    Ok((opened, disk))
}

/// Which optional checks run.
#[derive(Clone, Copy, Debug)]
struct Checks {
    tokens: bool,
    /// Checks every image, listing the failures, instead of stopping at
    /// the first.
    every_point: bool,
}

/// The checks that passed, summed, and each image that failed with why.
type Checked = (RunReport, Vec<(CrashImage, String)>);

fn run_and_check(
    backend: &CrashBackend,
    keys: u8,
    step_delay: Duration,
    plans: Vec<Vec<Step>>,
    checks: Checks,
) -> Result<Checked, String> {
    let store = open_disk(RedbStore::builder(), backend).map_err(|e| format!("open: {e}"))?;
    let opened_at = backend.mutations();
    let clock = Clock::new(step_delay);
    let logs: Vec<Result<RunLog, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = plans
            .into_iter()
            .enumerate()
            .map(|(t, steps)| {
                let (store, clock) = (&store, &clock);
                s.spawn(move || run_thread(store, backend, clock, t, keys, steps))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a thread panicked".into())))
            .collect()
    });
    drop(store); // a clean close is a crash point too
    let mut log = RunLog::default();
    for l in logs {
        let l = l?;
        log.keys.extend(l.keys);
        log.sweeps.extend(l.sweeps);
        log.claims.extend(l.claims);
        log.swept_in_flight += l.swept_in_flight;
    }
    let mut report = RunReport {
        mutations: backend.mutations(),
        swept_in_flight: log.swept_in_flight,
        ..RunReport::default()
    };
    let mut failures = Vec::new();
    for image in backend.take_images() {
        let checked = if image.at < opened_at {
            check_creation_image(&image)
        } else {
            check_image(&image, &log, checks)
        };
        match checked {
            Ok(checked) => report += checked,
            Err(e) => {
                failures.push((image, e));
                if !checks.every_point {
                    break;
                }
            }
        }
    }
    Ok((report, failures))
}

/// A power loss while the store file was being created (before `open`
/// returned): nothing was acknowledged, so nothing can be lost, but the
/// file must not panic the next open. redb writes its magic number last
/// when it creates a file, so a torn creation is a file redb refuses
/// ("magic number mismatch"): the store reports it as a typed error
/// (`Error::Corrupt`) and the file must be removed by hand. Either that or
/// an empty, working store is accepted; the refusals are counted.
fn check_creation_image(image: &CrashImage) -> Result<RunReport, String> {
    let (opened, _) = reopen(image, RedbStore::builder())
        .map_err(|_| "RedbStore panicked opening a half-created file".to_owned())?;
    let refused = match opened {
        Ok(store) => {
            drop(store);
            0
        }
        Err(idemstore::Error::Corrupt { .. }) => 1,
        Err(e) => return Err(format!("a half-created file gave an unexpected error: {e}")),
    };
    Ok(RunReport {
        creation_points: 1,
        creation_refused: refused,
        ..RunReport::default()
    })
}

/// What a reopened store file holds, checked by [`check_store_file`].
struct Found {
    /// Every record, decoded and verified.
    records: BTreeMap<Key, Record>,
    /// The largest fencing token ever handed out.
    token_hwm: u64,
}

/// Checks the store file a `RedbStore` reopened from a crash image left
/// (its log replayed and committed): the library's verifier
/// (`idemstore::redb::admin`) must find nothing at all: not a record that
/// does not verify, nor a token above the high-water mark, nor a record
/// and its expiry-index entry apart, nor redb having had to repair the
/// file. Then the records (by scan) and the token mark (from the facts).
///
/// One check stays here, below the store: the file as the store left it
/// (`disk`'s live image, a power loss right after the reopen) opens with
/// plain redb without a panic or a refusal. The verifier runs on an open
/// store and has no equivalent.
fn check_store_file(store: &RedbStore, disk: &CrashBackend) -> Result<Found, String> {
    let backend = CrashBackend::from_image(disk.live_image());
    let opened = catch_unwind(AssertUnwindSafe(|| {
        redb::Database::builder().create_with_backend(backend)
    }))
    .map_err(|_| "redb panicked opening the image".to_owned())?;
    drop(opened.map_err(|e| format!("redb refused the image: {e}"))?);
    let admin = store.admin();
    let report = admin
        .verify(|_| {})
        .map_err(|e| format!("verify of the reopened store: {e}"))?;
    if !report.is_clean() {
        let listed: Vec<String> = report.problems.iter().map(ToString::to_string).collect();
        return Err(format!(
            "the reopened store does not verify: {} problems: {}",
            report.problem_count,
            listed.join("; ")
        ));
    }
    let token_hwm = admin
        .facts()
        .map_err(|e| format!("facts of the reopened store: {e}"))?
        .token_hwm;
    let mut records = BTreeMap::new();
    let mut failed = None;
    admin
        .scan(|key, record| {
            match (key.decode(), record) {
                (Ok(key), Ok(record)) => {
                    records.insert(key, record);
                }
                (Err(e), _) | (_, Err(e)) => {
                    failed = Some(format!("a record does not verify: {e}"));
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        })
        .map_err(|e| format!("scan of the reopened store: {e}"))?;
    match failed {
        Some(e) => Err(e),
        None => Ok(Found { records, token_hwm }),
    }
}

/// Checks one crash image against what the run acknowledged before it:
///
/// - the image opens (`RedbStore`, and then plain redb) without a panic,
///   and the reopened store verifies clean: redb's integrity check passes
///   without a repair, every record verifies, no token is above the
///   high-water mark, and every record has exactly its expiry-index entry
///   ([`check_store_file`]);
/// - every key holds what its last acknowledged write left, or what the
///   one write in flight on it left (all or nothing), or nothing if a sweep
///   that had started could have deleted the record as expired;
/// - the token high-water mark covers every acknowledged claim (fencing
///   tokens never go back after a crash);
/// - after reopening, a `begin` on a key whose acknowledged claim is still
///   live is `InFlight` with the same lease, never `Claimed`; a key whose
///   acknowledged completion survived replays that response.
fn check_image(image: &CrashImage, log: &RunLog, checks: Checks) -> Result<RunReport, String> {
    let at = image.at;
    // Opening recovers the image (replaying its log, if any, and committing
    // that durably): the store file is then what is checked.
    let (opened, disk) = reopen(image, RedbStore::builder())?;
    let store = opened.map_err(|e| format!("RedbStore refused the image: {e}"))?;
    let found = check_store_file(&store, &disk)?;
    let mut report = RunReport {
        crash_points: 1,
        ..RunReport::default()
    };
    let acked_token = log
        .claims
        .iter()
        .filter(|(acked_at, _)| *acked_at <= at)
        .map(|(_, t)| *t)
        .max();
    if let Some(t) = acked_token.filter(|_| checks.tokens)
        && found.token_hwm < t
    {
        return Err(format!(
            "token high-water mark {} is below acknowledged token {t}",
            found.token_hwm
        ));
    }
    let swept_until = log
        .sweeps
        .iter()
        .filter(|(started, _)| *started <= at)
        .map(|(_, now)| *now)
        .max();
    // Per key: the slot to probe through the reopened store.
    let mut probes = Vec::new();
    for (i, kl) in log.keys.iter().enumerate() {
        let acked = kl
            .history
            .iter()
            .rposition(|e| e.acked_at <= at)
            .unwrap_or(0);
        let record = found.records.get(&kl.key);
        let last = kl.history.get(acked).map(|e| &e.after);
        let next = kl.history.get(acked + 1).map(|e| &e.after);
        let candidates = [last, next];
        let matched = candidates.iter().flatten().find(|s| s.matches(record));
        let swept = record.is_none()
            && candidates.iter().flatten().any(|s| {
                s.expires_at()
                    .is_some_and(|exp| swept_until.is_some_and(|t| t >= exp))
            });
        match matched {
            Some(slot) => probes.push((i, (*slot).clone())),
            None if swept => {}
            None => {
                return Err(format!(
                    "key {}: found {}; last acknowledged write left {last:?}; in flight {next:?}",
                    kl.key,
                    describe(record)
                ));
            }
        }
        report.acked_checked += acked as u64;
    }
    let probes_at = probes
        .iter()
        .filter_map(|(_, slot)| match slot {
            Slot::Live { written_at, .. } => Some(*written_at),
            Slot::Absent => None,
        })
        .max();
    for (i, slot) in probes.iter().cloned() {
        let Some(kl) = log.keys.get(i) else { continue };
        let Slot::Live {
            fp,
            state,
            lease_until,
            response,
            steps,
            written_at,
            ..
        } = slot
        else {
            continue;
        };
        let got = store
            .begin(&kl.key, &fp, written_at, LEASE, kl.retention)
            .map_err(|e| format!("key {}: begin after reopen: {e}", kl.key))?;
        let ok = match (state, &got) {
            // Released with its steps kept: claimed at once, with them.
            (State::Processing, Begin::Claimed(c)) if lease_until == Some(Timestamp::EPOCH) => {
                report.inflight_checked += 1;
                !c.is_takeover() && c.steps() == steps.as_slice()
            }
            (State::Processing, Begin::InFlight { lease_until: l }) => {
                report.inflight_checked += 1;
                Some(*l) == lease_until
            }
            (State::Done, Begin::Replay(r)) => {
                report.replays_checked += 1;
                Some(r) == response.as_ref()
            }
            _ => false,
        };
        if !ok {
            return Err(format!(
                "key {}: {state} record, but a new begin after reopening got {got:?}",
                kl.key
            ));
        }
    }
    // Fencing tokens never go back across a crash: a new claim is above
    // every token acknowledged and every token in the file.
    let floor = acked_token
        .into_iter()
        .chain(found.records.values().map(|r| r.token()))
        .max()
        .unwrap_or(0);
    let fresh = Key::new("crash", "fresh-after-reopen").map_err(|e| e.to_string())?;
    let then = probes_at.unwrap_or(T0);
    match store.begin(&fresh, &Fingerprint::of(b"fresh"), then, LEASE, LEASE) {
        Ok(Begin::Claimed(c)) if c.token() > floor => {}
        other => {
            return Err(format!(
                "a new claim after reopening got {other:?}, floor {floor}"
            ));
        }
    }
    drop(store);
    if image.seed.is_multiple_of(8) {
        report += check_expire_leases(image, log, &probes, then, floor)?;
    }
    Ok(report)
}

/// Reopens the image with [`RecoveryPolicy::ExpireLeases`] at `then`
/// (inside the acknowledged leases): every surviving PROCESSING record is
/// taken over at once by a retry, with a token above `floor` (every token
/// acknowledged or stored), and completed records still replay.
fn check_expire_leases(
    image: &CrashImage,
    log: &RunLog,
    probes: &[(usize, Slot)],
    then: Timestamp,
    floor: u64,
) -> Result<RunReport, String> {
    let builder = RedbStore::builder()
        .recovery(RecoveryPolicy::ExpireLeases)
        .clock(ManualClock::new(then));
    let store = reopen(image, builder)?
        .0
        .map_err(|e| format!("reopen with ExpireLeases: {e}"))?;
    let mut report = RunReport::default();
    let mut last = floor;
    for (i, slot) in probes {
        let (Some(kl), Slot::Live { fp, state, .. }) = (log.keys.get(*i), slot) else {
            continue;
        };
        let got = store
            .begin(&kl.key, fp, then, LEASE, kl.retention)
            .map_err(|e| format!("key {}: begin after ExpireLeases: {e}", kl.key))?;
        match (state, &got) {
            (State::Processing, Begin::Claimed(c)) if c.token() > last => {
                last = c.token();
                report.takeovers_checked += 1;
            }
            (State::Done, Begin::Replay(_)) => {}
            (State::Done, Begin::Claimed(_)) if then >= slot.expires_at().unwrap_or(then) => {}
            _ => {
                return Err(format!(
                    "key {}: {state} record, ExpireLeases reopen, begin got {got:?} (floor {last})",
                    kl.key
                ));
            }
        }
    }
    Ok(report)
}
