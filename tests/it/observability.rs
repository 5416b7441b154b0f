//! Features `metrics` and `tracing`: what a guarded request and a
//! `RedbStore` report, captured by a debugging recorder and a formatting
//! subscriber, and that no key id reaches either.

use idemstore::{Fingerprint, Guard, Key, ManualClock, Outcome, RedbStore, Response, Timestamp};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use std::convert::Infallible;
use std::time::Duration;

// The documented metric names (`idemstore::observability`), spelled out so
// that a rename fails here.
const GUARD_BEGIN_SECONDS: &str = "idemstore_guard_begin_seconds";
const GUARD_COMPLETE_SECONDS: &str = "idemstore_guard_complete_seconds";
const GUARD_OUTCOMES: &str = "idemstore_guard_outcomes_total";
const GUARD_TAKEOVERS: &str = "idemstore_guard_takeovers_total";
const REDB_GROUP_SIZE: &str = "idemstore_redb_group_size";
const REDB_LOG_FILL_RATIO: &str = "idemstore_redb_log_fill_ratio";
const REDB_LOG_SYNC_SECONDS: &str = "idemstore_redb_log_sync_seconds";
const REDB_MEMTABLE_BYTES: &str = "idemstore_redb_memtable_bytes";
const SECRET_ID: &str = "order-secret-4711";

/// A guard on a RedbStore with a manual clock: one request executed, its
/// replay, a conflict, and a takeover after a failed owner's lease.
fn traffic(dir: &std::path::Path) {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let store = RedbStore::builder()
        .clock(clock.clone())
        .open(dir.join("s.idem"))
        .unwrap();
    let guard = Guard::builder(store)
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let key = Key::new("tenant-7", SECRET_ID).unwrap();
    let fp = Fingerprint::of(b"qty=1");
    let ok = |_: &idemstore::Claim| Ok::<_, Infallible>(Response::new(201, "made"));
    assert!(matches!(guard.run(&key, &fp, ok), Outcome::Executed(_)));
    assert!(matches!(guard.run(&key, &fp, ok), Outcome::Replayed(_)));
    let other = Fingerprint::of(b"qty=2");
    assert!(matches!(guard.run(&key, &other, ok), Outcome::Conflicted));
    let dead = Key::new("tenant-7", "order-dead").unwrap();
    let failed = guard.run(&dead, &fp, |_| Err::<Response, _>("owner died"));
    assert!(matches!(failed, Outcome::HandlerFailed(_)));
    clock.advance(Duration::from_secs(31));
    assert!(matches!(guard.run(&dead, &fp, ok), Outcome::Executed(_)));
}

/// One request executed and then replayed through `run_async`, in the
/// scope `tenant-async`.
#[cfg(feature = "tokio")]
fn async_traffic(dir: &std::path::Path) {
    let guard = Guard::new(RedbStore::open(dir.join("a.idem")).unwrap());
    let key = Key::new("tenant-async", SECRET_ID).unwrap();
    let fp = Fingerprint::of(b"qty=1");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let run = || {
        guard.run_async(&key, &fp, |_| async {
            Ok::<_, Infallible>(Response::new(201, "made"))
        })
    };
    assert!(matches!(runtime.block_on(run()), Outcome::Executed(_)));
    assert!(matches!(runtime.block_on(run()), Outcome::Replayed(_)));
}

/// Set in the child process that [`a_guarded_redb_store_reports_outcomes_latencies_and_groups`] runs.
const METRICS_CHILD: &str = "IDEMSTORE_METRICS_CHILD";

/// Runs this binary's test `name` alone in a child process with `env`
/// set, and returns what it printed; the child must pass.
fn run_child(name: &str, env: &str) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(env, "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_guarded_redb_store_reports_outcomes_latencies_and_groups() {
    let text = run_child("observability::metrics_child", METRICS_CHILD);
    assert!(text.contains("1 passed"), "{text}");
}

