//! Same-run comparison of the message side: payments applied to an account
//! table through an inbox, messages/s at batch sizes 1, 10, 100 and 1,000,
//! with 0% and 20% redeliveries, on idemstore's `Inbox::handle_batch`,
//! today's one-message `Inbox::handle`, and PostgreSQL as a user would
//! write it (an inbox table with the message id as primary key and the
//! account update in one transaction per batch; `bench/src/inbox.rs`).
//! Every cell is interleaved round by round, so all sides see the same
//! disk weather; the table shows medians and ratios.
//!
//! ```text
//! pgd=$(mktemp -d); eval "$(scripts/pg-test-cluster start "$pgd")"
//! cargo run --release -p idemstore-bench --features postgres --bin inbox_compare -- --rounds 3
//! scripts/pg-test-cluster stop "$pgd"
//! cargo run --release -p idemstore-bench --bin inbox_compare -- --smoke   # CI: a table, not a measurement
//! ```
//!
//! Options: `--rounds N` (3), `--seconds S` per cell (2), `--smoke` (one
//! short round), `--json` (one JSON object on stdout instead of the table),
//! `--require-pg` (fail when PostgreSQL is not there: the feature is off or
//! `IDEMSTORE_PG_URL` is not set), `--batches 10,100` (other batch sizes),
//! `--no-handle` (without the one-message rows), `--pg-only` (only the
//! PostgreSQL rows), `--pg-per-message` (a row of the hand-written PostgreSQL side with one
//! `UPDATE` statement per message, as a per-message handler writes it),
//! `--pg-handler execute|typed|none|set` (what `PgInbox`'s handler runs:
//! the SQL text through `execute`, prepared and run, the default; through
//! `execute_typed`, one round trip; nothing, the inbox's own cost, with the
//! credited total not checked; `set`: `PgInbox::handle_set`, the batch's
//! new payments credited in one statement, as the hand-written side does), `--pg-fail-percent P` (P % of the
//! payments fail in their `PgInbox` handler's first run, after its write,
//! and are delivered again at once in a batch of their own: what a failing
//! message costs).

use idemstore_bench::inbox::{Feed, Ours, Tally};
use idemstore_bench::peers::{self, BoxResult};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const BATCHES: [usize; 4] = [1, 10, 100, 1_000];
const REDELIVERY_PERCENT: [u64; 2] = [0, 20];

/// A row of the table: which side, and how it takes messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Side {
    /// `Inbox::handle`, one call per message (the batch size only sets how
    /// many are fed at a time: it is always one commit per message).
    Handle,
    /// `Inbox::handle_batch`.
    Batch,
    /// `Inbox::handle_batch` on an inbox with `quick_repair(false)`.
    BatchOnePhase,
    /// PostgreSQL, one transaction per batch.
    Postgres,
    /// PostgreSQL, one transaction per batch, one `UPDATE` per message
    /// (`--pg-per-message`).
    PostgresPerMessage,
    /// idemstore's `PgInbox::handle_batch` on PostgreSQL.
    PgInbox,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Handle => "idemstore Inbox::handle (one message per commit)",
            Side::Batch => "idemstore Inbox::handle_batch",
            Side::BatchOnePhase => "idemstore Inbox::handle_batch, quick_repair(false)",
            Side::Postgres => "PostgreSQL (inbox table + UPDATE, one txn per batch)",
            Side::PostgresPerMessage => "PostgreSQL (inbox table, one UPDATE per message)",
            Side::PgInbox => "idemstore PgInbox::handle_batch (PostgreSQL)",
        }
    }
}

/// Runs one cell for `duration`: messages/s, checked.
fn cell(
    side: Side,
    batch: usize,
    redelivery: u64,
    duration: Duration,
    tag: &str,
    pg: PgOptions,
) -> BoxResult<f64> {
    let mut feed = Feed::new(redelivery, 0xFEED ^ batch as u64);
    let mut total = Tally::default();
    let mut credited = 0i64;
    let start = Instant::now();
    match side {
        Side::Handle | Side::Batch | Side::BatchOnePhase => {
            let dir = tempfile::tempdir()?;
            let ours = Ours::open(dir.path(), side != Side::BatchOnePhase)?;
            let mut seen = std::collections::HashSet::new();
            while start.elapsed() < duration {
                let payments = feed.batch(batch);
                let t = if side == Side::Handle {
                    ours.one_by_one(&payments)?
                } else {
                    ours.batch(&payments)?
                };
                for p in &payments {
                    if seen.insert(p.id) {
                        credited += p.amount;
                    }
                }
                total.messages += t.messages;
                total.handled += t.handled;
            }
            let elapsed = start.elapsed().as_secs_f64();
            // Exactly once: what was credited is the sum of distinct payments.
            assert_eq!(ours.total()?, credited, "{side:?} {batch} {redelivery}%");
            assert_eq!(total.handled, seen.len() as u64);
            Ok(total.messages as f64 / elapsed)
        }
        Side::Postgres => pg_cell(&mut feed, batch, duration, tag, PgSide::Set, pg),
        Side::PostgresPerMessage => {
            pg_cell(&mut feed, batch, duration, tag, PgSide::PerMessage, pg)
        }
        Side::PgInbox => pg_cell(&mut feed, batch, duration, tag, PgSide::Ours, pg),
    }
}

