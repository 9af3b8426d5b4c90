//! The line codec: newline-delimited frames over any `AsyncRead`, bounded by `line_bytes_max`.
//!
//! Memory is bounded by the limit, whatever the peer sends: an oversize line is counted and
//! discarded as it streams in (never buffered whole), reported once as [`Line::TooLong`], and the
//! next line is read normally, so one bad request does not cost the connection.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt};

pub use crate::limits::LINE_BYTES_MAX_DEFAULT;

/// Bytes asked of the reader per read once the buffer has room; also the first allocation.
const READ_CHUNK_BYTES: usize = 8 * 1024;

/// One frame from [`LineReader::next_line`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line<'a> {
    /// A line without its `\n` (a final line cut by EOF counts too). Never empty or blank.
    Text(&'a [u8]),
    /// A line longer than the limit; its bytes were dropped. `bytes` is its length without the
    /// `\n` (saturating).
    TooLong { bytes: usize },
}

/// Reads newline-delimited lines, at most `line_bytes_max` bytes each.
///
/// Blank lines (empty or only ASCII whitespace) are skipped: neither protocol answers them.
///
/// Cancel-safe: all progress lives in `self` and a read that is dropped consumes nothing, so
/// `next_line` can sit in a `tokio::select!` next to a reply channel.
#[derive(Debug)]
pub struct LineReader<R> {
    reader: R,
    line_bytes_max: usize,
    buf: Vec<u8>,
    /// Start of unconsumed bytes in `buf`.
    start: usize,
    /// End of filled bytes in `buf`.
    end: usize,
    /// `buf[start..scanned]` is known to contain no `\n`.
    scanned: usize,
    /// Bytes dropped so far of an oversize line whose `\n` has not arrived yet.
    discarding: Option<usize>,
    eof: bool,
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    /// `line_bytes_max` must be at least 1 (a configuration error otherwise).
    pub fn new(reader: R, line_bytes_max: usize) -> LineReader<R> {
        assert!(line_bytes_max >= 1, "line_bytes_max must be at least 1");
        LineReader {
            reader,
            line_bytes_max,
            buf: Vec::new(),
            start: 0,
            end: 0,
            scanned: 0,
            discarding: None,
            eof: false,
        }
    }

    pub fn line_bytes_max(&self) -> usize {
        self.line_bytes_max
    }

    pub fn get_ref(&self) -> &R {
        &self.reader
    }

    pub fn get_mut(&mut self) -> &mut R {
        &mut self.reader
    }

    /// The next line, `Ok(None)` at end of stream. Read errors are returned as they come; the
    /// connection is then unusable.
    pub async fn next_line(&mut self) -> io::Result<Option<Line<'_>>> {
        loop {
            match self.scan() {
                Found::Line(a, b) => return Ok(Some(Line::Text(&self.buf[a..b]))),
                Found::TooLong(bytes) => return Ok(Some(Line::TooLong { bytes })),
                Found::Blank => continue,
                Found::Nothing => {}
            }
            if self.eof {
                return Ok(self.finish());
            }
            self.make_room();
            let end = self.end;
            let n = self.reader.read(&mut self.buf[end..]).await?;
            if n == 0 {
                self.eof = true;
            } else {
                self.end += n;
            }
        }
    }

    /// Looks for the next complete frame in what has been read.
    fn scan(&mut self) -> Found {
        if let Some(dropped) = self.discarding {
            return match memchr::memchr(b'\n', &self.buf[self.start..self.end]) {
                Some(i) => {
                    self.discarding = None;
                    self.consume(self.start + i + 1);
                    Found::TooLong(dropped.saturating_add(i))
                }
                None => {
                    self.discarding = Some(dropped.saturating_add(self.end - self.start));
                    self.consume(self.end);
                    Found::Nothing
                }
            };
        }
        match memchr::memchr(b'\n', &self.buf[self.scanned..self.end]) {
            Some(i) => {
                let (a, b) = (self.start, self.scanned + i);
                self.consume(b + 1);
                self.frame(a, b)
            }
            None => {
                self.scanned = self.end;
                if self.end - self.start > self.line_bytes_max {
                    // The `\n` cannot fit any more: drop what we have and count the rest.
                    self.discarding = Some(self.end - self.start);
                    self.consume(self.end);
                }
                Found::Nothing
            }
        }
    }

    fn frame(&self, a: usize, b: usize) -> Found {
        if b - a > self.line_bytes_max {
            Found::TooLong(b - a)
        } else if self.buf[a..b].iter().all(u8::is_ascii_whitespace) {
            Found::Blank
        } else {
            Found::Line(a, b)
        }
    }

    /// At end of stream: a pending oversize line or a final line without `\n`, then `None`.
    fn finish(&mut self) -> Option<Line<'_>> {
        if let Some(dropped) = self.discarding.take() {
            return Some(Line::TooLong { bytes: dropped });
        }
        if self.start == self.end {
            return None;
        }
        let (a, b) = (self.start, self.end);
        self.consume(b);
        match self.frame(a, b) {
            Found::Line(a, b) => Some(Line::Text(&self.buf[a..b])),
            Found::TooLong(bytes) => Some(Line::TooLong { bytes }),
            Found::Blank | Found::Nothing => None,
        }
    }

    fn consume(&mut self, to: usize) {
        self.start = to;
        self.scanned = to;
    }

    /// Ensures `buf[end..]` is non-empty without letting the buffer grow past what one line of
    /// `line_bytes_max` bytes (plus its `\n`) needs.
    fn make_room(&mut self) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            self.scanned = 0;
        }
        if self.end < self.buf.len() {
            return;
        }
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.scanned -= self.start;
            self.start = 0;
            if self.end < self.buf.len() {
                return;
            }
        }
        // Full of one unfinished line of at most `line_bytes_max` bytes: grow, capped at the
        // limit + 1 so an oversize line is detected when the cap is reached.
        let cap = self.line_bytes_max.saturating_add(1);
        let want = (self.buf.len() * 2)
            .max(READ_CHUNK_BYTES)
            .min(cap.max(self.end + 1));
        self.buf.resize(want, 0);
    }
}

