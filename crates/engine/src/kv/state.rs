//! Recurrent state of hybrid models (Gated DeltaNet layers) and its snapshots in the prefix cache.
//!
//! A DeltaNet layer's state (one matrix per value head plus the convolution window) is the whole past folded
//! into a fixed size: unlike attention KV it cannot be truncated to an earlier position, only restored from a
//! copy taken exactly there. So a hybrid model's prefix hit is the deepest position `p` at or below the
//! attention KV match where a **snapshot** exists; the KV is cut back to `p`, the state restored, and
//! prefill resumes from `p`.
//!
//! * Each running sequence carries its live state in a [`Recurrent`], with the position it is valid for,
//!   in the device's memory (a [`Buf`]: the host's on the CPU; on a GPU it moves there at the sequence's
//!   first pass and stays, so a pass neither uploads nor reads back states). Rolling back to a kept step,
//!   and taking or restoring a snapshot, are copies where the state lives (on a GPU, device to device).
//! * [`Snapshots`] keeps copies keyed by a 128-bit hash chain over the token prefix (vLLM's block hashes at
//!   token granularity), so finding the deepest usable snapshot is one hash lookup per matched position.
//!   Snapshots are charged to a byte budget carved out of the KV memory and evicted least recently used,
//!   independently of the KV pages (SGLang keeps two LRUs the same way: states are large and go first).
//! * Where snapshots are taken ([`super::KvCache`] decides): at the end of every prompt, at the end of every
//!   sequence (the next agent turn extends it), at the branch point where a prompt left the cached tokens,
//!   at the last turn boundaries of a prompt (the chat template's message-start token), and every
//!   `snapshot_interval` positions of long prefills. Prefill chunks are cut to end exactly there.
//! * Speculative verification on a hybrid model runs the draft as a chain and keeps the state after each of
//!   its tokens ([`Recurrent::steps`]), so accepting `j` of them restores step `j`: rejected tokens never
//!   touch the state that carries on.

use crate::backend::Buf;
use crate::tokenizer::TokenId;
use std::collections::HashMap;

/// One sequence's recurrent state: every DeltaNet layer's state concatenated (empty for attention-only
/// models), where the device's ops reach it.
#[derive(Debug, Default)]
pub struct Recurrent {
    /// The state after positions `0..len`.
    pub state: Buf,
    /// The position `state` is valid for; [`Recurrent::INVALID`] while a forward pass is changing it.
    pub len: usize,
    /// States after each of the last tokens of the latest speculative pass (`steps_len` states of
    /// `state.len()` floats), for rolling back to the accepted prefix.
    pub steps: Buf,
    /// Position the first kept step is valid for.
    pub steps_from: usize,
    /// States kept in `steps`.
    pub steps_len: usize,
}

impl Recurrent {
    /// [`Recurrent::len`] of a state a pass left half updated.
    pub const INVALID: usize = usize::MAX;

    /// A zero state of `floats` (no positions), in host memory until a pass moves it.
    pub fn zeros(floats: usize) -> Self {
        Recurrent {
            state: vec![0.0; floats].into(),
            ..Recurrent::default()
        }
    }

    /// Makes the state the one after position `pos` was consumed, if a step was kept for it. Returns
    /// whether it could.
    pub fn roll_back_to(&mut self, len: usize) -> bool {
        if len == self.len {
            return true;
        }
        let n = self.state.len();
        if len < self.steps_from || len >= self.steps_from + self.steps_len || n == 0 {
            return false;
        }
        let i = len - self.steps_from;
        self.state.copy_from(0, &self.steps, i * n..(i + 1) * n);
        self.len = len;
        true
    }
}

impl Clone for Recurrent {
    /// A copy where the state lives (on a GPU, allocated there and copied on the device).
    fn clone(&self) -> Self {
        Recurrent {
            state: self.state.duplicate(),
            len: self.len,
            steps: self.steps.duplicate(),
            steps_from: self.steps_from,
            steps_len: self.steps_len,
        }
    }
}

/// The hash chain of a token prefix: `chain(h, t)` is the key of the prefix extended by `t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PrefixHash(u128);

impl PrefixHash {
    /// The key of the empty prefix.
    pub const EMPTY: PrefixHash = PrefixHash(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c834);

    /// The key of this prefix followed by `t`.
    #[inline]
    pub fn then(self, t: TokenId) -> PrefixHash {
        let mix = |mut z: u64| {
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let (hi, lo) = ((self.0 >> 64) as u64, self.0 as u64);
        let t = u64::from(t);
        let lo2 = mix(lo ^ t.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ hi.rotate_left(17));
        let hi2 = mix(hi ^ t.wrapping_add(0x632b_e59b_d9b4_e019) ^ lo2);
        PrefixHash((u128::from(hi2) << 64) | u128::from(lo2))
    }

    /// The key of `tokens`.
    pub fn of(tokens: &[TokenId]) -> PrefixHash {
        tokens.iter().fold(PrefixHash::EMPTY, |h, &t| h.then(t))
    }
}

#[derive(Debug)]
struct Snapshot {
    /// A copy of the state, where the state was.
    data: Buf,
    used: u64,
}

/// Counters of the snapshot store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotStats {
    /// Snapshots held.
    pub held: usize,
    /// Bytes they take.
    pub bytes: usize,
    /// The byte budget.
    pub budget: usize,
    /// Snapshots taken.
    pub taken: u64,
    /// Sequences that started from a snapshot.
    pub restored: u64,
    /// Snapshots evicted for room.
    pub evicted: u64,
}

/// Snapshots of recurrent state keyed by token prefix, under a byte budget, evicted least recently used.
#[derive(Debug, Default)]
pub struct Snapshots {
    map: HashMap<PrefixHash, Snapshot>,
    floats: usize,
    tick: u64,
    stats: SnapshotStats,
}

