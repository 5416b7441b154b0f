//! A simulated order service under a retry storm.
//!
//! Every order is one intent with one `Idempotency-Key`. Clients double-click,
//! time out and retry, gateways retry, a few clients reuse a key with other
//! parameters, and once the store fails to record a completion. The payment
//! ledger counts every charge; at the end every order must be charged
//! exactly once.
//!
//! The store is a `RedbStore` file on disk. The last phase crashes: a child
//! process runs the storm on the same file and is killed with SIGKILL in the
//! middle of it; the store is reopened, the clients retry every order, and
//! the payment provider's ledger (a file it fsyncs before answering, so it
//! survives the kill) must still show every order charged exactly once.
//!
//! ```text
//! cargo run --release --example retry_storm                 # files in a temp dir
//! cargo run --release --example retry_storm -- --dir DIR    # keep the files in DIR
//! ```

use idemstore::redb::RecoveryPolicy;
use idemstore::{
    Clock, Fingerprint, Guard, Key, Outcome, RedbStore, Response, State, Store, SystemClock,
};
use idemstore_testkit::{FaultyStore, Op};
use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::fs::File;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ORDERS: u64 = 400;
const CLIENT_THREADS: u64 = 16;
const LEASE: Duration = Duration::from_millis(300);
const HANDLER_TIME: Duration = Duration::from_millis(15);
/// Orders of the crash phase (ids after the earlier phases').
const CRASH_ORDERS: u64 = 600;
const CRASH_FIRST: u64 = 10_000;
/// The child is killed once this many charges are in the ledger.
const KILL_AFTER_CHARGES: usize = (CRASH_ORDERS / 3) as usize;
/// How long the parent waits for the child to get that far.
const CHILD_PROGRESS_TIMEOUT: Duration = Duration::from_secs(120);

/// The payment provider: charges are keyed by order, and the provider itself
/// refuses a second charge for the same order (the downstream idempotency key
/// that absorbs a handler that ran twice).
///
/// With a ledger file (the crash phase), every charge request is appended and
/// fsynced before the provider answers, as a real provider's database would
/// make it durable: the file outlives a SIGKILL of the service.
#[derive(Default)]
struct Payments {
    charges: Mutex<BTreeMap<u64, u64>>,
    attempts: AtomicU64,
    ledger: Option<Mutex<File>>,
}

impl Payments {
    /// A provider whose ledger is the file at `path` (appended to, and read
    /// back so that it refuses orders charged before a restart).
    fn durable(path: &Path) -> std::io::Result<Payments> {
        let charges = read_ledger(path)?
            .into_iter()
            .map(|(order, lines)| (order, lines.first().map_or(0, |l| l.cents)))
            .collect();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Payments {
            charges: Mutex::new(charges),
            attempts: AtomicU64::new(0),
            ledger: Some(Mutex::new(file)),
        })
    }

    fn charge(&self, order: u64, cents: u64, token: u64) {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        if let Some(ledger) = &self.ledger {
            let mut file = ledger.lock().unwrap_or_else(|p| p.into_inner());
            // One write() per line: `writeln!` may split a line, and a
            // SIGKILL between the parts would glue it to the next run's line.
            file.write_all(format!("{order} {cents} {token}\n").as_bytes())
                .and_then(|()| file.sync_data())
                .expect("the payment ledger is writable");
        }
        self.charges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(order)
            .or_insert(cents);
    }
}

/// One line of the ledger file: a charge request the provider received.
struct LedgerLine {
    cents: u64,
    token: u64,
}

/// The ledger file as charge requests per order, in the order received.
fn read_ledger(path: &Path) -> std::io::Result<BTreeMap<u64, Vec<LedgerLine>>> {
    let mut out: BTreeMap<u64, Vec<LedgerLine>> = BTreeMap::new();
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for line in std::io::BufReader::new(file).lines() {
        let line = line?;
        let mut fields = line.split(' ').map(str::parse::<u64>);
        // A line cut short by the kill (no fsync returned for it) is not a
        // charge the provider acknowledged.
        if let (Some(Ok(order)), Some(Ok(cents)), Some(Ok(token)), None) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        {
            out.entry(order)
                .or_default()
                .push(LedgerLine { cents, token });
        }
    }
    Ok(out)
}

#[derive(Default)]
struct Tally {
    by_outcome: Mutex<BTreeMap<&'static str, u64>>,
    requests: AtomicU64,
}

