//! Commands that touch every record: `sweep`, `compact`, `verify`,
//! `salvage`, `export`, `import`, and the log's `log` and `recover`.

use super::commands::bar;
use super::keys::{raw_key_json, raw_shown};
use super::replace::Building;
use super::{
    EXIT_ERROR, EXIT_OK, EXIT_PROBLEMS, EXIT_REFUSED, Failure, Io, Outcome, PROGRESS_MIN_RECORDS,
    existing_store_file, file_bytes, open_view,
};
use idemstore::limits::MAX_SWEEP_BATCH;
use idemstore::redb::admin::{ProblemKind, export_line, parse_line};
use idemstore::{Error, Key, Record, RedbStore, Result, Store};
use serde_json::json;
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::ops::ControlFlow;
use std::path::Path;
use std::time::{Duration, Instant};

/// `compact` repeats redb's compaction while it still moves pages, at most
/// this many times (redb moves a bounded amount per call).
pub(crate) const MAX_COMPACT_ROUNDS: u32 = 32;

fn spinner(io: &Io<'_>, records: u64, what: &str) -> indicatif::ProgressBar {
    if !io.progress || records < PROGRESS_MIN_RECORDS {
        return indicatif::ProgressBar::hidden();
    }
    let s = indicatif::ProgressBar::new_spinner();
    s.set_message(what.to_owned());
    s.enable_steady_tick(Duration::from_millis(120));
    s
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn secs(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

pub(crate) fn sweep(store: &RedbStore, path: &Path, io: &mut Io<'_>) -> Outcome {
    let json = io.json;
    let now = io.now;
    let started = Instant::now();
    let admin = store.admin();
    let due = admin.count_due(now, u64::MAX)?;
    let bar = bar(io, due, "sweeping");
    let mut removed = 0u64;
    let mut batches = 0u64;
    // Every call removes up to a batch of due index entries (records or
    // stale entries), so this many rounds empty the due range.
    let max_rounds = due.div_ceil(MAX_SWEEP_BATCH as u64) + 1;
    while batches < max_rounds && admin.count_due(now, 1)? > 0 {
        let n = store.sweep_expired(now, MAX_SWEEP_BATCH)? as u64;
        removed += n;
        batches += 1;
        bar.inc(n);
    }
    bar.finish_and_clear();
    admin.checkpoint()?;
    let left = admin.facts()?.records;
    let elapsed = started.elapsed();
    if json {
        let v = json!({
            "removed": removed,
            "index_entries_due": due,
            "batches": batches,
            "records_left": left,
            "file_bytes": file_bytes(path),
            "seconds": elapsed.as_secs_f64(),
        });
        writeln!(io.out, "{v}")?;
    } else {
        writeln!(
            io.out,
            "swept {removed} expired records ({}, {}); {left} records left.\n\
             The freed space is reused by new records; `compact` shrinks the file ({} bytes now).",
            plural(batches, "sweep batch", "sweep batches"),
            secs(elapsed),
            file_bytes(path)
        )?;
    }
    Ok(EXIT_OK)
}

pub(crate) fn compact(store: RedbStore, path: &Path, io: &mut Io<'_>) -> Outcome {
    let json = io.json;
    let before = file_bytes(path);
    let started = Instant::now();
    let spin = spinner(io, store.admin().facts()?.records, "compacting");
    let mut rounds = 0u32;
    while rounds < MAX_COMPACT_ROUNDS && store.compact()? {
        rounds += 1;
    }
    // Closing the store lets redb trim the file end; measure after.
    drop(store);
    spin.finish_and_clear();
    let after = file_bytes(path);
    let elapsed = started.elapsed();
    let reclaimed = before.saturating_sub(after);
    if json {
        let v = json!({
            "file_bytes_before": before,
            "file_bytes_after": after,
            "reclaimed_bytes": reclaimed,
            "rounds": rounds,
            "seconds": elapsed.as_secs_f64(),
        });
        writeln!(io.out, "{v}")?;
    } else {
        writeln!(
            io.out,
            "compacted in {} ({}): {before} -> {after} bytes, {reclaimed} reclaimed",
            secs(elapsed),
            plural(u64::from(rounds), "pass", "passes")
        )?;
    }
    Ok(EXIT_OK)
}

/// Where a problem of this kind lives: the table, the engine's pages, or
/// the store's meta entries.
fn table_of(kind: ProblemKind) -> &'static str {
    match kind {
        ProblemKind::EngineRepaired | ProblemKind::EngineDamaged => "pages",
        ProblemKind::Meta => "meta",
        ProblemKind::MissingIndex
        | ProblemKind::OrphanIndex
        | ProblemKind::StaleIndex
        | ProblemKind::BadIndexEntry => "expiry",
        _ => "records",
    }
}

/// `verify`: the log (without opening the store), then the store file
/// through a read-only view (redb's pages, every record and index entry).
/// Writes nothing.
pub(crate) fn verify(path: &Path, io: &mut Io<'_>) -> Outcome {
    existing_store_file(path)?;
    if let Some(code) = verify_log(path, io)? {
        return Ok(code);
    }
    let store = match open_view(path, io) {
        // A file too damaged to open is a verify finding, not a usage error.
        Err(f) if f.is_corrupt() => {
            return Err(Failure::new(
                EXIT_PROBLEMS,
                format!("verify: {} (nothing was written)", f.message),
            ));
        }
        other => other?,
    };
    match verify_store(&store, io) {
        // Damage redb cannot read past ends the check: still a finding.
        Err(f) if f.is_corrupt() => Err(Failure::new(
            EXIT_PROBLEMS,
            format!("verify: {} (nothing was written)", f.message),
        )),
        other => other,
    }
}

fn verify_store(store: &RedbStore, io: &mut Io<'_>) -> Outcome {
    let json = io.json;
    let started = Instant::now();
    let admin = store.admin();
    let facts = admin.facts()?;
    let bar = bar(io, facts.records + facts.index_entries, "verifying");
    let report = admin.verify(|n| {
        if n.is_multiple_of(4096) {
            bar.set_position(n);
        }
    })?;
    bar.finish_and_clear();
    let elapsed = started.elapsed();
    if json {
        let problems: Vec<_> = report
            .problems
            .iter()
            .map(|p| {
                json!({
                    "kind": p.kind.name(),
                    "table": table_of(p.kind),
                    "key": p.key,
                    "detail": p.detail,
                })
            })
            .collect();
        let v = json!({
            "ok": report.is_clean(),
            "records": report.records,
            "index_entries": report.index_entries,
            "problem_count": report.problem_count,
            "problems": problems,
            "problems_truncated": report.problem_count > report.problems.len() as u64,
            "seconds": elapsed.as_secs_f64(),
        });
        writeln!(io.out, "{v}")?;
    } else {
        writeln!(
            io.out,
            "read {} records and {} index entries in {}",
            report.records,
            report.index_entries,
            secs(elapsed)
        )?;
        if report.is_clean() {
            writeln!(
                io.out,
                "OK: every page, record and index entry verifies and the expiry index agrees \
                 with the records (nothing was written)"
            )?;
        } else {
            let rows: Vec<Vec<String>> = report
                .problems
                .iter()
                .map(|p| {
                    vec![
                        p.kind.name().to_owned(),
                        table_of(p.kind).to_owned(),
                        p.key.clone().unwrap_or_else(|| "-".to_owned()),
                        p.detail.clone(),
                    ]
                })
                .collect();
            write!(
                io.out,
                "{}",
                super::format::table(&["PROBLEM", "WHERE", "KEY", "DETAIL"], &rows)
            )?;
            let hidden = report.problem_count - report.problems.len() as u64;
            if hidden > 0 {
                writeln!(io.out, "... and {hidden} more")?;
            }
            writeln!(
                io.out,
                "FAILED: {} (nothing was written; `idemstore salvage STORE --to NEW` copies \
                 what verifies into a new file)",
                plural(report.problem_count, "problem", "problems")
            )?;
        }
    }
    Ok(if report.is_clean() {
        EXIT_OK
    } else {
        EXIT_PROBLEMS
    })
}

/// Creates the export file owner-only: it holds response snapshots.
fn create_private(path: &Path) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)
}

