//! `idemstore`: the operator tool (features `cli` and `redb`): inspect,
//! evict, sweep, compact, verify, export and import a `RedbStore` file.
//!
//! Built on idemstore's public API alone (`idemstore::redb::admin` for what
//! the `Store` contract does not cover). The commands are functions over an
//! `Io` (streams and now) so that unit tests drive them without a process;
//! integration tests (`tests/it/cli.rs`) run the real binary.
//!
//! ```text
//! idemstore stats   STORE
//! idemstore get     STORE [--scope S] KEY [--full]
//! idemstore list    STORE [--state processing|done] [--expired] [--scope S] [--limit N]
//! idemstore evict   STORE [--scope S] KEY [--yes]
//! idemstore sweep   STORE
//! idemstore compact STORE
//! idemstore verify  STORE
//! idemstore export  STORE [--format jsonl] [-o FILE]
//! idemstore import  STORE [--format jsonl] [FILE] [--force]
//! idemstore recover STORE --accept-loss [--report FILE]
//! ```
//! Every command takes `--json` for machine output. Exit codes are the
//! constants below.

mod commands;
mod format;
mod maintenance;

use clap::{Parser, Subcommand, ValueEnum};
use idemstore::{Clock, Error, RedbStore, SystemClock, Timestamp};
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
/// Exit code: `verify` found problems, or `export` skipped damaged records.
pub(crate) const EXIT_PROBLEMS: u8 = 3;
/// Exit code: another process (a running service) holds the store file.
pub(crate) const EXIT_LOCKED: u8 = 4;
/// Exit code: `get` or `evict` found no record for the key.
pub(crate) const EXIT_NOT_FOUND: u8 = 5;
/// Exit code: refused without confirmation (`evict` without `--yes` and
/// without a terminal, or `import` into a non-empty store without `--force`).
pub(crate) const EXIT_REFUSED: u8 = 6;

/// Stores with at least this many records get a progress bar (when stderr
/// is a terminal) for the commands that read or touch every record.
pub(crate) const PROGRESS_MIN_RECORDS: u64 = 100_000;
/// `list` prints at most this many records unless `--limit` says otherwise.
pub(crate) const DEFAULT_LIST_LIMIT: u64 = 1_000;

/// Runs the `idemstore` command line with the process's arguments and
/// standard streams, and returns its exit code.
fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_USAGE } else { EXIT_OK });
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
}

/// Shown after `--help`.
const EXIT_CODES_HELP: &str = "Exit codes: 0 ok, 1 error, 2 usage, 3 verify found problems \
(or export skipped damaged records), 4 locked by another process, 5 no such record, \
6 refused (no confirmation, or import into a non-empty store without --force).";

/// Inspect and maintain an idemstore store file (one that no running
/// process holds open).
#[derive(Debug, Parser)]
#[command(name = "idemstore", version, after_help = EXIT_CODES_HELP)]
pub(crate) struct Args {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Machine-readable JSON output instead of tables.
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
    /// file size, format version, token high-water mark.
    Stats {
        /// The store file.
        store: PathBuf,
    },
    /// One record: state, fingerprint, lease and expiry, stored response.
    Get {
        /// The store file.
        store: PathBuf,
        /// The key's id (the Idempotency-Key).
        key: String,
        /// The key's scope (tenant); empty when not given.
        #[arg(long, default_value = "")]
        scope: String,
        /// Show the whole body instead of its first 1 KiB.
        #[arg(long)]
        full: bool,
    },
    /// One line per record, in key order.
    List {
        /// The store file.
        store: PathBuf,
        /// Only records in this state.
        #[arg(long, value_enum)]
        state: Option<StateFilter>,
        /// Only records whose expiry has passed (invisible, not yet swept).
        #[arg(long)]
        expired: bool,
        /// Only records of this scope.
        #[arg(long)]
        scope: Option<String>,
        /// At most this many lines (0: no limit).
        #[arg(long, default_value_t = DEFAULT_LIST_LIMIT)]
        limit: u64,
    },
    /// Remove one record (and its index entry), whatever its state.
    Evict {
        /// The store file.
        store: PathBuf,
        /// The key's id.
        key: String,
        /// The key's scope; empty when not given.
        #[arg(long, default_value = "")]
        scope: String,
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
    /// Read every record and index entry and check checksums and that the
    /// record table and the expiry index agree. Exit code 0 only when all is well.
    Verify {
        /// The store file.
        store: PathBuf,
    },
    /// Write every record (expired ones too) as JSON lines.
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
    /// Read records written by `export` into a new (or empty) store.
    Import {
        /// The store file (created if missing).
        store: PathBuf,
        /// Input file; standard input when missing or `-`.
        input: Option<PathBuf>,
        /// Input format.
        #[arg(long, value_enum, default_value = "jsonl")]
        format: Format,
        /// Import into a store that already holds records (same keys are replaced).
        #[arg(long)]
        force: bool,
    },
}

/// A failed command: the message for stderr and the exit code.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) message: String,
    /// The store's bytes did not verify ([`Error::Corrupt`]).
    pub(crate) corrupt: bool,
}

