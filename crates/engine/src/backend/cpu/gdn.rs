//! Gated DeltaNet kernels over a run of tokens of one sequence: the causal convolution with its window, the
//! q/k normalisation and gates, and the delta-rule recurrence in two forms.
//!
//! * [`recurrence`]: token by token, `S ← S·e^g; δ = (v − Sᵀk)·β; S ← S + k δᵀ; o = Sᵀq` per value head.
//!   It is what decode runs, it can keep the state after every token (speculative verification), and its
//!   result for a token does not depend on how the run was split: a prefix served from a state snapshot
//!   continues bit for bit like a full prefill, which is what makes greedy output identical with and
//!   without the prefix cache. On CPU it is also the cheaper form (4·dk·dv flops per token and head against
//!   the chunked form's ~5.7·dk·dv at dk = dv = 128 and chunks of 64), so the engine prefills with it.
//! * [`chunked`]: the chunked (WY) form of the same recurrence (Yang et al., Gated DeltaNet; the form of
//!   `chunk_gated_delta_rule`): within a chunk of `C` tokens the interactions are `C×C` matrix products and
//!   the state is read and written once per chunk. This is the prefill form for matrix engines (the CUDA
//!   backend); on CPU it is the oracle-tested alternative, agreeing with [`recurrence`] to float rounding.
//!
//! Layouts: the state of one value head is `[dk][dv]` (row `i` is key dim `i`), heads after each other; the
//! window is `[channel][kernel − 1]`, oldest first; per token the convolution input/output is `[q | k | v]`
//! (`kh·dk`, `kh·dk`, `vh·dv`), value head `h` reading key head `h % kh`.

/// The shape of a DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Key (and query) heads.
    pub kh: usize,
    /// Value heads.
    pub vh: usize,
    /// Key head width.
    pub dk: usize,
    /// Value head width.
    pub dv: usize,
    /// Convolution taps.
    pub kernel: usize,
}

impl Shape {
    /// Convolution channels.
    pub fn conv_dim(&self) -> usize {
        2 * self.kh * self.dk + self.vh * self.dv
    }

    /// Floats of the recurrent matrices.
    pub fn matrix_floats(&self) -> usize {
        self.vh * self.dk * self.dv
    }

    /// Floats of the state (matrices, then the window).
    pub fn floats(&self) -> usize {
        self.matrix_floats() + self.conv_dim() * (self.kernel - 1)
    }
}

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// Most convolution taps the kernels handle (the loader rejects larger).
pub const MAX_KERNEL: usize = 8;
/// Widest value head the kernels handle (the loader rejects wider).
pub const MAX_HEAD: usize = 512;

/// Where to keep the state after each of the last `count` tokens of a run: step `j` of a part of the state
/// goes to `buf[j * stride + offset..]`.
#[derive(Debug)]
pub struct Steps<'a> {
    /// The steps of the whole recurrent state.
    pub buf: &'a mut [f32],
    /// Floats per step.
    pub stride: usize,
    /// Where this part (a head's matrix, a layer's window) sits in a step.
    pub offset: usize,
    /// Steps kept (the last tokens of the run).
    pub count: usize,
}

impl Steps<'_> {
    fn slot(&mut self, j: usize, len: usize) -> &mut [f32] {
        let o = j * self.stride + self.offset;
        &mut self.buf[o..o + len]
    }
}

/// Causal depthwise convolution of `n` tokens' inputs `x` (`n × conv_dim`) over `window` and themselves,
/// then SiLU, into `y`. The window then holds the last inputs. With `steps`, the window after each of the
/// last `steps.count` tokens is kept there too.
pub fn conv(
    s: &Shape,
    taps: &[f32],
    window: &mut [f32],
    x: &[f32],
    n: usize,
    y: &mut [f32],
    steps: Option<&mut Steps<'_>>,
) {
    let cd = s.conv_dim();
    let w = s.kernel - 1;
    // Input `j` of the run extended backwards by the window: index `j < w` is the window.
    let input = |window: &[f32], ch: usize, j: usize| -> f32 {
        if j < w {
            window[ch * w + j]
        } else {
            x[(j - w) * cd + ch]
        }
    };
    for t in 0..n {
        for ch in 0..cd {
            let tp = &taps[ch * s.kernel..(ch + 1) * s.kernel];
            let mut acc = 0.0;
            for (j, &tap) in tp.iter().enumerate() {
                acc += tap * input(window, ch, t + j);
            }
            y[t * cd + ch] = silu(acc);
        }
    }
    if let Some(st) = steps {
        let first_step = n - st.count;
        for i in 0..st.count {
            let t = first_step + i;
            let dst = st.slot(i, cd * w);
            for ch in 0..cd {
                for j in 0..w {
                    dst[ch * w + j] = input(window, ch, t + 1 + j);
                }
            }
        }
    }
    let mut last = [0f32; MAX_KERNEL];
    for ch in 0..cd {
        for (j, l) in last[..w].iter_mut().enumerate() {
            *l = input(window, ch, n + j);
        }
        window[ch * w..(ch + 1) * w].copy_from_slice(&last[..w]);
    }
}

