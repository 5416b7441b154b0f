//! The message-side workload: payments from an at-least-once queue applied
//! to an account table through an inbox, in batches, with a share of
//! redeliveries. Two sides run it:
//!
//! - [`Ours`]: `idemstore::redb::Inbox::handle_batch` (or `handle`, one
//!   message per call), the account table in the store's own file;
//! - [`Pg`] (feature `postgres`): PostgreSQL as a user would write it, per
//!   batch `BEGIN; INSERT INTO inbox .. ON CONFLICT DO NOTHING RETURNING id;
//!   UPDATE accounts ..; COMMIT` with `synchronous_commit` on (the default).
//!
//! Used by the `inbox_compare` binary and the `inbox` criterion bench.

use crate::peers::BoxResult;
use idemstore::redb::engine::{ReadableTable, TableDefinition, WriteTransaction};
use idemstore::redb::{Delivery, Inbox, Message};
use idemstore::{BoxError, Claim, Fingerprint, Key, RedbStore, Response};
use std::path::Path;

/// Accounts the payments spread over.
pub const ACCOUNTS: u64 = 1_000;

/// account -> balance, in the store's file.
pub const BALANCES: TableDefinition<u64, i64> = TableDefinition::new("bench.balances");

/// One payment: a message of the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Payment {
    /// The message id (unique per payment; a redelivery repeats it).
    pub id: u64,
    /// The account credited.
    pub account: u64,
    /// The amount credited.
    pub amount: i64,
}

impl Payment {
    /// Payment `id`: its account and amount are functions of the id.
    pub fn of(id: u64) -> Payment {
        let mixed = splitmix(id);
        Payment {
            id,
            account: mixed % ACCOUNTS,
            amount: (mixed >> 32) as i64 % 100 + 1,
        }
    }

    /// The payment as an inbox delivery.
    pub fn message(self) -> Message<Payment> {
        let key = Key::new("payments", format!("p-{}", self.id))
            .unwrap_or_else(|e| unreachable!("a short id is a valid key: {e}"));
        let fingerprint =
            Fingerprint::of_parts([&self.account.to_be_bytes()[..], &self.amount.to_be_bytes()]);
        Message::new(key, fingerprint, self)
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The queue: batches of fresh payments with a share of redeliveries of
/// payments delivered before (seeded, the same for every side).
#[derive(Debug)]
pub struct Feed {
    next_id: u64,
    redelivery_percent: u64,
    rng: u64,
}

impl Feed {
    /// A feed in which about `redelivery_percent` of each batch (after the
    /// first) are redeliveries.
    pub fn new(redelivery_percent: u64, seed: u64) -> Feed {
        Feed {
            next_id: 0,
            redelivery_percent,
            rng: seed,
        }
    }

    /// The next batch of `n` deliveries.
    pub fn batch(&mut self, n: usize) -> Vec<Payment> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            self.rng = splitmix(self.rng);
            let redeliver = self.next_id > 0 && self.rng % 100 < self.redelivery_percent;
            let id = if redeliver {
                // One of the last 10,000 payments delivered.
                let window = self.next_id.min(10_000);
                self.next_id - 1 - (self.rng >> 32) % window
            } else {
                self.next_id += 1;
                self.next_id - 1
            };
            out.push(Payment::of(id));
        }
        out
    }
}

/// Counts of one run: deliveries and how many were handled (new).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Deliveries processed.
    pub messages: u64,
    /// Of those, handled for the first time (the rest were redeliveries).
    pub handled: u64,
}

/// The business write: credit the payment's account.
pub fn credit(txn: &WriteTransaction, _claim: &Claim, p: &Payment) -> Result<Response, BoxError> {
    let mut balances = txn.open_table(BALANCES)?;
    let new = balances.get(p.account)?.map_or(0, |v| v.value()) + p.amount;
    balances.insert(p.account, new)?;
    Ok(Response::new(200, ""))
}

/// idemstore's side: an inbox on a fresh store in a directory.
pub struct Ours {
    inbox: Inbox,
}

