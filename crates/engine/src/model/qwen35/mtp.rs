//! The MTP (multi-token prediction) head of Qwen3.6 checkpoints: its inputs from the pass's hidden states,
//! its KV kept with the pass, and its drafts of the next token.

use super::config::unsupported;
use super::{Attention, Layer, Mixer, Qwen35, Scratch};
use crate::backend::{Buf, Device, Matrix};
use crate::kv::{Batch, PagePool, Recurrent};
use crate::model::ModelError;

/// The MTP head: `x = W_eh · [enorm(embed(token)); hnorm(hidden)]`, one gated-attention block, `head_norm`
/// and the shared LM head.
#[derive(Debug)]
pub(super) struct Mtp {
    pub(super) eh: Matrix,
    pub(super) enorm: Buf,
    pub(super) hnorm: Buf,
    pub(super) head_norm: Buf,
    pub(super) layer: Layer,
}

impl Mtp {
    fn attention(&self) -> &Attention {
        match &self.layer.mixer {
            Mixer::Attention(a) => a,
            Mixer::DeltaNet(_) => unreachable!("the MTP block is loaded as an attention block"),
        }
    }
}

impl Qwen35 {
    /// Whether the model has an MTP head.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// The MTP head's inputs for every token of `batch`: `W_eh · [enorm(embed(token t)); hnorm(hidden of
    /// position t − 1)]` into `s.x` (the residual stream), and its attention norm into `s.xb`. The head's row for
    /// token `t` pairs the hidden state before it with it;
    /// it sits at `t`'s position and slot (RoPE is relative, so this equals the usual "position t − 1"
    /// convention while keeping the head's KV at a slot that depends only on tokens `0..=t`, as the prefix
    /// cache requires). A sequence's first row reads the hidden state its [`Recurrent`] holds.
    pub(super) fn mtp_input(
        &self,
        mtp: &Mtp,
        dev: &Device,
        batch: &Batch,
        states: &[Recurrent],
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let d = c.d_model;
        let n = batch.len();
        let ho = c.hidden_offset();
        dev.grow(&mut s.raw, n * 2 * d)?;
        dev.grow(&mut s.cat, n * 2 * d)?;
        {
            // The raw rows, on the host: the embeddings (a host table) and the hidden states before
            // each token from the pass's (a sequence's first row: below, from its state).
            let hn = s.hn.read_back(n * d);
            let mut raw = s.raw.edit();
            for t in 0..n {
                let i = batch.owner[t] as usize;
                let span = &batch.seqs[i];
                let tok = batch.tokens[t] as usize;
                let (e, h) = raw[t * 2 * d..(t + 1) * 2 * d].split_at_mut(d);
                e.copy_from_slice(&self.embd[tok * d..(tok + 1) * d]);
                if span.start + (t - span.first) == 0 {
                    // Position 0 has no hidden state before it (its normed zeros are zeros); its row
                    // is never attended to.
                    h.fill(0.0);
                } else if t > span.first {
                    h.copy_from_slice(&hn[(t - 1) * d..t * d]);
                }
            }
        }
        // A sequence's first row (past position 0): the hidden state its recurrent state holds, copied
        // where the state lives (after the rows above reach the device).
        for (i, span) in batch.seqs.iter().enumerate() {
            if span.len > 0 && span.start > 0 {
                let t = span.first;
                s.raw.copy_from(t * 2 * d + d, &states[i].state, ho..ho + d);
            }
        }
        for t in 0..n {
            let (e, h) = (t * 2 * d, t * 2 * d + d);
            dev.rmsnorm_rows(s.raw.at(e..h), &mtp.enorm, c.eps, 1, d, s.cat.at_mut(e..h));
            let end = h + d;
            dev.rmsnorm_rows(
                s.raw.at(h..end),
                &mtp.hnorm,
                c.eps,
                1,
                d,
                s.cat.at_mut(h..end),
            );
        }
        let cat = dev.input(&s.cat, n, 2 * d, &mut s.ws);
        dev.matmul(&mtp.eh, &cat, &mut s.x);
        dev.rmsnorm_rows(&s.x, &mtp.layer.norm, c.eps, n, d, &mut s.xb);
        Ok(())
    }

    /// After a pass: keeps each sequence's final hidden state (and those of its kept steps) and writes the
    /// MTP head's KV for the pass's tokens (its rows need only K and V: their outputs are the drafts of
    /// positions already decided).
    pub(super) fn mtp_fill(
        &self,
        mtp: &Mtp,
        dev: &Device,
        pool: &mut PagePool,
        batch: &Batch,
        states: &mut [Recurrent],
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let d = c.d_model;
        let n = batch.len();
        let ho = c.hidden_offset();
        let floats = c.state_floats();
        dev.grow(&mut s.hn, n * d)?;
        dev.rmsnorm_rows(&s.x, self.head.norm(), c.eps, n, d, &mut s.hn);
        self.mtp_input(mtp, dev, batch, states, s)?;
        let a = mtp.attention();
        self.project_kv(a, dev, pool, batch, n, s, false)?;
        // Copied where the states live (on a GPU, on the device: nothing read back).
        for (st, span) in states.iter_mut().zip(&batch.seqs) {
            let last = span.first + span.len - 1;
            st.state.copy_from(ho, &s.hn, last * d..(last + 1) * d);
            for j in 0..st.steps_len {
                let row = span.first + span.len - st.steps_len + j;
                st.steps
                    .copy_from(j * floats + ho, &s.hn, row * d..(row + 1) * d);
            }
        }
        Ok(())
    }

    /// The MTP head's logits for the token after `batch`'s single token per sequence: each sequence's
    /// `states[i]` holds the hidden state of the position before it. The head's KV for that position is
    /// written (the sequence must own the page; the next pass writes the same row again). Returns `vocab`
    /// logits per sequence, or nothing for a model without a head.
    pub fn mtp_draft<'s>(
        &self,
        dev: &Device,
        pool: &mut PagePool,
        batch: &mut Batch,
        states: &[Recurrent],
        s: &'s mut Scratch,
    ) -> Result<&'s mut [f32], ModelError> {
        let c = &self.cfg;
        let Some(mtp) = &self.mtp else {
            return Ok(&mut []);
        };
        let n = batch.len();
        if n == 0 || batch.seqs.iter().any(|sp| sp.len != 1) || states.len() != batch.seqs.len() {
            return Err(unsupported("an MTP draft takes one token per sequence"));
        }
        if pool.shape() != c.kv_shape() {
            return Err(unsupported("the KV pool was made for another model"));
        }
        let d = c.d_model;
        let (nh, hd) = (c.n_heads, c.head_dim);
        dev.grow(&mut s.xb, n * d)?;
        dev.grow(&mut s.q, n * nh * hd)?;
        dev.grow(&mut s.att, n * nh * hd)?;
        dev.grow(&mut s.hn, n * d)?;
        self.grow_rope(batch, s);
        batch.attend_from = 1;
        let attended = self.mtp_input(mtp, dev, batch, states, s).and_then(|()| {
            let a = mtp.attention();
            self.attention(a, dev, pool, batch, n, s)
        });
        batch.attend_from = 0;
        attended?;
        dev.add(s.x.at_mut(..n * d), s.mix.at(..n * d));
        self.mlp(&mtp.layer, dev, n, s)?;
        dev.rmsnorm_rows(&s.x, &mtp.head_norm, c.eps, n, d, &mut s.xb);
        let x = dev.input(&s.xb, n, d, &mut s.ws);
        dev.matmul(self.head.output().matrix(), &x, &mut s.head.logits);
        Ok(s.head.logits.read_back(n * c.vocab))
    }
}
