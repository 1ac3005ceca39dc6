//! Launches of the KV cache's kernels: the page pool's layout in device memory ([`KvStore`]), a pass's
//! batch metadata ([`BatchMeta`]), the KV writes, the fused RoPE + KV write, and paged attention.

use super::*;

/// The KV page pool in device memory, laid out as the CPU's [`PagePool`](crate::backend::pages::PagePool): element
/// `(page, layer, kv head, slot, d)` at `(((page · layers + layer) · kv heads + head) · page_size + slot) ·
/// head_dim + d`; FP8 pools have one f32 scale per `(page, layer, kv head)` for keys and one for values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvStore {
    /// Keys.
    pub k: DevPtr,
    /// Values.
    pub v: DevPtr,
    /// Key scales (FP8).
    pub kscale: DevPtr,
    /// Value scales (FP8).
    pub vscale: DevPtr,
    /// Element type.
    pub dtype: KvDtype,
    /// The model's KV shape.
    pub shape: KvShape,
    /// Positions per page.
    pub page_size: usize,
}

/// Positions per attention tile (`ATTN_TILE` in attention.cu): a block's splits are whole tiles, each
/// scored and weighed at once with an online softmax across them.
pub const ATTENTION_TILE: usize = 64;

/// Batches of at most this many tokens run attention on a grid of [`split_cap`] splits per item (a decode
/// step, a draft tree: too few items to fill the GPU otherwise); larger ones one block per item, which runs
/// the token's splits in order. Either gives the same bits.
pub const SPLIT_TOKENS: usize = 64;

/// The most splits a token's positions are cut into on a GPU of `sms` multiprocessors for a model of
/// `n_kv_heads`: about two blocks per multiprocessor for one token. From the device and the model only,
/// never the batch, so that a token's attention is the same bits in any batch.
pub fn split_cap(sms: usize, n_kv_heads: usize) -> usize {
    (2 * sms).div_ceil(n_kv_heads.max(1)).clamp(1, 256)
}
/// The largest query group and head width the attention kernels take.
pub const ATTENTION_MAX_GROUP: usize = 16;
/// See [`ATTENTION_MAX_GROUP`].
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;

/// What the attention and KV-write kernels read about a batch, built on the host into reused buffers
/// (i32, as the kernels read them) and copied to the device before the layers run.
#[derive(Debug, Default, Clone)]
pub struct BatchMeta {
    /// Every sequence's page table, concatenated.
    pub table: Vec<i32>,
    /// Per token: page table offset, positions seen, first position not in place, offset into `seen`.
    pub meta: Vec<i32>,
    /// The slots of draft-tree ancestors that are not in place, per token from its `direct` position on.
    pub seen: Vec<i32>,
    /// Per token: the page and slot its KV row is written to.
    pub dst: Vec<i32>,
    /// Per sequence: first token and tokens (the FP8 writer's order).
    pub seqs: Vec<i32>,
    /// Per token: its position (RoPE).
    pub pos: Vec<i32>,
    /// The attention grid's rows: [`BatchMeta::split_cap`] for a batch of at most [`SPLIT_TOKENS`] (a
    /// block per split; those past a token's splits return at once, so the launch, and a decode step's
    /// CUDA graph, is the same at any depth), else 1 (a block per item runs its splits in order).
    pub splits: usize,
    /// The most splits a token's positions are cut into ([`split_cap`]).
    pub split_cap: usize,
    /// Positions before this are not attended to.
    pub attend_from: usize,
}