impl Ours {
    /// A fresh store in `dir` (the defaults: immediate durability), with
    /// redb's quick-repair on the inbox's commits or not.
    pub fn open(dir: &Path, quick_repair: bool) -> BoxResult<Ours> {
        let store = RedbStore::open(dir.join("inbox.idem"))?;
        Ok(Ours {
            inbox: Inbox::new(store).quick_repair(quick_repair),
        })
    }

    /// The inbox.
    pub fn inbox(&self) -> &Inbox {
        &self.inbox
    }

    /// One batch through `handle_batch`; checks every answer.
    pub fn batch(&self, payments: &[Payment]) -> BoxResult<Tally> {
        let messages: Vec<Message<Payment>> = payments.iter().map(|p| p.message()).collect();
        let answers = self
            .inbox
            .handle_batch(&messages, |txn, claim, m| credit(txn, claim, &m.payload))?;
        let mut tally = Tally::default();
        for answer in answers {
            tally.messages += 1;
            match answer? {
                Delivery::Handled(_) => tally.handled += 1,
                Delivery::Duplicate(_) => {}
                other => return Err(format!("unexpected {other:?}").into()),
            }
        }
        Ok(tally)
    }

    /// The same deliveries one `handle` call each: the one-message inbox.
    pub fn one_by_one(&self, payments: &[Payment]) -> BoxResult<Tally> {
        let mut tally = Tally::default();
        for p in payments {
            let m = p.message();
            let answer = self
                .inbox
                .handle(&m.key, &m.fingerprint, |txn, claim| credit(txn, claim, p))?;
            tally.messages += 1;
            match answer {
                Delivery::Handled(_) => tally.handled += 1,
                Delivery::Duplicate(_) => {}
                other => return Err(format!("unexpected {other:?}").into()),
            }
        }
        Ok(tally)
    }

    /// The sum of all balances (what the handled payments credited).
    pub fn total(&self) -> BoxResult<i64> {
        self.inbox.read(|txn| {
            let Ok(t) = txn.open_table(BALANCES) else {
                return Ok(0);
            };
            let mut sum = 0;
            for entry in t.iter()? {
                sum += entry?.1.value();
            }
            Ok(sum)
        })
    }
}

/// PostgreSQL's side, as a user would write it: an inbox table whose
/// primary key is the message id, and the account table, written in one
/// transaction per batch.
#[cfg(feature = "postgres")]
pub struct Pg {
    client: postgres::Client,
    inbox: String,
    accounts: String,
}

#[cfg(feature = "postgres")]
impl Pg {
    /// Fresh tables (named after this process and `tag`) on the server at `url`.
    pub fn open(url: &str, tag: &str) -> BoxResult<Pg> {
        let mut client = postgres::Client::connect(url, postgres::NoTls)?;
        let inbox = format!("bench_inbox_{}_{tag}", std::process::id());
        let accounts = format!("bench_accounts_{}_{tag}", std::process::id());
        client.batch_execute(&format!(
            "DROP TABLE IF EXISTS {inbox}; DROP TABLE IF EXISTS {accounts};
             CREATE TABLE {inbox} (id text PRIMARY KEY, handled_at timestamptz NOT NULL DEFAULT now());
             CREATE TABLE {accounts} (id bigint PRIMARY KEY, balance bigint NOT NULL);
             INSERT INTO {accounts} SELECT g, 0 FROM generate_series(0, {}) g;",
            ACCOUNTS - 1
        ))?;
        Ok(Pg {
            client,
            inbox,
            accounts,
        })
    }

