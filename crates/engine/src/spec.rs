//! Speculative decoding: draft a tree of likely continuations, verify it in one forward pass, keep the
//! longest path the model agrees with.
//!
//! The default model has no multi-token-prediction head, so drafts come from what a tool-calling agent
//! repeats ([`suffix`]: the request's prompt and output, and earlier outputs) and from the grammar (every
//! drafted token is followed by the run of tokens the grammar then forces). A model with an MTP head drafts
//! through the same [`draft::Drafter`] trait.
//!
//! One decode step with speculation:
//!
//! 1. **Propose.** Drafters add weighted token paths to a [`draft::Proposals`] trie.
//! 2. **Build the tree** ([`Builder`]): best-first by estimated path probability, top-k children per node
//!    (default 2), at most `max_depth` deep and `max_nodes` drafted nodes. Each node's probability is its
//!    share of the proposal weight times a calibrated acceptance rate for its evidence class and depth
//!    ([`Calibration`], learned from what verification accepted). A branch the grammar rejects never takes a
//!    slot; after each drafted token the tokens the grammar forces are appended (they are accepted exactly
//!    when their parent is). The tree's size is then chosen from the backend's measured cost of a forward
//!    pass by token count ([`CostModel`]): the prefix of the best-first order that maximises expected
//!    decisions per second, and no tree at all unless that beats plain decoding by `min_gain`. On a
//!    compute-bound CPU, where a 16-token pass costs several single steps, this keeps trees small and drafts
//!    only strong matches; where verification is nearly free (a GPU) the same rule grows full trees.
//! 3. **Verify**: the pending tokens and the tree run in one pass, each node at position `prefix + depth`
//!    attending to the prefix and its own ancestors ([`crate::kv::Batch::push_tree`]). The decoder then
//!    samples at the root exactly as without speculation (same sampler, same grammar mask, same random
//!    stream) and follows the child holding the chosen token, as long as there is one. Greedy output is
//!    therefore token-for-token the output without speculation, and sampled output has exactly the same
//!    distribution (the drafts are deterministic, a point mass per candidate, for which the standard
//!    multi-candidate rejection rule reduces to sampling the target and matching children). Ancestor KV that
//!    is not in place is gathered into the same attention kernel calls a chain makes, so the logits are
//!    bitwise those of plain decoding.
//! 4. **Keep** the accepted path's KV (rows move into place, [`crate::kv::KvCache::keep_path`]), drop the
//!    rest; the grammar matcher never saw the rejected branches (they were validated without committing).

pub mod draft;
pub mod suffix;

use crate::sample::grammar::Mask;
use crate::sample::grammar::{Constraint, GrammarError};
use crate::tokenizer::{TokenId, Tokenizer};
use draft::{CLASSES, DraftContext, Drafter, GRAMMAR_CLASS, HeadDrafter, MODEL_CLASS, Proposals};
use std::collections::BinaryHeap;
use suffix::{SuffixDrafter, SuffixStore};

/// Depth buckets of the calibration table.
const DEPTHS: usize = 8;

/// How to speculate.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecConfig {
    /// Whether to speculate at all (requests may still opt out).
    pub enabled: bool,
    /// Children kept per node.
    pub top_k: usize,
    /// Deepest drafted node.
    pub max_depth: usize,
    /// Most drafted nodes per tree (forced runs come on top).
    pub max_nodes: usize,
    /// Most grammar-forced tokens appended after one drafted node.
    pub max_forced: usize,
    /// Smallest expected speed-up worth a tree (0.05 = 5%).
    pub min_gain: f32,
    /// Choose the tree's size by the cost model (off: always the whole budget).
    pub adaptive: bool,
    /// A fixed cost model instead of one measured on this machine: tree shapes then depend on the drafts
    /// alone, never on the machine's speed or load (tests; reproducible benchmarks).
    pub fixed_cost: Option<FixedCost>,
    /// Bytes of earlier outputs kept for drafting.
    pub store_bytes: usize,
}