impl BatchMeta {
    /// Fills the buffers for `batch` over pages of `page_size` positions, cutting each token's positions
    /// into at most `split_cap` attention splits.
    pub fn build(
        &mut self,
        batch: &Batch,
        page_size: usize,
        split_cap: usize,
    ) -> Result<(), DeviceError> {
        let i = |v: usize| int(v, "a batch index");
        self.table.clear();
        for &p in &batch.table {
            self.table.push(i(p as usize)?);
        }
        self.meta.clear();
        self.seen.clear();
        self.dst.clear();
        self.pos.clear();
        for t in 0..batch.len() {
            let (span, slot) = batch.locate(t);
            let npos = batch.position(t) + 1;
            let direct = (batch.direct[t] as usize).min(npos);
            self.meta
                .extend([i(span.table)?, i(npos)?, i(direct)?, i(self.seen.len())?]);
            for p in direct..npos {
                self.seen.push(i(batch.slot_seen(t, p))?);
            }
            let page = batch.pages(span)[slot / page_size];
            self.dst.extend([i(page as usize)?, i(slot % page_size)?]);
            self.pos.push(i(batch.position(t))?);
        }
        self.seqs.clear();
        for s in &batch.seqs {
            self.seqs.extend([i(s.first)?, i(s.len)?]);
        }
        self.split_cap = split_cap.max(1);
        self.splits = if batch.len() <= SPLIT_TOKENS {
            self.split_cap
        } else {
            1
        };
        self.attend_from = batch.attend_from;
        Ok(())
    }

    /// The metadata as the kernels take it, its arrays `[table, meta, seen, dst, seqs]` at these device
    /// addresses.
    pub fn on_device(&self, [table, meta, seen, dst, seqs]: [DevPtr; 5]) -> DevBatch {
        DevBatch {
            table,
            meta,
            seen,
            dst,
            seqs,
            tokens: self.meta.len() / 4,
            n_seqs: self.seqs.len() / 2,
            splits: self.splits,
            split_cap: self.split_cap,
            attend_from: self.attend_from,
        }
    }
}

/// [`BatchMeta`]'s buffers in device memory, and the numbers the kernels take by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevBatch {
    /// [`BatchMeta::table`].
    pub table: DevPtr,
    /// [`BatchMeta::meta`].
    pub meta: DevPtr,
    /// [`BatchMeta::seen`].
    pub seen: DevPtr,
    /// [`BatchMeta::dst`].
    pub dst: DevPtr,
    /// [`BatchMeta::seqs`].
    pub seqs: DevPtr,
    /// Tokens.
    pub tokens: usize,
    /// Sequences.
    pub n_seqs: usize,
    /// [`BatchMeta::splits`].
    pub splits: usize,
    /// [`BatchMeta::split_cap`].
    pub split_cap: usize,
    /// [`BatchMeta::attend_from`].
    pub attend_from: usize,
}

impl DevBatch {
    /// Floats of attention partials for `n_kv_heads` heads of `group` queries of `head_dim` (none for a
    /// grid of one row: its blocks write the outputs).
    pub fn partial_floats(&self, n_kv_heads: usize, group: usize, head_dim: usize) -> usize {
        if self.splits == 1 {
            return 0;
        }
        self.tokens * n_kv_heads * self.splits * group * (head_dim + 2)
    }
}

fn kv_args(kv: &KvStore) -> Result<[Arg; 4], DeviceError> {
    Ok([
        Arg::I32(int(kv.shape.n_kv_heads, "KV heads")?),
        Arg::I32(int(kv.shape.head_dim, "a head width")?),
        Arg::I32(int(kv.page_size, "a page size")?),
        Arg::I32(int(kv.shape.n_layers, "layers")?),
    ])
}

