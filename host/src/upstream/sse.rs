//! A server-sent events decoder with a bound: an upstream's stream is read a chunk at a time and each
//! event's `data` handed on once its blank line arrives. A line or an event longer than the bound is an
//! error, so an upstream that never ends a line cannot grow thorn's memory (the decoders in the tree
//! buffer without limit).

/// An event or line over the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLong {
    /// The bound in bytes.
    pub limit: usize,
}

/// Decodes `text/event-stream` bytes into the events' data (fields other than `data` are not needed by
/// an OpenAI stream and are skipped; comments too).
#[derive(Debug)]
pub struct SseDecoder {
    line: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
    /// The previous chunk ended in `\r`: a `\n` starting this one belongs to it.
    after_cr: bool,
    limit: usize,
}

impl SseDecoder {
    /// A decoder that refuses lines and events over `limit` bytes.
    pub fn new(limit: usize) -> Self {
        SseDecoder {
            line: Vec::new(),
            data: Vec::new(),
            has_data: false,
            after_cr: false,
            limit,
        }
    }

    /// Feeds bytes; `out` gets each complete event's data (lines joined by `\n`, as the standard says).
    pub fn push(&mut self, mut bytes: &[u8], out: &mut dyn FnMut(&[u8])) -> Result<(), TooLong> {
        if self.after_cr && bytes.first() == Some(&b'\n') {
            bytes = &bytes[1..];
        }
        self.after_cr = false;
        while let Some(i) = bytes.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.take(&bytes[..i])?;
            let cr = bytes[i] == b'\r';
            bytes = &bytes[i + 1..];
            if cr {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    None => self.after_cr = true,
                    Some(_) => {}
                }
            }
            self.end_line(out)?;
        }
        self.take(bytes)
    }

    fn take(&mut self, part: &[u8]) -> Result<(), TooLong> {
        if self.line.len() + part.len() > self.limit {
            return Err(TooLong { limit: self.limit });
        }
        self.line.extend_from_slice(part);
        Ok(())
    }

    fn end_line(&mut self, out: &mut dyn FnMut(&[u8])) -> Result<(), TooLong> {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            if self.has_data {
                out(&self.data);
            }
            self.data.clear();
            self.has_data = false;
        } else if let Some(v) = line.strip_prefix(b"data") {
            // `data` alone is an empty value; `data:` then one optional space.
            let v = match v {
                [] => Some(&[][..]),
                [b':', b' ', rest @ ..] | [b':', rest @ ..] => Some(rest),
                _ => None,
            };
            if let Some(v) = v {
                if self.has_data {
                    self.data.push(b'\n');
                }
                // The event as a whole is bounded too (its lines each were).
                if self.data.len() + v.len() > self.limit {
                    return Err(TooLong { limit: self.limit });
                }
                self.data.extend_from_slice(v);
                self.has_data = true;
            }
        }
        self.line = line;
        self.line.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(chunks: &[&[u8]]) -> Vec<String> {
        let mut d = SseDecoder::new(64);
        let mut got = Vec::new();
        for c in chunks {
            d.push(c, &mut |e| {
                got.push(String::from_utf8_lossy(e).into_owned())
            })
            .unwrap();
        }
        got
    }

    #[test]
    fn events_are_split_at_blank_lines_whatever_the_chunking() {
        let whole: &[u8] = b": keep-alive\n\ndata: {\"a\":1}\n\ndata:x\r\ndata: y\r\n\r\nevent: e\nid: 3\ndata\n\n";
        let want = ["{\"a\":1}", "x\ny", ""];
        assert_eq!(events(&[whole]), want);
        // Every split point, including inside a CRLF.
        for i in 0..whole.len() {
            assert_eq!(events(&[&whole[..i], &whole[i..]]), want, "split at {i}");
        }
        let bytes: Vec<&[u8]> = whole.chunks(1).collect();
        assert_eq!(events(&bytes), want);
        // An event still open at the end is not an event.
        assert!(events(&[b"data: half"]).is_empty());
        // `dataset:` is not a data field.
        assert!(events(&[b"dataset: 1\n\n"]).is_empty());
    }

    #[test]
    fn a_line_over_the_bound_is_refused() {
        let mut d = SseDecoder::new(8);
        let mut n = 0;
        assert_eq!(
            d.push(b"data: 0123", &mut |_| n += 1),
            Err(TooLong { limit: 8 })
        );
        let mut d = SseDecoder::new(8);
        assert!(d.push(b"data: 12", &mut |_| n += 1).is_ok());
        assert_eq!(d.push(b"3", &mut |_| n += 1), Err(TooLong { limit: 8 }));
        // Many lines of one event add up.
        let mut d = SseDecoder::new(12);
        assert!(d.push(b"data: 123456\n", &mut |_| n += 1).is_ok());
        assert_eq!(
            d.push(b"data: 789012\n", &mut |_| n += 1),
            Err(TooLong { limit: 12 })
        );
        assert_eq!(n, 0);
    }
}