/// L2-normalises every q and k head of `n` convolution outputs and scales q by `1/sqrt(dk)`.
pub fn normalize_qk(s: &Shape, y: &mut [f32], n: usize) {
    let cd = s.conv_dim();
    let qs = 1.0 / (s.dk as f32).sqrt();
    for t in 0..n {
        let row = &mut y[t * cd..t * cd + 2 * s.kh * s.dk];
        for (i, head) in row.chunks_mut(s.dk).enumerate() {
            let inv = 1.0 / (head.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
            let scale = if i < s.kh { inv * qs } else { inv };
            head.iter_mut().for_each(|v| *v *= scale);
        }
    }
}

/// The per-token, per-value-head gates from the projections: `beta = σ(b)` and the log decay
/// `g = a · softplus(alpha + dt_bias)` (in place: `alpha` becomes `g`, `b` becomes `beta`).
pub fn gates(a: &[f32], dt_bias: &[f32], alpha: &mut [f32], b: &mut [f32]) {
    let vh = a.len();
    for (al, bt) in alpha.chunks_mut(vh).zip(b.chunks_mut(vh)) {
        for h in 0..vh {
            al[h] = a[h] * softplus(al[h] + dt_bias[h]);
            bt[h] = sigmoid(bt[h]);
        }
    }
}

/// The inputs of one run for one value head.
pub struct HeadRun<'a> {
    /// Convolution outputs, `n × conv_dim` (q and k normalised).
    pub y: &'a [f32],
    /// Log decay per token and value head (`n × vh`).
    pub g: &'a [f32],
    /// β per token and value head (`n × vh`).
    pub beta: &'a [f32],
    /// Tokens.
    pub n: usize,
    /// The value head.
    pub head: usize,
}

impl HeadRun<'_> {
    #[inline]
    fn q(&self, s: &Shape, t: usize) -> &[f32] {
        let k = self.head % s.kh;
        let o = t * s.conv_dim() + k * s.dk;
        &self.y[o..o + s.dk]
    }

    #[inline]
    fn k(&self, s: &Shape, t: usize) -> &[f32] {
        let k = self.head % s.kh;
        let o = t * s.conv_dim() + (s.kh + k) * s.dk;
        &self.y[o..o + s.dk]
    }

    #[inline]
    fn v(&self, s: &Shape, t: usize) -> &[f32] {
        let o = t * s.conv_dim() + 2 * s.kh * s.dk + self.head * s.dv;
        &self.y[o..o + s.dv]
    }

    #[inline]
    fn gate(&self, s: &Shape, t: usize) -> (f32, f32) {
        (
            self.g[t * s.vh + self.head],
            self.beta[t * s.vh + self.head],
        )
    }
}

/// The recurrence for one value head over a run, token by token: `state` is the head's `[dk][dv]` matrix,
/// `o` receives `Sᵀq` per token (row stride `vh·dv`, this head's columns). With `steps`, the matrix after
/// each of the last `steps.count` tokens is kept there too.
pub fn recurrence(
    s: &Shape,
    r: &HeadRun<'_>,
    state: &mut [f32],
    o: &mut [f32],
    mut steps: Option<&mut Steps<'_>>,
) {
    let (dk, dv) = (s.dk, s.dv);
    let first_step = r.n - steps.as_ref().map_or(0, |st| st.count);
    let mut buf = [0f32; MAX_HEAD];
    let delta = &mut buf[..dv];
    for t in 0..r.n {
        let (g, beta) = r.gate(s, t);
        let (q, k, v) = (r.q(s, t), r.k(s, t), r.v(s, t));
        let decay = g.exp();
        state.iter_mut().for_each(|x| *x *= decay);
        delta.copy_from_slice(v);
        for (i, &ki) in k.iter().enumerate() {
            for (d, &sv) in delta.iter_mut().zip(&state[i * dv..(i + 1) * dv]) {
                *d -= sv * ki;
            }
        }
        delta.iter_mut().for_each(|d| *d *= beta);
        let out = &mut o[(t * s.vh + r.head) * dv..(t * s.vh + r.head + 1) * dv];
        out.fill(0.0);
        for i in 0..dk {
            let row = &mut state[i * dv..(i + 1) * dv];
            let (ki, qi) = (k[i], q[i]);
            for ((sv, &d), ov) in row.iter_mut().zip(delta.iter()).zip(out.iter_mut()) {
                *sv += ki * d;
                *ov += *sv * qi;
            }
        }
        if let Some(st) = steps.as_mut().filter(|_| t >= first_step) {
            st.slot(t - first_step, state.len()).copy_from_slice(state);
        }
    }
}

