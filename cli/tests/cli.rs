//! The `idemstore` binary, run as a process against stores made by the
//! library: every command, the exit codes, a damaged store for `verify`, and
//! a store held by another process.
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "a panic in a test is a failure with a location"
)]

use assert_cmd::Command;
use idemstore::{
    Begin, Clock, Fingerprint, Key, RedbStore, Response, State, Store, SystemClock, Timestamp,
};
use redb::{ReadableTable, TableDefinition};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(300);
const KEEP: Duration = Duration::from_secs(24 * 3600);
const SHORT: Duration = Duration::from_secs(3600);
/// The tests never wait on the binary longer than this: a hang is a failure.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(60);
const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idemstore.records");
const EXPIRY: TableDefinition<&[u8], ()> = TableDefinition::new("idemstore.expiry");

fn idemstore() -> Command {
    let mut cmd = Command::new(assert_cmd::cargo::cargo_bin!("idemstore"));
    cmd.timeout(PROCESS_TIMEOUT);
    cmd
}

fn now() -> Timestamp {
    SystemClock.now()
}

fn hours_ago(h: u64) -> Timestamp {
    Timestamp::from_millis(now().as_millis() - h * 3_600_000)
}

fn claimed(b: Begin) -> idemstore::Claim {
    match b {
        Begin::Claimed(c) => c,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// A store with one record of each kind an operator asks about:
/// `t/done` (DONE, text body), `t/bin` (DONE, binary body), `t/big`
/// (DONE, 5000-byte body), `t/live` (PROCESSING, lease live), `t/dead`
/// (PROCESSING, lease passed), `u/old` (DONE, expired, not swept).
fn sample_store(dir: &Path) -> PathBuf {
    let path = dir.join("sample.idem");
    let store = RedbStore::open(&path).unwrap();
    let fp = Fingerprint::of(b"sku=A&qty=1");
    let done = |scope: &str, id: &str, at: Timestamp, keep: Duration, response: Response| {
        let k = Key::new(scope, id).unwrap();
        let c = claimed(store.begin(&k, &fp, at, LEASE, keep).unwrap());
        store.complete(&k, &c, &response, at, keep).unwrap();
    };
    done(
        "t",
        "done",
        now(),
        KEEP,
        Response::new(201, "charged").with_header("content-type", "text/plain"),
    );
    done(
        "t",
        "bin",
        now(),
        KEEP,
        Response::new(200, vec![0xff, 0x00, 0xfe]),
    );
    done(
        "t",
        "big",
        now(),
        KEEP,
        Response::new(200, "x".repeat(5000)),
    );
    done("u", "old", hours_ago(2), SHORT, Response::new(200, "old"));
    let k = Key::new("t", "live").unwrap();
    claimed(store.begin(&k, &fp, now(), LEASE, KEEP).unwrap());
    let k = Key::new("t", "dead").unwrap();
    claimed(store.begin(&k, &fp, hours_ago(1), LEASE, KEEP).unwrap());
    path
}

fn json_lines(out: &[u8]) -> Vec<Value> {
    String::from_utf8(out.to_vec())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn run_json(args: &[&str]) -> Value {
    let out = idemstore().args(args).arg("--json").assert().success();
    let mut lines = json_lines(&out.get_output().stdout);
    assert_eq!(lines.len(), 1);
    lines.remove(0)
}

fn stdout(assert: &assert_cmd::assert::Assert) -> String {
    String::from_utf8(assert.get_output().stdout.clone()).unwrap()
}

fn stderr(assert: &assert_cmd::assert::Assert) -> String {
    String::from_utf8(assert.get_output().stderr.clone()).unwrap()
}

fn encoded_key(scope: &str, id: &str) -> Vec<u8> {
    // The frozen key layout: scope_len u8 | scope | id.
    let mut k = vec![scope.len() as u8];
    k.extend_from_slice(scope.as_bytes());
    k.extend_from_slice(id.as_bytes());
    k
}

#[test]
fn stats_counts_records_by_state() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let p = path.to_str().unwrap();
    let v = run_json(&["stats", p]);
    assert_eq!(v["records"], 6);
    assert_eq!(v["done"], 3);
    assert_eq!(v["processing"], 2);
    assert_eq!(v["processing_lease_passed"], 1);
    assert_eq!(v["expired_not_swept"], 1);
    assert_eq!(v["unreadable"], 0);
    assert_eq!(v["index_entries"], 6);
    assert_eq!(v["format_version"], 3);
    assert_eq!(v["token_high_water_mark"], 6);
    assert_eq!(v["health"], "healthy");
    assert!(v["health_cause"].is_null());
    assert!(v["file_bytes"].as_u64().unwrap() > 0);
    assert!(v["oldest_expiry_ms"].as_u64() < v["newest_expiry_ms"].as_u64());
    let table = idemstore().args(["stats", p]).assert().success();
    let text = stdout(&table);
    assert!(text.contains("token high-water mark  6"), "{text}");
    assert!(
        text.contains("PROCESSING, live     2 (1 with lease passed)"),
        "{text}"
    );
}

/// An inspection of a crash image (copied while the store is open, after
/// a checkpoint) finds the record and writes nothing.
#[test]
fn an_inspection_of_a_crash_image_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    let image = tempfile::tempdir().unwrap();
    {
        let store = RedbStore::open(&path).unwrap();
        let key = Key::new("s", "k1").unwrap();
        let fp = Fingerprint::of(b"body");
        let claim = claimed(
            store
                .begin(
                    &key,
                    &fp,
                    now(),
                    Duration::from_secs(60),
                    Duration::from_secs(3600),
                )
                .unwrap(),
        );
        store
            .complete(
                &key,
                &claim,
                &Response::new(201, "made"),
                now(),
                Duration::from_secs(3600),
            )
            .unwrap();
        store.admin().checkpoint().unwrap();
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), image.path().join(entry.file_name())).unwrap();
        }
    }
    let copied = image.path().join("s.idem");
    let before: Vec<_> = std::fs::read_dir(image.path())
        .unwrap()
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    let v = run_json(&["get", copied.to_str().unwrap(), "--scope", "s", "k1"]);
    assert_eq!(v["state"], "DONE", "{v}");
    let after: Vec<_> = std::fs::read_dir(image.path())
        .unwrap()
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    assert!(before == after, "an inspection wrote");
}

