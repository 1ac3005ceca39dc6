//! Quantized matrix products: weights repacked at load, activations quantized to 8 bits per block of 32.
//!
//! Every supported weight type is an *affine block* format: within a block of 32, `w = d * u + m` with an
//! unsigned integer `u` and two f32 numbers per block. Q4_1 is that directly; Q4_0 is `m = -8d`; Q4_K's
//! sub-blocks are `d*sc` and `-dmin*min`; Q8_0 is stored as `u = q + 128` with `m = -128d`. So two kernels
//! cover them all: [`Layout::Nibble`] (4-bit `u`) and [`Layout::Byte`] (8-bit `u`).
//!
//! Activations are quantized per token and per block of 32 to `x ≈ dx * qx` (`qx` in -127..=127), with
//! `sx = dx * Σqx` kept per block, so a block's dot product is exact integer work plus two multiplies:
//! `Σ w*x ≈ d*dx*Σ(u*qx) + m*sx`. This is the same approximation llama.cpp's CPU path makes (its Q8_1).
//!
//! Nibble packing: for each pair of blocks (64 elements) 32 bytes, where byte `j` holds element `j` in its
//! low nibble and element `32 + j` in its high nibble, so one 256-bit load and two masks give 64 values in
//! order. See [`QMatrix`] for the pair records that carry them with their scales.

use crate::quant::{GgmlType, QuantError, dequantize_ref};

/// Elements per quantization block.
pub const QK: usize = 32;

/// How a prepared matrix stores its integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// 4-bit, two blocks per 32 bytes (see the module docs).
    Nibble,
    /// 8-bit, one block per 32 bytes; `m = -128 d` is implied.
    Byte,
    /// Plain f32 rows (fallback for types without an affine form, e.g. Q6_K, F16).
    F32,
}

/// A weight matrix prepared for the CPU kernels. `rows` outputs, `cols` inputs.
///
/// Each row is a sequence of *pair records*, one per 64 inputs, so a kernel reads one forward stream:
/// * nibble: 32 bytes of packed 4-bit values, then `d0 d1 m0 m1` (f16, or f32 when `f32_scales`) — the same
///   20 bytes per 32 weights as Q4_1 in GGUF when the scales are f16;
/// * byte: 64 bytes of `q + 128`, then `d0 d1` (f16): 34 bytes per 32, as Q8_0.
///
/// Scales are f16 when the source type's scales are (Q4_0, Q4_1, Q8_0: exact), f32 when they are products
/// (Q4_K's `d * sc`). Rows with an odd number of blocks get a zero block (`d = m = 0`).
#[derive(Debug)]
pub struct QMatrix {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Storage layout.
    pub layout: Layout,
    /// Blocks per row as stored (always even).
    pub blocks: usize,
    /// Bytes per pair record.
    pub pair_bytes: usize,
    /// Whether the scales are stored as f32 (else f16).
    pub f32_scales: bool,
    /// `rows * blocks / 2` pair records.
    pub data: Vec<u8>,
    /// Row-major f32 weights (only for [`Layout::F32`]).
    pub f: Vec<f32>,
    /// The source type, for reports.
    pub source: GgmlType,
}

impl QMatrix {
    /// Bytes a matrix-vector product reads.
    pub fn bytes(&self) -> usize {
        self.data.len() + 4 * self.f.len()
    }

