//! [`PostgresStore::atomic_step`]: a step whose SQL runs in the
//! transaction that records it, as [`PgInbox`](super::PgInbox) runs a
//! handler in the transaction of its DONE record.

use super::errors::db_error;
use super::inbox::{OpenTx, settled};
use super::ops::{Core, RunError, durable, stored};
use super::sql::Stmt;
use super::{PostgresStore, row};
use crate::error::Error;
use crate::guard::Next;
use crate::key::Key;
use crate::logic;
use crate::record::Claim;
use crate::step::{self, Step};
use crate::time::Timestamp;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tokio_postgres::Client;

/// What an atomic step's handler returns: a boxed future of its output that
/// may borrow the client.
pub type StepFuture<'c, E> = Pin<Box<dyn Future<Output = Result<Vec<u8>, E>> + Send + 'c>>;

impl PostgresStore {
    /// Runs the step `name` of `claim`'s run as an atomic phase: `handler`'s
    /// statements (on the [`Client`] it is given, inside a transaction) and
    /// the step's record commit together, so a crash or a lost connection
    /// leaves both or neither, and a retry never applies them twice. A step
    /// an earlier attempt recorded ([`Claim::steps`]) returns its output
    /// without running. The handler gets the step key ([`Key::step_key`]).
    ///
    /// An `Err` from the handler rolls everything back and records nothing;
    /// a claim that no longer owns `key` (taken over, released, expired) is
    /// [`Error::StaleClaim`], with the handler's statements rolled back. A
    /// failed `COMMIT`, or one the server reports done on the primary only,
    /// is an [`Error::Backend`] whose outcome is unknown: the next attempt
    /// finds the step recorded or not. The limits and the one-name-per-run
    /// rule are [`Claim::step`]'s; a claim from
    /// [`Store::begin`](crate::Store::begin) may be used too. The
    /// transaction holds a pooled connection while the handler runs.
    ///
    /// ```no_run
    /// # async fn f(store: std::sync::Arc<idemstore::PostgresStore>, key: idemstore::Key, claim: idemstore::Claim) -> Result<(), idemstore::Error> {
    /// let reserved = store
    ///     .atomic_step(&key, &claim, "reserve", |client, _step_key| {
    ///         Box::pin(async move {
    ///             client.execute("UPDATE stock SET n = n - 1 WHERE sku = 'apple'", &[]).await
    ///                 .map_err(|e| idemstore::Error::backend(e.to_string()))?;
    ///             Ok::<_, idemstore::Error>(b"1".to_vec())
    ///         })
    ///     })
    ///     .await?;
    /// # let _ = reserved; Ok(()) }
    /// ```
    pub fn atomic_step<E, F>(
        &self,
        key: &Key,
        claim: &Claim,
        name: &str,
        handler: F,
    ) -> impl Future<Output = Result<Vec<u8>, E>> + Send + 'static
    where
        E: From<Error> + Send + 'static,
        F: for<'c> FnOnce(&'c Client, String) -> StepFuture<'c, E> + Send + 'static,
    {
        let decided = replayed(claim, name);
        let core = Arc::clone(&self.core);
        let (key, claim, name) = (key.clone(), claim.clone(), name.to_owned());
        let now = self.clock.now();
        let task = self.runtime.spawn_task(async move {
            match decided {
                Err(e) => Err(e.into()),
                Ok(Some(output)) => Ok(output),
                Ok(None) => run(&core, &key, &claim, &name, now, handler).await,
            }
        });
        async move { task.await.unwrap_or_else(|| Err(Error::Closed.into())) }
    }
}

/// The output when an earlier attempt recorded the step; checks the name
/// (and, in a guard's run, claims it for the run).
fn replayed(claim: &Claim, name: &str) -> Result<Option<Vec<u8>>, Error> {
    if claim.run.is_some() {
        return Ok(match claim.next_step(name)? {
            Next::Replay(output) => Some(output),
            Next::Run(_) => None,
        });
    }
    step::check_name(name)?;
    Ok(claim
        .steps
        .iter()
        .find(|s| s.name == name)
        .map(|s| s.output.clone()))
}

async fn run<E, F>(
    core: &Core,
    key: &Key,
    claim: &Claim,
    name: &str,
    now: Timestamp,
    handler: F,
) -> Result<Vec<u8>, E>
where
    E: From<Error>,
    F: for<'c> FnOnce(&'c Client, String) -> StepFuture<'c, E>,
{
    let token = row::token(claim.token).ok_or(Error::StaleClaim)?;
    let (mut open, conn, seen) = OpenTx::take(&core.pool).await?;
    let table = &core.sql.table;
    let db = |e| -> E { db_error(e, table).into() };
    let run = |e: RunError| -> E { e.into_error(table).into() };
    conn.client.batch_execute("BEGIN").await.map_err(db)?;
    let output = match handler(&conn.client, key.step_key(name)).await {
        Ok(output) => output,
        Err(err) => {
            open.rollback(&conn).await.map_err(db)?;
            return Err(err);
        }
    };
    let step = Step::new(name, output)?;
    let existing = stored(&conn, key).await.map_err(run)?;
    let decided = logic::record_step(existing, claim, &step, now);
    let record = match decided {
        Ok(Some(record)) => record,
        // Recorded already (a retried call): the handler's statements
        // must not apply twice. Acknowledged once that record is durable.
        Ok(None) => {
            conn.client.batch_execute("ROLLBACK").await.map_err(db)?;
            durable(&conn).await.map_err(run)?;
            return Ok(settled(&mut open, &conn, seen, step.output)?);
        }
        Err(e) => {
            open.rollback(&conn).await.map_err(db)?;
            return Err(e.into());
        }
    };
    // The owner's check on the newest row, under its lock; the steps as
    // read (Stmt::RecordStep). No row: the record changed while the step
    // ran, and nothing of it is kept.
    let seen_steps = i32::try_from(record.steps.len().saturating_sub(1)).unwrap_or(i32::MAX);
    let at = row::millis(now);
    let (name, output) = (step.name.as_bytes(), &step.output[..]);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] = [
        &key.scope(),
        &key.id(),
        &token,
        &at,
        &name,
        &output,
        &seen_steps,
    ];
    let appended = conn.execute(Stmt::RecordStep, &params).await.map_err(db)?;
    if appended != 1 {
        open.rollback(&conn).await.map_err(db)?;
        return Err(Error::StaleClaim.into());
    }
    conn.client.batch_execute("COMMIT").await.map_err(db)?;
    Ok(settled(&mut open, &conn, seen, step.output)?)
}
