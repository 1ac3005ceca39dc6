//! Stop strings over streamed text.

/// Buffers streamed text so that nothing that could be the start of a stop string is emitted early.
#[derive(Debug)]
pub struct StopBuffer {
    stops: Vec<String>,
    text: String,
    emitted: usize,
    stopped: bool,
    matched: Option<usize>,
}

impl StopBuffer {
    /// A buffer for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        StopBuffer {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            emitted: 0,
            stopped: false,
            matched: None,
        }
    }

    /// Adds text; emits what is now certain through `emit`. Returns `true` once a stop string is found
    /// (the text before it has been emitted, the stop string and anything after it dropped).
    pub fn push(&mut self, delta: &str, emit: &mut dyn FnMut(&str)) -> bool {
        if self.stopped {
            return true;
        }
        self.text.push_str(delta);
        // Only a stop string that ends in the new text can be new; search from far enough back.
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let from = floor_char(
            &self.text,
            self.emitted
                .min(self.text.len().saturating_sub(delta.len() + longest)),
        );
        let hit = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(k, s)| self.text[from..].find(s.as_str()).map(|i| (from + i, k)))
            .min();
        if let Some((at, k)) = hit {
            self.matched = Some(k);
            self.text.truncate(at);
            self.flush(self.text.len(), emit);
            self.stopped = true;
            return true;
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for k in (1..s.len().min(self.text.len() + 1)).rev() {
                if s.is_char_boundary(k) && self.text.ends_with(&s[..k]) {
                    keep = keep.max(k);
                    break;
                }
            }
        }
        self.flush(self.text.len() - keep, emit);
        false
    }

    /// The stop string that ended the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|k| self.stops[k].as_str())
    }

    fn flush(&mut self, upto: usize, emit: &mut dyn FnMut(&str)) {
        if upto > self.emitted {
            emit(&self.text[self.emitted..upto]);
            self.emitted = upto;
        }
    }

    /// Emits whatever is held back and returns the whole text.
    pub fn finish(mut self, emit: &mut dyn FnMut(&str)) -> String {
        if !self.stopped {
            self.flush(self.text.len(), emit);
        }
        self.text
    }
}

fn floor_char(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, String, bool) {
        let mut b = StopBuffer::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        let mut stopped = false;
        for p in pieces {
            if b.push(p, &mut |t| out.push(t.to_string())) {
                stopped = true;
                break;
            }
        }
        let text = b.finish(&mut |t| out.push(t.to_string()));
        (out, text, stopped)
    }

    #[test]
    fn stops_across_pieces_and_holds_back_prefixes() {
        let (out, text, stopped) = run(&["</tool>"], &["Hello <", "/to", "ol> more"]);
        assert!(stopped);
        assert_eq!(text, "Hello ");
        let (_, text, _) = run(&["b", "ab"], &["xab"]);
        assert_eq!(text, "x", "the earliest stop string wins");
        assert_eq!(out.concat(), "Hello ");
        assert_eq!(
            out[0], "Hello ",
            "'<' is held back as a possible stop prefix"
        );
    }

    #[test]
    fn releases_false_alarms_and_handles_unicode() {
        let (out, text, stopped) = run(&["STOP", "é!"], &["aS", "TOx", " é", "?"]);
        assert!(!stopped);
        assert_eq!(text, "aSTOx é?");
        assert_eq!(out.concat(), text);
        let (_, text, stopped) = run(&["é!"], &["ab é", "! tail"]);
        assert!(stopped);
        assert_eq!(text, "ab ");
        let (out, text, _) = run(&[], &["x", "y"]);
        assert_eq!((out.concat(), text), ("xy".into(), "xy".into()));
    }
}
