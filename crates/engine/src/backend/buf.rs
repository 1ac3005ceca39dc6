//! Activation buffers a device owns, and the views of them its ops take.
//!
//! A [`Buf`] is `f32` storage in its device's memory: a `Vec` on the CPU, device memory on a GPU. The
//! model's per-pass buffers are `Buf`s, grown by [`super::Device::grow`] (only ever grown, so a warm pass
//! allocates nothing), and the ops read and write them through [`View`] and [`ViewMut`]: a range of a
//! buffer, or (on the CPU only) of any host slice, which is what `From` makes of `&[f32]` and `&Vec<f32>`.
//!
//! A GPU op only queues its kernels: what it writes is in device memory and the host never addresses
//! it, so nothing waits until the host asks for the contents. [`Buf::read_back`] (results the host
//! consumes: the logits) and [`Buf::edit`] (host code between ops) are the only ways to reach them, and
//! both wait for the queued work first; `edit` writes its changes back when it ends. Borrowing does the
//! rest: a view of a buffer borrows it, so host code cannot hold its contents while an op is handed the
//! same buffer to write.
//!
//! This module knows no device's types: a buffer in a device's own memory is a [`DeviceMem`] (the GPU
//! wing's `GpuBuf` implements it), addressed by a [`DevPtr`].

use std::marker::PhantomData;
use std::ops::{Bound, Deref, DerefMut, RangeBounds};

/// A device address: a CUDA device pointer, or a host address in the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevPtr(pub u64);

impl DevPtr {
    /// The address `bytes` further on.
    pub fn offset(self, bytes: usize) -> DevPtr {
        DevPtr(self.0 + bytes as u64)
    }
}

/// A [`Buf`]'s storage in a device's own memory, with the host copy that [`Buf::read_back`] and
/// [`Buf::edit`] hand out (the GPU wing's `GpuBuf`).
pub(crate) trait DeviceMem: std::fmt::Debug + Send + Sync {
    /// Floats it holds.
    fn len(&self) -> usize;

    /// Its device address.
    fn ptr(&self) -> DevPtr;

    /// Its first `n` values in the host copy, after the queued work (see [`Buf::read_back`]).
    fn read_back(&mut self, n: usize) -> &mut [f32];

    /// The host copy, as the last whole read-back left it.
    fn host(&self) -> &[f32];

    /// The host copy, to change.
    fn host_mut(&mut self) -> &mut [f32];

    /// Queues the upload of the host copy (the whole buffer): an [`Edit`]'s changes.
    fn write_back(&mut self);

    /// Queues an upload of `data` to values `at..`.
    fn upload(&mut self, at: usize, data: &[f32]);

    /// Copies values `at..at + out.len()` into `out`, after the queued work.
    fn download(&self, at: usize, out: &mut [f32]);

    /// Queues a copy of `n` values from device address `src` to values `at..` (on the device).
    fn copy_in(&mut self, at: usize, src: DevPtr, n: usize);

    /// A new buffer of the same device holding a copy of its values (copied on the device).
    fn duplicate(&self) -> Box<dyn DeviceMem>;
}

/// `f32` storage in a device's memory (see the module docs). The default is an empty host buffer; the
/// first [`super::Device::grow`] on a GPU moves it there.
#[derive(Debug, Default)]
pub struct Buf {
    pub(super) mem: Mem,
}

#[derive(Debug)]
pub(super) enum Mem {
    Host(Vec<f32>),
    Gpu(Box<dyn DeviceMem>),
}

impl Default for Mem {
    fn default() -> Self {
        Mem::Host(Vec::new())
    }
}

impl From<Vec<f32>> for Buf {
    /// A host buffer holding `v` (the CPU's; a GPU op refuses it).
    fn from(v: Vec<f32>) -> Self {
        Buf { mem: Mem::Host(v) }
    }
}

/// `start..end` of a buffer of `len` values.
fn bounds(r: impl RangeBounds<usize>, len: usize) -> (usize, usize) {
    let start = match r.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s + 1,
        Bound::Unbounded => 0,
    };
    let end = match r.end_bound() {
        Bound::Included(&e) => e + 1,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    assert!(
        start <= end && end <= len,
        "range {start}..{end} of a buffer of {len}"
    );
    (start, end)
}

impl Buf {
    /// Values it holds.
    pub fn len(&self) -> usize {
        match &self.mem {
            Mem::Host(v) => v.len(),
            Mem::Gpu(g) => g.len(),
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A range of it, for an op to read.
    pub fn at(&self, r: impl RangeBounds<usize>) -> View<'_> {
        let (s, e) = bounds(r, self.len());
        match &self.mem {
            Mem::Host(v) => View {
                p: Place::Host(&v[s..e]),
            },
            Mem::Gpu(g) => View {
                p: Place::Gpu(g.ptr().offset(4 * s), e - s, PhantomData),
            },
        }
    }

    /// A range of it, for an op to write.
    pub fn at_mut(&mut self, r: impl RangeBounds<usize>) -> ViewMut<'_> {
        let (s, e) = bounds(r, self.len());
        match &mut self.mem {
            Mem::Host(v) => ViewMut {
                p: PlaceMut::Host(&mut v[s..e]),
            },
            Mem::Gpu(g) => ViewMut {
                p: PlaceMut::Gpu(g.ptr().offset(4 * s), e - s, PhantomData),
            },
        }
    }

