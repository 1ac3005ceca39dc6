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
//! Weights are stored in *groups* of [`GROUP`] rows, block by block: a group block holds 16 rows × 32 inputs
//! arranged so that one 32-bit lane is one row's four consecutive integers, which is what `vpdpbusd`
//! (and `pmaddubsw`) multiply by four activation bytes broadcast to every lane. A kernel therefore computes
//! 16 rows of one token per instruction, reuses each unpacked weight vector for every token of a tile, and
//! never reduces across lanes: every output's arithmetic is the same exact integer block sum followed by
//! two fused multiply-adds per block, in block order, whatever the ISA, the tile or the rows beside it.
//! See [`QMatrix`] for the bytes.

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

/// Rows per weight group: one per 32-bit lane of a 512-bit vector.
pub const GROUP: usize = 16;

/// A weight matrix prepared for the CPU kernels. `rows` outputs, `cols` inputs.
///
/// Affine layouts are `rows.div_ceil(16)` groups of 16 rows (the last padded with zero rows), each a run of
/// `blocks` *group blocks* (16 rows × 32 inputs) of `block_bytes`, so a kernel reads one forward stream per
/// group. In a group block, byte `4i + c` of 64-byte vector `v` belongs to row `i`:
/// * nibble: 4 vectors; the low nibble is element `4v + c`, the high nibble element `16 + 4v + c`; then
///   the 16 rows' `d` and the 16 rows' `m` (f16, or f32 when `f32_scales`) — 320 bytes per 16 × 32 weights
///   with f16 scales, the 20 bytes per 32 of Q4_1 in GGUF;
/// * byte: 8 vectors of `q + 128`, vector `v` holding elements `4v + c`; then the 16 `d` (f16; `m = -128 d`
///   is implied) — 544 bytes, the 34 per 32 of Q8_0.
///
/// Scales are f16 when the source type's scales are (Q4_0, Q4_1, Q8_0: exact), f32 when they are products
/// (Q4_K's `d * sc`).
#[derive(Debug)]
pub struct QMatrix {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Storage layout.
    pub layout: Layout,
    /// Blocks of 32 inputs per row.
    pub blocks: usize,
    /// Bytes per group block.
    pub block_bytes: usize,
    /// Whether the scales are stored as f32 (else f16).
    pub f32_scales: bool,
    /// `rows.div_ceil(GROUP) * blocks` group blocks, group by group.
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
        let layout = if ty == GgmlType::Q8_0 {
            Layout::Byte
        } else {
            Layout::Nibble
        };
        let mut m = QMatrix::zeros(ty, layout, ty == GgmlType::Q4_K, rows, cols);
        let mut u = [0u8; QK];
        for r in 0..rows {
            let src = &data[r * row_bytes..(r + 1) * row_bytes];
            for b in 0..m.blocks {
                let (d, mn) = affine_block(ty, src, b, &mut u);
                m.put(r, b, &u, d, mn);
            }
        }
        Ok(m)
    }

    /// An affine matrix of zero blocks (`d = m = 0`), to be filled by [`QMatrix::put`].
    fn zeros(source: GgmlType, layout: Layout, f32_scales: bool, rows: usize, cols: usize) -> Self {
        let block_bytes = match (layout, f32_scales) {
            (Layout::Byte, _) => 544,
            (_, false) => 320,
            (_, true) => 384,
        };
        let blocks = cols / QK;
        QMatrix {
            rows,
            cols,
            layout,
            blocks,
            block_bytes,
            f32_scales,
            data: vec![0; rows.div_ceil(GROUP) * blocks * block_bytes],
            f: vec![],
            source,
        }
    }

    /// Where row `r`'s block `b` lives: its group block and its lane.
    #[inline]
    fn at(&self, r: usize, b: usize) -> (usize, usize) {
        ((r / GROUP * self.blocks + b) * self.block_bytes, r % GROUP)
    }

    /// Byte offset of the 16 `d` scales in a group block (the `m` follow them, for nibbles).
    #[inline]
    fn scales_at(&self) -> usize {
        match self.layout {
            Layout::Byte => 512,
            _ => 256,
        }
    }

    /// Writes row `r`'s block `b`: its 32 integers and `(d, m)` (`m` is implied for bytes).
    fn put(&mut self, r: usize, b: usize, u: &[u8; QK], d: f32, m: f32) {
        let (at, i) = self.at(r, b);
        let (layout, f32s, sc) = (self.layout, self.f32_scales, self.scales_at());
        let rec = &mut self.data[at..at + self.block_bytes];
        match layout {
            Layout::Byte => {
                for (j, &v) in u.iter().enumerate() {
                    rec[64 * (j / 4) + 4 * i + j % 4] = v;
                }
            }
            _ => {
                for j in 0..16 {
                    rec[64 * (j / 4) + 4 * i + j % 4] = u[j] | (u[16 + j] << 4);
                }
            }
        }
        if f32s {
            rec[sc + 4 * i..sc + 4 * i + 4].copy_from_slice(&d.to_le_bytes());
            rec[sc + 64 + 4 * i..sc + 68 + 4 * i].copy_from_slice(&m.to_le_bytes());
        } else {
            let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
            rec[sc + 2 * i..sc + 2 * i + 2].copy_from_slice(&h(d));
            if layout != Layout::Byte {
                rec[sc + 32 + 2 * i..sc + 34 + 2 * i].copy_from_slice(&h(m));
            }
        }
    }

    /// A matrix of plain f32 rows (`f` is `rows × cols`, row-major).
    pub fn from_f32(rows: usize, cols: usize, f: Vec<f32>) -> Self {
        assert_eq!(f.len(), rows * cols, "f32 matrix of the wrong size");
        QMatrix {
            rows,
            cols,
            layout: Layout::F32,
            blocks: 0,
            block_bytes: 0,
            f32_scales: false,
            data: vec![],
            f,
            source: GgmlType::F32,
        }
    }

    /// Concatenates matrices with the same input size and layout along the output dimension (fused QKV).
    /// Parts whose rows fill whole groups are joined as they are; otherwise the rows are regrouped.
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
        let rows = parts.iter().map(|p| p.rows).sum();
        if first.layout == Layout::F32 {
            let f = parts.iter().flat_map(|p| p.f.iter().copied()).collect();
            return Some(QMatrix {
                source: first.source,
                ..QMatrix::from_f32(rows, first.cols, f)
            });
        }
        let n = parts.len();
        if parts[..n - 1].iter().all(|p| p.rows.is_multiple_of(GROUP)) {
            return Some(QMatrix {
                rows,
                data: parts.iter().flat_map(|p| p.data.iter().copied()).collect(),
                ..QMatrix::zeros(first.source, first.layout, first.f32_scales, 0, first.cols)
            });
        }
        let mut out = QMatrix::zeros(
            first.source,
            first.layout,
            first.f32_scales,
            rows,
            first.cols,
        );
        let mut r0 = 0;
        let mut u = [0u8; QK];
        for p in parts {
            for r in 0..p.rows {
                for b in 0..p.blocks {
                    for (j, v) in u.iter_mut().enumerate() {
                        *v = p.u(r, b, j);
                    }
                    let (d, m) = p.dm(r, b);
                    out.put(r0 + r, b, &u, d, m);
                }
            }
            r0 += p.rows;
        }
        Some(out)
    }

    /// `(d, m)` of block `b` in row `r`.
    #[inline]
    pub fn dm(&self, r: usize, b: usize) -> (f32, f32) {
        let (at, i) = self.at(r, b);
        let rec = &self.data[at..at + self.block_bytes];
        let sc = self.scales_at();
        let h = |o: usize| half::f16::from_le_bytes([rec[o], rec[o + 1]]).to_f32();
        let f = |o: usize| f32::from_le_bytes([rec[o], rec[o + 1], rec[o + 2], rec[o + 3]]);
        match (self.layout, self.f32_scales) {
            (Layout::Byte, _) => {
                let d = h(sc + 2 * i);
                (d, -128.0 * d)
            }
            (_, true) => (f(sc + 4 * i), f(sc + 64 + 4 * i)),
            (_, false) => (h(sc + 2 * i), h(sc + 32 + 2 * i)),
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
        let (at, i) = self.at(r, b);
        let rec = &self.data[at..at + self.block_bytes];
        match self.layout {
            Layout::Byte => rec[64 * (j / 4) + 4 * i + j % 4],
            _ => {
                let k = j % 16;
                let v = rec[64 * (k / 4) + 4 * i + k % 4];
                if j < 16 { v & 0xF } else { v >> 4 }
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
}

/// `out[t * rows + r] = Σ_c W[r, c] * x[t, c]` for rows `rows`, scalar reference over quantized activations.
///
/// Integer block sums are exact; the float combination is two fused multiply-adds per block in block order,
/// `acc = isum * (d*dx) + acc`, then `acc = m * sx + acc`: exactly what every SIMD kernel does, so they
/// equal this bit for bit.
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
                        acc = (isum as f32).mul_add(d * dx, acc);
                        acc = m.mul_add(sx, acc);
                    }
                    acc
                }
            };
        }
    }
}
