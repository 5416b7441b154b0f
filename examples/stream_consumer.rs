//! An at-least-once queue made effectively-once: a Redis Streams consumer
//! group feeds payments to `Inbox::handle_batch`, which applies them to an
//! account table in the store's own redb file, and the consumer
//! acknowledges (`XACK`) a batch only after its commit.
//!
//! A consumer that dies after the commit but before the `XACK` leaves its
//! entries pending: the next consumer claims them (`XAUTOCLAIM`, after
//! `--min-idle-ms`) and the inbox answers `Duplicate` without running the
//! handler. One that dies before the commit leaves nothing in the file: the
//! claimed entries are handled as new. Either way every payment is applied
//! once (`check`). `tests/it/stream_consumer.rs` does this with 20+ SIGKILLs.
//!
//! ```text
//! dir=$(mktemp -d)
//! eval "$(scripts/redis-test-server start "$dir/redis")"      # exports IDEMSTORE_REDIS_URL
//! cargo run --release --example stream_consumer -- produce 100000
//! cargo run --release --example stream_consumer -- consume --store "$dir/ledger.idem" --consumer c1
//! #   ... kill -9 it, run it again with --consumer c2: it claims c1's pending entries
//! cargo run --release --example stream_consumer -- check --store "$dir/ledger.idem" --payments 100000
//! scripts/redis-test-server stop "$dir/redis"; rm -rf "$dir"
//! ```
//!
//! Options: `--stream NAME` (`payments`), `--batch N` (100), `--min-idle-ms
//! MS` (how long an entry stays pending before another consumer claims it;
//! 5000), `--forever` (keep waiting for entries instead of exiting when the
//! stream is drained), `--no-quick-repair` (`Inbox::quick_repair(false)`).
//! For tests, `STREAM_CONSUMER_CRASH=after-commit:K` or `before-commit:K`
//! makes the consumer SIGKILL itself at its K-th batch, after the commit
//! and before the `XACK`, or inside the last handler before the commit.

use idemstore::redb::engine::{ReadableTable, TableDefinition, WriteTransaction};
use idemstore::redb::{Delivery, Inbox, Message};
use idemstore::{BoxError, Fingerprint, Key, RedbStore, Response};
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// account -> balance.
pub const BALANCES: TableDefinition<u64, i64> = TableDefinition::new("ledger.balances");
/// payment id -> how many times it was applied (1, or the test fails).
pub const APPLIED: TableDefinition<u64, u32> = TableDefinition::new("ledger.applied");
/// The consumer group.
pub const GROUP: &str = "ledger";
/// Accounts the payments go to.
pub const ACCOUNTS: u64 = 50;
/// Entries written per round trip by `produce`.
const PRODUCE_CHUNK: u64 = 1_000;

/// Payment `id`: its account and amount (a function of the id, so `check`
/// can recompute what exactly-once gives).
pub fn payment(id: u64) -> (u64, i64) {
    (id % ACCOUNTS, (id % 97) as i64 + 1)
}

/// Creates the stream and the group (idempotent), then appends payments
/// `first..first + n`.
pub fn produce(url: &str, stream: &str, first: u64, n: u64) -> Result<(), BoxError> {
    let mut con = redis::Client::open(url)?.get_connection()?;
    let created: redis::RedisResult<()> = redis::cmd("XGROUP")
        .arg(&["CREATE", stream, GROUP, "0", "MKSTREAM"])
        .query(&mut con);
    if let Err(e) = created
        && e.code() != Some("BUSYGROUP")
    {
        return Err(e.into());
    }
    let mut id = first;
    while id < first + n {
        let mut pipe = redis::pipe();
        for id in id..(id + PRODUCE_CHUNK).min(first + n) {
            let (account, amount) = payment(id);
            pipe.cmd("XADD")
                .arg(stream)
                .arg("*")
                .arg("pid")
                .arg(id)
                .arg("account")
                .arg(account)
                .arg("amount")
                .arg(amount)
                .ignore();
        }
        pipe.query::<()>(&mut con)?;
        id += PRODUCE_CHUNK;
    }
    Ok(())
}

/// Where the consumer SIGKILLs itself (tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crash {
    /// After the commit of the K-th batch that applied something new
    /// (not only redeliveries), before its `XACK`.
    AfterCommit(u64),
    /// In the K-th batch's last handler: the rows are written, not committed.
    BeforeCommit(u64),
}

