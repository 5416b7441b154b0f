//! [`PostgresStore`]: the same [`Store`] contract over a PostgreSQL table,
//! for services that run several replicas (feature `postgres`). The
//! statements, the schema and the clock are described on [`PostgresStore`].

mod errors;
mod group;
mod inbox;
mod inbox_set;
mod inbox_sql;
mod lane;
mod line;
mod ops;
mod options;
mod pool;
mod row;
mod runtime;
mod schema;
mod sql;
mod stats;
mod step;
mod tls;

pub use inbox::{Delivery, HandlerFuture, PgInbox};
pub use inbox_set::{Claimed, SetHandlerFuture};
pub use options::{DEFAULT_TABLE, MAX_POOL_SIZE, MAX_TABLE_NAME_BYTES, PostgresStoreBuilder};
pub use stats::PostgresStats;
pub use step::StepFuture;
/// The PostgreSQL client a [`PgInbox`] handler writes through
/// (`tokio-postgres`), re-exported so that its version is the store's.
pub use tokio_postgres as engine;

use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::{Begin, Claim, Record};
use crate::response::Response;
use crate::step::Step;
use crate::store::{Store, StoreFuture};
use crate::time::{Clock, Timestamp};
use lane::Ran;
use ops::Core;
use runtime::StoreRuntime;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Most times one `begin` runs its statement when concurrent writers keep
/// committing between its snapshot and its conflict check (each retry
/// takes a new snapshot, so a second attempt almost always settles it).
const MAX_BEGIN_ATTEMPTS: usize = 8;

