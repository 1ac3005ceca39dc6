//! Property tests of the paged cache: random interleavings of acquire / extend / commit / release /
//! truncate / clear over a small pool, checking after every step that refcounts equal the owners (tree
//! nodes plus sequence tables), that the tree is well formed, and that every position a sequence holds
//! carries the KV written for exactly its token prefix (so reuse, copy-on-write and eviction never hand a
//! sequence someone else's or overwritten KV).

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

const SHAPE: KvShape = KvShape {
    n_layers: 1,
    n_kv_heads: 1,
    head_dim: 2,
    recurrent: 0,
};

/// The KV "content" of a position: a hash of the token prefix ending there, exact in f32.
fn content(prefix: &[TokenId]) -> [f32; 2] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in prefix {
        h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
    }
    [(h & 0xfffff) as f32, ((h >> 20) & 0xfffff) as f32]
}

struct Sim {
    cache: KvCache,
    seqs: Vec<(SeqKv, Vec<TokenId>)>,
}

impl Sim {
    fn new(pages: usize, page_size: usize) -> Self {
        let cfg = KvConfig {
            dtype: KvDtype::F32,
            page_size,
            memory: pages * PagePool::page_bytes(SHAPE, page_size, KvDtype::F32),
            cache_output: true,
            ..KvConfig::default()
        };
        Sim {
            cache: KvCache::new(SHAPE, cfg),
            seqs: Vec::new(),
        }
    }

    /// Computes positions `seq.len()..tokens.len()` like a forward pass would.
    fn fill(cache: &mut KvCache, seq: &mut SeqKv, tokens: &[TokenId]) -> Result<(), KvError> {
        cache.reserve(seq, tokens.len())?;
        let ps = cache.pool().page_size();
        for pos in seq.len()..tokens.len() {
            let c = content(&tokens[..=pos]);
            let page = seq.pages()[pos / ps];
            assert_eq!(cache.pool().refs(page), 1, "writing a shared page");
            cache.pool_mut().write(page, pos % ps, 0, &c, &c);
        }
        let n = tokens.len() - seq.len();
        seq.advance(n);
        Ok(())
    }

