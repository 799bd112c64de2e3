//! `Content-Length` framing (LSP style) as a tokio-util codec.
//!
//! A frame is `Content-Length: N\r\n` (other headers such as `Content-Type` are accepted and
//! ignored), an empty line, then N bytes of UTF-8 JSON. The codec only cuts and joins byte
//! frames; it never parses JSON. A frame larger than the configured maximum or a header block
//! that is not well formed is a [`FrameError`], after which the stream must be treated as
//! broken: there is no way to find the next frame boundary again.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

/// Default maximum size of one frame body: 64 MiB.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// Longest header block accepted before the empty line (headers are tiny in practice).
const MAX_HEADER_BYTES: usize = 8 * 1024;

/// How much buffer the decoder reserves ahead of a body still arriving. The announced
/// `Content-Length` is only a claim: reserving all of it up front would let a peer that
/// announces 64 MiB and sends nothing hold 64 MiB per connection. The buffer grows with what
/// actually arrives, at most this much ahead of it.
pub const MAX_RESERVE_AHEAD_BYTES: usize = 64 * 1024;

/// The least room a read is given: a read asks the pipe for whatever is there up to this
/// much beyond the frame being read, so a burst of frames comes in a few reads, not in reads
/// sized to one header or one body's remainder (tokio-util's first buffer is this size too).
pub const MIN_READ_BYTES: usize = 8 * 1024;

/// The most read buffer a connection keeps between frames: after a larger frame, an empty
/// buffer starts afresh instead of keeping that frame's allocation.
pub const MAX_RETAINED_READ_BYTES: usize = 16 * 1024;

/// Why a byte stream could not be cut into frames.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The announced body is larger than the configured maximum.
    #[error("frame of {announced} bytes exceeds the maximum of {max} bytes")]
    TooLarge { announced: usize, max: usize },
    /// The header block has no `Content-Length`, a bad value, or is not text.
    #[error("malformed frame header: {0}")]
    MalformedHeader(String),
    /// The stream ended in the middle of a frame.
    #[error("stream ended inside a frame ({0} bytes buffered)")]
    Truncated(usize),
    /// Reading or writing the underlying pipe failed.
    #[error("i/o error on the frame stream: {0}")]
    Io(#[from] std::io::Error),
}

/// Cuts a byte stream into frame bodies and writes bodies with their header.
#[derive(Debug, Clone)]
pub struct FrameCodec {
    max_frame_bytes: usize,
    /// When set, the maximum for reading a frame's header, as it is at that moment (raised
    /// by the owner once its peer may send more; see `ConnectionOptions::read_limit_until_lifted`).
    read_max: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
    /// Body length of the frame whose header has been consumed, if any.
    pending_body: Option<usize>,
}

impl FrameCodec {
    /// A codec that refuses bodies larger than `max_frame_bytes`.
    pub fn new(max_frame_bytes: usize) -> Self {
        Self {
            max_frame_bytes,
            read_max: None,
            pending_body: None,
        }
    }

    /// A codec whose frames read may be at most what `read_max` holds when each header is
    /// read (written frames: at most `max_frame_bytes`).
    pub fn with_read_max(
        max_frame_bytes: usize,
        read_max: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) -> Self {
        Self {
            read_max: Some(read_max),
            ..Self::new(max_frame_bytes)
        }
    }

    /// The configured maximum body size.
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    fn parse_header(&self, block: &[u8]) -> Result<usize, FrameError> {
        let text = std::str::from_utf8(block)
            .map_err(|_| FrameError::MalformedHeader("header is not UTF-8".into()))?;
        let mut length = None;
        for line in text.split("\r\n").filter(|l| !l.is_empty()) {
            let (name, value) = line.split_once(':').ok_or_else(|| {
                FrameError::MalformedHeader(format!("header line without ':': {:?}", clip(line)))
            })?;
            if name.trim().eq_ignore_ascii_case("content-length") {
                let value = value.trim();
                let n: usize = value.parse().map_err(|_| {
                    FrameError::MalformedHeader(format!("bad Content-Length {:?}", clip(value)))
                })?;
                length = Some(n);
            }
        }
        let n =
            length.ok_or_else(|| FrameError::MalformedHeader("no Content-Length header".into()))?;
        let max = self.read_max.as_ref().map_or(self.max_frame_bytes, |m| {
            m.load(std::sync::atomic::Ordering::Relaxed)
        });
        if n > max {
            return Err(FrameError::TooLarge { announced: n, max });
        }
        Ok(n)
    }
}

