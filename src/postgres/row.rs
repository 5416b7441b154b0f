//! Rows to records and back: the column encoding.
//!
//! The record lives in plain columns rather than in the codec's envelope:
//! the statements compare the fingerprint, state, deadlines and token inside
//! the server, and an operator can read the table with SQL. PostgreSQL
//! checksums its own pages (when the cluster has data checksums on), so
//! there is no crc32 here; every row read is checked against
//! `Record::check` (the table has no CHECK constraints since schema
//! version 2: see `schema.rs`). Steps are two `bytea[]` columns, names and
//! outputs (see `schema.rs` for why).
//!
//! Times are `bigint` milliseconds since the Unix epoch. A deadline past
//! `i64::MAX` ms (some 292 million years) is stored as `i64::MAX`.

use super::sql::{STATE_DONE, STATE_PROCESSING};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::record::{Record, State};
use crate::response::Response;
use crate::step::Step;
use crate::time::Timestamp;
use std::time::Duration;
use tokio_postgres::Row;

/// A timestamp as stored (saturating at `i64::MAX`).
pub(super) fn millis(t: Timestamp) -> i64 {
    i64::try_from(t.as_millis()).unwrap_or(i64::MAX)
}

/// A `complete`'s instants as stored: `now`, and the DONE record's expiry
/// `now + retention`.
pub(super) fn times(now: Timestamp, retention: Duration) -> (i64, i64) {
    (millis(now), millis(now + retention))
}

/// A token as stored; tokens come from a `bigint` sequence starting at 1,
/// so a token above `i64::MAX` was never handed out by this store.
pub(super) fn token(t: u64) -> Option<i64> {
    i64::try_from(t).ok()
}

/// A response as its columns.
pub(super) struct ResponseColumns<'a> {
    pub(super) status: i32,
    pub(super) names: Vec<&'a [u8]>,
    pub(super) values: Vec<&'a [u8]>,
    pub(super) body: &'a [u8],
}

pub(super) fn response_columns(r: &Response) -> ResponseColumns<'_> {
    ResponseColumns {
        status: i32::from(r.status),
        names: r.headers.iter().map(|(n, _)| n.as_bytes()).collect(),
        values: r.headers.iter().map(|(_, v)| v.as_slice()).collect(),
        body: &r.body,
    }
}

/// Decodes the record columns starting at column `first`, and checks the
/// record's invariants. A row that does not decode is [`Error::Corrupt`].
pub(super) fn record(key: &Key, row: &Row, first: usize) -> Result<Record> {
    let corrupt = |detail: String| Error::corrupt(Some(key.to_string()), detail);
    let col = |i: usize| first + i;
    let get_err = |e: tokio_postgres::Error| corrupt(format!("row does not decode: {e}"));
    let fingerprint: Vec<u8> = row.try_get(col(0)).map_err(get_err)?;
    let fingerprint: [u8; 32] = fingerprint
        .try_into()
        .map_err(|f: Vec<u8>| corrupt(format!("fingerprint is {} bytes, not 32", f.len())))?;
    let state = match row.try_get::<_, i16>(col(1)).map_err(get_err)? {
        STATE_PROCESSING => State::Processing,
        STATE_DONE => State::Done,
        other => return Err(corrupt(format!("unknown state {other}"))),
    };
    let time = |v: i64, what: &str| {
        u64::try_from(v)
            .map(Timestamp::from_millis)
            .map_err(|_| corrupt(format!("{what} {v} is negative")))
    };
    let lease_until = match row.try_get::<_, Option<i64>>(col(2)).map_err(get_err)? {
        Some(v) => Some(time(v, "lease deadline")?),
        None => None,
    };
    let expires_at = time(row.try_get(col(3)).map_err(get_err)?, "expiry")?;
    let created_at = time(row.try_get(col(4)).map_err(get_err)?, "creation time")?;
    let token: i64 = row.try_get(col(5)).map_err(get_err)?;
    let token = u64::try_from(token).map_err(|_| corrupt(format!("token {token} is negative")))?;
    let attempts: i64 = row.try_get(col(6)).map_err(get_err)?;
    let attempts = u32::try_from(attempts)
        .map_err(|_| corrupt(format!("attempt count {attempts} is out of range")))?;
    let response = response(
        row.try_get(col(7)).map_err(get_err)?,
        row.try_get(col(8)).map_err(get_err)?,
        row.try_get(col(9)).map_err(get_err)?,
        row.try_get(col(10)).map_err(get_err)?,
    )
    .map_err(corrupt)?;
    let steps = steps(
        row.try_get(col(11)).map_err(get_err)?,
        row.try_get(col(12)).map_err(get_err)?,
    )
    .map_err(corrupt)?;
    let record = Record {
        fingerprint: Fingerprint::from_bytes(fingerprint),
        state,
        response,
        lease_until,
        expires_at,
        created_at,
        token,
        attempts,
        steps,
    };
    record.check().map_err(|why| corrupt(why.to_owned()))?;
    Ok(record)
}

