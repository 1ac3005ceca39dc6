//! Turning logits into the next token.
//!
//! Order of operations (llama.cpp's, which OpenAI-style parameters assume): logit bias, then repetition /
//! presence / frequency penalties over the recent history, then (for `logprobs`) the log-softmax of those
//! logits, then either greedy argmax (`temperature <= 0`) or top-k, temperature, top-p, min-p and a draw
//! from a seeded generator. The same seed and inputs always give the same tokens.
//!
//! Nothing here allocates per token: the candidate buffer and the penalty counters live in the [`Sampler`].

pub mod grammar;
pub mod guide;

use crate::backend::HostReduce;
use crate::tokenizer::TokenId;

/// Sampling parameters (OpenAI's names where they exist).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `<= 0` means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recent tokens by this (1 = off).
    pub repetition_penalty: f32,
    /// Subtract this from the logit of every token seen recently (0 = off).
    pub presence_penalty: f32,
    /// Subtract this times the count of each recent token (0 = off).
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub penalty_last_n: usize,
    /// Added to the logits of the given tokens (`-inf` bans a token).
    pub logit_bias: Vec<(TokenId, f32)>,
    /// Random seed; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Return this many most likely alternatives with each token (0 = none).
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            logit_bias: Vec::new(),
            seed: None,
            top_logprobs: 0,
        }
    }
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: TokenId,
    /// Its log-probability under the (biased, penalized) model distribution.
    pub logprob: f32,
    /// The most likely alternatives with their log-probabilities, best first (`top_logprobs` of them).
    pub top: Vec<(TokenId, f32)>,
}

/// A seeded xoshiro256** generator (small, fast, reproducible across platforms).
#[derive(Debug, Clone)]
pub struct Rng([u64; 4]);

impl Rng {
    /// Seeds the state with splitmix64.
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Per-sequence sampling state.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    cand: Vec<(TokenId, f32)>,
    counts: Vec<u32>,
    reduce: HostReduce,
    /// The fast paths' softmax weights (plain temperature sampling: one chunk of the row at a time, and
    /// every chunk's sum; top-p: the whole row).
    weights: Vec<f32>,
    chunk_sums: Vec<f32>,
    /// [`Sampler::pick_from_top`]'s candidates with their logits (`cand` becomes their weights).
    kept: Vec<(TokenId, f32)>,
}

/// How many candidates are sorted before falling back to sorting everything (top-p without top-k).
const PARTIAL_SORT: usize = 1024;

/// The largest top-k found in one pass over the row (larger ones list and partly sort the row).
const SMALL_TOP_K: usize = 64;

/// Logits per chunk of plain temperature sampling (its weights are computed a chunk at a time).
const DRAW_CHUNK: usize = 512;

