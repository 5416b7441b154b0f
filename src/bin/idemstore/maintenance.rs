//! Commands that touch every record: `sweep`, `compact`, `verify`,
//! `export` and `import`.

use super::commands::bar;
use super::{
    EXIT_ERROR, EXIT_OK, EXIT_PROBLEMS, EXIT_REFUSED, Failure, Io, Outcome, PROGRESS_MIN_RECORDS,
    file_bytes,
};
use idemstore::limits::MAX_SWEEP_BATCH;
use idemstore::redb::admin::{export_line, parse_line};
use idemstore::{Error, RedbStore, Result, Store};
use serde_json::json;
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

pub(crate) fn sweep(store: &RedbStore, path: &Path, json: bool, io: &mut Io<'_>) -> Outcome {
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

pub(crate) fn compact(store: RedbStore, path: &Path, json: bool, io: &mut Io<'_>) -> Outcome {
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

pub(crate) fn verify(store: &RedbStore, json: bool, io: &mut Io<'_>) -> Outcome {
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
            .map(|p| json!({"kind": p.kind.name(), "key": p.key, "detail": p.detail}))
            .collect();
        let v = json!({
            "ok": report.is_clean(),
            "records": report.records,
            "index_entries": report.index_entries,
            "problem_count": report.problem_count,
            "problems": problems,
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
                "OK: every record verifies and the expiry index agrees with the records"
            )?;
        } else {
            let rows: Vec<Vec<String>> = report
                .problems
                .iter()
                .map(|p| {
                    vec![
                        p.kind.name().to_owned(),
                        p.key.clone().unwrap_or_else(|| "-".to_owned()),
                        p.detail.clone(),
                    ]
                })
                .collect();
            write!(
                io.out,
                "{}",
                super::format::table(&["PROBLEM", "KEY", "DETAIL"], &rows)
            )?;
            let hidden = report.problem_count - report.problems.len() as u64;
            if hidden > 0 {
                writeln!(io.out, "... and {hidden} more")?;
            }
            writeln!(
                io.out,
                "FAILED: {}",
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

pub(crate) fn export(
    store: &RedbStore,
    output: Option<&Path>,
    json: bool,
    io: &mut Io<'_>,
) -> Outcome {
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
    if json {
        writeln!(io.err, "{summary}")?;
    } else {
        writeln!(
            io.err,
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

pub(crate) fn import(
    store: RedbStore,
    input: Option<&Path>,
    force: bool,
    json: bool,
    io: &mut Io<'_>,
) -> Outcome {
    let started = Instant::now();
    let facts = store.admin().facts()?;
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
    let spin = spinner(io, PROGRESS_MIN_RECORDS, "importing");
    let mut file;
    let reader: &mut dyn BufRead = match input {
        Some(p) if p != Path::new("-") => {
            file = BufReader::new(std::fs::File::open(p)?);
            &mut file
        }
        _ => &mut *io.input,
    };
    let mut line_no = 0u64;
    let lines = reader.lines().filter_map(|line| {
        line_no += 1;
        let at = line_no;
        match line {
            Ok(l) if l.trim().is_empty() => None,
            Ok(l) => Some(parse_line(&l).map_err(|e| Error::InvalidArgument {
                reason: format!("line {at}: {e}"),
            })),
            Err(e) => Some(Err(Error::Io(e))),
        }
    });
    let result: Result<u64> = store.admin().import(lines.inspect(|_| spin.inc(1)));
    // An import took the store by value before it moved to the public
    // admin API: it is closed (and its file released) before the report.
    drop(store);
    spin.finish_and_clear();
    let written = match result {
        Ok(n) => n,
        Err(e) => {
            return Err(Failure::new(
                EXIT_ERROR,
                format!(
                    "import stopped: {e}. Records before that line may be written: \
                     delete the target and import again after fixing the input"
                ),
            ));
        }
    };
    if json {
        let v = json!({"imported": written, "seconds": started.elapsed().as_secs_f64()});
        writeln!(io.out, "{v}")?;
    } else {
        writeln!(
            io.out,
            "imported {written} records in {}",
            secs(started.elapsed())
        )?;
    }
    Ok(EXIT_OK)
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
    json: bool,
    io: &mut Io<'_>,
) -> Outcome {
    // A store file lost beside its log is a case for recover, not a typo.
    let log = idemstore::redb::admin::log_path(path);
    if !path.exists() && !log.exists() {
        return Err(Failure::new(
            EXIT_ERROR,
            format!("no store at {}", path.display()),
        ));
    }
    if !accept_loss {
        // Read-only: what an open would refuse, without opening.
        let problems = if path.exists() {
            let check = idemstore::redb::admin::check_log(path)?;
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
/// opening the store (`idemstore::redb::admin::check_log`). `Some(code)`
/// when the log holds what an open would refuse (all of it is reported);
/// `None` to go on with the store file. A store file the check cannot read
/// is left to the open, which reports it.
pub(crate) fn verify_log(path: &Path, json: bool, io: &mut Io<'_>) -> Result<Option<u8>, Failure> {
    if !path.exists() {
        return Ok(None);
    }
    let Ok(check) = idemstore::redb::admin::check_log(path) else {
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
        let v = json!({
            "ok": false,
            "log": {
                "path": check.path.display().to_string(),
                "present": check.present,
                "bytes": check.bytes,
                "clean_stop": check.clean_stop,
                "frames": check.frames,
                "problems": check.problems,
            },
        });
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