pub(crate) fn export(store: &RedbStore, output: Option<&Path>, io: &mut Io<'_>) -> Outcome {
    let json = io.json;
    let to_file = output.is_some_and(|p| p != Path::new("-"));
    let started = Instant::now();
    let admin = store.admin();
    let facts = admin.facts()?;
    let bar = bar(io, facts.records, "exporting");
    let mut file;
    let out: &mut dyn Write = match output {
        Some(p) if p != Path::new("-") => {
            file = std::io::BufWriter::new(create_private(p)?);
            &mut file
        }
        _ => &mut *io.out,
    };
    let (mut written, mut skipped) = (0u64, Vec::new());
    let mut failed = None;
    admin.scan(|key, record| {
        let line = match (record, key.decode()) {
            (Ok(r), Ok(k)) => export_line(&k, &r),
            (Err(e), _) | (_, Err(e)) => {
                skipped.push(format!("{key}: {e}"));
                return ControlFlow::Continue(());
            }
        };
        if let Err(e) = writeln!(out, "{line}") {
            failed = Some(e);
            return ControlFlow::Break(());
        }
        written += 1;
        if written.is_multiple_of(4096) {
            bar.set_position(written);
        }
        ControlFlow::Continue(())
    })?;
    bar.finish_and_clear();
    if let Some(e) = failed {
        return Err(e.into());
    }
    out.flush()?;
    for s in &skipped {
        writeln!(io.err, "idemstore: skipped unreadable record {s}")?;
    }
    let summary = json!({
        "exported": written,
        "skipped_unreadable": skipped.len(),
        "seconds": started.elapsed().as_secs_f64(),
    });
    // The summary goes to stdout unless stdout carries the records.
    let report: &mut dyn Write = if to_file { &mut *io.out } else { &mut *io.err };
    if json {
        writeln!(report, "{summary}")?;
    } else {
        writeln!(
            report,
            "exported {written} records in {}{}",
            secs(started.elapsed()),
            if skipped.is_empty() {
                String::new()
            } else {
                format!(
                    "; {} unreadable records skipped (run verify)",
                    skipped.len()
                )
            }
        )?;
    }
    Ok(if skipped.is_empty() {
        EXIT_OK
    } else {
        EXIT_PROBLEMS
    })
}

