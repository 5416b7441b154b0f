//! `idemstore`: the operator tool (package `idemstore-cli`): inspect,
//! explain, evict, sweep, compact, verify, salvage, export and import a
//! `RedbStore` file.
//!
//! Built on idemstore's public API alone (`idemstore::redb::admin` for what
//! the `Store` contract does not cover). The commands are functions over an
//! `Io` (streams and now) so that unit tests drive them without a process;
//! integration tests (`tests/cli.rs`) run the real binary.
//!
//! ```text
//! idemstore stats       STORE                              (reads only)
//! idemstore get         STORE [--scope S] KEY [--hex] [--full]
//! idemstore list        STORE [--state processing|done] [--expired | --include-expired] [--scope S] [--limit N]
//! idemstore explain     STORE [--scope S] KEY [--hex] [--fingerprint HEX | request options]
//! idemstore log         STORE
//! idemstore verify      STORE
//! idemstore export      STORE [--format jsonl] [-o FILE]
//! idemstore fingerprint [--kind http|bytes|json] [--method M --path P] [--header 'name: value']... [--json-field POINTER]... [--body FILE]
//! idemstore evict       STORE [--scope S] KEY [--hex] [--yes]  (writes)
//! idemstore sweep       STORE
//! idemstore compact     STORE
//! idemstore salvage     STORE --to NEW                     (writes NEW only)
//! idemstore import      STORE [--format jsonl] [FILE] [--force]
//! idemstore recover     STORE --accept-loss [--report FILE]
//! ```
//! The inspections (`stats`, `get`, `list`, `explain`, `log`, `verify`,
//! `export`) open the store read-only (`RedbStore::builder().open_read_only`): no
//! byte of the store or its log changes, no file is created, and they work
//! on a file the user cannot write. No command but `import` (and `salvage`,
//! into its new file) creates a store. Every command takes `--json` for
//! machine output, errors included. Exit codes are the constants below.

mod commands;
mod explain;
mod format;
mod keys;
mod maintenance;
mod replace;

use clap::{Parser, Subcommand, ValueEnum};
use idemstore::{Clock, Error, RedbStore, SystemClock, Timestamp};
use serde_json::json;
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Exit code: the command did what was asked and found nothing wrong.
pub(crate) const EXIT_OK: u8 = 0;
/// Exit code: an error (I/O, a damaged or foreign file, bad input); the
/// message on stderr says which.
pub(crate) const EXIT_ERROR: u8 = 1;
/// Exit code: the command line was not understood (clap's usage error).
pub(crate) const EXIT_USAGE: u8 = 2;
/// Exit code: `verify` found problems, `export` skipped damaged records, or
/// `salvage` left records behind.
pub(crate) const EXIT_PROBLEMS: u8 = 3;
/// Exit code: another process (a running service, another `idemstore`
/// command) holds the store file.
pub(crate) const EXIT_LOCKED: u8 = 4;
/// Exit code: `get`, `evict` or `explain --require-record` found no record
/// for the key.
pub(crate) const EXIT_NOT_FOUND: u8 = 5;
/// Exit code: refused (`evict` without `--yes` and without a terminal;
/// `import` into a non-empty store without `--force`, or over a file that
/// is not a store; `salvage` onto an existing file).
pub(crate) const EXIT_REFUSED: u8 = 6;

/// Stores with at least this many records get a progress bar (when stderr
/// is a terminal) for the commands that read or touch every record.
pub(crate) const PROGRESS_MIN_RECORDS: u64 = 100_000;
/// How long a command tries again when the store is locked before it says
/// so (exit 4): a lock that lasts less is another command finishing, or a
/// process that forked while it had the file open and has not yet run its
/// new program.
pub(crate) const LOCK_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// `list` prints at most this many records unless `--limit` says otherwise.
pub(crate) const DEFAULT_LIST_LIMIT: u64 = 1_000;

