//! The process-kill test, for any durable backend.
//!
//! A child process (this test binary, re-invoked on one ignored test) runs
//! guarded requests from many threads against a store directory and appends
//! every acknowledged outcome to a ledger file, fsyncing each line before
//! going on. The parent kills the child with SIGKILL at a random moment,
//! reopens the store, and checks the store against the ledger; then starts
//! a new child on the same store, several times.
//!
//! Each execution runs three steps ([`Claim::step`](idemstore::Claim::step)),
//! each an fsynced ledger line (`STEP`), and notes each step that returned
//! (`RECORDED`: its output is durable).
//!
//! What it proves (the durability invariants of docs/design.md): nothing acknowledged
//! is lost — a claim whose handler ran is still held (or was taken over, or
//! completed), a completion acknowledged to a caller is DONE with that
//! response — and no key is executed twice inside one lease. Of the steps:
//! a recorded step never runs again (no `STEP` after its `RECORDED`), no
//! recorded step is lost (a PROCESSING record holds it, a DONE response
//! carries its output), and a step runs twice only when a run died (or
//! failed) inside it.
//!
//! A backend plugs in with one line in its test module:
//! `idemstore_testkit::kill_suite!(open_fn);` where `open_fn: fn(&Path) -> Result<Arc<dyn Store>>`
//! opens the store in the given (existing, initially empty) directory, e.g.
//! `RedbStore::open(dir.join("kill.idem"))` or `SledStore::open(dir)`.
//! The parent also checks that the store is `Error::Locked` to a second
//! process while the child holds it.