/// Writes the batch's new rows of `layer` into their pages: token `t`'s keys (KV heads × head_dim floats)
/// at `k + 4 · t · stride`, its values likewise at `v` (the K and V parts of fused QKV rows).
pub fn write_kv(
    l: &dyn Launcher,
    kv: &KvStore,
    b: &DevBatch,
    layer: usize,
    k: DevPtr,
    v: DevPtr,
    stride: usize,
) -> Result<(), DeviceError> {
    if b.tokens == 0 {
        return Ok(());
    }
    if stride < kv.shape.n_kv_heads * kv.shape.head_dim {
        return Err(unsupported(format!("KV rows {stride} floats apart")));
    }
    let src_stride = Arg::I32(int(stride, "a row stride")?);
    let [heads, hd, ps, layers] = kv_args(kv)?;
    let layer = Arg::I32(int(layer, "a layer")?);
    let (k, v) = (Arg::Ptr(k), Arg::Ptr(v));
    let (ks, vs) = (Arg::Ptr(kv.k), Arg::Ptr(kv.v));
    let m = &thorn_kernels::KV_WRITE;
    if kv.dtype == KvDtype::Fp8 {
        let shape = Shape {
            grid: [
                int(kv.shape.n_kv_heads, "KV heads")? as u32,
                int(b.n_seqs, "sequences")? as u32,
                1,
            ],
            block: [128, 1, 1],
            shared: 0,
        };
        let (ksc, vsc) = (Arg::Ptr(kv.kscale), Arg::Ptr(kv.vscale));
        let args = [
            k,
            v,
            ks,
            vs,
            ksc,
            vsc,
            Arg::Ptr(b.dst),
            Arg::Ptr(b.seqs),
            heads,
            hd,
            ps,
            layers,
            layer,
            src_stride,
        ];
        return l.launch(m, "kv_write_fp8", shape, &args);
    }
    let n = b.tokens * kv.shape.n_kv_heads * kv.shape.head_dim;
    let tokens = Arg::I32(int(b.tokens, "tokens")?);
    let args = [
        k,
        v,
        ks,
        vs,
        Arg::Ptr(b.dst),
        tokens,
        heads,
        hd,
        ps,
        layers,
        layer,
        src_stride,
    ];
    let kernel = match kv.dtype {
        KvDtype::F16 => "kv_write_f16",
        _ => "kv_write_f32",
    };
    l.launch(m, kernel, elementwise(n), &args)
}

/// Attention of the batch's queries (token `t`'s `n_heads` × head_dim at `q + 4 · t · q_stride`) over
/// `layer` of the pool into `out` (tokens × `n_heads` × head_dim), with `partials`
/// ([`DevBatch::partial_floats`] floats) as the splits' scratch. On a grid of several rows, with
/// `counters` (one `i32` per token and KV head, zero, and zero again when the launch ends; see
/// [`attention_counters`]) the last block of each item folds its splits, in one launch; without,
/// `attention_merge` runs as a second launch. Every grid and both ways give the same bits. f16 and FP8
/// pages with a head_dim of whole 16s take the tensor-core kernels (`attention_f16_tc`, `attention_fp8_tc`).
#[expect(clippy::too_many_arguments, reason = "a kernel's shape")]
pub fn attention(
    l: &dyn Launcher,
    kv: &KvStore,
    b: &DevBatch,
    layer: usize,
    q: DevPtr,
    q_stride: usize,
    n_heads: usize,
    out: DevPtr,
    partials: DevPtr,
    counters: Option<DevPtr>,
) -> Result<(), DeviceError> {
    let (kvh, hd) = (kv.shape.n_kv_heads, kv.shape.head_dim);
    if q_stride < n_heads * hd {
        return Err(unsupported(format!("queries {q_stride} floats apart")));
    }
    if kvh == 0 || !n_heads.is_multiple_of(kvh) {
        return Err(unsupported(format!(
            "{n_heads} query heads over {kvh} KV heads"
        )));
    }
    let group = n_heads / kvh;
    if group > ATTENTION_MAX_GROUP || hd > ATTENTION_MAX_HEAD_DIM || hd == 0 {
        return Err(unsupported(format!(
            "attention with {group} queries per KV head of width {hd}"
        )));
    }
    if b.tokens == 0 {
        return Ok(());
    }
    if b.splits != 1 && b.splits != b.split_cap {
        return Err(unsupported(format!(
            "an attention grid of {} rows for {} splits",
            b.splits, b.split_cap
        )));
    }
    let items = int(b.tokens * kvh, "attention items")? as u32;
    // f16 and FP8 pages on the tensor cores where head_dim is whole 16s (4 warps); else a thread per
    // dimension at least.
    let tensor_cores = kv.dtype != KvDtype::F32 && hd.is_multiple_of(16);
    let threads = if hd > 128 && !tensor_cores { 256 } else { 128 };
    let shape = Shape {
        grid: [items, int(b.splits, "splits")? as u32, 1],
        block: [threads, 1, 1],
        shared: 0,
    };
    let cap = Arg::I32(int(b.split_cap, "splits")?);
    let attend_from = Arg::I32(int(b.attend_from, "a position")?);
    let [heads, hd_arg, ps, layers] = kv_args(kv)?;
    let args = [
        Arg::Ptr(q),
        Arg::Ptr(kv.k),
        Arg::Ptr(kv.v),
        Arg::Ptr(kv.kscale),
        Arg::Ptr(kv.vscale),
        Arg::Ptr(b.table),
        Arg::Ptr(b.meta),
        Arg::Ptr(b.seen),
        Arg::Ptr(partials),
        Arg::I32(int(n_heads, "heads")?),
        heads,
        hd_arg,
        ps,
        layers,
        Arg::I32(int(layer, "a layer")?),
        attend_from,
        Arg::F32(1.0 / (hd as f32).sqrt()),
        Arg::I32(int(q_stride, "a row stride")?),
        Arg::Ptr(out),
        Arg::Ptr(counters.unwrap_or(DevPtr(0))),
        cap,
    ];
    let kernel = match (kv.dtype, tensor_cores) {
        (KvDtype::F32, _) => "attention_f32",
        (KvDtype::F16, false) => "attention_f16",
        (KvDtype::Fp8, false) => "attention_fp8",
        (KvDtype::F16, true) => "attention_f16_tc",
        (KvDtype::Fp8, true) => "attention_fp8_tc",
    };
    let m = &thorn_kernels::ATTENTION;
    l.launch(m, kernel, shape, &args)?;
    if counters.is_some() || b.splits == 1 {
        return Ok(());
    }
    let merge = Shape {
        grid: [items, 1, 1],
        block: [hd as u32, 1, 1],
        shared: 0,
    };
    let args = [
        Arg::Ptr(partials),
        Arg::Ptr(out),
        Arg::Ptr(b.meta),
        Arg::I32(int(b.splits, "splits")?),
        Arg::I32(int(n_heads, "heads")?),
        heads,
        hd_arg,
        attend_from,
        cap,
    ];
    l.launch(m, "attention_merge", merge, &args)
}

