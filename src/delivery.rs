//! [`Delivery`]: what an inbox (redb's `Inbox`, PostgreSQL's `PgInbox`) did
//! with one delivery of a message, and the panic text both inboxes report
//! as [`Error::HandlerPanicked`](crate::Error::HandlerPanicked). Re-exported
//! as `idemstore::redb::Delivery` and `idemstore::postgres::Delivery`.

use crate::response::Response;
use crate::time::Timestamp;

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