#[test]
fn get_shows_the_record_and_its_response() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let p = path.to_str().unwrap();
    let text = stdout(
        &idemstore()
            .args(["get", p, "--scope", "t", "done"])
            .assert()
            .success(),
    );
    assert!(text.contains("state        DONE"), "{text}");
    assert!(
        text.contains(&Fingerprint::of(b"sku=A&qty=1").to_hex()),
        "{text}"
    );
    assert!(text.contains("status       201"), "{text}");
    assert!(
        text.contains("header       content-type: text/plain"),
        "{text}"
    );
    assert!(text.trim_end().ends_with("charged"), "{text}");
    assert!(
        text.contains("Z (in 23h59m)") || text.contains("Z (in 1d)"),
        "{text}"
    );

    let v = run_json(&["get", p, "--scope", "t", "bin"]);
    assert_eq!(v["response"]["body_hex"], "ff00fe");
    assert_eq!(v["state"], "DONE");

    let v = run_json(&["get", p, "--scope", "t", "big"]);
    assert_eq!(v["response"]["body_truncated"], true);
    assert_eq!(v["response"]["body"].as_str().unwrap().len(), 1024);
    let v = run_json(&["get", p, "--scope", "t", "big", "--full"]);
    assert_eq!(v["response"]["body"].as_str().unwrap().len(), 5000);

    let v = run_json(&["get", p, "--scope", "t", "dead"]);
    assert_eq!(
        (v["state"].as_str(), v["lease_passed"].as_bool()),
        (Some("PROCESSING"), Some(true))
    );
    let text = stdout(
        &idemstore()
            .args(["get", p, "--scope", "t", "dead"])
            .assert()
            .success(),
    );
    assert!(text.contains("LEASE PASSED"), "{text}");
    // Expired records are shown (flagged): the operator asks what is on disk.
    let text = stdout(
        &idemstore()
            .args(["get", p, "--scope", "u", "old"])
            .assert()
            .success(),
    );
    assert!(text.contains("EXPIRED"), "{text}");

    let missing = idemstore()
        .args(["get", p, "--scope", "t", "nope"])
        .assert()
        .code(5);
    assert!(stderr(&missing).contains("no record for t/nope"));
}

#[test]
fn list_filters_and_flags_passed_leases() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let p = path.to_str().unwrap();
    let keys = |args: &[&str]| -> Vec<String> {
        let out = idemstore()
            .args(["list", p, "--json"])
            .args(args)
            .assert()
            .success();
        let lines = json_lines(&out.get_output().stdout);
        let (summary, records) = lines.split_last().unwrap();
        assert_eq!(summary["summary"]["shown"], records.len());
        records
            .iter()
            .map(|v| {
                let (scope, id) = (&v["key"]["scope"], &v["key"]["id"]);
                format!("{}/{}", scope.as_str().unwrap(), id.as_str().unwrap())
            })
            .collect()
    };
    assert_eq!(
        keys(&[]),
        ["t/big", "t/bin", "t/dead", "t/done", "t/live", "u/old"]
    );
    assert_eq!(keys(&["--state", "processing"]), ["t/dead", "t/live"]);
    assert_eq!(
        keys(&["--state", "done", "--scope", "t"]),
        ["t/big", "t/bin", "t/done"]
    );
    assert_eq!(keys(&["--expired"]), ["u/old"]);
    assert_eq!(keys(&["--scope", "u"]), ["u/old"]);
    assert_eq!(keys(&["--scope", ""]), Vec::<String>::new());
    assert_eq!(keys(&["--limit", "2"]), ["t/big", "t/bin"]);
    let text = stdout(&idemstore().args(["list", p]).assert().success());
    let dead = text.lines().find(|l| l.contains("t/dead")).unwrap();
    assert!(dead.contains("LEASE-PASSED"), "{text}");
    let live = text.lines().find(|l| l.contains("t/live")).unwrap();
    assert!(!live.contains("LEASE-PASSED"), "{text}");
    assert!(
        text.lines()
            .find(|l| l.contains("u/old"))
            .unwrap()
            .contains("EXPIRED")
    );
}

#[test]
fn evict_needs_confirmation_then_removes_record_and_index_entry() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let p = path.to_str().unwrap();
    // stdin is a pipe here, not a terminal: without --yes it must refuse.
    let refused = idemstore()
        .args(["evict", p, "--scope", "t", "done"])
        .write_stdin("y\n")
        .assert()
        .code(6);
    assert!(stderr(&refused).contains("--yes"), "{}", stderr(&refused));
    run_json(&["get", p, "--scope", "t", "done"]);

    let v = run_json(&["evict", p, "--scope", "t", "done", "--yes"]);
    assert_eq!(
        (v["state"].as_str(), v["index_entries"].as_u64()),
        (Some("DONE"), Some(1))
    );
    idemstore()
        .args(["get", p, "--scope", "t", "done"])
        .assert()
        .code(5);
    idemstore()
        .args(["evict", p, "--scope", "t", "done", "--yes"])
        .assert()
        .code(5);
    idemstore().args(["verify", p]).assert().success();
    // The key is free again: a retry claims it.
    let store = RedbStore::open(&path).unwrap();
    let k = Key::new("t", "done").unwrap();
    let fp = Fingerprint::of(b"sku=A&qty=1");
    assert!(matches!(
        store.begin(&k, &fp, now(), LEASE, KEEP).unwrap(),
        Begin::Claimed(_)
    ));
}

#[test]
fn sweep_removes_expired_records_and_compact_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let p = path.to_str().unwrap();
    let v = run_json(&["sweep", p]);
    assert_eq!(
        (v["removed"].as_u64(), v["records_left"].as_u64()),
        (Some(1), Some(5))
    );
    assert_eq!(run_json(&["sweep", p])["removed"], 0);
    idemstore()
        .args(["get", p, "--scope", "u", "old"])
        .assert()
        .code(5);
    let v = run_json(&["compact", p]);
    assert!(
        v["file_bytes_after"].as_u64() <= v["file_bytes_before"].as_u64(),
        "{v}"
    );
    assert_eq!(run_json(&["stats", p])["records"], 5);
    let text = stdout(&idemstore().args(["verify", p]).assert().success());
    assert!(text.contains("OK"), "{text}");
}