/// Records per transaction of a copy: the import's own batch size.
const IMPORT_BATCH: usize = 10_000;

/// Reads `records` (the good records of a scan) into `into`,
/// [`IMPORT_BATCH`] per transaction.
struct Feeder<'a> {
    into: &'a RedbStore,
    batch: Vec<(Key, Record)>,
    written: u64,
}

impl Feeder<'_> {
    fn push(&mut self, key: Key, record: Record) -> Result<()> {
        self.batch.push((key, record));
        if self.batch.len() >= IMPORT_BATCH {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let batch = std::mem::take(&mut self.batch);
        self.written += self.into.admin().import(batch.into_iter().map(Ok))?;
        Ok(())
    }
}

/// What a copy left behind: the key (as JSON and as shown), when there is
/// one, and why.
struct LeftBehind {
    key: Option<(serde_json::Value, String)>,
    why: String,
}

/// Every record of `from` that verifies, into `into`; the rest (with why)
/// in the returned list. An error of the scan itself (damage the engine
/// cannot read past) is one entry of the list: what came after it is not
/// read.
fn copy_records(
    from: &RedbStore,
    into: &RedbStore,
    io: &Io<'_>,
    what: &str,
) -> std::result::Result<(u64, Vec<LeftBehind>), Failure> {
    let bar = bar(io, from.admin().facts().map_or(0, |f| f.records), what);
    let mut feeder = Feeder {
        into,
        batch: Vec::new(),
        written: 0,
    };
    let mut left = Vec::new();
    let mut failed = None;
    let mut seen = 0u64;
    let scanned = from.admin().scan(|raw, record| {
        seen += 1;
        if seen.is_multiple_of(4096) {
            bar.set_position(seen);
        }
        match (raw.decode(), record) {
            (Ok(key), Ok(record)) => {
                if let Err(e) = feeder.push(key, record) {
                    failed = Some(e);
                    return ControlFlow::Break(());
                }
            }
            (Err(e), _) | (_, Err(e)) => left.push(LeftBehind {
                key: Some((raw_key_json(raw), raw_shown(raw))),
                why: e.to_string(),
            }),
        }
        ControlFlow::Continue(())
    });
    bar.finish_and_clear();
    if let Some(e) = failed {
        return Err(e.into());
    }
    if let Err(e) = scanned {
        left.push(LeftBehind {
            key: None,
            why: format!(
                "the scan stopped after {seen} records: {e}; records after it are not read"
            ),
        });
    }
    feeder.flush()?;
    Ok((feeder.written, left))
}