use idemstore::Clock;
use idemstore::{Fingerprint, Guard, Key, Outcome, Response, State, Store, SystemClock, Timestamp};
use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a backend opens (or reopens) its store in a directory (or file
/// inside it).
pub type Open = fn(&Path) -> idemstore::Result<Arc<dyn Store>>;

/// Kills per run: each is a full child start, random kill, reopen, check.
/// `IDEMSTORE_KILLS` sets another number (a long run).
const KILLS: usize = 5;
/// The steps of every execution, in order.
const STEPS: [&str; 3] = ["charge", "reserve", "email"];
/// Client threads in the child.
const THREADS: usize = 16;
/// Half the requests go to a few hot keys (retries, replays, in-flight
/// answers, and takeovers of claims a killed child left behind), half to
/// many cold ones (fresh executions).
const HOT_KEYS: u64 = 40;
const COLD_KEYS: u64 = 5_000;
/// Short, so that leases left by a killed child expire during the next one
/// and takeovers happen.
const LEASE: Duration = Duration::from_millis(400);
/// One execution in this many fails (and is taken over after its lease).
const FAIL_ONE_IN: u64 = 6;
/// Longer than the test: nothing expires, so every record stays checkable.
const RETENTION: Duration = Duration::from_secs(3600);
/// A child that is never killed (parent gone) stops on its own after this.
const CHILD_MAX_RUN: Duration = Duration::from_secs(30);
/// The child runs at least this long after its first execution before the
/// random part of the delay, so every kill lands mid-traffic.
const MIN_RUN_AFTER_FIRST_EXEC: Duration = Duration::from_millis(200);

const ENV_DIR: &str = "IDEMSTORE_KILL_DIR";
const ENV_LEDGER: &str = "IDEMSTORE_KILL_LEDGER";

/// Generates, in a backend's test module, the child entry and the test.
///
/// `$open` is an [`Open`]. The test binary re-invokes itself to run the
/// child, so the module must be reachable by its path (a plain `mod` of
/// an integration test is).
///
/// ```no_run
/// use idemstore::{RedbStore, Store};
/// use std::{path::Path, sync::Arc};
///
/// fn open(dir: &Path) -> idemstore::Result<Arc<dyn Store>> {
///     Ok(Arc::new(RedbStore::open(dir.join("kill.idem"))?))
/// }
///
/// idemstore_testkit::kill_suite!(open);
/// # fn main() {}
/// ```
///
/// A store shared by several processes by design (PostgreSQL) is not
/// locked to one: `kill_suite!(open, shared, when: enabled)` skips that
/// check, and runs only when `enabled()` says a server is there.
#[macro_export]
macro_rules! kill_suite {
    ($open:path) => {
        $crate::kill_suite!(@tests $open, true, $crate::conformance::always);
    };
    ($open:path, shared, when: $when:path) => {
        $crate::kill_suite!(@tests $open, false, $when);
    };
    (@tests $open:path, $locked:expr, $when:path) => {
        /// The child side of the kill test; does nothing unless started by it.
        #[test]
        #[ignore = "the kill test's child process; started by acknowledged_outcomes_survive_sigkill"]
        fn kill_child_entry() {
            $crate::kill::child_entry($open);
        }

        /// Kills a child running guarded requests several times; nothing
        /// acknowledged is lost, no key runs twice inside a lease.
        #[test]
        fn acknowledged_outcomes_survive_sigkill() {
            if $when() {
                $crate::kill::run_parent(module_path!(), $open, $locked);
            }
        }
    };
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn seed() -> u64 {
    let t = SystemClock.now().as_millis();
    (t ^ (u64::from(std::process::id()) << 32)) | 1
}

/// The ledger: one line per acknowledged outcome, appended and fsynced
/// before the client moves on.
struct Ledger(Mutex<File>);

impl Ledger {
    fn append(&self, line: &str) {
        let mut f = self.0.lock().unwrap();
        // One write per line: a kill cannot interleave two lines; at worst
        // the last line is cut short, and the parser drops it.
        f.write_all(format!("{line}\n").as_bytes()).unwrap();
        f.sync_data().unwrap();
    }
}

/// The child: runs until killed.
pub fn child_entry(open: Open) {
    let (Some(dir), Some(ledger)) = (std::env::var_os(ENV_DIR), std::env::var_os(ENV_LEDGER))
    else {
        return; // run by hand with --ignored: nothing to do
    };
    let store = open(Path::new(&dir)).unwrap();
    let guard = Guard::builder(store)
        .lease(LEASE)
        .retention(RETENTION)
        .build()
        .unwrap();
    let ledger = Ledger(Mutex::new(
        File::options()
            .append(true)
            .create(true)
            .open(ledger)
            .unwrap(),
    ));
    ledger.append(&format!("START {}", std::process::id()));
    let deadline = Instant::now() + CHILD_MAX_RUN;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (guard, ledger) = (&guard, &ledger);
            s.spawn(move || {
                let mut rng = seed() ^ ((t as u64 + 1) * 0x9E37_79B9_7F4A_7C15);
                while Instant::now() < deadline {
                    let r = xorshift(&mut rng);
                    let n = if r.is_multiple_of(2) {
                        (r >> 1) % HOT_KEYS
                    } else {
                        HOT_KEYS + (r >> 1) % COLD_KEYS
                    };
                    let id = format!("k{n}");
                    let key = Key::new("kill", id.as_str()).unwrap();
                    let pause = Duration::from_micros(xorshift(&mut rng) % 20_000);
                    let fail = xorshift(&mut rng).is_multiple_of(FAIL_ONE_IN);
                    let outcome = guard.run(&key, &Fingerprint::of(&id), |claim| {
                        // The side effects: fsynced lines, written only
                        // after the claim was acknowledged.
                        let token = claim.token();
                        ledger.append(&format!(
                            "EXEC {id} {token} {} {}",
                            claim.lease_until().as_millis(),
                            claim.is_takeover()
                        ));
                        let mut body = format!("done-by-{token}");
                        for (i, name) in STEPS.into_iter().enumerate() {
                            let output = claim.step(name, |_| -> Result<_, BoxError> {
                                ledger.append(&format!("STEP {id} {name} {token}"));
                                std::thread::sleep(pause / 3);
                                Ok(format!("{name}-by-{token}").into_bytes())
                            })?;
                            let output = String::from_utf8_lossy(&output).into_owned();
                            ledger.append(&format!("RECORDED {id} {name} {output}"));
                            body.push_str(&format!("|{output}"));
                            // Some executions fail after a step: the claim
                            // stays PROCESSING until its lease ends, and a
                            // retry takes it over and resumes.
                            if fail && i == 1 {
                                return Err("transient failure".into());
                            }
                        }
                        Ok::<_, BoxError>(Response::new(200, body))
                    });
                    match outcome {
                        Outcome::Executed(r) => ledger.append(&format!("ACK {id} {}", body(&r))),
                        Outcome::Replayed(r) => {
                            ledger.append(&format!("REPLAY {id} {}", body(&r)));
                        }
                        Outcome::InFlight { .. } | Outcome::HandlerFailed(_) => {
                            std::thread::sleep(Duration::from_millis(2));
                        }
                        other => panic!("{id}: unexpected outcome {other:?}"),
                    }
                }
            });
        }
    });
}