    /// One batch in one transaction: record the new ids, credit their
    /// payments, commit (one WAL flush).
    pub fn batch(&mut self, payments: &[Payment]) -> BoxResult<Tally> {
        let ids: Vec<String> = payments.iter().map(|p| format!("p-{}", p.id)).collect();
        let mut txn = self.client.transaction()?;
        let new = claim_new(&mut txn, &self.inbox, &ids)?;
        let mut accounts = Vec::new();
        let mut amounts = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (p, id) in payments.iter().zip(&ids) {
            if new.contains(id) && seen.insert(id) {
                accounts.push(p.account as i64);
                amounts.push(p.amount);
            }
        }
        if !accounts.is_empty() {
            txn.execute(&credit_all(&self.accounts), &[&accounts, &amounts])?;
        }
        txn.commit()?;
        Ok(Tally {
            messages: payments.len() as u64,
            handled: accounts.len() as u64,
        })
    }

    /// [`batch`](Pg::batch) with the account update written per message,
    /// as a per-message handler would: one `UPDATE` statement (prepared
    /// and run, two round trips) for each new payment, in the batch's
    /// transaction.
    pub fn batch_per_message(&mut self, payments: &[Payment]) -> BoxResult<Tally> {
        let ids: Vec<String> = payments.iter().map(|p| format!("p-{}", p.id)).collect();
        let update = format!(
            "UPDATE {} SET balance = balance + $1 WHERE id = $2",
            self.accounts
        );
        let mut txn = self.client.transaction()?;
        let new = claim_new(&mut txn, &self.inbox, &ids)?;
        let mut seen = std::collections::HashSet::new();
        let mut handled = 0;
        for (p, id) in payments.iter().zip(&ids) {
            if new.contains(id) && seen.insert(id) {
                txn.execute(update.as_str(), &[&p.amount, &(p.account as i64)])?;
                handled += 1;
            }
        }
        txn.commit()?;
        Ok(Tally {
            messages: payments.len() as u64,
            handled,
        })
    }

    /// The sum of all balances.
    pub fn total(&mut self) -> BoxResult<i64> {
        let row = self.client.query_one(
            &format!(
                "SELECT coalesce(sum(balance), 0)::bigint FROM {}",
                self.accounts
            ),
            &[],
        )?;
        Ok(row.get(0))
    }
}

/// The set-based credit of a batch's new payments: `$1` accounts and `$2`
/// amounts (one element per payment), summed per account, one statement.
#[cfg(feature = "postgres")]
fn credit_all(accounts: &str) -> String {
    format!(
        "UPDATE {accounts} a SET balance = a.balance + d.amount \
         FROM (SELECT account, sum(amount)::bigint AS amount \
               FROM unnest($1::bigint[], $2::bigint[]) AS t(account, amount) \
               GROUP BY account) d \
         WHERE a.id = d.account"
    )
}

/// What [`PgOurs`]' handler runs for a new payment.
#[cfg(feature = "postgres")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PgHandler {
    /// `client.execute(sql, ..)` with the SQL text: the statement prepared
    /// and run, two round trips (what a handler written plainly does).
    Execute,
    /// `client.execute_typed(sql, ..)`: parse, bind and run in one round
    /// trip.
    Typed,
    /// No statement: the inbox's own cost alone. The account is not
    /// credited, so the exactly-once total is not checked.
    None,
    /// `PgInbox::handle_set`: one handler call for the batch's new
    /// payments, crediting them all in one statement, the hand-written
    /// side's (`execute_typed`: one round trip).
    Set,
}

/// Records the batch's new ids in the inbox table and returns them, in one
/// statement. Duplicates inside the batch are recorded once: the first row
/// wins, ON CONFLICT skips the rest.
#[cfg(feature = "postgres")]
fn claim_new(
    txn: &mut postgres::Transaction<'_>,
    inbox: &str,
    ids: &[String],
) -> BoxResult<std::collections::HashSet<String>> {
    Ok(txn
        .query(
            &format!(
                "INSERT INTO {inbox} (id) SELECT DISTINCT unnest($1::text[]) \
                 ON CONFLICT DO NOTHING RETURNING id"
            ),
            &[&ids],
        )?
        .into_iter()
        .map(|row| row.get(0))
        .collect())
}

