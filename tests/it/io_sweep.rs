//! An I/O error at every I/O call of a workload, SQLite's I/O-error tests
//! the model: a clean run of the workload counts the reads, writes, syncs
//! and resizes of each file ([`CrashBackend::io_counts`]); then, for each
//! file, kind of call and `N` up to that count, the workload runs again with
//! the `N`-th such call failing ([`CrashBackend::inject`]), with EIO or
//! ENOSPC, once (transient) or from then on (persistent). At every `N`:
//!
//! - every call returns, promptly, `Ok` or an error of the injected kind
//!   (or the store's poisoned refusal); nothing panics;
//! - on a subset of `N`, the store's threads stay idle after the failure
//!   (no retry loop): under 5 % of one core over an idle interval;
//! - the drop returns within a second;
//! - the files, reopened on a healthy disk (as the program left them, and
//!   as a power loss would), hold every acknowledged write and no write
//!   that was never attempted;
//! - after a transient error, the same store value becomes healthy again
//!   within 2 s and a new claim and completion succeed.
//!
//! The workload: an open that replays a log left by a store never closed,
//! claims and completions, a replay, a manual checkpoint (and, in the
//! `Background` variant, the checkpointer's own on a short interval),
//! `sweep_expired`, `compact`, an inbox batch, and the close.
//!
//! The default test runs a shortened sweep (a few `N` per file and kind);
//! the ignored `..._full` test, or `IDEMSTORE_FULL_SWEEP=1`, runs every
//! `N`. Both print the injection points per file and kind. Each runs in a
//! child process of the test binary, so that the threads whose CPU time is
//! measured are this store's only, and a call that hangs ends with it.

use idemstore::redb::engine::{ReadableTable, TableDefinition, WriteTransaction};
use idemstore::redb::{Delivery, Inbox, Message};
use idemstore::{
    Begin, BoxError, Claim, Error, Fingerprint, Key, ManualClock, RedbStore, Response, State,
    Store, Timestamp,
};
use idemstore_testkit::crash::{CrashBackend, CrashImage, Fault, FaultOn, Injection, IoCounts};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::ControlFlow;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const T0: Timestamp = Timestamp::from_millis(1_760_846_400_000);
const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(3600);
/// The retention of the `e*` records, which the workload's sweep removes.
const SHORT_KEEP: Duration = Duration::from_secs(2);
/// When the workload sweeps: past the `e*` records' expiry, before anyone
/// else's (and before any lease ends).
const SWEEP_AT: Timestamp = Timestamp::from_millis(1_760_846_410_000);
const NO_CHECKPOINT: Duration = Duration::from_secs(3600);
/// The background checkpointer's interval in the `Background` variant.
const SHORT_CHECKPOINT: Duration = Duration::from_millis(2);

/// Longest a single call of the workload may take before it counts as hung
/// (a debug build on a shared machine: generous, and still a hang).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
const DROP_TIMEOUT: Duration = Duration::from_secs(1);
const HEAL_TIMEOUT: Duration = Duration::from_secs(2);
/// The idle interval over which the store's threads' CPU time is measured.
const IDLE_INTERVAL: Duration = Duration::from_millis(500);
/// Most CPU the store's threads may use over it, in percent of the interval.
const IDLE_MAX_PERCENT: u64 = 5;
/// `/proc/*/stat` times are in clock ticks of 1/USER_HZ s; USER_HZ is 100
/// on Linux whatever the kernel's own tick.
const TICK_MS: u64 = 10;

/// The handler's table: message id -> payload.
const APP: TableDefinition<&str, u64> = TableDefinition::new("sweep.app");

/// Marks the child process and names the test it runs.
const CHILD_ENV: &str = "IDEMSTORE_IO_SWEEP_CHILD";
const FULL_ENV: &str = "IDEMSTORE_FULL_SWEEP";

fn key(id: &str) -> Key {
    Key::new("sweep", id).unwrap()
}