#[test]
fn verify_reports_a_damaged_record_value_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let p = path.to_str().unwrap();
    idemstore().args(["verify", p]).assert().success();
    {
        // Flip one byte inside a record value through redb itself: redb's
        // own page checksums stay valid, only the record envelope is wrong.
        let db = redb::Database::open(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut records = txn.open_table(RECORDS).unwrap();
            let key = encoded_key("t", "done");
            let mut value = records
                .get(key.as_slice())
                .unwrap()
                .unwrap()
                .value()
                .to_vec();
            let last = value.len() - 1;
            value[last] ^= 0x01;
            records.insert(key.as_slice(), value.as_slice()).unwrap();
        }
        txn.commit().unwrap();
    }
    let failed = idemstore().args(["verify", p]).assert().code(3);
    let text = stdout(&failed);
    assert!(text.contains("bad_record"), "{text}");
    assert!(text.contains("t/done"), "{text}");
    assert!(text.contains("checksum mismatch"), "{text}");
    assert!(text.contains("FAILED: 1 problem ("), "{text}");
    // The other commands still work around it, and say so.
    assert_eq!(run_json(&["stats", p])["unreadable"], 1);
    let get = idemstore()
        .args(["get", p, "--scope", "t", "done"])
        .assert()
        .code(1);
    assert!(
        stderr(&get).contains("corrupt record for key t/done"),
        "{}",
        stderr(&get)
    );
    let listed = stdout(&idemstore().args(["list", p]).assert().success());
    let line = listed.lines().find(|l| l.contains("t/done")).unwrap();
    assert!(line.starts_with("UNREADABLE"), "{listed}");
    let export = idemstore().args(["export", p]).assert().code(3);
    assert_eq!(json_lines(&export.get_output().stdout).len(), 5);
    assert!(stderr(&export).contains("t/done"), "{}", stderr(&export));
    // evict is the repair: it removes the damaged record and its index entry.
    idemstore()
        .args(["evict", p, "--scope", "t", "done", "--yes"])
        .assert()
        .success();
    idemstore().args(["verify", p]).assert().success();
}

#[test]
fn verify_reports_index_disagreements() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let p = path.to_str().unwrap();
    {
        let db = redb::Database::open(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut expiry = txn.open_table(EXPIRY).unwrap();
            // An entry whose record never existed, and one record's entry removed.
            let mut orphan = 42u64.to_be_bytes().to_vec();
            orphan.extend_from_slice(&encoded_key("t", "ghost"));
            expiry.insert(orphan.as_slice(), ()).unwrap();
            let entries: Vec<Vec<u8>> = expiry
                .iter()
                .unwrap()
                .map(|e| e.unwrap().0.value().to_vec())
                .collect();
            let live = entries
                .iter()
                .find(|e| e.ends_with(&encoded_key("t", "live")))
                .unwrap();
            expiry.remove(live.as_slice()).unwrap();
        }
        txn.commit().unwrap();
    }
    let out = idemstore().args(["verify", p, "--json"]).assert().code(3);
    let v = &json_lines(&out.get_output().stdout)[0];
    assert_eq!(v["ok"], false);
    assert_eq!(v["problem_count"], 2);
    let kinds: Vec<(&str, &str)> = v["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["kind"].as_str().unwrap(), p["key"].as_str().unwrap()))
        .collect();
    assert_eq!(
        kinds,
        [("missing_index", "t/live"), ("orphan_index", "t/ghost")]
    );
}

#[test]
fn export_then_import_round_trips_every_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let p = path.to_str().unwrap();
    let dump = dir.path().join("dump.jsonl");
    let d = dump.to_str().unwrap();
    idemstore().args(["export", p, "-o", d]).assert().success();
    let lines = std::fs::read_to_string(&dump).unwrap();
    assert_eq!(lines.lines().count(), 6);
    assert!(lines.contains("\"body_b64\":\"/wD+\""), "{lines}");
    assert!(lines.contains("\"body\":\"charged\""), "{lines}");

    let copy = dir.path().join("copy.idem");
    let c = copy.to_str().unwrap();
    let imported = run_json(&["import", c, d]);
    assert_eq!(
        (&imported["lines"], &imported["records_stored"]),
        (&6.into(), &6.into())
    );
    // Standard input works too, and a second export is byte-identical.
    let again = idemstore().args(["export", c]).assert().success();
    assert_eq!(
        String::from_utf8(again.get_output().stdout.clone()).unwrap(),
        lines
    );
    let refused = idemstore()
        .args(["import", c])
        .write_stdin(lines.clone())
        .assert()
        .code(6);
    assert!(stderr(&refused).contains("--force"), "{}", stderr(&refused));
    idemstore()
        .args(["import", c, "--force"])
        .write_stdin(lines)
        .assert()
        .success();
    idemstore().args(["verify", c]).assert().success();

    // The imported store behaves: replays, and tokens continue above the import.
    let store = RedbStore::open(&copy).unwrap();
    let fp = Fingerprint::of(b"sku=A&qty=1");
    let k = Key::new("t", "done").unwrap();
    let replay = store.begin(&k, &fp, now(), LEASE, KEEP).unwrap();
    assert_eq!(
        replay,
        Begin::Replay(Response::new(201, "charged").with_header("content-type", "text/plain"))
    );
    let rec = store
        .get(&Key::new("t", "dead").unwrap(), now())
        .unwrap()
        .unwrap();
    assert_eq!(rec.state(), State::Processing);
    let fresh = claimed(
        store
            .begin(&Key::new("t", "new").unwrap(), &fp, now(), LEASE, KEEP)
            .unwrap(),
    );
    assert_eq!(
        fresh.token(),
        7,
        "the high-water mark came along with the records"
    );
}

#[test]
fn import_names_the_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("t.idem");
    let out = idemstore()
        .args(["import", target.to_str().unwrap()])
        .write_stdin("\n{\"v\":1}\n")
        .assert()
        .code(1);
    assert!(stderr(&out).contains("line 2"), "{}", stderr(&out));
}