impl Snapshots {
    /// A store for states of `floats` under `budget` bytes.
    pub fn new(floats: usize, budget: usize) -> Self {
        Snapshots {
            floats,
            stats: SnapshotStats {
                budget,
                ..SnapshotStats::default()
            },
            ..Snapshots::default()
        }
    }

    /// Bytes of one snapshot.
    pub fn snapshot_bytes(&self) -> usize {
        4 * self.floats
    }

    /// Counters.
    pub fn stats(&self) -> SnapshotStats {
        self.stats
    }

    /// Whether a snapshot of this prefix is held.
    pub fn contains(&self, key: &PrefixHash) -> bool {
        self.map.contains_key(key)
    }

    /// Stores a copy of `state` (where it lives) as the state after the prefix `key` (refreshing it if
    /// already held). Evicts the least recently used snapshots for room; a state that does not fit the
    /// budget at all is not kept.
    pub fn put(&mut self, key: PrefixHash, state: &Buf) {
        debug_assert_eq!(state.len(), self.floats);
        self.tick += 1;
        if let Some(s) = self.map.get_mut(&key) {
            s.used = self.tick;
            return;
        }
        let size = self.snapshot_bytes();
        if size == 0 || size > self.stats.budget {
            return;
        }
        while self.stats.bytes + size > self.stats.budget {
            let Some((&victim, _)) = self.map.iter().min_by_key(|(_, s)| s.used) else {
                break;
            };
            self.map.remove(&victim);
            self.stats.bytes -= size;
            self.stats.evicted += 1;
        }
        self.map.insert(
            key,
            Snapshot {
                data: state.duplicate(),
                used: self.tick,
            },
        );
        self.stats.bytes += size;
        self.stats.taken += 1;
        self.stats.held = self.map.len();
    }

    /// A copy of the snapshot of `key`, where it lives (on a GPU, copied on the device), marking it used;
    /// `None` when none is held.
    pub fn restore(&mut self, key: &PrefixHash) -> Option<Buf> {
        self.tick += 1;
        let s = self.map.get_mut(key)?;
        s.used = self.tick;
        self.stats.restored += 1;
        Some(s.data.duplicate())
    }

    /// Drops every snapshot.
    pub fn clear(&mut self) {
        self.stats.evicted += self.map.len() as u64;
        self.map.clear();
        self.stats.bytes = 0;
        self.stats.held = 0;
    }

    /// The deepest `p <= max` such that the prefix `tokens[..p]` has a snapshot (0 when none).
    pub fn deepest(&self, tokens: &[TokenId], max: usize) -> (usize, PrefixHash) {
        let mut best = (0, PrefixHash::EMPTY);
        let mut h = PrefixHash::EMPTY;
        for (i, &t) in tokens[..max.min(tokens.len())].iter().enumerate() {
            h = h.then(t);
            if self.map.contains_key(&h) {
                best = (i + 1, h);
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_chain_distinguishes_prefixes() {
        let a = PrefixHash::of(&[1, 2, 3]);
        assert_eq!(a, PrefixHash::of(&[1, 2]).then(3));
        assert_ne!(a, PrefixHash::of(&[1, 2, 4]));
        assert_ne!(a, PrefixHash::of(&[3, 2, 1]));
        assert_ne!(PrefixHash::of(&[0]), PrefixHash::EMPTY);
        assert_ne!(PrefixHash::of(&[0]), PrefixHash::of(&[0, 0]));
    }

    #[test]
    fn snapshots_are_found_deepest_first_and_evicted_lru() {
        // Room for two snapshots of 4 floats.
        let mut s = Snapshots::new(4, 32);
        let toks = [5, 6, 7, 8, 9];
        let state = |v: f32| Buf::from(vec![v; 4]);
        s.put(PrefixHash::of(&toks[..2]), &state(2.0));
        s.put(PrefixHash::of(&toks[..4]), &state(4.0));
        assert_eq!(s.deepest(&toks, 5).0, 4);
        assert_eq!(s.deepest(&toks, 3).0, 2);
        assert_eq!(s.deepest(&[5, 7, 7, 8], 4).0, 0);
        // Using the shallow one makes the deep one the least recently used.
        let out = s.restore(&PrefixHash::of(&toks[..2])).unwrap();
        assert_eq!(out.to_vec(), [2.0; 4]);
        s.put(PrefixHash::of(&toks[..5]), &state(5.0));
        assert_eq!(s.stats().held, 2);
        assert_eq!(s.stats().evicted, 1);
        assert!(!s.contains(&PrefixHash::of(&toks[..4])));
        assert_eq!(s.deepest(&toks, 5).0, 5);
        assert_eq!(s.stats().bytes, 32);
        // A state larger than the whole budget is not kept.
        let mut tiny = Snapshots::new(16, 32);
        tiny.put(PrefixHash::EMPTY, &Buf::from(vec![0.0; 16]));
        assert_eq!(tiny.stats().held, 0);
    }

    #[test]
    fn steps_roll_back_only_where_kept() {
        let mut r = Recurrent::zeros(2);
        r.len = 12;
        r.steps = vec![10.0, 10.0, 11.0, 11.0, 12.0, 12.0].into();
        r.steps_from = 10;
        r.steps_len = 3;
        assert!(r.roll_back_to(12));
        assert!(r.roll_back_to(11));
        assert_eq!((r.state.to_vec(), r.len), (vec![11.0, 11.0], 11));
        assert!(!r.roll_back_to(9));
        assert!(r.roll_back_to(10));
        assert_eq!(r.state.to_vec(), vec![10.0, 10.0]);
    }
}
