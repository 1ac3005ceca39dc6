//! The page pool: every page of KV memory the cache may use, allocated once, handed out by refcount.
//!
//! A page holds `page_size` consecutive positions of one sequence for every layer and KV head. Inside a page
//! the layout is `[layer][kv head][position][head_dim]` for keys and the same for values, so attention for
//! one (layer, head) streams a page's keys as one contiguous run, and copying a page (copy-on-write) is one
//! `memcpy` per (layer, head).
//!
//! FP8 pages carry one power-of-two scale per (page, layer, KV head) for keys and one for values. A row
//! whose largest magnitude does not fit the current scale doubles it (as often as needed) and shifts the
//! page's stored bytes down to match, which is exact for normal numbers.
//!
//! The stores are host memory, or on a GPU plain device memory ([`PagePool::on`]) that the host never
//! addresses: the pool's copies (copy-on-write, a draft's accepted rows) run as the GPU's kernels in order
//! with its other work ([`PageDevice`]), and the host reads such a pool only as a whole copy
//! ([`PagePool::to_host`]: tests, inspection). The kernels take the pool by reference
//! ([`PagePool::raw_parts`]).

use super::fp8::{self, e4m3_decode, e4m3_encode, e4m3_scale};
use super::{Device, DeviceError};
use half::f16;
use std::sync::Arc;

/// Element type of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 32-bit floats (exact).
    F32,
    /// 16-bit floats (half the memory traffic; ~1e-2 logit differences). The default, like llama.cpp.
    F16,
    /// FP8 E4M3 with a power-of-two scale per (page, layer, KV head): a quarter of f32.
    Fp8,
}

impl KvDtype {
    /// Bytes per element.
    pub fn element_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
            KvDtype::Fp8 => 1,
        }
    }

    /// Its name on the command line (`f32`, `f16`, `fp8`).
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Fp8 => "fp8",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "fp8" | "e4m3" | "fp8_e4m3" => Ok(KvDtype::Fp8),
            _ => Err(format!("unknown KV type {s:?} (f32, f16 or fp8)")),
        }
    }
}

/// The part of a model's shape the cache needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Layers.
    pub n_layers: usize,
    /// KV heads per layer.
    pub n_kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Floats of one sequence's recurrent state (hybrid models' DeltaNet layers; 0 for pure attention).
    pub recurrent: usize,
}

impl KvShape {
    /// Bytes of K and V per position (all layers and heads) at `dtype`.
    pub fn bytes_per_position(&self, dtype: KvDtype) -> usize {
        2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype.element_bytes()
    }
}

/// Keys or values of one page for one (layer, head): `page_size` rows of `head_dim` elements.
#[derive(Debug, Clone, Copy)]
pub enum KvSlice<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// E4M3 bytes; the value is `e4m3_decode(byte) * scale`.
    Fp8 {
        /// The bytes.
        data: &'a [u8],
        /// The page's scale for this (layer, head).
        scale: f32,
    },
}

impl KvSlice<'_> {
    /// Row `pos` as f32, written into `out` (`head_dim` long). The scalar reference of every kernel's load.
    pub fn row_into(&self, pos: usize, out: &mut [f32]) {
        let hd = out.len();
        let r = pos * hd..(pos + 1) * hd;
        match *self {
            KvSlice::F32(d) => out.copy_from_slice(&d[r]),
            KvSlice::F16(d) => half::slice::HalfFloatSliceExt::convert_to_f32_slice(&d[r], out),
            KvSlice::Fp8 { data, scale } => {
                for (o, &b) in out.iter_mut().zip(&data[r]) {
                    *o = fp8::e4m3_decode(b) * scale;
                }
            }
        }
    }

    /// Row `pos` as a new vector (tests and references).
    pub fn row(&self, pos: usize, head_dim: usize) -> Vec<f32> {
        let mut v = vec![0.0; head_dim];
        self.row_into(pos, &mut v);
        v
    }
}