/// Tokens per chunk of [`chunked`].
pub const CHUNK: usize = 64;

/// The same recurrence as [`recurrence`] in chunked (WY) form, chunks of [`CHUNK`] tokens.
pub fn chunked(s: &Shape, r: &HeadRun<'_>, state: &mut [f32], o: &mut [f32]) {
    let (dk, dv) = (s.dk, s.dv);
    let c = CHUNK.min(r.n.max(1));
    let mut gc = vec![0f32; c];
    let mut a = vec![0f32; c * c];
    let mut u = vec![0f32; c * dv];
    let mut w = vec![0f32; c * dk];
    let mut vnew = vec![0f32; c * dv];
    let mut t0 = 0;
    while t0 < r.n {
        let m = c.min(r.n - t0);
        // Cumulative log decay within the chunk.
        let mut acc = 0.0;
        for (i, g) in gc.iter_mut().enumerate().take(m) {
            acc += r.gate(s, t0 + i).0;
            *g = acc;
        }
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>();
        // A = -(β_i k_i·k_j e^{gc_i − gc_j}) strictly below the diagonal, then T = (I − A')⁻¹ by forward
        // substitution, row by row.
        a[..m * c].fill(0.0);
        for i in 0..m {
            let (_, bi) = r.gate(s, t0 + i);
            let ki = r.k(s, t0 + i);
            for j in 0..i {
                a[i * c + j] = -bi * dot(ki, r.k(s, t0 + j)) * (gc[i] - gc[j]).exp();
            }
        }
        for i in 1..m {
            for j in 0..i {
                let mut sum = a[i * c + j];
                for q in j + 1..i {
                    sum += a[i * c + q] * a[q * c + j];
                }
                a[i * c + j] = sum;
            }
        }
        for i in 0..m {
            a[i * c + i] = 1.0;
        }
        // U = T (β v), W = T (β k e^{gc}).
        u[..m * dv].fill(0.0);
        w[..m * dk].fill(0.0);
        for i in 0..m {
            for j in 0..=i {
                let tij = a[i * c + j];
                if tij == 0.0 {
                    continue;
                }
                let (_, bj) = r.gate(s, t0 + j);
                let f = tij * bj;
                for (uu, &vv) in u[i * dv..(i + 1) * dv].iter_mut().zip(r.v(s, t0 + j)) {
                    *uu += f * vv;
                }
                let fk = f * gc[j].exp();
                for (ww, &kk) in w[i * dk..(i + 1) * dk].iter_mut().zip(r.k(s, t0 + j)) {
                    *ww += fk * kk;
                }
            }
        }
        // v_new = U − W S; o = (q e^{gc}) S + Σ_{j≤i} (q_i·k_j) e^{gc_i − gc_j} v_new_j.
        for i in 0..m {
            let vn = &mut vnew[i * dv..(i + 1) * dv];
            vn.copy_from_slice(&u[i * dv..(i + 1) * dv]);
            for (kk, row) in w[i * dk..(i + 1) * dk].iter().zip(state.chunks(dv)) {
                for (x, &sv) in vn.iter_mut().zip(row) {
                    *x -= kk * sv;
                }
            }
        }
        for i in 0..m {
            let t = t0 + i;
            let qi = r.q(s, t);
            let out = &mut o[(t * s.vh + r.head) * dv..(t * s.vh + r.head + 1) * dv];
            out.fill(0.0);
            let e = gc[i].exp();
            for (qq, row) in qi.iter().zip(state.chunks(dv)) {
                let f = qq * e;
                for (x, &sv) in out.iter_mut().zip(row) {
                    *x += f * sv;
                }
            }
            for j in 0..=i {
                let f = dot(qi, r.k(s, t0 + j)) * (gc[i] - gc[j]).exp();
                for (x, &vv) in out.iter_mut().zip(&vnew[j * dv..(j + 1) * dv]) {
                    *x += f * vv;
                }
            }
        }
        // S = S e^{gc_last} + Σ_j (k_j e^{gc_last − gc_j}) v_newᵀ_j.
        let last = gc[m - 1];
        let el = last.exp();
        state.iter_mut().for_each(|x| *x *= el);
        for j in 0..m {
            let f = (last - gc[j]).exp();
            let vn = &vnew[j * dv..(j + 1) * dv];
            for (kk, row) in r.k(s, t0 + j).iter().zip(state.chunks_mut(dv)) {
                let fk = f * kk;
                for (x, &vv) in row.iter_mut().zip(vn) {
                    *x += fk * vv;
                }
            }
        }
        t0 += m;
    }
}