/// One block per (layer, KV head) of the pool, for the copies between pages.
fn per_head(kv: &KvStore) -> Result<Shape, DeviceError> {
    Ok(Shape {
        grid: [
            int(kv.shape.n_layers * kv.shape.n_kv_heads, "KV heads")? as u32,
            1,
            1,
        ],
        block: [128, 1, 1],
        shared: 0,
    })
}

/// Copies positions `0..n` of page `src` into page `dst`, every layer and KV head, with `src`'s FP8
/// scales (the CPU pool's [`PagePool::copy`](crate::backend::pages::PagePool::copy): copy-on-write).
pub fn copy_page(
    l: &dyn Launcher,
    kv: &KvStore,
    src: u32,
    dst: u32,
    n: usize,
) -> Result<(), DeviceError> {
    if n > kv.page_size || src == dst {
        return Err(unsupported(format!(
            "a copy of {n} positions from page {src} to page {dst}"
        )));
    }
    let fp8 = kv.dtype == KvDtype::Fp8;
    let args = [
        Arg::Ptr(kv.k),
        Arg::Ptr(kv.v),
        Arg::Ptr(if fp8 { kv.kscale } else { DevPtr(0) }),
        Arg::Ptr(if fp8 { kv.vscale } else { DevPtr(0) }),
        Arg::I32(int(src as usize, "a page")?),
        Arg::I32(int(dst as usize, "a page")?),
        Arg::I32(int(n, "positions")?),
        Arg::I32(kv.dtype.element_bytes() as i32),
        Arg::I32(int(kv.shape.n_layers * kv.shape.n_kv_heads, "KV heads")?),
        Arg::I32(int(kv.shape.head_dim, "a head width")?),
        Arg::I32(int(kv.page_size, "a page size")?),
    ];
    l.launch(
        &thorn_kernels::KV_WRITE,
        "kv_copy_page",
        per_head(kv)?,
        &args,
    )
}