/// Rows of several pages gathered into one page-shaped buffer: how a draft-tree node attends to ancestors
/// stored away from their positions, through the same kernel calls as a chain (so its result is the same).
#[derive(Debug, Default)]
pub struct Gathered {
    f32: Vec<f32>,
    f16: Vec<f16>,
}

impl Gathered {
    /// Gathers rows `0..n`, row `r` being row `src(r).1` of slice `src(r).0`. f32 and f16 rows are copied
    /// as they are; FP8 rows (whose pages may differ in scale) are decoded to f32.
    pub fn gather<'p>(
        &mut self,
        head_dim: usize,
        n: usize,
        mut src: impl FnMut(usize) -> (KvSlice<'p>, usize),
    ) -> KvSlice<'_> {
        let hd = head_dim;
        let first = if n > 0 { Some(src(0).0) } else { None };
        if let Some(KvSlice::F16(_)) = first {
            self.f16.resize(n * hd, f16::ZERO);
            for r in 0..n {
                let (s, slot) = src(r);
                if let KvSlice::F16(d) = s {
                    self.f16[r * hd..(r + 1) * hd].copy_from_slice(&d[slot * hd..(slot + 1) * hd]);
                }
            }
            return KvSlice::F16(&self.f16);
        }
        self.f32.resize(n * hd, 0.0);
        for r in 0..n {
            let (s, slot) = src(r);
            s.row_into(slot, &mut self.f32[r * hd..(r + 1) * hd]);
        }
        KvSlice::F32(&self.f32)
    }
}

/// Index of a page in the pool.
pub type PageId = u32;

/// A device whose memory holds a pool's stores where the host does not address them (a GPU's): it
/// allocates them, runs the pool's copies as its own work (queued in order with the kernels that read and
/// write the pages), and transfers bytes for the host's rare whole-pool reads and single-row writes. A
/// runtime failure inside these is a lost device: it panics, as the device's other ops do.
pub(crate) trait PageDevice: std::fmt::Debug + Send + Sync {
    /// `bytes` of zeroed device memory.
    fn alloc(&self, bytes: usize) -> Result<DeviceRegion, DeviceError>;
    /// [`PagePool::copy`] on the device.
    fn copy_page(&self, pool: &PagePool, src: PageId, dst: PageId, n: usize);
    /// [`PagePool::move_rows`] on the device.
    fn move_rows(&self, pool: &PagePool, moves: &[RowMove]);
    /// Copies `out.len()` bytes from device address `addr`, after the queued work.
    fn read(&self, addr: u64, out: &mut [u8]);
    /// Queues a copy of `data` to device address `addr`, after the queued work.
    fn write(&self, addr: u64, data: &[u8]);
}

/// Device memory a [`PageDevice`] allocated: its address, kept alive (and freed) by its owner.
pub(crate) struct DeviceRegion {
    /// Its device address.
    pub addr: u64,
    /// Its size.
    pub bytes: usize,
    /// What frees it when dropped.
    pub _owner: Box<dyn Send + Sync>,
}

impl std::fmt::Debug for DeviceRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRegion")
            .field("addr", &self.addr)
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// A row to move: `[src page, src slot, dst page, dst slot]` (see [`PagePool::move_rows`]).
pub type RowMove = [u32; 4];

/// Memory a store lives in.
#[derive(Debug)]
enum Region {
    /// Host memory (a zeroed `Vec` is a lazy calloc: pages the cache never uses cost nothing).
    Host(Vec<u64>),
    /// A device's memory, which the host does not address.
    Device(DeviceRegion),
}

impl Region {
    /// `bytes` of zeroed memory: the host's, or `dev`'s.
    fn zeroed(dev: Option<&dyn PageDevice>, bytes: usize) -> Result<Region, DeviceError> {
        Ok(match dev {
            Some(d) => Region::Device(d.alloc(bytes.next_multiple_of(8))?),
            None => Region::Host(vec![0; bytes.div_ceil(8)]),
        })
    }