fn fp(id: &str) -> Fingerprint {
    Fingerprint::of(id.as_bytes())
}

/// The one response a completion of `id` ever sends: a record holding
/// another one was never written by this workload.
fn response(id: &str) -> Response {
    Response::new(200, format!("r-{id}"))
}

/// How the workload's store is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// Checkpoints only when asked: the calls come in the same order every
    /// run, so `N` names the same call each time.
    Manual,
    /// The checkpointer on a short interval, with pauses for it to run:
    /// its calls interleave with the caller's.
    Background,
}

impl Variant {
    fn interval(self) -> Duration {
        match self {
            Variant::Manual => NO_CHECKPOINT,
            Variant::Background => SHORT_CHECKPOINT,
        }
    }

    fn pause(self) {
        if self == Variant::Background {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn open(variant: Variant, disk: &CrashBackend, log: &CrashBackend) -> idemstore::Result<RedbStore> {
    RedbStore::builder()
        .clock(ManualClock::new(T0))
        .checkpoint_interval(variant.interval())
        .open_backend_with_log(disk.clone(), log.clone())
}

/// Whether the store takes writes. Until the store heals by itself this
/// is "not poisoned".
fn healthy(store: &RedbStore) -> bool {
    !store.is_poisoned()
}

/// What the workload did, for the checks after it: what was attempted and
/// what was acknowledged.
#[derive(Clone, Debug, Default)]
struct Ledger {
    /// Keys a `begin` was called for.
    begun: BTreeSet<String>,
    /// Keys whose `begin` returned `Claimed`.
    claimed: BTreeSet<String>,
    /// Keys a `complete` was called for (with [`response`]).
    sent: BTreeSet<String>,
    /// Keys whose `complete` returned `Ok`.
    completed: BTreeSet<String>,
    /// Inbox messages in a batch that was handed to the inbox.
    offered: BTreeSet<String>,
    /// Inbox messages answered `Handled`.
    handled: BTreeSet<String>,
    /// A sweep was called: the `e*` records may be gone.
    swept: bool,
    /// Errors the calls returned (for the report).
    errors: Vec<String>,
    /// Answers that break the contract.
    wrong: Vec<String>,
}

/// The writes the setup run acknowledged: DONE, DONE with a short
/// retention (swept by the workload), and PROCESSING.
const SETUP_DONE: [&str; 6] = ["s0", "s1", "s2", "s3", "t0", "t1"];
const SETUP_SHORT: [&str; 3] = ["e0", "e1", "e2"];
const SETUP_CLAIMED: [&str; 2] = ["s4", "t2"];

impl Ledger {
    fn after_setup() -> Ledger {
        let mut l = Ledger::default();
        for id in SETUP_DONE.iter().chain(&SETUP_SHORT) {
            for set in [&mut l.begun, &mut l.claimed, &mut l.sent, &mut l.completed] {
                set.insert((*id).to_owned());
            }
        }
        for id in SETUP_CLAIMED {
            l.begun.insert(id.to_owned());
            l.claimed.insert(id.to_owned());
        }
        l
    }
}

/// The files of a store that was never closed: records in the store file
/// (checkpointed) and in the log only, with leases held. Made once, by a
/// run without faults.
fn setup_image() -> &'static CrashImage {
    static IMAGE: OnceLock<CrashImage> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let disk = CrashBackend::new();
        let log = disk.sibling();
        let store = open(Variant::Manual, &disk, &log).unwrap();
        let claim = |id: &str, keep: Duration| match store.begin(
            &key(id),
            &fp(id),
            T0,
            keep.min(LEASE),
            keep,
        ) {
            Ok(Begin::Claimed(c)) => c,
            other => panic!("setup {id}: {other:?}"),
        };
        for (ids, keep) in [(&SETUP_DONE[..4], KEEP), (&SETUP_SHORT[..], SHORT_KEEP)] {
            for id in ids {
                let c = claim(id, keep);
                store
                    .complete(&key(id), &c, &response(id), T0, keep)
                    .unwrap();
            }
        }
        claim("s4", KEEP);
        store.admin().checkpoint().unwrap();
        for id in &SETUP_DONE[4..] {
            let c = claim(id, KEEP);
            store
                .complete(&key(id), &c, &response(id), T0, KEEP)
                .unwrap();
        }
        claim("t2", KEEP);
        // The store is still open: its log holds t0..t2, not checkpointed.
        let image = disk.live_image_all();
        drop(store);
        image
    })
}