/// In the child: the traffic under a global recorder, because the store's
/// group metrics come from its committer thread, and the other tests of
/// this binary would record into a global recorder at the same time.
#[test]
fn metrics_child() {
    if std::env::var_os(METRICS_CHILD).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();
    traffic(dir.path());
    let snapshot = snapshotter.snapshot().into_vec();
    let find = |name: &str, label: Option<(&str, &str)>| -> Option<&DebugValue> {
        snapshot.iter().find_map(|(k, _, _, v)| {
            let key = k.key();
            let labelled =
                label.is_none_or(|(lk, lv)| key.labels().any(|l| l.key() == lk && l.value() == lv));
            (key.name() == name && labelled).then_some(v)
        })
    };
    let counter = |outcome: &str| match find(GUARD_OUTCOMES, Some(("outcome", outcome))) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{outcome}: {other:?}"),
    };
    assert_eq!(counter("executed"), 2);
    assert_eq!(counter("replayed"), 1);
    assert_eq!(counter("conflicted"), 1);
    assert_eq!(counter("handler_failed"), 1);
    assert!(matches!(
        find(GUARD_TAKEOVERS, None),
        Some(DebugValue::Counter(1))
    ));
    let samples = |name: &str| match find(name, None) {
        Some(DebugValue::Histogram(v)) => v.len(),
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(samples(GUARD_BEGIN_SECONDS), 5, "one per request");
    assert_eq!(
        samples(GUARD_COMPLETE_SECONDS),
        2,
        "one per stored response"
    );
    // Claims and completions are written in groups, each a log frame.
    assert!(samples(REDB_GROUP_SIZE) >= 4);
    assert_eq!(samples(REDB_GROUP_SIZE), samples(REDB_LOG_SYNC_SECONDS));
    assert!(matches!(find(REDB_MEMTABLE_BYTES, None), Some(DebugValue::Gauge(b)) if b.0 > 0.0));
    assert!(
        matches!(find(REDB_LOG_FILL_RATIO, None), Some(DebugValue::Gauge(f)) if f.0 > 0.0 && f.0 <= 1.0)
    );
    // No metric is labelled with a key id.
    assert!(!format!("{snapshot:?}").contains(SECRET_ID));
}

/// Set in the child process that [`requests_are_spans_with_scope_outcome_and_token_but_never_the_key_id`] runs.
const CHILD: &str = "IDEMSTORE_TRACING_CHILD";

/// In the child: the traffic under a global formatting subscriber, printed
/// to stdout. A child process, because tracing caches whether a call site
/// is wanted globally, and the other tests of this binary run the same
/// call sites at the same time without a subscriber.
#[test]
fn tracing_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(std::io::stdout)
        .init();
    let dir = tempfile::tempdir().unwrap();
    traffic(dir.path());
    #[cfg(feature = "tokio")]
    async_traffic(dir.path());
}

#[test]
fn requests_are_spans_with_scope_outcome_and_token_but_never_the_key_id() {
    let text = run_child("observability::tracing_child", CHILD);
    assert!(text.contains("store opened"), "{text}");
    assert!(text.contains("idemstore.request{scope=tenant-7"), "{text}");
    assert!(text.contains("idemstore.store{op=\"begin\"}"), "{text}");
    for outcome in ["executed", "replayed", "conflicted", "handler_failed"] {
        assert!(
            text.contains(&format!("outcome=\"{outcome}\"")),
            "{outcome}: {text}"
        );
    }
    // The async run's outcome is in its own span.
    #[cfg(feature = "tokio")]
    for outcome in ["executed", "replayed"] {
        let outcome = format!("outcome=\"{outcome}\"");
        let async_span = text
            .lines()
            .any(|l| l.contains("idemstore.request{scope=tenant-async") && l.contains(&outcome));
        assert!(async_span, "{outcome} (async): {text}");
    }
    assert!(text.contains("token=1"), "{text}");
    assert!(
        text.contains("claim taken over after the owner's lease passed")
            && text.contains("attempt=2"),
        "{text}"
    );
    // Not at any level: a key id can be personal data.
    assert!(!text.contains(SECRET_ID), "{text}");
}