impl Default for FrameCodec {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_FRAME_BYTES)
    }
}

fn clip(s: &str) -> String {
    s.chars().take(64).collect()
}

impl Decoder for FrameCodec {
    type Item = Bytes;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Bytes>, FrameError> {
        let body_len = match self.pending_body {
            Some(n) => n,
            None => {
                let Some(end) = find_header_end(src) else {
                    if src.len() > MAX_HEADER_BYTES {
                        return Err(FrameError::MalformedHeader(format!(
                            "no end of header within {MAX_HEADER_BYTES} bytes"
                        )));
                    }
                    // Room for the header and what follows it in one read.
                    src.reserve(MIN_READ_BYTES);
                    return Ok(None);
                };
                let n = self.parse_header(&src[..end])?;
                src.advance(end + 4);
                self.pending_body = Some(n);
                n
            }
        };
        if src.len() < body_len {
            // Room for the rest of the body and the start of the next frame, at most the
            // read-ahead: the buffer grows with the bytes that arrive, not with what the
            // header announced.
            let rest = body_len - src.len();
            src.reserve(
                rest.saturating_add(MIN_READ_BYTES)
                    .min(MAX_RESERVE_AHEAD_BYTES),
            );
            return Ok(None);
        }
        self.pending_body = None;
        let frame = src.split_to(body_len).freeze();
        // (The read room kept past a frame does not count against what is retained.)
        if src.is_empty() && src.capacity() + body_len > MAX_RETAINED_READ_BYTES + MIN_READ_BYTES {
            // The buffer would otherwise reclaim the large frame's allocation once the frame
            // is dropped, and every connection would hold its largest frame for good.
            *src = BytesMut::new();
        }
        Ok(Some(frame))
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<Bytes>, FrameError> {
        match self.decode(buf)? {
            Some(frame) => Ok(Some(frame)),
            None if buf.is_empty() && self.pending_body.is_none() => Ok(None),
            None => Err(FrameError::Truncated(buf.len())),
        }
    }
}

fn find_header_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

impl Encoder<Bytes> for FrameCodec {
    type Error = FrameError;

