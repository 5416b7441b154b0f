//! The conformance suite and PostgreSQL-specific tests on `PostgresStore`,
//! against a real server named by `IDEMSTORE_PG_URL`.
//!
//! Start a throwaway server with
//! `dir=$(mktemp -d) && eval "$(scripts/pg-test-cluster start "$dir")"`.
//! Without the variable every test here passes without running and one line
//! says so; under CI (`CI` set) they fail instead, so CI cannot skip them.
//! Each store gets a table of its own, dropped at the end, so the tests run
//! in parallel on one database.

use idemstore::limits::{MAX_STEP_OUTPUT_BYTES, MAX_STEPS, MAX_STEPS_BYTES};
use idemstore::{
    Begin, Error, Fingerprint, Guard, Key, Outcome, PostgresStore, Response, State, Step, Store,
    SystemClock, Timestamp,
};
use idemstore_testkit::conformance::{Subject, T0};
use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Once};
use std::time::{Duration, Instant};

const URL_VAR: &str = "IDEMSTORE_PG_URL";
const SEC: Duration = Duration::from_secs(1);
const HOUR: Duration = Duration::from_secs(3600);

/// The server's URL, or `None` (after one line on stderr) when the tests
/// are to be skipped. Panics under CI without a URL.
pub fn pg_url() -> Option<String> {
    if let Ok(url) = std::env::var(URL_VAR) {
        return Some(url);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI is set but {URL_VAR} is not: the PostgreSQL tests must run in CI \
         (.ci/run starts a server with scripts/pg-test-cluster)"
    );
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        // Written past the test harness's capture, so it shows in a normal run.
        let _ = writeln!(
            std::io::stderr(),
            "PostgreSQL tests are skipped: {URL_VAR} is not set. To run them: \
             dir=$(mktemp -d) && eval \"$(scripts/pg-test-cluster start \"$dir\")\" && \
             cargo test --all-features postgres; scripts/pg-test-cluster stop \"$dir\""
        );
    });
    None
}

pub fn enabled() -> bool {
    pg_url().is_some()
}

/// A table name unique to this process and call.
pub fn fresh_table(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A raw client, for setting up and inspecting what the store cannot.
pub fn raw(url: &str) -> ::postgres::Client {
    ::postgres::Client::connect(url, ::postgres::NoTls).unwrap()
}

/// `url` with the connections' `application_name` set to `app`, so that
/// [`end_connections`] finds them.
pub fn named(url: &str, app: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={app}")
}

/// Has the server end every connection named `app`; how many it ended.
pub fn end_connections(url: &str, app: &str) -> i64 {
    raw(url)
        .query_one(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE application_name = $1) t",
            &[&app],
        )
        .unwrap()
        .get(0)
}

/// Drops its table (and the sequence it owns) when dropped.
pub struct DropTable {
    pub url: String,
    pub table: String,
}

impl Drop for DropTable {
    fn drop(&mut self) {
        if let Ok(mut c) = ::postgres::Client::connect(&self.url, ::postgres::NoTls) {
            let _ = c.batch_execute(&format!("DROP TABLE IF EXISTS \"{}\"", self.table));
        }
    }
}

/// A migrated store on a fresh table, and the guard that drops the table.
pub fn fresh_store(prefix: &str, pool_size: u32) -> (PostgresStore, DropTable) {
    let url = pg_url().expect("checked by the caller");
    let table = fresh_table(prefix);
    let store = PostgresStore::builder()
        .table(&table)
        .max_size(pool_size)
        // Generous: the machine running the tests may be busy.
        .connect_timeout(Duration::from_secs(30))
        .build_timeout(Duration::from_secs(60))
        .migrate_on_build(true)
        .connect(&url)
        .unwrap();
    (store, DropTable { url, table })
}

fn subject() -> Subject {
    let (store, drop_table) = fresh_store("conf", 8);
    Subject::new(store, drop_table)
}

idemstore_testkit::conformance!(subject, when: enabled);

/// The kill test's store: a table named after the test's directory, so
/// the parent and each child it starts (and kills) share it.
fn open_for_kill(dir: &std::path::Path) -> idemstore::Result<Arc<dyn Store>> {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    let url = pg_url().expect("checked by enabled()");
    let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(dir);
    let store = PostgresStore::builder()
        .table(format!("kill_{hash:016x}"))
        .connect_timeout(Duration::from_secs(30))
        .build_timeout(Duration::from_secs(60))
        .migrate_on_build(true)
        .connect(&url)?;
    Ok(Arc::new(store))
}

idemstore_testkit::kill_suite!(open_for_kill, shared, when: enabled);

pub fn key(id: &str) -> Key {
    Key::new("pg", id).unwrap()
}

pub fn claimed(b: Begin) -> idemstore::Claim {
    match b {
        Begin::Claimed(c) => c,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

#[test]
fn migrate_twice_keeps_records_and_tokens_survive_reconnect() {
    let Some(url) = pg_url() else { return };
    let (store, guard) = fresh_store("twice", 2);
    let c = claimed(
        store
            .begin(&key("a"), &Fingerprint::of(b"a"), T0, SEC, HOUR)
            .unwrap(),
    );
    store
        .complete(&key("a"), &c, &Response::new(201, "paid"), T0, HOUR)
        .unwrap();
    store.migrate().unwrap();
    drop(store);
    // A new store on the same table (a restarted replica) sees the record
    // and hands out larger tokens.
    let again = PostgresStore::builder()
        .table(&guard.table)
        .connect(&url)
        .unwrap();
    again.migrate().unwrap();
    assert_eq!(
        again
            .begin(&key("a"), &Fingerprint::of(b"a"), T0, SEC, HOUR)
            .unwrap(),
        Begin::Replay(Response::new(201, "paid"))
    );
    let next = claimed(
        again
            .begin(&key("b"), &Fingerprint::of(b"b"), T0, SEC, HOUR)
            .unwrap(),
    );
    assert!(next.token() > c.token());
}

/// A table of the same name that someone else created must be refused at
/// connect and by migrate, and left as it was.
#[test]
fn foreign_or_newer_table_is_a_typed_error() {
    let Some(url) = pg_url() else { return };
    let table = fresh_table("foreign");
    let _drop = DropTable {
        url: url.clone(),
        table: table.clone(),
    };
    let mut client = raw(&url);
    client
        .batch_execute(&format!(
            "CREATE TABLE \"{table}\" (scope bytea, id bytea); INSERT INTO \"{table}\" VALUES ('a', 'b')"
        ))
        .unwrap();
    let err = PostgresStore::builder()
        .table(&table)
        .connect(&url)
        .unwrap_err();
    assert!(
        matches!(&err, Error::Corrupt { key: None, detail } if detail.contains("not an idemstore table")),
        "{err}"
    );
    let count: i64 = client
        .query_one(&format!("SELECT count(*) FROM \"{table}\""), &[])
        .unwrap()
        .get(0);
    assert_eq!(count, 1, "the foreign table is untouched");

    // Our table, marked by a newer schema version.
    client
        .batch_execute(&format!(
            "COMMENT ON TABLE \"{table}\" IS 'idemstore records, schema version 7'"
        ))
        .unwrap();
    let err = PostgresStore::builder()
        .table(&table)
        .connect(&url)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnsupportedFormat {
                found: 7,
                supported: 4
            }
        ),
        "{err}"
    );

    // A store built before its table was replaced by a foreign one:
    // migrate refuses it.
    let (store, later) = fresh_store("foreign_later", 1);
    client
        .batch_execute(&format!(
            "DROP TABLE \"{0}\"; CREATE TABLE \"{0}\" (x int)",
            later.table
        ))
        .unwrap();
    assert!(matches!(store.migrate(), Err(Error::Corrupt { .. })));
    // So does a store built with migrate_on_build.
    let err = PostgresStore::builder()
        .table(&later.table)
        .migrate_on_build(true)
        .connect(&url)
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
}

