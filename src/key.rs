//! [`Key`]: (scope, id).

use crate::error::{Error, Result};
use std::fmt;

/// Longest id, in bytes.
pub const MAX_ID_BYTES: usize = 255;
/// Longest scope, in bytes.
pub const MAX_SCOPE_BYTES: usize = 255;

/// An idempotency key: a scope (tenant, account, consumer group) and an id
/// (the client's `Idempotency-Key`, a message id).
///
/// The same id under two scopes is two keys, so two tenants can never see
/// each other's responses. The id is 1..=[`MAX_ID_BYTES`] bytes and the scope
/// 0..=[`MAX_SCOPE_BYTES`] bytes of any value; anything else is
/// [`Error::InvalidKey`], raised here, before any I/O.
///
/// ```
/// use idemstore::{Error, Key};
///
/// let a = Key::new("tenant-42", "order-1")?;
/// let b = Key::new("tenant-7", "order-1")?;
/// assert_ne!(a, b);
/// assert_eq!(a.scope(), b"tenant-42");
/// assert_eq!(a.id(), b"order-1");
///
/// assert!(matches!(Key::new("t", ""), Err(Error::InvalidKey { .. })));
/// assert!(matches!(Key::new("t", [b'x'; 256]), Err(Error::InvalidKey { .. })));
/// # Ok::<(), idemstore::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    scope: Box<[u8]>,
    id: Box<[u8]>,
}

impl Key {
    /// A key in `scope` (may be empty) with `id` (must not be).
    pub fn new(scope: impl AsRef<[u8]>, id: impl AsRef<[u8]>) -> Result<Key> {
        let (scope, id) = (scope.as_ref(), id.as_ref());
        if id.is_empty() {
            return Err(invalid(format!(
                "the id is empty (1..={MAX_ID_BYTES} bytes required)"
            )));
        }
        if id.len() > MAX_ID_BYTES {
            return Err(invalid(format!(
                "the id is {} bytes (1..={MAX_ID_BYTES} bytes allowed)",
                id.len()
            )));
        }
        if scope.len() > MAX_SCOPE_BYTES {
            return Err(invalid(format!(
                "the scope is {} bytes (0..={MAX_SCOPE_BYTES} bytes allowed)",
                scope.len()
            )));
        }
        Ok(Key {
            scope: scope.into(),
            id: id.into(),
        })
    }

    /// A key with the empty scope.
    ///
    /// ```
    /// let k = idemstore::Key::unscoped("msg-17")?;
    /// assert!(k.scope().is_empty());
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn unscoped(id: impl AsRef<[u8]>) -> Result<Key> {
        Key::new([], id)
    }

    /// The scope bytes.
    ///
    /// ```
    /// assert_eq!(idemstore::Key::new("s", "i")?.scope(), b"s");
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn scope(&self) -> &[u8] {
        &self.scope
    }

    /// The id bytes.
    ///
    /// ```
    /// assert_eq!(idemstore::Key::new("s", "i")?.id(), b"i");
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn id(&self) -> &[u8] {
        &self.id
    }
}

fn invalid(reason: String) -> Error {
    Error::InvalidKey { reason }
}

/// Prints `scope/id`, each as text when it is printable UTF-8 and as
/// `0x..` hex otherwise.
///
/// ```
/// let k = idemstore::Key::new("tenant", [0xff, 0x00])?;
/// assert_eq!(k.to_string(), "tenant/0xff00");
/// # Ok::<(), idemstore::Error>(())
/// ```
impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_printable(f, &self.scope)?;
        f.write_str("/")?;
        write_printable(f, &self.id)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({self})")
    }
}

pub(crate) fn write_printable(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    match std::str::from_utf8(bytes) {
        Ok(s) if s.chars().all(|c| !c.is_control()) => f.write_str(s),
        _ => {
            f.write_str("0x")?;
            for b in bytes {
                write!(f, "{b:02x}")?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_inclusive() {
        assert!(Key::new([b's'; MAX_SCOPE_BYTES], [b'i'; MAX_ID_BYTES]).is_ok());
        assert!(Key::new([b's'; MAX_SCOPE_BYTES + 1], "i").is_err());
        assert!(Key::new("", [b'i'; MAX_ID_BYTES + 1]).is_err());
        assert!(Key::new("", "i").is_ok());
    }

    #[test]
    fn scope_and_id_do_not_run_together() {
        assert_ne!(Key::new("ab", "c").ok(), Key::new("a", "bc").ok());
    }
}