    /// Repacks `rows` rows of `cols` elements of type `ty` (GGUF bytes) for the kernels.
    pub fn from_ggml(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Self, QuantError> {
        let row_bytes = ty.row_bytes(cols).ok_or(QuantError::PartialBlock {
            ty,
            n: cols,
            block: ty.block_size(),
        })?;
        if data.len() != rows * row_bytes {
            return Err(QuantError::Length {
                ty,
                n: rows * cols,
                expected: rows * row_bytes,
                got: data.len(),
            });
        }
        let affine = matches!(
            ty,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q8_0
        );
        if !affine || !cols.is_multiple_of(QK) {
            let mut f = vec![0f32; rows * cols];
            for (src, dst) in data.chunks_exact(row_bytes).zip(f.chunks_exact_mut(cols)) {
                dequantize_ref(ty, src, dst)?;
            }
            return Ok(QMatrix {
                source: ty,
                ..QMatrix::from_f32(rows, cols, f)
            });
        }
        let nb = cols / QK;
        let blocks = nb.next_multiple_of(2);
        let layout = if ty == GgmlType::Q8_0 {
            Layout::Byte
        } else {
            Layout::Nibble
        };
        let f32_scales = ty == GgmlType::Q4_K;
        let pair_bytes = match (layout, f32_scales) {
            (Layout::Byte, _) => 68,
            (_, false) => 40,
            (_, true) => 48,
        };
        let pairs = blocks / 2;
        let mut out = vec![0u8; rows * pairs * pair_bytes];
        let mut u = [0u8; QK];
        for r in 0..rows {
            let src = &data[r * row_bytes..(r + 1) * row_bytes];
            for b in 0..nb {
                let (d, m) = affine_block(ty, src, b, &mut u);
                let rec = &mut out[(r * pairs + b / 2) * pair_bytes..][..pair_bytes];
                let half = b & 1;
                match layout {
                    Layout::Byte => {
                        rec[32 * half..32 * half + 32].copy_from_slice(&u);
                        rec[64 + 2 * half..66 + 2 * half]
                            .copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
                    }
                    _ => {
                        let shift = 4 * half;
                        for j in 0..QK {
                            rec[j] |= u[j] << shift;
                        }
                        if f32_scales {
                            rec[32 + 4 * half..36 + 4 * half].copy_from_slice(&d.to_le_bytes());
                            rec[40 + 4 * half..44 + 4 * half].copy_from_slice(&m.to_le_bytes());
                        } else {
                            rec[32 + 2 * half..34 + 2 * half]
                                .copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
                            rec[36 + 2 * half..38 + 2 * half]
                                .copy_from_slice(&half::f16::from_f32(m).to_le_bytes());
                        }
                    }
                }
            }
        }
        Ok(QMatrix {
            rows,
            cols,
            layout,
            blocks,
            pair_bytes,
            f32_scales,
            data: out,
            f: vec![],
            source: ty,
        })
    }

    /// A matrix of plain f32 rows (`f` is `rows × cols`, row-major).
    pub fn from_f32(rows: usize, cols: usize, f: Vec<f32>) -> Self {
        assert_eq!(f.len(), rows * cols, "f32 matrix of the wrong size");
        QMatrix {
            rows,
            cols,
            layout: Layout::F32,
            blocks: 0,
            pair_bytes: 0,
            f32_scales: false,
            data: vec![],
            f,
            source: GgmlType::F32,
        }
    }

    /// Concatenates matrices with the same input size and layout along the output dimension (fused QKV).
    pub fn concat(parts: &[QMatrix]) -> Option<QMatrix> {
        let first = parts.first()?;
        if parts.iter().any(|p| {
            p.cols != first.cols
                || p.layout != first.layout
                || p.blocks != first.blocks
                || p.f32_scales != first.f32_scales
        }) {
            return None;
        }
        Some(QMatrix {
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            layout: first.layout,
            blocks: first.blocks,
            pair_bytes: first.pair_bytes,
            f32_scales: first.f32_scales,
            data: parts.iter().flat_map(|p| p.data.iter().copied()).collect(),
            f: parts.iter().flat_map(|p| p.f.iter().copied()).collect(),
            source: first.source,
        })
    }

    /// The pair record holding block `b` of row `r`.
    #[inline]
    fn record(&self, r: usize, b: usize) -> &[u8] {
        &self.data[(r * self.blocks / 2 + b / 2) * self.pair_bytes..][..self.pair_bytes]
    }

    /// `(d, m)` of block `b` in row `r`.
    #[inline]
    pub fn dm(&self, r: usize, b: usize) -> (f32, f32) {
        let rec = self.record(r, b);
        let half = b & 1;
        let h = |i: usize| half::f16::from_le_bytes([rec[i], rec[i + 1]]).to_f32();
        let f = |i: usize| f32::from_le_bytes([rec[i], rec[i + 1], rec[i + 2], rec[i + 3]]);
        match (self.layout, self.f32_scales) {
            (Layout::Byte, _) => {
                let d = h(64 + 2 * half);
                (d, -128.0 * d)
            }
            (_, true) => (f(32 + 4 * half), f(40 + 4 * half)),
            (_, false) => (h(32 + 2 * half), h(36 + 2 * half)),
        }
    }

    /// Row `r` dequantized (tests).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match self.layout {
            Layout::F32 => out.copy_from_slice(&self.f[r * self.cols..(r + 1) * self.cols]),
            Layout::Byte | Layout::Nibble => {
                for b in 0..self.cols / QK {
                    let (d, m) = self.dm(r, b);
                    for j in 0..QK {
                        out[b * QK + j] = d * f32::from(self.u(r, b, j)) + m;
                    }
                }
            }
        }
    }

    /// The unsigned integer of element `j` of block `b` in row `r`.
    #[inline]
    pub fn u(&self, r: usize, b: usize, j: usize) -> u8 {
        let rec = self.record(r, b);
        match self.layout {
            Layout::Byte => rec[32 * (b & 1) + j],
            _ => {
                if b & 1 == 0 {
                    rec[j] & 0xF
                } else {
                    rec[j] >> 4
                }
            }
        }
    }
}