    fn encode(&mut self, body: Bytes, dst: &mut BytesMut) -> Result<(), FrameError> {
        if body.len() > self.max_frame_bytes {
            return Err(FrameError::TooLarge {
                announced: body.len(),
                max: self.max_frame_bytes,
            });
        }
        let header = format!("Content-Length: {}\r\n\r\n", body.len());
        dst.reserve(header.len() + body.len());
        dst.put_slice(header.as_bytes());
        dst.put_slice(&body);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(codec: &mut FrameCodec, input: &[u8]) -> Result<Vec<Bytes>, FrameError> {
        let mut buf = BytesMut::from(input);
        let mut out = Vec::new();
        while let Some(frame) = codec.decode(&mut buf)? {
            out.push(frame);
        }
        Ok(out)
    }

    #[test]
    fn round_trips_frames() {
        let mut codec = FrameCodec::default();
        let mut buf = BytesMut::new();
        codec
            .encode(Bytes::from_static(b"{\"a\":1}"), &mut buf)
            .unwrap();
        codec.encode(Bytes::from_static(b"[]"), &mut buf).unwrap();
        assert_eq!(
            &buf[..],
            b"Content-Length: 7\r\n\r\n{\"a\":1}Content-Length: 2\r\n\r\n[]"
        );
        let frames = decode_all(&mut codec, &buf).unwrap();
        assert_eq!(
            frames,
            vec![Bytes::from_static(b"{\"a\":1}"), Bytes::from_static(b"[]")]
        );
    }

    #[test]
    fn decodes_byte_by_byte_and_accepts_content_type() {
        let input = b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\ncontent-length: 3\r\n\r\n\"x\"";
        let mut codec = FrameCodec::default();
        let mut buf = BytesMut::new();
        let mut frames = Vec::new();
        for b in input {
            buf.put_u8(*b);
            if let Some(f) = codec.decode(&mut buf).unwrap() {
                frames.push(f);
            }
        }
        assert_eq!(frames, vec![Bytes::from_static(b"\"x\"")]);
    }

    #[test]
    fn body_length_counts_utf8_bytes() {
        let body = "{\"t\":\"é\"}".as_bytes();
        let mut codec = FrameCodec::default();
        let mut buf = BytesMut::new();
        codec
            .encode(Bytes::copy_from_slice(body), &mut buf)
            .unwrap();
        assert!(buf.starts_with(format!("Content-Length: {}\r\n", body.len()).as_bytes()));
        assert_eq!(decode_all(&mut codec, &buf).unwrap()[0], body);
    }

    #[test]
    fn refuses_oversized_frames_before_buffering_them() {
        let mut codec = FrameCodec::new(10);
        let err = decode_all(&mut codec, b"Content-Length: 11\r\n\r\n").unwrap_err();
        assert!(
            matches!(
                err,
                FrameError::TooLarge {
                    announced: 11,
                    max: 10
                }
            ),
            "{err}"
        );
        let mut buf = BytesMut::new();
        assert!(codec.encode(Bytes::from(vec![b'x'; 11]), &mut buf).is_err());
    }

    #[test]
    fn refuses_malformed_headers() {
        for input in [
            &b"Content-Length: abc\r\n\r\n"[..],
            b"Content-Length: -1\r\n\r\n",
            b"X-Other: 1\r\n\r\n{}",
            b"garbage without colon\r\n\r\n",
            b"\xff\xfe: 1\r\n\r\n",
        ] {
            let mut codec = FrameCodec::default();
            let err = decode_all(&mut codec, input).unwrap_err();
            assert!(
                matches!(err, FrameError::MalformedHeader(_)),
                "{input:?}: {err}"
            );
        }
    }

    #[test]
    fn a_huge_content_length_reserves_no_more_than_the_read_ahead() {
        let mut codec = FrameCodec::default();
        let header = format!("Content-Length: {DEFAULT_MAX_FRAME_BYTES}\r\n\r\n{{");
        let mut buf = BytesMut::from(header.as_bytes());
        assert!(codec.decode(&mut buf).unwrap().is_none());
        assert!(
            buf.capacity() <= header.len() + MAX_RESERVE_AHEAD_BYTES,
            "reserved {} bytes for a body of which 1 byte arrived",
            buf.capacity()
        );
        // The body still decodes whole once it has arrived, in pieces.
        let mut codec = FrameCodec::default();
        let body = vec![b'7'; 3 * MAX_RESERVE_AHEAD_BYTES + 5];
        let mut buf = BytesMut::from(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
        let mut frames = Vec::new();
        let mut arrived = buf.len();
        for piece in body.chunks(MAX_RESERVE_AHEAD_BYTES / 3) {
            buf.extend_from_slice(piece);
            arrived += piece.len();
            if let Some(frame) = codec.decode(&mut buf).unwrap() {
                frames.push(frame);
            }
            // Keeping the read-ahead free may double the buffer (`BytesMut`'s growth).
            assert!(
                buf.capacity() <= 2 * (arrived + MAX_RESERVE_AHEAD_BYTES),
                "{} bytes of buffer after {arrived} bytes arrived",
                buf.capacity()
            );
        }
        assert_eq!(frames, vec![Bytes::from(body)]);
    }

    #[test]
    fn refuses_endless_header() {
        let mut codec = FrameCodec::default();
        let err = decode_all(&mut codec, &vec![b'a'; MAX_HEADER_BYTES + 1]).unwrap_err();
        assert!(matches!(err, FrameError::MalformedHeader(_)));
    }

    #[test]
    fn eof_inside_a_frame_is_an_error() {
        let mut codec = FrameCodec::default();
        let mut buf = BytesMut::from(&b"Content-Length: 5\r\n\r\n{}"[..]);
        assert!(codec.decode(&mut buf).unwrap().is_none());
        assert!(matches!(
            codec.decode_eof(&mut buf),
            Err(FrameError::Truncated(2))
        ));
        let mut clean = FrameCodec::default();
        assert!(clean.decode_eof(&mut BytesMut::new()).unwrap().is_none());
    }

    /// A pipe's read end holding `data`: each read takes what is asked, up to what is left,
    /// and the sizes asked are kept.
    struct RecordedPipe {
        data: Vec<u8>,
        at: usize,
        asked: Vec<usize>,
    }

    impl tokio::io::AsyncRead for RecordedPipe {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            self.asked.push(buf.remaining());
            let n = buf.remaining().min(self.data.len() - self.at);
            let at = self.at;
            buf.put_slice(&self.data[at..at + n]);
            self.at += n;
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_burst_of_frames_is_read_in_reads_of_at_least_eight_kibibytes() {
        use futures_util::StreamExt;
        // What a runtime writes during a turn: small events between large ones, and a
        // frame larger than the buffer a connection keeps.
        let mut codec = FrameCodec::default();
        let mut data = BytesMut::new();
        let sizes = [300, 10_000, 75, 40_000, 900, 9_000, 20, 14_000];
        for (i, size) in sizes.iter().enumerate() {
            codec
                .encode(Bytes::from(vec![b'a' + i as u8; *size]), &mut data)
                .unwrap();
        }
        let total = data.len();
        let pipe = RecordedPipe {
            data: data.to_vec(),
            at: 0,
            asked: Vec::new(),
        };
        let mut framed = tokio_util::codec::FramedRead::new(pipe, FrameCodec::default());
        let mut got = Vec::new();
        while let Some(frame) = framed.next().await {
            got.push(frame.unwrap().len());
        }
        assert_eq!(got, sizes);
        let asked = &framed.get_ref().asked;
        assert!(
            asked.iter().all(|n| *n >= MIN_READ_BYTES),
            "reads asked for {asked:?} bytes"
        );
        // Every read but the last (which finds the end) fills what it asked for.
        assert!(
            asked.len() <= total.div_ceil(MIN_READ_BYTES) + 1,
            "{} reads for {total} bytes: {asked:?}",
            asked.len()
        );
    }

    #[test]
    fn a_body_still_arriving_leaves_room_for_the_next_frames_start_within_the_read_ahead() {
        let mut codec = FrameCodec::default();
        let mut buf = BytesMut::with_capacity(64);
        buf.extend_from_slice(b"Content-Length: 100\r\n\r\n{\"a\":");
        assert!(codec.decode(&mut buf).unwrap().is_none());
        assert!(
            buf.capacity() - buf.len() >= 100 - 5 + MIN_READ_BYTES,
            "{} bytes free for a body's 95 bytes still to come",
            buf.capacity() - buf.len()
        );
        // A codec whose limit is near the address space: no overflow in the reservation.
        let mut huge = FrameCodec::new(usize::MAX);
        let header = format!("Content-Length: {}\r\n\r\n{{", usize::MAX);
        let mut buf = BytesMut::from(header.as_bytes());
        assert!(huge.decode(&mut buf).unwrap().is_none());
        assert!(buf.capacity() <= header.len() + 2 * MAX_RESERVE_AHEAD_BYTES);
    }

    #[test]
    fn after_a_large_frame_the_read_buffer_does_not_keep_its_allocation() {
        let body = vec![b'x'; 200 * 1024];
        let mut buf = BytesMut::from(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
        buf.extend_from_slice(&body);
        let mut codec = FrameCodec::default();
        let frame = codec.decode(&mut buf).unwrap().unwrap();
        assert_eq!(frame.len(), body.len());
        drop(frame);
        // What the framed reader does before its next read.
        buf.reserve(1);
        assert!(
            buf.capacity() <= MAX_RETAINED_READ_BYTES,
            "the read buffer kept {} bytes after a {}-byte frame",
            buf.capacity(),
            body.len()
        );
    }
}
