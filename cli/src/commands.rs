//! Read commands (`stats`, `get`, `list`) and `evict`.

use super::format::{self, BODY_PREVIEW_BYTES, rfc3339, store_id, when};
use super::keys::{command_line_form, key_json, raw_key_json, raw_shown, shown};
use super::{
    EXIT_NOT_FOUND, EXIT_OK, EXIT_REFUSED, Failure, Io, Outcome, PROGRESS_MIN_RECORDS, StateFilter,
    file_bytes,
};
use idemstore::redb::admin::RawKey;
use idemstore::{Key, Record, RedbStore, State, Timestamp};
use serde_json::{Value, json};
use std::ops::ControlFlow;
use std::path::Path;

/// Bytes the file takes on disk (allocated blocks; sparse parts and
/// preallocation count as they are), or its length where that is unknown.
fn disk_bytes(path: &Path) -> u64 {
    match std::fs::metadata(path) {
        #[cfg(unix)]
        Ok(m) => std::os::unix::fs::MetadataExt::blocks(&m) * 512,
        #[cfg(not(unix))]
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

/// A progress bar over `len` items on stderr, or a hidden one when the
/// store is small or stderr is not a terminal.
pub(crate) fn bar(io: &Io<'_>, len: u64, what: &str) -> indicatif::ProgressBar {
    if !io.progress || len < PROGRESS_MIN_RECORDS {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}, eta {eta})",
    ) {
        bar.set_style(style);
    }
    bar.set_message(what.to_owned());
    bar
}

/// Per-state counts from one pass over the records.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) records: u64,
    pub(crate) processing: u64,
    pub(crate) processing_lease_passed: u64,
    pub(crate) done: u64,
    pub(crate) expired_not_swept: u64,
    pub(crate) unreadable: u64,
}

pub(crate) fn count(
    store: &RedbStore,
    now: Timestamp,
    io: &Io<'_>,
    len: u64,
) -> Result<Counts, Failure> {
    let bar = bar(io, len, "reading");
    let mut c = Counts::default();
    store.admin().scan(|_, record| {
        c.records += 1;
        if c.records.is_multiple_of(4096) {
            bar.set_position(c.records);
        }
        match record {
            Err(_) => c.unreadable += 1,
            Ok(r) if r.is_expired(now) => c.expired_not_swept += 1,
            Ok(r) if r.state() == State::Done => c.done += 1,
            Ok(r) => {
                c.processing += 1;
                if lease_passed(&r, now) {
                    c.processing_lease_passed += 1;
                }
            }
        }
        ControlFlow::Continue(())
    })?;
    bar.finish_and_clear();
    Ok(c)
}

fn lease_passed(r: &Record, now: Timestamp) -> bool {
    r.state() == State::Processing && r.lease_until().is_some_and(|l| now >= l)
}

/// Two columns, the names padded.
fn kv(rows: &[(&str, String)]) -> String {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    rows.iter()
        .map(|(k, v)| format!("{k:width$}  {v}\n"))
        .collect()
}

fn size(bytes: u64, disk: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    format!(
        "{:.1} MiB ({bytes} bytes), {:.1} MiB",
        bytes as f64 / MIB,
        disk as f64 / MIB
    )
}

/// The cause of a store's failure, when its health is not good: for the
/// view `stats` reads through, a read of the files that failed.
fn health_cause(store: &RedbStore) -> Option<String> {
    use idemstore::redb::Health;
    match store.health() {
        Health::Degraded { cause, .. } | Health::Failed { cause } => Some(cause.to_string()),
        _ => None,
    }
}