impl Tally {
    fn add(&self, outcome: &Outcome<Infallible>) {
        let name = match outcome {
            Outcome::Executed(_) => "executed",
            Outcome::Replayed(_) => "replayed",
            Outcome::InFlight { .. } => "in flight (409)",
            Outcome::Conflicted => "conflicted (422)",
            Outcome::Unavailable(_) => "unavailable (503)",
            Outcome::NotStored { .. } => "executed, not stored",
            _ => "other",
        };
        self.requests.fetch_add(1, Ordering::Relaxed);
        *self
            .by_outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name)
            .or_default() += 1;
    }
}

struct Service<S> {
    guard: Guard<Arc<FaultyStore<S>>>,
    payments: Payments,
    tally: Tally,
    handler_runs: AtomicU64,
}

impl<S: Store + 'static> Service<S> {
    fn order(&self, order: u64, qty: u64) -> Outcome<Infallible> {
        let key = Key::new("shop-1", format!("order-{order}")).expect("ids are short");
        let fp = Fingerprint::of_parts([b"POST /orders".as_slice(), &qty.to_be_bytes()]);
        let out = self.guard.run(&key, &fp, |claim| {
            self.handler_runs.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(HANDLER_TIME);
            self.payments.charge(order, 1000 * qty, claim.token());
            Ok(Response::new(
                201,
                format!("order {order} paid, token {}", claim.token()),
            ))
        });
        self.tally.add(&out);
        out
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["--child", dir] => child_storm(Path::new(dir)),
        ["--dir", dir] => {
            std::fs::create_dir_all(dir)?;
            run(Path::new(dir))
        }
        [] => {
            let dir = tempfile::tempdir()?;
            run(dir.path())
        }
        _ => Err("usage: retry_storm [--dir DIR]".into()),
    }
}

fn store_path(dir: &Path) -> PathBuf {
    dir.join("orders.idem")
}

