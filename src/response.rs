//! [`Response`]: the replayable snapshot, and its limits.

use crate::error::{Error, Result};

/// Default limit on a stored response body, in bytes (1 MiB). A store can be
/// configured up to [`MAX_BODY_BYTES_HARD_CAP`].
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
/// The largest body limit any store accepts (16 MiB): a snapshot is held in
/// memory and written in one transaction.
pub const MAX_BODY_BYTES_HARD_CAP: usize = 16 * 1024 * 1024;
/// Most headers in one response.
pub const MAX_HEADERS: usize = 64;
/// Most bytes in all header names and values of one response together (64 KiB).
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// The response of the first execution, stored with the DONE record and
/// returned to every retry: a status code, headers and a body.
///
/// For message consumers, the status can carry an application outcome code
/// and the body whatever the consumer wants a redelivery to see.
///
/// ```
/// use idemstore::Response;
///
/// let r = Response::new(201, b"{\"order\":1}".to_vec())
///     .with_header("content-type", "application/json");
/// assert_eq!(r.status(), 201);
/// assert_eq!(r.header("content-type"), Some(&b"application/json"[..]));
/// assert_eq!(r.body(), b"{\"order\":1}");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Response {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) body: Vec<u8>,
}

impl Response {
    /// A response with `status` and `body` and no headers.
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> Response {
        Response {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// Adds a header (names are kept as given; HTTP layers lower-case them).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Response {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The status code.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// All headers, in insertion order.
    ///
    /// ```
    /// let r = idemstore::Response::new(200, "").with_header("a", "1").with_header("b", "2");
    /// assert_eq!(r.headers().len(), 2);
    /// ```
    pub fn headers(&self) -> &[(String, Vec<u8>)] {
        &self.headers
    }

    /// The first header named `name` (ASCII case-insensitive).
    ///
    /// ```
    /// let r = idemstore::Response::new(200, "").with_header("Retry-After", "3");
    /// assert_eq!(r.header("retry-after"), Some(&b"3"[..]));
    /// ```
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// The body bytes.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// Consumes the response into (status, headers, body).
    ///
    /// ```
    /// let (status, headers, body) = idemstore::Response::new(204, "").into_parts();
    /// assert_eq!((status, headers.len(), body.len()), (204, 0, 0));
    /// ```
    #[allow(
        clippy::type_complexity,
        reason = "a plain tuple is the most direct destructuring"
    )]
    pub fn into_parts(self) -> (u16, Vec<(String, Vec<u8>)>, Vec<u8>) {
        (self.status, self.headers, self.body)
    }

    /// Checks the response against the limits, with `max_body_bytes` for the
    /// body: the body of [`logic::check_response`](crate::logic::check_response),
    /// the one public name of this check.
    pub(crate) fn check_limits(&self, max_body_bytes: usize) -> Result<()> {
        let limit = max_body_bytes.min(MAX_BODY_BYTES_HARD_CAP);
        if self.body.len() > limit {
            return Err(Error::ResponseTooLarge {
                what: "body bytes",
                size: self.body.len(),
                limit,
            });
        }
        if self.headers.len() > MAX_HEADERS {
            return Err(Error::ResponseTooLarge {
                what: "header count",
                size: self.headers.len(),
                limit: MAX_HEADERS,
            });
        }
        let header_bytes: usize = self.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        if header_bytes > MAX_HEADER_BYTES {
            return Err(Error::ResponseTooLarge {
                what: "header bytes",
                size: header_bytes,
                limit: MAX_HEADER_BYTES,
            });
        }
        Ok(())
    }
}

/// Checks a configured body limit against the hard cap.
pub(crate) fn check_body_limit(max_body_bytes: usize) -> Result<usize> {
    if max_body_bytes > MAX_BODY_BYTES_HARD_CAP {
        return Err(Error::invalid_argument(format!(
            "response body limit {max_body_bytes} exceeds the hard cap of {MAX_BODY_BYTES_HARD_CAP} bytes"
        )));
    }
    Ok(max_body_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_limits() {
        let mut r = Response::new(200, "");
        for i in 0..MAX_HEADERS {
            r = r.with_header(format!("h{i}"), "v");
        }
        assert!(r.check_limits(DEFAULT_MAX_BODY_BYTES).is_ok());
        let r = r.with_header("one-more", "v");
        assert!(matches!(
            r.check_limits(DEFAULT_MAX_BODY_BYTES),
            Err(Error::ResponseTooLarge {
                what: "header count",
                ..
            })
        ));
        let fat = Response::new(200, "").with_header("x", vec![b'v'; MAX_HEADER_BYTES]);
        assert!(matches!(
            fat.check_limits(DEFAULT_MAX_BODY_BYTES),
            Err(Error::ResponseTooLarge {
                what: "header bytes",
                ..
            })
        ));
    }

    #[test]
    fn configured_limit_never_exceeds_hard_cap() {
        assert!(check_body_limit(MAX_BODY_BYTES_HARD_CAP).is_ok());
        assert!(check_body_limit(MAX_BODY_BYTES_HARD_CAP + 1).is_err());
    }
}