pub(crate) fn stats(store: &RedbStore, path: &Path, io: &mut Io<'_>) -> Outcome {
    let now = io.now;
    let facts = store.admin().facts()?;
    let bounds = store.admin().expiry_bounds()?;
    let c = count(store, now, io, facts.records)?;
    // As on disk: a read-only view changes neither file.
    let (file, file_disk) = (file_bytes(path), disk_bytes(path));
    let log = RedbStore::log_path(path);
    let (log_len, log_disk) = (file_bytes(&log), disk_bytes(&log));
    let log_frames = store.stats().frames_replayed_on_open;
    if io.json {
        let v = json!({
            "path": path.display().to_string(),
            "file_bytes": file,
            "file_disk_bytes": file_disk,
            "log_path": log.display().to_string(),
            "log_bytes": log_len,
            "log_disk_bytes": log_disk,
            "log_frames_not_checkpointed": log_frames,
            "format_version": facts.format_version,
            "store_id": store_id(facts.store_id),
            "token_high_water_mark": facts.token_hwm,
            "records": c.records,
            "done": c.done,
            "processing": c.processing,
            "processing_lease_passed": c.processing_lease_passed,
            "expired_not_swept": c.expired_not_swept,
            "unreadable": c.unreadable,
            "index_entries": facts.index_entries,
            "oldest_expiry_ms": bounds.map(|b| b.0.as_millis()),
            "newest_expiry_ms": bounds.map(|b| b.1.as_millis()),
            "now_ms": now.as_millis(),
            "health": store.health().name(),
            "health_cause": health_cause(store),
        });
        writeln!(io.out, "{v}")?;
        return Ok(EXIT_OK);
    }
    let mut rows = vec![
        ("store", path.display().to_string()),
        ("file size", format!("{} on disk", size(file, file_disk))),
        (
            "log",
            format!(
                "{} on disk, {log_frames} frames not yet in the file",
                size(log_len, log_disk)
            ),
        ),
        (
            "format version",
            format!(
                "{} (this build reads {})",
                facts.format_version, facts.supported_version
            ),
        ),
        (
            "health",
            match health_cause(store) {
                Some(cause) => format!("{}: {cause}", store.health().name()),
                None => store.health().name().to_owned(),
            },
        ),
        ("store id", store_id(facts.store_id)),
        ("token high-water mark", facts.token_hwm.to_string()),
        ("records", c.records.to_string()),
        ("  DONE, live", c.done.to_string()),
        (
            "  PROCESSING, live",
            format!(
                "{} ({} with lease passed)",
                c.processing, c.processing_lease_passed
            ),
        ),
        ("  expired, not swept", c.expired_not_swept.to_string()),
    ];
    if c.unreadable > 0 {
        rows.push(("  unreadable", format!("{} (run verify)", c.unreadable)));
    }
    rows.push(("index entries", facts.index_entries.to_string()));
    match bounds {
        Some((oldest, newest)) => {
            rows.push(("oldest expiry", when(oldest, now)));
            rows.push(("newest expiry", when(newest, now)));
        }
        None => rows.push(("expiry range", "-".to_owned())),
    }
    write!(io.out, "{}", kv(&rows))?;
    Ok(EXIT_OK)
}

/// A record as JSON for `get` and `list --json` (the body as in `get`).
fn record_json(key: Value, r: &Record, now: Timestamp, body_limit: Option<usize>) -> Value {
    let response = r.response().map(|resp| {
        let body = format::preview(resp.body(), body_limit);
        let headers: Vec<Value> = resp
            .headers()
            .iter()
            .map(|(n, v)| {
                let p = format::preview(v, None);
                let field = if p.is_hex { "value_hex" } else { "value" };
                json!({"name": n, field: p.shown})
            })
            .collect();
        let field = if body.is_hex { "body_hex" } else { "body" };
        json!({
            "status": resp.status(),
            "headers": headers,
            field: body.shown,
            "body_bytes": body.total_bytes,
            "body_truncated": body.truncated(),
        })
    });
    json!({
        "key": key,
        "state": r.state().to_string(),
        "fingerprint": r.fingerprint().to_hex(),
        "token": r.token(),
        "attempts": r.attempts(),
        "created_at": rfc3339(r.created_at()),
        "created_at_ms": r.created_at().as_millis(),
        "lease_until": r.lease_until().map(rfc3339),
        "lease_until_ms": r.lease_until().map(Timestamp::as_millis),
        "lease_passed": lease_passed(r, now),
        "expires_at": rfc3339(r.expires_at()),
        "expires_at_ms": r.expires_at().as_millis(),
        "expired": r.is_expired(now),
        "response": response,
        "steps": r.steps().iter().map(|s| {
            let output = format::preview(s.output(), body_limit);
            let field = if output.is_hex { "output_hex" } else { "output" };
            json!({
                "name": s.name(),
                field: output.shown,
                "output_bytes": output.total_bytes,
                "output_truncated": output.truncated(),
            })
        }).collect::<Vec<_>>(),
    })
}