/// The step columns as steps: as many names as outputs, each name UTF-8.
/// The limits, unique names and "no steps when DONE" are `Record::check`'s.
fn steps(names: Vec<Vec<u8>>, outputs: Vec<Vec<u8>>) -> std::result::Result<Vec<Step>, String> {
    if names.len() != outputs.len() {
        return Err(format!(
            "{} step names but {} outputs",
            names.len(),
            outputs.len()
        ));
    }
    names
        .into_iter()
        .zip(outputs)
        .map(|(name, output)| {
            String::from_utf8(name)
                .map(|name| Step { name, output })
                .map_err(|_| "a step name is not UTF-8".to_owned())
        })
        .collect()
}

fn response(
    status: Option<i32>,
    names: Option<Vec<Vec<u8>>>,
    values: Option<Vec<Vec<u8>>>,
    body: Option<Vec<u8>>,
) -> std::result::Result<Option<Response>, String> {
    let (Some(status), Some(names), Some(values), Some(body)) = (status, names, values, body)
    else {
        return Ok(None);
    };
    let status = u16::try_from(status).map_err(|_| format!("status {status} is out of range"))?;
    if names.len() != values.len() {
        return Err(format!(
            "{} header names but {} values",
            names.len(),
            values.len()
        ));
    }
    let headers = names
        .into_iter()
        .zip(values)
        .map(|(name, value)| {
            String::from_utf8(name)
                .map(|name| (name, value))
                .map_err(|_| "a header name is not UTF-8".to_owned())
        })
        .collect::<std::result::Result<_, _>>()?;
    Ok(Some(Response {
        status,
        headers,
        body,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_saturate_at_the_column_range() {
        assert_eq!(millis(Timestamp::from_millis(5)), 5);
        assert_eq!(millis(Timestamp::MAX), i64::MAX);
        assert_eq!(token(u64::MAX), None);
        assert_eq!(token(7), Some(7));
    }

    #[test]
    fn response_columns_round_trip() {
        let r = Response::new(201, "paid").with_header("x-a", "1");
        let c = response_columns(&r);
        let back = response(
            Some(c.status),
            Some(c.names.iter().map(|n| n.to_vec()).collect()),
            Some(c.values.iter().map(|v| v.to_vec()).collect()),
            Some(c.body.to_vec()),
        );
        assert_eq!(back, Ok(Some(r)));
        assert!(response(Some(70_000), Some(vec![]), Some(vec![]), Some(vec![])).is_err());
        assert!(
            response(
                Some(200),
                Some(vec![vec![b'a']]),
                Some(vec![]),
                Some(vec![])
            )
            .is_err()
        );
        assert!(
            response(
                Some(200),
                Some(vec![vec![0xff]]),
                Some(vec![vec![]]),
                Some(vec![])
            )
            .is_err()
        );
        assert_eq!(response(None, None, None, None), Ok(None));
    }

    #[test]
    fn step_columns_decode_and_malformed_ones_are_refused() {
        let s = Step::new("charge", b"ch_1".to_vec()).unwrap();
        assert_eq!(
            steps(vec![b"charge".to_vec()], vec![b"ch_1".to_vec()]),
            Ok(vec![s])
        );
        assert_eq!(steps(vec![], vec![]), Ok(vec![]));
        assert!(steps(vec![b"a".to_vec()], vec![]).is_err());
        assert!(steps(vec![vec![0xff]], vec![vec![]]).is_err());
    }
}
