//! The GPU device's reductions over logits rows, so that a step's result leaves the GPU as a few numbers.

use super::{GpuDevice, launch};
use crate::backend::buf::{View, ViewMut};

impl GpuDevice {
    /// Each of `rows` rows of `vocab` logits: its greedy token (as a float), that logit and its
    /// log-normaliser, [`launch::ROW_BEST_FLOATS`] floats per row into `out`.
    pub fn row_best(&self, logits: View<'_>, rows: usize, vocab: usize, out: ViewMut<'_>) {
        assert!(
            logits.len() >= rows * vocab && out.len() >= rows * launch::ROW_BEST_FLOATS,
            "row_best sizes"
        );
        let (lp, op) = (logits.ptr(), out.ptr());
        self.run("the logits' best", |l| {
            launch::row_best(l, lp, rows, vocab, op)
        });
    }

    /// Each row's top-k sampling candidates (see [`launch::row_top`]): [`launch::TOP_FLOATS`] floats a row.
    pub fn row_top(&self, logits: View<'_>, rows: usize, vocab: usize, out: ViewMut<'_>) {
        assert!(
            logits.len() >= rows * vocab && out.len() >= rows * launch::TOP_FLOATS,
            "row_top sizes"
        );
        let (lp, op) = (logits.ptr(), out.ptr());
        self.run("the logits' top candidates", |l| {
            launch::row_top(l, lp, rows, vocab, launch::TOP_CANDIDATES, op)
        });
    }
}