/// Runs the `idemstore` command line with the process's arguments and
/// standard streams, and returns its exit code.
fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let usage = e.use_stderr();
            let code = if usage { EXIT_USAGE } else { EXIT_OK };
            if usage && std::env::args().any(|a| a == "--json") {
                let failure = Failure::new(EXIT_USAGE, e.to_string().trim_end());
                let _ = writeln!(std::io::stderr(), "{}", failure.to_json());
            } else {
                let _ = e.print();
            }
            return ExitCode::from(code);
        }
    };
    let stdin = std::io::stdin();
    let mut io = Io {
        out: &mut std::io::stdout().lock(),
        err: &mut std::io::stderr(),
        input: &mut stdin.lock(),
        input_is_tty: std::io::stdin().is_terminal(),
        progress: std::io::stderr().is_terminal(),
        now: SystemClock.now(),
        json: args.json,
    };
    ExitCode::from(run(args, &mut io))
}

/// Where a command reads and writes, and the time it takes as now.
pub(crate) struct Io<'a> {
    pub(crate) out: &'a mut dyn Write,
    pub(crate) err: &'a mut dyn Write,
    pub(crate) input: &'a mut dyn BufRead,
    /// Whether `input` is a terminal a person can answer a question on.
    pub(crate) input_is_tty: bool,
    /// Whether progress bars may be drawn (stderr is a terminal).
    pub(crate) progress: bool,
    pub(crate) now: Timestamp,
    /// `--json`: machine output, notes and errors included.
    pub(crate) json: bool,
}

impl Io<'_> {
    /// A note on stderr (a JSON object under `--json`): something the
    /// operator should know that is not the command's output.
    pub(crate) fn note(&mut self, message: &str) -> std::io::Result<()> {
        if self.json {
            writeln!(self.err, "{}", json!({"note": message}))
        } else {
            writeln!(self.err, "idemstore: note: {message}")
        }
    }
}

/// Shown after `--help`.
const EXIT_CODES_HELP: &str = "Exit codes: 0 ok, 1 error, 2 usage, 3 problems found (verify; \
export or salvage left damaged records behind), 4 locked by another process, 5 no such record, \
6 refused (no confirmation; import into a non-empty store without --force; an existing target). \
Under --json, errors are one JSON object on stderr: {\"error\":{\"kind\",\"message\",\"exit_code\"}}.";

/// Inspect and maintain an idemstore store file. Inspections read only;
/// the commands that write need the store closed by every other process.
#[derive(Debug, Parser)]
#[command(name = "idemstore", version, after_help = EXIT_CODES_HELP)]
pub(crate) struct Args {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Machine-readable JSON output instead of tables (errors too, on stderr).
    #[arg(long, global = true)]
    pub(crate) json: bool,
}