/// A forward pass of `n` tokens costs `step + token * (n - 1)` (any unit: only ratios matter).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FixedCost {
    /// Cost of a one-token pass.
    pub step: f64,
    /// Cost of each further token in the pass.
    pub token: f64,
}

impl FixedCost {
    /// A memory-bound device: extra tokens in a pass are nearly free (2% of a step each), so the builder
    /// uses most of the budget when drafts are likely.
    pub const MEMORY_BOUND: FixedCost = FixedCost {
        step: 1.0,
        token: 0.02,
    };
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            enabled: true,
            top_k: 2,
            max_depth: 8,
            max_nodes: 16,
            max_forced: 32,
            min_gain: 0.05,
            adaptive: true,
            fixed_cost: None,
            store_bytes: 1 << 20,
        }
    }
}

impl SpecConfig {
    /// Speculation off.
    pub fn off() -> Self {
        SpecConfig {
            enabled: false,
            ..SpecConfig::default()
        }
    }

    /// A linear chain of at most `n` drafted tokens (top-1 per depth).
    pub fn chain(n: usize) -> Self {
        SpecConfig {
            top_k: 1,
            max_depth: n,
            max_nodes: n,
            ..SpecConfig::default()
        }
    }
}

/// Counters of speculation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpecStats {
    /// Trees verified.
    pub trees: u64,
    /// Tree tokens run (drafted and forced).
    pub drafted: u64,
    /// Tree tokens accepted.
    pub accepted: u64,
    /// Decode forward passes.
    pub passes: u64,
    /// Tokens generated by them.
    pub tokens: u64,
    /// Trees with at least one node that has a sibling (not a chain).
    pub branched: u64,
    /// Trees by size in tokens: 1, 2, 3-4, 5-8, 9-16, 17 and more.
    pub sizes: [u64; 6],
}

impl SpecStats {
    /// Labels of [`SpecStats::sizes`].
    pub const SIZE_LABELS: [&'static str; 6] = ["1", "2", "3-4", "5-8", "9-16", "17+"];

    fn size_bucket(n: usize) -> usize {
        match n {
            0..=1 => 0,
            2 => 1,
            3..=4 => 2,
            5..=8 => 3,
            9..=16 => 4,
            _ => 5,
        }
    }

    /// Generated tokens per decode forward pass.
    pub fn tokens_per_pass(&self) -> f64 {
        self.tokens as f64 / (self.passes as f64).max(1.0)
    }

    /// Share of tree tokens accepted.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / (self.drafted as f64).max(1.0)
    }

    /// Adds another's counts.
    pub fn add(&mut self, o: &SpecStats) {
        self.trees += o.trees;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        self.passes += o.passes;
        self.tokens += o.tokens;
        self.branched += o.branched;
        for (a, b) in self.sizes.iter_mut().zip(o.sizes) {
            *a += b;
        }
    }
}

/// Acceptance rates by evidence class and depth, learned from verification.
#[derive(Debug, Clone)]
pub struct Calibration {
    hits: [[f32; DEPTHS]; CLASSES],
    tries: [[f32; DEPTHS]; CLASSES],
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            hits: [[0.0; DEPTHS]; CLASSES],
            tries: [[0.0; DEPTHS]; CLASSES],
        }
    }
}

impl Calibration {
    /// Prior: a match of class `c` is right with probability `0.2 + 0.1 c` (strength 4 observations); one
    /// of the grammar's few alternatives is right for sure (their shares split it).
    fn prior(class: usize) -> (f32, f32) {
        let p = if class == GRAMMAR_CLASS as usize {
            0.95
        } else if class == MODEL_CLASS as usize {
            0.6
        } else {
            (0.2 + 0.1 * class as f32).min(0.8)
        };
        (4.0 * p, 4.0)
    }