#[test]
fn a_store_held_by_a_running_process_is_locked_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let held = RedbStore::open(&path).unwrap();
    for cmd in ["stats", "verify", "sweep"] {
        let out = idemstore()
            .args([cmd, path.to_str().unwrap()])
            .assert()
            .code(4);
        // The holder is named: this test's process.
        let holder = format!("is locked by pid {} (", std::process::id());
        assert!(stderr(&out).contains(&holder), "{cmd}: {}", stderr(&out));
    }
    drop(held);
    idemstore()
        .args(["stats", path.to_str().unwrap()])
        .assert()
        .success();
}

#[test]
fn missing_and_foreign_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("typo.idem");
    let out = idemstore()
        .args(["stats", missing.to_str().unwrap()])
        .assert()
        .code(1);
    assert!(stderr(&out).contains("no store at"), "{}", stderr(&out));
    assert!(!missing.exists(), "a read command must not create a store");
    let foreign = dir.path().join("notes.txt");
    std::fs::write(&foreign, "hello, not a database").unwrap();
    let out = idemstore()
        .args(["stats", foreign.to_str().unwrap()])
        .assert()
        .code(1);
    assert!(
        stderr(&out).contains("not an idemstore store file"),
        "{}",
        stderr(&out)
    );
    let out = idemstore()
        .args(["verify", foreign.to_str().unwrap()])
        .assert()
        .code(3);
    assert!(
        stderr(&out).contains("not an idemstore store file"),
        "{}",
        stderr(&out)
    );
    idemstore().args(["frobnicate"]).assert().code(2);
}

/// An open store at `dir/s.idem` with `ids` claimed and only in its log
/// (no checkpoint yet): what a process about to be killed leaves.
fn unclean_store(dir: &Path, ids: &[&str]) -> RedbStore {
    let store = RedbStore::builder()
        .checkpoint_interval(Duration::from_secs(3600))
        .open(dir.join("s.idem"))
        .unwrap();
    let fp = Fingerprint::of(b"x");
    for id in ids {
        let key = Key::new("t", id).unwrap();
        claimed(
            store
                .begin(
                    &key,
                    &fp,
                    now(),
                    Duration::from_secs(30),
                    Duration::from_secs(3600),
                )
                .unwrap(),
        );
    }
    store
}

#[test]
fn recover_refuses_without_accept_loss_then_opens_and_writes_the_report() {
    // A store copied without its log after an unclean stop: a plain open
    // refuses it; `recover --accept-loss` opens it and says what was lost.
    let live = tempfile::tempdir().unwrap();
    let store = unclean_store(live.path(), &["order-1"]);
    let copy = tempfile::tempdir().unwrap();
    let path = copy.path().join("s.idem");
    std::fs::copy(live.path().join("s.idem"), &path).unwrap();
    drop(store);

    let out = idemstore().args(["recover"]).arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(6), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("was not closed cleanly"), "{err}");
    assert!(err.contains("--accept-loss"), "{err}");

    let out = idemstore()
        .args(["recover", "--accept-loss"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let report_path = copy.path().join("s.idem.loss-report.json");
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert!(
        report["findings"][0]
            .as_str()
            .unwrap()
            .contains("missing or empty"),
        "{report}"
    );
    // Recovered: the store now opens and verifies.
    let out = idemstore().arg("verify").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    // A second recover has nothing to do, and never overwrites a report.
    let out = idemstore().arg("recover").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

#[test]
fn verify_checks_the_log_without_writing_and_lists_every_problem() {
    // A store killed with writes in its log, copied, and one frame in the
    // middle of the copy's log damaged: verify says so, and neither file
    // changes (before, verify opened the store, which replayed the log up
    // to the damage and dropped the rest).
    let live = tempfile::tempdir().unwrap();
    let store = unclean_store(live.path(), &["a", "b", "c"]);
    let intact = tempfile::tempdir().unwrap();
    let copy = tempfile::tempdir().unwrap();
    let path = copy.path().join("s.idem");
    let log_path = copy.path().join("s.idem-wal");
    for dir in [intact.path(), copy.path()] {
        std::fs::copy(live.path().join("s.idem"), dir.join("s.idem")).unwrap();
        std::fs::copy(live.path().join("s.idem-wal"), dir.join("s.idem-wal")).unwrap();
    }
    drop(store);
    // The intact copy: verify passes, and says the stop was unclean.
    let out = idemstore()
        .arg("verify")
        .arg(intact.path().join("s.idem"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(
        text.contains("log: 3 frames to replay, not closed cleanly"),
        "{text}"
    );
    // Damage the second frame's epoch field in the other copy.
    let mut log = std::fs::read(&log_path).unwrap();
    let frames: Vec<usize> = (0..log.len() - 20)
        .step_by(4096)
        .filter(|&at| log[at..at + 4] == *b"IDWL")
        .collect();
    let newest = frames
        .iter()
        .map(|&at| &log[at + 4..at + 12])
        .max()
        .unwrap()
        .to_vec();
    let live_frames: Vec<usize> = frames
        .into_iter()
        .filter(|&at| log[at + 4..at + 12] == newest[..])
        .collect();
    assert_eq!(live_frames.len(), 3);
    log[live_frames[1] + 11] ^= 0x10;
    std::fs::write(&log_path, &log).unwrap();
    let before = (
        std::fs::read(&path).unwrap(),
        std::fs::read(&log_path).unwrap(),
    );
    let out = idemstore().arg("verify").arg(&path).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(text.contains("a later frame of the same epoch"), "{text}");
    let after = (
        std::fs::read(&path).unwrap(),
        std::fs::read(&log_path).unwrap(),
    );
    assert!(before == after, "verify wrote to a damaged store");
    let out = idemstore()
        .args(["--json", "verify"])
        .arg(&path)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["log"]["clean_stop"], false);
}

#[test]
fn verify_on_a_damaged_page_reports_it_and_leaves_the_store_readable() {
    // redb's integrity check repairs in place, and a failed repair ("all
    // roots are corrupted") can leave a file no command opens. Now the
    // check runs on a private copy in memory: verify reports the damage,
    // names the key, and the store still opens for `stats` and `export`,
    // which save every other record.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    {
        let store = RedbStore::open(&path).unwrap();
        let fp = Fingerprint::of(b"x");
        for i in 0..50 {
            let key = Key::new("t", format!("k{i}")).unwrap();
            let c = claimed(
                store
                    .begin(
                        &key,
                        &fp,
                        now(),
                        Duration::from_secs(30),
                        Duration::from_secs(3600),
                    )
                    .unwrap(),
            );
            let body = if i == 7 {
                "DAMAGE-ME-7".to_owned()
            } else {
                format!("ok-{i}")
            };
            store
                .complete(
                    &key,
                    &c,
                    &Response::new(200, body),
                    now(),
                    Duration::from_secs(3600),
                )
                .unwrap();
        }
    }
    // Every copy of the marker: redb copies pages on write, so a freed
    // page may still hold an older copy of the record, and which copy is
    // live depends on when the checkpoints ran.
    let mut bytes = std::fs::read(&path).unwrap();
    let copies: Vec<usize> = bytes
        .windows(11)
        .enumerate()
        .filter_map(|(i, w)| (w == b"DAMAGE-ME-7").then_some(i))
        .collect();
    assert!(!copies.is_empty(), "the marker is in the file");
    for at in copies {
        bytes[at] ^= 0x20;
    }
    std::fs::write(&path, &bytes).unwrap();
    let before = snapshot(dir.path());
    let out = idemstore().arg("verify").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert_eq!(snapshot(dir.path()), before, "verify changed a file");
    // Before, the check ended at redb's error and named no key; now it
    // reports the engine's finding and goes on to the damaged record.
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("engine_damaged") && text.contains("verify changed nothing"),
        "{text}"
    );
    assert!(
        text.contains("bad_record") && text.contains("t/k7"),
        "{text}"
    );
    // The store still opens, and the other records are all there.
    let out = idemstore().arg("stats").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = idemstore().arg("export").arg(&path).output().unwrap();
    let lines = String::from_utf8_lossy(&out.stdout).lines().count();
    assert!(lines >= 49, "export saved {lines} records: {out:?}");
    assert_eq!(snapshot(dir.path()), before, "an inspection changed a file");

    // salvage: every other record into a new file, the damaged one named.
    let saved = dir.path().join("saved.idem");
    let out = idemstore()
        .args(["salvage", "--json"])
        .arg(&path)
        .arg("--to")
        .arg(&saved)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "something was left behind: {out:?}"
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["salvaged"], 49, "{v}");
    assert_eq!(v["left_behind"][0]["key"]["id"], "k7", "{v}");
    assert_eq!(v["token_high_water_mark"], 50, "{v}");
    let mut after = snapshot(dir.path());
    assert!(after.remove(&PathBuf::from("saved.idem")).is_some());
    assert_eq!(
        after, before,
        "salvage changed the original or left files behind"
    );
    idemstore().arg("verify").arg(&saved).assert().success();
    let listed = run_json(&["stats", saved.to_str().unwrap()]);
    assert_eq!(listed["records"], 49);
    // Never over an existing file.
    let again = idemstore()
        .arg("salvage")
        .arg(&path)
        .arg("--to")
        .arg(&saved)
        .assert()
        .code(6);
    assert!(stderr(&again).contains("exists"), "{}", stderr(&again));
}