/// The gated RMSNorm of each value head's output: `o / rms(o) · w · silu(z)`, in place (`n × vh·dv`).
pub fn gated_norm(s: &Shape, o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    for (oh, zh) in o.chunks_mut(s.dv).zip(z.chunks(s.dv)) {
        let ms = oh.iter().map(|v| v * v).sum::<f32>() / s.dv as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((x, &g), &zz) in oh.iter_mut().zip(w).zip(zh) {
            *x = *x * inv * g * silu(zz);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random numbers in [-1, 1).
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        crate::testutil::noise(seed, n, 1.0)
    }

    fn run(s: &Shape, n: usize, chunk: bool, split: usize) -> (Vec<f32>, Vec<f32>) {
        let cd = s.conv_dim();
        let mut y = noise(1, n * cd);
        normalize_qk(s, &mut y, n);
        let mut g = noise(2, n * s.vh);
        let mut beta = noise(3, n * s.vh);
        gates(
            &[-0.5, -1.0, -2.0, -0.1],
            &[0.1, -0.2, 0.3, 0.0],
            &mut g,
            &mut beta,
        );
        let mut state = noise(4, s.matrix_floats());
        let mut o = vec![0f32; n * s.vh * s.dv];
        // Run the tokens in two pieces: [0, split) and [split, n).
        for (from, to) in [(0, split), (split, n)] {
            if from == to {
                continue;
            }
            for h in 0..s.vh {
                let r = HeadRun {
                    y: &y[from * cd..to * cd],
                    g: &g[from * s.vh..to * s.vh],
                    beta: &beta[from * s.vh..to * s.vh],
                    n: to - from,
                    head: h,
                };
                let st = &mut state[h * s.dk * s.dv..(h + 1) * s.dk * s.dv];
                let out = &mut o[from * s.vh * s.dv..to * s.vh * s.dv];
                if chunk {
                    chunked(s, &r, st, out);
                } else {
                    recurrence(s, &r, st, out, None);
                }
            }
        }
        (o, state)
    }

    const SHAPE: Shape = Shape {
        kh: 2,
        vh: 4,
        dk: 16,
        dv: 8,
        kernel: 4,
    };

    #[test]
    fn chunked_form_matches_the_recurrence() {
        // 150 tokens: two full chunks and a partial one.
        let (o1, s1) = run(&SHAPE, 150, false, 150);
        let (o2, s2) = run(&SHAPE, 150, true, 150);
        let max = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        assert!(max(&o1, &o2) < 1e-4, "outputs differ by {}", max(&o1, &o2));
        assert!(max(&s1, &s2) < 1e-4, "states differ by {}", max(&s1, &s2));
    }

    #[test]
    fn the_recurrence_does_not_depend_on_how_a_run_is_split() {
        let (o1, s1) = run(&SHAPE, 100, false, 100);
        for split in [1, 37, 64, 99] {
            let (o2, s2) = run(&SHAPE, 100, false, split);
            assert_eq!((&o1, &s1), (&o2, &s2), "split at {split}");
        }
    }

    #[test]
    fn conv_window_and_steps_follow_the_inputs() {
        let s = Shape {
            kh: 1,
            vh: 1,
            dk: 1,
            dv: 1,
            kernel: 3,
        };
        let taps = [1.0, 10.0, 100.0, 2.0, 20.0, 200.0, 3.0, 30.0, 300.0];
        let mut window = vec![0.0; 3 * 2];
        let x: Vec<f32> = (1..=12).map(|v| v as f32 * 0.01).collect();
        let mut y = vec![0.0; 12];
        let mut buf = vec![0.0; 12];
        let mut steps = Steps {
            buf: &mut buf,
            stride: 6,
            offset: 0,
            count: 2,
        };
        conv(&s, &taps, &mut window, &x, 4, &mut y, Some(&mut steps));
        let st = [&buf[..6], &buf[6..]];
        // Channel 0 at token 1: the window's last (zero) input, then tokens 0 and 1.
        let x0 = |t: usize| x[t * 3];
        assert!((y[3] - silu(10.0 * x0(0) + 100.0 * x0(1))).abs() < 1e-6);
        assert!((y[6] - silu(x0(0) + 10.0 * x0(1) + 100.0 * x0(2))).abs() < 1e-6);
        // The window after the run: the last two inputs of each channel, oldest first.
        assert_eq!(&window[..2], &[x0(2), x0(3)]);
        // Steps: after token 2 and after token 3.
        assert_eq!(&st[0][..2], &[x0(1), x0(2)]);
        assert_eq!(&st[1][..2], &[x0(2), x0(3)]);
    }
}