    /// Estimated probability that a drafted token of `class` at `depth` (0 = first) is accepted, given
    /// that its parent was.
    pub fn rate(&self, class: u8, depth: usize) -> f32 {
        let (c, d) = (class as usize, depth.min(DEPTHS - 1));
        let (a, n) = Self::prior(c);
        (self.hits[c][d] + a) / (self.tries[c][d] + n)
    }

    /// Verified drafts of `class` so far: (accepted, tried), over all depths.
    pub fn observed(&self, class: u8) -> (f32, f32) {
        let c = class as usize;
        (self.hits[c].iter().sum(), self.tries[c].iter().sum())
    }

    /// Records one verified node: whether it was accepted, its parent having been.
    pub fn record(&mut self, class: u8, depth: usize, accepted: bool) {
        let (c, d) = (class as usize, depth.min(DEPTHS - 1));
        if self.tries[c][d] >= 2000.0 {
            // Forget slowly: the workload changes.
            self.tries[c][d] *= 0.5;
            self.hits[c][d] *= 0.5;
        }
        self.tries[c][d] += 1.0;
        self.hits[c][d] += f32::from(u8::from(accepted));
    }
}

/// Measured cost of a forward pass by token count, for sizing trees; or a [`FixedCost`], which ignores
/// measurements.
#[derive(Debug, Clone)]
pub struct CostModel {
    secs: [f64; CostModel::MAX + 1],
    fixed: bool,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            secs: [0.0; CostModel::MAX + 1],
            fixed: false,
        }
    }
}

impl CostModel {
    /// Largest pass size tracked.
    pub const MAX: usize = 96;

    /// A model that costs every pass by `f` and ignores what is observed.
    pub fn fixed(f: FixedCost) -> Self {
        let mut secs = [0.0; CostModel::MAX + 1];
        for (n, s) in secs.iter_mut().enumerate().skip(1) {
            *s = f.step + f.token * (n - 1) as f64;
        }
        CostModel { secs, fixed: true }
    }

    /// The cost model `cfg` asks for: fixed, or measured (empty until calibrated or observed).
    pub fn for_config(cfg: &SpecConfig) -> Self {
        cfg.fixed_cost.map(Self::fixed).unwrap_or_default()
    }

    /// Whether this model is fixed (observations and calibration leave it unchanged).
    pub fn is_fixed(&self) -> bool {
        self.fixed
    }

    /// Records a pass of `n` tokens that took `secs`.
    pub fn observe(&mut self, n: usize, secs: f64) {
        if self.fixed || n == 0 || n > Self::MAX || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let s = &mut self.secs[n];
        *s = if *s == 0.0 {
            secs
        } else {
            0.8 * *s + 0.2 * secs
        };
    }

    /// Sets the cost of a pass of `n` tokens (a calibration's median).
    pub fn set(&mut self, n: usize, secs: f64) {
        if !self.fixed && (1..=Self::MAX).contains(&n) && secs.is_finite() && secs > 0.0 {
            self.secs[n] = secs;
        }
    }

    /// Whether a pass of `n` tokens was measured.
    pub fn measured(&self, n: usize) -> bool {
        n <= Self::MAX && self.secs[n] > 0.0
    }

    /// The cost of a pass of `n` tokens: measured, else interpolated between measured sizes, else
    /// extrapolated (a prior of half a step per extra token, the compute-bound CPU case, when nothing is
    /// known).
    pub fn cost(&self, n: usize) -> f64 {
        let n = n.max(1);
        if n <= Self::MAX && self.secs[n] > 0.0 {
            return self.secs[n];
        }
        let lo = (1..n.min(Self::MAX + 1))
            .rev()
            .find(|&i| self.secs[i] > 0.0);
        let hi = (n + 1..=Self::MAX).find(|&i| self.secs[i] > 0.0);
        match (lo, hi) {
            (Some(a), Some(b)) => {
                let f = (n - a) as f64 / (b - a) as f64;
                self.secs[a] + f * (self.secs[b] - self.secs[a])
            }
            (Some(a), None) => {
                let below = (1..a).rev().find(|&i| self.secs[i] > 0.0);
                let slope = match below {
                    Some(z) => ((self.secs[a] - self.secs[z]) / (a - z) as f64).max(0.0),
                    None => 0.5 * self.secs[a] / a as f64,
                };
                self.secs[a] + slope * (n - a) as f64
            }
            (None, Some(b)) => {
                self.secs[b] * (1.0 + 0.5 * (n as f64 - 1.0)) / (1.0 + 0.5 * (b as f64 - 1.0))
            }
            (None, None) => 1.0 + 0.5 * (n as f64 - 1.0),
        }
    }
}