/// A table of an older schema version (made by pre-release builds: 1,
/// every record invariant a CHECK constraint; 2, no step columns; 3, the
/// key in the expiry index) is
/// refused at build and by `migrate`, with the version found and the
/// version this build reads; its rows are left as they are.
#[test]
fn an_older_version_table_is_refused_and_left_as_it_is() {
    let Some(url) = pg_url() else { return };
    for old in [1u32, 2, 3] {
        let (store, names) = fresh_store("old", 1);
        let table = names.table.clone();
        let fp = Fingerprint::of(b"a");
        let first = claimed(store.begin(&key("a"), &fp, T0, SEC, HOUR).unwrap());
        store
            .complete(&key("a"), &first, &Response::new(201, "one"), T0, HOUR)
            .unwrap();
        drop(store);
        let mut client = raw(&url);
        client
            .batch_execute(&format!(
                "COMMENT ON TABLE \"{table}\" IS 'idemstore records, schema version {old}'"
            ))
            .unwrap();
        let refused = |e: &Error| matches!(e, Error::UnsupportedFormat { found, supported: 4 } if *found == old);
        let err = PostgresStore::builder()
            .table(&table)
            .connect(&url)
            .unwrap_err();
        assert!(refused(&err), "{err}");
        let text = err.to_string();
        assert!(
            text.contains(&format!("version {old}")) && text.contains("version 4"),
            "names both versions: {text}"
        );
        let err = PostgresStore::builder()
            .table(&table)
            .migrate_on_build(true)
            .connect(&url)
            .unwrap_err();
        assert!(refused(&err), "{err}");
        let (rows, comment): (i64, String) = {
            let row = client
                .query_one(
                    &format!(
                        "SELECT (SELECT count(*) FROM \"{table}\"), \
                         obj_description(to_regclass($1), 'pg_class')"
                    ),
                    &[&format!("\"{table}\"")],
                )
                .unwrap();
            (row.get(0), row.get(1))
        };
        assert_eq!(rows, 1, "the rows are left as they are");
        assert_eq!(comment, format!("idemstore records, schema version {old}"));
    }
}

/// Regression: a store built on a table nobody had created built fine, and
/// then every call was a transient `Error::Backend` (503 for every request)
/// instead of an error at start-up.
#[test]
fn build_refuses_a_missing_table_unless_it_migrates() {
    let Some(url) = pg_url() else { return };
    let table = fresh_table("unmigrated");
    let _drop = DropTable {
        url: url.clone(),
        table: table.clone(),
    };
    let err = PostgresStore::builder()
        .table(&table)
        .connect(&url)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(!err.is_transient());
    assert!(err.to_string().contains("migrate_on_build(true)"), "{err}");
    let store = PostgresStore::builder()
        .table(&table)
        .migrate_on_build(true)
        .connect(&url)
        .unwrap();
    let fp = Fingerprint::of(b"a");
    let _ = claimed(store.begin(&key("a"), &fp, T0, SEC, HOUR).unwrap());
    // Dropped behind the store's back: calls say what to do.
    raw(&url)
        .batch_execute(&format!("DROP TABLE \"{table}\""))
        .unwrap();
    let err = store.begin(&key("b"), &fp, T0, SEC, HOUR).unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err}");
    assert!(err.to_string().contains("migrate()"), "{err}");
}