/// An idempotency store in a PostgreSQL table, shared by every replica of a
/// service: the same [`Store`] contract as the embedded stores, over a pool
/// of connections (feature `postgres`).
///
/// ```no_run
/// use idemstore::{Begin, Fingerprint, Key, PostgresStore, Response, Store, Timestamp};
/// use std::time::Duration;
///
/// let store = PostgresStore::builder()
///     .migrate_on_build(true) // or store.migrate() once per deploy
///     .connect("postgres://app@db.internal/orders")?;
/// let key = Key::new("tenant-42", "order-1")?;
/// let fp = Fingerprint::of(b"sku=A&qty=1");
/// let now = Timestamp::from_system_time(std::time::SystemTime::now());
/// let (lease, retention) = (Duration::from_secs(30), Duration::from_secs(24 * 3600));
/// if let Begin::Claimed(claim) = store.begin(&key, &fp, now, lease, retention)? {
///     store.complete(&key, &claim, &Response::new(201, "charged"), now, retention)?;
/// }
/// # Ok::<(), idemstore::Error>(())
/// ```
///
/// # Sync and async callers, any context
///
/// The statements are written once, as async code on `tokio-postgres`, and
/// run on a current-thread tokio runtime the store owns (a thread named
/// `idemstore-postgres`, holding every connection). The blocking [`Store`]
/// methods spawn their work there and wait on a channel; the `_async`
/// methods ([`Store::begin_async`] and the rest, [`get_async`](Self::get_async)) spawn it and
/// return a future any executor can await. So a store can be built, used
/// and dropped inside a tokio runtime (either flavour), on a
/// `spawn_blocking` thread or with no runtime at all. A blocking call on a
/// tokio worker holds that worker for its round trip, as any blocking call
/// does: async code should use the `_async` methods.
///
/// One exception saves the two thread hand-offs a call otherwise costs: a
/// blocking `begin` or `complete` made while no group is queued or
/// running, from a thread outside any tokio runtime, runs its statement on
/// a connection that the calling thread drives (the way the blocking
/// `postgres` client works), with the same answers. The store keeps up to
/// 8 such connections (one per four of `max_size`, never the
/// pool's last one), so a few threads calling at once each drive their
/// own; [`PostgresStats::caller_driven_calls`] counts these calls. There a
/// `begin` first tries a plain `INSERT` of a fresh key (under the same
/// lock, with the same answer) and runs the full statement below only
/// when that writes nothing; once a begin finds its key taken, the full
/// statement goes first until one claims a fresh key again.
///
/// The builder checks the schema at build, bounds the build, sizes a lazy
/// pool and opens a circuit breaker while the server is unreachable: see
/// [`PostgresStoreBuilder`]. [`stats`](Self::stats) shows all of it.
///
/// # One statement per call, one transaction per group of calls
///
/// A lone call is one prepared statement in its own transaction: one round
/// trip, one commit. `begin` is an `INSERT .. ON CONFLICT (scope, id) DO
/// UPDATE .. WHERE <expired, or same fingerprint with the lease run out>
/// RETURNING ..` with a read of the existing row in the same statement, so
/// Claimed, Replay, InFlight and Conflict all come back in that round trip;
/// the write decides on the newest row under its lock, never on an earlier
/// read. When the statement's snapshot already shows a live record that
/// cannot be claimed, the statement writes nothing (no row lock, no WAL
/// flush): a replay is a read. When a concurrent writer
/// commits between the statement's snapshot and its conflict check, the
/// statement sees no row (or an older one); it is then run again, at most
/// 8 times. Fencing tokens come from a sequence, drawn
/// under a transaction-scoped advisory lock on the key, so the claims of a
/// key get increasing tokens in the order they commit. `complete` and `release`
/// are conditional on the token. `sweep_expired` deletes one bounded batch,
/// oldest expiry first, skipping rows another sweeper holds.
///
/// **Group commit.** `begin`s and `complete`s that arrive while the store
/// is busy are gathered (up to 128 calls, at most 2 groups at once, one
/// more while 16 calls wait) and sent as one transaction:
/// the completes as one set-based `UPDATE`, the begins as one set-based
/// form of the statement above, and one `COMMIT`, written in one message.
/// Every call gets the answer it would get alone; a group that fails runs
/// each of its calls again alone. [`PostgresStats::group_commits`] and
/// [`PostgresStats::grouped_calls`] count them.
///
/// After a server restart or failover, a call that meets a connection the
/// server ended runs again on another one; a repeated `complete` or
/// `release` that finds its own lost first run done reports success.
///
/// **Durability** is the server's: `Claimed` is returned after the commit,
/// which with the default `synchronous_commit = on` means the WAL is flushed
/// (and, with synchronous replication, on the standbys the server waits for).
///
/// # Time: the caller's clock, and skew between replicas
///
/// Deadlines are computed from the `now` each call passes in, not from the
/// database clock. That keeps the [`Store`] contract (every backend takes
/// `now`; tests run on a manual clock and are deterministic), and it means
/// each replica judges leases and expiry by its own clock. Skew between
/// replicas therefore matters: a replica whose clock runs ahead by `s` sees
/// other replicas' leases end `s` early — it may take over a claim whose
/// owner is still inside its lease — and sees records expire `s` early.
/// Fencing tokens still stop the stale owner from completing, but its side
/// effect may already have run. Keep the clocks synchronised (NTP, chrony)
/// and the skew well under the lease (a lease of tens of seconds against
/// millisecond NTP skew is comfortable).
///
/// # The schema
///
/// One table (default [`DEFAULT_TABLE`]) keyed by (scope, id), with the
/// fingerprint, state, lease deadline, expiry, fencing token, attempt count,
/// the response (status, header names and values as `bytea[]`, body as
/// `bytea`) and the [steps](Store::record_step) (names and outputs, two
/// `bytea[]`) in plain columns; a sequence for tokens; an index on the
/// expiry. A record released with its steps kept stays PROCESSING with
/// `lease_until` 0. [`PostgresStore::migrate`] creates them and is idempotent; the
/// schema version is kept in the table's comment, and a table of the same
/// name that is not ours, or is newer, is refused with a typed error.
///
/// # TLS
///
/// The URL's `sslmode`, `sslrootcert`, `sslcert` and `sslkey` have libpq's
/// meanings (TLS through rustls): `prefer` by default (TLS when the server
/// offers it, its certificate unchecked), `require`, `verify-ca` and
/// `verify-full` (against `sslrootcert`, or the platform's roots without
/// one), or `disable`. A managed database asks for `verify-full`:
///
/// ```no_run
/// let store = idemstore::PostgresStore::builder().connect(
///     "postgres://app@db.example.com/orders?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem",
/// )?;
/// # Ok::<(), idemstore::Error>(())
/// ```
pub struct PostgresStore {
    core: Arc<Core>,
    runtime: StoreRuntime,
    /// The calling threads' lanes for blocking calls on an idle line.
    lanes: lane::Lanes,
    /// Never read by the store: handed out by [`Store::clock`].
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (connections, idle) = self.core.pool.state();
        f.debug_struct("PostgresStore")
            .field("table", &self.core.sql.table)
            .field("connections", &connections)
            .field("idle_connections", &idle)
            .field("breaker_open", &self.core.pool.breaker_is_open())
            .field("max_body_bytes", &self.core.max_body_bytes)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Options for a store; [`PostgresStoreBuilder::connect`] takes the
    /// server's URL (`postgres://user[:password]@host[:port]/database[?options]`,
    /// or the `key=value` form libpq accepts).
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::builder()
    ///     .max_size(32)
    ///     .migrate_on_build(true)
    ///     .connect("postgres://app@db.internal/orders")?;
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn builder() -> PostgresStoreBuilder {
        PostgresStoreBuilder::new()
    }

