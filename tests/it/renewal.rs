//! Lease renewal across a process kill: a child process (this test binary,
//! re-invoked on an ignored test) claims a key through a renewing guard and
//! runs a handler that never ends, writing every lease end it sees to a
//! ledger (fsynced). The parent kills it with SIGKILL after a few renewals,
//! reopens the store and checks that the renewals were durable and that a
//! retry takes over exactly one lease after the last renewal: InFlight a
//! millisecond before the stored lease end, Claimed (a takeover, new token)
//! at it. The `now` of those two calls is given, so nothing here is timed.
//!
//! The sync and async runs, the lease-lost path and the layer's 409 are in
//! the conformance suite (`a_handler_five_leases_long_runs_once`) and
//! `tests/it/tower.rs`.

use idemstore::{
    Begin, Fingerprint, Guard, Key, RedbStore, Response, Store, SystemClock, Timestamp,
};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_millis(600);
const ENV_DIR: &str = "IDEMSTORE_RENEWAL_DIR";

fn key() -> Key {
    Key::new("renewal", "long-job").unwrap()
}

fn fp() -> Fingerprint {
    Fingerprint::of(b"the whole export")
}

/// The child: claims the key and renews its lease until it is killed.
#[test]
#[ignore = "the renewal kill test's child process; started by a_killed_owner_is_taken_over_one_lease_after_its_last_renewal"]
fn renewal_child_entry() {
    let Some(dir) = std::env::var_os(ENV_DIR) else {
        return; // run by hand with --ignored: nothing to do
    };
    let dir = Path::new(&dir);
    let store = RedbStore::open(dir.join("renew.idem")).unwrap();
    let guard = Guard::builder(store)
        .clock(SystemClock)
        .lease(LEASE)
        .build()
        .unwrap();
    let mut ledger = std::fs::File::create(dir.join("ledger")).unwrap();
    let out = guard.run(&key(), &fp(), |claim| {
        let mut seen = Timestamp::EPOCH;
        let stop = Instant::now() + Duration::from_secs(60);
        while Instant::now() < stop {
            let until = claim.lease_until();
            if until != seen {
                writeln!(ledger, "{} {}", claim.token(), until.as_millis()).unwrap();
                ledger.sync_data().unwrap();
                seen = until;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok::<_, std::convert::Infallible>(Response::new(200, "never reached"))
    });
    panic!("the child was not killed: {out:?}");
}

/// `(token, lease end)` per line the child wrote.
fn ledger(dir: &Path) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(dir.join("ledger")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (token, until) = l.split_once(' ')?;
            Some((token.parse().ok()?, until.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_killed_owner_is_taken_over_one_lease_after_its_last_renewal() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args([
            "renewal::renewal_child_entry",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env(ENV_DIR, dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The claim and at least three renewals (a renewal every 200 ms).
    let deadline = Instant::now() + Duration::from_secs(60);
    while ledger(dir.path()).len() < 4 {
        assert!(Instant::now() < deadline, "the child made no renewals");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the child ended on its own"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let seen = ledger(dir.path());
    let (token, claimed_until) = seen[0];
    let (_, last_seen) = *seen.last().unwrap();
    assert!(seen.iter().all(|(t, _)| *t == token), "one claim: {seen:?}");
    assert!(last_seen > claimed_until, "renewed: {seen:?}");

    let store = RedbStore::open(dir.path().join("renew.idem")).unwrap();
    let record = store
        .get(&key(), Timestamp::from_millis(last_seen))
        .unwrap()
        .expect("the claim survived the kill");
    let stored_until = record.lease_until().expect("still PROCESSING");
    assert_eq!(record.token(), token);
    // Every renewal the child saw is durable; one more may have been
    // stored after the child's last line.
    assert!(
        stored_until.as_millis() >= last_seen,
        "stored {stored_until:?}, seen {last_seen}"
    );
    let lease = LEASE.as_millis() as u64;
    assert!(
        stored_until.as_millis() <= last_seen + lease,
        "stored {stored_until:?}, seen {last_seen}"
    );
    // The takeover comes one lease after the last renewal, not after the
    // first claim's lease.
    let before = stored_until - Duration::from_millis(1);
    assert_eq!(
        store.begin(&key(), &fp(), before, LEASE, LEASE).unwrap(),
        Begin::InFlight {
            lease_until: stored_until
        }
    );
    let Begin::Claimed(taken) = store
        .begin(&key(), &fp(), stored_until, LEASE, LEASE)
        .unwrap()
    else {
        panic!("no takeover at the stored lease end");
    };
    assert!(taken.is_takeover() && taken.token() > token);
}