/// Many threads on few keys, twice (fresh keys, then after the lease runs
/// out): exactly one Claimed per key per lease, the rest InFlight.
#[test]
fn many_threads_few_keys_one_claim_per_key_per_lease() {
    if !enabled() {
        return;
    }
    const THREADS: usize = 24;
    const KEYS: usize = 3;
    let (store, _drop) = fresh_store("stress", 12);
    let store = Arc::new(store);
    let fp = Fingerprint::of(b"same request");
    for (round, now) in [(0, T0), (1, T0 + SEC)] {
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    barrier.wait();
                    (0..KEYS)
                        .map(|k| {
                            store
                                .begin(&key(&format!("k{k}")), &fp, now, SEC, HOUR)
                                .unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut claims: HashMap<usize, Vec<idemstore::Claim>> = HashMap::new();
        for h in handles {
            for (k, answer) in h.join().unwrap().into_iter().enumerate() {
                match answer {
                    Begin::Claimed(c) => claims.entry(k).or_default().push(c),
                    Begin::InFlight { lease_until } => assert_eq!(lease_until, now + SEC),
                    other => panic!("round {round}: unexpected {other:?}"),
                }
            }
        }
        for k in 0..KEYS {
            let list = claims.get(&k).map_or(&[][..], Vec::as_slice);
            assert_eq!(list.len(), 1, "round {round}, key {k}: {list:?}");
            assert_eq!(list[0].is_takeover(), round == 1);
        }
    }
}

/// Another replica's claim of "k" in `tx`, not yet committed: token 1000,
/// its lease until `T0 + 10 s`.
fn claim_uncommitted(tx: &mut ::postgres::Transaction<'_>, table: &str, fp: &Fingerprint) {
    tx.execute(
        &format!(
            "INSERT INTO \"{table}\" (scope, id, fingerprint, state, lease_until, expires_at, created_at, token, attempts)
             VALUES ($1, $2, $3, 1, $4, $5, $6, 1000, 1)"
        ),
        &[
            &key("k").scope(),
            &key("k").id(),
            &&fp.as_bytes()[..],
            &((T0 + 10 * SEC).as_millis() as i64),
            &((T0 + HOUR).as_millis() as i64),
            &(T0.as_millis() as i64),
        ],
    )
    .unwrap();
}

/// The plain claim of a fresh key, which a blocking begin on an idle
/// store tries first, racing another replica's uncommitted claim of the
/// same key: it waits on the conflict, writes nothing once that commits,
/// and the full statement then answers from the committed row.
#[test]
fn a_fresh_claim_racing_an_uncommitted_insert_answers_from_the_committed_row() {
    let Some(url) = pg_url() else { return };
    let (store, guard) = fresh_store("freshrace", 2);
    let store = Arc::new(store);
    let fp = Fingerprint::of(b"a");
    // A fresh claim: the store prepares the plain claim, and tries it first.
    let _ = claimed(store.begin(&key("warm"), &fp, T0, SEC, HOUR).unwrap());
    let table = &guard.table;
    let mut other = raw(&url);
    let mut tx = other.transaction().unwrap();
    claim_uncommitted(&mut tx, table, &fp);
    let racing = {
        let store = Arc::clone(&store);
        std::thread::spawn(move || store.begin(&key("k"), &fp, T0 + SEC, SEC, HOUR))
    };
    wait_for_lock_waiter(&url, "idemstore");
    let lane_calls = store.stats().caller_driven_calls;
    tx.commit().unwrap();
    assert_eq!(
        racing.join().unwrap().unwrap(),
        Begin::InFlight {
            lease_until: T0 + 10 * SEC
        }
    );
    assert!(
        store.stats().caller_driven_calls > lane_calls,
        "on the lane"
    );
    // Its token was never handed out: the other replica's claim stands.
    let stored = store.get(&key("k"), T0 + SEC).unwrap().expect("the row");
    assert_eq!(stored.token(), 1000);
    // And a fresh key after it is claimed as before.
    let _ = claimed(store.begin(&key("next"), &fp, T0, SEC, HOUR).unwrap());
}

/// The race the retry exists for: a begin whose statement started before
/// another transaction committed the key waits on the conflict, then sees
/// no row in its snapshot. It must run again and answer from the committed
/// row, not fail and not claim.
#[test]
fn begin_racing_an_uncommitted_insert_answers_from_the_committed_row() {
    let Some(url) = pg_url() else { return };
    let (store, guard) = fresh_store("snapshot", 2);
    let store = Arc::new(store);
    let fp = Fingerprint::of(b"a");
    // Claim a key once so the store has prepared its statement: the
    // begin below then blocks inside the one statement we mean to test.
    // The second begin finds the key taken, so the store's next begins run
    // the full statement first, not the plain claim of a fresh key (see
    // `a_fresh_claim_racing_an_uncommitted_insert_answers_from_the_committed_row`).
    let _ = claimed(store.begin(&key("warm"), &fp, T0, SEC, HOUR).unwrap());
    assert!(matches!(
        store.begin(&key("warm"), &fp, T0, SEC, HOUR).unwrap(),
        Begin::InFlight { .. }
    ));
    let table = &guard.table;
    let mut other = raw(&url);
    let mut tx = other.transaction().unwrap();
    claim_uncommitted(&mut tx, table, &fp);
    let racing = {
        let store = Arc::clone(&store);
        std::thread::spawn(move || store.begin(&key("k"), &fp, T0 + SEC, SEC, HOUR))
    };
    wait_for_lock_waiter(&url, "idemstore");
    let retries = store.stats().snapshot_retries;
    tx.commit().unwrap();
    let answer = racing.join().unwrap().unwrap();
    assert!(store.stats().snapshot_retries > retries);
    assert_eq!(
        answer,
        Begin::InFlight {
            lease_until: T0 + 10 * SEC
        }
    );

    // The same with an update: the other replica takes over an expired
    // lease of "t"; our statement's snapshot still shows the expired lease.
    let _ = claimed(store.begin(&key("t"), &fp, T0, SEC, HOUR).unwrap());
    let mut tx = other.transaction().unwrap();
    tx.execute(
        &format!(
            "UPDATE \"{table}\" SET token = 2000, attempts = 2, lease_until = $3 WHERE scope = $1 AND id = $2"
        ),
        &[
            &key("t").scope(),
            &key("t").id(),
            &((T0 + 20 * SEC).as_millis() as i64),
        ],
    )
    .unwrap();
    let racing = {
        let store = Arc::clone(&store);
        std::thread::spawn(move || store.begin(&key("t"), &fp, T0 + 5 * SEC, SEC, HOUR))
    };
    wait_for_lock_waiter(&url, "idemstore");
    tx.commit().unwrap();
    assert_eq!(
        racing.join().unwrap().unwrap(),
        Begin::InFlight {
            lease_until: T0 + 20 * SEC
        }
    );
}

/// Replay, InFlight and Conflict answers are reads: they must not lock the
/// row (a lock sets the row's xmax, takes a transaction id and makes the
/// commit flush the WAL, an fsync per retried request).
#[test]
fn answers_that_claim_nothing_lock_nothing() {
    let Some(url) = pg_url() else { return };
    let (store, guard) = fresh_store("readonly", 2);
    let fp = Fingerprint::of(b"a");
    let xmax = |id: &str| -> String {
        raw(&url)
            .query_one(
                &format!(
                    "SELECT xmax::text FROM \"{}\" WHERE scope = $1 AND id = $2",
                    guard.table
                ),
                &[&key(id).scope(), &key(id).id()],
            )
            .unwrap()
            .get(0)
    };
    let done = claimed(store.begin(&key("done"), &fp, T0, SEC, HOUR).unwrap());
    store
        .complete(&key("done"), &done, &Response::new(200, "x"), T0, HOUR)
        .unwrap();
    let _busy = claimed(store.begin(&key("busy"), &fp, T0, SEC, HOUR).unwrap());
    let (done_xmax, busy_xmax) = (xmax("done"), xmax("busy"));
    for _ in 0..3 {
        assert!(matches!(
            store.begin(&key("done"), &fp, T0, SEC, HOUR).unwrap(),
            Begin::Replay(_)
        ));
        assert!(matches!(
            store.begin(&key("busy"), &fp, T0, SEC, HOUR).unwrap(),
            Begin::InFlight { .. }
        ));
        assert_eq!(
            store
                .begin(&key("busy"), &Fingerprint::of(b"b"), T0, SEC, HOUR)
                .unwrap(),
            Begin::Conflict
        );
    }
    assert_eq!(xmax("done"), done_xmax, "a replay locked the row");
    assert_eq!(
        xmax("busy"),
        busy_xmax,
        "an InFlight or Conflict locked the row"
    );
}

/// Replicas sweep the same table at once: every expired record is deleted
/// exactly once (rows another sweeper holds are skipped, not waited for or
/// counted twice), and live records stay.
#[test]
fn concurrent_sweepers_delete_each_expired_record_once() {
    if !enabled() {
        return;
    }
    const EXPIRED: usize = 300;
    let (store, _drop) = fresh_store("sweepers", 8);
    let store = Arc::new(store);
    let fp = Fingerprint::of(b"a");
    for i in 0..EXPIRED {
        let _ = claimed(
            store
                .begin(&key(&format!("old-{i}")), &fp, T0, SEC, SEC)
                .unwrap(),
        );
    }
    let _ = claimed(store.begin(&key("live"), &fp, T0, SEC, HOUR).unwrap());
    let later = T0 + 2 * SEC;
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let mut total = 0;
                loop {
                    let n = store.sweep_expired(later, 7).unwrap();
                    assert!(n <= 7);
                    total += n;
                    if n == 0 {
                        return total;
                    }
                }
            })
        })
        .collect();
    let swept: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(swept, EXPIRED);
    assert_eq!(store.sweep_expired(later, 100).unwrap(), 0);
    assert!(store.get(&key("live"), later).unwrap().is_some());
}