/// Every file in `dir` (not below) with its bytes and permissions: what
/// "nothing changed" is checked against.
fn snapshot(dir: &Path) -> std::collections::BTreeMap<PathBuf, (Vec<u8>, u32)> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let meta = e.metadata().unwrap();
            (
                PathBuf::from(e.file_name()),
                (std::fs::read(e.path()).unwrap(), meta.permissions().mode()),
            )
        })
        .collect()
}

/// The inspections, as arguments after the store's path.
const INSPECTIONS: &[&[&str]] = &[
    &["stats"],
    &["get", "--scope", "t", "done"],
    &["list", "--limit", "0"],
    &["explain", "--scope", "t", "done"],
    &["log"],
    &["verify"],
    &["export"],
];

fn inspect(path: &Path, args: &[&str]) -> std::process::Output {
    idemstore()
        .arg(args[0])
        .arg(path)
        .args(&args[1..])
        .output()
        .unwrap()
}

#[test]
fn inspections_change_no_byte_and_create_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let before = snapshot(dir.path());
    for args in INSPECTIONS {
        let out = inspect(&path, args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
        assert_eq!(snapshot(dir.path()), before, "{args:?} changed a file");
    }
}

#[test]
fn inspections_read_through_unflushed_log_frames_without_writing() {
    // A killed service leaves claims only in the log: the inspections show
    // them (and say so) without replaying them into the file.
    let live = tempfile::tempdir().unwrap();
    let store = unclean_store(live.path(), &["order-1", "order-2"]);
    let copy = tempfile::tempdir().unwrap();
    let path = copy.path().join("s.idem");
    for name in ["s.idem", "s.idem-wal"] {
        std::fs::copy(live.path().join(name), copy.path().join(name)).unwrap();
    }
    drop(store);
    let before = snapshot(copy.path());
    let out = idemstore()
        .arg("get")
        .arg(&path)
        .args(["--scope", "t", "order-2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the view includes 2 frames of the write-ahead log"),
        "{err}"
    );
    let stats = run_json(&["stats", path.to_str().unwrap()]);
    assert_eq!(stats["processing"], 2, "{stats}");
    assert_eq!(stats["log_frames_not_checkpointed"], 2, "{stats}");
    let log = idemstore()
        .arg("log")
        .arg(&path)
        .arg("--json")
        .output()
        .unwrap();
    let log: Value = serde_json::from_slice(&log.stdout).unwrap();
    assert_eq!(
        (&log["clean_stop"], &log["frames"]),
        (&false.into(), &2.into())
    );
    assert_eq!(snapshot(copy.path()), before, "an inspection wrote");
    // A writer's command replays them into the file, and says so.
    let out = idemstore().args(["sweep"]).arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("replayed 2 frames"), "{err}");
}

