//! The GPU device's own staging: what its ops upload (a batch's metadata, RoPE rows) and the scratch they
//! write (attention partials, DeltaNet work), reused across calls. A decode step asks for the same
//! batch metadata and RoPE rows in every layer: they are built and uploaded once, and each later op of
//! the step only hands the staged copy to its segment (one lock of the queue, no upload). A pass that
//! starts as a step ([`Staging::step`]) stages all of its inputs (metadata, RoPE rows, embedding rows)
//! in one buffer with one upload.

use crate::backend::DeviceError;
use crate::backend::batch::{Batch, SeqSpan};
use crate::backend::gpu::launch::{BatchMeta, DevBatch, DevPtr};
use crate::backend::gpu::mem::DevVec;
use crate::backend::gpu::runtime::Queue;
use crate::backend::pages::PageId;

/// The batch metadata in device memory, one staging per array.
#[derive(Debug, Default)]
struct MetaBufs {
    table: DevVec,
    meta: DevVec,
    seen: DevVec,
    dst: DevVec,
    seqs: DevVec,
}

/// What [`BatchMeta::build`] reads of a batch, kept to tell whether the next batch is the same one.
#[derive(Debug, Default)]
struct BatchKey {
    table: Vec<PageId>,
    seqs: Vec<SeqSpan>,
    owner: Vec<u32>,
    pos: Vec<u32>,
    parent: Vec<u32>,
    direct: Vec<u32>,
    attend_from: usize,
    page_size: usize,
    split_cap: usize,
}

impl BatchKey {
    fn matches(&self, b: &Batch, page_size: usize, split_cap: usize) -> bool {
        self.page_size == page_size
            && self.split_cap == split_cap
            && self.attend_from == b.attend_from
            && self.pos == b.pos
            && self.table == b.table
            && self.seqs == b.seqs
            && self.owner == b.owner
            && self.direct == b.direct
            && self.parent == b.parent
    }

    fn set(&mut self, b: &Batch, page_size: usize, split_cap: usize) {
        self.split_cap = split_cap;
        self.table.clone_from(&b.table);
        self.seqs.clone_from(&b.seqs);
        self.owner.clone_from(&b.owner);
        self.pos.clone_from(&b.pos);
        self.parent.clone_from(&b.parent);
        self.direct.clone_from(&b.direct);
        self.attend_from = b.attend_from;
        self.page_size = page_size;
    }
}

/// The device's own staging (RoPE rows and positions, batch metadata, attention partials, embedding
/// rows), reused across calls.
#[derive(Debug, Default)]
pub(super) struct Staging {
    meta: BatchMeta,
    dev_meta: MetaBufs,
    /// The batch `dev_meta` holds the metadata of, and what it gave (`None`: none yet, or an upload of
    /// it failed).
    staged: Option<DevBatch>,
    key: BatchKey,
    pub(super) partials: DevVec,
    /// The attention merge's counters: zero on the device whenever no launch is running.
    counters: DevVec,
    zeros: Vec<u8>,
    table: Vec<f32>,
    dev_table: DevVec,
    pos: Vec<i32>,
    dev_pos: DevVec,
    pub(super) rows: Vec<f32>,
    /// The chunked DeltaNet's per-head scratch.
    pub(super) gdn_work: DevVec,
    /// A step's inputs in one buffer ([`Staging::step`]), its host bytes, and its sections' capacities.
    inputs: DevVec,
    blob: Vec<u8>,
    sections: [usize; SECTIONS],
    /// Whether the staged batch's arrays are in `inputs` (else in `dev_meta`).
    staged_in_inputs: bool,
    /// Where `inputs` holds RoPE rows, and what they were built from.
    rope_staged: Option<(DevPtr, DevPtr)>,
    rope_key: RopeKey,
}

/// What RoPE rows are built from: the positions, pairs per position, and the angle table's address and
/// length (a model's own table).
#[derive(Debug, Default)]
struct RopeKey {
    positions: Vec<u32>,
    n_angles: usize,
    table: (usize, usize),
}

impl RopeKey {
    fn matches(&self, positions: &[u32], table: &[(f32, f32)], n_angles: usize) -> bool {
        self.n_angles == n_angles
            && self.table == (table.as_ptr() as usize, table.len())
            && self.positions == positions
    }
}

/// Sections of a step's inputs: the five metadata arrays, RoPE positions and rows, embedding rows.
const SECTIONS: usize = 8;

/// Where a step's inputs are in device memory ([`Staging::step`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct StepInputs {
    pub(super) batch: DevBatch,
    /// The embedding rows, when staged.
    pub(super) rows: Option<DevPtr>,
    /// Each section's offset in the buffer: a pass recorded at other offsets read other addresses.
    pub(super) layout: [usize; SECTIONS],
}