    /// Its first `n` values where the host consumes them (a pass's logits): on the CPU the buffer itself;
    /// on a GPU a host copy, after the queued work is done. Changes made to it reach the device only on
    /// the CPU; host code that changes a buffer for the ops that follow uses [`Buf::edit`].
    pub fn read_back(&mut self, n: usize) -> &mut [f32] {
        assert!(n <= self.len(), "{n} values of a buffer of {}", self.len());
        match &mut self.mem {
            Mem::Host(v) => &mut v[..n],
            Mem::Gpu(g) => g.read_back(n),
        }
    }

    /// Copies `src`'s values in `range` to values `at..` of this buffer, where they are: on the device
    /// when both are a GPU's (queued after its work), else through the host.
    pub fn copy_from(&mut self, at: usize, src: &Buf, range: std::ops::Range<usize>) {
        let n = range.len();
        assert!(
            at + n <= self.len() && range.end <= src.len(),
            "a copy of {range:?} of {} values to {at}.. of {}",
            src.len(),
            self.len()
        );
        match (&mut self.mem, &src.mem) {
            (Mem::Host(d), Mem::Host(s)) => d[at..at + n].copy_from_slice(&s[range]),
            (Mem::Gpu(d), Mem::Gpu(s)) => d.copy_in(at, s.ptr().offset(4 * range.start), n),
            (Mem::Gpu(d), Mem::Host(s)) => d.upload(at, &s[range]),
            (Mem::Host(d), Mem::Gpu(s)) => s.download(range.start, &mut d[at..at + n]),
        }
    }

    /// Writes `data` to values `at..` (an upload on a GPU, queued after its work).
    pub fn write(&mut self, at: usize, data: &[f32]) {
        assert!(at + data.len() <= self.len(), "a write past the end");
        match &mut self.mem {
            Mem::Host(v) => v[at..at + data.len()].copy_from_slice(data),
            Mem::Gpu(g) => g.upload(at, data),
        }
    }

    /// Its values, copied to the host (after the queued work on a GPU).
    pub fn to_vec(&self) -> Vec<f32> {
        match &self.mem {
            Mem::Host(v) => v.clone(),
            Mem::Gpu(g) => {
                let mut v = vec![0.0; g.len()];
                g.download(0, &mut v);
                v
            }
        }
    }

    /// A copy in the same memory (a GPU's: allocated there and copied on the device).
    pub fn duplicate(&self) -> Buf {
        Buf {
            mem: match &self.mem {
                Mem::Host(v) => Mem::Host(v.clone()),
                Mem::Gpu(g) => Mem::Gpu(g.duplicate()),
            },
        }
    }

    /// Its contents for host code between ops: waits for the queued work (GPU), and writes the changes
    /// back when the guard ends.
    pub fn edit(&mut self) -> Edit<'_> {
        match &mut self.mem {
            Mem::Host(v) => Edit {
                place: EditPlace::Host(v),
            },
            Mem::Gpu(g) => {
                let n = g.len();
                g.read_back(n);
                Edit {
                    place: EditPlace::Device(&mut **g),
                }
            }
        }
    }
}

/// Host access to a [`Buf`] (see [`Buf::edit`]); a GPU buffer gets the changes back when it ends.
#[derive(Debug)]
pub struct Edit<'a> {
    place: EditPlace<'a>,
}

#[derive(Debug)]
enum EditPlace<'a> {
    Host(&'a mut [f32]),
    /// A device buffer, its host copy read back.
    Device(&'a mut dyn DeviceMem),
}

impl Deref for Edit<'_> {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.place {
            EditPlace::Host(h) => h,
            EditPlace::Device(d) => d.host(),
        }
    }
}

impl DerefMut for Edit<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        match &mut self.place {
            EditPlace::Host(h) => h,
            EditPlace::Device(d) => d.host_mut(),
        }
    }
}

impl Drop for Edit<'_> {
    fn drop(&mut self) {
        if let EditPlace::Device(d) = &mut self.place {
            d.write_back();
        }
    }
}

/// A range of floats an op reads: a [`Buf`]'s, or a host slice's.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    p: Place<'a>,
}

#[derive(Debug, Clone, Copy)]
enum Place<'a> {
    Host(&'a [f32]),
    Gpu(DevPtr, usize, PhantomData<&'a Buf>),
}

/// A range of floats an op writes: a [`Buf`]'s, or a host slice's.
#[derive(Debug)]
pub struct ViewMut<'a> {
    p: PlaceMut<'a>,
}