fn run(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let path = store_path(dir);
    let redb = Arc::new(RedbStore::open(&path)?);
    let store = Arc::new(FaultyStore::new(Arc::clone(&redb)));
    let service = Arc::new(Service {
        guard: Guard::builder(Arc::clone(&store)).lease(LEASE).build()?,
        payments: Payments::default(),
        tally: Tally::default(),
        handler_runs: AtomicU64::new(0),
    });
    println!(
        "retry storm: {ORDERS} orders, {CLIENT_THREADS} client threads, store: RedbStore at {}",
        path.display()
    );

    // Phase 1: the storm. Each client thread owns a slice of the orders and
    // sends each one the way real clients do.
    let threads: Vec<_> = (0..CLIENT_THREADS)
        .map(|t| {
            let service = Arc::clone(&service);
            std::thread::spawn(move || {
                for order in (t..ORDERS).step_by(CLIENT_THREADS as usize) {
                    match order % 4 {
                        // Double click: two identical requests at once.
                        0 => {
                            let s2 = Arc::clone(&service);
                            let twin = std::thread::spawn(move || s2.order(order, 1));
                            service.order(order, 1);
                            let _ = twin.join();
                        }
                        // Client timeout: the client gives up after 5 ms and
                        // retries while the first request still runs.
                        1 => {
                            let s2 = Arc::clone(&service);
                            let first = std::thread::spawn(move || s2.order(order, 1));
                            std::thread::sleep(Duration::from_millis(5));
                            service.order(order, 1);
                            let _ = first.join();
                            service.order(order, 1); // and once more after it finished
                        }
                        // Gateway retries: three more sends after the first answer.
                        2 => {
                            for _ in 0..4 {
                                service.order(order, 1);
                            }
                        }
                        // A buggy client reuses the key with another quantity.
                        _ => {
                            service.order(order, 1);
                            service.order(order, 2);
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| "client thread panicked")?;
    }

    // Phase 2: the store fails to record one completion. The retry inside
    // the lease is refused; after the lease it takes over and runs again,
    // and the payment provider absorbs the second charge.
    let failed_order = ORDERS;
    store.fail_next(Op::Complete, 1);
    let first = service.order(failed_order, 1);
    assert!(matches!(first, Outcome::NotStored { .. }), "{first:?}");
    let inside = service.order(failed_order, 1);
    assert!(matches!(inside, Outcome::InFlight { .. }), "{inside:?}");
    std::thread::sleep(LEASE + Duration::from_millis(20));
    let after = service.order(failed_order, 1);
    assert!(matches!(after, Outcome::Executed(_)), "{after:?}");
    let replay = service.order(failed_order, 1);
    assert!(matches!(replay, Outcome::Replayed(_)), "{replay:?}");

    // Phase 3: the store goes down: every request fails closed.
    store.fail_all();
    let down = service.order(ORDERS + 1, 1);
    assert!(matches!(down, Outcome::Unavailable(_)), "{down:?}");
    store.clear_fault();

    print_report(&service, started.elapsed())?;
    print_store(&redb, &path)?;
    // Close the file: the crash phase's child process opens it next.
    drop((service, store, redb));

    crash_phase(dir, &path)
}

fn print_store(store: &RedbStore, path: &Path) -> std::io::Result<()> {
    let stats = store.stats();
    println!(
        "  store file               {:>8} KiB",
        std::fs::metadata(path)?.len() / 1024
    );
    println!(
        "  group commit             {} writes in {} groups (mean {:.1}, largest {}), {} fsynced log appends, {} checkpoints + {} other durable commits, {} replays on the read fast path",
        stats.requests,
        stats.groups,
        stats.mean_group(),
        stats.largest_group,
        stats.logged_commits,
        stats.checkpoints,
        stats.durable_commits.saturating_sub(stats.checkpoints),
        stats.fast_replays
    );
    if stats.frames_replayed_on_open > 0 {
        println!(
            "  write-ahead log          {} groups replayed at open (acknowledged after the last checkpoint)",
            stats.frames_replayed_on_open
        );
    }
    Ok(())
}

fn crash_key(order: u64) -> Key {
    Key::new("shop-1", format!("order-{order}")).expect("ids are short")
}

/// The child process: the storm on the crash phase's orders, until killed.
fn child_storm(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let store = Arc::new(FaultyStore::new(Arc::new(RedbStore::open(store_path(
        dir,
    ))?)));
    let service = Arc::new(Service {
        guard: Guard::builder(store).lease(LEASE).build()?,
        payments: Payments::durable(&dir.join("payments.log"))?,
        tally: Tally::default(),
        handler_runs: AtomicU64::new(0),
    });
    let threads: Vec<_> = (0..CLIENT_THREADS)
        .map(|t| {
            let service = Arc::clone(&service);
            std::thread::spawn(move || {
                for order in
                    (CRASH_FIRST + t..CRASH_FIRST + CRASH_ORDERS).step_by(CLIENT_THREADS as usize)
                {
                    if order % 2 == 0 {
                        // Double click.
                        let s2 = Arc::clone(&service);
                        let twin = std::thread::spawn(move || s2.order(order, 1));
                        service.order(order, 1);
                        let _ = twin.join();
                    } else {
                        service.order(order, 1);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| "client thread panicked")?;
    }
    Ok(())
}

/// Phase 4: a child process runs the storm on the same store file and is
/// killed with SIGKILL in the middle; the store is reopened and every order
/// is retried until it has an answer.
fn crash_phase(dir: &Path, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let ledger = dir.join("payments.log");
    println!();
    println!(
        "crash phase: {CRASH_ORDERS} orders in a child process, SIGKILL after {KILL_AFTER_CHARGES} charges"
    );
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--child")
        .arg(dir)
        .stdout(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + CHILD_PROGRESS_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            return Err(format!("the child exited before it was killed: {status}").into());
        }
        let charged: usize = read_ledger(&ledger)?.values().map(Vec::len).sum();
        if charged >= KILL_AFTER_CHARGES {
            break;
        }
        if Instant::now() > deadline {
            child.kill()?;
            return Err("the child made no progress".into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill()?; // SIGKILL on Unix: no destructor, no flush, no goodbye
    let status = child.wait()?;
    let at_kill = read_ledger(&ledger)?;
    println!(
        "  killed the child ({status}) with {} orders charged",
        at_kill.len()
    );

    // Reopen. The child is dead, so its PROCESSING claims are too: let a
    // retry take them over at once instead of waiting out the lease.
    let reopen = Instant::now();
    let redb = Arc::new(
        RedbStore::builder()
            .recovery(RecoveryPolicy::ExpireLeases)
            .open(path)?,
    );
    println!(
        "  reopened in {:.1?}: {} leases of the dead process ended",
        reopen.elapsed(),
        redb.stats().leases_expired_on_open
    );
    let now = SystemClock.now();
    let mut done_before = BTreeSet::new();
    for order in CRASH_FIRST..CRASH_FIRST + CRASH_ORDERS {
        if let Some(r) = redb.get(&crash_key(order), now)?
            && r.state() == State::Done
        {
            done_before.insert(order);
        }
    }
    println!("  {} orders were DONE before the kill", done_before.len());

    // The storm resumes: every client retries every order until it has an
    // answer (replayed, or executed now).
    let store = Arc::new(FaultyStore::new(Arc::clone(&redb)));
    let service = Arc::new(Service {
        guard: Guard::builder(store).lease(LEASE).build()?,
        payments: Payments::durable(&ledger)?,
        tally: Tally::default(),
        handler_runs: AtomicU64::new(0),
    });
    let threads: Vec<_> = (0..CLIENT_THREADS)
        .map(|t| {
            let service = Arc::clone(&service);
            std::thread::spawn(move || -> Result<(), String> {
                for order in
                    (CRASH_FIRST + t..CRASH_FIRST + CRASH_ORDERS).step_by(CLIENT_THREADS as usize)
                {
                    loop {
                        match service.order(order, 1) {
                            Outcome::Executed(_) | Outcome::Replayed(_) => break,
                            Outcome::InFlight { .. } => {
                                std::thread::sleep(Duration::from_millis(10))
                            }
                            other => return Err(format!("order {order}: {other:?}")),
                        }
                    }
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| "client thread panicked")??;
    }
    let tally = service.tally.by_outcome.lock().map_err(|_| "poisoned")?;
    println!("  after the restart: {tally:?}");
    drop(tally);
    print_store(&redb, path)?;

    // The ledger: every order charged, exactly once by the provider's
    // dedup; a second charge request only where the kill cut a handler off
    // between the charge and storing its response (a PROCESSING claim,
    // taken over with a higher fencing token), never for an order that was
    // DONE.
    let ledger = read_ledger(&ledger)?;
    let mut problems = Vec::new();
    let mut absorbed = 0u64;
    for order in CRASH_FIRST..CRASH_FIRST + CRASH_ORDERS {
        let lines = ledger.get(&order).map(Vec::as_slice).unwrap_or_default();
        match lines {
            [] => problems.push(format!("order {order} was never charged")),
            [one] if one.cents == 1000 => {}
            [first, rest @ ..] => {
                absorbed += rest.len() as u64;
                if done_before.contains(&order) {
                    problems.push(format!("order {order} was DONE but ran again"));
                }
                if rest
                    .iter()
                    .any(|l| l.token <= first.token || l.cents != first.cents)
                {
                    problems.push(format!("order {order}: a re-run without a higher token"));
                }
                if first.cents != 1000 {
                    problems.push(format!("order {order} charged {} cents", first.cents));
                }
            }
        }
    }
    let expired = redb.stats().leases_expired_on_open;
    if absorbed > expired {
        problems.push(format!(
            "{absorbed} re-runs but only {expired} claims were in flight at the kill"
        ));
    }
    println!();
    println!("ledger after the crash");
    println!("  orders placed            {CRASH_ORDERS:>8}");
    println!(
        "  orders charged           {:>8}",
        ledger.range(CRASH_FIRST..).count()
    );
    println!(
        "  re-runs absorbed         {absorbed:>8}  (handlers cut off by the kill after charging)"
    );
    if problems.is_empty() {
        println!("OK: after SIGKILL and reopen, every order charged exactly once");
        Ok(())
    } else {
        Err(problems.join("; ").into())
    }
}

fn print_report<S: Store>(
    service: &Service<S>,
    elapsed: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    println!();
    println!("{:<24} {:>8}", "outcome", "requests");
    for (name, n) in service
        .tally
        .by_outcome
        .lock()
        .map_err(|_| "poisoned")?
        .iter()
    {
        println!("{name:<24} {n:>8}");
    }
    println!(
        "{:<24} {:>8}",
        "total",
        service.tally.requests.load(Ordering::Relaxed)
    );

    let charges = service.payments.charges.lock().map_err(|_| "poisoned")?;
    let orders_paid = charges.len() as u64;
    let total_cents: u64 = charges.values().sum();
    println!();
    println!("ledger");
    println!("  orders placed            {:>8}", ORDERS + 1);
    println!("  orders charged           {orders_paid:>8}");
    println!(
        "  charge attempts          {:>8}",
        service.payments.attempts.load(Ordering::Relaxed)
    );
    println!(
        "  handler runs             {:>8}",
        service.handler_runs.load(Ordering::Relaxed)
    );
    println!(
        "  total charged            {:>8.2} EUR",
        total_cents as f64 / 100.0
    );
    let stats = service.guard.stats();
    println!("  takeovers                {:>8}", stats.takeovers);
    println!("  elapsed                  {:>8.2?}", elapsed);

    // Every placed order is charged exactly once, for quantity 1; the one
    // handler that ran twice (the failed completion) was absorbed downstream.
    let every_order_once = orders_paid == ORDERS + 1 && charges.values().all(|c| *c == 1000);
    let runs = service.handler_runs.load(Ordering::Relaxed);
    let one_run_per_order_plus_takeover = runs == ORDERS + 2;
    println!();
    if every_order_once && one_run_per_order_plus_takeover {
        println!(
            "OK: every order charged exactly once ({runs} handler runs = {} orders + 1 takeover)",
            ORDERS + 1
        );
        Ok(())
    } else {
        Err(format!("ledger mismatch: {orders_paid} orders charged, {runs} handler runs").into())
    }
}