/// A store value the workload hands back (its inbox gone).
struct Opened {
    store: Arc<RedbStore>,
}

/// What the workload thread reports.
enum Progress {
    /// The call about to be made (named in a hang's message).
    Call(String),
    /// The workload returned; the store, if the open succeeded.
    Done(Option<Opened>),
    /// It panicked, with the message.
    Panicked(String),
}

/// The fault in force, as the checks of an error see it.
#[derive(Clone, Copy, Debug)]
struct Case {
    variant: Variant,
    injection: Option<Injection>,
}

impl Case {
    fn fault(&self) -> Option<Fault> {
        self.injection.map(|i| i.fault)
    }

    fn transient(&self) -> bool {
        self.injection.is_some_and(|i| !i.persistent)
    }
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.injection {
            None => write!(f, "{:?}, no fault", self.variant),
            Some(i) => write!(
                f,
                "{:?}, file {}, {} #{} {:?} {}",
                self.variant,
                i.file.map_or("any".to_owned(), |f| f.to_string()),
                i.on,
                i.nth,
                i.fault,
                if i.persistent {
                    "persistent"
                } else {
                    "transient"
                }
            ),
        }
    }
}

/// Whether `err` is an error the store may return under `case`'s fault:
/// the injected I/O error with its kind, or the refusal of a poisoned store.
fn error_fits(case: &Case, err: &Error) -> bool {
    let Some(fault) = case.fault() else {
        return false;
    };
    match err {
        Error::Io(e) => e.kind() == fault.kind(),
        Error::Poisoned { .. } => true,
        _ => false,
    }
}

/// Records an error a call returned, and whether it fits.
fn note_err(case: &Case, ledger: &Mutex<Ledger>, call: &str, err: &Error) {
    let mut l = ledger.lock().unwrap();
    l.errors.push(format!("{call}: {err}"));
    if !error_fits(case, err) {
        l.wrong.push(format!(
            "{call}: an error of the wrong kind: {err} ({err:?})"
        ));
    }
}