/// Which records `list` shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum StateFilter {
    /// Owners executing (or dead: flagged when the lease has passed).
    Processing,
    /// Completed, response stored.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Format {
    /// One JSON object per record per line.
    Jsonl,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Record counts by state, expired records not yet swept, expiry range,
    /// file sizes on disk, format version, token high-water mark. Reads only.
    Stats {
        /// The store file.
        store: PathBuf,
    },
    /// One record: state, fingerprint, lease and expiry, stored response.
    /// Reads only.
    Get {
        /// The store file.
        store: PathBuf,
        #[command(flatten)]
        key: keys::KeyArg,
        /// Show the whole body instead of its first 1 KiB.
        #[arg(long)]
        full: bool,
    },
    /// One line per record, in key order. Reads only.
    List {
        /// The store file.
        store: PathBuf,
        /// Only records in this state (expired ones excluded unless
        /// --include-expired).
        #[arg(long, value_enum)]
        state: Option<StateFilter>,
        /// Only records whose expiry has passed (invisible, not yet swept).
        #[arg(long, conflicts_with = "include_expired")]
        expired: bool,
        /// With --state: show expired records of that state too.
        #[arg(long)]
        include_expired: bool,
        /// Only records of this scope.
        #[arg(long)]
        scope: Option<String>,
        /// At most this many lines (0: no limit).
        #[arg(long, default_value_t = DEFAULT_LIST_LIMIT)]
        limit: u64,
    },
    /// What a request with this key (and body) would get now, and why:
    /// replay, 409 in flight, 422 conflict, or a claim. Reads only.
    Explain {
        /// The store file.
        store: PathBuf,
        #[command(flatten)]
        key: keys::KeyArg,
        /// The request's fingerprint (64 hex digits, as `fingerprint`
        /// prints it) instead of the request options.
        #[arg(long, conflicts_with_all = ["body", "method", "path", "header", "json_field"])]
        fingerprint: Option<String>,
        #[command(flatten)]
        request: explain::RequestArgs,
    },
    /// The write-ahead log: its size, whether the store was closed cleanly,
    /// the frames an open would replay, and every problem. Reads only.
    Log {
        /// The store file.
        store: PathBuf,
    },
    /// Compute a request's fingerprint exactly as the library and the HTTP
    /// layer do.
    Fingerprint {
        #[command(flatten)]
        request: explain::RequestArgs,
    },
    /// Remove one record (and its index entry), whatever its state.
    Evict {
        /// The store file.
        store: PathBuf,
        #[command(flatten)]
        key: keys::KeyArg,
        /// Do not ask for confirmation.
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Delete every expired record now.
    Sweep {
        /// The store file.
        store: PathBuf,
    },
    /// Reclaim the free space in the file (after sweeps).
    Compact {
        /// The store file.
        store: PathBuf,
    },
    /// Check the log, redb's pages, every record and index entry, without
    /// writing (redb's check runs on a private in-memory copy). Exit code 0
    /// only when all is well, 3 when problems were found.
    Verify {
        /// The store file.
        store: PathBuf,
    },
    /// Copy every record that verifies into a new store file, and report
    /// what was left behind. The damaged store is only read.
    Salvage {
        /// The damaged store file (read only).
        store: PathBuf,
        /// The new store file (must not exist).
        #[arg(long)]
        to: PathBuf,
    },
    /// Write every record (expired ones too) as JSON lines. Reads only.
    Export {
        /// The store file.
        store: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value = "jsonl")]
        format: Format,
        /// Write here instead of standard output.
        #[arg(long, short = 'o')]
        output: Option<PathBuf>,
    },
    /// Open a store whose files an open refuses (a damaged or missing
    /// write-ahead log, a store file lost beside its log) with whatever
    /// verifies, and write down what was given up (docs/operations.md).
    /// Without --accept-loss it only says whether there is anything to
    /// recover.
    Recover {
        /// The store file.
        store: PathBuf,
        /// Accept the loss: skip what does not verify, move a log that
        /// cannot be replayed aside, and write the report.
        #[arg(long)]
        accept_loss: bool,
        /// Where to write the report (JSON); `<STORE>.loss-report.json`
        /// when not given.
        #[arg(long)]
        report: Option<PathBuf>,
    },
    /// Read records written by `export` into a new store, or merge them
    /// into an existing one (--force). All or nothing: the result is built
    /// beside the target and renamed into place only when every line
    /// imported.
    Import {
        /// The store file (created; replaced only when every line imported).
        store: PathBuf,
        /// Input file; standard input when missing or `-`.
        input: Option<PathBuf>,
        /// Input format.
        #[arg(long, value_enum, default_value = "jsonl")]
        format: Format,
        /// Merge into a store that already holds records (same keys are replaced).
        #[arg(long)]
        force: bool,
    },
}

/// A failed command: the message for stderr, the exit code and a stable
/// kind for `--json`.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: u8,
    /// A stable name for scripts (`locked`, `corrupt`, `not_found`, ...).
    pub(crate) kind: &'static str,
    pub(crate) message: String,
}

impl Failure {
    /// A failure whose kind follows from its exit code.
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Failure {
        let kind = match code {
            EXIT_USAGE => "usage",
            EXIT_PROBLEMS => "problems",
            EXIT_LOCKED => "locked",
            EXIT_NOT_FOUND => "not_found",
            EXIT_REFUSED => "refused",
            _ => "error",
        };
        Failure {
            code,
            kind,
            message: message.into(),
        }
    }

    fn with_kind(mut self, kind: &'static str) -> Failure {
        self.kind = kind;
        self
    }

    /// The store's bytes did not verify.
    pub(crate) fn is_corrupt(&self) -> bool {
        self.kind == "corrupt"
    }

    /// `{"error":{"kind":..,"message":..,"exit_code":..}}`.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        json!({"error": {"kind": self.kind, "message": self.message, "exit_code": self.code}})
    }
}