    fn get<T: bytemuck::Pod>(&self) -> &[T] {
        match self {
            Region::Host(v) => bytemuck::cast_slice(v),
            Region::Device(_) => panic!("{DEVICE_VIEW}"),
        }
    }

    fn get_mut<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        match self {
            Region::Host(v) => bytemuck::cast_slice_mut(v),
            Region::Device(_) => panic!("{DEVICE_VIEW}"),
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Region::Host(v) => v.as_ptr() as u64,
            Region::Device(m) => m.addr,
        }
    }

    /// A host copy (the region itself when it is host memory).
    fn to_host(&self, dev: Option<&dyn PageDevice>) -> Region {
        match (self, dev) {
            (Region::Host(v), _) => Region::Host(v.clone()),
            (Region::Device(m), Some(d)) => {
                let mut v = vec![0u64; m.bytes.div_ceil(8)];
                d.read(m.addr, &mut bytemuck::cast_slice_mut(&mut v)[..m.bytes]);
                Region::Host(v)
            }
            (Region::Device(_), None) => unreachable!("a device pool keeps its device"),
        }
    }
}

/// Why a device pool's pages have no host view.
const DEVICE_VIEW: &str =
    "a GPU pool's pages are device memory: read them through PagePool::to_host";

/// Keys or values: elements (f32, f16 bit patterns, or E4M3 bytes with one f32 scale per page, layer and
/// head).
#[derive(Debug)]
enum Store {
    F32(Region),
    F16(Region),
    Fp8(Region, Region),
}

impl Store {
    fn new(
        dev: Option<&dyn PageDevice>,
        dtype: KvDtype,
        elements: usize,
        scales: usize,
    ) -> Result<Self, DeviceError> {
        let data = Region::zeroed(dev, elements * dtype.element_bytes())?;
        Ok(match dtype {
            KvDtype::F32 => Store::F32(data),
            KvDtype::F16 => Store::F16(data),
            KvDtype::Fp8 => Store::Fp8(data, Region::zeroed(dev, 4 * scales)?),
        })
    }
}

/// Fixed-size pages of KV memory with reference counts and a free list.
#[derive(Debug)]
pub struct PagePool {
    shape: KvShape,
    page_size: usize,
    dtype: KvDtype,
    n_pages: usize,
    k: Store,
    v: Store,
    refs: Vec<u32>,
    free: Vec<PageId>,
    /// The device whose memory the stores are (none: host memory).
    dev: Option<Arc<dyn PageDevice>>,
}

impl PagePool {
    /// A pool of `n_pages` pages of `page_size` positions in host memory.
    pub fn new(shape: KvShape, page_size: usize, dtype: KvDtype, n_pages: usize) -> Self {
        match Self::build(None, shape, page_size, dtype, n_pages) {
            Ok(p) => p,
            Err(e) => unreachable!("host memory: {e}"),
        }
    }

    /// The pool in `dev`'s memory (host memory for the CPU; plain device memory on a GPU, which the host
    /// reads only through [`PagePool::to_host`]).
    pub fn on(
        dev: &Device,
        shape: KvShape,
        page_size: usize,
        dtype: KvDtype,
        n_pages: usize,
    ) -> Result<Self, DeviceError> {
        Self::build(dev.pages(), shape, page_size, dtype, n_pages)
    }

    fn build(
        dev: Option<Arc<dyn PageDevice>>,
        shape: KvShape,
        page_size: usize,
        dtype: KvDtype,
        n_pages: usize,
    ) -> Result<Self, DeviceError> {
        assert!(page_size > 0, "pages hold at least one position");
        let per_page = shape.n_layers * shape.n_kv_heads * page_size * shape.head_dim;
        let scales = shape.n_layers * shape.n_kv_heads * n_pages;
        Ok(PagePool {
            shape,
            page_size,
            dtype,
            n_pages,
            k: Store::new(dev.as_deref(), dtype, per_page * n_pages, scales)?,
            v: Store::new(dev.as_deref(), dtype, per_page * n_pages, scales)?,
            refs: vec![0; n_pages],
            // Popped from the end: low page ids first.
            free: (0..n_pages as PageId).rev().collect(),
            dev,
        })
    }