impl Crash {
    /// From `STREAM_CONSUMER_CRASH` (`after-commit:K`, `before-commit:K`).
    pub fn from_env() -> Option<Crash> {
        let spec = std::env::var("STREAM_CONSUMER_CRASH").ok()?;
        let (point, k) = spec.split_once(':')?;
        let k = k.parse().ok()?;
        match point {
            "after-commit" => Some(Crash::AfterCommit(k)),
            "before-commit" => Some(Crash::BeforeCommit(k)),
            _ => None,
        }
    }
}

/// SIGKILL this process: no destructor, no flush, as a power cut or an OOM
/// kill would leave it.
fn kill_self() -> ! {
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &std::process::id().to_string()])
        .status();
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A consumer's settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// The Redis server.
    pub url: String,
    /// The stream.
    pub stream: String,
    /// The store file (the ledger's tables live in it).
    pub store: PathBuf,
    /// This consumer's name in the group.
    pub consumer: String,
    /// Entries per batch (one commit each).
    pub batch: usize,
    /// An entry pending this long is claimed from its (dead) consumer.
    pub min_idle: Duration,
    /// Return once the stream is drained (nothing new, nothing pending).
    pub until_drained: bool,
    /// `Inbox::quick_repair`.
    pub quick_repair: bool,
    /// Where to SIGKILL itself, if anywhere.
    pub crash: Option<Crash>,
}

/// What a consumer did.
#[derive(Clone, Copy, Debug, Default)]
pub struct Summary {
    /// Batches handled (one commit each).
    pub batches: u64,
    /// Entries handled (fresh and redelivered).
    pub messages: u64,
    /// Applied for the first time.
    pub handled: u64,
    /// Already applied (a redelivery): skipped.
    pub duplicates: u64,
    /// Claimed from a dead consumer's pending entries.
    pub claimed: u64,
    /// Acknowledged without being applied: the payment id was used for
    /// another payment before.
    pub conflicts: u64,
    /// Left pending (a failed handler): claimed again later.
    pub failed: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
}

/// A batch of entries for the consumer loop, or "nothing to read now".
enum Fetched {
    Entries {
        entries: Vec<StreamId>,
        claimed: bool,
    },
    Idle,
}

/// The reader thread: claims what dead consumers left pending (at the
/// start, when the stream has nothing new, and every `min_idle`), otherwise
/// reads new entries; hands batches to the consumer loop, one ahead of it.
fn read_loop(cfg: &Config, out: &mpsc::SyncSender<Fetched>) -> Result<(), BoxError> {
    let mut con = redis::Client::open(cfg.url.as_str())?.get_connection()?;
    let mut last_claim: Option<Instant> = None;
    loop {
        let claim_due = last_claim.is_none_or(|t| t.elapsed() >= cfg.min_idle);
        if claim_due {
            last_claim = Some(Instant::now());
            let mut cursor = "0-0".to_owned();
            loop {
                let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
                    .arg(&cfg.stream)
                    .arg(GROUP)
                    .arg(&cfg.consumer)
                    .arg(cfg.min_idle.as_millis() as u64)
                    .arg(&cursor)
                    .arg("COUNT")
                    .arg(cfg.batch)
                    .query(&mut con)?;
                if !reply.claimed.is_empty() {
                    let fetched = Fetched::Entries {
                        entries: reply.claimed,
                        claimed: true,
                    };
                    if out.send(fetched).is_err() {
                        return Ok(());
                    }
                }
                if reply.next_stream_id == "0-0" {
                    break;
                }
                cursor = reply.next_stream_id;
            }
        }
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg(&["GROUP", GROUP, &cfg.consumer, "COUNT"])
            .arg(cfg.batch)
            .arg(&["BLOCK", "50", "STREAMS", &cfg.stream, ">"])
            .query(&mut con)?;
        let entries: Vec<StreamId> = reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .collect();
        let fetched = if entries.is_empty() {
            // Nothing new: claim next round, whatever the time.
            last_claim = None;
            Fetched::Idle
        } else {
            Fetched::Entries {
                entries,
                claimed: false,
            }
        };
        if out.send(fetched).is_err() {
            return Ok(());
        }
    }
}