impl From<Error> for Failure {
    fn from(err: Error) -> Failure {
        match &err {
            Error::Locked { path, holder } => Failure::new(
                EXIT_LOCKED,
                match holder {
                    Some(holder) => format!(
                        "{path} is locked by {holder}; stop that process, or inspect the \
                         store through it"
                    ),
                    None => format!(
                        "{path} is locked by another process (a running service, or another \
                         idemstore command); stop that process, or inspect the store through it"
                    ),
                },
            ),
            Error::Corrupt { .. } => Failure::new(EXIT_ERROR, err.to_string()).with_kind("corrupt"),
            Error::UnsupportedFormat { .. } => {
                Failure::new(EXIT_ERROR, err.to_string()).with_kind("unsupported_format")
            }
            Error::InvalidKey { .. } => {
                Failure::new(EXIT_ERROR, err.to_string()).with_kind("invalid_key")
            }
            Error::InvalidArgument { .. } => {
                Failure::new(EXIT_ERROR, err.to_string()).with_kind("invalid_argument")
            }
            Error::Io(_) => Failure::new(EXIT_ERROR, err.to_string()).with_kind("io"),
            _ => Failure::new(EXIT_ERROR, err.to_string()),
        }
    }
}

impl From<std::io::Error> for Failure {
    fn from(err: std::io::Error) -> Failure {
        Failure::new(EXIT_ERROR, format!("I/O error: {err}")).with_kind("io")
    }
}

/// What a command returns: its exit code, or a failure to report.
pub(crate) type Outcome = std::result::Result<u8, Failure>;

/// Runs parsed arguments; writes the failure message (if any) to `io.err`.
pub(crate) fn run(args: Args, io: &mut Io<'_>) -> u8 {
    let outcome = dispatch(args.command, io);
    match outcome {
        Ok(code) => code,
        Err(failure) => {
            let _ = if io.json {
                writeln!(io.err, "{}", failure.to_json())
            } else {
                writeln!(io.err, "idemstore: {}", failure.message)
            };
            failure.code
        }
    }
}

fn dispatch(command: Command, io: &mut Io<'_>) -> Outcome {
    match command {
        Command::Stats { store } => {
            let s = open_view(&store, io)?;
            commands::stats(&s, &store, io)
        }
        Command::Get { store, key, full } => {
            let s = open_view(&store, io)?;
            commands::get(&s, &key.key()?, full, io)
        }
        Command::List {
            store,
            state,
            expired,
            include_expired,
            scope,
            limit,
        } => {
            let s = open_view(&store, io)?;
            let filter = commands::ListFilter {
                state,
                expired,
                include_expired,
                scope,
                limit,
            };
            commands::list(&s, &filter, io)
        }
        Command::Explain {
            store,
            key,
            fingerprint,
            request,
        } => {
            let given = match fingerprint {
                Some(hex) => Some(explain::Given::parse_hex(&hex)?),
                None => request.fingerprint_if_given()?,
            };
            let s = open_view(&store, io)?;
            explain::explain(&s, &key.key()?, given.as_ref(), io)
        }
        Command::Log { store } => maintenance::log(&store, io),
        Command::Fingerprint { request } => explain::fingerprint(&request, io),
        Command::Evict { store, key, yes } => {
            let key = key.key()?;
            let s = open_writer(&store, io)?;
            commands::evict(&s, &key, yes, io)
        }
        Command::Sweep { store } => {
            let s = open_writer(&store, io)?;
            maintenance::sweep(&s, &store, io)
        }
        Command::Compact { store } => {
            let s = open_writer(&store, io)?;
            maintenance::compact(s, &store, io)
        }
        Command::Verify { store } => maintenance::verify(&store, io),
        Command::Salvage { store, to } => maintenance::salvage(&store, &to, io),
        Command::Export {
            store,
            format: Format::Jsonl,
            output,
        } => {
            let s = open_view(&store, io)?;
            maintenance::export(&s, output.as_deref(), io)
        }
        Command::Recover {
            store,
            accept_loss,
            report,
        } => maintenance::recover(&store, accept_loss, report.as_deref(), io),
        Command::Import {
            store,
            input,
            format: Format::Jsonl,
            force,
        } => maintenance::import(&store, input.as_deref(), force, io),
    }
}

