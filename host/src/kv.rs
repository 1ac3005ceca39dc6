//! The attention KV cache, behind a small interface the paged/prefix cache will replace.
//!
//! Storage is one contiguous region per (layer, KV head): `capacity` positions of `head_dim` elements, so
//! attention for one head streams keys and values in position order. Elements are f16 (the default, like
//! llama.cpp) or f32 (exact, for reference runs).

use half::f16;

/// Element type of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    /// 32-bit floats (exact).
    F32,
    /// 16-bit floats (half the memory traffic; ~1e-2 logit differences).
    F16,
}

/// Keys or values for one (layer, head): positions `0..len`, `head_dim` elements each.
#[derive(Debug, Clone, Copy)]
pub enum KvSlice<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
}

#[derive(Debug)]
enum Store {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

/// A contiguous KV cache for one sequence.
#[derive(Debug)]
pub struct KvCache {
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
    k: Store,
    v: Store,
}

impl KvCache {
    /// A cache for `capacity` positions.
    pub fn new(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: KvDtype,
    ) -> Self {
        let n = n_layers * n_kv_heads * capacity * head_dim;
        let store = || match dtype {
            KvDtype::F32 => Store::F32(vec![0.0; n]),
            KvDtype::F16 => Store::F16(vec![f16::ZERO; n]),
        };
        KvCache {
            n_layers,
            n_kv_heads,
            head_dim,
            capacity,
            len: 0,
            k: store(),
            v: store(),
        }
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Element type.
    pub fn dtype(&self) -> KvDtype {
        match self.k {
            Store::F32(_) => KvDtype::F32,
            Store::F16(_) => KvDtype::F16,
        }
    }

    /// Bytes per position, all layers and heads, K and V.
    pub fn bytes_per_position(&self) -> usize {
        let el = if self.dtype() == KvDtype::F32 { 4 } else { 2 };
        2 * self.n_layers * self.n_kv_heads * self.head_dim * el
    }

    /// Forgets positions `n..` (a later prompt diverged from the cached one there).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    /// Marks positions `..n` as filled (after a forward pass wrote them).
    pub fn set_len(&mut self, n: usize) {
        assert!(
            n <= self.capacity,
            "KV cache overflow: {n} > {}",
            self.capacity
        );
        self.len = n;
    }

    fn base(&self, layer: usize, head: usize, pos: usize) -> usize {
        ((layer * self.n_kv_heads + head) * self.capacity + pos) * self.head_dim
    }

    /// Stores position `pos` of layer `layer`: `k` and `v` hold all KV heads (`n_kv_heads * head_dim`).
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        assert!(pos < self.capacity, "KV cache overflow at position {pos}");
        let hd = self.head_dim;
        for h in 0..self.n_kv_heads {
            let o = self.base(layer, h, pos);
            for (store, src) in [
                (&mut self.k, &k[h * hd..(h + 1) * hd]),
                (&mut self.v, &v[h * hd..(h + 1) * hd]),
            ] {
                match store {
                    Store::F32(d) => d[o..o + hd].copy_from_slice(src),
                    Store::F16(d) => {
                        for (x, &s) in d[o..o + hd].iter_mut().zip(src) {
                            *x = f16::from_f32(s);
                        }
                    }
                }
            }
        }
    }

    /// Keys of (layer, head) for positions `0..n`.
    pub fn keys(&self, layer: usize, head: usize, n: usize) -> KvSlice<'_> {
        self.slice(&self.k, layer, head, n)
    }

    /// Values of (layer, head) for positions `0..n`.
    pub fn values(&self, layer: usize, head: usize, n: usize) -> KvSlice<'_> {
        self.slice(&self.v, layer, head, n)
    }

    fn slice<'a>(&self, s: &'a Store, layer: usize, head: usize, n: usize) -> KvSlice<'a> {
        let o = self.base(layer, head, 0);
        let end = o + n.min(self.capacity) * self.head_dim;
        match s {
            Store::F32(d) => KvSlice::F32(&d[o..end]),
            Store::F16(d) => KvSlice::F16(&d[o..end]),
        }
    }
}