    /// A store with the default options on the server at `url`, whose
    /// table must already exist (see [`PostgresStoreBuilder::connect`] for
    /// the errors, and [`PostgresStoreBuilder::migrate_on_build`]).
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::connect("postgres://app@db.internal/orders")?;
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn connect(url: &str) -> Result<PostgresStore> {
        PostgresStoreBuilder::new().connect(url)
    }

    /// Creates the table, its token sequence and its expiry index unless
    /// they exist. Idempotent, and safe to run from several replicas at once
    /// (they serialise on an advisory lock); run it once at deploy, with a
    /// role allowed to create tables, or build with
    /// [`migrate_on_build(true)`](PostgresStoreBuilder::migrate_on_build).
    ///
    /// Errors: [`Error::Corrupt`](crate::Error::Corrupt) when a table of
    /// that name exists but is not an idemstore table (nothing is changed);
    /// [`Error::UnsupportedFormat`](crate::Error::UnsupportedFormat) when
    /// another schema version created it;
    /// [`Error::Backend`](crate::Error::Backend) for server errors.
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::builder()
    ///     .migrate_on_build(true)
    ///     .connect("postgres://app@db.internal/orders")?;
    /// store.migrate()?; // a second run changes nothing
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn migrate(&self) -> Result<()> {
        let core = Arc::clone(&self.core);
        self.runtime.block_on(async move { core.migrate().await })
    }