#[test]
fn inspections_work_on_a_read_only_file_for_a_user_who_cannot_write_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    for file in [path.clone(), dir.path().join("sample.idem-wal")] {
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o444)).unwrap();
    }
    // Root writes anything: the commands then run as `nobody`, who can
    // read the files (0444) and write neither them nor the directory.
    let root = rustix_uid_is_root();
    if root {
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    } else {
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o555)).unwrap();
    }
    let before = snapshot(dir.path());
    for args in INSPECTIONS {
        let mut cmd = if root {
            let mut cmd = std::process::Command::new("setpriv");
            cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .arg(assert_cmd::cargo::cargo_bin!("idemstore"));
            cmd
        } else {
            std::process::Command::new(assert_cmd::cargo::cargo_bin!("idemstore"))
        };
        let out = cmd
            .arg(args[0])
            .arg(&path)
            .args(&args[1..])
            .output()
            .expect("setpriv runs (util-linux) when the tests run as root");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
    }
    // And a write is refused with a message that names the file.
    let out = if root {
        std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(assert_cmd::cargo::cargo_bin!("idemstore"))
            .arg("evict")
            .arg(&path)
            .args(["--yes", "--scope", "t", "done"])
            .output()
            .unwrap()
    } else {
        idemstore()
            .arg("evict")
            .arg(&path)
            .args(["--yes", "--scope", "t", "done"])
            .output()
            .unwrap()
    };
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("sample.idem") && err.contains("ermission denied"),
        "{err}"
    );
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(snapshot(dir.path()), before, "a read-only file changed");
}

fn rustix_uid_is_root() -> bool {
    // `id -u` rather than a libc dependency for one call.
    let out = std::process::Command::new("id").arg("-u").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

#[test]
fn an_empty_or_missing_file_is_never_taken_for_a_store() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.idem");
    std::fs::write(&empty, b"").unwrap();
    std::fs::set_permissions(&empty, std::fs::Permissions::from_mode(0o644)).unwrap();
    let before = snapshot(dir.path());
    let mut all: Vec<&[&str]> = INSPECTIONS.to_vec();
    all.extend_from_slice(&[
        &["evict", "--yes", "k"],
        &["sweep"],
        &["compact"],
        &["salvage", "--to", "/nonexistent/x"],
    ]);
    for args in &all {
        let out = inspect(&empty, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("empty (0 bytes): not a store file"),
            "{args:?}: {err}"
        );
        assert_eq!(
            snapshot(dir.path()),
            before,
            "{args:?} changed the directory"
        );
        let out = inspect(&dir.path().join("missing.idem"), args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("no store at"), "{args:?}: {err}");
        assert_eq!(snapshot(dir.path()), before, "{args:?} created a file");
    }
    // import refuses to replace a file that is not a store.
    let out = idemstore()
        .arg("import")
        .arg(&empty)
        .write_stdin("")
        .assert()
        .code(6);
    assert!(stderr(&out).contains("not a store"), "{}", stderr(&out));
    assert_eq!(snapshot(dir.path()), before);
}

/// `n` export lines of DONE records `t/k0..`, all valid.
fn good_lines(n: usize) -> String {
    let scratch = idemstore::MemoryStore::new();
    let key = Key::new("t", "k").unwrap();
    let fp = Fingerprint::of(b"x");
    let c = claimed(scratch.begin(&key, &fp, now(), LEASE, KEEP).unwrap());
    scratch
        .complete(&key, &c, &Response::new(200, "ok"), now(), KEEP)
        .unwrap();
    let record = scratch.get(&key, now()).unwrap().unwrap();
    let mut out = String::new();
    for i in 0..n {
        let key = Key::new("t", format!("k{i}")).unwrap();
        out.push_str(&idemstore::redb::admin::export_line(&key, &record));
        out.push('\n');
    }
    out
}

#[test]
fn a_failed_import_leaves_nothing_at_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("t.idem");
    // A bad line after two and a half batches: before, 20,000 records were
    // left in the target; now nothing is.
    let mut input = good_lines(25_000);
    input.push_str("{\"v\":1,\"oops\":true}\n");
    let out = idemstore()
        .arg("import")
        .arg(&target)
        .write_stdin(input)
        .assert()
        .code(1);
    let err = stderr(&out);
    assert!(
        err.contains("line 25001") && err.contains("Nothing was written"),
        "{err}"
    );
    assert!(
        snapshot(dir.path()).is_empty(),
        "files left: {:?}",
        snapshot(dir.path()).keys().collect::<Vec<_>>()
    );
    // A bad first line: no file either.
    idemstore()
        .arg("import")
        .arg(&target)
        .write_stdin("not json\n")
        .assert()
        .code(1);
    assert!(snapshot(dir.path()).is_empty());
    // Counts are of records stored: two lines with one key store one.
    let twice = good_lines(1).repeat(2);
    let v: Value = serde_json::from_slice(
        &idemstore()
            .arg("import")
            .arg(&target)
            .arg("--json")
            .write_stdin(twice)
            .assert()
            .success()
            .get_output()
            .stdout,
    )
    .unwrap();
    assert_eq!(
        (&v["lines"], &v["records_stored"]),
        (&2.into(), &1.into()),
        "{v}"
    );
    assert_eq!(v["lines_repeating_a_key"], 1);
    // A failed merge into an existing store leaves it byte for byte as it was.
    let before = snapshot(dir.path());
    let mut bad = good_lines(3);
    bad.push_str("{\"v\":1,\"scope\":\"t\",\"id\":\"x\",\"extra\":1}\n");
    let out = idemstore()
        .args(["import", "--force"])
        .arg(&target)
        .write_stdin(bad)
        .assert()
        .code(1);
    assert!(
        stderr(&out).contains("unknown field \"extra\""),
        "{}",
        stderr(&out)
    );
    assert_eq!(snapshot(dir.path()), before);
    // A good merge keeps the target's records and adds the new ones.
    let v: Value = serde_json::from_slice(
        &idemstore()
            .args(["import", "--force", "--json"])
            .arg(&target)
            .write_stdin(good_lines(3))
            .assert()
            .success()
            .get_output()
            .stdout,
    )
    .unwrap();
    assert_eq!(v["records_in_store"], 3, "{v}");
    assert_eq!(v["records_kept_from_target"], 1, "{v}");
    idemstore().arg("verify").arg(&target).assert().success();
}