enum Found {
    /// `buf[a..b]`.
    Line(usize, usize),
    TooLong(usize),
    Blank,
    Nothing,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// Feeds `input` in `chunk`-sized writes through a duplex pipe and collects every frame.
    async fn frames(input: &[u8], max: usize, chunk: usize) -> Vec<Result<Vec<u8>, usize>> {
        let (mut tx, rx) = tokio::io::duplex(64);
        let data = input.to_vec();
        let writer = tokio::spawn(async move {
            for part in data.chunks(chunk.max(1)) {
                tx.write_all(part).await.expect("write");
            }
        });
        let mut reader = LineReader::new(rx, max);
        let mut out = Vec::new();
        while let Some(line) = reader.next_line().await.expect("read") {
            out.push(match line {
                Line::Text(t) => Ok(t.to_vec()),
                Line::TooLong { bytes } => Err(bytes),
            });
            assert!(
                reader.buf.len() <= (max + 1).max(READ_CHUNK_BYTES),
                "buffer grew past the bound"
            );
        }
        writer.await.expect("writer");
        out
    }

    fn text(s: &str) -> Result<Vec<u8>, usize> {
        Ok(s.as_bytes().to_vec())
    }

    #[tokio::test]
    async fn splits_lines_and_keeps_a_final_line_without_newline() {
        for chunk in [1, 2, 3, 7, 64, 1000] {
            let got = frames(b"{\"a\":1}\n{\"b\":2}\r\nlast", 100, chunk).await;
            assert_eq!(
                got,
                vec![text("{\"a\":1}"), text("{\"b\":2}\r"), text("last")],
                "chunk {chunk}"
            );
        }
    }

    #[tokio::test]
    async fn skips_blank_lines() {
        let got = frames(b"\n\n  \t\r\nx\n\n \n", 100, 3).await;
        assert_eq!(got, vec![text("x")]);
    }

    #[tokio::test]
    async fn empty_stream_has_no_lines() {
        assert_eq!(frames(b"", 10, 1).await, vec![]);
    }

    #[tokio::test]
    async fn line_of_exactly_the_limit_passes_one_more_byte_does_not() {
        for chunk in [1, 4, 100] {
            let got = frames(b"abcd\nabcde\nok\n", 4, chunk).await;
            assert_eq!(got, vec![text("abcd"), Err(5), text("ok")], "chunk {chunk}");
        }
    }

    #[tokio::test]
    async fn oversize_line_is_discarded_and_the_connection_goes_on() {
        let mut input = b"first\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', 100_000));
        input.extend_from_slice(b"\nsecond\n");
        for chunk in [1, 13, 4096, 200_000] {
            let got = frames(&input, 1000, chunk).await;
            assert_eq!(
                got,
                vec![text("first"), Err(100_000), text("second")],
                "chunk {chunk}"
            );
        }
    }

    #[tokio::test]
    async fn oversize_final_line_without_newline_is_reported_at_eof() {
        let got = frames(&[b'y'; 50], 10, 7).await;
        assert_eq!(got, vec![Err(50)]);
        let got = frames(&[b'y'; 11], 10, 100).await;
        assert_eq!(got, vec![Err(11)]);
    }

    #[tokio::test]
    async fn many_small_lines_in_one_read() {
        let input: Vec<u8> = (0..1000)
            .flat_map(|i| format!("line{i}\n").into_bytes())
            .collect();
        let got = frames(&input, 16, 5000).await;
        assert_eq!(got.len(), 1000);
        assert_eq!(got[999], text("line999"));
    }

    #[tokio::test]
    async fn hostile_endless_line_stays_bounded() {
        // 4 MiB without a newline against a 1 KiB limit: the buffer never exceeds the bound
        // (checked in `frames`) and the line is reported once.
        let input = vec![b'z'; 4 << 20];
        let got = frames(&input, 1024, 65_536).await;
        assert_eq!(got, vec![Err(4 << 20)]);
    }
}
