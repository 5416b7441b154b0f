//! [`Key`]: (scope, id).

use crate::error::{Error, Result};
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

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
#[derive(Clone)]
pub struct Key {
    /// The scope's bytes, then the id's, in one allocation that every
    /// clone shares: a guarded run holds its key in the flights table, its
    /// lease renewal and its steps.
    bytes: Arc<[u8]>,
    /// Where the id starts; at most `bytes.len()` (only [`Key::new`]
    /// makes a key).
    scope_len: usize,
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
            bytes: scope.iter().chain(id).copied().collect(),
            scope_len: scope.len(),
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
        self.bytes.get(..self.scope_len).unwrap_or_default()
    }

    /// The id bytes.
    ///
    /// ```
    /// assert_eq!(idemstore::Key::new("s", "i")?.id(), b"i");
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn id(&self) -> &[u8] {
        self.bytes.get(self.scope_len..).unwrap_or_default()
    }
}

// Compared, ordered and hashed as the pair (scope, id): the bytes alone
// do not tell ("ab", "c") from ("a", "bc").
impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.scope_len == other.scope_len && self.bytes == other.bytes
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self.scope(), self.id()).hash(state);
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Key) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Key) -> Ordering {
        (self.scope(), self.id()).cmp(&(other.scope(), other.id()))
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
        write_printable(f, self.scope())?;
        f.write_str("/")?;
        write_printable(f, self.id())
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
        let k = |s: &str, i: &str| Key::new(s, i).unwrap();
        assert_ne!(k("ab", "c"), k("a", "bc"));
        // Ordered by scope, then id (the bytes alone would put "abc"
        // before "az").
        let mut keys = vec![
            k("b", "a"),
            k("ab", "c"),
            k("a", "z"),
            k("a", "bc"),
            k("", "zz"),
        ];
        keys.sort();
        let sorted = [
            k("", "zz"),
            k("a", "bc"),
            k("a", "z"),
            k("ab", "c"),
            k("b", "a"),
        ];
        assert_eq!(keys, sorted);
        let set: std::collections::HashSet<Key> = keys.iter().cloned().collect();
        assert_eq!(set.len(), 5);
        assert!(set.contains(&k("a", "bc")) && !set.contains(&k("abc", "x")));
        let hash = |k: &Key| {
            let mut h = std::hash::DefaultHasher::new();
            k.hash(&mut h);
            h.finish()
        };
        // The hash of the pair, as when the key was two boxed fields.
        #[derive(Hash)]
        struct Pair {
            scope: Box<[u8]>,
            id: Box<[u8]>,
        }
        for key in &keys {
            let mut h = std::hash::DefaultHasher::new();
            let pair = Pair {
                scope: key.scope().into(),
                id: key.id().into(),
            };
            pair.hash(&mut h);
            assert_eq!(hash(key), h.finish(), "{key}");
        }
        assert_ne!(hash(&k("a", "bc")), hash(&k("ab", "c")));
        // A clone shares the bytes and is the same key.
        let c = keys[3].clone();
        assert!(Arc::ptr_eq(&c.bytes, &keys[3].bytes));
        assert!(c == keys[3] && c.scope() == b"ab" && c.id() == b"c");
    }
}