/// Which PostgreSQL side a cell runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PgSide {
    /// The hand-written set-based SQL.
    Set,
    /// The hand-written SQL with one `UPDATE` per message.
    PerMessage,
    /// `PgInbox::handle_batch`.
    Ours,
}

/// `--pg-handler`: what `PgInbox`'s handler runs (see
/// `idemstore_bench::inbox::PgHandler`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PgHandlerArg {
    Execute,
    Typed,
    None,
    Set,
}

/// The PostgreSQL options: `--pg-handler`, `--pg-fail-percent`.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(
    not(feature = "postgres"),
    allow(dead_code, reason = "read by the PostgreSQL cells only")
)]
struct PgOptions {
    handler: PgHandlerArg,
    fail_percent: u64,
}

fn parse_pg_handler(s: &str) -> BoxResult<PgHandlerArg> {
    Ok(match s {
        "execute" => PgHandlerArg::Execute,
        "typed" => PgHandlerArg::Typed,
        "none" => PgHandlerArg::None,
        "set" => PgHandlerArg::Set,
        other => return Err(format!("--pg-handler {other}: execute, typed, none or set").into()),
    })
}

#[cfg(feature = "postgres")]
fn pg_cell(
    feed: &mut Feed,
    batch: usize,
    duration: Duration,
    tag: &str,
    side: PgSide,
    pg: PgOptions,
) -> BoxResult<f64> {
    use idemstore_bench::inbox::PgHandler;
    let handler = pg.handler;
    let url = pg_url().ok_or("IDEMSTORE_PG_URL is not set")?;
    if side == PgSide::Ours {
        let handler = match handler {
            PgHandlerArg::Execute => PgHandler::Execute,
            PgHandlerArg::Typed => PgHandler::Typed,
            PgHandlerArg::None => PgHandler::None,
            PgHandlerArg::Set => PgHandler::Set,
        };
        let pg = std::cell::RefCell::new(
            idemstore_bench::inbox::PgOurs::open_with(&url, tag, handler)?
                .fail_percent(pg.fail_percent),
        );
        return drive(
            feed,
            batch,
            duration,
            |p| pg.borrow().batch(p),
            // Without a statement nothing is credited: no total to check.
            (handler != PgHandler::None).then_some(|| pg.borrow_mut().total()),
        );
    }
    let mut pg = idemstore_bench::inbox::Pg::open(&url, tag)?;
    let pg = std::cell::RefCell::new(&mut pg);
    drive(
        feed,
        batch,
        duration,
        |p| {
            if side == PgSide::PerMessage {
                pg.borrow_mut().batch_per_message(p)
            } else {
                pg.borrow_mut().batch(p)
            }
        },
        Some(|| pg.borrow_mut().total()),
    )
}

/// Feeds batches to `run` for `duration` and checks the credited total
/// (exactly once) at the end: messages/s.
#[cfg(feature = "postgres")]
fn drive(
    feed: &mut Feed,
    batch: usize,
    duration: Duration,
    mut run: impl FnMut(&[idemstore_bench::inbox::Payment]) -> BoxResult<Tally>,
    total: Option<impl FnOnce() -> BoxResult<i64>>,
) -> BoxResult<f64> {
    let mut seen = std::collections::HashSet::new();
    let (mut messages, mut handled, mut credited) = (0u64, 0u64, 0i64);
    let start = Instant::now();
    while start.elapsed() < duration {
        let payments = feed.batch(batch);
        let t = run(&payments)?;
        for p in &payments {
            if seen.insert(p.id) {
                credited += p.amount;
            }
        }
        messages += t.messages;
        handled += t.handled;
    }
    let elapsed = start.elapsed().as_secs_f64();
    if let Some(total) = total {
        assert_eq!(total()?, credited, "postgres {batch}");
    }
    assert_eq!(handled, seen.len() as u64);
    Ok(messages as f64 / elapsed)
}

#[cfg(not(feature = "postgres"))]
fn pg_cell(
    _: &mut Feed,
    _: usize,
    _: Duration,
    _: &str,
    _: PgSide,
    _: PgOptions,
) -> BoxResult<f64> {
    Err("built without the postgres feature".into())
}

fn pg_url() -> Option<String> {
    std::env::var("IDEMSTORE_PG_URL").ok()
}

fn median(mut v: Vec<f64>) -> f64 {
    peers::percentile(&mut v, 0.5)
}