/// [`Failure`] when `path` is not a store file: missing, not a regular
/// file, or empty. A typo must not create files, and an empty file is not
/// a store.
pub(crate) fn existing_store_file(path: &Path) -> std::result::Result<(), Failure> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            Failure::new(EXIT_ERROR, format!("no store at {}", path.display()))
                .with_kind("not_found")
        }
        _ => {
            Failure::new(EXIT_ERROR, format!("cannot read {}: {e}", path.display())).with_kind("io")
        }
    })?;
    if !meta.is_file() {
        return Err(Failure::new(
            EXIT_ERROR,
            format!("{} is not a file", path.display()),
        ));
    }
    if meta.len() == 0 {
        return Err(Failure::new(
            EXIT_ERROR,
            format!("{} is empty (0 bytes): not a store file", path.display()),
        )
        .with_kind("corrupt"));
    }
    Ok(())
}

/// Opens an existing store read-only: nothing is written, and a file the
/// user cannot write is fine. Says (on stderr) when the view includes
/// frames of the write-ahead log not yet in the store file.
pub(crate) fn open_view(path: &Path, io: &mut Io<'_>) -> std::result::Result<RedbStore, Failure> {
    existing_store_file(path)?;
    let store =
        retry_locked(|| RedbStore::builder().open_read_only(path)).map_err(|e| name_io(e, path))?;
    let frames = store.stats().frames_replayed_on_open;
    if frames > 0 {
        io.note(&format!(
            "the view includes {} of the write-ahead log that {} not yet in the store file \
             (the service's next open writes them in; nothing was written)",
            frames_of(frames),
            if frames == 1 { "is" } else { "are" }
        ))?;
    }
    Ok(store)
}

/// Opens an existing store to write to it (it is never created here).
/// Says (on stderr) when the open replayed log frames into the file.
pub(crate) fn open_writer(path: &Path, io: &mut Io<'_>) -> std::result::Result<RedbStore, Failure> {
    existing_store_file(path)?;
    let store = retry_locked(|| RedbStore::open(path)).map_err(|e| name_io(e, path))?;
    let frames = store.stats().frames_replayed_on_open;
    if frames > 0 {
        io.note(&format!(
            "replayed {} of the write-ahead log into the store file (writes the last process \
             acknowledged before it stopped)",
            frames_of(frames)
        ))?;
    }
    Ok(store)
}

/// `open()`, tried again for up to [`LOCK_GRACE`] while it is `Locked`.
pub(crate) fn retry_locked(
    open: impl Fn() -> idemstore::Result<RedbStore>,
) -> idemstore::Result<RedbStore> {
    let until = std::time::Instant::now() + LOCK_GRACE;
    loop {
        match open() {
            Err(Error::Locked { .. }) if std::time::Instant::now() < until => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// "1 frame", "2 frames".
fn frames_of(n: u64) -> String {
    format!("{n} frame{}", if n == 1 { "" } else { "s" })
}

/// An I/O error opening `path` names the file.
fn name_io(err: Error, path: &Path) -> Failure {
    match err {
        Error::Io(e) => {
            Failure::new(EXIT_ERROR, format!("cannot open {}: {e}", path.display())).with_kind("io")
        }
        other => Failure::from(other),
    }
}

/// The file's size in bytes, 0 when it cannot be read.
pub(crate) fn file_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn locked_maps_to_its_own_exit_code_and_names_the_holder() {
        let f = Failure::from(Error::Locked {
            path: "orders.idem".into(),
            holder: None,
        });
        assert_eq!((f.code, f.kind), (EXIT_LOCKED, "locked"));
        assert!(
            f.message.contains("locked by another process"),
            "{}",
            f.message
        );
        let f = Failure::from(Error::Locked {
            path: "orders.idem".into(),
            holder: Some("pid 42 (orders_service)".into()),
        });
        assert!(
            f.message.contains("locked by pid 42 (orders_service)"),
            "{}",
            f.message
        );
    }

    #[test]
    fn failures_as_json_carry_kind_message_and_code() {
        let v = Failure::new(EXIT_NOT_FOUND, "no record for t/k").to_json();
        assert_eq!(v["error"]["kind"], "not_found");
        assert_eq!(v["error"]["exit_code"], 5);
        assert_eq!(v["error"]["message"], "no record for t/k");
        let corrupt = Failure::from(Error::Corrupt {
            key: None,
            detail: "x".into(),
        });
        assert!(corrupt.is_corrupt());
        assert_eq!(corrupt.code, EXIT_ERROR);
    }
}