/// The workload; reports each call before making it, and returns the
/// store for the checks that follow.
fn workload(case: Case, disk: CrashBackend, ledger: Arc<Mutex<Ledger>>, tx: Sender<Progress>) {
    let say = |call: &str| {
        let _ = tx.send(Progress::Call(call.to_owned()));
    };
    let log = disk.file(1).unwrap();
    say("open (replays the log)");
    let store = match open(case.variant, &disk, &log) {
        Ok(store) => store,
        Err(e) => {
            note_err(&case, &ledger, "open", &e);
            if !case.transient() {
                let _ = tx.send(Progress::Done(None));
                return;
            }
            // A failed open commits nothing: once the fault is gone, the
            // same files open.
            say("open again after a transient fault");
            match open(case.variant, &disk, &log) {
                Ok(store) => store,
                Err(e) => {
                    let mut l = ledger.lock().unwrap();
                    l.wrong
                        .push(format!("the open after a transient fault failed: {e}"));
                    drop(l);
                    let _ = tx.send(Progress::Done(None));
                    return;
                }
            }
        }
    };
    let store = Arc::new(store);
    let inbox = Inbox::new(Arc::clone(&store));
    let s = &*store;
    let claim_and_complete = |ids: &[&str], complete: usize| {
        let mut claims: Vec<(String, Claim)> = Vec::new();
        for id in ids {
            say(&format!("begin {id}"));
            ledger.lock().unwrap().begun.insert((*id).to_owned());
            match s.begin(&key(id), &fp(id), T0, LEASE, KEEP) {
                Ok(Begin::Claimed(c)) => {
                    ledger.lock().unwrap().claimed.insert((*id).to_owned());
                    claims.push(((*id).to_owned(), c));
                }
                Ok(other) => ledger
                    .lock()
                    .unwrap()
                    .wrong
                    .push(format!("begin {id} on a new key: {other:?}")),
                Err(e) => note_err(&case, &ledger, &format!("begin {id}"), &e),
            }
        }
        for (id, c) in claims.iter().take(complete) {
            say(&format!("complete {id}"));
            ledger.lock().unwrap().sent.insert(id.clone());
            match s.complete(&key(id), c, &response(id), T0, KEEP) {
                Ok(()) => {
                    ledger.lock().unwrap().completed.insert(id.clone());
                }
                Err(e) => note_err(&case, &ledger, &format!("complete {id}"), &e),
            }
        }
    };
    claim_and_complete(&["c0", "c1", "c2", "c3"], 3);
    say("checkpoint");
    if let Err(e) = s.admin().checkpoint() {
        note_err(&case, &ledger, "checkpoint", &e);
    }
    claim_and_complete(&["d0", "d1", "d2"], 2);
    case.variant.pause();
    // A replay and a read: they need no write, so they answer whenever
    // the data is readable (a fault on anything but reads).
    let readable = case.injection.is_none_or(|i| i.on != FaultOn::Read);
    say("begin s0 (a replay)");
    match s.begin(&key("s0"), &fp("s0"), T0, LEASE, KEEP) {
        Ok(Begin::Replay(r)) if r == response("s0") => {}
        Ok(other) => ledger
            .lock()
            .unwrap()
            .wrong
            .push(format!("begin s0 (DONE): {other:?}")),
        Err(e) => {
            note_err(&case, &ledger, "begin s0 (a replay)", &e);
            if readable {
                ledger
                    .lock()
                    .unwrap()
                    .wrong
                    .push(format!("a replay failed with the data readable: {e}"));
            }
        }
    }
    say("get t0");
    match s.get(&key("t0"), T0) {
        Ok(Some(r)) if r.state() == State::Done && r.response() == Some(&response("t0")) => {}
        Ok(other) => ledger
            .lock()
            .unwrap()
            .wrong
            .push(format!("get t0 (DONE): {other:?}")),
        Err(e) => {
            note_err(&case, &ledger, "get t0", &e);
            if readable {
                ledger
                    .lock()
                    .unwrap()
                    .wrong
                    .push(format!("a get failed with the data readable: {e}"));
            }
        }
    }
    say("sweep_expired");
    ledger.lock().unwrap().swept = true;
    match s.sweep_expired(SWEEP_AT, 100) {
        Ok(n) if n <= SETUP_SHORT.len() => {}
        Ok(n) => ledger.lock().unwrap().wrong.push(format!(
            "sweep_expired removed {n} records, more than expired"
        )),
        Err(e) => note_err(&case, &ledger, "sweep_expired", &e),
    }
    say("compact");
    if let Err(e) = s.compact() {
        note_err(&case, &ledger, "compact", &e);
    }
    say("inbox batch");
    let ids = ["m0", "m1", "m2", "m3"];
    let batch: Vec<Message<u64>> = ids
        .iter()
        .zip(0u64..)
        .map(|(id, n)| Message::new(key(id), fp(id), n))
        .collect();
    ledger
        .lock()
        .unwrap()
        .offered
        .extend(ids.iter().map(|id| (*id).to_owned()));
    let handler = |txn: &WriteTransaction, _: &Claim, m: &Message<u64>| {
        let id = String::from_utf8_lossy(m.key.id()).into_owned();
        txn.open_table(APP)?.insert(id.as_str(), m.payload)?;
        Ok::<_, BoxError>(response(&id))
    };
    match inbox.handle_batch(&batch, handler) {
        Ok(answers) => {
            for (id, answer) in ids.iter().zip(answers) {
                match answer {
                    Ok(Delivery::Handled(r)) if r == response(id) => {
                        ledger.lock().unwrap().handled.insert((*id).to_owned());
                    }
                    Ok(other) => ledger
                        .lock()
                        .unwrap()
                        .wrong
                        .push(format!("inbox {id}: {other:?}")),
                    // The handler's own error (its table write failed):
                    // the injected one, whatever the engine wrapped it in.
                    Err(e) if case.fault().is_some() => {
                        ledger
                            .lock()
                            .unwrap()
                            .errors
                            .push(format!("inbox {id}: {e}"));
                    }
                    Err(e) => ledger
                        .lock()
                        .unwrap()
                        .wrong
                        .push(format!("inbox {id} without a fault: {e}")),
                }
            }
        }
        Err(e) => note_err(&case, &ledger, "inbox batch", &e),
    }
    case.variant.pause();
    claim_and_complete(&["f0"], 1);
    drop(inbox);
    let _ = tx.send(Progress::Done(Some(Opened { store })));
}