/// `import`: builds the new store beside the target from the target's
/// records (with `--force`) and the input's, and renames it into place
/// only when every line imported.
pub(crate) fn import(target: &Path, input: Option<&Path>, force: bool, io: &mut Io<'_>) -> Outcome {
    let started = Instant::now();
    let log = RedbStore::log_path(target);
    let existing = if target.exists() {
        Some(import_target(target, force, io)?)
    } else if log.exists() {
        return Err(Failure::new(
            EXIT_REFUSED,
            format!(
                "{} is missing but its write-ahead log {} is beside it (the store file was \
                 lost?); nothing was written. Move the log away to import here; see \
                 docs/operations.md",
                target.display(),
                log.display()
            ),
        ));
    } else {
        None
    };
    let building = Building::start(target)?;
    let new = building.store()?;
    // With --force the target's records come first; the input's replace
    // them key by key.
    let (carried, carried_hwm) = match &existing {
        Some(view) => {
            let (n, left) = copy_records(view, new, io, "copying the target")?;
            if !left.is_empty() {
                return Err(Failure::new(
                    EXIT_PROBLEMS,
                    format!(
                        "the target {} holds {} records that do not verify; nothing was \
                         written. Run `idemstore verify` and `idemstore salvage` on it first",
                        target.display(),
                        left.len()
                    ),
                ));
            }
            (n, view.admin().facts()?.token_hwm)
        }
        None => (0, 0),
    };
    let spin = spinner(io, PROGRESS_MIN_RECORDS, "importing");
    let mut file;
    let reader: &mut dyn BufRead = match input {
        Some(p) if p != Path::new("-") => {
            file = BufReader::new(std::fs::File::open(p).map_err(|e| {
                Failure::new(EXIT_ERROR, format!("cannot read {}: {e}", p.display()))
            })?);
            &mut file
        }
        _ => &mut *io.input,
    };
    let mut line_no = 0u64;
    let mut keys = HashSet::new();
    let lines = reader.lines().filter_map(|line| {
        line_no += 1;
        let at = line_no;
        match line {
            Ok(l) if l.trim().is_empty() => None,
            Ok(l) => Some(
                parse_line(&l)
                    .map_err(|e| Error::InvalidArgument {
                        reason: format!("line {at}: {e}"),
                    })
                    .inspect(|(key, _)| {
                        keys.insert(key.clone());
                    }),
            ),
            Err(e) => Some(Err(Error::InvalidArgument {
                reason: format!("line {at}: {e}"),
            })),
        }
    });
    let result: Result<u64> = new.admin().import(lines.inspect(|_| spin.inc(1)));
    spin.finish_and_clear();
    let lines_read = match result {
        Ok(n) => n,
        Err(e) => {
            return Err(Failure::new(
                EXIT_ERROR,
                format!(
                    "import stopped: {e}. Nothing was written to {} (the import is all or \
                     nothing); fix the input and import again",
                    target.display()
                ),
            ));
        }
    };
    new.admin().raise_token_high_water_mark(carried_hwm)?;
    let in_store = new.admin().facts()?.records;
    let replaced = existing.is_some();
    building.finish(replaced)?;
    drop(existing);
    let stored = keys.len() as u64;
    let repeated = lines_read - stored;
    if io.json {
        let v = json!({
            "lines": lines_read,
            "records_stored": stored,
            "lines_repeating_a_key": repeated,
            "records_kept_from_target": carried,
            "records_in_store": in_store,
            "seconds": started.elapsed().as_secs_f64(),
        });
        writeln!(io.out, "{v}")?;
    } else {
        let mut line = format!(
            "imported {} from {}",
            plural(stored, "record", "records"),
            plural(lines_read, "line", "lines")
        );
        if repeated > 0 {
            line.push_str(&format!(
                " ({} repeated a key already read: the last one is kept)",
                plural(repeated, "line", "lines")
            ));
        }
        line.push_str(&format!(
            "; {} now holds {} in {}",
            target.display(),
            plural(in_store, "record", "records"),
            secs(started.elapsed())
        ));
        writeln!(io.out, "{line}")?;
    }
    Ok(EXIT_OK)
}