    /// A copy of the pool in host memory, pages, scales and refcounts alike (a device pool's pages read
    /// back after its queued work): for tests and inspection.
    pub fn to_host(&self) -> PagePool {
        let dev = self.dev.as_deref();
        let store = |s: &Store| match s {
            Store::F32(d) => Store::F32(d.to_host(dev)),
            Store::F16(d) => Store::F16(d.to_host(dev)),
            Store::Fp8(d, sc) => Store::Fp8(d.to_host(dev), sc.to_host(dev)),
        };
        PagePool {
            shape: self.shape,
            page_size: self.page_size,
            dtype: self.dtype,
            n_pages: self.n_pages,
            k: store(&self.k),
            v: store(&self.v),
            refs: self.refs.clone(),
            free: self.free.clone(),
            dev: None,
        }
    }

    /// Bytes one page takes (keys, values and FP8 scales).
    pub fn page_bytes(shape: KvShape, page_size: usize, dtype: KvDtype) -> usize {
        let heads = shape.n_layers * shape.n_kv_heads;
        let scales = if dtype == KvDtype::Fp8 {
            2 * 4 * heads
        } else {
            0
        };
        2 * heads * page_size * shape.head_dim * dtype.element_bytes() + scales
    }

    /// The addresses of the key and value stores and of their FP8 scales (0 for other types), for the
    /// GPU device's kernels (which address the pool where it is).
    pub fn raw_parts(&self) -> (u64, u64, u64, u64) {
        fn parts(s: &Store) -> (u64, u64) {
            match s {
                Store::F32(d) | Store::F16(d) => (d.addr(), 0),
                Store::Fp8(d, sc) => (d.addr(), sc.addr()),
            }
        }
        let ((k, ks), (v, vs)) = (parts(&self.k), parts(&self.v));
        (k, v, ks, vs)
    }

    /// [`PagePool::raw_parts`], for kernels that write the pool (the borrow says so).
    pub fn raw_parts_mut(&mut self) -> (u64, u64, u64, u64) {
        self.raw_parts()
    }

    /// Positions per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// The model's KV shape.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Pages in the pool.
    pub fn total(&self) -> usize {
        self.n_pages
    }

    /// Pages not referenced by anything.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Owners of `page` (sequences and radix-tree nodes).
    pub fn refs(&self, page: PageId) -> u32 {
        self.refs[page as usize]
    }

    /// Takes a free page (refcount 1), or `None` when every page is in use.
    pub fn alloc(&mut self) -> Option<PageId> {
        let p = self.free.pop()?;
        debug_assert_eq!(self.refs[p as usize], 0);
        self.refs[p as usize] = 1;
        if let (Store::Fp8(_, ks), Store::Fp8(_, vs)) = (&mut self.k, &mut self.v) {
            // A fresh page starts unscaled; its first row sets the scale.
            let heads = self.shape.n_layers * self.shape.n_kv_heads;
            let r = p as usize * heads..(p as usize + 1) * heads;
            for sc in [ks, vs] {
                match (&self.dev, sc) {
                    (Some(d), Region::Device(m)) => {
                        d.write(m.addr + 4 * r.start as u64, &vec![0; 4 * heads]);
                    }
                    (_, sc) => sc.get_mut::<f32>()[r.clone()].fill(0.0),
                }
            }
        }
        Some(p)
    }

    /// Adds an owner to `page`.
    pub fn retain(&mut self, page: PageId) {
        let r = &mut self.refs[page as usize];
        assert!(*r > 0, "retain of free page {page}");
        *r += 1;
    }