    /// [`migrate`](Self::migrate) as a future that blocks no thread.
    ///
    /// ```no_run
    /// # async fn f(store: idemstore::PostgresStore) -> Result<(), idemstore::Error> {
    /// store.migrate_async().await?;
    /// # Ok(()) }
    /// ```
    pub fn migrate_async(&self) -> impl Future<Output = Result<()>> + Send + 'static {
        let core = Arc::clone(&self.core);
        self.runtime
            .spawn(async move { core.migrate().await }, None)
    }

    /// The table this store uses.
    ///
    /// ```no_run
    /// let store = idemstore::PostgresStore::connect("postgres://app@db.internal/orders")?;
    /// assert_eq!(store.table(), idemstore::postgres::DEFAULT_TABLE);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn table(&self) -> &str {
        &self.core.sql.table
    }

    /// What the store has done, and the state of its pool and circuit
    /// breaker now; reading it costs a few atomic loads (no I/O).
    ///
    /// ```no_run
    /// use idemstore::{Fingerprint, Key, PostgresStore, Store, Timestamp};
    ///
    /// let store = PostgresStore::connect("postgres://app@db.internal/orders")?;
    /// let before = store.stats();
    /// let _ = store.get(&Key::new("", "k")?, Timestamp::EPOCH)?;
    /// assert_eq!(store.stats().calls, before.calls + 1);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn stats(&self) -> PostgresStats {
        let mut stats = self.core.counters.snapshot();
        (stats.connections, stats.idle_connections) = self.core.pool.state();
        stats.breaker_open = self.core.pool.breaker_is_open();
        stats
    }

    // The work of `begin_async`, `complete_async` and `release_async`
    // (the `Store` trait's), spawned on the store's runtime when called:
    // the futures borrow nothing, and any executor can await them.

    fn spawn_begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> impl Future<Output = Result<Begin>> + Send + 'static {
        let work = self.begin_work(key, fingerprint, now, lease, retention);
        self.runtime.spawn(work, Some(self.give_back(key)))
    }

    /// Gives a claim nobody will see back at once, on the store's runtime:
    /// a `begin` whose caller dropped its future, or that answered after
    /// the call timeout.
    fn give_back(&self, key: &Key) -> runtime::Abandoned<Begin> {
        let (core, key) = (Arc::clone(&self.core), key.clone());
        let handle = self.runtime.handle();
        Arc::new(move |answer| {
            if let Ok(Begin::Claimed(claim)) = answer {
                let (core, key) = (Arc::clone(&core), key.clone());
                handle.spawn(async move {
                    let _ = core.release(&key, &claim).await;
                });
            }
        })
    }

    fn spawn_complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> impl Future<Output = Result<()>> + Send + 'static {
        let work = self.complete_work(key, claim, response, now, retention);
        self.runtime.spawn(work, None)
    }

    fn spawn_release(
        &self,
        key: &Key,
        claim: &Claim,
    ) -> impl Future<Output = Result<()>> + Send + 'static {
        self.runtime.spawn(self.release_work(key, claim), None)
    }

    /// [`Store::get`] as a future that blocks no thread.
    ///
    /// ```no_run
    /// # async fn f(store: idemstore::PostgresStore, key: idemstore::Key) -> Result<(), idemstore::Error> {
    /// let now = idemstore::Timestamp::from_system_time(std::time::SystemTime::now());
    /// let record = store.get_async(&key, now).await?;
    /// # Ok(()) }
    /// ```
    pub fn get_async(
        &self,
        key: &Key,
        now: Timestamp,
    ) -> impl Future<Output = Result<Option<Record>>> + Send + 'static {
        self.runtime.spawn(self.get_work(key, now), None)
    }

    /// [`Store::sweep_expired`] as a future that blocks no thread.
    ///
    /// ```no_run
    /// # async fn f(store: idemstore::PostgresStore) -> Result<(), idemstore::Error> {
    /// let now = idemstore::Timestamp::from_system_time(std::time::SystemTime::now());
    /// while store.sweep_expired_async(now, 1_000).await? == 1_000 {}
    /// # Ok(()) }
    /// ```
    pub fn sweep_expired_async(
        &self,
        now: Timestamp,
        max: usize,
    ) -> impl Future<Output = Result<usize>> + Send + 'static {
        self.runtime.spawn(self.sweep_work(now, max), None)
    }

    // The work of each call, owning what it needs (it runs on the store's
    // runtime, maybe after its caller is gone): the one place each
    // operation is wired to the core, for the blocking and async entries.

    fn begin_work(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> impl Future<Output = Result<Begin>> + Send + 'static {
        let core = Arc::clone(&self.core);
        let (key, fingerprint) = (key.clone(), *fingerprint);
        async move { core.begin(key, fingerprint, now, lease, retention).await }
    }

    fn complete_work(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> impl Future<Output = Result<()>> + Send + 'static {
        let core = Arc::clone(&self.core);
        let (key, claim, response) = (key.clone(), claim.clone(), response.clone());
        async move { core.complete(key, claim, response, now, retention).await }
    }

    fn release_work(
        &self,
        key: &Key,
        claim: &Claim,
    ) -> impl Future<Output = Result<()>> + Send + 'static {
        let core = Arc::clone(&self.core);
        let (key, claim) = (key.clone(), claim.clone());
        async move { core.release(&key, &claim).await }
    }

    fn renew_work(
        &self,
        key: &Key,
        claim: &Claim,
        now: Timestamp,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim>> + Send + 'static {
        let core = Arc::clone(&self.core);
        let (key, claim) = (key.clone(), claim.clone());
        async move { core.renew(&key, &claim, now, lease).await }
    }

    fn record_step_work(
        &self,
        key: &Key,
        claim: &Claim,
        step: &Step,
        now: Timestamp,
    ) -> impl Future<Output = Result<()>> + Send + 'static {
        let core = Arc::clone(&self.core);
        let (key, claim, step) = (key.clone(), claim.clone(), step.clone());
        async move { core.record_step(&key, &claim, &step, now).await }
    }

    fn get_work(
        &self,
        key: &Key,
        now: Timestamp,
    ) -> impl Future<Output = Result<Option<Record>>> + Send + 'static {
        let core = Arc::clone(&self.core);
        let key = key.clone();
        async move { core.get(&key, now).await }
    }

    fn sweep_work(
        &self,
        now: Timestamp,
        max: usize,
    ) -> impl Future<Output = Result<usize>> + Send + 'static {
        let core = Arc::clone(&self.core);
        async move { core.sweep_expired(now, max).await }
    }
}

