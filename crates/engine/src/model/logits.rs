//! A forward pass's logits as the caller reads them ([`LogitRows`]): each row's greedy token and
//! log-normaliser ([`BestLogit`], reduced on a GPU where the rows are: a few bytes read back), its top-k
//! sampling candidates ([`Candidates`], likewise, where a sampler asked for them), or the rows themselves,
//! read back on first use.

use crate::backend::{Buf, Device};

/// A logits row's greedy token (its largest value, the lower index among equals), that logit, and the
/// row's log-normaliser `ln(sum(exp(x)))`: all a greedy pick needs (`logprob = logit - lse`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BestLogit {
    /// The token.
    pub token: u32,
    /// Its logit.
    pub logit: f32,
    /// The row's log-normaliser.
    pub lse: f32,
}

/// A pass's logits rows (`vocab` floats each, in batch order), read back only as far as the caller asks:
/// [`LogitRows::best`] (on a GPU, three numbers a row) or [`LogitRows::row`] (the whole rows, read back
/// once, on first use). Valid until the next pass with the same scratch.
#[derive(Debug)]
pub struct LogitRows<'s> {
    all: Lazy<'s>,
    /// The rows' best, then (when `top`) their candidates.
    best: Lazy<'s>,
    top: bool,
    rows: usize,
    vocab: usize,
}

/// A logits row's largest finite values (at most [`Device::TOP_CANDIDATES`], the lower index first among
/// equals; all of them when the row has fewer), in no particular order.
#[derive(Debug, Clone, Copy)]
pub struct Candidates<'a>(&'a [f32]);

impl<'a> Candidates<'a> {
    /// The (token, logit) pairs.
    pub fn iter(&self) -> impl Iterator<Item = (u32, f32)> + 'a {
        let n = self.0[0] as usize;
        self.0[1..1 + 2 * n]
            .chunks_exact(2)
            .map(|p| (p[0] as u32, p[1]))
    }
}

/// Floats in a buffer, read back from the device on first use.
#[derive(Debug)]
enum Lazy<'s> {
    None,
    Buf(&'s mut Buf, usize),
    Read(&'s mut [f32]),
}

impl<'s> Lazy<'s> {
    fn get(&mut self) -> Option<&mut [f32]> {
        if matches!(self, Lazy::Buf(..)) {
            let Lazy::Buf(b, n) = std::mem::replace(self, Lazy::None) else {
                unreachable!("matched above")
            };
            *self = Lazy::Read(b.read_back(n));
        }
        match self {
            Lazy::Read(v) => Some(&mut **v),
            _ => None,
        }
    }
}

impl<'s> LogitRows<'s> {
    /// `rows` rows of `vocab` logits in `logits`, and their [`BestLogit`]s in `best`
    /// ([`Device::BEST_FLOATS`] a row) where the device reduced them, followed (when `top`) by their
    /// candidates ([`Device::TOP_FLOATS`] a row).
    pub(crate) fn new(
        logits: &'s mut Buf,
        best: Option<&'s mut Buf>,
        top: bool,
        rows: usize,
        vocab: usize,
    ) -> Self {
        let per = Device::BEST_FLOATS + if top { Device::TOP_FLOATS } else { 0 };
        LogitRows {
            all: Lazy::Buf(logits, rows * vocab),
            top: top && best.is_some(),
            best: best.map_or(Lazy::None, |b| Lazy::Buf(b, rows * per)),
            rows,
            vocab,
        }
    }

    /// Rows already on the host (`vocab` floats each).
    pub fn host(logits: &'s mut [f32], vocab: usize) -> Self {
        LogitRows {
            rows: logits.len().checked_div(vocab).unwrap_or(0),
            all: Lazy::Read(logits),
            best: Lazy::None,
            top: false,
            vocab,
        }
    }

    /// How many rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Floats per row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Row `i`'s greedy token, its logit and the row's log-normaliser, where the device reduced the rows
    /// (a GPU); `None` elsewhere (read the row), or when every value of the row is NaN.
    pub fn best(&mut self, i: usize) -> Option<BestLogit> {
        assert!(i < self.rows, "logits row {i} of {}", self.rows);
        let f = Device::BEST_FLOATS;
        let b = &self.best.get()?[i * f..(i + 1) * f];
        (b[0] >= 0.0).then(|| BestLogit {
            token: b[0] as u32,
            logit: b[1],
            lse: b[2],
        })
    }

    /// Row `i`'s top-k sampling candidates, where the device found them (a GPU, when the pass's batch asked:
    /// read back with the rows' best); `None` elsewhere (read the row).
    pub fn candidates(&mut self, i: usize) -> Option<Candidates<'_>> {
        assert!(i < self.rows, "logits row {i} of {}", self.rows);
        if !self.top {
            return None;
        }
        let (rows, f) = (self.rows, Device::TOP_FLOATS);
        let at = rows * Device::BEST_FLOATS + i * f;
        Some(Candidates(&self.best.get()?[at..at + f]))
    }

    /// Row `i` (every row is read back on the first call).
    pub fn row(&mut self, i: usize) -> &mut [f32] {
        let v = self.vocab;
        &mut self.all()[i * v..(i + 1) * v]
    }

    /// Every row (read back on the first call).
    pub fn all(&mut self) -> &mut [f32] {
        self.all.get().unwrap_or_default()
    }

    /// Every row, for as long as the scratch they are in.
    pub fn into_all(mut self) -> &'s mut [f32] {
        self.all.get();
        match self.all {
            Lazy::Read(v) => v,
            _ => &mut [],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Host rows: no reduction (the caller reads the rows), the rows as given.
    #[test]
    fn host_rows_are_read_where_they_are() {
        let mut v: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let mut r = LogitRows::host(&mut v, 4);
        assert_eq!((r.rows(), r.vocab()), (3, 4));
        assert_eq!(r.best(1), None);
        assert_eq!(r.row(2), &[8.0, 9.0, 10.0, 11.0]);
        r.row(0)[0] = 5.0;
        assert_eq!(r.into_all()[0], 5.0);
    }
}