impl Failure {
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
            corrupt: false,
        }
    }
}

impl From<Error> for Failure {
    fn from(err: Error) -> Failure {
        match &err {
            Error::Locked { path } => Failure::new(
                EXIT_LOCKED,
                format!(
                    "{path} is locked by another process (a running service holds it); \
                     stop that process, or inspect the store through it"
                ),
            ),
            Error::Corrupt { .. } => Failure {
                corrupt: true,
                ..Failure::new(EXIT_ERROR, err.to_string())
            },
            _ => Failure::new(EXIT_ERROR, err.to_string()),
        }
    }
}

impl From<std::io::Error> for Failure {
    fn from(err: std::io::Error) -> Failure {
        Failure::new(EXIT_ERROR, format!("I/O error: {err}"))
    }
}

/// What a command returns: its exit code, or a failure to report.
pub(crate) type Outcome = std::result::Result<u8, Failure>;

/// Runs parsed arguments; writes the failure message (if any) to `io.err`.
pub(crate) fn run(args: Args, io: &mut Io<'_>) -> u8 {
    let json = args.json;
    let outcome = match args.command {
        Command::Stats { store } => {
            open(&store).and_then(|s| commands::stats(&s, &store, json, io))
        }
        Command::Get {
            store,
            key,
            scope,
            full,
        } => open(&store).and_then(|s| commands::get(&s, &scope, &key, full, json, io)),
        Command::List {
            store,
            state,
            expired,
            scope,
            limit,
        } => open(&store).and_then(|s| {
            let filter = commands::ListFilter {
                state,
                expired,
                scope,
                limit,
            };
            commands::list(&s, &filter, json, io)
        }),
        Command::Evict {
            store,
            key,
            scope,
            yes,
        } => open(&store).and_then(|s| commands::evict(&s, &scope, &key, yes, json, io)),
        Command::Sweep { store } => {
            open(&store).and_then(|s| maintenance::sweep(&s, &store, json, io))
        }
        Command::Compact { store } => {
            open(&store).and_then(|s| maintenance::compact(s, &store, json, io))
        }
        Command::Verify { store } => match maintenance::verify_log(&store, json, io) {
            // The log holds what an open would refuse: reported, and the
            // store is not opened (an open would refuse it anyway, and
            // verify never writes to a store it found damaged).
            Ok(Some(code)) => Ok(code),
            Err(f) => Err(f),
            Ok(None) => match open(&store) {
                // A file too damaged to open is a verify finding, not a usage error.
                Err(f) if f.corrupt => Err(Failure::new(
                    EXIT_PROBLEMS,
                    format!("verify: {}", f.message),
                )),
                opened => match opened.and_then(|s| maintenance::verify(&s, json, io)) {
                    // Damage redb itself cannot repair ends the check: still a finding.
                    Err(f) if f.corrupt => Err(Failure::new(
                        EXIT_PROBLEMS,
                        format!("verify: {}", f.message),
                    )),
                    other => other,
                },
            },
        },
        Command::Export {
            store,
            format: Format::Jsonl,
            output,
        } => open(&store).and_then(|s| maintenance::export(&s, output.as_deref(), json, io)),
        Command::Recover {
            store,
            accept_loss,
            report,
        } => maintenance::recover(&store, accept_loss, report.as_deref(), json, io),
        Command::Import {
            store,
            input,
            format: Format::Jsonl,
            force,
        } => RedbStore::open(&store)
            .map_err(Failure::from)
            .and_then(|s| maintenance::import(s, input.as_deref(), force, json, io)),
    };
    match outcome {
        Ok(code) => code,
        Err(failure) => {
            let _ = writeln!(io.err, "idemstore: {}", failure.message);
            failure.code
        }
    }
}

/// Opens an existing store. A missing path is an error rather than a new
/// empty store: a typo must not create files.
pub(crate) fn open(path: &Path) -> std::result::Result<RedbStore, Failure> {
    if !path.exists() {
        return Err(Failure::new(
            EXIT_ERROR,
            format!("no store at {}", path.display()),
        ));
    }
    Ok(RedbStore::open(path)?)
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
    fn locked_maps_to_its_own_exit_code_and_message() {
        let f = Failure::from(Error::Locked {
            path: "orders.idem".into(),
        });
        assert_eq!(f.code, EXIT_LOCKED);
        assert!(
            f.message.contains("locked by another process"),
            "{}",
            f.message
        );
    }
}