/// Moves `n_moves` rows, in order, each `[src page, src slot, dst page, dst slot]` (four `i32` at `moves`),
/// every layer and KV head (the CPU pool's
/// [`PagePool::move_rows`](crate::backend::pages::PagePool::move_rows)): f32 and f16 rows as they are, FP8
/// rows re-encoded at the destination page's scale. No move may read a row an earlier one wrote.
pub fn move_rows(
    l: &dyn Launcher,
    kv: &KvStore,
    moves: DevPtr,
    n_moves: usize,
) -> Result<(), DeviceError> {
    if n_moves == 0 {
        return Ok(());
    }
    let hd = kv.shape.head_dim;
    let (k, v) = (Arg::Ptr(kv.k), Arg::Ptr(kv.v));
    let (moves, n) = (Arg::Ptr(moves), Arg::I32(int(n_moves, "row moves")?));
    let heads = Arg::I32(int(kv.shape.n_layers * kv.shape.n_kv_heads, "KV heads")?);
    let (width, ps) = (
        Arg::I32(int(hd, "a head width")?),
        Arg::I32(int(kv.page_size, "a page size")?),
    );
    let m = &thorn_kernels::KV_WRITE;
    if kv.dtype == KvDtype::Fp8 {
        if hd > ATTENTION_MAX_HEAD_DIM {
            return Err(unsupported(format!("FP8 row moves of width {hd}")));
        }
        let (ks, vs) = (Arg::Ptr(kv.kscale), Arg::Ptr(kv.vscale));
        let args = [k, v, ks, vs, moves, n, heads, width, ps];
        return l.launch(m, "kv_move_rows_fp8", per_head(kv)?, &args);
    }
    let elem = Arg::I32(kv.dtype.element_bytes() as i32);
    let args = [k, v, moves, n, elem, heads, width, ps];
    l.launch(m, "kv_move_rows", per_head(kv)?, &args)
}

/// Bytes of the merge counters [`attention`] takes for a batch of `tokens` over `n_kv_heads`.
pub fn attention_counters(tokens: usize, n_kv_heads: usize) -> usize {
    4 * tokens * n_kv_heads
}

/// Normal RoPE of fused QKV rows with the KV write in one launch, for f32 and f16 pages: token `t`'s row at
/// `rows + 4 · t · stride` holds `[Q (n_heads) | K | V (KV heads each)]` heads of head_dim; Q and K are
/// rotated in place (`pos`, `table`, `n_angles` as [`rope`]), K and V written to their page slots, with
/// the same bits as [`rope`] then [`write_kv`]. FP8 pages (which rescale in token order) take those two.
#[expect(clippy::too_many_arguments, reason = "a kernel's shape")]
pub fn rope_kv_write(
    l: &dyn Launcher,
    kv: &KvStore,
    b: &DevBatch,
    layer: usize,
    rows: DevPtr,
    stride: usize,
    n_heads: usize,
    pos: DevPtr,
    table: DevPtr,
    n_angles: usize,
) -> Result<(), DeviceError> {
    let (kvh, hd) = (kv.shape.n_kv_heads, kv.shape.head_dim);
    let kernel = match kv.dtype {
        KvDtype::F32 => "rope_kv_write_f32",
        KvDtype::F16 => "rope_kv_write_f16",
        KvDtype::Fp8 => {
            return Err(unsupported(
                "the fused RoPE and KV write on FP8 pages".into(),
            ));
        }
    };
    if stride < (n_heads + 2 * kvh) * hd || 2 * n_angles > hd || n_angles == 0 || hd % 2 != 0 {
        return Err(unsupported(format!(
            "fused rows of {stride} floats for {n_heads} + 2 x {kvh} heads of {hd}, {n_angles} pairs"
        )));
    }
    if b.tokens == 0 {
        return Ok(());
    }
    let [heads, hd_arg, ps, layers] = kv_args(kv)?;
    let args = [
        Arg::Ptr(rows),
        Arg::Ptr(pos),
        Arg::Ptr(table),
        Arg::Ptr(kv.k),
        Arg::Ptr(kv.v),
        Arg::Ptr(b.dst),
        Arg::I32(int(b.tokens, "tokens")?),
        Arg::I32(int(n_heads, "heads")?),
        heads,
        hd_arg,
        Arg::I32(int(n_angles, "pairs")?),
        Arg::I32(int(stride, "a row stride")?),
        ps,
        layers,
        Arg::I32(int(layer, "a layer")?),
    ];
    let pairs = b.tokens * (n_heads + 2 * kvh) * (hd / 2);
    l.launch(&thorn_kernels::ROPE, kernel, elementwise(pairs), &args)
}