/// A draft tree in depth-first order: every node's first child follows it, so the most likely path is
/// stored in place.
#[derive(Debug, Clone, Default)]
pub struct DraftTree {
    /// Node tokens.
    pub tokens: Vec<TokenId>,
    /// Parent of each node (index in this tree; [`crate::kv::NO_PARENT`] for the root's children).
    pub parents: Vec<u32>,
    /// Estimated probability that the node is accepted.
    pub prob: Vec<f32>,
    /// Evidence class of drafted nodes; `None` for grammar-forced ones.
    pub class: Vec<Option<u8>>,
    /// Drafted depth of each node: drafted ancestors before it (0 = the first drafted token); a forced
    /// node has its drafted parent's.
    pub depth: Vec<u16>,
}

impl DraftTree {
    /// Empties the tree.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.parents.clear();
        self.prob.clear();
        self.class.clear();
        self.depth.clear();
    }

    /// Nodes.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it has no nodes.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The child of `node` (`None`: the root) holding `token`.
    pub fn child(&self, node: Option<usize>, token: TokenId) -> Option<usize> {
        let p = node.map_or(crate::kv::NO_PARENT, |n| n as u32);
        let from = node.map_or(0, |n| n + 1);
        (from..self.len()).find(|&i| self.parents[i] == p && self.tokens[i] == token)
    }

    fn push(&mut self, token: TokenId, parent: u32, prob: f32, class: Option<u8>, depth: u16) {
        self.tokens.push(token);
        self.parents.push(parent);
        self.prob.push(prob);
        self.class.push(class);
        self.depth.push(depth);
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Candidate {
    prob: f32,
    /// Proposal node it comes from ([`NO_PROP`] for a grammar alternative).
    prop: u32,
    token: TokenId,
    class: u8,
    parent: u32,
    depth: u16,
}

const NO_PROP: u32 = u32::MAX;

impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Candidate {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // Highest probability first; ties by proposal order, then token (deterministic).
        self.prob
            .total_cmp(&o.prob)
            .then_with(|| o.prop.cmp(&self.prop))
            .then_with(|| o.token.cmp(&self.token))
    }
}

/// What the tree builder needs to know about the forward pass the tree joins.
#[derive(Debug, Clone, Copy)]
pub struct PassShape {
    /// Tokens already in the pass (this sequence's pending tokens and other sequences' tokens).
    pub base: usize,
    /// Sampling decisions the pass yields without this tree (sequences in it, this one included).
    pub decisions: f32,
    /// Most tree tokens that fit (context room, tokens left to generate).
    pub room: usize,
}

/// Builds draft trees; holds its buffers between steps.
#[derive(Debug, Default)]
pub struct Builder {
    heap: BinaryHeap<Candidate>,
    kids: Vec<Candidate>,
    staged: DraftTree,
    /// Proposal node each staged node continues from (`u32::MAX`: none).
    staged_prop: Vec<u32>,
    path: Vec<TokenId>,
    mask: Mask,
    order: Vec<usize>,
    remap: Vec<u32>,
    stack: Vec<usize>,
}