/// Block `b` of a GGUF row as `(d, m)` and 32 unsigned integers.
fn affine_block(ty: GgmlType, row: &[u8], b: usize, u: &mut [u8; QK]) -> (f32, f32) {
    let h = |i: usize| half::f16::from_bits(u16::from_le_bytes([row[i], row[i + 1]])).to_f32();
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (base, qs_off) = if ty == GgmlType::Q4_0 {
                (b * 18, 2)
            } else {
                (b * 20, 4)
            };
            let qs = &row[base + qs_off..base + qs_off + 16];
            for j in 0..16 {
                u[j] = qs[j] & 0xF;
                u[j + 16] = qs[j] >> 4;
            }
            let d = h(base);
            let m = if ty == GgmlType::Q4_0 {
                -8.0 * d
            } else {
                h(base + 2)
            };
            (d, m)
        }
        GgmlType::Q8_0 => {
            let base = b * 34;
            for j in 0..QK {
                u[j] = (i16::from(row[base + 2 + j] as i8) + 128) as u8;
            }
            let d = h(base);
            (d, -128.0 * d)
        }
        GgmlType::Q4_K => {
            let (sb, sub) = (b / 8, b % 8);
            let base = sb * 144;
            let (d, dmin) = (h(base), h(base + 2));
            let scales = &row[base + 4..base + 16];
            let (sc, mn) = if sub < 4 {
                (scales[sub] & 63, scales[sub + 4] & 63)
            } else {
                (
                    (scales[sub + 4] & 0xF) | ((scales[sub - 4] >> 6) << 4),
                    (scales[sub + 4] >> 4) | ((scales[sub] >> 6) << 4),
                )
            };
            let qs = &row[base + 16 + 32 * (sub / 2)..][..32];
            for j in 0..QK {
                u[j] = if sub % 2 == 0 {
                    qs[j] & 0xF
                } else {
                    qs[j] >> 4
                };
            }
            (d * f32::from(sc), -(dmin * f32::from(mn)))
        }
        _ => unreachable!("only affine types reach affine_block"),
    }
}