fn body(r: &Response) -> String {
    String::from_utf8_lossy(r.body()).into_owned()
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the ledger says about one key.
#[derive(Default, Debug)]
struct KeyLog {
    /// (token, lease_until_ms, takeover) per execution.
    execs: Vec<(u64, u64, bool)>,
    acks: Vec<String>,
    replays: Vec<String>,
    /// Per step name: the token of each run of it, in ledger order.
    step_runs: BTreeMap<String, Vec<u64>>,
    /// Per step name: the output a step call returned (recorded), once
    /// one did, and how many runs there were at that point.
    recorded: BTreeMap<String, (String, usize)>,
}

#[derive(Default, Debug)]
struct Totals {
    starts: usize,
    execs: usize,
    takeovers: usize,
    acks: usize,
    replays: usize,
    steps_run: usize,
    steps_run_again: usize,
}

fn parse(ledger: &Path) -> (BTreeMap<String, KeyLog>, Totals) {
    let text = std::fs::read_to_string(ledger).unwrap_or_default();
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    let mut keys: BTreeMap<String, KeyLog> = BTreeMap::new();
    let mut totals = Totals::default();
    for line in complete.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f.as_slice() {
            ["START", _] => totals.starts += 1,
            ["EXEC", id, token, lease_until, takeover] => {
                let takeover = *takeover == "true";
                totals.execs += 1;
                totals.takeovers += usize::from(takeover);
                keys.entry((*id).to_owned()).or_default().execs.push((
                    token.parse().unwrap(),
                    lease_until.parse().unwrap(),
                    takeover,
                ));
            }
            ["ACK", id, body] => {
                totals.acks += 1;
                keys.entry((*id).to_owned())
                    .or_default()
                    .acks
                    .push((*body).to_owned());
            }
            ["STEP", id, name, token] => {
                totals.steps_run += 1;
                let runs = keys.entry((*id).to_owned()).or_default();
                let runs = runs.step_runs.entry((*name).to_owned()).or_default();
                runs.push(token.parse().unwrap());
                totals.steps_run_again += usize::from(runs.len() > 1);
            }
            ["RECORDED", id, name, output] => {
                let log = keys.entry((*id).to_owned()).or_default();
                let runs = log.step_runs.get(*name).map_or(0, Vec::len);
                let first = log
                    .recorded
                    .entry((*name).to_owned())
                    .or_insert_with(|| ((*output).to_owned(), runs));
                assert_eq!(
                    first.0, *output,
                    "{id}: step {name} returned {output} after it returned {}",
                    first.0
                );
            }
            ["REPLAY", id, body] => {
                totals.replays += 1;
                keys.entry((*id).to_owned())
                    .or_default()
                    .replays
                    .push((*body).to_owned());
            }
            _ => panic!("unparsable ledger line {line:?}"),
        }
    }
    (keys, totals)
}

/// Checks a reopened store against the ledger.
fn check(store: &dyn Store, keys: &BTreeMap<String, KeyLog>, now: Timestamp) {
    let mut all_tokens = HashSet::new();
    for (id, log) in keys {
        let mut execs = log.execs.clone();
        execs.sort_unstable();
        for (token, _, _) in &execs {
            assert!(all_tokens.insert(*token), "token {token} handed out twice");
        }
        // No two executions of a key inside one lease.
        for pair in execs.windows(2) {
            let ((_, prev_until, _), (token, until, takeover)) = (pair[0], pair[1]);
            let started = until - LEASE.as_millis() as u64;
            assert!(
                started >= prev_until,
                "{id}: token {token} executed at {started} inside the lease of the previous owner (until {prev_until})"
            );
            assert!(takeover, "{id}: re-execution {token} was not a takeover");
        }
        let key = Key::new("kill", id.as_str()).unwrap();
        let Some(&(last_exec, _, _)) = execs.last() else {
            assert!(
                log.acks.is_empty() && log.replays.is_empty(),
                "{id}: outcome without execution"
            );
            continue;
        };
        let record = store
            .get(&key, now)
            .unwrap()
            .unwrap_or_else(|| panic!("{id}: acknowledged claim {last_exec} lost"));
        assert!(
            record.token() >= last_exec,
            "{id}: record token {} is older than acknowledged claim {last_exec}",
            record.token()
        );
        check_steps(id, log, &record);
        let done_body = (record.state() == State::Done)
            .then(|| String::from_utf8_lossy(record.response().unwrap().body()).into_owned());
        if let Some(done) = &done_body {
            let by = done.split('|').next().unwrap_or_default();
            let t: u64 = by.trim_start_matches("done-by-").parse().unwrap();
            assert!(
                execs.iter().any(|(token, _, _)| *token == t),
                "{id}: DONE response {done} from an execution not in the ledger"
            );
            assert_eq!(t, last_exec, "{id}: executed again after DONE ({done})");
        }
        for ack in &log.acks {
            assert_eq!(
                done_body.as_ref(),
                Some(ack),
                "{id}: acknowledged completion {ack} lost or changed"
            );
        }
        for replay in &log.replays {
            assert_eq!(
                done_body.as_ref(),
                Some(replay),
                "{id}: replayed {replay} is not the stored response"
            );
        }
    }
}