    fn verify(&self) {
        let ps = self.cache.pool().page_size();
        let pool = self.cache.pool();
        for (seq, tokens) in &self.seqs {
            assert!(seq.len() <= tokens.len());
            for pos in 0..seq.len() {
                let page = seq.pages()[pos / ps];
                let got = pool.keys(page, 0, 0).row(pos % ps, 2);
                assert_eq!(got, content(&tokens[..=pos]), "position {pos}");
            }
        }
        // Refcounts are exactly the owners.
        let mut owners: HashMap<PageId, u32> = self.cache.tree().check(pool);
        for (seq, _) in &self.seqs {
            for &p in seq.pages() {
                *owners.entry(p).or_insert(0) += 1;
            }
        }
        for p in 0..pool.total() as PageId {
            assert_eq!(
                pool.refs(p),
                owners.get(&p).copied().unwrap_or(0),
                "page {p}"
            );
        }
        let used = owners.len();
        assert_eq!(pool.free(), pool.total() - used);
        // Everything the tree holds reads back as the KV of its path.
        for (tokens, pages) in self.cache.tree().paths() {
            for pos in 0..tokens.len() {
                let got = pool.keys(pages[pos / ps], 0, 0).row(pos % ps, 2);
                assert_eq!(got, content(&tokens[..=pos]), "cached position {pos}");
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Start {
        base: usize,
        len: usize,
        tail: Vec<TokenId>,
    },
    Extend {
        seq: usize,
        tail: Vec<TokenId>,
    },
    Commit {
        seq: usize,
    },
    Finish {
        seq: usize,
        cache: bool,
    },
    Truncate {
        seq: usize,
        keep: usize,
    },
    Clear,
}

fn base(i: usize) -> Vec<TokenId> {
    (0..64).map(|j| ((i * 7 + j * 3) % 11) as TokenId).collect()
}

fn op() -> impl Strategy<Value = Op> {
    let tail = || prop::collection::vec(0u32..4, 0..9);
    prop_oneof![
        4 => (0usize..3, 0usize..40, tail()).prop_map(|(base, len, tail)| Op::Start { base, len, tail }),
        3 => (0usize..8, tail()).prop_map(|(seq, tail)| Op::Extend { seq, tail }),
        1 => (0usize..8).prop_map(|seq| Op::Commit { seq }),
        3 => (0usize..8, any::<bool>()).prop_map(|(seq, cache)| Op::Finish { seq, cache }),
        1 => (0usize..8, 0usize..40).prop_map(|(seq, keep)| Op::Truncate { seq, keep }),
        1 => Just(Op::Clear),
    ]
}

fn run(ops: &[Op], pages: usize, page_size: usize) {
    let mut sim = Sim::new(pages, page_size);
    for op in ops {
        match op.clone() {
            Op::Start { base: b, len, tail } => {
                let mut prompt = base(b)[..len].to_vec();
                prompt.extend(tail);
                if prompt.is_empty() {
                    continue;
                }
                let mut seq = sim.cache.acquire(&prompt);
                assert!(seq.len() < prompt.len());
                let hit = seq.len();
                match Sim::fill(&mut sim.cache, &mut seq, &prompt) {
                    Ok(()) => sim.seqs.push((seq, prompt)),
                    Err(KvError::OutOfPages { .. }) => {
                        // What a scheduler does when it cannot admit: give the pages back.
                        assert!(seq.len() == hit);
                        sim.cache.release(seq, None);
                    }
                }
            }
            Op::Extend { seq, tail } => {
                if let Some((s, t)) = sim.seqs.get_mut(seq) {
                    t.truncate(s.len());
                    t.extend(tail);
                    if Sim::fill(&mut sim.cache, s, t).is_err() {
                        let (s, t) = sim.seqs.remove(seq);
                        sim.cache.release(s, Some(&t));
                    }
                }
            }
            Op::Commit { seq } => {
                if let Some((s, t)) = sim.seqs.get(seq) {
                    sim.cache.commit(s, t);
                }
            }
            Op::Finish { seq, cache } => {
                if seq < sim.seqs.len() {
                    let (s, t) = sim.seqs.remove(seq);
                    sim.cache.release(s, cache.then_some(&t[..]));
                }
            }
            Op::Truncate { seq, keep } => {
                if let Some((s, t)) = sim.seqs.get_mut(seq) {
                    sim.cache.truncate(s, keep);
                    t.truncate(s.len().max(keep.min(t.len())));
                }
            }
            Op::Clear => sim.cache.clear(),
        }
        sim.verify();
    }
    for (s, t) in std::mem::take(&mut sim.seqs) {
        sim.cache.release(s, Some(&t));
    }
    sim.verify();
    sim.cache.clear();
    assert_eq!(sim.cache.pool().free(), sim.cache.pool().total());
    assert_eq!(sim.cache.stats().nodes, 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn radix_cache_keeps_refcounts_and_contents(ops in prop::collection::vec(op(), 1..40)) {
        run(&ops, 24, 4);
    }

    #[test]
    fn radix_cache_under_a_tiny_budget(ops in prop::collection::vec(op(), 1..40)) {
        run(&ops, 6, 2);
    }

    #[test]
    fn radix_cache_with_one_position_pages(ops in prop::collection::vec(op(), 1..30)) {
        run(&ops, 40, 1);
    }
}

#[test]
fn a_second_turn_reuses_the_first_and_copies_the_partial_page() {
    let mut sim = Sim::new(64, 4);
    let turn1: Vec<TokenId> = (0..10).collect();
    let mut s = sim.cache.acquire(&turn1);
    assert_eq!(s.len(), 0);
    Sim::fill(&mut sim.cache, &mut s, &turn1).unwrap();
    sim.cache.release(s, Some(&turn1));
    // The tree holds 10 tokens: two full pages and a partial one.
    let mut turn2 = turn1.clone();
    turn2.extend([100, 101, 102]);
    let s = sim.cache.acquire(&turn2);
    assert_eq!(s.len(), 10, "the whole first turn is reused");
    assert_eq!(s.hit(), 10);
    let tree_pages: Vec<PageId> = sim.cache.tree().paths()[0].1.clone();
    assert_eq!(&s.pages()[..2], &tree_pages[..2], "full pages are shared");
    assert_ne!(s.pages()[2], tree_pages[2], "the partial page is copied");
    sim.seqs.push((s, turn2.clone()));
    sim.verify();
    // A prompt equal to the cached one still computes its last token.
    let s2 = sim.cache.acquire(&turn1);
    assert_eq!(s2.len(), 9);
    sim.cache.release(s2, None);
    sim.verify();
    assert_eq!(sim.cache.stats().hit_tokens, 19);
}

#[test]
fn eviction_frees_the_least_recently_used_prefix_first() {
    let mut sim = Sim::new(6, 2);
    let a: Vec<TokenId> = vec![1, 2, 3, 4];
    let b: Vec<TokenId> = vec![5, 6, 7, 8];
    for p in [&a, &b] {
        let mut s = sim.cache.acquire(p);
        Sim::fill(&mut sim.cache, &mut s, p).unwrap();
        sim.cache.release(s, Some(p));
    }
    // Touch `a` again so `b` is the older one.
    let s = sim.cache.acquire(&[1, 2, 3, 4, 9]);
    sim.cache.release(s, None);
    // Needing 4 fresh pages with 2 free evicts `b` (2 pages), not `a`.
    let c: Vec<TokenId> = vec![10, 11, 12, 13, 14, 15, 16];
    let mut s = sim.cache.acquire(&c);
    Sim::fill(&mut sim.cache, &mut s, &c).unwrap();
    sim.cache.release(s, None);
    let st = sim.cache.stats();
    assert_eq!((st.evicted_nodes, st.evicted_pages), (1, 2));
    let s = sim.cache.acquire(&[1, 2, 3, 4, 9]);
    assert_eq!(s.len(), 4, "a is still cached");
    sim.cache.release(s, None);
    let s = sim.cache.acquire(&[5, 6, 7, 8, 9]);
    assert_eq!(s.len(), 0, "b was evicted");
    sim.cache.release(s, None);
    sim.verify();
}

#[test]
fn running_sequences_are_never_evicted_and_overflow_is_an_error() {
    let mut sim = Sim::new(4, 2);
    let a: Vec<TokenId> = (0..6).collect();
    let mut s = sim.cache.acquire(&a);
    Sim::fill(&mut sim.cache, &mut s, &a).unwrap();
    let b: Vec<TokenId> = (10..16).collect();
    let mut s2 = sim.cache.acquire(&b);
    let err = Sim::fill(&mut sim.cache, &mut s2, &b).unwrap_err();
    assert_eq!(
        err,
        KvError::OutOfPages {
            need: 3,
            free: 1,
            total: 4
        }
    );
    sim.cache.release(s2, None);
    sim.seqs.push((s, a));
    sim.verify();
}

#[test]
fn hybrid_snapshot_points_cut_prefill_chunks() {
    let shape = KvShape {
        recurrent: 4,
        ..SHAPE
    };
    let mut kv = KvCache::new(
        shape,
        KvConfig {
            dtype: KvDtype::F32,
            page_size: 4,
            memory: 1 << 16,
            state_memory: 1 << 10,
            snapshot_interval: 16,
            turn_token: Some(9),
            ..KvConfig::default()
        },
    );
    // Turn tokens at 3, 10 and 20: the last two (10, 20) are points, as are 16 and 32.
    let mut toks: Vec<u32> = (0..40).map(|i| 100 + i).collect();
    for i in [3, 10, 20] {
        toks[i] = 9;
    }
    let seq = kv.acquire(&toks);
    assert_eq!(seq.len(), 0);
    assert_eq!(kv.chunk_end(&seq, &toks, 0, 40), 10);
    assert_eq!(kv.chunk_end(&seq, &toks, 10, 40), 16);
    assert_eq!(kv.chunk_end(&seq, &toks, 16, 40), 20);
    assert_eq!(kv.chunk_end(&seq, &toks, 20, 40), 32);
    assert!(!kv.snapshot_point(&seq, &toks, 3));
    assert!(kv.snapshot_point(&seq, &toks, 20));
    // A sequence the state budget can hold leaves a snapshot that the next acquire of a longer prompt
    // resumes from (after its KV is in the tree).
    let mut seq = seq;
    kv.reserve(&mut seq, 20).unwrap();
    seq.advance(20);
    seq.rec.len = 20;
    seq.rec.state = vec![1.0, 2.0, 3.0, 4.0].into();
    kv.release(seq, Some(&toks[..20]));
    let again = kv.acquire(&toks);
    assert_eq!((again.len(), again.rec.len), (20, 20));
    assert_eq!(again.rec.state.to_vec(), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(kv.stats().snapshots.restored, 1);
}