pub(crate) fn get(store: &RedbStore, key: &Key, full: bool, io: &mut Io<'_>) -> Outcome {
    let Some(r) = store.admin().get_raw(key)? else {
        return Err(not_found(store, key)?);
    };
    let now = io.now;
    let limit = (!full).then_some(BODY_PREVIEW_BYTES);
    if io.json {
        writeln!(io.out, "{}", record_json(key_json(key), &r, now, limit))?;
        return Ok(EXIT_OK);
    }
    let mut rows = vec![
        ("key", shown(key)),
        ("state", r.state().to_string()),
        ("fingerprint", r.fingerprint().to_hex()),
        ("token", r.token().to_string()),
        ("attempts", r.attempts().to_string()),
        ("created", when(r.created_at(), now)),
    ];
    if let Some(lease) = r.lease_until() {
        if lease == Timestamp::EPOCH {
            rows.push((
                "lease until",
                "RELEASED with its steps kept: the next retry claims it".to_owned(),
            ));
        } else {
            let note = if now >= lease {
                " LEASE PASSED: the next retry takes over"
            } else {
                ""
            };
            rows.push(("lease until", format!("{}{note}", when(lease, now))));
        }
    }
    for step in r.steps() {
        let output = format::preview(step.output(), limit);
        let shown = if output.is_hex {
            format!("0x{}", output.shown)
        } else {
            output.shown
        };
        rows.push(("step", format!("{}: {shown}", step.name())));
    }
    let note = if r.is_expired(now) {
        " EXPIRED: invisible, not yet swept"
    } else {
        ""
    };
    rows.push(("expires", format!("{}{note}", when(r.expires_at(), now))));
    if let Some(resp) = r.response() {
        rows.push(("status", resp.status().to_string()));
        for (name, value) in resp.headers() {
            let p = format::preview(value, None);
            let shown = if p.is_hex {
                format!("0x{}", p.shown)
            } else {
                p.shown
            };
            rows.push(("header", format!("{name}: {shown}")));
        }
        let body = format::preview(resp.body(), limit);
        let mut line = format!(
            "{} bytes, {}",
            body.total_bytes,
            if body.is_hex { "binary (hex)" } else { "text" }
        );
        if body.truncated() {
            line.push_str(&format!(
                ", first {} shown (--full for all)",
                body.shown_bytes
            ));
        }
        rows.push(("body", line));
        write!(io.out, "{}", kv(&rows))?;
        writeln!(io.out, "{}", body.shown)?;
    } else {
        write!(io.out, "{}", kv(&rows))?;
    }
    Ok(EXIT_OK)
}

/// Most other scopes named in a "no record" message.
const MAX_SCOPES_NAMED: usize = 5;