    /// Drops an owner of `page`; the last one returns it to the free list (and this returns true).
    pub fn release(&mut self, page: PageId) -> bool {
        let r = &mut self.refs[page as usize];
        assert!(*r > 0, "release of free page {page}");
        *r -= 1;
        if *r == 0 {
            self.free.push(page);
            true
        } else {
            false
        }
    }

    fn block(&self, page: PageId, layer: usize, head: usize) -> usize {
        let s = &self.shape;
        (((page as usize * s.n_layers + layer) * s.n_kv_heads + head) * self.page_size) * s.head_dim
    }

    fn scale_index(&self, page: PageId, layer: usize, head: usize) -> usize {
        (page as usize * self.shape.n_layers + layer) * self.shape.n_kv_heads + head
    }

    /// Copies the first `n` positions of `src` into `dst` (copy-on-write of a shared partial page).
    pub fn copy(&mut self, src: PageId, dst: PageId, n: usize) {
        assert!(n <= self.page_size && src != dst);
        if let Some(d) = &self.dev {
            d.copy_page(self, src, dst, n);
            return;
        }
        let (hd, heads) = (
            self.shape.head_dim,
            self.shape.n_layers * self.shape.n_kv_heads,
        );
        let span = self.page_size * hd;
        let (s0, d0) = (self.block(src, 0, 0), self.block(dst, 0, 0));
        let (ss, ds) = (self.scale_index(src, 0, 0), self.scale_index(dst, 0, 0));
        for store in [&mut self.k, &mut self.v] {
            for h in 0..heads {
                let (s, d) = (s0 + h * span, d0 + h * span);
                match store {
                    Store::F32(x) => x.get_mut::<f32>().copy_within(s..s + n * hd, d),
                    Store::F16(x) => x.get_mut::<u16>().copy_within(s..s + n * hd, d),
                    Store::Fp8(x, sc) => {
                        x.get_mut::<u8>().copy_within(s..s + n * hd, d);
                        let sc = sc.get_mut::<f32>();
                        sc[ds + h] = sc[ss + h];
                    }
                }
            }
        }
    }

    /// Copies position `src_slot` of `src` to `dst_slot` of `dst`, every layer and head: one
    /// [`PagePool::move_rows`].
    pub fn copy_row(&mut self, src: PageId, src_slot: usize, dst: PageId, dst_slot: usize) {
        self.move_rows(&[[src, src_slot as u32, dst, dst_slot as u32]]);
    }

    /// Copies rows in order, each `[src page, src slot, dst page, dst slot]`, every layer and head (keeping
    /// a draft's accepted path; no move may read a row an earlier one wrote). FP8 rows are re-encoded at
    /// the destination page's scale. On a GPU, one kernel for all of them.
    pub fn move_rows(&mut self, moves: &[RowMove]) {
        for &[_, s, _, d] in moves {
            assert!(
                (s as usize) < self.page_size && (d as usize) < self.page_size,
                "a row move outside a page"
            );
        }
        if let Some(dev) = &self.dev {
            dev.move_rows(self, moves);
            return;
        }
        let hd = self.shape.head_dim;
        let (layers, heads) = (self.shape.n_layers, self.shape.n_kv_heads);
        for &[src, src_slot, dst, dst_slot] in moves {
            let (src_slot, dst_slot) = (src_slot as usize, dst_slot as usize);
            if let (Store::Fp8(..), Store::Fp8(..)) = (&self.k, &self.v) {
                let (mut k, mut v) = (vec![0.0; heads * hd], vec![0.0; heads * hd]);
                for layer in 0..layers {
                    for h in 0..heads {
                        let r = h * hd..(h + 1) * hd;
                        self.keys(src, layer, h)
                            .row_into(src_slot, &mut k[r.clone()]);
                        self.values(src, layer, h).row_into(src_slot, &mut v[r]);
                    }
                    self.write(dst, dst_slot, layer, &k, &v);
                }
                continue;
            }
            for layer in 0..layers {
                for h in 0..heads {
                    let s = self.block(src, layer, h) + src_slot * hd;
                    let d = self.block(dst, layer, h) + dst_slot * hd;
                    for store in [&mut self.k, &mut self.v] {
                        match store {
                            Store::F32(x) => x.get_mut::<f32>().copy_within(s..s + hd, d),
                            Store::F16(x) => x.get_mut::<u16>().copy_within(s..s + hd, d),
                            Store::Fp8(..) => unreachable!("handled above"),
                        }
                    }
                }
            }
        }
    }