#[test]
fn errors_under_json_are_one_json_object() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let foreign = dir.path().join("foreign.idem");
    std::fs::write(&foreign, b"hello, not a store").unwrap();
    let held = dir.path().join("held.idem");
    let holder = RedbStore::open(&held).unwrap();
    let cases: Vec<(Vec<std::ffi::OsString>, u8, &str)> = vec![
        (
            vec!["get".into(), path.clone().into(), "nope".into()],
            5,
            "not_found",
        ),
        (
            vec!["stats".into(), dir.path().join("no.idem").into()],
            1,
            "not_found",
        ),
        (vec!["stats".into(), foreign.clone().into()], 1, "corrupt"),
        (vec!["stats".into(), held.clone().into()], 4, "locked"),
        (vec!["stats".into(), "--frobnicate".into()], 2, "usage"),
        (
            vec![
                "get".into(),
                path.clone().into(),
                "--hex".into(),
                "zz".into(),
            ],
            2,
            "usage",
        ),
    ];
    for (args, code, kind) in cases {
        let out = idemstore().args(&args).arg("--json").output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(i32::from(code)),
            "{args:?}: {out:?}"
        );
        let v: Value = serde_json::from_slice(&out.stderr)
            .unwrap_or_else(|e| panic!("{args:?}: stderr is not JSON ({e}): {out:?}"));
        assert_eq!(v["error"]["kind"], kind, "{args:?}: {v}");
        assert_eq!(v["error"]["exit_code"], code, "{args:?}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    drop(holder);
}