/// The steps of one key: a recorded step never ran after it was recorded,
/// and is in the record (PROCESSING) or in its response (DONE).
fn check_steps(id: &str, log: &KeyLog, record: &idemstore::Record) {
    for (name, (output, runs_then)) in &log.recorded {
        let runs = log.step_runs.get(name).map_or(0, Vec::len);
        assert_eq!(
            runs, *runs_then,
            "{id}: step {name} ran again after its output {output} was recorded"
        );
        let token: u64 = output
            .rsplit("-by-")
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{id}: step output {output} names no token"));
        assert!(
            log.step_runs.get(name).is_some_and(|t| t.contains(&token)),
            "{id}: step {name} returned {output}, which no run of it made"
        );
        match record.state() {
            State::Processing => assert!(
                record
                    .steps()
                    .iter()
                    .any(|s| s.name() == name && s.output() == output.as_bytes()),
                "{id}: recorded step {name} = {output} lost: the record holds {:?}",
                record.steps()
            ),
            State::Done => {
                let body = String::from_utf8_lossy(record.response().unwrap().body()).into_owned();
                assert!(
                    body.split('|').any(|part| part == output),
                    "{id}: recorded step {name} = {output} is not in the response {body}"
                );
            }
        }
    }
}

/// The parent: `test_module` is the backend's `module_path!()`; `locked`:
/// the store refuses a second process while the child holds it.
pub fn run_parent(test_module: &str, open: Open, locked: bool) {
    let module = test_module
        .split_once("::")
        .map_or(test_module, |(_, rest)| rest);
    let child_test = format!("{module}::kill_child_entry");
    let dir = tempfile::tempdir().unwrap();
    // The directory exists before the first open: a file-based backend
    // opens a file inside it, a directory-based one uses it as is.
    let store_dir = dir.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let ledger = dir.path().join("ledger");
    let stderr_path = dir.path().join("child.stderr");
    let mut rng = seed();
    let mut delays = Vec::new();
    let kills = std::env::var("IDEMSTORE_KILLS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(KILLS);
    for round in 0..kills {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                child_test.as_str(),
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_DIR, &store_dir)
            .env(ENV_LEDGER, &ledger)
            .stdout(Stdio::null())
            .stderr(File::create(&stderr_path).unwrap())
            .spawn()
            .unwrap();
        wait_for_traffic(&ledger, round + 1, &mut child, &stderr_path);
        if locked {
            let second = open(&store_dir).map(|_| ());
            assert!(
                matches!(second, Err(idemstore::Error::Locked { .. })),
                "a second process opened the store the child holds: {second:?}"
            );
        }
        let delay = MIN_RUN_AFTER_FIRST_EXEC + Duration::from_millis(xorshift(&mut rng) % 400);
        delays.push(delay.as_millis());
        std::thread::sleep(delay);
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert!(
            status.code().is_none(),
            "the child exited by itself: {status:?}"
        );
        let store = open(&store_dir).unwrap();
        let (keys, _) = parse(&ledger);
        check(&*store, &keys, SystemClock.now());
    }
    let (_, totals) = parse(&ledger);
    delays.sort_unstable();
    eprintln!(
        "kill test ({module}): {kills} SIGKILLs after {}..={} ms of traffic (median {}); ledger: {} starts, {} executions ({} takeovers), {} acknowledged completions, {} replays; {} steps run, {} of them a second time (a run died or failed inside it)",
        delays.first().unwrap_or(&0),
        delays.last().unwrap_or(&0),
        delays.get(delays.len() / 2).unwrap_or(&0),
        totals.starts,
        totals.execs,
        totals.takeovers,
        totals.acks,
        totals.replays,
        totals.steps_run,
        totals.steps_run_again
    );
    assert!(
        totals.execs > kills,
        "too little traffic to prove anything: {totals:?}"
    );
}

/// Waits until the `round`-th child has started and executed something, so
/// the kill lands in the middle of traffic, not during process start-up.
fn wait_for_traffic(
    ledger: &PathBuf,
    round: usize,
    child: &mut std::process::Child,
    stderr: &Path,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "child exited early ({status:?}):\n{}",
                std::fs::read_to_string(stderr).unwrap_or_default()
            );
        }
        let text = std::fs::read_to_string(ledger).unwrap_or_default();
        let after_start = text
            .match_indices("START ")
            .nth(round - 1)
            .map(|(i, _)| &text[i..]);
        if after_start.is_some_and(|rest| rest.contains("\nEXEC ")) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "child {round} produced no traffic"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