/// idemstore's inbox on PostgreSQL: `PgInbox::handle_batch`, the batch's
/// claims in one statement, each new message's account update by its
/// handler, the DONE records in one statement, one commit.
#[cfg(feature = "postgres")]
pub struct PgOurs {
    inbox: idemstore::postgres::PgInbox,
    accounts: String,
    admin: postgres::Client,
    handler: PgHandler,
    /// Percent of the new payments (by id) whose handler fails its first
    /// run, after its write; see [`fail_percent`](PgOurs::fail_percent).
    fail_percent: u64,
    /// The ids that failed once.
    failed_once: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<u64>>>,
}

#[cfg(feature = "postgres")]
impl PgOurs {
    /// A fresh store table and account table (named after this process and
    /// `tag`) on the server at `url`.
    pub fn open(url: &str, tag: &str) -> BoxResult<PgOurs> {
        PgOurs::open_with(url, tag, PgHandler::Execute)
    }

    /// [`open`](PgOurs::open) with the handler's way of writing.
    pub fn open_with(url: &str, tag: &str, handler: PgHandler) -> BoxResult<PgOurs> {
        let mut admin = postgres::Client::connect(url, postgres::NoTls)?;
        let table = format!("bench_pginbox_{}_{tag}", std::process::id());
        let accounts = format!("bench_pgaccounts_{}_{tag}", std::process::id());
        admin.batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}; DROP TABLE IF EXISTS {accounts};
             CREATE TABLE {accounts} (id bigint PRIMARY KEY, balance bigint NOT NULL);
             INSERT INTO {accounts} SELECT g, 0 FROM generate_series(0, {}) g;",
            ACCOUNTS - 1
        ))?;
        let store = idemstore::PostgresStore::builder()
            .table(&table)
            .migrate_on_build(true)
            .connect(url)?;
        Ok(PgOurs {
            inbox: idemstore::postgres::PgInbox::new(store),
            accounts,
            admin,
            handler,
            fail_percent: 0,
            failed_once: Default::default(),
        })
    }

    /// Makes `percent` % of the payments (by id) fail in their handler's
    /// first run, after its write (a transient error): [`batch`](PgOurs::batch)
    /// then delivers the failed ones again at once, in a batch of their own,
    /// where they succeed. What a failing message costs its batch.
    pub fn fail_percent(mut self, percent: u64) -> PgOurs {
        self.fail_percent = percent;
        self
    }

    /// One batch through `handle_batch` (and the failed ones again, with
    /// [`fail_percent`](PgOurs::fail_percent)).
    pub fn batch(&self, payments: &[Payment]) -> BoxResult<Tally> {
        let mut tally = Tally {
            messages: payments.len() as u64,
            handled: 0,
        };
        let mut failed = Vec::new();
        for (p, a) in payments.iter().zip(self.deliver(payments)?) {
            match a {
                Ok(idemstore::postgres::Delivery::Handled(_)) => tally.handled += 1,
                Ok(_) => {}
                Err(_) if self.fail_percent > 0 => failed.push(*p),
                Err(e) => return Err(e.into()),
            }
        }
        if !failed.is_empty() {
            for a in self.deliver(&failed)? {
                if matches!(a?, idemstore::postgres::Delivery::Handled(_)) {
                    tally.handled += 1;
                }
            }
        }
        Ok(tally)
    }

    fn deliver(
        &self,
        payments: &[Payment],
    ) -> BoxResult<Vec<Result<idemstore::postgres::Delivery, idemstore::Error>>> {
        let sql = format!(
            "UPDATE {} SET balance = balance + $1 WHERE id = $2",
            self.accounts
        );
        let messages = payments
            .iter()
            .map(|p| {
                let m = p.message();
                (m.key, m.fingerprint, *p)
            })
            .collect();
        let (mode, fail_percent) = (self.handler, self.fail_percent);
        let failed_once = std::sync::Arc::clone(&self.failed_once);
        if mode == PgHandler::Set {
            return self.deliver_set(messages);
        }
        Ok(self
            .inbox
            .handle_batch(messages, move |client, _claim, p: &Payment| {
                let (sql, amount, account) = (sql.clone(), p.amount, p.account as i64);
                let fail = p.id % 100 < fail_percent
                    && failed_once
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(p.id);
                Box::pin(async move {
                    use idemstore::postgres::engine::types::Type;
                    match mode {
                        PgHandler::Execute => client.execute(&sql, &[&amount, &account]).await,
                        PgHandler::Typed => {
                            client
                                .execute_typed(
                                    &sql,
                                    &[(&amount, Type::INT8), (&account, Type::INT8)],
                                )
                                .await
                        }
                        PgHandler::None | PgHandler::Set => Ok(0),
                    }
                    .map_err(idemstore::Error::backend)?;
                    if fail {
                        return Err(idemstore::Error::backend("a transient failure"));
                    }
                    Ok::<_, idemstore::Error>(Response::new(200, "ok"))
                })
            })?)
    }

    /// [`deliver`](PgOurs::deliver) through `handle_set`: the new
    /// payments credited in one statement; a failing payment (see
    /// [`fail_percent`](PgOurs::fail_percent)) fails its whole set, which
    /// the inbox halves down to it.
    fn deliver_set(
        &self,
        messages: Vec<(idemstore::Key, idemstore::Fingerprint, Payment)>,
    ) -> BoxResult<Vec<Result<idemstore::postgres::Delivery, idemstore::Error>>> {
        use idemstore::postgres::Claimed;
        use idemstore::postgres::engine::types::Type;
        let sql = credit_all(&self.accounts);
        let fail_percent = self.fail_percent;
        let failed_once = std::sync::Arc::clone(&self.failed_once);
        Ok(self
            .inbox
            .handle_set(messages, move |client, set: &[Claimed<'_, Payment>]| {
                let accounts: Vec<i64> = set.iter().map(|m| m.payload.account as i64).collect();
                let amounts: Vec<i64> = set.iter().map(|m| m.payload.amount).collect();
                let fail = set.iter().any(|m| {
                    m.payload.id % 100 < fail_percent
                        && failed_once
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .insert(m.payload.id)
                });
                let (sql, n) = (sql.clone(), set.len());
                Box::pin(async move {
                    let params: [(
                        &(dyn idemstore::postgres::engine::types::ToSql + Sync),
                        Type,
                    ); 2] = [(&accounts, Type::INT8_ARRAY), (&amounts, Type::INT8_ARRAY)];
                    client
                        .execute_typed(&sql, &params)
                        .await
                        .map_err(idemstore::Error::backend)?;
                    if fail {
                        return Err(idemstore::Error::backend("a transient failure"));
                    }
                    Ok::<_, idemstore::Error>(vec![Response::new(200, "ok"); n])
                })
            })?)
    }

    /// The sum of all balances.
    pub fn total(&mut self) -> BoxResult<i64> {
        let row = self.admin.query_one(
            &format!(
                "SELECT coalesce(sum(balance), 0)::bigint FROM {}",
                self.accounts
            ),
            &[],
        )?;
        Ok(row.get(0))
    }
}

#[cfg(feature = "postgres")]
impl Drop for PgOurs {
    fn drop(&mut self) {
        let table = self.inbox.store().table().to_owned();
        let _ = self.admin.batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}; DROP TABLE IF EXISTS {};",
            self.accounts
        ));
    }
}

#[cfg(feature = "postgres")]
impl Drop for Pg {
    fn drop(&mut self) {
        let _ = self.client.batch_execute(&format!(
            "DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {};",
            self.inbox, self.accounts
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_feed_redelivers_about_its_share() {
        let mut feed = Feed::new(20, 7);
        let mut seen = std::collections::HashSet::new();
        let mut redelivered = 0;
        for p in (0..50).flat_map(|_| feed.batch(100)) {
            if !seen.insert(p.id) {
                redelivered += 1;
            }
        }
        assert!((800..1_200).contains(&redelivered), "{redelivered}");
        assert!(
            Feed::new(0, 7)
                .batch(100)
                .iter()
                .enumerate()
                .all(|(i, p)| p.id == i as u64)
        );
    }
}