/// A stream entry as an inbox delivery: the payment id is the message id
/// (a producer's retry of the same payment is a duplicate too), the
/// fingerprint its account and amount.
fn delivery(entry: &StreamId) -> Result<Message<(u64, u64, i64)>, BoxError> {
    let field = |name: &str| -> Result<i64, BoxError> {
        entry
            .get::<i64>(name)
            .ok_or_else(|| format!("entry {} has no numeric {name}", entry.id).into())
    };
    let (pid, account, amount) = (
        field("pid")? as u64,
        field("account")? as u64,
        field("amount")?,
    );
    let key = Key::new("payments", pid.to_string())?;
    let fingerprint = Fingerprint::of_parts([&account.to_be_bytes()[..], &amount.to_be_bytes()]);
    Ok(Message::new(key, fingerprint, (pid, account, amount)))
}

/// The handler: credit the account and count the payment as applied.
fn apply(
    txn: &WriteTransaction,
    pid: u64,
    account: u64,
    amount: i64,
) -> Result<Response, BoxError> {
    let mut balances = txn.open_table(BALANCES)?;
    let balance = balances.get(account)?.map_or(0, |v| v.value()) + amount;
    balances.insert(account, balance)?;
    let mut applied = txn.open_table(APPLIED)?;
    let times = applied.get(pid)?.map_or(0, |v| v.value()) + 1;
    applied.insert(pid, times)?;
    Ok(Response::new(200, balance.to_string()))
}

/// What the acker thread is asked to do.
enum Ack {
    /// Acknowledge these entries: their batch is committed.
    Ids(Vec<String>),
    /// Answer once every earlier `Ids` is acknowledged.
    Flush(mpsc::SyncSender<()>),
}