/// Runs the workload on a thread, waiting at most [`CALL_TIMEOUT`] for
/// each call. `Err` names the call that hung or the panic.
fn run_workload(
    case: Case,
    disk: &CrashBackend,
    ledger: &Arc<Mutex<Ledger>>,
) -> Result<Option<Opened>, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (disk, ledger) = (disk.clone(), Arc::clone(ledger));
    std::thread::Builder::new()
        .name("io-sweep-workload".to_owned())
        .spawn(move || {
            let panicked = tx.clone();
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| workload(case, disk, ledger, tx))) {
                let _ = panicked.send(Progress::Panicked(panic_message(&*p)));
            }
        })
        .unwrap();
    follow(&rx)
}

fn follow(rx: &Receiver<Progress>) -> Result<Option<Opened>, String> {
    let mut call = "the start".to_owned();
    loop {
        match rx.recv_timeout(CALL_TIMEOUT) {
            Ok(Progress::Call(c)) => call = c,
            Ok(Progress::Done(opened)) => return Ok(opened),
            Ok(Progress::Panicked(m)) => return Err(format!("`{call}` panicked: {m}")),
            Err(RecvTimeoutError::Timeout) => {
                return Err(format!(
                    "`{call}` did not return within {CALL_TIMEOUT:?} (hung)"
                ));
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(format!("the workload thread vanished during `{call}`"));
            }
        }
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// The store's threads: those named `idemstore-redb-*` (the kernel keeps
/// 15 bytes of a name) that are not in `before`.
fn store_threads(before: &BTreeSet<u64>) -> BTreeSet<u64> {
    redb_threads().difference(before).copied().collect()
}

fn redb_threads() -> BTreeSet<u64> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return BTreeSet::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let tid: u64 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        comm.starts_with("idemstore-redb").then_some(tid)
    })
    .collect()
}

/// utime + stime of thread `tid`, in clock ticks (fields 14 and 15 of
/// `/proc/self/task/<tid>/stat`, counted after the `(comm)` field, which
/// may hold spaces).
fn cpu_ticks(tid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split(' ').collect();
    // `rest` starts at field 3 (state): fields 14 and 15 are at 11 and 12.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// The CPU time the threads `tids` use over [`IDLE_INTERVAL`], in ms.
fn idle_cpu_ms(tids: &BTreeSet<u64>) -> u64 {
    let before: BTreeMap<u64, u64> = tids
        .iter()
        .filter_map(|&t| Some((t, cpu_ticks(t)?)))
        .collect();
    std::thread::sleep(IDLE_INTERVAL);
    let used: u64 = before
        .iter()
        .filter_map(|(&t, &b)| Some(cpu_ticks(t)?.saturating_sub(b)))
        .sum();
    used * TICK_MS
}

/// Drops the store on a thread; `Err` when that takes over [`DROP_TIMEOUT`].
fn drop_in_time(opened: Opened) -> Result<(), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let started = Instant::now();
        drop(opened);
        let _ = tx.send(started.elapsed());
    });
    match rx.recv_timeout(DROP_TIMEOUT) {
        Ok(_) => Ok(()),
        Err(_) => Err(format!("the drop did not return within {DROP_TIMEOUT:?}")),
    }
}

