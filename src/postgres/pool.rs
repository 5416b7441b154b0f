//! The connection pool: r2d2 over the synchronous `postgres` client, with
//! the store's statements prepared once per connection.

use super::sql::{Sql, Stmt};
use ::postgres::types::ToSql;
use ::postgres::{Client, Config, NoTls, Row, Statement};
use std::sync::Arc;

pub(super) type Pool = r2d2::Pool<Manager>;

/// Opens connections for the pool. (A small hand-written manager rather than
/// the `r2d2_postgres` crate: it also owns the per-connection statement
/// cache, which is what makes each call one round trip.)
#[derive(Debug)]
pub(super) struct Manager {
    config: Config,
    sql: Arc<Sql>,
}

impl Manager {
    pub(super) fn new(config: Config, sql: Arc<Sql>) -> Manager {
        Manager { config, sql }
    }
}

/// A connection and its prepared statements. Statements are prepared on
/// first use, not at connect: before `migrate()` the table does not exist
/// and preparing would fail.
pub(super) struct Conn {
    pub(super) client: Client,
    sql: Arc<Sql>,
    prepared: [Option<Statement>; Stmt::COUNT],
}

impl Conn {
    /// Prepares `stmt` on this connection if it is not yet (one extra round
    /// trip, once per connection), then runs it.
    pub(super) fn query(
        &mut self,
        stmt: Stmt,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, ::postgres::Error> {
        let prepared = self.prepared(stmt)?;
        self.client.query(&prepared, params)
    }

    /// Like [`query`](Conn::query), returning the number of rows affected.
    pub(super) fn execute(
        &mut self,
        stmt: Stmt,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, ::postgres::Error> {
        let prepared = self.prepared(stmt)?;
        self.client.execute(&prepared, params)
    }

    fn prepared(&mut self, stmt: Stmt) -> Result<Statement, ::postgres::Error> {
        if let Some(Some(prepared)) = self.prepared.get(stmt as usize) {
            return Ok(prepared.clone());
        }
        let prepared = self.client.prepare(self.sql.text(stmt))?;
        if let Some(slot) = self.prepared.get_mut(stmt as usize) {
            *slot = Some(prepared.clone());
        }
        Ok(prepared)
    }
}

impl r2d2::ManageConnection for Manager {
    type Connection = Conn;
    type Error = ::postgres::Error;

    fn connect(&self) -> Result<Conn, ::postgres::Error> {
        Ok(Conn {
            client: self.config.connect(NoTls)?,
            sql: Arc::clone(&self.sql),
            prepared: Default::default(),
        })
    }

    fn is_valid(&self, conn: &mut Conn) -> Result<(), ::postgres::Error> {
        conn.client.simple_query("").map(|_| ())
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.client.is_closed()
    }
}