    /// Stores position `slot` of `page` for `layer`: `k` and `v` hold every KV head (`n_kv_heads * head_dim`).
    /// On a device pool each row is a transfer (FP8: its page's rows and scale, read back, changed, and
    /// written): for tests and rare host writes; the device's own kernels write its rows in a pass.
    pub fn write(&mut self, page: PageId, slot: usize, layer: usize, k: &[f32], v: &[f32]) {
        assert!(slot < self.page_size, "slot {slot} outside a page");
        debug_assert!(self.refs[page as usize] > 0, "write to a free page");
        let hd = self.shape.head_dim;
        let span = self.page_size * hd;
        for h in 0..self.shape.n_kv_heads {
            let o = self.block(page, layer, h);
            let si = self.scale_index(page, layer, h);
            for (store, src) in [
                (&mut self.k, &k[h * hd..(h + 1) * hd]),
                (&mut self.v, &v[h * hd..(h + 1) * hd]),
            ] {
                let row = o + slot * hd;
                match (store, self.dev.as_deref()) {
                    (Store::F32(d), Some(dev)) => {
                        dev.write(d.addr() + 4 * row as u64, bytemuck::cast_slice(src));
                    }
                    (Store::F32(d), None) => d.get_mut::<f32>()[row..row + hd].copy_from_slice(src),
                    (Store::F16(d), dev) => {
                        let bits = src.iter().map(|&s| f16::from_f32(s).to_bits());
                        match dev {
                            Some(dev) => {
                                let bits: Vec<u16> = bits.collect();
                                dev.write(d.addr() + 2 * row as u64, bytemuck::cast_slice(&bits));
                            }
                            None => {
                                for (x, b) in d.get_mut::<u16>()[row..row + hd].iter_mut().zip(bits)
                                {
                                    *x = b;
                                }
                            }
                        }
                    }
                    (Store::Fp8(d, scales), Some(dev)) => {
                        let (mut blk, mut scale) = (vec![0u8; span], [0f32]);
                        dev.read(d.addr() + o as u64, &mut blk);
                        dev.read(
                            scales.addr() + 4 * si as u64,
                            bytemuck::cast_slice_mut(&mut scale),
                        );
                        fp8_row(&mut blk, &mut scale[0], slot, src);
                        dev.write(d.addr() + o as u64, &blk);
                        dev.write(scales.addr() + 4 * si as u64, bytemuck::cast_slice(&scale));
                    }
                    (Store::Fp8(d, scales), None) => fp8_row(
                        &mut d.get_mut::<u8>()[o..o + span],
                        &mut scales.get_mut::<f32>()[si],
                        slot,
                        src,
                    ),
                }
            }
        }
    }

    /// Keys of `page` for (`layer`, `head`): all `page_size` positions (only the filled ones mean anything).
    pub fn keys(&self, page: PageId, layer: usize, head: usize) -> KvSlice<'_> {
        self.slice(&self.k, page, layer, head)
    }

    /// Values of `page` for (`layer`, `head`).
    pub fn values(&self, page: PageId, layer: usize, head: usize) -> KvSlice<'_> {
        self.slice(&self.v, page, layer, head)
    }

    fn slice<'a>(&self, s: &'a Store, page: PageId, layer: usize, head: usize) -> KvSlice<'a> {
        let o = self.block(page, layer, head);
        let r = o..o + self.page_size * self.shape.head_dim;
        match s {
            Store::F32(d) => KvSlice::F32(&d.get::<f32>()[r]),
            Store::F16(d) => KvSlice::F16(half::slice::HalfBitsSliceExt::reinterpret_cast(
                &d.get::<u16>()[r],
            )),
            Store::Fp8(d, scales) => KvSlice::Fp8 {
                data: &d.get::<u8>()[r],
                scale: scales.get::<f32>()[self.scale_index(page, layer, head)],
            },
        }
    }
}