/// "no record for KEY", naming the scopes that do hold a record with the
/// same id (a forgotten `--scope` is the usual cause). Scans the store.
fn not_found(store: &RedbStore, key: &Key) -> Result<Failure, Failure> {
    let mut elsewhere = Vec::new();
    store.admin().scan(|raw, _| {
        if let Ok(other) = raw.decode()
            && other.id() == key.id()
            && other.scope() != key.scope()
        {
            elsewhere.push(command_line_form(&other));
            if elsewhere.len() >= MAX_SCOPES_NAMED {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    })?;
    let mut message = format!("no record for {key}");
    if !elsewhere.is_empty() {
        message.push_str(&format!(
            "; the same id has a record under another scope: {}",
            elsewhere.join(", ")
        ));
    }
    Ok(Failure::new(EXIT_NOT_FOUND, message))
}

/// What `list` shows.
#[derive(Debug)]
pub(crate) struct ListFilter {
    pub(crate) state: Option<StateFilter>,
    pub(crate) expired: bool,
    /// With a state: expired records of it too.
    pub(crate) include_expired: bool,
    pub(crate) scope: Option<String>,
    pub(crate) limit: u64,
}

impl ListFilter {
    fn wants(&self, r: &Record, now: Timestamp) -> bool {
        let state = match self.state {
            None => true,
            Some(StateFilter::Processing) => r.state() == State::Processing,
            Some(StateFilter::Done) => r.state() == State::Done,
        };
        let expired = r.is_expired(now);
        let expiry = if self.expired {
            expired
        } else if self.state.is_some() {
            // A state names live records (as `stats` counts them).
            self.include_expired || !expired
        } else {
            true
        };
        state && expiry
    }
}

pub(crate) fn list(store: &RedbStore, filter: &ListFilter, io: &mut Io<'_>) -> Outcome {
    let json = io.json;
    let now = io.now;
    let limit = if filter.limit == 0 {
        u64::MAX
    } else {
        filter.limit
    };
    let mut rows: Vec<Vec<String>> = Vec::new();
    let mut shown = 0u64;
    let mut more = false;
    let mut out_err = None;
    let admin = store.admin();
    let each = |key: RawKey<'_>, record: idemstore::Result<Record>| {
        let name = raw_shown(key);
        let row = match record {
            Ok(r) if !filter.wants(&r, now) => return ControlFlow::Continue(()),
            Ok(r) => {
                if shown >= limit {
                    more = true;
                    return ControlFlow::Break(());
                }
                if json {
                    let line = record_json(raw_key_json(key), &r, now, Some(0));
                    if let Err(e) = writeln!(io.out, "{line}") {
                        out_err = Some(e);
                        return ControlFlow::Break(());
                    }
                    shown += 1;
                    return ControlFlow::Continue(());
                }
                let mut flags = Vec::new();
                if lease_passed(&r, now) {
                    flags.push("LEASE-PASSED");
                }
                if r.is_expired(now) {
                    flags.push("EXPIRED");
                }
                let status = r
                    .response()
                    .map_or("-".to_owned(), |x| x.status().to_string());
                let lease = r
                    .lease_until()
                    .map_or("-".to_owned(), |l| format::relative(l, now));
                vec![
                    r.state().to_string(),
                    name,
                    r.token().to_string(),
                    status,
                    lease,
                    format::relative(r.expires_at(), now),
                    flags.join(","),
                ]
            }
            // A damaged record matches no filter but is never hidden from a listing of all.
            Err(e) if filter.state.is_none() && !filter.expired => {
                if shown >= limit {
                    more = true;
                    return ControlFlow::Break(());
                }
                if json {
                    let v = json!({"key": raw_key_json(key), "state": "UNREADABLE", "error": e.to_string()});
                    if let Err(e) = writeln!(io.out, "{v}") {
                        out_err = Some(e);
                        return ControlFlow::Break(());
                    }
                    shown += 1;
                    return ControlFlow::Continue(());
                }
                let cells = ["UNREADABLE", &name, "-", "-", "-", "-", "run verify"];
                cells.iter().map(|c| (*c).to_owned()).collect()
            }
            Err(_) => return ControlFlow::Continue(()),
        };
        rows.push(row);
        shown += 1;
        ControlFlow::Continue(())
    };
    match &filter.scope {
        Some(scope) => admin.scan_scope(scope, each)?,
        None => admin.scan(each)?,
    }
    if let Some(e) = out_err {
        return Err(e.into());
    }
    if json {
        // Last, so a reader knows the listing is whole or was cut.
        let v = json!({"summary": {"shown": shown, "truncated": more, "limit": filter.limit}});
        writeln!(io.out, "{v}")?;
    } else {
        let header = [
            "STATE", "KEY", "TOKEN", "STATUS", "LEASE", "EXPIRES", "FLAGS",
        ];
        write!(io.out, "{}", format::table(&header, &rows))?;
        if more {
            writeln!(
                io.err,
                "(more records; --limit {} shown, --limit 0 for all)",
                filter.limit
            )?;
        }
    }
    Ok(EXIT_OK)
}

/// Asks on stderr and reads the answer from `io.input`; only a terminal
/// can answer (a script must say `--yes`).
pub(crate) fn confirm(question: &str, io: &mut Io<'_>) -> Result<bool, Failure> {
    if !io.input_is_tty {
        return Err(Failure::new(
            EXIT_REFUSED,
            "refusing to evict without confirmation: standard input is not a terminal \
             (pass --yes to evict from a script)",
        ));
    }
    write!(io.err, "{question} [y/N] ")?;
    io.err.flush()?;
    let mut answer = String::new();
    io.input.read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}

pub(crate) fn evict(store: &RedbStore, key: &Key, yes: bool, io: &mut Io<'_>) -> Outcome {
    let json = io.json;
    let key = key.clone();
    let what = match store.admin().get_raw(&key) {
        Ok(Some(r)) => format!("{} record, token {}", r.state(), r.token()),
        Ok(None) => return Err(not_found(store, &key)?),
        Err(e) => format!("unreadable record ({e})"),
    };
    if !yes {
        let question =
            format!("Evict {key} ({what})? A retry of it will run its side effect again.");
        if !confirm(&question, io)? {
            return Err(Failure::new(EXIT_REFUSED, "not evicted"));
        }
    }
    let Some(evicted) = store.admin().evict(&key)? else {
        return Err(Failure::new(EXIT_NOT_FOUND, format!("no record for {key}")));
    };
    if json {
        let v = json!({
            "evicted": key_json(&key),
            "state": evicted.record.as_ref().map(|r| r.state().to_string()),
            "index_entries": evicted.index_entries,
        });
        writeln!(io.out, "{v}")?;
    } else {
        writeln!(
            io.out,
            "evicted {key} ({what}; {} index entr{} removed)",
            evicted.index_entries,
            if evicted.index_entries == 1 {
                "y"
            } else {
                "ies"
            }
        )?;
    }
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn with_io<T>(input: &str, tty: bool, f: impl FnOnce(&mut Io<'_>) -> T) -> (T, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut input = Cursor::new(input.as_bytes().to_vec());
        let mut io = Io {
            out: &mut out,
            err: &mut err,
            input: &mut input,
            input_is_tty: tty,
            progress: false,
            now: Timestamp::EPOCH,
            json: false,
        };
        let t = f(&mut io);
        (t, String::from_utf8(err).expect("utf-8"))
    }

    #[test]
    fn confirmation_needs_a_terminal_and_a_yes() {
        let (answer, err) = with_io("y\n", true, |io| confirm("Evict?", io).expect("asked"));
        assert!(answer);
        assert!(err.contains("Evict? [y/N]"), "{err}");
        let (answer, _) = with_io("\n", true, |io| confirm("Evict?", io).expect("asked"));
        assert!(!answer, "the default is no");
        let (answer, _) = with_io("nope\n", true, |io| confirm("Evict?", io).expect("asked"));
        assert!(!answer);
        let (refused, _) = with_io("y\n", false, |io| confirm("Evict?", io));
        let refused = refused.expect_err("no terminal");
        assert_eq!(refused.code, EXIT_REFUSED);
        assert!(refused.message.contains("--yes"), "{}", refused.message);
    }
}