/// The acker thread: `XACK`s committed batches while the consumer loop
/// commits the next one (with `appendfsync always` an `XACK` waits for
/// Redis's fsync).
fn ack_loop(cfg: &Config, acks: &mpsc::Receiver<Ack>) -> Result<(), BoxError> {
    let mut con = redis::Client::open(cfg.url.as_str())?.get_connection()?;
    for ack in acks.iter() {
        match ack {
            Ack::Ids(ids) => {
                redis::cmd("XACK")
                    .arg(&cfg.stream)
                    .arg(GROUP)
                    .arg(&ids)
                    .query::<u64>(&mut con)?;
            }
            Ack::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
    Ok(())
}

/// Consumes the stream: read (or claim) a batch, handle it in one commit,
/// acknowledge it. Three threads: the reader fetches the next batch and
/// the acker acknowledges the previous one while this one commits. Returns
/// when the stream is drained (with `until_drained`), or on an error.
pub fn consume(cfg: &Config) -> Result<Summary, BoxError> {
    let store = RedbStore::open(&cfg.store)?;
    let inbox = Inbox::new(store).quick_repair(cfg.quick_repair);
    let mut con = redis::Client::open(cfg.url.as_str())?.get_connection()?;
    let (fetch_tx, fetched) = mpsc::sync_channel(1);
    let (ack_tx, ack_rx) = mpsc::sync_channel(4);
    let reader = {
        let cfg = cfg.clone();
        std::thread::spawn(move || read_loop(&cfg, &fetch_tx))
    };
    let acker = {
        let cfg = cfg.clone();
        std::thread::spawn(move || ack_loop(&cfg, &ack_rx))
    };
    let mut summary = Summary::default();
    // Batches that applied something new (the crash point counts these).
    let mut applying = 0;
    let start = Instant::now();
    let run = (|| -> Result<(), BoxError> {
        for fetched in fetched.iter() {
            let (entries, claimed) = match fetched {
                Fetched::Entries { entries, claimed } => (entries, claimed),
                Fetched::Idle => {
                    // Drained when everything handled is acknowledged and
                    // the group has nothing pending either.
                    let (done, flushed) = mpsc::sync_channel(1);
                    ack_tx.send(Ack::Flush(done))?;
                    flushed.recv()?;
                    let pending: (u64, redis::Value, redis::Value, redis::Value) =
                        redis::cmd("XPENDING")
                            .arg(&cfg.stream)
                            .arg(GROUP)
                            .query(&mut con)?;
                    if cfg.until_drained && pending.0 == 0 {
                        return Ok(());
                    }
                    continue;
                }
            };
            summary.batches += 1;
            let handled_before = summary.handled;
            let batch: Vec<_> = entries.iter().map(delivery).collect::<Result<_, _>>()?;
            let crash = cfg.crash;
            let n = summary.batches;
            let answers = inbox.handle_batch(&batch, |txn, _claim, m| {
                let (pid, account, amount) = m.payload;
                let response = apply(txn, pid, account, amount)?;
                if crash == Some(Crash::BeforeCommit(n))
                    && batch.last().is_some_and(|l| std::ptr::eq(m, l))
                {
                    kill_self();
                }
                Ok::<_, BoxError>(response)
            })?;
            let mut ack = Vec::with_capacity(entries.len());
            for (entry, answer) in entries.into_iter().zip(answers) {
                match answer {
                    Ok(Delivery::Handled(_)) => summary.handled += 1,
                    Ok(Delivery::Duplicate(_)) => summary.duplicates += 1,
                    Ok(Delivery::Conflict) => {
                        // The payment id was used for another payment: a
                        // producer's bug. Acked (a dead-letter queue would
                        // take it here), never applied.
                        eprintln!("entry {}: payment id reused with other content", entry.id);
                        summary.conflicts += 1;
                    }
                    Ok(other) => {
                        // InFlight (claimed through the Store API) or a
                        // future answer: left pending, claimed again later.
                        eprintln!("entry {}: {other:?}", entry.id);
                        summary.failed += 1;
                        continue;
                    }
                    Err(e) => {
                        // Left pending: claimed and tried again after min_idle.
                        eprintln!("entry {}: {e}", entry.id);
                        summary.failed += 1;
                        continue;
                    }
                }
                ack.push(entry.id);
            }
            summary.messages += batch.len() as u64;
            if claimed {
                summary.claimed += batch.len() as u64;
            }
            if summary.handled > handled_before {
                applying += 1;
                if crash == Some(Crash::AfterCommit(applying)) {
                    kill_self();
                }
            }
            // Only after the commit: a crash before the XACK redelivers the
            // batch, and the inbox skips it.
            if !ack.is_empty() {
                ack_tx.send(Ack::Ids(ack))?;
            }
        }
        Ok(())
    })();
    summary.elapsed = start.elapsed();
    // The helpers stop when their channels close; an error of theirs (a
    // closed channel above is its symptom) is the run's.
    drop(fetched);
    drop(ack_tx);
    for (name, thread) in [("reader", reader), ("acker", acker)] {
        match thread.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("the {name}: {e}").into()),
            Err(_) => return Err(format!("the {name} panicked").into()),
        }
    }
    run.map(|()| summary)
}

/// What the ledger holds, against what exactly-once gives for payments
/// `0..payments`.
#[derive(Debug, PartialEq, Eq)]
pub struct Report {
    /// Payments applied once.
    pub applied_once: u64,
    /// Payment ids applied more than once, or outside `0..payments`.
    pub wrong: Vec<u64>,
    /// Payments never applied.
    pub missing: u64,
    /// Balances that differ from exactly-once: account -> (found, expected).
    pub bad_balances: BTreeMap<u64, (i64, i64)>,
}

impl Report {
    /// True when the ledger is exactly what exactly-once processing gives.
    pub fn exact(&self) -> bool {
        self.wrong.is_empty() && self.missing == 0 && self.bad_balances.is_empty()
    }
}

/// The ledger's tables: balances, and how many times each payment id was
/// applied. No consumer may hold the store.
#[allow(clippy::type_complexity, reason = "two plain maps, named in the doc")]
pub fn ledger(store: &Path) -> Result<(BTreeMap<u64, i64>, BTreeMap<u64, u32>), BoxError> {
    let inbox = Inbox::new(RedbStore::open(store)?);
    inbox.read(|txn| {
        let mut balances = BTreeMap::new();
        let mut applied = BTreeMap::new();
        // A table that was never written does not exist yet.
        if let Ok(t) = txn.open_table(BALANCES) {
            for e in t.iter()? {
                let (k, v) = e?;
                balances.insert(k.value(), v.value());
            }
        }
        if let Ok(t) = txn.open_table(APPLIED) {
            for e in t.iter()? {
                let (k, v) = e?;
                applied.insert(k.value(), v.value());
            }
        }
        Ok((balances, applied))
    })
}