#[derive(Debug)]
enum PlaceMut<'a> {
    Host(&'a mut [f32]),
    Gpu(DevPtr, usize, PhantomData<&'a mut Buf>),
}

impl<'a> View<'a> {
    /// Values in range.
    pub fn len(&self) -> usize {
        match self.p {
            Place::Host(s) => s.len(),
            Place::Gpu(_, n, _) => n,
        }
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A sub-range.
    pub fn slice(self, r: impl RangeBounds<usize>) -> View<'a> {
        let (s, e) = bounds(r, self.len());
        View {
            p: match self.p {
                Place::Host(h) => Place::Host(&h[s..e]),
                Place::Gpu(p, _, m) => Place::Gpu(p.offset(4 * s), e - s, m),
            },
        }
    }

    /// The host slice (the CPU device's views); a GPU buffer here is a caller's bug.
    pub(super) fn host(self) -> &'a [f32] {
        match self.p {
            Place::Host(s) => s,
            Place::Gpu(..) => panic!("a GPU buffer given to a host op"),
        }
    }

    /// The device address (the GPU device's views); a host slice here is a caller's bug.
    pub(super) fn ptr(self) -> DevPtr {
        match self.p {
            Place::Gpu(p, ..) => p,
            Place::Host(_) => panic!("a host slice given to the GPU device (its buffers are Bufs)"),
        }
    }
}

impl<'a> ViewMut<'a> {
    /// Values in range.
    pub fn len(&self) -> usize {
        match &self.p {
            PlaceMut::Host(s) => s.len(),
            PlaceMut::Gpu(_, n, _) => *n,
        }
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A sub-range, for one op.
    pub fn slice(&mut self, r: impl RangeBounds<usize>) -> ViewMut<'_> {
        let (s, e) = bounds(r, self.len());
        ViewMut {
            p: match &mut self.p {
                PlaceMut::Host(h) => PlaceMut::Host(&mut h[s..e]),
                PlaceMut::Gpu(p, _, _) => PlaceMut::Gpu(p.offset(4 * s), e - s, PhantomData),
            },
        }
    }

    /// The same range read-only, for an op that reads what it then writes.
    pub fn as_view(&self) -> View<'_> {
        View {
            p: match &self.p {
                PlaceMut::Host(h) => Place::Host(h),
                PlaceMut::Gpu(p, n, _) => Place::Gpu(*p, *n, PhantomData),
            },
        }
    }

    /// The host slice (the CPU device's views); a GPU buffer here is a caller's bug.
    pub(super) fn host(self) -> &'a mut [f32] {
        match self.p {
            PlaceMut::Host(s) => s,
            PlaceMut::Gpu(..) => panic!("a GPU buffer given to a host op"),
        }
    }

    /// The device address (the GPU device's views); a host slice here is a caller's bug.
    pub(super) fn ptr(&self) -> DevPtr {
        match self.p {
            PlaceMut::Gpu(p, ..) => p,
            PlaceMut::Host(_) => {
                panic!("a host slice given to the GPU device (its buffers are Bufs)")
            }
        }
    }
}

impl<'a> From<&'a [f32]> for View<'a> {
    fn from(s: &'a [f32]) -> Self {
        View { p: Place::Host(s) }
    }
}

impl<'a> From<&'a Vec<f32>> for View<'a> {
    fn from(s: &'a Vec<f32>) -> Self {
        View { p: Place::Host(s) }
    }
}

impl<'a> From<&'a Buf> for View<'a> {
    fn from(b: &'a Buf) -> Self {
        b.at(..)
    }
}

impl<'a> From<&'a mut [f32]> for ViewMut<'a> {
    fn from(s: &'a mut [f32]) -> Self {
        ViewMut {
            p: PlaceMut::Host(s),
        }
    }
}

impl<'a> From<&'a mut Vec<f32>> for ViewMut<'a> {
    fn from(s: &'a mut Vec<f32>) -> Self {
        ViewMut {
            p: PlaceMut::Host(s),
        }
    }
}

impl<'a> From<&'a mut Buf> for ViewMut<'a> {
    fn from(b: &'a mut Buf) -> Self {
        b.at_mut(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_address_the_ranges_they_name() {
        let mut b = Buf::from((0..10).map(|v| v as f32).collect::<Vec<_>>());
        assert_eq!(b.len(), 10);
        assert_eq!(b.at(2..5).host(), &[2.0, 3.0, 4.0]);
        assert_eq!(b.at(..).slice(8..).host(), &[8.0, 9.0]);
        assert_eq!(b.at(3..=3).host(), &[3.0]);
        let mut w = b.at_mut(4..);
        assert_eq!(w.as_view().len(), 6);
        w.slice(1..2).host()[0] = -1.0;
        assert_eq!(b.read_back(6)[5], -1.0);
        b.edit()[0] = 7.0;
        assert_eq!(b.at(..1).host(), &[7.0]);
    }

    #[test]
    #[should_panic(expected = "range 3..11")]
    fn a_range_past_the_end_is_refused() {
        let b = Buf::from(vec![0.0; 10]);
        let _ = b.at(3..11);
    }
}