impl Builder {
    /// Builds `tree` from `props`, validating every node with `grammar` (its state is where the tree
    /// starts; it is left unchanged), sized by `cost` for a pass shaped like `pass`.
    #[expect(
        clippy::too_many_arguments,
        reason = "the tree's inputs are independent; a struct would only rename them"
    )]
    pub fn build(
        &mut self,
        props: &Proposals,
        mut grammar: Option<&mut Constraint>,
        cfg: &SpecConfig,
        calib: &Calibration,
        cost: &CostModel,
        pass: PassShape,
        tree: &mut DraftTree,
    ) -> Result<(), GrammarError> {
        tree.clear();
        let s = &mut self.staged;
        s.clear();
        self.staged_prop.clear();
        self.heap.clear();
        if pass.room == 0 || cfg.max_nodes == 0 {
            return Ok(());
        }
        if props.is_empty() {
            // Nothing proposed: the grammar's alternatives, if there are only a few.
            self.path.clear();
            if let Some(g) = grammar.as_deref_mut() {
                grammar_children(
                    &mut self.heap,
                    &mut self.mask,
                    &self.path,
                    g,
                    crate::kv::NO_PARENT,
                    1.0,
                    0,
                    cfg,
                    calib,
                )?;
            }
        } else {
            push_children(
                &mut self.heap,
                &mut self.kids,
                props,
                0,
                crate::kv::NO_PARENT,
                1.0,
                0,
                cfg,
                calib,
            );
        }
        // Best-first: (tokens so far, expected accepted drafted nodes) after each drafted node.
        let mut curve: Vec<(usize, f32)> = Vec::with_capacity(cfg.max_nodes);
        let mut expected = 0.0f32;
        while let Some(c) = self.heap.pop() {
            if curve.len() >= cfg.max_nodes || s.len() >= pass.room {
                break;
            }
            let token = c.token;
            // The path from the root to this candidate.
            self.path.clear();
            let mut at = c.parent;
            while at != crate::kv::NO_PARENT {
                self.path.push(s.tokens[at as usize]);
                at = s.parents[at as usize];
            }
            self.path.reverse();
            self.path.push(token);
            let mut forced = Vec::new();
            if let Some(g) = grammar.as_deref_mut() {
                if g.validate(&self.path)? < self.path.len() {
                    continue;
                }
                g.commit_all(&self.path)?;
                if !g.is_stopped() {
                    forced = g.forced();
                }
                g.rollback(self.path.len())?;
            }
            let id = s.len() as u32;
            s.push(token, c.parent, c.prob, Some(c.class), c.depth);
            self.staged_prop.push(c.prop);
            expected += c.prob;
            // The forced run, and where the proposals continue after it.
            let mut prop = (c.prop != NO_PROP).then_some(c.prop as usize);
            let mut last = id;
            let depth = c.depth;
            for &f in forced
                .iter()
                .take(cfg.max_forced.min(pass.room - s.len().min(pass.room)))
            {
                s.push(f, last, c.prob, None, depth);
                self.staged_prop.push(u32::MAX);
                last = s.len() as u32 - 1;
                prop = prop.and_then(|p| props.child(p, f));
            }
            curve.push((s.len(), expected));
            if (depth as usize + 1) >= cfg.max_depth {
                continue;
            }
            let proposed = prop.filter(|&p| props.children(p).next().is_some());
            if proposed.is_none()
                && let Some(g) = grammar.as_deref_mut()
            {
                self.path.extend_from_slice(&forced);
                grammar_children(
                    &mut self.heap,
                    &mut self.mask,
                    &self.path,
                    g,
                    last,
                    c.prob,
                    depth + 1,
                    cfg,
                    calib,
                )?;
            }
            if let Some(p) = proposed {
                push_children(
                    &mut self.heap,
                    &mut self.kids,
                    props,
                    p,
                    last,
                    c.prob,
                    depth + 1,
                    cfg,
                    calib,
                );
            }
        }
        // How many drafted nodes (in best-first order) to keep.
        let base = cost.cost(pass.base);
        let mut best = (0usize, 1.0f64);
        for (i, &(n, e)) in curve.iter().enumerate() {
            let gain = (f64::from(pass.decisions) + f64::from(e)) / f64::from(pass.decisions)
                * base
                / cost.cost(pass.base + n);
            if !cfg.adaptive || gain > best.1 {
                best = (i + 1, gain);
            }
        }
        if cfg.adaptive && best.1 < 1.0 + f64::from(cfg.min_gain) {
            return Ok(());
        }
        let keep = if best.0 == 0 { 0 } else { curve[best.0 - 1].0 };
        // Depth-first order, likeliest child first.
        self.order.clear();
        self.stack.clear();
        let kids = |p: u32, out: &mut Vec<usize>, s: &DraftTree| {
            let from = out.len();
            out.extend((0..keep).filter(|&i| s.parents[i] == p));
            out[from..].sort_by(|&a, &b| s.prob[a].total_cmp(&s.prob[b]).then(b.cmp(&a)));
        };
        kids(crate::kv::NO_PARENT, &mut self.stack, s);
        while let Some(n) = self.stack.pop() {
            self.order.push(n);
            kids(n as u32, &mut self.stack, s);
        }
        self.remap.clear();
        self.remap.resize(keep, 0);
        for (new, &old) in self.order.iter().enumerate() {
            self.remap[old] = new as u32;
        }
        for &old in &self.order {
            let p = s.parents[old];
            let p = if p == crate::kv::NO_PARENT {
                p
            } else {
                self.remap[p as usize]
            };
            tree.push(s.tokens[old], p, s.prob[old], s.class[old], s.depth[old]);
        }
        Ok(())
    }
}