impl Staging {
    /// `batch`'s metadata in device memory (over pages of `page_size`, at most `split_cap` attention
    /// splits a token): built and uploaded when the batch differs from the last one asked for (in what the
    /// metadata is built from), else the staged copy, handed to the current segment.
    pub(super) fn batch(
        &mut self,
        rt: &Queue,
        batch: &Batch,
        page_size: usize,
        split_cap: usize,
    ) -> Result<DevBatch, DeviceError> {
        if let Some(b) = self.staged
            && self.key.matches(batch, page_size, split_cap)
        {
            if self.staged_in_inputs {
                DevVec::put_all(rt, [(&mut self.inputs, None)])?;
                return Ok(b);
            }
            let d = &mut self.dev_meta;
            DevVec::put_all(
                rt,
                [
                    (&mut d.table, None),
                    (&mut d.meta, None),
                    (&mut d.seen, None),
                    (&mut d.dst, None),
                    (&mut d.seqs, None),
                ],
            )?;
            return Ok(b);
        }
        self.staged = None;
        self.meta.build(batch, page_size, split_cap)?;
        let (m, d) = (&self.meta, &mut self.dev_meta);
        let ptrs = DevVec::put_all(
            rt,
            [
                (&mut d.table, Some(bytemuck::cast_slice(&m.table))),
                (&mut d.meta, Some(bytemuck::cast_slice(&m.meta))),
                (&mut d.seen, Some(bytemuck::cast_slice(&m.seen))),
                (&mut d.dst, Some(bytemuck::cast_slice(&m.dst))),
                (&mut d.seqs, Some(bytemuck::cast_slice(&m.seqs))),
            ],
        )?;
        let b = m.on_device(ptrs);
        Ok(self.stage(b, batch, page_size, split_cap, false))
    }

    /// Remembers `b` as `batch`'s staged metadata (in `inputs`, or in `dev_meta`).
    fn stage(
        &mut self,
        b: DevBatch,
        batch: &Batch,
        page_size: usize,
        split_cap: usize,
        in_inputs: bool,
    ) -> DevBatch {
        self.key.set(batch, page_size, split_cap);
        self.staged = Some(b);
        self.staged_in_inputs = in_inputs;
        b
    }

    /// At least `bytes` of zeros in device memory, for the attention merge's counters (each launch leaves
    /// them zero, so they are uploaded only when they grow).
    pub(super) fn counters(&mut self, rt: &Queue, bytes: usize) -> Result<DevPtr, DeviceError> {
        if self.zeros.len() < bytes {
            self.zeros.resize(bytes, 0);
        }
        self.counters.put(rt, &self.zeros)
    }

    /// The RoPE rows of `positions` (`n_angles` pairs each, from `table`) as a table the kernels read at
    /// positions `0..positions.len()`, in device memory: (positions, table).
    pub(super) fn rope_rows(
        &mut self,
        rt: &Queue,
        positions: &[u32],
        table: &[(f32, f32)],
        n_angles: usize,
    ) -> Result<(DevPtr, DevPtr), DeviceError> {
        if let Some(ptrs) = self.rope_staged
            && self.rope_key.matches(positions, table, n_angles)
        {
            DevVec::put_all(rt, [(&mut self.inputs, None)])?;
            return Ok(ptrs);
        }
        self.build_rope(positions, table, n_angles);
        let [pos, table] = DevVec::put_all(
            rt,
            [
                (&mut self.dev_pos, Some(bytemuck::cast_slice(&self.pos))),
                (&mut self.dev_table, Some(bytemuck::cast_slice(&self.table))),
            ],
        )?;
        Ok((pos, table))
    }

    /// The RoPE rows of `positions` into `table` and `pos` (see [`Staging::rope_rows`]).
    fn build_rope(&mut self, positions: &[u32], table: &[(f32, f32)], n_angles: usize) {
        self.table.clear();
        self.pos.clear();
        for (t, &p) in positions.iter().enumerate() {
            let p = p as usize;
            self.table.extend(
                table[p * n_angles..(p + 1) * n_angles]
                    .iter()
                    .flat_map(|&(c, si)| [c, si]),
            );
            self.pos.push(t as i32);
        }
    }