/// An existing import target: a store (never another file), empty unless
/// `--force`, and closed cleanly (its log holds nothing, so replacing the
/// file and removing the log loses nothing). Returned open read-only: its
/// shared lock keeps writers out until the import is done.
fn import_target(target: &Path, force: bool, io: &mut Io<'_>) -> Result<RedbStore, Failure> {
    let view = open_view(target, io).map_err(|f| {
        if f.code == super::EXIT_LOCKED {
            return f;
        }
        Failure::new(
            EXIT_REFUSED,
            format!(
                "{} exists and cannot be read as a store ({}); import never replaces a file \
                 that is not a store: remove it or import to another path",
                target.display(),
                f.message
            ),
        )
    })?;
    let facts = view.admin().facts()?;
    if !force && (facts.records > 0 || facts.index_entries > 0) {
        return Err(Failure::new(
            EXIT_REFUSED,
            format!(
                "the target store already holds {} records; import into a new file, \
                 or pass --force to merge (records with the same key are replaced)",
                facts.records
            ),
        ));
    }
    if RedbStore::check_log(target)?.clean_stop == Some(false) {
        return Err(Failure::new(
            EXIT_REFUSED,
            format!(
                "{} was not closed cleanly (its write-ahead log may hold writes not yet in \
                 the file); nothing was written. Open and close it once (`idemstore sweep {}` \
                 does), then import again",
                target.display(),
                target.display()
            ),
        ));
    }
    Ok(view)
}