#[test]
fn keys_of_any_bytes_are_listed_and_addressed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.idem");
    {
        let store = RedbStore::open(&path).unwrap();
        let fp = Fingerprint::of(b"x");
        for key in [
            Key::new("t", [0x74, 0xff]).unwrap(),
            Key::new("a/b", "c").unwrap(),
            Key::new("a", "b/c").unwrap(),
        ] {
            claimed(store.begin(&key, &fp, now(), LEASE, KEEP).unwrap());
        }
    }
    let p = path.to_str().unwrap();
    let out = idemstore().args(["list", p, "--json"]).assert().success();
    let lines = json_lines(&out.get_output().stdout);
    let keys: Vec<&Value> = lines.iter().filter_map(|v| v.get("key")).collect();
    assert_eq!(keys.len(), 3);
    assert!(keys.contains(&&serde_json::json!({"scope": "a/b", "id": "c"})));
    assert!(keys.contains(&&serde_json::json!({"scope": "a", "id": "b/c"})));
    assert!(keys.contains(&&serde_json::json!({"scope": "t", "id_hex": "74ff"})));
    let v = run_json(&["get", p, "--hex", "--scope", "74", "74ff"]);
    assert_eq!(v["key"]["id_hex"], "74ff");
    // The text listing shows how to address it.
    let text = stdout(&idemstore().args(["list", p]).assert().success());
    assert!(text.contains("--hex --scope 74 74ff"), "{text}");
    idemstore()
        .args(["evict", p, "--yes", "--hex", "--scope", "74", "0x74ff"])
        .assert()
        .success();
    // A forgotten --scope: the message names the scope that has the id.
    let out = idemstore().args(["get", p, "b/c"]).assert().code(5);
    assert!(
        stderr(&out).contains("under another scope: --scope a b/c"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn list_filters_exclude_expired_records_and_say_when_they_cut() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let p = path.to_str().unwrap();
    let ids = |args: &[&str]| -> (Vec<String>, Value) {
        let out = idemstore()
            .args(["list", p, "--json"])
            .args(args)
            .assert()
            .success();
        let mut lines = json_lines(&out.get_output().stdout);
        let summary = lines.pop().unwrap();
        let ids = lines
            .iter()
            .map(|v| v["key"]["id"].as_str().unwrap().to_owned())
            .collect();
        (ids, summary)
    };
    // u/old is DONE and expired: a state filter names live records.
    assert_eq!(ids(&["--state", "done"]).0, ["big", "bin", "done"]);
    assert_eq!(
        ids(&["--state", "done", "--include-expired"]).0,
        ["big", "bin", "done", "old"]
    );
    let (shown, summary) = ids(&["--limit", "2"]);
    assert_eq!(shown.len(), 2);
    assert_eq!(summary["summary"]["truncated"], true);
    assert_eq!(ids(&["--limit", "0"]).1["summary"]["truncated"], false);
    // stats reports sizes as on disk.
    let stats = run_json(&["stats", p]);
    assert_eq!(stats["file_bytes"], std::fs::metadata(&path).unwrap().len());
    // export's summary goes to stdout when the records go to a file.
    let dump = dir.path().join("d.jsonl");
    let v = run_json(&["export", p, "-o", dump.to_str().unwrap()]);
    assert_eq!(v["exported"], 6);
}

#[test]
fn explain_says_what_a_request_would_get_and_why() {
    let dir = tempfile::tempdir().unwrap();
    let path = sample_store(dir.path());
    let p = path.to_str().unwrap();
    let body = dir.path().join("body");
    std::fs::write(&body, b"sku=A&qty=1").unwrap();
    let b = body.to_str().unwrap();
    let explain = |args: &[&str]| run_json(&[&["explain", p, "--scope"], args].concat());
    // The same body: the stored response.
    let v = explain(&["t", "done", "--kind", "bytes", "--body", b]);
    assert_eq!(
        (&v["verdict"], &v["http_status"]),
        (&"replay".into(), &201.into()),
        "{v}"
    );
    assert_eq!(v["fingerprint_matches"], true);
    // Another body: 422, never the stored response.
    std::fs::write(&body, b"sku=A&qty=2").unwrap();
    let v = explain(&["t", "done", "--kind", "bytes", "--body", b]);
    assert_eq!(
        (&v["verdict"], &v["http_status"]),
        (&"conflict".into(), &422.into()),
        "{v}"
    );
    assert_eq!(v["fingerprint_matches"], false);
    // A live owner: 409; a dead one (lease passed): taken over.
    let v = explain(&["t", "live"]);
    assert_eq!(
        (&v["verdict"], &v["http_status"]),
        (&"in_flight".into(), &409.into()),
        "{v}"
    );
    let v = explain(&["t", "dead"]);
    assert_eq!(v["verdict"], "takeover", "{v}");
    assert!(v["why"].as_str().unwrap().contains("attempt 2"), "{v}");
    // Expired or absent: a claim, with the next token.
    let v = explain(&["u", "old"]);
    assert_eq!(v["verdict"], "claim", "{v}");
    let v = explain(&["t", "nope"]);
    assert_eq!(v["verdict"], "claim", "{v}");
    assert!(v["why"].as_str().unwrap().contains("token 7"), "{v}");
    // --fingerprint takes what `fingerprint` prints; the text form reads.
    let fp = Fingerprint::of(b"sku=A&qty=1").to_hex();
    let v = explain(&["t", "done", "--fingerprint", &fp]);
    assert_eq!(v["verdict"], "replay");
    let text = stdout(
        &idemstore()
            .args(["explain", p, "--scope", "t", "done", "--fingerprint"])
            .arg("00".repeat(32))
            .assert()
            .success(),
    );
    assert!(text.contains("verdict      CONFLICT (HTTP 422)"), "{text}");
    assert!(text.contains("DIFFERS"), "{text}");
}

#[test]
fn the_fingerprint_command_computes_what_the_library_does() {
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("order.json");
    std::fs::write(&body, br#"{"qty":1,"sku":"A"}"#).unwrap();
    let b = body.to_str().unwrap();
    let printed = |args: &[&str]| -> String {
        stdout(&idemstore().arg("fingerprint").args(args).assert().success())
            .trim()
            .to_owned()
    };
    assert_eq!(
        printed(&[
            "--method",
            "POST",
            "--path",
            "/orders",
            "--header",
            "X-Tenant: acme",
            "--body",
            b
        ]),
        Fingerprint::of_http(
            "POST",
            "/orders",
            br#"{"qty":1,"sku":"A"}"#,
            &[("x-tenant", &[b"acme"])]
        )
        .to_hex()
    );
    assert_eq!(
        printed(&["--kind", "bytes", "--body", b]),
        Fingerprint::of(br#"{"qty":1,"sku":"A"}"#).to_hex()
    );
    assert_eq!(
        printed(&["--kind", "json", "--body", b]),
        Fingerprint::of_json(&serde_json::json!({"sku": "A", "qty": 1})).to_hex()
    );
    // The HTTP kind needs a method and a path.
    idemstore()
        .args(["fingerprint", "--body", b])
        .assert()
        .code(2);
}

/// A request through the real layer with JSON fields on a `RedbStore`,
/// then `fingerprint` and `explain` with the same pointers: the CLI must
/// compute the layer's fingerprint, or an operator asking "why 422?" is
/// told about another request.
#[test]
fn the_cli_and_the_layer_agree_on_json_fields() {
    use axum::{Router, body::Body, http::StatusCode, routing::post};
    use idemstore::{Guard, tower::IdempotencyLayer};
    use tower::ServiceExt;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("payments.idem");
    let p = path.to_str().unwrap();
    {
        let store = std::sync::Arc::new(RedbStore::open(&path).unwrap());
        let layer = IdempotencyLayer::new(Guard::new(std::sync::Arc::clone(&store)))
            .fingerprint_headers([http::HeaderName::from_static("x-tenant")])
            .fingerprint_json_fields(["/amount", "/currency"])
            .unwrap();
        let app = Router::new()
            .route("/payments", post(|| async { StatusCode::CREATED }))
            .layer(layer);
        let req = http::Request::post("/payments?v=2")
            .header("idempotency-key", "p-1")
            .header("x-tenant", "acme")
            .body(Body::from(
                r#"{"currency": "EUR", "amount": 1250, "sent_at": "09:00:00"}"#,
            ))
            .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let res = rt.block_on(app.oneshot(req)).unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
    }
    let stored = store_fingerprint(&path, "p-1");
    // The client's retry: another timestamp, the members reordered.
    let retry = dir.path().join("retry.json");
    std::fs::write(
        &retry,
        br#"{"sent_at":"09:00:05","amount":1250,"currency":"EUR"}"#,
    )
    .unwrap();
    let r = retry.to_str().unwrap();
    let request = [
        "--method",
        "POST",
        "--path",
        "/payments?v=2",
        "--header",
        "x-tenant: acme",
        "--json-field",
        "/currency",
        "--json-field",
        "/amount",
        "--body",
        r,
    ];
    let printed = stdout(
        &idemstore()
            .arg("fingerprint")
            .args(request)
            .assert()
            .success(),
    );
    assert_eq!(printed.trim(), stored);
    let v = run_json(&[&["explain", p, "p-1"][..], &request].concat());
    assert_eq!(v["verdict"], "replay", "{v}");
    assert_eq!(v["fingerprint_matches"], true, "{v}");
    // Another amount: the 422 the layer gives, and the account names the value.
    std::fs::write(&retry, br#"{"amount":1251,"currency":"EUR"}"#).unwrap();
    let text = stdout(
        &idemstore()
            .args(["explain", p, "p-1"])
            .args(request)
            .assert()
            .success(),
    );
    assert!(text.contains("verdict      CONFLICT (HTTP 422)"), "{text}");
    assert!(
        text.contains("/amount = 1251, /currency = \"EUR\""),
        "{text}"
    );
    // Without the pointers the whole body is fingerprinted, which is not
    // what this layer does: the CLI says DIFFERS even for the same body.
    std::fs::write(&retry, br#"{"amount":1250,"currency":"EUR"}"#).unwrap();
    let v = run_json(&[&["explain", p, "p-1"][..], &request[..6], &request[10..]].concat());
    assert_eq!(v["fingerprint_matches"], false, "{v}");
    // A pointer that is not RFC 6901 is a usage error.
    let bad = idemstore()
        .args(["fingerprint", "--json-field", "amount", "--body", r])
        .args(["--method", "POST", "--path", "/payments"])
        .assert()
        .code(2);
    assert!(stderr(&bad).contains("RFC 6901"), "{}", stderr(&bad));
}

/// The stored fingerprint of `id` (empty scope), as `get --json` prints it.
fn store_fingerprint(path: &Path, id: &str) -> String {
    let v = run_json(&["get", path.to_str().unwrap(), id]);
    v["fingerprint"].as_str().unwrap().to_owned()
}