    /// Stages a step's inputs with one upload: `batch`'s metadata (as [`Staging::batch`]), its RoPE rows
    /// `(table, pairs per position)` when given (as [`Staging::rope_rows`]), and the embedding rows in
    /// `rows` (n × d floats) when given. Each goes to a section of one buffer, whose sections keep their
    /// capacity (a power of two) from step to step, so a decode step's addresses stay where they were;
    /// the ops of the pass then find the batch and RoPE rows staged.
    pub(super) fn step(
        &mut self,
        rt: &Queue,
        batch: &Batch,
        page_size: usize,
        split_cap: usize,
        rope: Option<(&[(f32, f32)], usize)>,
        rows: Option<&[f32]>,
    ) -> Result<StepInputs, DeviceError> {
        self.staged = None;
        self.rope_staged = None;
        self.meta.build(batch, page_size, split_cap)?;
        let positions = &batch.pos[..batch.len()];
        if let Some((table, n_angles)) = rope {
            self.build_rope(positions, table, n_angles);
        }
        let m = &self.meta;
        let parts: [&[u8]; SECTIONS] = [
            bytemuck::cast_slice(&m.table),
            bytemuck::cast_slice(&m.meta),
            bytemuck::cast_slice(&m.seen),
            bytemuck::cast_slice(&m.dst),
            bytemuck::cast_slice(&m.seqs),
            if rope.is_some() {
                bytemuck::cast_slice(&self.pos)
            } else {
                &[]
            },
            if rope.is_some() {
                bytemuck::cast_slice(&self.table)
            } else {
                &[]
            },
            rows.map_or(&[][..], bytemuck::cast_slice),
        ];
        let mut layout = [0usize; SECTIONS];
        let mut at: usize = 0;
        for (i, p) in parts.iter().enumerate() {
            if p.len() > self.sections[i] {
                self.sections[i] = p.len().next_power_of_two().max(64);
            }
            layout[i] = at;
            at += self.sections[i];
        }
        // Up to the end of the last section's contents: the capacity after it is never read.
        self.blob
            .resize(layout[SECTIONS - 1] + parts[SECTIONS - 1].len(), 0);
        for (p, &o) in parts.iter().zip(&layout) {
            self.blob[o..o + p.len()].copy_from_slice(p);
        }
        let base = self.inputs.put(rt, &self.blob)?;
        let ptr = |i: usize| base.offset(layout[i]);
        let b = m.on_device(std::array::from_fn(ptr));
        let b = self.stage(b, batch, page_size, split_cap, true);
        if let Some((table, n_angles)) = rope {
            // The key's buffer is reused: nothing is allocated a step.
            let key = &mut self.rope_key;
            key.positions.clear();
            key.positions.extend_from_slice(positions);
            key.n_angles = n_angles;
            key.table = (table.as_ptr() as usize, table.len());
            self.rope_staged = Some((ptr(5), ptr(6)));
        }
        Ok(StepInputs {
            batch: b,
            rows: rows.map(|_| ptr(7)),
            layout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::batch::{Logits, NO_PARENT};
    use crate::backend::gpu::runtime::GpuRuntime;
    use crate::backend::gpu::sim::Counting;
    use std::sync::Arc;

    /// One sequence's decode token at `pos` over `pages`.
    fn decode(b: &mut Batch, pages: &[PageId], pos: u32) {
        b.clear();
        b.tokens.push(5);
        b.table.extend_from_slice(pages);
        b.seqs.push(SeqSpan {
            table: 0,
            pages: pages.len(),
            start: pos as usize,
            first: 0,
            len: 1,
        });
        b.logits.push(Logits::Last);
        b.owner.push(0);
        b.pos.push(pos);
        b.parent.push(NO_PARENT);
        b.direct.push(u32::MAX);
    }

    fn table(rt: &Counting, b: &DevBatch, n: usize) -> Vec<i32> {
        let mut bytes = vec![0u8; 4 * n];
        rt.download(b.table, &mut bytes).unwrap();
        bytemuck::cast_slice(&bytes).to_vec()
    }

    #[test]
    fn a_batch_is_staged_once_and_again_when_it_changes_in_place() {
        let rt = Counting::new();
        let q = Queue::new(Arc::clone(&rt) as Arc<dyn GpuRuntime>);
        let (mut s, mut b) = (Staging::default(), Batch::default());
        decode(&mut b, &[3, 7], 20);
        let first = s.batch(&q, &b, 16, 4).unwrap();
        assert_eq!(table(&rt, &first, 2), [3, 7]);
        rt.take();
        // The same batch again (every layer of a step): the staged copy, nothing uploaded.
        for _ in 0..30 {
            assert_eq!(s.batch(&q, &b, 16, 4).unwrap(), first);
        }
        assert_eq!(rt.take().uploads, 0);
        // The same Batch value refilled with a page moved: built and uploaded again.
        decode(&mut b, &[3, 9], 20);
        let moved = s.batch(&q, &b, 16, 4).unwrap();
        assert_eq!(table(&rt, &moved, 2), [3, 9]);
        assert!(rt.take().uploads > 0);
        // The next position, or another page size: new metadata too.
        decode(&mut b, &[3, 9], 21);
        let next = s.batch(&q, &b, 16, 4).unwrap();
        assert!(rt.take().uploads > 0, "the next position");
        assert_eq!(next.splits, moved.splits);
        s.batch(&q, &b, 32, 4).unwrap();
        assert!(rt.take().uploads > 0, "another page size");
    }
}