/// After a server restart or failover every idle pooled connection is dead:
/// every call must move on to a new connection instead of failing once per
/// pooled connection (and a completion must not be lost to one).
#[test]
fn calls_survive_the_server_ending_pooled_connections() {
    let Some(url) = pg_url() else { return };
    let (_, guard) = fresh_store("terminated", 1);
    let app = fresh_table("idemstore_terminated");
    let store = Arc::new(
        PostgresStore::builder()
            .table(&guard.table)
            .max_size(4)
            .connect(&named(&url, &app))
            .unwrap(),
    );
    let fp = Fingerprint::of(b"a");
    let to_complete = claimed(store.begin(&key("c"), &fp, T0, SEC, HOUR).unwrap());
    let to_release = claimed(store.begin(&key("r"), &fp, T0, SEC, HOUR).unwrap());
    // Opens all four connections, then has the server end them.
    let warm_and_end = || {
        let barrier = Arc::new(Barrier::new(4));
        let warm: Vec<_> = (0..4)
            .map(|i| {
                let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    barrier.wait();
                    for j in 0..20 {
                        let _ = store.get(&key(&format!("w{i}-{j}")), T0).unwrap();
                    }
                })
            })
            .collect();
        for h in warm {
            h.join().unwrap();
        }
        assert!(
            end_connections(&url, &app) >= 1,
            "no pooled connection to end"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    warm_and_end();
    store
        .complete(&key("c"), &to_complete, &Response::new(200, "ok"), T0, HOUR)
        .unwrap();
    warm_and_end();
    store.release(&key("r"), &to_release).unwrap();
    warm_and_end();
    assert_eq!(
        store.begin(&key("c"), &fp, T0, SEC, HOUR).unwrap(),
        Begin::Replay(Response::new(200, "ok"))
    );
    warm_and_end();
    assert!(store.get(&key("r"), T0).unwrap().is_none());
    warm_and_end();
    assert_eq!(store.sweep_expired(T0, 10).unwrap(), 0);
}

/// Regression: records with the same expiry were swept in whatever order
/// the index scan gave, while the other stores (and the model the property
/// test checks against) sweep ties in key order; the model test caught a
/// sweep of 1 that deleted "k2" where the model deleted "k1".
#[test]
fn sweep_breaks_expiry_ties_in_key_order() {
    if !enabled() {
        return;
    }
    let (store, _drop) = fresh_store("ties", 2);
    let fp = Fingerprint::of(b"a");
    for id in ["k3", "k1", "k2"] {
        let _ = claimed(store.begin(&key(id), &fp, T0, SEC, SEC).unwrap());
    }
    let later = T0 + SEC;
    for (n, gone) in ["k1", "k2", "k3"].into_iter().enumerate() {
        assert_eq!(store.sweep_expired(later, 1).unwrap(), 1);
        assert!(store.get(&key(gone), T0).unwrap().is_none(), "sweep {n}");
    }
}

/// Waits until some connection named `app` (`idemstore` unless the URL
/// names it otherwise) is blocked on a lock.
pub fn wait_for_lock_waiter(url: &str, app: &str) {
    let mut c = raw(url);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE application_name = $1 AND wait_event_type = 'Lock'",
                &[&app],
            )
            .unwrap()
            .get(0);
        if waiting > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "no call of {app} ever blocked");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// With every connection busy (one, stuck behind a lock) a call fails with a
/// typed error after the connect timeout instead of hanging; a statement
/// stuck behind a lock fails at the statement timeout.
#[test]
fn pool_exhaustion_and_stuck_statements_are_typed_errors() {
    let Some(url) = pg_url() else { return };
    let (_, guard) = fresh_store("exhaust", 1);
    let store = Arc::new(
        PostgresStore::builder()
            .table(&guard.table)
            .max_size(1)
            .connect_timeout(Duration::from_millis(300))
            .statement_timeout(Duration::from_secs(2))
            .connect(&url)
            .unwrap(),
    );
    let fp = Fingerprint::of(b"a");
    let _ = claimed(store.begin(&key("k"), &fp, T0, SEC, HOUR).unwrap());
    let mut other = raw(&url);
    let mut tx = other.transaction().unwrap();
    tx.execute(
        &format!(
            "SELECT 1 FROM \"{}\" WHERE scope = $1 AND id = $2 FOR UPDATE",
            guard.table
        ),
        &[&key("k").scope(), &key("k").id()],
    )
    .unwrap();
    let stuck = {
        let store = Arc::clone(&store);
        // The lease has run out: this begin wants to take over and waits
        // for the row lock, holding the pool's only connection.
        std::thread::spawn(move || store.begin(&key("k"), &fp, T0 + 2 * SEC, SEC, HOUR))
    };
    wait_for_lock_waiter(&url, "idemstore");
    let waits = store.stats().pool_waits;
    let err = store.get(&key("other"), T0).unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err}");
    assert!(err.to_string().contains("connect timeout"), "{err}");
    assert_eq!(store.stats().pool_waits, waits + 1);
    let err = stuck.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err}");
    assert!(err.to_string().contains("statement timeout"), "{err}");
    tx.rollback().unwrap();
    // The connection is usable again.
    assert!(matches!(
        store
            .begin(&key("k"), &fp, T0 + 2 * SEC, SEC, HOUR)
            .unwrap(),
        Begin::Claimed(_)
    ));
}

/// A server that is not there (nothing listening), or that accepts the
/// connection and never answers, is a typed error within the connect
/// timeout, not a hang.
#[test]
fn server_down_is_a_typed_error() {
    if !enabled() {
        return;
    }
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = PostgresStore::builder()
        .connect_timeout(Duration::from_millis(500))
        .connect(&format!("postgres://u@127.0.0.1:{closed}/db"))
        .unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err}");
    assert!(err.is_transient());

    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let started = Instant::now();
    let err = PostgresStore::builder()
        .connect_timeout(Duration::from_millis(500))
        .connect(&format!("postgres://u@127.0.0.1:{port}/db"))
        .unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err}");
    // Not a timing assertion on performance: a hang would never get here,
    // and a bound far above the timeout says the timeout is what ended it.
    assert!(started.elapsed() < Duration::from_secs(20));

    // The build timeout bounds the whole build, whatever the connect timeout.
    let started = Instant::now();
    let err = PostgresStore::builder()
        .connect_timeout(Duration::from_secs(120))
        .build_timeout(Duration::from_millis(300))
        .connect(&format!("postgres://u@127.0.0.1:{port}/db"))
        .unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err}");
    assert!(err.to_string().contains("build timeout"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20));
}

// ---- Several processes, one table ----

const RACE_TABLE_VAR: &str = "IDEMSTORE_PG_RACE_TABLE";
const RACE_START_VAR: &str = "IDEMSTORE_PG_RACE_START_MS";
const RACE_PROCESSES: usize = 3;
const RACE_THREADS: usize = 4;
const RACE_KEYS: usize = 40;
/// Longer than the test: no lease runs out, so every key runs exactly once.
const RACE_LEASE: Duration = Duration::from_secs(120);

