//! [`ResponseBody`]: what [`Idempotency`](super::Idempotency) answers with.

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use std::pin::Pin;
use std::task::{Context, Poll};

pin_project! {
    /// The response body of [`Idempotency`](super::Idempotency): the inner
    /// service's body passed through (possibly after a buffered prefix), or
    /// bytes held in memory (a buffered first response, a replay, a problem).
    ///
    /// ```
    /// use http_body::Body;
    /// let b = idemstore::tower::ResponseBody::<http_body_util::Empty<bytes::Bytes>>::from_bytes("hi");
    /// assert_eq!(b.size_hint().exact(), Some(2));
    /// ```
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Full { data: Option<Bytes> },
        Stream { prefix: Option<Bytes>, #[pin] rest: B },
    }
}

impl<B> ResponseBody<B> {
    /// A body of `data`, held in memory.
    pub fn from_bytes(data: impl Into<Bytes>) -> ResponseBody<B> {
        let data: Bytes = data.into();
        ResponseBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// `rest` passed through, after `prefix` (bytes already read from it).
    pub(crate) fn stream(prefix: Bytes, rest: B) -> ResponseBody<B> {
        ResponseBody {
            kind: Kind::Stream {
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
            },
        }
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Stream { prefix, rest } => match prefix.take() {
                Some(d) => Poll::Ready(Some(Ok(Frame::data(d)))),
                None => rest.poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Stream { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        let len = |d: &Option<Bytes>| d.as_ref().map_or(0, |d| d.len() as u64);
        match &self.kind {
            Kind::Full { data } => SizeHint::with_exact(len(data)),
            Kind::Stream { prefix, rest } => {
                let hint = rest.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(hint.lower().saturating_add(len(prefix)));
                if let Some(upper) = hint.upper() {
                    out.set_upper(upper.saturating_add(len(prefix)));
                }
                out
            }
        }
    }
}

/// A response body read into memory, or why not.
pub(crate) enum Buffered<B: Body> {
    /// All of it (trailers are dropped: a snapshot has none).
    Complete(Bytes),
    /// Longer than the limit: what was read, and the unread rest.
    TooLarge(Bytes, B),
    /// The body failed while it was read.
    Failed(B::Error),
}

/// Reads `body` into memory, stopping (without losing anything) once it is
/// longer than `limit_bytes`.
pub(crate) async fn buffer<B>(mut body: B, limit_bytes: usize) -> Buffered<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    let declared = usize::try_from(body.size_hint().lower()).unwrap_or(usize::MAX);
    if declared > limit_bytes {
        return Buffered::TooLarge(Bytes::new(), body);
    }
    // What was read is in one of the two: the usual body, one frame, stays
    // in `first` as it came (not copied); a second frame moves it all into
    // `more`.
    let (mut first, mut more) = (Bytes::new(), BytesMut::new());
    let read = |first: Bytes, more: BytesMut| {
        if more.is_empty() {
            first
        } else {
            more.freeze()
        }
    };
    while let Some(frame) = body.frame().await {
        match frame.map(Frame::into_data) {
            Ok(Ok(data)) if first.is_empty() && more.is_empty() => first = data,
            Ok(Ok(data)) => {
                more.extend_from_slice(&std::mem::take(&mut first));
                more.extend_from_slice(&data);
            }
            Ok(Err(_trailers)) => {}
            Err(e) => return Buffered::Failed(e),
        }
        if first.len() + more.len() > limit_bytes {
            return Buffered::TooLarge(read(first, more), body);
        }
    }
    Buffered::Complete(read(first, more))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// A body of chunks with no size hint, like a streamed response.
    struct Chunks(VecDeque<Bytes>);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
    }

    fn chunks(parts: &[&'static str]) -> Chunks {
        Chunks(
            parts
                .iter()
                .map(|p| Bytes::from_static(p.as_bytes()))
                .collect(),
        )
    }

    #[tokio::test]
    async fn a_body_over_the_limit_loses_nothing() {
        // A streamed response longer than the limit: the bytes read while
        // finding out must still reach the client, in order.
        let Buffered::TooLarge(prefix, rest) = buffer(chunks(&["abc", "def", "ghi"]), 4).await
        else {
            panic!("expected TooLarge");
        };
        assert_eq!(prefix, "abcdef");
        let body = ResponseBody::stream(prefix, rest);
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(all, "abcdefghi");
    }

    /// One frame is kept as it came (the same bytes, not a copy); empty
    /// frames before or between others lose nothing.
    #[tokio::test]
    async fn one_frame_is_not_copied_and_empty_frames_are_harmless() {
        let one = Bytes::from(vec![7u8; 8]);
        let Buffered::Complete(all) = buffer(Chunks([one.clone()].into()), 8).await else {
            panic!("expected Complete");
        };
        assert_eq!(all.as_ptr(), one.as_ptr());
        for parts in [&["", "ab", "", "cd"][..], &["ab", "", "cd"], &["", ""]] {
            let Buffered::Complete(all) = buffer(chunks(parts), 4).await else {
                panic!("expected Complete");
            };
            assert_eq!(all, parts.concat());
        }
        let Buffered::TooLarge(prefix, _) = buffer(chunks(&["", "abcde", "f"]), 4).await else {
            panic!("expected TooLarge");
        };
        assert_eq!(prefix, "abcde");
    }

    #[tokio::test]
    async fn a_body_within_the_limit_is_buffered() {
        let Buffered::Complete(all) = buffer(chunks(&["ab", "cd"]), 4).await else {
            panic!("expected Complete");
        };
        assert_eq!(all, "abcd");
        let full = ResponseBody::<Chunks>::from_bytes(all);
        assert_eq!(full.size_hint().exact(), Some(4));
        assert_eq!(full.collect().await.unwrap().to_bytes(), "abcd");
    }
}
