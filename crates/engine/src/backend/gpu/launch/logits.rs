//! Launches of the reductions over logits rows: the k best of each row ([`topk_rows`]), each row's
//! greedy token with its log-normaliser ([`row_best`]), and each row's top-k sampling candidates
//! ([`row_top`]).

use super::*;

/// The most candidates [`topk_rows`] keeps per row.
pub const TOPK_MAX: usize = 8;

/// The `k` largest of each of `rows` rows of `vocab` logits: `idx` (i32) and `val` (f32), `rows × k`,
/// best first, the lower index first among equals, NaN never chosen (index -1 pads a short row).
pub fn topk_rows(
    l: &dyn Launcher,
    logits: DevPtr,
    rows: usize,
    vocab: usize,
    k: usize,
    idx: DevPtr,
    val: DevPtr,
) -> Result<(), DeviceError> {
    if k == 0 || k > TOPK_MAX {
        return Err(unsupported(format!(
            "the top {k} of a row (1 to {TOPK_MAX})"
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let shape = Shape::line(rows, 256)?;
    let args = [
        Arg::Ptr(logits),
        Arg::I32(int(vocab, "a vocabulary")?),
        Arg::I32(k as i32),
        Arg::Ptr(idx),
        Arg::Ptr(val),
    ];
    l.launch(&thorn_kernels::LOGITS, "topk_rows", shape, &args)
}

/// Floats [`row_best`] writes per row: the greedy token's index, its logit, the row's log-normaliser.
pub const ROW_BEST_FLOATS: usize = 3;

/// Each of `rows` rows of `vocab` logits at `logits`: the index of its largest value (the lower index
/// among equals, NaN never chosen, -1 when every value is NaN) as a float, that value, and
/// `ln(sum(exp(x)))` over the row, [`ROW_BEST_FLOATS`] floats per row at `out`.
pub fn row_best(
    l: &dyn Launcher,
    logits: DevPtr,
    rows: usize,
    vocab: usize,
    out: DevPtr,
) -> Result<(), DeviceError> {
    if vocab >= 1 << 24 {
        return Err(unsupported(format!(
            "a vocabulary of {vocab} (token ids are read back as floats, exact below 2^24)"
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let shape = Shape::line(rows, 256)?;
    let args = [
        Arg::Ptr(logits),
        Arg::I32(int(vocab, "a vocabulary")?),
        Arg::Ptr(out),
    ];
    l.launch(&thorn_kernels::LOGITS, "row_best", shape, &args)
}

/// The most candidates [`row_top`] finds per row (`TOP_CANDIDATES` in logits.cu): the largest top-k the
/// sampler draws from device candidates.
pub const TOP_CANDIDATES: usize = 64;

/// Floats [`row_top`] writes per row: the count, then that many (index, value) pairs.
pub const TOP_FLOATS: usize = 1 + 2 * TOP_CANDIDATES;

/// Each of `rows` rows of `vocab` logits at `logits`: its `k` largest finite values (fewer when it has
/// fewer), the lower index first among equals, as sampling candidates: [`TOP_FLOATS`] floats per row at
/// `out`, the count then (index as a float, value) pairs in no particular order.
pub fn row_top(
    l: &dyn Launcher,
    logits: DevPtr,
    rows: usize,
    vocab: usize,
    k: usize,
    out: DevPtr,
) -> Result<(), DeviceError> {
    if k == 0 || k > TOP_CANDIDATES || vocab >= 1 << 24 {
        return Err(unsupported(format!(
            "the top {k} of rows of {vocab} (1 to {TOP_CANDIDATES}, below 2^24)"
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let shape = Shape::line(rows, 256)?;
    let args = [
        Arg::Ptr(logits),
        Arg::I32(int(vocab, "a vocabulary")?),
        Arg::I32(k as i32),
        Arg::Ptr(out),
    ];
    l.launch(&thorn_kernels::LOGITS, "row_top", shape, &args)
}