/// The child side of the multi-process race; does nothing unless started by it.
#[test]
#[ignore = "a child process of several_processes_execute_each_key_once"]
fn race_child_entry() {
    let (Ok(url), Ok(table), Ok(start)) = (
        std::env::var(URL_VAR),
        std::env::var(RACE_TABLE_VAR),
        std::env::var(RACE_START_VAR),
    ) else {
        return;
    };
    let store = PostgresStore::builder()
        .table(&table)
        .max_size(RACE_THREADS as u32)
        .connect(&url)
        .unwrap();
    let guard = Guard::builder(store)
        .lease(RACE_LEASE)
        .retention(HOUR)
        .build()
        .unwrap();
    // All processes start together, so they really race.
    let start: u64 = start.parse().unwrap();
    let wait = Timestamp::from_system_time(std::time::SystemTime::now())
        .until(Timestamp::from_millis(start));
    std::thread::sleep(wait);
    let lines = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..RACE_THREADS {
            let (guard, lines) = (&guard, &lines);
            s.spawn(move || {
                // Each thread walks the keys from a different place.
                for i in 0..RACE_KEYS {
                    let k = (i + t * 7 + std::process::id() as usize) % RACE_KEYS;
                    let id = format!("k{k}");
                    let outcome = guard.run(&key(&id), &Fingerprint::of(&id), |claim| {
                        Ok::<_, std::convert::Infallible>(Response::new(
                            200,
                            format!("{}:{}", std::process::id(), claim.token()),
                        ))
                    });
                    let line = match outcome {
                        Outcome::Executed(r) => format!("EXEC {id} {}", body(&r)),
                        Outcome::Replayed(r) => format!("REPLAY {id} {}", body(&r)),
                        Outcome::InFlight { .. } => format!("INFLIGHT {id}"),
                        other => panic!("{id}: {other:?}"),
                    };
                    lines.lock().unwrap().push(line);
                }
            });
        }
    });
    let mut out = std::io::stdout().lock();
    for line in lines.into_inner().unwrap() {
        writeln!(out, "RACE {line}").unwrap();
    }
}

fn body(r: &Response) -> String {
    String::from_utf8_lossy(r.body()).into_owned()
}

/// Several processes, each with its own `PostgresStore` (its own pool),
/// run the same keys through a `Guard` at the same moment: across all of
/// them, each key is executed exactly once, and every replay returns that
/// execution's response.
#[test]
fn several_processes_execute_each_key_once() {
    if !enabled() {
        return;
    }
    let (store, guard) = fresh_store("race", 1);
    let start = SystemClock.now_ms() + 1_500;
    let children: Vec<_> = (0..RACE_PROCESSES)
        .map(|_| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "postgres::race_child_entry",
                    "--exact",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(RACE_TABLE_VAR, &guard.table)
                .env(RACE_START_VAR, start.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut execs: HashMap<String, Vec<String>> = HashMap::new();
    let mut replays: Vec<(String, String)> = Vec::new();
    let mut lines = 0;
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "child failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // The harness prints "test .. ... " before the child's first line.
            let Some(rest) = line.split_once("RACE ").map(|(_, rest)| rest) else {
                continue;
            };
            lines += 1;
            let f: Vec<&str> = rest.split(' ').collect();
            match f.as_slice() {
                ["EXEC", id, by] => execs
                    .entry((*id).to_owned())
                    .or_default()
                    .push((*by).to_owned()),
                ["REPLAY", id, by] => replays.push(((*id).to_owned(), (*by).to_owned())),
                ["INFLIGHT", _] => {}
                _ => panic!("unparsable line {line:?}"),
            }
        }
    }
    assert_eq!(lines, RACE_PROCESSES * RACE_THREADS * RACE_KEYS);
    for k in 0..RACE_KEYS {
        let id = format!("k{k}");
        let list = execs.get(&id).map_or(&[][..], Vec::as_slice);
        assert_eq!(list.len(), 1, "{id} executed {list:?}");
        let stored = store
            .get(
                &key(&id),
                Timestamp::from_system_time(std::time::SystemTime::now()),
            )
            .unwrap()
            .unwrap();
        assert_eq!(body(stored.response().unwrap()), list[0], "{id}");
    }
    for (id, by) in replays {
        assert_eq!(execs[&id], [by], "{id}: a replay of another execution");
    }
    let processes: std::collections::HashSet<&str> = execs
        .values()
        .map(|v| v[0].split(':').next().unwrap())
        .collect();
    eprintln!(
        "multi-process race: {RACE_PROCESSES} processes x {RACE_THREADS} threads on {RACE_KEYS} keys; \
         executions by {} distinct processes",
        processes.len()
    );
}

trait NowMs {
    fn now_ms(&self) -> u64;
}

impl NowMs for SystemClock {
    fn now_ms(&self) -> u64 {
        idemstore::Clock::now(self).as_millis()
    }
}

// Steps (issue #42) on PostgreSQL: the table's two step columns and every
// statement's handling of a released record (lease_until 0, steps kept).

fn step(name: &str, output: &[u8]) -> Step {
    Step::new(name, output.to_vec()).unwrap()
}

fn names(steps: &[Step]) -> Vec<&str> {
    steps.iter().map(Step::name).collect()
}

