//! Weights repacked at load for the matrix-vector kernels' aligned loads ([`Layout::Packed`]).
//!
//! A GGUF Q4_1 block is 20 bytes (d and m as f16, then 16 bytes of nibbles), so its nibbles are never
//! 16-byte aligned and a row takes several dependent loads. Packed, a row of `nb` blocks is the `nb` blocks'
//! 16 bytes of nibbles (block `b`'s at `16 b`, laid out as in GGUF), then their `nb` `(d, m)` pairs, padded
//! to a multiple of 16 bytes: every block is one 16-byte load and one 4-byte load (`matvec_q4_1p`). Rows
//! stay whole and in order, so stacking matrices (fused QKV, gate/up) is still copying their bytes.

/// How a matrix's rows are laid out in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// As the GGUF file stores them.
    #[default]
    Gguf,
    /// Q4_1 rows repacked for aligned loads (see the module docs and [`repack_q4_1`]).
    Packed,
}

/// Bytes of a packed Q4_1 row of `cols` weights (whole blocks of 32).
pub fn packed_row_bytes(cols: usize) -> usize {
    let nb = cols / 32;
    16 * nb + (4 * nb).next_multiple_of(16)
}

/// `rows` GGUF Q4_1 rows of `cols` weights, packed (see [`Layout::Packed`]); `None` when `data` is not
/// that many whole rows.
pub fn repack_q4_1(data: &[u8], rows: usize, cols: usize) -> Option<Vec<u8>> {
    let nb = cols / 32;
    if !cols.is_multiple_of(32) || data.len() != rows * nb * 20 {
        return None;
    }
    let rb = packed_row_bytes(cols);
    let mut out = vec![0u8; rows * rb];
    for (src, dst) in data.chunks_exact(nb * 20).zip(out.chunks_exact_mut(rb)) {
        let (qs, dm) = dst.split_at_mut(16 * nb);
        for (b, blk) in src.chunks_exact(20).enumerate() {
            qs[16 * b..16 * (b + 1)].copy_from_slice(&blk[4..]);
            dm[4 * b..4 * (b + 1)].copy_from_slice(&blk[..4]);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;
    use crate::testutil::quantize_rows;

    #[test]
    fn a_packed_row_holds_the_same_blocks_aligned() {
        let (rows, cols) = (3, 576);
        let data = quantize_rows(GgmlType::Q4_1, rows, cols, 9);
        let p = repack_q4_1(&data, rows, cols).unwrap();
        let rb = packed_row_bytes(cols);
        assert_eq!(
            (rb, rb % 16),
            (368, 0),
            "18 blocks: 288 bytes of nibbles, 72 of scales padded to 80"
        );
        for r in 0..rows {
            for b in 0..cols / 32 {
                let blk = &data[(r * 18 + b) * 20..][..20];
                assert_eq!(&p[r * rb + 16 * b..][..16], &blk[4..]);
                assert_eq!(&p[r * rb + 288 + 4 * b..][..4], &blk[..4]);
            }
        }
        assert_eq!(repack_q4_1(&data[1..], rows, cols), None);
        assert_eq!(repack_q4_1(&data, rows, 100), None);
    }
}