/// `salvage`: every record of `store` that verifies, read through a
/// read-only view that skips what does not verify in the log (in memory),
/// into a new store at `to`. The original is only read.
pub(crate) fn salvage(store: &Path, to: &Path, io: &mut Io<'_>) -> Outcome {
    let started = Instant::now();
    existing_store_file(store)?;
    for taken in [to.to_path_buf(), RedbStore::log_path(to)] {
        if taken.exists() {
            return Err(Failure::new(
                EXIT_REFUSED,
                format!(
                    "{} exists; salvage writes only a new file (nothing was written)",
                    taken.display()
                ),
            ));
        }
    }
    let view = super::retry_locked(|| RedbStore::builder().accept_loss(true).open_read_only(store))
        .map_err(|e| {
            let f = Failure::from(e);
            Failure {
                message: format!(
                    "salvage cannot read {}: {} (nothing was written)",
                    store.display(),
                    f.message
                ),
                ..f
            }
        })?;
    let mut left_behind = Vec::new();
    let meta_hwm = match view.admin().facts() {
        Ok(facts) => facts.token_hwm,
        Err(e) => {
            left_behind.push(LeftBehind {
                key: None,
                why: format!("the meta entries: {e}"),
            });
            0
        }
    };
    let building = Building::start(to)?;
    let new = building.store()?;
    let (salvaged, mut left) = copy_records(&view, new, io, "salvaging")?;
    left_behind.append(&mut left);
    // No fencing token the old store handed out is handed out again.
    new.admin().raise_token_high_water_mark(meta_hwm)?;
    let check = new.admin().verify(|_| {})?;
    if !check.is_clean() {
        return Err(Failure::new(
            EXIT_ERROR,
            format!(
                "the new store does not verify ({} problems); nothing was written to {}",
                check.problem_count,
                to.display()
            ),
        ));
    }
    building.finish(false)?;
    let loss = view.loss_report().cloned();
    drop(view);
    let log_skipped = loss.as_ref().map_or(0, |l| l.frames_skipped);
    if io.json {
        let left: Vec<_> = left_behind
            .iter()
            .map(|l| json!({"key": l.key.as_ref().map(|k| &k.0), "why": l.why}))
            .collect();
        let v = json!({
            "salvaged": salvaged,
            "to": to.display().to_string(),
            "left_behind": left,
            "log_frames_skipped": log_skipped,
            "log_findings": loss.as_ref().map(|l| l.findings.clone()).unwrap_or_default(),
            "token_high_water_mark": new_hwm(to)?,
            "seconds": started.elapsed().as_secs_f64(),
        });
        writeln!(io.out, "{v}")?;
    } else {
        writeln!(
            io.out,
            "salvaged {} from {} into {} in {} ({} was not changed)",
            plural(salvaged, "record", "records"),
            store.display(),
            to.display(),
            secs(started.elapsed()),
            store.display()
        )?;
        if let Some(loss) = &loss {
            for finding in &loss.findings {
                writeln!(io.out, "log: {finding}")?;
            }
        }
        if left_behind.is_empty() && log_skipped == 0 {
            writeln!(io.out, "nothing was left behind")?;
        } else {
            writeln!(
                io.out,
                "left behind: {}{}",
                plural(left_behind.len() as u64, "record", "records"),
                if log_skipped > 0 {
                    format!(" and {} of the log", plural(log_skipped, "frame", "frames"))
                } else {
                    String::new()
                }
            )?;
            for l in &left_behind {
                match &l.key {
                    Some((_, key)) => writeln!(io.out, "  {key}: {}", l.why)?,
                    None => writeln!(io.out, "  {}", l.why)?,
                }
            }
        }
    }
    Ok(if left_behind.is_empty() && log_skipped == 0 {
        EXIT_OK
    } else {
        EXIT_PROBLEMS
    })
}

/// The token high-water mark of the store at `path`, read through a view.
fn new_hwm(path: &Path) -> std::result::Result<u64, Failure> {
    Ok(RedbStore::builder()
        .open_read_only(path)?
        .admin()
        .facts()?
        .token_hwm)
}

/// A [`LogCheck`](idemstore::redb::admin::LogCheck) as JSON (`log`, and
/// `verify` when the log fails).
fn log_json(check: &idemstore::redb::admin::LogCheck) -> serde_json::Value {
    json!({
        "path": check.path.display().to_string(),
        "present": check.present,
        "bytes": check.bytes,
        "clean_stop": check.clean_stop,
        "frames": check.frames,
        "problems": check.problems,
    })
}

/// `log`: the write-ahead log as an open would find it. Reads only.
pub(crate) fn log(path: &Path, io: &mut Io<'_>) -> Outcome {
    existing_store_file(path)?;
    let check = RedbStore::check_log(path)?;
    if io.json {
        writeln!(io.out, "{}", log_json(&check))?;
    } else {
        let stop = match check.clean_stop {
            Some(true) => "closed cleanly: the log holds nothing the store needs",
            Some(false) => "not closed cleanly: the next open replays the frames below",
            None => "no record of the last stop (a store written by an older build)",
        };
        writeln!(
            io.out,
            "log     {}{}",
            check.path.display(),
            if check.present { "" } else { " (missing)" }
        )?;
        writeln!(io.out, "size    {} bytes", check.bytes)?;
        writeln!(io.out, "store   {stop}")?;
        writeln!(io.out, "frames  {} an open would replay", check.frames)?;
        if check.is_clean() {
            writeln!(io.out, "OK: an open would replay it without refusing")?;
        } else {
            writeln!(io.out, "an open would refuse it:")?;
            for problem in &check.problems {
                writeln!(io.out, "  {problem}")?;
            }
        }
    }
    Ok(if check.is_clean() {
        EXIT_OK
    } else {
        EXIT_PROBLEMS
    })
}

