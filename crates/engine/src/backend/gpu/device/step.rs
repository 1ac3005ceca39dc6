//! A forward pass as a step plan (see [`plan`](crate::backend::gpu::plan)): its inputs staged before
//! its ops, so that a pass seen before is replayed whole.

use super::{GpuDevice, fail};
use crate::backend::DeviceError;
use crate::backend::batch::Batch;
use crate::backend::gpu::plan::StepKey;
use crate::backend::pages::PagePool;
use crate::backend::{Embedding, gpu::launch};

impl GpuDevice {
    /// Stages what `batch`'s ops read (its metadata; its RoPE rows, `(table, angles per position)`,
    /// when the model rotates by the device's table; its embedding rows, dequantized here, when given)
    /// with one upload, and starts the pass under `key`, the model's part of it, which this completes with
    /// what the device derives from the batch and the pool. Returns `true` when the pass was replayed from
    /// its plan (its launches are queued: the model runs none of its ops and reads the results); `false`
    /// when the model runs its ops, recorded until [`GpuDevice::end_step`] (the embedding rows' copy into
    /// place the first of them). An empty key has no plan: the embedding rows are uploaded where they go.
    pub fn begin_step(
        &self,
        key: &mut StepKey,
        pool: &mut PagePool,
        batch: &Batch,
        rope: Option<(&[(f32, f32)], usize)>,
        embed: Option<Embedding<'_>>,
    ) -> Result<bool, DeviceError> {
        if key.is_empty() || batch.is_empty() {
            key.clear();
            if let Some(e) = embed {
                self.embed_rows(&e)?;
            }
            return self.q.begin_step(key);
        }
        let placed = {
            let s = &mut *self.staging();
            let rows = match &embed {
                Some(e) => {
                    Self::dequantize_rows(e, &mut s.rows)?;
                    Some(std::mem::take(&mut s.rows))
                }
                None => None,
            };
            let staged = s.step(
                &self.q,
                batch,
                pool.page_size(),
                self.split_cap(pool),
                rope,
                rows.as_deref(),
            );
            if let Some(r) = rows {
                s.rows = r;
            }
            let inputs = staged?;
            let b = inputs.batch;
            if let Some((_, n_angles)) = rope {
                key.push(n_angles as u64);
            }
            let store = Self::store_mut(pool);
            for v in [
                b.tokens,
                b.n_seqs,
                b.splits,
                b.split_cap,
                b.attend_from,
                usize::from(batch.top_candidates),
                store.page_size,
                store.dtype as usize,
            ] {
                key.push(v as u64);
            }
            for p in [store.k, store.v, store.kscale, store.vscale] {
                key.push(p.0);
            }
            for o in inputs.layout {
                key.push(o as u64);
            }
            embed.map(|e| (inputs.rows, e))
        };
        if let Some((_, e)) = &placed {
            key.push(e.out.ptr().0);
            key.push(e.out.len() as u64);
        }
        let replayed = self.q.begin_step(key)?;
        if !replayed && let Some((Some(src), e)) = placed {
            let (dst, n) = (e.out.ptr(), e.tokens.len() * e.d);
            self.run("the embedding rows", |l| launch::copy(l, dst, src, n));
        }
        Ok(replayed)
    }

    /// Ends the pass [`GpuDevice::begin_step`] started (its launches queued; kept as its key's plan).
    pub fn end_step(&self) {
        if let Err(e) = self.q.end_step() {
            fail("pass", e);
        }
    }

    /// Whether a pass that could be replayed is recorded anyway and checked against its plan (on in the
    /// tests, so that a key that misses something fails them; off, the host time of a replayed pass).
    #[cfg(test)]
    pub(crate) fn verify_steps(&self, on: bool) {
        self.q.rec().plans.verify = on;
    }
}
