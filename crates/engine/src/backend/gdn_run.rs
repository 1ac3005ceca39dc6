//! What a Gated DeltaNet op is handed besides its state: a sequence's run of tokens ([`GdnRun`]) and
//! where the state after each of the run's last tokens is kept ([`GdnSteps`], speculative verification).

use super::buf::{View, ViewMut};
use super::cpu::gdn;

/// One sequence's run of tokens through a DeltaNet layer's recurrence: the normalised convolution output
/// `y` (`n × conv_dim`) and the gates `g` (log decay) and `beta` (`n × vh` each).
#[derive(Debug, Clone, Copy)]
pub struct GdnRun<'v> {
    /// Convolution outputs (q and k normalised).
    pub y: View<'v>,
    /// Log decay per token and value head.
    pub g: View<'v>,
    /// β per token and value head.
    pub beta: View<'v>,
    /// Tokens.
    pub n: usize,
}

impl<'v> GdnRun<'v> {
    /// The CPU kernels' view of the run (value head 0; the CPU's loop over the heads sets each).
    pub(super) fn host(&self) -> gdn::HeadRun<'v> {
        gdn::HeadRun {
            y: self.y.host(),
            g: self.g.host(),
            beta: self.beta.host(),
            n: self.n,
            head: 0,
        }
    }
}

/// Where a DeltaNet op keeps the state after each of the last `count` tokens of a run (speculative
/// verification): step `j` of the part of the state an op updates goes to `buf[j · stride + offset..]`.
#[derive(Debug)]
pub struct GdnSteps<'v> {
    /// The steps of a sequence's whole recurrent state.
    pub buf: ViewMut<'v>,
    /// Floats per step.
    pub stride: usize,
    /// Where the op's part (a layer's matrices or window) sits in a step.
    pub offset: usize,
    /// Steps kept.
    pub count: usize,
}

impl GdnSteps<'_> {
    /// The same steps, for the part of the state at `offset`.
    pub fn at(&mut self, offset: usize) -> GdnSteps<'_> {
        GdnSteps {
            buf: self.buf.slice(..),
            stride: self.stride,
            offset,
            count: self.count,
        }
    }

    /// Floats the steps need for a part of `part` floats at the offset.
    pub(crate) fn span(&self, part: usize) -> usize {
        match self.count {
            0 => 0,
            c => (c - 1) * self.stride + self.offset + part,
        }
    }
}

impl<'v> GdnSteps<'v> {
    /// The CPU kernels' view of the steps.
    pub(super) fn host(self) -> gdn::Steps<'v> {
        gdn::Steps {
            buf: self.buf.host(),
            stride: self.stride,
            offset: self.offset,
            count: self.count,
        }
    }
}