/// `recover`: without `accept_loss`, says (reading only) whether a plain
/// open refuses the store; with it, opens accepting loss and writes the [`LossReport`] as
/// JSON beside the store (or at `report`), never over an existing file.
///
/// [`LossReport`]: idemstore::redb::LossReport
pub(crate) fn recover(
    path: &Path,
    accept_loss: bool,
    report: Option<&Path>,
    io: &mut Io<'_>,
) -> Outcome {
    let json = io.json;
    // A store file lost beside its log is a case for recover, not a typo.
    let log = RedbStore::log_path(path);
    if !path.exists() && !log.exists() {
        return Err(Failure::new(
            EXIT_ERROR,
            format!("no store at {}", path.display()),
        ));
    }
    if !accept_loss {
        // Read-only: what an open would refuse, without opening.
        let problems = if path.exists() {
            let check = RedbStore::check_log(path)?;
            check.problems
        } else {
            vec![format!(
                "{} is missing, but its write-ahead log {} is beside it",
                path.display(),
                log.display()
            )]
        };
        if problems.is_empty() {
            writeln!(io.out, "nothing to recover: the store opens as it is")?;
            return Ok(EXIT_OK);
        }
        return Err(Failure::new(
            EXIT_REFUSED,
            format!(
                "an open refuses {}:\n  {}\nrun `idemstore recover {} --accept-loss` to open it \
                 with what verifies and write down what is given up (nothing was written)",
                path.display(),
                problems.join("\n  "),
                path.display()
            ),
        ));
    }
    let store = RedbStore::builder().accept_loss(true).open(path)?;
    let Some(loss) = store.loss_report().cloned() else {
        drop(store);
        if json {
            writeln!(io.out, "{}", json!({"lost": false}))?;
        } else {
            writeln!(io.out, "nothing was lost: the store opens as it is")?;
        }
        return Ok(EXIT_OK);
    };
    // Closed cleanly: from now on the store opens plainly.
    drop(store);
    let target = match report {
        Some(p) => p.to_path_buf(),
        None => {
            let mut name = path.as_os_str().to_os_string();
            name.push(".loss-report.json");
            std::path::PathBuf::from(name)
        }
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&target)
        .map_err(|e| {
            Failure::new(
                EXIT_ERROR,
                format!("cannot write the report to {}: {e}", target.display()),
            )
        })?;
    writeln!(file, "{}", loss.to_json())?;
    file.sync_all()?;
    if json {
        writeln!(
            io.out,
            "{}",
            json!({"lost": true, "report": target.display().to_string(), "frames_skipped": loss.frames_skipped, "keys_possibly_lost": loss.keys_possibly_lost.len()})
        )?;
    } else {
        write!(io.out, "opened with loss:\n{loss}")?;
        writeln!(io.out, "report written to {}", target.display())?;
    }
    Ok(EXIT_OK)
}

/// `verify`'s first step: the store's write-ahead log, checked without
/// opening the store (`RedbStore::check_log`). `Some(code)`
/// when the log holds what an open would refuse (all of it is reported);
/// `None` to go on with the store file. A store file the check cannot read
/// is left to the open, which reports it.
pub(crate) fn verify_log(path: &Path, io: &mut Io<'_>) -> Result<Option<u8>, Failure> {
    let json = io.json;
    if !path.exists() {
        return Ok(None);
    }
    let Ok(check) = RedbStore::check_log(path) else {
        return Ok(None);
    };
    if check.is_clean() {
        if !json {
            writeln!(
                io.out,
                "log: {} frames to replay, {}",
                check.frames,
                match check.clean_stop {
                    Some(true) => "closed cleanly",
                    Some(false) => "not closed cleanly",
                    None => "no record of the last stop",
                }
            )?;
        }
        return Ok(None);
    }
    if json {
        let v = json!({"ok": false, "log": log_json(&check)});
        writeln!(io.out, "{v}")?;
    } else {
        writeln!(
            io.out,
            "the write-ahead log {} holds what an open would refuse:",
            check.path.display()
        )?;
        for problem in &check.problems {
            writeln!(io.out, "  {problem}")?;
        }
        writeln!(
            io.out,
            "nothing was written; see `idemstore recover` and docs/operations.md"
        )?;
    }
    Ok(Some(EXIT_PROBLEMS))
}