/// Steps recorded by the owner come back to the claim that takes the key
/// over; the old owner can no longer record, renew or complete; a DONE
/// record has none, in the table too.
#[test]
fn steps_are_recorded_and_handed_to_a_takeover() {
    let Some(url) = pg_url() else { return };
    let (store, table) = fresh_store("steps", 4);
    let (k, fp) = (key("order"), Fingerprint::of(b"qty=1"));
    let first = claimed(store.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    assert!(first.steps().is_empty());
    let charge = step("charge", b"ch_1");
    store.record_step(&k, &first, &charge, T0).unwrap();
    // The same step again writes nothing; another output under its name is refused.
    store.record_step(&k, &first, &charge, T0).unwrap();
    let clash = store.record_step(&k, &first, &step("charge", b"ch_2"), T0);
    assert!(
        matches!(clash, Err(Error::InvalidArgument { .. })),
        "{clash:?}"
    );
    // A name with a NUL and an empty output are steps like any other.
    let odd = step("nul\0name", b"");
    store.record_step(&k, &first, &odd, T0).unwrap();
    let rec = store.get(&k, T0).unwrap().unwrap();
    assert_eq!(rec.steps(), [charge.clone(), odd.clone()]);

    // The lease runs out: a takeover, with the steps.
    let later = T0 + SEC;
    let second = claimed(store.begin(&k, &fp, later, SEC, HOUR).unwrap());
    assert!(second.is_takeover());
    assert_eq!(second.attempt(), 2);
    assert_eq!(second.steps(), [charge.clone(), odd.clone()]);
    let email = step("email", b"msg_9");
    let stale = store.record_step(&k, &first, &email, later);
    assert!(matches!(stale, Err(Error::StaleClaim)), "{stale:?}");
    assert!(matches!(
        store.renew(&k, &first, later, SEC),
        Err(Error::StaleClaim)
    ));
    assert!(matches!(
        store.complete(&k, &first, &Response::new(200, "old"), later, HOUR),
        Err(Error::StaleClaim)
    ));
    assert!(matches!(store.release(&k, &first), Err(Error::StaleClaim)));
    store.record_step(&k, &second, &email, later).unwrap();
    assert_eq!(
        names(store.get(&k, later).unwrap().unwrap().steps()),
        ["charge", "nul\0name", "email"]
    );
    // A renewal keeps them.
    let second = store.renew(&k, &second, later, SEC).unwrap();
    assert_eq!(store.get(&k, later).unwrap().unwrap().steps().len(), 3);

    // complete drops them.
    store
        .complete(&k, &second, &Response::new(201, "paid"), later, HOUR)
        .unwrap();
    let done = store.get(&k, later).unwrap().unwrap();
    assert_eq!(done.state(), State::Done);
    assert!(done.steps().is_empty());
    let stale = store.record_step(&k, &second, &step("late", b""), later);
    assert!(matches!(stale, Err(Error::StaleClaim)), "{stale:?}");
    let left: i32 = raw(&url)
        .query_one(
            &format!(
                "SELECT cardinality(step_names) + cardinality(step_outputs) FROM \"{}\"",
                table.table
            ),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "no step is left in the DONE row");
}

/// A release with steps keeps the row (PROCESSING, lease_until 0, steps):
/// the next claim with the same fingerprint is at once and not a takeover,
/// another fingerprint is a conflict, the old claim is stale for every
/// call. Without steps a release deletes the row, as before.
#[test]
fn a_release_keeps_steps_and_the_next_claim_is_not_a_takeover() {
    let Some(url) = pg_url() else { return };
    let (store, table) = fresh_store("steps_rel", 4);
    let (k, fp) = (key("order"), Fingerprint::of(b"qty=1"));
    let first = claimed(store.begin(&k, &fp, T0, HOUR, HOUR * 2).unwrap());
    let charge = step("charge", b"ch_1");
    store.record_step(&k, &first, &charge, T0).unwrap();
    store.release(&k, &first).unwrap();
    let kept = store.get(&k, T0).unwrap().expect("kept");
    assert_eq!(kept.state(), State::Processing);
    assert_eq!(kept.lease_until(), Some(Timestamp::EPOCH));
    assert_eq!(kept.token(), first.token());
    assert_eq!(kept.steps(), std::slice::from_ref(&charge));
    let lease: i64 = raw(&url)
        .query_one(&format!("SELECT lease_until FROM \"{}\"", table.table), &[])
        .unwrap()
        .get(0);
    assert_eq!(lease, 0);

    // The released claim is stale for every call.
    let t = T0 + SEC;
    assert!(matches!(store.release(&k, &first), Err(Error::StaleClaim)));
    assert!(matches!(
        store.renew(&k, &first, t, SEC),
        Err(Error::StaleClaim)
    ));
    assert!(matches!(
        store.record_step(&k, &first, &step("email", b""), t),
        Err(Error::StaleClaim)
    ));
    assert!(matches!(
        store.complete(&k, &first, &Response::new(200, "x"), t, HOUR),
        Err(Error::StaleClaim)
    ));
    // Another fingerprint conflicts; the same one claims at once (the
    // owner's lease, an hour, has not run out), not as a takeover.
    assert!(matches!(
        store.begin(&k, &Fingerprint::of(b"qty=2"), t, SEC, HOUR),
        Ok(Begin::Conflict)
    ));
    let second = claimed(store.begin(&k, &fp, t, SEC, HOUR).unwrap());
    assert!(!second.is_takeover());
    assert_eq!(second.attempt(), 2);
    assert_eq!(second.steps(), std::slice::from_ref(&charge));
    assert!(second.token() > first.token());
    // The next one is InFlight, as for any live claim.
    assert!(matches!(
        store.begin(&k, &fp, t, SEC, HOUR),
        Ok(Begin::InFlight { .. })
    ));
    // Released again (steps kept), then claimed through the async entry.
    store.release(&k, &second).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let third = rt
        .block_on(async {
            store
                .begin_async(&k, &fp, t, SEC, HOUR)
                .expect("native")
                .await
        })
        .map(claimed)
        .unwrap();
    assert!(!third.is_takeover());
    assert_eq!((third.attempt(), third.steps()), (3, &[charge.clone()][..]));
    rt.block_on(async {
        store
            .record_step_async(&k, &third, &step("email", b"m"), t)
            .expect("native")
            .await
    })
    .unwrap();
    assert_eq!(
        names(store.get(&k, t).unwrap().unwrap().steps()),
        ["charge", "email"]
    );
    store
        .complete(&k, &third, &Response::new(201, "paid"), t, HOUR)
        .unwrap();
    assert!(store.get(&k, t).unwrap().unwrap().steps().is_empty());

    // No steps: the row goes, and the next claim is a fresh one.
    let plain = key("plain");
    let c = claimed(store.begin(&plain, &fp, T0, HOUR, HOUR).unwrap());
    store.release(&plain, &c).unwrap();
    assert!(store.get(&plain, T0).unwrap().is_none());
    let again = claimed(store.begin(&plain, &fp, T0, HOUR, HOUR).unwrap());
    assert_eq!((again.is_takeover(), again.attempt()), (false, 1));

    // A released record that expires is gone for good: a fresh claim, no steps.
    let gone = key("gone");
    let c = claimed(store.begin(&gone, &fp, T0, SEC, SEC * 2).unwrap());
    store.record_step(&gone, &c, &charge, T0).unwrap();
    store.release(&gone, &c).unwrap();
    let fresh = claimed(store.begin(&gone, &fp, T0 + SEC * 2, SEC, HOUR).unwrap());
    assert_eq!((fresh.is_takeover(), fresh.attempt()), (false, 1));
    assert!(fresh.steps().is_empty());
    assert!(
        store
            .get(&gone, T0 + SEC * 2)
            .unwrap()
            .unwrap()
            .steps()
            .is_empty()
    );
}

/// Released records claimed by many threads at once (the commit line then
/// groups begins, and a group never claims a released row: its job runs
/// again alone): one claim per key, never a takeover, with the steps.
#[test]
fn concurrent_claims_of_released_records_are_not_takeovers() {
    if !enabled() {
        return;
    }
    let (store, _table) = fresh_store("steps_conc", 8);
    let store = Arc::new(store);
    let fp = Fingerprint::of(b"x");
    let keys: Vec<Key> = (0..40).map(|i| key(&format!("r{i}"))).collect();
    for k in &keys {
        let c = claimed(store.begin(k, &fp, T0, HOUR, HOUR * 2).unwrap());
        store
            .record_step(k, &c, &step("charge", k.id()), T0)
            .unwrap();
        store.release(k, &c).unwrap();
    }
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (store, keys, barrier) = (Arc::clone(&store), keys.clone(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                let mut claims = Vec::new();
                for k in &keys {
                    match store.begin(k, &fp, T0 + SEC, SEC, HOUR).unwrap() {
                        Begin::Claimed(c) => claims.push((k.clone(), c)),
                        Begin::InFlight { .. } => {}
                        other => panic!("{other:?}"),
                    }
                }
                claims
            })
        })
        .collect();
    let claims: Vec<_> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    assert_eq!(claims.len(), keys.len(), "one claim per key");
    for (k, c) in claims {
        assert!(!c.is_takeover(), "{k}");
        assert_eq!(c.attempt(), 2);
        assert_eq!(c.steps(), [step("charge", k.id())]);
    }
}

