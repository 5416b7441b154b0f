//! [`Delivery`]: what an inbox (redb's `Inbox`, PostgreSQL's `PgInbox`) did
//! with one delivery of a message, and the panic text both inboxes report
//! as [`Error::HandlerPanicked`](crate::Error::HandlerPanicked). Re-exported
//! as `idemstore::redb::Delivery` and `idemstore::postgres::Delivery`.

use crate::error::{Error, Result};
use crate::response::Response;
use crate::time::Timestamp;

/// Most messages in one inbox batch (redb's `Inbox::handle_batch`,
/// PostgreSQL's `PgInbox::handle_batch`); a larger batch is
/// [`Error::InvalidArgument`] before any I/O. It bounds how long a batch
/// holds its locks and how many passes it may run.
///
/// ```
/// # #[cfg(feature = "redb")] {
/// use idemstore::redb::{Inbox, Message};
/// use idemstore::{Error, Fingerprint, Key, RedbStore, Response, limits::MAX_INBOX_BATCH};
/// # let dir = tempfile::tempdir().unwrap();
/// let inbox = Inbox::new(RedbStore::open(dir.path().join("inbox.idem")).unwrap());
/// let batch: Vec<Message<()>> = (0..=MAX_INBOX_BATCH)
///     .map(|i| Message::new(Key::new("q", i.to_string()).unwrap(), Fingerprint::of(b""), ()))
///     .collect();
/// let refused = inbox.handle_batch(&batch, |_, _, _| Ok::<_, Error>(Response::new(200, "")));
/// assert!(matches!(refused, Err(Error::InvalidArgument { .. })));
/// # }
/// ```
pub const MAX_INBOX_BATCH: usize = 4_096;

/// A batch of `len` messages is within [`MAX_INBOX_BATCH`].
pub(crate) fn check_batch_len(len: usize) -> Result<()> {
    if len > MAX_INBOX_BATCH {
        return Err(Error::invalid_argument(format!(
            "a batch of {len} messages is over the limit of {MAX_INBOX_BATCH}"
        )));
    }
    Ok(())
}

/// What an inbox did with one delivery of a message.
///
/// ```
/// # #[cfg(feature = "redb")]
/// # fn main() {
/// use idemstore::Response;
/// use idemstore::redb::Delivery;
/// assert_eq!(Delivery::Duplicate(Response::new(200, "ok")).response(), Some(&Response::new(200, "ok")));
/// # }
/// # #[cfg(not(feature = "redb"))]
/// # fn main() {}
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivery {
    /// First delivery: the handler ran and its writes committed together
    /// with the DONE record; this is the result it returned.
    Handled(Response),
    /// A redelivery: the handler did not run; this is the result stored by
    /// the delivery that was handled.
    Duplicate(Response),
    /// The message id was already used by a message with a different
    /// fingerprint: the handler did not run and nothing was written.
    Conflict,
    /// The id is claimed through the [`Store`](crate::Store) API by an owner
    /// whose lease is still live (not something the inbox itself leaves
    /// behind): the handler did not run; redeliver later.
    InFlight {
        /// When the owner's lease ends.
        lease_until: Timestamp,
    },
}

impl Delivery {
    /// The handler's result, fresh or stored; `None` for `Conflict` and `InFlight`.
    ///
    /// ```
    /// # #[cfg(feature = "redb")]
    /// # fn main() {
    /// use idemstore::Response;
    /// use idemstore::redb::Delivery;
    /// assert_eq!(Delivery::Duplicate(Response::new(200, "ok")).response(), Some(&Response::new(200, "ok")));
    /// assert_eq!(Delivery::Conflict.response(), None);
    /// # }
    /// # #[cfg(not(feature = "redb"))]
    /// # fn main() {}
    /// ```
    pub fn response(&self) -> Option<&Response> {
        match self {
            Delivery::Handled(r) | Delivery::Duplicate(r) => Some(r),
            Delivery::Conflict | Delivery::InFlight { .. } => None,
        }
    }
}

/// The text of a panic's payload (what `panic!` was given, when it was text).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic whose payload is not text".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::panic_message;

    #[test]
    fn panic_payloads_are_read_as_text() {
        assert_eq!(panic_message(&"boom"), "boom");
        assert_eq!(panic_message(&String::from("bang")), "bang");
        assert_eq!(panic_message(&7u8), "a panic whose payload is not text");
    }
}
