//! The radix tree of cached prefixes: token runs on the edges, the pages that hold their KV in the nodes.
//!
//! Node boundaries sit on page boundaries (position `k * page_size`), so a node owns whole pages and a split
//! never cuts a page in two. The one exception is the last page of a leaf, which may be partly filled (the
//! tail of a finished sequence). A request matches whole pages by reference and the filled part of a
//! partly matching page by copy ([`PrefixMatch::partial`]), so hits are token-exact while pages stay
//! immutable once shared: only a page with a single owner is ever written.
//!
//! Ownership is counted in the [`PagePool`]: each node holds one reference on each of its pages, each
//! sequence one on each page of its table. A leaf whose pages nobody else references can be evicted; the
//! least recently used goes first.

use super::{PageId, PagePool};
use crate::tokenizer::TokenId;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

const ROOT: usize = 0;

#[derive(Debug, Clone, Default)]
struct Node {
    parent: usize,
    children: Vec<usize>,
    tokens: Vec<TokenId>,
    pages: Vec<PageId>,
    last_used: u64,
    live: bool,
}

/// What a request found in the tree.
#[derive(Debug, Default)]
pub struct PrefixMatch {
    /// Whole pages shared with the tree, in position order (a reference on each is held for the caller).
    pub pages: Vec<PageId>,
    /// Tokens those pages hold (`pages.len() * page_size`).
    pub len: usize,
    /// A page whose first `n` positions also match: the caller copies them into a page of its own.
    pub partial: Option<(PageId, usize)>,
}

/// Counts for the stats endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Leaves removed.
    pub nodes: usize,
    /// Pages returned to the pool.
    pub pages: usize,
}

/// The prefix tree.
#[derive(Debug)]
pub struct RadixTree {
    nodes: Vec<Node>,
    spare: Vec<usize>,
    clock: u64,
    page_size: usize,
    pages: usize,
}