/// The blocking API: each call runs the same async operation on the
/// store's runtime and waits for it on a channel. Safe on any thread; on a
/// tokio worker it holds that worker for the round trip, as any blocking
/// call does — async code should use the `_async` methods (or a guard's
/// `run_async`).
impl Store for PostgresStore {
    /// Always `Some`: the statement starts on the store's own runtime when
    /// this is called, and the future, which any executor can await, is
    /// woken with the answer (no blocking thread). Dropped before it
    /// answers, it gives back any claim it made.
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), idemstore::Error> {
    /// use idemstore::{Begin, Fingerprint, Key, PostgresStore, Store, Timestamp};
    /// use std::time::Duration;
    ///
    /// let store = PostgresStore::builder()
    ///     .migrate_on_build(true)
    ///     .connect("postgres://app@db.internal/orders")?;
    /// let (key, fp, d) = (Key::new("t", "k")?, Fingerprint::of(b"x"), Duration::from_secs(30));
    /// let now = Timestamp::from_system_time(std::time::SystemTime::now());
    /// let native = "PostgresStore answers natively";
    /// if let Begin::Claimed(claim) = store.begin_async(&key, &fp, now, d, d).expect(native).await? {
    ///     store.release_async(&key, &claim).expect(native).await?;
    /// }
    /// # Ok(()) }
    /// ```
    fn begin_async<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Option<StoreFuture<'a, Begin>> {
        Some(Box::pin(self.spawn_begin(
            key,
            fingerprint,
            now,
            lease,
            retention,
        )))
    }

    /// Always `Some`, started when called (see `begin_async`). Dropped
    /// before it answers, the completion still runs to its end: the
    /// response is stored whole or not at all; [`Store::get`] tells which.
    fn complete_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        response: &'a Response,
        now: Timestamp,
        retention: Duration,
    ) -> Option<StoreFuture<'a, ()>> {
        Some(Box::pin(
            self.spawn_complete(key, claim, response, now, retention),
        ))
    }

    /// Always `Some`, started when called (see `begin_async`); dropped, it
    /// still runs.
    fn release_async<'a>(&'a self, key: &'a Key, claim: &'a Claim) -> Option<StoreFuture<'a, ()>> {
        Some(Box::pin(self.spawn_release(key, claim)))
    }

    fn begin(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        now: Timestamp,
        lease: Duration,
        retention: Duration,
    ) -> Result<Begin> {
        let (core, store) = (&*self.core, &self.runtime.handle());
        match (self.lanes).begin(core, store, key, fingerprint, now, lease, retention) {
            Ran::Answered(answer) => answer,
            Ran::NotTaken => self.runtime.call(
                self.begin_work(key, fingerprint, now, lease, retention),
                Some(self.give_back(key)),
            ),
            Ran::Broken => {
                let core = Arc::clone(&self.core);
                let (key, fingerprint) = (key.clone(), *fingerprint);
                let give_back = self.give_back(&key);
                self.runtime.call(
                    async move {
                        core.begin_alone(&key, &fingerprint, now, lease, retention, true)
                            .await
                    },
                    Some(give_back),
                )
            }
        }
    }

    fn complete(
        &self,
        key: &Key,
        claim: &Claim,
        response: &Response,
        now: Timestamp,
        retention: Duration,
    ) -> Result<()> {
        let (core, store) = (&*self.core, &self.runtime.handle());
        match (self.lanes).complete(core, store, key, claim, response, now, retention) {
            Ran::Answered(answer) => answer,
            Ran::NotTaken => self.runtime.call(
                self.complete_work(key, claim, response, now, retention),
                None,
            ),
            Ran::Broken => {
                let core = Arc::clone(&self.core);
                let (key, claim, response) = (key.clone(), claim.clone(), response.clone());
                let Some(token) = row::token(claim.token) else {
                    return Err(crate::Error::StaleClaim); // the lane ran it: unreachable
                };
                let times = row::times(now, retention);
                self.runtime.call(
                    async move {
                        core.complete_alone(&key, &claim, token, &response, times, true)
                            .await
                    },
                    None,
                )
            }
        }
    }

    fn release(&self, key: &Key, claim: &Claim) -> Result<()> {
        self.runtime.call(self.release_work(key, claim), None)
    }

    fn renew(&self, key: &Key, claim: &Claim, now: Timestamp, lease: Duration) -> Result<Claim> {
        self.runtime
            .call(self.renew_work(key, claim, now, lease), None)
    }

    /// The row read, [`logic::record_step`](crate::logic::record_step)'s
    /// decision on it, and a conditional append that holds only while the
    /// row is still the claim's with the steps read (else read and decided
    /// again): two round trips, one commit; a step already recorded writes
    /// nothing and is acknowledged once the row read is durable.
    fn record_step(&self, key: &Key, claim: &Claim, step: &Step, now: Timestamp) -> Result<()> {
        self.runtime
            .call(self.record_step_work(key, claim, step, now), None)
    }

    /// Always `Some`, started when called (see `begin_async`); dropped, it
    /// still runs: the step is recorded whole or not at all.
    fn record_step_async<'a>(
        &'a self,
        key: &'a Key,
        claim: &'a Claim,
        step: &'a Step,
        now: Timestamp,
    ) -> Option<StoreFuture<'a, ()>> {
        Some(Box::pin(
            self.runtime
                .spawn(self.record_step_work(key, claim, step, now), None),
        ))
    }

    fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>> {
        self.runtime.call(self.get_work(key, now), None)
    }

    fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<usize> {
        self.runtime.call(self.sweep_work(now, max), None)
    }

    fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.clock)
    }
}