/// Activations of `n` tokens quantized to 8 bits per block of 32.
#[derive(Debug, Default, Clone)]
pub struct QActs {
    /// Tokens.
    pub n: usize,
    /// Elements per token (padded up to a multiple of 64 with zeros).
    pub cols: usize,
    /// Blocks per token.
    pub blocks: usize,
    /// `n * cols` quantized values.
    pub q: Vec<i8>,
    /// `n * blocks` scales.
    pub d: Vec<f32>,
    /// `n * blocks` values of `d * Σq`.
    pub s: Vec<f32>,
    /// `n * blocks` integer sums `Σq`.
    pub sum: Vec<i32>,
    /// Per token and pair of blocks: `[d0, d1, s0, s1]` (what the AVX-512 kernel multiplies a weight pair's
    /// `[d0, d1, m0, m1]` by).
    pub rec: Vec<f32>,
}

impl QActs {
    /// Resizes for `n` tokens of `cols` elements (reusing the allocation).
    pub fn reset(&mut self, n: usize, cols: usize) {
        let padded = cols.next_multiple_of(2 * QK);
        self.n = n;
        self.cols = padded;
        self.blocks = padded / QK;
        self.q.clear();
        self.q.resize(n * padded, 0);
        for v in [&mut self.d, &mut self.s] {
            v.clear();
            v.resize(n * self.blocks, 0.0);
        }
        self.sum.clear();
        self.sum.resize(n * self.blocks, 0);
        self.rec.clear();
        self.rec.resize(n * self.blocks * 2, 0.0);
    }

    /// Fills `rec` from `d` and `s`.
    pub fn fill_records(&mut self) {
        for i in 0..self.n * self.blocks / 2 {
            self.rec[4 * i..4 * i + 4].copy_from_slice(&[
                self.d[2 * i],
                self.d[2 * i + 1],
                self.s[2 * i],
                self.s[2 * i + 1],
            ]);
        }
    }
}

/// Quantizes one block of 32 (scalar reference; the SIMD versions must agree bit for bit).
#[inline]
pub fn quantize_block_ref(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (o, &v) in q.iter_mut().zip(x) {
        let r = (v * id).round_ties_even() as i32;
        *o = r as i8;
        sum += r;
    }
    (d, sum)
}

/// Quantizes `n` rows of `cols` floats into `out` (scalar reference).
pub fn quantize_ref(x: &[f32], n: usize, cols: usize, out: &mut QActs) {
    out.reset(n, cols);
    for t in 0..n {
        let row = &x[t * cols..(t + 1) * cols];
        for b in 0..cols / QK {
            let i = t * out.blocks + b;
            let (d, sum) = quantize_block_ref(
                &row[b * QK..(b + 1) * QK],
                &mut out.q[t * out.cols + b * QK..][..QK],
            );
            out.d[i] = d;
            out.sum[i] = sum;
            out.s[i] = d * sum as f32;
        }
    }
    out.fill_records();
}

/// `out[t * rows + r] = Σ_c W[r, c] * x[t, c]` for rows `rows`, scalar reference over quantized activations.
///
/// Integer block sums are exact; the float combination is `Σ_b d*dx*isum + m*sx` in block order.
pub fn matmul_ref(
    w: &QMatrix,
    x: &QActs,
    xf: &[f32],
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    for t in 0..x.n {
        for r in rows.clone() {
            out[t * w.rows + r] = match w.layout {
                Layout::F32 => {
                    let wr = &w.f[r * w.cols..(r + 1) * w.cols];
                    let xr = &xf[t * w.cols..(t + 1) * w.cols];
                    wr.iter().zip(xr).map(|(a, b)| a * b).sum()
                }
                _ => {
                    let mut acc = 0f32;
                    for b in 0..w.cols / QK {
                        let isum: i32 = (0..QK)
                            .map(|j| {
                                i32::from(w.u(r, b, j)) * i32::from(x.q[t * x.cols + b * QK + j])
                            })
                            .sum();
                        let (d, m) = w.dm(r, b);
                        let (dx, sx) = (x.d[t * x.blocks + b], x.s[t * x.blocks + b]);
                        acc += d * dx * isum as f32 + m * sx;
                    }
                    acc
                }
            };
        }
    }
}