/// Pushes the tokens `g` allows after `path` as candidates, when there are 2 to `top_k` of them (one is
/// forced, more are not worth a guess); each gets an equal share of `prob`.
#[expect(
    clippy::too_many_arguments,
    reason = "the expansion's inputs, as in push_children"
)]
fn grammar_children(
    heap: &mut BinaryHeap<Candidate>,
    mask: &mut Mask,
    path: &[TokenId],
    g: &mut Constraint,
    parent: u32,
    prob: f32,
    depth: u16,
    cfg: &SpecConfig,
    calib: &Calibration,
) -> Result<(), GrammarError> {
    let k = cfg.top_k.max(1);
    if k < 2 {
        return Ok(());
    }
    g.commit_all(path)?;
    let res = (|| {
        if g.is_stopped() {
            return Ok(());
        }
        g.mask_into(mask)?;
        let n = mask.count();
        if !(2..=k).contains(&n) {
            return Ok(());
        }
        let p = prob * calib.rate(GRAMMAR_CLASS, depth as usize) / n as f32;
        for (w, &bits) in mask.words().iter().enumerate() {
            let mut b = bits;
            while b != 0 {
                let t = (w * 32) as u32 + b.trailing_zeros();
                b &= b - 1;
                heap.push(Candidate {
                    prob: p,
                    prop: NO_PROP,
                    token: t,
                    class: GRAMMAR_CLASS,
                    parent,
                    depth,
                });
            }
        }
        Ok(())
    })();
    g.rollback(path.len())?;
    res
}

#[expect(
    clippy::too_many_arguments,
    reason = "a private helper of the builder's loop"
)]
fn push_children(
    heap: &mut BinaryHeap<Candidate>,
    scratch: &mut Vec<Candidate>,
    props: &Proposals,
    prop: usize,
    parent: u32,
    prob: f32,
    depth: u16,
    cfg: &SpecConfig,
    calib: &Calibration,
) {
    let total = props.get(prop).weight.max(f32::MIN_POSITIVE);
    scratch.clear();
    scratch.extend(props.children(prop).map(|c| {
        let n = props.get(c);
        Candidate {
            prob: prob * n.weight / total * calib.rate(n.class, depth as usize),
            prop: c as u32,
            token: n.token,
            class: n.class,
            parent,
            depth,
        }
    }));
    scratch.sort_unstable_by(|a, b| b.cmp(a));
    heap.extend(scratch.iter().take(cfg.top_k.max(1)).copied());
}