/// The per-record limits are refused before any write; the limit itself
/// is accepted.
#[test]
fn step_limits_are_refused_and_nothing_is_written() {
    if !enabled() {
        return;
    }
    let (store, _table) = fresh_store("steps_lim", 2);
    let fp = Fingerprint::of(b"x");
    let k = key("many");
    let c = claimed(store.begin(&k, &fp, T0, HOUR, HOUR).unwrap());
    for i in 0..MAX_STEPS {
        store
            .record_step(&k, &c, &step(&format!("s{i}"), b""), T0)
            .unwrap();
    }
    let over = store.record_step(&k, &c, &step("one-more", b""), T0);
    assert!(
        matches!(over, Err(Error::StepLimit { what: "steps", .. })),
        "{over:?}"
    );
    assert_eq!(store.get(&k, T0).unwrap().unwrap().steps().len(), MAX_STEPS);
    // A step already recorded is still Ok at the limit.
    store.record_step(&k, &c, &step("s0", b""), T0).unwrap();

    let k = key("heavy");
    let c = claimed(store.begin(&k, &fp, T0, HOUR, HOUR).unwrap());
    let big = vec![7u8; MAX_STEP_OUTPUT_BYTES];
    for i in 0..3 {
        store
            .record_step(&k, &c, &step(&format!("b{i}"), &big), T0)
            .unwrap();
    }
    let over = store.record_step(&k, &c, &step("b3", &big), T0);
    assert!(
        matches!(
            over,
            Err(Error::StepLimit {
                what: "step bytes in the record",
                ..
            })
        ),
        "{over:?}"
    );
    let rec = store.get(&k, T0).unwrap().unwrap();
    assert_eq!(names(rec.steps()), ["b0", "b1", "b2"]);
    assert!(rec.steps().iter().all(|s| s.output() == big.as_slice()));
    // Four full outputs and their names are over MAX_STEPS_BYTES.
    const { assert!(4 * (MAX_STEP_OUTPUT_BYTES + 2) > MAX_STEPS_BYTES) };
}

/// A stale owner recording steps while another caller takes the key over:
/// every step the owner was told is recorded is one the new claim starts
/// with, and no step it was refused is in the record.
#[test]
fn a_stale_owner_racing_two_threads_records_nothing_after_the_takeover() {
    if !enabled() {
        return;
    }
    let (store, _table) = fresh_store("steps_race", 4);
    let store = Arc::new(store);
    let fp = Fingerprint::of(b"x");
    for round in 0..20 {
        let k = key(&format!("race{round}"));
        let owner = claimed(store.begin(&k, &fp, T0, SEC, HOUR).unwrap());
        let barrier = Arc::new(Barrier::new(2));
        let recorder = {
            let (store, k, owner, barrier) = (
                Arc::clone(&store),
                k.clone(),
                owner.clone(),
                Arc::clone(&barrier),
            );
            std::thread::spawn(move || {
                barrier.wait();
                let mut told = Vec::new();
                for i in 0..12 {
                    let s = step(&format!("s{i}"), &[i]);
                    // Its own clock still inside the lease.
                    match store.record_step(&k, &owner, &s, T0) {
                        Ok(()) => told.push((s, true)),
                        Err(Error::StaleClaim) => told.push((s, false)),
                        Err(other) => panic!("{other}"),
                    }
                }
                told
            })
        };
        barrier.wait();
        let next = claimed(store.begin(&k, &fp, T0 + SEC, SEC, HOUR).unwrap());
        assert!(next.is_takeover());
        let told = recorder.join().unwrap();
        let rec = store.get(&k, T0 + SEC).unwrap().unwrap();
        assert_eq!(rec.token(), next.token());
        assert_eq!(
            rec.steps(),
            next.steps(),
            "nothing was recorded after the takeover"
        );
        let recorded: Vec<&Step> = told.iter().filter(|(_, ok)| *ok).map(|(s, _)| s).collect();
        assert_eq!(
            recorded,
            next.steps().iter().collect::<Vec<_>>(),
            "round {round}: the steps acknowledged are exactly the ones handed over"
        );
        // Once refused, always refused.
        let first_refused = told.iter().position(|(_, ok)| !ok).unwrap_or(told.len());
        assert!(
            told.get(first_refused..)
                .unwrap_or_default()
                .iter()
                .all(|(_, ok)| !ok)
        );
    }
}

/// Step columns a hand-written UPDATE broke are reported as corrupt.
#[test]
fn malformed_step_columns_are_corrupt() {
    let Some(url) = pg_url() else { return };
    let (store, table) = fresh_store("steps_bad", 2);
    let fp = Fingerprint::of(b"x");
    let t = &table.table;
    let mut client = raw(&url);
    let breakages = [
        // More names than outputs.
        "step_names = '{\"\\\\x61\"}'",
        // A name that is not UTF-8.
        "step_names = '{\"\\\\xff\"}', step_outputs = '{\"\\\\x\"}'",
        // A name twice.
        "step_names = '{\"\\\\x61\",\"\\\\x61\"}', step_outputs = '{\"\\\\x\",\"\\\\x\"}'",
        // A NULL element.
        "step_names = '{NULL}', step_outputs = '{NULL}'",
        // Two dimensions.
        "step_names = '{{\"\\\\x61\"}}', step_outputs = '{{\"\\\\x\"}}'",
    ];
    for (i, set) in breakages.iter().enumerate() {
        let k = key(&format!("bad{i}"));
        let c = claimed(store.begin(&k, &fp, T0, HOUR, HOUR).unwrap());
        client
            .batch_execute(&format!(
                "UPDATE \"{t}\" SET {set} WHERE id = '{}'::bytea",
                k.id().escape_ascii()
            ))
            .unwrap();
        let got = store.get(&k, T0);
        assert!(matches!(got, Err(Error::Corrupt { .. })), "{set}: {got:?}");
        let _ = c;
    }
    // A DONE row with steps.
    let k = key("done");
    let c = claimed(store.begin(&k, &fp, T0, HOUR, HOUR).unwrap());
    store
        .complete(&k, &c, &Response::new(200, "ok"), T0, HOUR)
        .unwrap();
    client
        .batch_execute(&format!(
            "UPDATE \"{t}\" SET step_names = '{{\"\\\\x61\"}}', step_outputs = '{{\"\\\\x\"}}' \
             WHERE id = 'done'::bytea"
        ))
        .unwrap();
    let got = store.get(&k, T0);
    assert!(matches!(got, Err(Error::Corrupt { .. })), "{got:?}");
}