/// The payment ids the ledger has applied.
pub fn applied(store: &Path) -> Result<std::collections::BTreeSet<u64>, BoxError> {
    Ok(ledger(store)?.1.into_keys().collect())
}

/// Reads the ledger (no consumer may hold the store) and compares it with
/// payments `0..payments` applied once each.
pub fn check(store: &Path, payments: u64) -> Result<Report, BoxError> {
    let (balances, applied) = ledger(store)?;
    let mut expected: BTreeMap<u64, i64> = BTreeMap::new();
    for id in 0..payments {
        let (account, amount) = payment(id);
        *expected.entry(account).or_insert(0) += amount;
    }
    let mut bad_balances = BTreeMap::new();
    for account in 0..ACCOUNTS {
        let found = balances.get(&account).copied().unwrap_or(0);
        let want = expected.get(&account).copied().unwrap_or(0);
        if found != want {
            bad_balances.insert(account, (found, want));
        }
    }
    let wrong: Vec<u64> = applied
        .iter()
        .filter(|&(&id, &times)| times != 1 || id >= payments)
        .map(|(&id, _)| id)
        .collect();
    let applied_once = applied.len() as u64 - wrong.len() as u64;
    Ok(Report {
        applied_once,
        missing: payments.saturating_sub(applied_once),
        wrong,
        bad_balances,
    })
}

fn usage() -> BoxError {
    "usage: stream_consumer produce N | consume --store FILE --consumer NAME [--batch N] \
     [--min-idle-ms MS] [--forever] [--no-quick-repair] | check --store FILE --payments N \
     (all take --stream NAME; the server is IDEMSTORE_REDIS_URL)"
        .into()
}

fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let command = args.next().ok_or_else(usage)?;
    let mut n: Option<u64> = None;
    let mut cfg = Config {
        url: std::env::var("IDEMSTORE_REDIS_URL").unwrap_or_default(),
        stream: "payments".to_owned(),
        store: PathBuf::from("ledger.idem"),
        consumer: "c1".to_owned(),
        batch: 100,
        min_idle: Duration::from_secs(5),
        until_drained: true,
        quick_repair: true,
        crash: Crash::from_env(),
    };
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(usage);
        match arg.as_str() {
            "--stream" => cfg.stream = value()?,
            "--store" => cfg.store = value()?.into(),
            "--consumer" => cfg.consumer = value()?,
            "--batch" => cfg.batch = value()?.parse()?,
            "--min-idle-ms" => cfg.min_idle = Duration::from_millis(value()?.parse()?),
            "--payments" => n = Some(value()?.parse()?),
            "--forever" => cfg.until_drained = false,
            "--no-quick-repair" => cfg.quick_repair = false,
            other if n.is_none() && command == "produce" => n = Some(other.parse()?),
            _ => return Err(usage()),
        }
    }
    if cfg.url.is_empty() && command != "check" {
        return Err(
            "IDEMSTORE_REDIS_URL is not set: eval \"$(scripts/redis-test-server start DIR)\""
                .into(),
        );
    }
    match command.as_str() {
        "produce" => {
            let n = n.ok_or_else(usage)?;
            let start = Instant::now();
            produce(&cfg.url, &cfg.stream, 0, n)?;
            println!(
                "produced {n} payments to {} in {:.2?}",
                cfg.stream,
                start.elapsed()
            );
        }
        "consume" => {
            let s = consume(&cfg)?;
            println!(
                "{}: {} messages in {} batches ({} handled, {} duplicates, {} claimed from dead consumers, {} conflicts, {} failed) in {:.2?}: {:.0} messages/s",
                cfg.consumer,
                s.messages,
                s.batches,
                s.handled,
                s.duplicates,
                s.claimed,
                s.conflicts,
                s.failed,
                s.elapsed,
                s.messages as f64 / s.elapsed.as_secs_f64()
            );
        }
        "check" => {
            let report = check(&cfg.store, n.ok_or_else(usage)?)?;
            println!("{report:?}");
            if !report.exact() {
                return Err("the ledger is not exactly-once".into());
            }
            println!(
                "exactly once: {} payments applied once each",
                report.applied_once
            );
        }
        _ => return Err(usage()),
    }
    Ok(())
}