/// Writes `src` as row `slot` of an FP8 block (one page's rows of one layer and head, `src.len()` wide)
/// whose scale is `scale`: a row that does not fit raises the scale and shifts the block's rows to it
/// (exact for normal numbers).
fn fp8_row(block: &mut [u8], scale: &mut f32, slot: usize, src: &[f32]) {
    let hd = src.len();
    let amax = src.iter().fold(0f32, |m, x| m.max(x.abs()));
    let need = e4m3_scale(amax);
    if need > *scale {
        if *scale > 0.0 {
            let f = *scale / need;
            for b in block.iter_mut() {
                *b = e4m3_encode(e4m3_decode(*b) * f);
            }
        }
        *scale = need;
    }
    let inv = if *scale > 0.0 { 1.0 / *scale } else { 0.0 };
    for (x, &s) in block[slot * hd..(slot + 1) * hd].iter_mut().zip(src) {
        *x = e4m3_encode(s * inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: KvShape = KvShape {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 8,
        recurrent: 0,
    };

    fn row(seed: usize, scale: f32) -> Vec<f32> {
        (0..SHAPE.n_kv_heads * SHAPE.head_dim)
            .map(|i| ((seed * 31 + i * 7) % 17) as f32 / 8.0 - 1.0)
            .map(|x| x * scale)
            .collect()
    }

    #[test]
    fn refcounts_and_free_list() {
        let mut p = PagePool::new(SHAPE, 4, KvDtype::F32, 3);
        let a = p.alloc().unwrap();
        let b = p.alloc().unwrap();
        let c = p.alloc().unwrap();
        assert_eq!((a, b, c), (0, 1, 2));
        assert!(p.alloc().is_none());
        p.retain(b);
        assert!(!p.release(b));
        assert!(p.release(b));
        assert_eq!(p.free(), 1);
        assert_eq!(p.alloc(), Some(b));
    }

    #[test]
    fn writes_read_back_and_copy_on_write_copies_a_prefix() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Fp8] {
            let mut p = PagePool::new(SHAPE, 4, dtype, 2);
            let (a, b) = (p.alloc().unwrap(), p.alloc().unwrap());
            // Growing magnitudes force FP8 rescales along the way.
            for slot in 0..4 {
                for layer in 0..2 {
                    let s = 1.0 + 10.0 * slot as f32;
                    p.write(a, slot, layer, &row(slot + layer, s), &row(9 + slot, s));
                }
            }
            p.copy(a, b, 3);
            let tol = match dtype {
                KvDtype::F32 => 0.0,
                KvDtype::F16 => 1e-2,
                KvDtype::Fp8 => 0.07,
            };
            for page in [a, b] {
                for slot in 0..3 {
                    for layer in 0..2 {
                        let s = 1.0 + 10.0 * slot as f32;
                        let (k, v) = (row(slot + layer, s), row(9 + slot, s));
                        for h in 0..2 {
                            let hd = SHAPE.head_dim;
                            let got_k = p.keys(page, layer, h).row(slot, hd);
                            let got_v = p.values(page, layer, h).row(slot, hd);
                            for i in 0..hd {
                                let (wk, wv) = (k[h * hd + i], v[h * hd + i]);
                                assert!((got_k[i] - wk).abs() <= tol * wk.abs().max(s / 8.0));
                                assert!((got_v[i] - wv).abs() <= tol * wv.abs().max(s / 8.0));
                            }
                        }
                    }
                }
            }
        }
    }
}