fn main() -> BoxResult<()> {
    let mut rounds = 3usize;
    let mut seconds = 2.0f64;
    let mut json = false;
    let mut require_pg = false;
    let mut batches = BATCHES.to_vec();
    let mut with_handle = true;
    let mut per_message = false;
    let mut pg_handler = None;
    let mut fail_percent = 0u64;
    let mut pg_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--smoke" => {
                rounds = 1;
                seconds = 0.25;
            }
            "--rounds" => rounds = args.next().ok_or("--rounds N")?.parse()?,
            "--seconds" => seconds = args.next().ok_or("--seconds S")?.parse()?,
            "--json" => json = true,
            "--require-pg" => require_pg = true,
            "--batches" => {
                batches = args
                    .next()
                    .ok_or("--batches N,N,..")?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--no-handle" => with_handle = false,
            "--pg-only" => pg_only = true,
            "--pg-per-message" => per_message = true,
            "--pg-fail-percent" => {
                fail_percent = args.next().ok_or("--pg-fail-percent P")?.parse()?
            }
            "--pg-handler" => {
                pg_handler = Some(parse_pg_handler(
                    &args.next().ok_or("--pg-handler execute|typed|none|set")?,
                )?)
            }
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    let pg = cfg!(feature = "postgres") && pg_url().is_some();
    if require_pg && !pg {
        return Err(
            "--require-pg: build with --features postgres and set IDEMSTORE_PG_URL \
                    (scripts/pg-test-cluster start DIR)"
                .into(),
        );
    }
    let mut sides = vec![Side::Batch, Side::BatchOnePhase];
    if pg_only {
        sides.clear();
    }
    if with_handle && !pg_only {
        sides.insert(0, Side::Handle);
    }
    if pg {
        sides.push(Side::Postgres);
        if per_message {
            sides.push(Side::PostgresPerMessage);
        }
        sides.push(Side::PgInbox);
    }
    let pg_options = PgOptions {
        handler: pg_handler.unwrap_or(PgHandlerArg::Execute),
        fail_percent,
    };
    let duration = Duration::from_secs_f64(seconds);
    if !json {
        println!(
            "inbox_compare: {rounds} round(s) × {seconds} s per cell; batches {BATCHES:?}, \
             redeliveries {REDELIVERY_PERCENT:?} %{}",
            if pg {
                ""
            } else {
                "; PostgreSQL skipped (--features postgres and IDEMSTORE_PG_URL)"
            }
        );
    }
    let mut runs: BTreeMap<(u64, Side, usize), Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        for &redelivery in &REDELIVERY_PERCENT {
            for &batch in &batches {
                for &side in &sides {
                    // One message per commit is slow: its cells past a
                    // batch of 10 would only repeat the same figure.
                    if side == Side::Handle && batch > 10 {
                        continue;
                    }
                    let tag = format!("{round}_{redelivery}_{batch}");
                    let rate = cell(side, batch, redelivery, duration, &tag, pg_options)?;
                    runs.entry((redelivery, side, batch))
                        .or_default()
                        .push(rate);
                }
            }
        }
        if !json {
            eprintln!("round {} of {rounds} done", round + 1);
        }
    }
    let med = |r: u64, s: Side, b: usize| runs.get(&(r, s, b)).cloned().map(median);
    if json {
        let mut cells = Vec::new();
        for ((r, s, b), v) in &runs {
            cells.push(format!(
                "{{\"redelivery_percent\":{r},\"side\":\"{s:?}\",\"batch\":{b},\"median_msgs_per_s\":{:.0},\"runs\":{v:?}}}",
                median(v.clone())
            ));
        }
        println!(
            "{{\"rounds\":{rounds},\"seconds\":{seconds},\"cells\":[{}]}}",
            cells.join(",")
        );
        return Ok(());
    }
    for &r in &REDELIVERY_PERCENT {
        println!("\nmessages/s, {r}% redeliveries (median of {rounds})");
        print!("| side |");
        for b in &batches {
            print!(" batch {b} |");
        }
        println!();
        println!("|---|{}", "---|".repeat(batches.len()));
        for &s in &sides {
            print!("| {} |", s.label());
            for &b in &batches {
                match med(r, s, b) {
                    Some(v) => print!(" {v:.0} |"),
                    None => print!(" |"),
                }
            }
            println!();
        }
        let handle = med(r, Side::Handle, 1).unwrap_or(f64::NAN);
        for &b in &batches {
            for side in [Side::Batch, Side::BatchOnePhase] {
                if !sides.contains(&side) {
                    continue;
                }
                let ours = med(r, side, b).unwrap_or(f64::NAN);
                let vs_pg = med(r, Side::Postgres, b)
                    .map(|p| format!(", {:.1}× PostgreSQL", ours / p))
                    .unwrap_or_default();
                println!(
                    "batch {b}, {}: {:.1}× handle{vs_pg}",
                    side.label(),
                    ours / handle
                );
            }
        }
    }
    Ok(())
}