/// After a transient fault: the store becomes healthy within
/// [`HEAL_TIMEOUT`], and a new claim and completion succeed on it.
fn heals(opened: &Opened, ledger: &Mutex<Ledger>) -> Result<(), String> {
    let started = Instant::now();
    while !healthy(&opened.store) {
        if started.elapsed() > HEAL_TIMEOUT {
            return Err(format!(
                "not healthy {HEAL_TIMEOUT:?} after a transient fault"
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let id = "h0";
    ledger.lock().unwrap().begun.insert(id.to_owned());
    let claim = match opened.store.begin(&key(id), &fp(id), T0, LEASE, KEEP) {
        Ok(Begin::Claimed(c)) => c,
        other => return Err(format!("healthy, but a new claim is {other:?}")),
    };
    ledger.lock().unwrap().claimed.insert(id.to_owned());
    ledger.lock().unwrap().sent.insert(id.to_owned());
    opened
        .store
        .complete(&key(id), &claim, &response(id), T0, KEEP)
        .map_err(|e| format!("healthy, but a new completion is {e}"))?;
    ledger.lock().unwrap().completed.insert(id.to_owned());
    Ok(())
}

/// Reopens `image` on a disk without faults and checks it against what
/// the workload acknowledged and attempted.
fn check_image(what: &str, image: &CrashImage, ledger: &Ledger) -> Vec<String> {
    let disk = image.restore();
    let store = match open(Variant::Manual, &disk, &disk.file(1).unwrap()) {
        Ok(s) => s,
        Err(e) => return vec![format!("{what}: a healthy copy does not open: {e}")],
    };
    let mut wrong = Vec::new();
    let mut records = BTreeMap::new();
    let scanned = store.admin().scan(|raw, record| {
        let id = raw
            .decode()
            .map(|k| String::from_utf8_lossy(k.id()).into_owned())
            .unwrap_or_else(|e| format!("<{e}>"));
        records.insert(id, record);
        ControlFlow::Continue(())
    });
    if let Err(e) = scanned {
        return vec![format!("{what}: the scan failed: {e}")];
    }
    let inbox = Inbox::new(store);
    let app: BTreeMap<String, u64> = inbox
        .read(|txn| {
            let Ok(t) = txn.open_table(APP) else {
                return Ok::<_, BoxError>(BTreeMap::new());
            };
            t.iter()?
                .map(|e| {
                    let (k, v) = e?;
                    Ok((k.value().to_owned(), v.value()))
                })
                .collect()
        })
        .unwrap_or_default();
    let short = |id: &str| SETUP_SHORT.contains(&id);
    for id in &ledger.claimed {
        let may_be_swept = short(id) && ledger.swept;
        match records.get(id) {
            None if may_be_swept => {}
            None => wrong.push(format!("{what}: the acknowledged claim of {id} is lost")),
            Some(Err(e)) => wrong.push(format!("{what}: {id} does not verify: {e}")),
            Some(Ok(r)) => {
                if ledger.completed.contains(id) && r.state() != State::Done {
                    wrong.push(format!(
                        "{what}: the acknowledged completion of {id} is lost: {:?}",
                        r.state()
                    ));
                }
            }
        }
    }
    for (id, record) in &records {
        let Ok(r) = record else {
            wrong.push(format!("{what}: {id} does not verify"));
            continue;
        };
        let inboxed = ledger.offered.contains(id);
        if !ledger.begun.contains(id) && !inboxed {
            wrong.push(format!("{what}: {id} is there, never begun"));
        }
        if r.state() == State::Done
            && (r.response() != Some(&response(id)) || !(ledger.sent.contains(id) || inboxed))
        {
            wrong.push(format!(
                "{what}: {id} is DONE with {:?}, never sent",
                r.response()
            ));
        }
    }
    for id in &ledger.offered {
        let done = matches!(records.get(id), Some(Ok(r)) if r.state() == State::Done);
        if app.contains_key(id) != done {
            wrong.push(format!(
                "{what}: inbox {id}: the handler's write and the record apart"
            ));
        }
        if ledger.handled.contains(id) && !done {
            wrong.push(format!("{what}: the handled message {id} is lost"));
        }
    }
    if let Some(id) = app.keys().find(|id| !ledger.offered.contains(*id)) {
        wrong.push(format!(
            "{what}: the handler's write of {id}, never offered"
        ));
    }
    wrong
}

/// What a case found: the contract's breaches (empty: it passed), and
/// whether the injected call was reached.
struct Outcome {
    wrong: Vec<String>,
    fired: bool,
}

/// One run of the workload under `case`; with `measure_idle`, the store's
/// threads' CPU time is measured after it.
fn run_case(case: Case, measure_idle: bool) -> Outcome {
    let disk = setup_image().restore();
    let ledger = Arc::new(Mutex::new(Ledger::after_setup()));
    if let Some(i) = case.injection {
        disk.inject(i);
    }
    let before = redb_threads();
    let opened = match run_workload(case, &disk, &ledger) {
        Ok(opened) => opened,
        // A hung or panicked store cannot be checked further (and the
        // hung thread is left behind: the child process ends with it).
        Err(e) => {
            return Outcome {
                wrong: vec![e],
                fired: disk.injected_failures() > 0,
            };
        }
    };
    let mut wrong = std::mem::take(&mut ledger.lock().unwrap().wrong);
    if let Some(opened) = opened {
        if measure_idle {
            let threads = store_threads(&before);
            let used_ms = idle_cpu_ms(&threads);
            let limit_ms = duration_ms(IDLE_INTERVAL) * IDLE_MAX_PERCENT / 100;
            if used_ms >= limit_ms {
                wrong.push(format!(
                    "the store's {} threads used {used_ms} ms of CPU over an idle {IDLE_INTERVAL:?}",
                    threads.len()
                ));
            }
        }
        if case.transient()
            && let Err(e) = heals(&opened, &ledger)
        {
            wrong.push(e);
        }
        if let Err(e) = drop_in_time(opened) {
            // The files may still change: no image is checked.
            wrong.push(e);
            return Outcome {
                wrong,
                fired: disk.injected_failures() > 0,
            };
        }
    }
    let fired = disk.clear_injection() > 0;
    let ledger = ledger.lock().unwrap().clone();
    wrong.extend(check_image("as left", &disk.live_image_all(), &ledger));
    let seed = case.injection.map_or(0, |i| i.nth);
    wrong.extend(check_image(
        "after a power loss",
        &disk.power_loss_all(seed),
        &ledger,
    ));
    Outcome { wrong, fired }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The calls of each kind on each file in a clean run of `variant`.
fn clean_counts(variant: Variant) -> IoCounts {
    let disk = setup_image().restore();
    let ledger = Arc::new(Mutex::new(Ledger::after_setup()));
    let case = Case {
        variant,
        injection: None,
    };
    let opened = run_workload(case, &disk, &ledger)
        .unwrap()
        .expect("a clean open");
    let l = ledger.lock().unwrap().clone();
    assert!(
        l.wrong.is_empty() && l.errors.is_empty(),
        "a clean run: {l:?}"
    );
    assert_eq!(l.handled.len(), 4, "{l:?}");
    drop_in_time(opened).unwrap();
    let counts = disk.io_counts();
    let wrong = check_image("clean", &disk.live_image_all(), &l);
    assert!(wrong.is_empty(), "{wrong:?}");
    counts
}

/// Which `N` a sweep runs, per file and kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Depth {
    /// A few: the first, the last and about four between.
    Short,
    /// Every one.
    Full,
}

/// The `N` of a file and kind with `count` calls, and those of them on
/// which the idle CPU is measured (for persistent faults).
fn points(depth: Depth, count: u64) -> (Vec<u64>, BTreeSet<u64>) {
    let all: Vec<u64> = match depth {
        Depth::Full => (1..=count).collect(),
        Depth::Short => {
            let step = (count / 5).max(1);
            let mut v: Vec<u64> = (1..=count)
                .step_by(usize::try_from(step).unwrap())
                .collect();
            if v.last() != Some(&count) && count > 0 {
                v.push(count);
            }
            v
        }
    };
    let idle: BTreeSet<u64> = match (depth, count) {
        (_, 0) => BTreeSet::new(),
        (Depth::Short, _) => [count.div_ceil(2)].into(),
        (Depth::Full, _) => [1, count.div_ceil(2), count].into(),
    };
    (all, idle)
}

/// The sweep: every variant, file, kind, fault and persistence, at the `N`
/// `depth` picks. Panics with every breach found.
fn sweep(depth: Depth) {
    let started = Instant::now();
    let mut breaches: Vec<String> = Vec::new();
    let mut runs = 0u64;
    let mut unreached = 0u64;
    for variant in [Variant::Manual, Variant::Background] {
        let counts = clean_counts(variant);
        eprintln!(
            "{variant:?}: calls of a clean run (file 0: the store, 1: the write-ahead log)\n{counts}"
        );
        for file in 0..counts.files() {
            for on in FaultOn::ALL {
                let (ns, idle) = points(depth, counts.get(file, on));
                for &nth in &ns {
                    for fault in [Fault::Eio, Fault::Enospc] {
                        for persistent in [false, true] {
                            let case = Case {
                                variant,
                                injection: Some(Injection {
                                    file: Some(file),
                                    on,
                                    nth,
                                    fault,
                                    persistent,
                                }),
                            };
                            // One fault kind per point is enough for the
                            // idle check; EIO is the one that retries.
                            let measure = persistent && fault == Fault::Eio && idle.contains(&nth);
                            let outcome = run_case(case, measure);
                            runs += 1;
                            unreached += u64::from(!outcome.fired);
                            breaches
                                .extend(outcome.wrong.into_iter().map(|w| format!("{case}: {w}")));
                        }
                    }
                }
            }
        }
    }
    eprintln!(
        "{depth:?} sweep: {runs} runs ({unreached} never reached their call) in {:.1?}; {} breaches",
        started.elapsed(),
        breaches.len()
    );
    for b in breaches.iter().take(40) {
        eprintln!("  {b}");
    }
    assert!(
        breaches.is_empty(),
        "{} breaches, the first: {}",
        breaches.len(),
        breaches[0]
    );
}

/// Runs `f` in a child process of this test binary that runs the test
/// `name` alone; the parent passes on its output and its failure.
fn in_child(name: &str, ignored: bool, f: impl FnOnce()) {
    if std::env::var(CHILD_ENV).is_ok_and(|v| v == name) {
        f();
        return;
    }
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"]);
    if ignored {
        cmd.arg("--ignored");
    }
    let out = cmd.env(CHILD_ENV, name).output().unwrap();
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the sweep failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn an_io_error_at_every_call_is_survived_short() {
    let depth = if std::env::var(FULL_ENV).is_ok_and(|v| v == "1") {
        Depth::Full
    } else {
        Depth::Short
    };
    in_child(
        "io_sweep::an_io_error_at_every_call_is_survived_short",
        false,
        || sweep(depth),
    );
}

#[test]
#[ignore = "the full sweep: every N, minutes; the short one runs by default"]
fn an_io_error_at_every_call_is_survived_full() {
    in_child(
        "io_sweep::an_io_error_at_every_call_is_survived_full",
        true,
        || sweep(Depth::Full),
    );
}