fn lcp(a: &[TokenId], b: &[TokenId]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl RadixTree {
    /// An empty tree over pages of `page_size` positions.
    pub fn new(page_size: usize) -> Self {
        RadixTree {
            nodes: vec![Node {
                live: true,
                ..Node::default()
            }],
            spare: Vec::new(),
            clock: 0,
            page_size,
            pages: 0,
        }
    }

    /// Pages the tree holds.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Nodes besides the root.
    pub fn nodes(&self) -> usize {
        self.nodes.len() - self.spare.len() - 1
    }

    /// The child of `node` sharing the longest prefix with `tokens`, and that length.
    fn best_child(&self, node: usize, tokens: &[TokenId]) -> Option<(usize, usize)> {
        let first = *tokens.first()?;
        self.nodes[node]
            .children
            .iter()
            .filter(|&&c| self.nodes[c].tokens[0] == first)
            .map(|&c| (c, lcp(&self.nodes[c].tokens, tokens)))
            .max_by_key(|&(_, m)| m)
    }

    fn touch(&mut self, node: usize) {
        self.clock += 1;
        self.nodes[node].last_used = self.clock;
    }

    /// The longest cached prefix of `tokens[..max_len]`; takes a reference on every page returned.
    pub fn match_prefix(
        &mut self,
        pool: &mut PagePool,
        tokens: &[TokenId],
        max_len: usize,
    ) -> PrefixMatch {
        let ps = self.page_size;
        let tokens = &tokens[..max_len.min(tokens.len())];
        let mut out = PrefixMatch::default();
        let mut node = ROOT;
        while let Some((c, m)) = self.best_child(node, &tokens[out.len..]) {
            if m == 0 {
                break;
            }
            self.touch(c);
            let n = &self.nodes[c];
            let whole = m == n.tokens.len() && m.is_multiple_of(ps);
            let full = if whole { m } else { m / ps * ps };
            for &p in &n.pages[..full / ps] {
                pool.retain(p);
                out.pages.push(p);
            }
            out.len += full;
            if whole {
                node = c;
                continue;
            }
            if m > full {
                out.partial = Some((n.pages[full / ps], m - full));
            }
            break;
        }
        out
    }

    /// Splits `node` after its first `at` tokens (a multiple of the page size); returns the new parent.
    fn split(&mut self, node: usize, at: usize) -> usize {
        debug_assert!(
            at > 0 && at.is_multiple_of(self.page_size) && at < self.nodes[node].tokens.len()
        );
        let parent = self.nodes[node].parent;
        let head = Node {
            parent,
            children: vec![node],
            tokens: self.nodes[node].tokens[..at].to_vec(),
            pages: self.nodes[node].pages[..at / self.page_size].to_vec(),
            last_used: self.nodes[node].last_used,
            live: true,
        };
        let h = self.alloc_node(head);
        let n = &mut self.nodes[node];
        n.tokens.drain(..at);
        n.pages.drain(..at / self.page_size);
        n.parent = h;
        for c in &mut self.nodes[parent].children {
            if *c == node {
                *c = h;
            }
        }
        h
    }

    fn alloc_node(&mut self, node: Node) -> usize {
        match self.spare.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Removes a leaf, dropping the tree's references on its pages; returns the pages freed.
    fn remove_leaf(&mut self, pool: &mut PagePool, node: usize) -> usize {
        debug_assert!(node != ROOT && self.nodes[node].children.is_empty());
        let n = std::mem::take(&mut self.nodes[node]);
        let freed = n.pages.iter().filter(|&&p| pool.release(p)).count();
        self.pages -= n.pages.len();
        self.nodes[n.parent].children.retain(|&c| c != node);
        self.spare.push(node);
        freed
    }

    /// Records that positions `0..tokens.len()` hold the KV of `tokens` in `pages` (one page per
    /// `page_size` positions, the last possibly partial). The tree takes a reference on every page it keeps;
    /// the caller keeps its own.
    pub fn insert(&mut self, pool: &mut PagePool, tokens: &[TokenId], pages: &[PageId]) {
        let ps = self.page_size;
        let n = tokens.len();
        assert!(
            pages.len() >= n.div_ceil(ps),
            "pages do not cover the tokens"
        );
        let mut node = ROOT;
        let mut pos = 0;
        while pos < n {
            let Some((c, m)) = self.best_child(node, &tokens[pos..]) else {
                break;
            };
            self.touch(c);
            let len = self.nodes[c].tokens.len();
            if m == n - pos && m <= len {
                // Everything left is already in the tree.
                return;
            }
            if m == len && len.is_multiple_of(ps) {
                node = c;
                pos += m;
                continue;
            }
            // A partial match, or a partly filled leaf the new tokens extend: share its whole pages and
            // start a new branch at the page boundary below the divergence.
            let at = m / ps * ps;
            if at > 0 {
                node = self.split(c, at);
                pos += at;
            }
            break;
        }
        if pos >= n {
            return;
        }
        let leaf = Node {
            parent: node,
            children: Vec::new(),
            tokens: tokens[pos..].to_vec(),
            pages: pages[pos / ps..n.div_ceil(ps)].to_vec(),
            last_used: 0,
            live: true,
        };
        for &p in &leaf.pages {
            pool.retain(p);
        }
        self.pages += leaf.pages.len();
        // A partly filled sibling leaf whose tokens the new branch starts with is now redundant.
        let redundant: Vec<usize> = self.nodes[node]
            .children
            .iter()
            .copied()
            .filter(|&s| {
                let s = &self.nodes[s];
                s.children.is_empty()
                    && s.tokens.len() < ps
                    && leaf.tokens.len() > s.tokens.len()
                    && leaf.tokens.starts_with(&s.tokens)
            })
            .collect();
        let id = self.alloc_node(leaf);
        self.nodes[node].children.push(id);
        self.touch(id);
        for s in redundant {
            self.remove_leaf(pool, s);
        }
    }

    /// Evicts least recently used leaves that only the tree references until `pool` has `want` free pages
    /// (or nothing more can go).
    pub fn evict(&mut self, pool: &mut PagePool, want: usize) -> Evicted {
        let mut out = Evicted::default();
        if pool.free() >= want {
            return out;
        }
        let evictable = |t: &Self, pool: &PagePool, i: usize| {
            let n = &t.nodes[i];
            i != ROOT
                && n.live
                && n.children.is_empty()
                && n.pages.iter().all(|&p| pool.refs(p) == 1)
        };
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (0..self.nodes.len())
            .filter(|&i| evictable(self, pool, i))
            .map(|i| Reverse((self.nodes[i].last_used, i)))
            .collect();
        while pool.free() < want {
            let Some(Reverse((_, i))) = heap.pop() else {
                break;
            };
            let parent = self.nodes[i].parent;
            out.pages += self.remove_leaf(pool, i);
            out.nodes += 1;
            if evictable(self, pool, parent) {
                heap.push(Reverse((self.nodes[parent].last_used, parent)));
            }
        }
        out
    }

    /// Drops every node whose pages nobody else references (all of them when no sequence runs).
    pub fn clear(&mut self, pool: &mut PagePool) -> Evicted {
        self.evict(pool, usize::MAX)
    }

    /// Checks the tree's structural invariants and returns how many references it holds on each page.
    #[cfg(test)]
    pub(crate) fn check(&self, pool: &PagePool) -> std::collections::HashMap<PageId, u32> {
        let ps = self.page_size;
        let mut held = std::collections::HashMap::new();
        let mut pages = 0;
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.live || i == ROOT {
                continue;
            }
            assert!(!n.tokens.is_empty(), "node {i} is empty");
            assert_eq!(n.pages.len(), n.tokens.len().div_ceil(ps), "node {i} pages");
            assert!(
                n.tokens.len().is_multiple_of(ps) || n.children.is_empty(),
                "inner node {i} ends inside a page"
            );
            assert!(
                self.nodes[n.parent].children.contains(&i),
                "node {i} parent"
            );
            for &c in &n.children {
                assert_eq!(self.nodes[c].parent, i);
            }
            for &p in &n.pages {
                assert!(pool.refs(p) > 0, "node {i} holds free page {p}");
                *held.entry(p).or_insert(0) += 1;
            }
            pages += n.pages.len();
        }
        assert!(held.values().all(|&c| c == 1), "a page in two nodes");
        assert_eq!(pages, self.pages);
        held
    }

    /// Every cached sequence, as (tokens, pages) from the root to each node (tests).
    #[cfg(test)]
    pub(crate) fn paths(&self) -> Vec<(Vec<TokenId>, Vec<PageId>)> {
        let mut out = Vec::new();
        let mut stack = vec![(ROOT, Vec::new(), Vec::new())];
        while let Some((i, t, p)) = stack.pop() {
            for &c in &self.nodes[i].children {
                let (mut t2, mut p2) = (t.clone(), p.clone());
                t2.extend_from_slice(&self.nodes[c].tokens);
                p2.extend_from_slice(&self.nodes[c].pages);
                out.push((t2.clone(), p2.clone()));
                stack.push((c, t2, p2));
            }
        }
        out
    }
}