/// Engine-wide speculation state: configuration, the cost model, calibration, the store of earlier outputs,
/// and counters.
#[derive(Debug)]
pub struct Speculator {
    /// Configuration.
    pub cfg: SpecConfig,
    /// Forward-pass cost by size.
    pub cost: CostModel,
    /// Acceptance rates.
    pub calib: Calibration,
    /// Earlier outputs.
    pub store: SuffixStore,
    /// Counters.
    pub stats: SpecStats,
    props: Proposals,
    builder: Builder,
    /// Drafters after the request's suffix drafter and the store: the model head's first.
    drafters: Vec<Box<dyn Drafter>>,
    /// The model head's candidates for this draft ([`DraftContext::head`]), set by the engine right before
    /// [`Speculator::draft`] and used once.
    head: Vec<(TokenId, f32)>,
}

impl Speculator {
    /// A speculator configured by `cfg`.
    pub fn new(cfg: SpecConfig) -> Self {
        Speculator {
            store: SuffixStore::new(cfg.store_bytes),
            cost: CostModel::for_config(&cfg),
            cfg,
            calib: Calibration::default(),
            stats: SpecStats::default(),
            props: Proposals::default(),
            builder: Builder::default(),
            drafters: vec![Box::new(HeadDrafter)],
            head: Vec::new(),
        }
    }

    /// Sets the model head's candidates for the token after the pending one in the coming draft
    /// (`(token, probability)`, an MTP head's top tokens): [`HeadDrafter`] proposes them, and they are
    /// forgotten after that draft.
    pub fn set_head(&mut self, candidates: impl IntoIterator<Item = (TokenId, f32)>) {
        self.head.clear();
        self.head.extend(candidates);
    }

    /// Adds a drafter whose proposals join every tree (a draft model, a domain's table); its weights share
    /// the trie with the suffix drafter's and the store's.
    pub fn add_drafter(&mut self, d: Box<dyn Drafter>) {
        self.drafters.push(d);
    }

    /// Drafts the tree that follows `history` (its last token included): proposals from the request's
    /// suffix drafter and the store, validated by `grammar`, sized for `pass`.
    pub fn draft(
        &mut self,
        drafter: &mut SuffixDrafter,
        history: &[TokenId],
        grammar: Option<&mut Constraint>,
        tok: &Tokenizer,
        pass: PassShape,
        tree: &mut DraftTree,
    ) -> Result<(), GrammarError> {
        tree.clear();
        if !self.cfg.enabled {
            self.head.clear();
            return Ok(());
        }
        self.props.clear();
        let ctx = DraftContext {
            history,
            head: &self.head,
            tokenizer: tok,
            max_depth: self.cfg.max_depth,
        };
        drafter.propose(&ctx, &mut self.props);
        self.store
            .propose(drafter.bytes(), tok, self.cfg.max_depth, &mut self.props);
        for d in &mut self.drafters {
            d.propose(&ctx, &mut self.props);
        }
        self.head.clear();
        self.builder.build(
            &self.props,
            grammar,
            &self.cfg,
            &self.calib,
            &self.cost,
            pass,
            tree,
        )
    }

    /// Learns from a verified tree: `path` lists the accepted nodes.
    pub fn record(&mut self, tree: &DraftTree, path: &[usize]) {
        if tree.is_empty() {
            return;
        }
        self.stats.trees += 1;
        self.stats.drafted += tree.len() as u64;
        self.stats.accepted += path.len() as u64;
        self.stats.sizes[SpecStats::size_bucket(tree.len())] += 1;
        let chain = (1..tree.len()).all(|i| tree.parents[i] == i as u32 - 1);
        self.stats.branched += u64::from(!chain);
        for i in 0..tree.len() {
            let Some(class) = tree.class[i] else { continue };
            let p = tree.parents[i];
            let parent_ok = p == crate::kv::NO_PARENT || path.contains(&(p as usize));
            if parent_ok {
                self.calib
                    .record(class, tree.depth[i] as usize, path.contains(&i));
            }
        }
    }
}

#[cfg(test)]
mod tests;
