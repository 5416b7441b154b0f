//! Power loss against plain redb: proves [`CrashBackend`] and the way the
//! checks read acknowledgements before they are used to judge idemstore.
//! If redb itself failed these, no store on it could pass.

use super::backend::{CrashBackend, CrashImage, SyncMode, TornSectors};
use super::rng::Rng;
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

const TABLE: TableDefinition<u64, &[u8]> = TableDefinition::new("raw");

/// What one [`raw_redb_run`] checked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawRun {
    /// Crash images reopened and checked.
    pub crash_points: u64,
    /// Acknowledged commits whose contents were checked, summed over images.
    pub acked_checked: u64,
}

type Contents = BTreeMap<u64, Vec<u8>>;

/// One commit of the workload, as acknowledged.
struct Commit {
    durable: bool,
    /// `CrashBackend::mutations` when `commit` returned.
    acked_at: u64,
    /// The table after it.
    after: Contents,
}

/// Runs `commits` seeded transactions (inserts of 1 B..12 KiB values,
/// overwrites, deletes; one in five non-durable) on redb over a
/// [`CrashBackend`], takes a power-loss image at `crash_points` chosen
/// points, and checks each reopened image: it opens without a panic, passes
/// redb's integrity check, and holds exactly the table as of some commit
/// between the last acknowledged durable one and the first unacknowledged
/// one (the commit in flight is all or nothing). With [`SyncMode::Lies`]
/// the checks must fail: that is how they are shown able to.
pub fn raw_redb_run(
    seed: u64,
    commits: usize,
    crash_points: usize,
    sync: SyncMode,
) -> Result<RawRun, String> {
    let (run, failures) =
        raw_redb_run_all_points(seed, commits, crash_points, sync, TornSectors::OldOrNew)?;
    match failures.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(run),
    }
}

/// [`raw_redb_run`] on a disk whose sectors being written read back as
/// `torn` says, checking every image even after one fails: the run counts
/// the images that passed, and each failure is listed. `Err` is a failure
/// of the run itself.
pub fn raw_redb_run_all_points(
    seed: u64,
    commits: usize,
    crash_points: usize,
    sync: SyncMode,
    torn: TornSectors,
) -> Result<(RawRun, Vec<String>), String> {
    let mut rng = Rng::new(seed);
    let backend = CrashBackend::new();
    backend.set_sync_mode(sync);
    backend.set_torn_sectors(torn);
    let db = Database::builder()
        .create_with_backend(backend.clone())
        .map_err(|e| format!("create: {e}"))?;
    let mut history = vec![Commit {
        durable: true,
        acked_at: backend.mutations(),
        after: Contents::new(),
    }];
    let mut table = Contents::new();
    // Crash points are planned once the run's length is roughly known: a
    // first guess, then everything left goes at the end.
    let expected_mutations = (commits as u64).saturating_mul(8).max(1);
    backend.plan((0..crash_points).map(|_| (rng.below(expected_mutations), rng.next_u64())));
    for i in 0..commits {
        let durable = !rng.chance(20);
        let mut txn = db.begin_write().map_err(|e| format!("begin: {e}"))?;
        if !durable {
            txn.set_durability(Durability::None)
                .map_err(|e| format!("durability: {e}"))?;
        }
        {
            let mut t = txn.open_table(TABLE).map_err(|e| format!("open: {e}"))?;
            for _ in 0..=rng.below(4) {
                let k = rng.below(64);
                if rng.chance(25) {
                    t.remove(k).map_err(|e| format!("remove: {e}"))?;
                    table.remove(&k);
                } else {
                    let len = usize::try_from(1 + rng.below(12 * 1024)).unwrap_or(1);
                    let v = vec![u8::try_from(i % 251).unwrap_or(0); len];
                    t.insert(k, v.as_slice())
                        .map_err(|e| format!("insert: {e}"))?;
                    table.insert(k, v);
                }
            }
        }
        txn.commit().map_err(|e| format!("commit {i}: {e}"))?;
        history.push(Commit {
            durable,
            acked_at: backend.mutations(),
            after: table.clone(),
        });
    }
    drop(db);
    let mut run = RawRun::default();
    let mut failures = Vec::new();
    for image in backend.take_images() {
        match check_image(&image, &history) {
            Ok(acked) => {
                run.acked_checked += acked;
                run.crash_points += 1;
            }
            Err(e) => failures.push(e),
        }
    }
    Ok((run, failures))
}

/// Checks one image against the history; returns the acknowledged commits
/// it covered.
fn check_image(image: &CrashImage, history: &[Commit]) -> Result<u64, String> {
    let at = image.at;
    let acked = history.iter().filter(|c| c.acked_at <= at).count();
    let floor = history
        .iter()
        .take(acked)
        .rposition(|c| c.durable)
        .unwrap_or(0);
    let found = read_image(image)?;
    let last = acked.min(history.len().saturating_sub(1));
    let candidates = history.get(floor..=last).unwrap_or_default();
    if candidates.iter().any(|c| c.after == found) {
        Ok(acked as u64)
    } else {
        Err(format!(
            "image at {at} (seed {}): table of {} keys matches no commit in {floor}..={acked}",
            image.seed,
            found.len()
        ))
    }
}

fn read_image(image: &CrashImage) -> Result<Contents, String> {
    let ctx = |what: &str, e: &dyn std::fmt::Display| {
        format!("image at {} (seed {}): {what}: {e}", image.at, image.seed)
    };
    let backend = CrashBackend::from_image(image.bytes.clone());
    let opened = catch_unwind(AssertUnwindSafe(|| {
        Database::builder().create_with_backend(backend)
    }))
    .map_err(|_| ctx("open", &"redb panicked"))?;
    let mut db = opened.map_err(|e| ctx("open", &e))?;
    let contents = {
        let txn = db.begin_read().map_err(|e| ctx("read", &e))?;
        match txn.open_table(TABLE) {
            Ok(t) => {
                let mut out = Contents::new();
                for entry in t.iter().map_err(|e| ctx("iter", &e))? {
                    let (k, v) = entry.map_err(|e| ctx("entry", &e))?;
                    out.insert(k.value(), v.value().to_vec());
                }
                out
            }
            Err(redb::TableError::TableDoesNotExist(_)) => Contents::new(),
            Err(e) => return Err(ctx("table", &e)),
        }
    };
    match db.check_integrity() {
        Ok(true) => Ok(contents),
        Ok(false) => Err(ctx("integrity", &"repaired after open")),
        Err(e) => Err(ctx("integrity", &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_redb_survives_power_loss() {
        let run = raw_redb_run(1, 40, 40, SyncMode::Honest).unwrap();
        assert_eq!(run.crash_points, 40);
        assert!(run.acked_checked > 0);
    }
}