impl Sampler {
    /// A sampler for a vocabulary of `vocab` tokens.
    pub fn new(params: SamplingParams, vocab: usize) -> Self {
        let seed = params.seed.unwrap_or_else(|| {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0),
            );
            h.finish()
        });
        Sampler {
            params,
            rng: Rng::new(seed),
            cand: Vec::with_capacity(vocab),
            counts: vec![0; vocab],
            reduce: HostReduce::detect(),
            weights: vec![0.0; DRAW_CHUNK],
            chunk_sums: Vec::with_capacity(vocab.div_ceil(DRAW_CHUNK)),
            kept: Vec::with_capacity(SMALL_TOP_K),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (modified in place by bias and penalties). `history` is the
    /// sequence so far (prompt and generated), used by the penalties.
    pub fn sample(&mut self, logits: &mut [f32], history: &[TokenId]) -> Sampled {
        self.process(logits, history);
        self.pick(logits)
    }

    /// Whether picking from unmasked logits and keeping the token if a constraint allows it (else masking and
    /// picking again) draws exactly from the masked distribution: true for greedy, and for plain temperature
    /// sampling (rejection sampling: a draw from `p` conditioned on landing in the allowed set is a draw from
    /// `p` renormalised over it). Top-k/top-p/min-p truncate before the mask would, so they need the mask
    /// first; so do top log-probabilities, which must be reported under the constrained distribution.
    pub fn lazy_mask_is_exact(&self) -> bool {
        let p = &self.params;
        p.top_logprobs == 0
            && (p.temperature <= 0.0 || (p.top_k == 0 && p.top_p >= 1.0 && p.min_p <= 0.0))
    }

    /// Whether a row's greedy token and log-normaliser are all a pick needs: greedy, no logit bias or
    /// penalties, no top log-probabilities (a GPU then reads back three numbers a row, not the row).
    pub fn needs_only_best(&self) -> bool {
        let p = &self.params;
        p.temperature <= 0.0 && p.top_logprobs == 0 && self.unprocessed()
    }

    /// Whether a row's `limit` largest values and its log-normaliser are all a pick needs: top-k sampling
    /// with `top_k` of 1 to `limit` (temperature, top-p and min-p then act on those alone), no logit bias
    /// or penalties, at most `top_k` top log-probabilities (see [`Sampler::pick_from_top`]).
    pub fn draws_from_top(&self, limit: usize) -> bool {
        let p = &self.params;
        p.temperature > 0.0
            && (1..=limit.min(SMALL_TOP_K)).contains(&p.top_k)
            && p.top_logprobs <= p.top_k
            && self.unprocessed()
    }

    /// Whether [`Sampler::process`] leaves the logits as they are (no logit bias, no penalties).
    fn unprocessed(&self) -> bool {
        let p = &self.params;
        let penalize = p.penalty_last_n > 0
            && (p.repetition_penalty != 1.0
                || p.presence_penalty != 0.0
                || p.frequency_penalty != 0.0);
        p.logit_bias.is_empty() && !penalize
    }

    /// The pick [`Sampler::pick`] makes from a row whose largest finite values are `top` (any order, at
    /// least `top_k` of them unless the row has fewer, the lower index first among equals at the cut) and
    /// whose log-normaliser is `lse`, when [`Sampler::draws_from_top`]: the same candidates in the same
    /// order as the row's top-k path finds them, so the same token for the same random state, and its
    /// log-probability and the top ones under the row's normaliser.
    pub fn pick_from_top(
        &mut self,
        top: impl Iterator<Item = (TokenId, f32)>,
        lse: f32,
    ) -> Sampled {
        self.cand.clear();
        self.cand.extend(top.filter(|c| c.1.is_finite()));
        // As the row's top-k path orders them: by logit (-0 equal to +0), the lower id among equals.
        self.cand.sort_unstable_by(|a, b| {
            b.1.partial_cmp(&a.1)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.0.cmp(&b.0))
        });
        self.cand.truncate(self.params.top_k);
        self.kept.clear();
        self.kept.extend_from_slice(&self.cand);
        let n = self.params.top_logprobs.min(self.kept.len());
        let top = self.kept[..n].iter().map(|&(t, l)| (t, l - lse)).collect();
        let k = self.cand.len();
        let token = self.draw_cand(k, k);
        let logit = self
            .kept
            .iter()
            .find(|c| c.0 == token)
            .map_or(f32::NEG_INFINITY, |c| c.1);
        Sampled {
            token,
            logprob: logit - lse,
            top,
        }
    }

    /// Applies logit bias and penalties to `logits` in place (once per step, before [`Sampler::pick`]).
    pub fn process(&mut self, logits: &mut [f32], history: &[TokenId]) {
        let p = &self.params;
        for &(t, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        let penalize =
            p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if penalize && p.penalty_last_n > 0 {
            let recent = &history[history.len().saturating_sub(p.penalty_last_n)..];
            for &t in recent {
                if let Some(c) = self.counts.get_mut(t as usize) {
                    *c += 1;
                }
            }
            for &t in recent {
                let Some(c) = self.counts.get_mut(t as usize) else {
                    continue;
                };
                if *c == 0 {
                    continue; // already applied for this token
                }
                let l = &mut logits[t as usize];
                if p.repetition_penalty != 1.0 {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
                *l -= p.presence_penalty + p.frequency_penalty * *c as f32;
                *c = 0;
            }
        }
    }

    /// Picks a token from processed logits (greedy or a seeded draw), with its log-probability under them.
    pub fn pick(&mut self, logits: &[f32]) -> Sampled {
        let p = &self.params;
        // log-softmax normaliser of the processed logits (for logprobs).
        let lse = self.reduce.logsumexp(logits);

        let token = if p.temperature <= 0.0 {
            self.reduce.argmax(logits).unwrap_or(0) as TokenId
        } else {
            self.draw(logits)
        };
        let top = if self.params.top_logprobs > 0 {
            self.top_n(logits, self.params.top_logprobs, lse)
        } else {
            Vec::new()
        };
        Sampled {
            token,
            logprob: logits[token as usize] - lse,
            top,
        }
    }

    /// Plain temperature sampling (no truncation; the API's default), without building or sorting a
    /// candidate list: the softmax weights `exp((x - max) / t)` are computed a chunk of [`DRAW_CHUNK`] at a
    /// time with the vector exp (each chunk's sum kept), the draw picks the chunk its point falls in and
    /// walks that chunk's weights, computed again the same way. The same distribution as the general path
    /// (to float rounding); a row whose largest value is not finite, or that has no weight, goes there
    /// (`None`).
    fn draw_plain(&mut self, logits: &[f32]) -> Option<TokenId> {
        let (inv_t, ms) = self.scaled_max(logits)?;
        if self.weights.len() < DRAW_CHUNK {
            self.weights.resize(DRAW_CHUNK, 0.0);
        }
        let (reduce, w) = (self.reduce, &mut self.weights);
        let weigh = |c: &[f32], w: &mut [f32]| {
            for (o, &v) in w.iter_mut().zip(c) {
                *o = v * inv_t;
            }
            reduce.exp_sub(&mut w[..c.len()], ms)
        };
        self.chunk_sums.clear();
        let mut total = 0f64;
        for c in logits.chunks(DRAW_CHUNK) {
            let s = weigh(c, w);
            if !s.is_finite() {
                return None;
            }
            self.chunk_sums.push(s);
            total += f64::from(s);
        }
        if total <= 0.0 {
            return None;
        }
        let mut r = self.rng.next_f64() * total;
        // The chunk the point falls in (the last with weight if rounding carries it past the end).
        let last = self.chunk_sums.iter().rposition(|&s| s > 0.0)?;
        let mut at = last;
        for (i, &s) in self.chunk_sums.iter().enumerate() {
            if r < f64::from(s) {
                at = i;
                break;
            }
            r -= f64::from(s);
        }
        let c = &logits[at * DRAW_CHUNK..logits.len().min((at + 1) * DRAW_CHUNK)];
        weigh(c, w);
        let mut pick = None;
        for (j, &wj) in w[..c.len()].iter().enumerate() {
            if wj > 0.0 {
                pick = Some(j);
                r -= f64::from(wj);
                if r < 0.0 {
                    break;
                }
            }
        }
        pick.map(|j| (at * DRAW_CHUNK + j) as TokenId)
    }

    /// Top-p sampling without sorting the row: every softmax weight `exp((x - max) / t)` (at most 1) from
    /// the vector exp, their sums per binary exponent, and from the largest exponent down the first one at
    /// which the mass reaches `top_p` of the total: the nucleus (the smallest set of the most likely tokens
    /// that reaches it) is among the tokens of that exponent or larger, which alone are sorted (by weight,
    /// then id) and cut as the general path cuts its sorted list. `None` (the general path) as
    /// [`Sampler::draw_plain`].
    fn draw_nucleus(&mut self, logits: &[f32]) -> Option<TokenId> {
        let (inv_t, ms) = self.scaled_max(logits)?;
        let w = &mut self.weights;
        w.clear();
        w.extend(logits.iter().map(|&v| v * inv_t));
        let total = self.reduce.exp_sub(w, ms);
        if !(total.is_finite() && total > 0.0) {
            return None;
        }
        // Mass per binary exponent (weights are in [0, 1]: exponents 0..=127), four interleaved
        // histograms so that the adds do not wait on each other.
        let mut hist = [[0f64; 128]; 4];
        for (k, &x) in w.iter().enumerate() {
            hist[k & 3][((x.to_bits() >> 23) & 127) as usize] += f64::from(x);
        }
        let need = f64::from(self.params.top_p) * f64::from(total);
        let mut acc = 0.0;
        let mut floor = 0u32;
        for e in (0..128).rev() {
            acc += hist.iter().map(|h| h[e]).sum::<f64>();
            if acc >= need {
                floor = e as u32;
                break;
            }
        }
        self.cand.clear();
        self.cand.extend(
            w.iter()
                .enumerate()
                .filter(|(_, x)| ((x.to_bits() >> 23) & 127) >= floor && **x > 0.0)
                .map(|(i, &x)| (i as TokenId, x)),
        );
        self.cand.sort_unstable_by(by_logit);
        self.keep_mass(need);
        Some(self.draw_from_cand())
    }

    /// The inverse temperature and the largest logit times it (what the fast paths' weights subtract);
    /// `None` when the largest logit is not finite.
    fn scaled_max(&self, logits: &[f32]) -> Option<(f32, f32)> {
        let inv_t = 1.0 / self.params.temperature;
        let m = self.reduce.max(logits);
        m.is_finite().then_some((inv_t, m * inv_t))
    }

    /// Keeps the shortest prefix of `cand` (sorted, weights) whose mass reaches `need` (all of it if none).
    fn keep_mass(&mut self, need: f64) {
        let mut acc = 0f64;
        let keep = self
            .cand
            .iter()
            .position(|c| {
                acc += f64::from(c.1);
                acc >= need
            })
            .map_or(self.cand.len(), |i| i + 1);
        self.cand.truncate(keep);
    }

    /// A draw from `cand` in proportion to its weights (the last candidate if rounding runs past them).
    fn draw_from_cand(&mut self) -> TokenId {
        let total: f64 = self.cand.iter().map(|c| f64::from(c.1)).sum();
        let mut r = self.rng.next_f64() * total;
        for c in &self.cand {
            r -= f64::from(c.1);
            if r < 0.0 {
                return c.0;
            }
        }
        self.cand.last().map_or(0, |c| c.0)
    }

    /// The `k` largest finite logits of the row into `cand`, sorted as the general path sorts (by logit,
    /// the lower id first among equals), in one pass: once `k` are held, a chunk none of whose values beats
    /// the k-th is skipped with one vectorizable comparison per value.
    fn top_k_into_cand(&mut self, logits: &[f32], k: usize) {
        const CHUNK: usize = 256;
        self.cand.clear();
        let mut kth = f32::NEG_INFINITY;
        for (ci, chunk) in logits.chunks(CHUNK).enumerate() {
            // NaN beats nothing; minus infinity and equals of the k-th never enter once k are held.
            if self.cand.len() == k && !chunk.iter().fold(false, |any, &v| any | (v > kth)) {
                continue;
            }
            for (j, &v) in chunk.iter().enumerate() {
                if !v.is_finite() || (self.cand.len() == k && v <= kth) {
                    continue;
                }
                // After every value at least as large: an equal held one has the lower id.
                let at = self.cand.partition_point(|c| c.1 >= v);
                self.cand.insert(at, ((ci * CHUNK + j) as TokenId, v));
                if self.cand.len() > k {
                    self.cand.pop();
                }
                if self.cand.len() == k {
                    kth = self.cand[k - 1].1;
                }
            }
        }
    }

    fn top_n(&mut self, logits: &[f32], n: usize, lse: f32) -> Vec<(TokenId, f32)> {
        self.cand.clear();
        self.cand
            .extend(logits.iter().enumerate().map(|(i, &l)| (i as TokenId, l)));
        let n = n.min(self.cand.len());
        // By logit, the lower id among equals (in the selection too, so that ties are kept the same way).
        if n < self.cand.len() {
            self.cand.select_nth_unstable_by(n, by_logit);
        }
        self.cand[..n].sort_by(by_logit);
        self.cand[..n].iter().map(|&(t, l)| (t, l - lse)).collect()
    }

    fn draw(&mut self, logits: &[f32]) -> TokenId {
        if self.params.top_k == 0 && self.params.min_p <= 0.0 {
            let fast = if self.params.top_p >= 1.0 {
                self.draw_plain(logits)
            } else {
                self.draw_nucleus(logits)
            };
            if let Some(t) = fast {
                return t;
            }
        }
        let p = &self.params;
        let (k, sorted) = if (1..=SMALL_TOP_K).contains(&p.top_k) {
            // A small top-k: the k best found in one pass, without listing the row.
            self.top_k_into_cand(logits, p.top_k);
            (self.cand.len(), self.cand.len())
        } else {
            self.cand.clear();
            self.cand.extend(
                logits
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| l.is_finite())
                    .map(|(i, &l)| (i as TokenId, l)),
            );
            // Keep a sorted prefix: top-k, or enough candidates for top-p / min-p.
            let k = if p.top_k > 0 {
                p.top_k.min(self.cand.len())
            } else {
                self.cand.len()
            };
            let sorted = if p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0 {
                k.min(PARTIAL_SORT.max(p.top_k))
            } else {
                0
            };
            if sorted > 0 {
                if sorted < self.cand.len() {
                    self.cand.select_nth_unstable_by(sorted - 1, by_logit);
                }
                self.cand[..sorted].sort_unstable_by(by_logit);
            }
            (k, sorted)
        };
        self.draw_cand(k, sorted)
    }

    /// A draw from the first `k` of `cand` (the row's finite logits; the first `sorted` sorted by logit,
    /// the lower id first among equals): temperature, then top-p and min-p over them.
    fn draw_cand(&mut self, k: usize, sorted: usize) -> TokenId {
        if self.cand.is_empty() {
            return 0;
        }
        let (t, top_p, min_p) = (
            self.params.temperature,
            self.params.top_p,
            self.params.min_p,
        );
        self.cand.truncate(k);
        // Temperature softmax, in place (probabilities, unnormalised).
        let max = self.cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1));
        let mut total = 0f64;
        for c in self.cand.iter_mut() {
            c.1 = ((c.1 - max) / t).exp();
            total += f64::from(c.1);
        }
        if top_p < 1.0 {
            let need = f64::from(top_p) * total;
            let prefix: f64 = self.cand[..sorted].iter().map(|c| f64::from(c.1)).sum();
            if prefix < need && sorted < self.cand.len() {
                // The mass is spread beyond the sorted prefix: sort the rest too (rare).
                self.cand[sorted..].sort_unstable_by(by_logit);
            }
            self.keep_mass(need);
        }
        if min_p > 0.0 {
            // Candidates are sorted by now whenever min_p is set, and the first has weight exp(0) = 1.
            let keep = self.cand.iter().take_while(|c| c.1 >= min_p).count().max(1);
            self.cand.truncate(keep);
        }
        self.draw_from_cand()
    }
}

/// The candidates' order: by logit (or weight), the lower id among equals.
fn by_logit(a: &(TokenId, f32), b: &(TokenId, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

#[cfg(test)]
mod tests;