/// The owner releases its record (steps kept) while a begin that read the
/// record with its lease run out waits on the row lock: the begin must
/// not answer from its snapshot (a takeover) but from the row it claims
/// (released: not a takeover), as logic::begin on that row does.
#[test]
fn a_begin_racing_a_release_claims_the_released_record_without_a_takeover() {
    let Some(url) = pg_url() else { return };
    let (store, guard) = fresh_store("steps_relrace", 2);
    let store = Arc::new(store);
    let (k, fp) = (key("k"), Fingerprint::of(b"a"));
    let owner = claimed(store.begin(&k, &fp, T0, SEC, HOUR).unwrap());
    let charge = step("charge", b"ch_1");
    store.record_step(&k, &owner, &charge, T0).unwrap();
    let mut other = raw(&url);
    let mut tx = other.transaction().unwrap();
    // The owner's release, as Stmt::ReleaseKeep writes it, not yet committed.
    let released = tx
        .execute(
            &format!(
                "UPDATE \"{}\" SET lease_until = 0 WHERE id = $1 AND token = $2",
                guard.table
            ),
            &[&k.id(), &(owner.token() as i64)],
        )
        .unwrap();
    assert_eq!(released, 1);
    let racing = {
        let (store, k) = (Arc::clone(&store), k.clone());
        std::thread::spawn(move || store.begin(&k, &fp, T0 + 2 * SEC, SEC, HOUR))
    };
    wait_for_lock_waiter(&url, "idemstore");
    tx.commit().unwrap();
    let claim = claimed(racing.join().unwrap().unwrap());
    assert!(!claim.is_takeover(), "{claim:?}");
    assert_eq!(claim.attempt(), 2);
    assert_eq!(claim.steps(), std::slice::from_ref(&charge));
}

/// record_step's append waits on the row lock of a concurrent writer and
/// decides again on the row that writer committed: after a takeover it is
/// StaleClaim and writes nothing; after another step of the same claim it
/// records its own step after that one.
#[test]
fn record_step_decides_again_after_a_concurrent_write() {
    let Some(url) = pg_url() else { return };
    let (store, guard) = fresh_store("steps_cas", 2);
    let store = Arc::new(store);
    let fp = Fingerprint::of(b"a");
    let t = &guard.table;
    for (id, concurrent, expect_stale) in [
        // A takeover: a new token (and attempts + 1).
        (
            "taken",
            "token = token + 1000000, attempts = attempts + 1",
            true,
        ),
        // The same claim recording another step.
        (
            "appended",
            "step_names = array_append(step_names, '\\x6f74686572'::bytea), \
             step_outputs = array_append(step_outputs, '\\x'::bytea)",
            false,
        ),
    ] {
        let k = key(id);
        let owner = claimed(store.begin(&k, &fp, T0, HOUR, HOUR * 2).unwrap());
        store
            .record_step(&k, &owner, &step("first", b"1"), T0)
            .unwrap();
        // Prepare the statements, so the racing call's only wait is the lock.
        store
            .record_step(&key("warm"), &owner, &step("x", b""), T0)
            .unwrap_err();
        let mut other = raw(&url);
        let mut tx = other.transaction().unwrap();
        let n = tx
            .execute(
                &format!("UPDATE \"{t}\" SET {concurrent} WHERE id = $1"),
                &[&k.id()],
            )
            .unwrap();
        assert_eq!(n, 1);
        let racing = {
            let (store, k, owner) = (Arc::clone(&store), k.clone(), owner.clone());
            std::thread::spawn(move || store.record_step(&k, &owner, &step("mine", b"2"), T0))
        };
        wait_for_lock_waiter(&url, "idemstore");
        tx.commit().unwrap();
        let answer = racing.join().unwrap();
        let rec = store.get(&k, T0).unwrap().unwrap();
        if expect_stale {
            assert!(matches!(answer, Err(Error::StaleClaim)), "{answer:?}");
            assert_eq!(names(rec.steps()), ["first"]);
        } else {
            answer.unwrap();
            assert_eq!(names(rec.steps()), ["first", "other", "mine"]);
        }
    }
}

/// `PostgresStore::atomic_step`: the step's statements and its record
/// commit together. A failing step, or one whose claim was taken over,
/// leaves neither; a recorded step is not run again.
#[test]
fn an_atomic_step_commits_its_statements_with_its_record_or_neither() {
    if !enabled() {
        return;
    }
    let (store, dropped) = fresh_store("atomic", 4);
    let rows = format!("{}_rows", dropped.table);
    let mut admin = ::postgres::Client::connect(&dropped.url, ::postgres::NoTls).unwrap();
    admin
        .batch_execute(&format!("CREATE TABLE \"{rows}\" (name text PRIMARY KEY)"))
        .unwrap();
    let _rows_dropped = DropTable {
        url: dropped.url.clone(),
        table: rows.clone(),
    };
    let count = |admin: &mut ::postgres::Client| -> i64 {
        admin
            .query_one(&format!("SELECT count(*) FROM \"{rows}\""), &[])
            .unwrap()
            .get(0)
    };
    let insert = |name: &'static str, fail: bool| insert_step(&rows, name, fail);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (k, fp, lease) = (key("atomic"), Fingerprint::of(b"x"), Duration::from_secs(1));
    let t0 = idemstore::Clock::now(&*store.clock());
    let Begin::Claimed(first) = store.begin(&k, &fp, t0, lease, lease * 60).unwrap() else {
        panic!("claimed")
    };
    let failed = rt.block_on(store.atomic_step(&k, &first, "a", insert("a", true)));
    assert!(failed.is_err());
    assert_eq!(
        count(&mut admin),
        0,
        "a failed step rolls its statement back"
    );
    assert!(store.get(&k, t0).unwrap().unwrap().steps().is_empty());
    let done = rt.block_on(store.atomic_step(&k, &first, "a", insert("a", false)));
    assert_eq!(done.unwrap(), b"a");
    assert_eq!(count(&mut admin), 1);
    assert_eq!(store.get(&k, t0).unwrap().unwrap().steps()[0].name(), "a");
    // Taken over: the old owner's next step rolls back as stale.
    let Begin::Claimed(second) = store.begin(&k, &fp, t0 + lease, lease, lease * 60).unwrap()
    else {
        panic!("taken over")
    };
    let stale = rt.block_on(store.atomic_step(&k, &first, "b", insert("b", false)));
    assert!(matches!(stale, Err(Error::StaleClaim)), "{stale:?}");
    assert_eq!(count(&mut admin), 1, "the stale step's row rolled back");
    // The new owner replays `a` without running it, and runs `b`.
    let replayed = rt.block_on(store.atomic_step(&k, &second, "a", insert("a", false)));
    assert_eq!(replayed.unwrap(), b"a");
    assert_eq!(
        rt.block_on(store.atomic_step(&k, &second, "b", insert("b", false)))
            .unwrap(),
        b"b"
    );
    assert_eq!(count(&mut admin), 2);
    let record = store.get(&k, t0).unwrap().unwrap();
    let names: Vec<&str> = record.steps().iter().map(|s| s.name()).collect();
    assert_eq!(names, ["a", "b"]);
}

/// An atomic step that inserts `name` into `rows`, then fails if `fail`.
fn insert_step(
    rows: &str,
    name: &'static str,
    fail: bool,
) -> impl for<'c> FnOnce(
    &'c tokio_postgres::Client,
    String,
) -> idemstore::postgres::StepFuture<'c, Error>
+ Send
+ 'static {
    let sql = format!("INSERT INTO \"{rows}\" VALUES ('{name}')");
    move |client, _step_key| {
        Box::pin(async move {
            client
                .execute(&sql, &[])
                .await
                .map_err(|e| Error::backend(e.to_string()))?;
            if fail {
                return Err(Error::backend("declined"));
            }
            Ok(name.as_bytes().to_vec())
        })
    }
}
