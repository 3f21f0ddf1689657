//! Attention over a key/value cache: the decode path (split-KV forward with packed GQA rows, its
//! combine) and the cache append with rotary embedding. Validation, kernel parameters, launches.
//!
//! Layouts (flash_attn 2's `flash_attn_with_kvcache`, reference/api-contracts.md §1.6;
//! kernels/attention/kvcache_params.cuh):
//!   q / out (b, s_q, h, d), or varlen (total_q, h, d) with cu_seqlens_q; lse (b, h, s_q) or (h, total_q);
//!   k / v the cache: contiguous (b_cache, s_cache, h_k, d); paged (num_pages, page_size, h_k, d)
//!   with block_table (b, max_pages) int32; or packed varlen (total_k, h_k, d) with cu_seqlens_k.
//!   cache_seqlens (b,) int32: keys per sequence before `seqlen_k_add` appended ones;
//!   cache_leftpad (b,) int32: the first key row of each cache row (contiguous only);
//!   cache_batch_idx (b,) int32: the cache row of each batch entry (contiguous only).
//! Split partials: o_accum (num_splits, b, h, s_q, d) and lse_accum (num_splits, b, h, s_q),
//! fp32, contiguous, allocated by the caller (`num_splits` from `plan_splits`).
//!
//! Device-side values (cache_seqlens, block_table, cache_batch_idx, cu_seqlens) are never
//! trusted: the kernels clamp every length to the cache and every page / row index to the
//! cache's first dim, so no value reads or writes outside k / v.

use crate::arch::Arch;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::jit::{impl_kernel_spec, KernelMap, KernelSpec};
use crate::launch::launch;
use crate::launch_record::{LaunchInfo, LaunchShape, Work};
use crate::ops::attention::{check_dense, check_outputs, check_tile_layout, params, AttnFwdParams, AttnVariant, Problem, VariantKind};
use crate::ops::validate::{check_device, check_dtype, check_not_null, check_shape, check_strides};
use crate::tensor::{fmt_shape, TensorMeta, TensorView};
use crate::tuning::attention_kvcache::{
    blocks_per_sm, kvcache_config, kvcache_production_configs, num_splits, row_blocks, AttnKvcacheConfig,
    KvAppendConfig, SplitCombineConfig, MAX_SPLITS,
};
use std::ffi::c_void;

/// Mirror of `struct AttnKvcacheParams` (kernels/attention/kvcache_params.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnKvcacheParams {
    pub base: AttnFwdParams,
    pub seqlens_k: *const i32,
    pub leftpad_k: *const i32,
    pub batch_idx: *const i32,
    pub block_table: *const i32,
    pub o_accum: *mut f32,
    pub lse_accum: *mut f32,
    pub block_table_batch_stride: i64,
    pub seqlen_k_add: i32,
    pub cache_rows: i32,
    pub cache_batches: i32,
    pub page_size: i32,
    pub num_splits: i32,
    pub group: i32,
}

/// Mirror of `struct KvAppendParams` (kernels/attention/kv_append.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvAppendParams {
    pub k_new: *const c_void,
    pub v_new: *const c_void,
    pub k_cache: *mut c_void,
    pub v_cache: *mut c_void,
    pub q: *const c_void,
    pub q_rot: *mut c_void,
    pub cos: *const c_void,
    pub sin: *const c_void,
    pub seqlens: *const i32,
    pub batch_idx: *const i32,
    pub block_table: *const i32,
    pub kn: [i64; 3],
    pub vn: [i64; 3],
    pub kc: [i64; 3],
    pub vc: [i64; 3],
    pub qs: [i64; 3],
    pub qr: [i64; 3],
    pub block_table_batch_stride: i64,
    pub batch: i32,
    pub s_new: i32,
    pub heads_k: i32,
    pub s_q: i32,
    pub heads: i32,
    pub head_dim: i32,
    pub rotary_dim: i32,
    pub seqlen_ro: i32,
    pub interleaved: i32,
    pub q_per_token: i32,
    pub cache_rows: i32,
    pub cache_batches: i32,
    pub page_size: i32,
}

impl_kernel_spec!(
    AttnKvcacheConfig,
    kernel: |_| AttnKvcacheConfig::KERNEL,
    header: |_| AttnKvcacheConfig::HEADER,
    smem: |c| c.smem_bytes(),
);
impl_kernel_spec!(
    SplitCombineConfig,
    kernel: |_| SplitCombineConfig::KERNEL,
    header: |_| SplitCombineConfig::HEADER,
    smem: |_| 0,
);
impl_kernel_spec!(
    KvAppendConfig,
    kernel: |_| KvAppendConfig::KERNEL,
    header: |_| KvAppendConfig::HEADER,
    smem: |_| 0,
);

/// What `precompile` builds for this family.
pub fn production_specs(arch: Arch) -> Vec<AttnKvcacheConfig> {
    kvcache_production_configs(arch)
}

/// The small kernels of this family that `precompile` builds (per dtype).
pub fn production_helper_specs(arch: Arch) -> (Vec<SplitCombineConfig>, Vec<KvAppendConfig>) {
    let dtypes = [DType::F16, DType::BF16];
    (
        dtypes.iter().map(|&dtype| SplitCombineConfig { dtype, arch }).collect(),
        dtypes.iter().map(|&dtype| KvAppendConfig { dtype, arch }).collect(),
    )
}

/// The cache-side arguments of one call (`T`: metadata or views).
#[derive(Clone, Copy, Debug)]
pub struct KvCache<T> {
    /// (b,) int32 keys per sequence before the append (None: the whole cache row / the packed
    /// varlen lengths).
    pub cache_seqlens: Option<T>,
    /// Tokens appended before the attention (added to cache_seqlens).
    pub seqlen_k_add: i64,
    pub cache_leftpad: Option<T>,
    pub cache_batch_idx: Option<T>,
    pub block_table: Option<T>,
}

impl<T> Default for KvCache<T> {
    fn default() -> Self {
        KvCache { cache_seqlens: None, seqlen_k_add: 0, cache_leftpad: None, cache_batch_idx: None, block_table: None }
    }
}

impl<T> KvCache<T> {
    pub fn map<'a, U>(&'a self, f: impl Fn(&'a T) -> U) -> KvCache<U> {
        KvCache {
            cache_seqlens: self.cache_seqlens.as_ref().map(&f),
            seqlen_k_add: self.seqlen_k_add,
            cache_leftpad: self.cache_leftpad.as_ref().map(&f),
            cache_batch_idx: self.cache_batch_idx.as_ref().map(&f),
            block_table: self.block_table.as_ref().map(&f),
        }
    }
}

/// Where one call's keys live (validated).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    pub paged: bool,
    /// Packed varlen k / v (total_k, h_k, d).
    pub packed: bool,
    /// Keys one sequence can hold.
    pub cache_rows: i64,
    /// The cache's first dim: cache rows, pages or packed rows.
    pub cache_batches: i64,
    pub page_size: i64,
    pub heads_k: i64,
    pub head_dim: i64,
}

/// A validated kv-cache attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvProblem {
    /// The forward problem the variant is checked against (seqlen_k: the cache's capacity).
    pub base: Problem,
    pub cache: CacheLayout,
}

fn arg_err(arg: &str, want: impl std::fmt::Display, got: impl ToString) -> Error {
    Error::argument(arg, want.to_string(), got)
}

fn check_rank(arg: &str, t: &TensorMeta, ranks: &[usize], layout: &str) -> Result<()> {
    if !ranks.contains(&t.ndim()) || t.strides.len() != t.ndim() {
        return Err(arg_err(arg, layout, format!("{} dims (shape {})", t.ndim(), fmt_shape(&t.shape))));
    }
    if let Some(s) = t.shape.iter().find(|&&s| s < 0) {
        return Err(arg_err(arg, "non-negative sizes", format!("size {s}")));
    }
    Ok(())
}

/// An int32 (n,) contiguous tensor on q's device.
fn check_index_vector(arg: &str, t: &TensorMeta, n: i64, what: &str, q: &TensorMeta) -> Result<()> {
    check_dtype(arg, t, DType::I32, "")?;
    check_shape(arg, t, &[n], what)?;
    if n > 1 && t.strides[0] != 1 {
        return Err(arg_err(arg, "a contiguous tensor (stride 1)", format!("stride {}", t.strides[0])));
    }
    if q.device.is_cuda() {
        check_device(arg, t, "q", q)?;
    }
    Ok(())
}

/// The cache tensors and their index arguments, for `batch` sequences of q's dtype (`varlen`: the
/// keys' lengths come from cu_seqlens_k).
pub fn validate_cache(k: &TensorMeta, v: &TensorMeta, q: &TensorMeta, batch: i64, varlen: bool,
                      kv: &KvCache<&TensorMeta>) -> Result<CacheLayout> {
    check_dtype("k_cache", k, q.dtype, " (q's dtype)")?;
    check_dtype("v_cache", v, q.dtype, " (q's dtype)")?;
    let paged = kv.block_table.is_some();
    let packed = varlen && !paged;
    let (ranks, layout): (&[usize], &str) = if packed {
        (&[3], "(total_k, heads_k, head_dim): packed varlen keys")
    } else if paged {
        (&[4], "(num_pages, page_size, heads_k, head_dim) with block_table")
    } else {
        (&[4], "(batch_cache, seqlen_cache, heads_k, head_dim)")
    };
    check_rank("k_cache", k, ranks, layout)?;
    check_rank("v_cache", v, ranks, layout)?;
    check_strides("k_cache", k)?;
    check_strides("v_cache", v)?;
    if v.shape != k.shape {
        return Err(arg_err("v_cache", format!("shape {} (k_cache's)", fmt_shape(&k.shape)), format!("shape {}", fmt_shape(&v.shape))));
    }
    let r = k.ndim();
    let (heads_k, head_dim) = (k.shape[r - 2], k.shape[r - 1]);
    let cache_batches = k.shape[0];
    let (cache_rows, page_size) = if packed {
        (k.shape[0], 1)
    } else if let Some(bt) = kv.block_table {
        check_dtype("block_table", bt, DType::I32, "")?;
        if bt.ndim() != 2 || bt.shape[0] != batch {
            return Err(arg_err("block_table", format!("shape ({batch}, max_pages)"), format!("shape {}", fmt_shape(&bt.shape))));
        }
        if bt.shape[1] > 1 && bt.strides[1] != 1 {
            return Err(arg_err("block_table", "a contiguous last dim (stride 1)", format!("strides {:?}", bt.strides)));
        }
        if q.device.is_cuda() {
            check_device("block_table", bt, "q", q)?;
        }
        if k.shape[1] < 1 {
            return Err(arg_err("k_cache", "a page size >= 1 (dim 1)", k.shape[1]));
        }
        for (arg, t) in [("cache_leftpad", kv.cache_leftpad), ("cache_batch_idx", kv.cache_batch_idx)] {
            if t.is_some() {
                return Err(arg_err(arg, "None with a paged cache (block_table)", "a tensor"));
            }
        }
        (bt.shape[1] * k.shape[1], k.shape[1])
    } else {
        if kv.cache_batch_idx.is_none() && cache_batches < batch {
            return Err(arg_err("k_cache", format!("at least {batch} cache rows (dim 0; q's batch) without cache_batch_idx"), cache_batches));
        }
        (k.shape[1], k.shape[1].max(1))
    };
    if !packed && cache_batches == 0 && batch > 0 {
        return Err(arg_err("k_cache", "at least one cache row or page (dim 0) for a non-empty batch", format!("shape {}", fmt_shape(&k.shape))));
    }
    if cache_rows > i32::MAX as i64 || cache_batches > i32::MAX as i64 {
        return Err(arg_err("k_cache", format!("at most {} keys per sequence and rows / pages", i32::MAX), format!("shape {}", fmt_shape(&k.shape))));
    }
    if let Some(t) = kv.cache_seqlens {
        check_index_vector("cache_seqlens", t, batch, " (batch,)", q)?;
    }
    if let Some(t) = kv.cache_leftpad {
        check_index_vector("cache_leftpad", t, batch, " (batch,)", q)?;
    }
    if let Some(t) = kv.cache_batch_idx {
        check_index_vector("cache_batch_idx", t, batch, " (batch,)", q)?;
    }
    if packed && (kv.cache_seqlens.is_some() || kv.cache_leftpad.is_some() || kv.cache_batch_idx.is_some()) {
        return Err(arg_err("cache_seqlens", "None with packed varlen keys (cu_seqlens_k gives the lengths)", "a tensor"));
    }
    if q.device.is_cuda() {
        check_device("k_cache", k, "q", q)?;
        check_device("v_cache", v, "q", q)?;
    }
    Ok(CacheLayout { paged, packed, cache_rows, cache_batches, page_size, heads_k, head_dim })
}

/// Validate a kv-cache attention call from metadata (`out` / `lse` None from the check entry).
#[allow(clippy::too_many_arguments)]
pub fn validate(q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, out: Option<&TensorMeta>, lse: Option<&TensorMeta>,
                cu_seqlens_q: Option<&TensorMeta>, cu_seqlens_k: Option<&TensorMeta>, max_seqlen_q: i64,
                kv: &KvCache<&TensorMeta>) -> Result<KvProblem> {
    if !matches!(q.dtype, DType::F16 | DType::BF16) {
        return Err(Error::dtype("q", "float16 or bfloat16", q.dtype));
    }
    let varlen = cu_seqlens_q.is_some();
    if varlen != cu_seqlens_k.is_some() {
        let (arg, other) = if varlen { ("cu_seqlens_k", "cu_seqlens_q") } else { ("cu_seqlens_q", "cu_seqlens_k") };
        return Err(arg_err(arg, format!("a tensor ({other} was given)"), "None"));
    }
    let (rank, layout) = if varlen { (3, "(total_q, heads, head_dim) in varlen mode") } else { (4, "(batch, seqlen_q, heads, head_dim)") };
    check_rank("q", q, &[rank], layout)?;
    check_strides("q", q)?;
    let (heads, d) = (q.shape[rank - 2], q.shape[rank - 1]);
    if !(8..=256).contains(&d) || d % 8 != 0 {
        return Err(arg_err("q", "head dim a multiple of 8 in 8..=256", format!("head dim {d}")));
    }
    let (batch, seqlen_q) = if varlen {
        let (cq, ck) = (cu_seqlens_q.unwrap(), cu_seqlens_k.unwrap());
        for (arg, t) in [("cu_seqlens_q", cq), ("cu_seqlens_k", ck)] {
            check_dtype(arg, t, DType::I32, "")?;
            if t.ndim() != 1 || t.shape[0] < 1 || (t.shape[0] > 1 && t.strides[0] != 1) {
                return Err(arg_err(arg, "a contiguous (batch + 1,) tensor", format!("shape {} strides {:?}", fmt_shape(&t.shape), t.strides)));
            }
            if q.device.is_cuda() {
                check_device(arg, t, "q", q)?;
            }
        }
        if ck.shape != cq.shape {
            return Err(arg_err("cu_seqlens_k", format!("length {} (cu_seqlens_q's)", cq.shape[0]), format!("length {}", ck.shape[0])));
        }
        if q.shape[0] > i32::MAX as i64 {
            return Err(arg_err("q", format!("at most {} rows (cu_seqlens are int32)", i32::MAX), q.shape[0]));
        }
        if max_seqlen_q < 1 && q.shape[0] > 0 {
            return Err(arg_err("max_seqlen_q", ">= 1 for a non-empty input", max_seqlen_q));
        }
        (cq.shape[0] - 1, if q.shape[0] == 0 { 0 } else { max_seqlen_q.min(q.shape[0]) })
    } else {
        (q.shape[0], q.shape[1])
    };
    if batch > 65535 {
        return Err(arg_err("q", "a batch of at most 65535 sequences (the kv-cache grid's z)", batch));
    }
    if seqlen_q > i32::MAX as i64 {
        return Err(arg_err("q", format!("at most {} query tokens", i32::MAX), seqlen_q));
    }
    let cache = validate_cache(k, v, q, batch, varlen, kv)?;
    if cache.head_dim != d {
        return Err(arg_err("k_cache", format!("head dim {d} (q's head dim)"), format!("head dim {}", cache.head_dim)));
    }
    if cache.heads_k < 1 || heads % cache.heads_k != 0 {
        return Err(arg_err("k_cache", format!("a number of heads >= 1 that divides q's {heads}"), format!("{} heads", cache.heads_k)));
    }
    if cache.heads_k > 65535 {
        return Err(arg_err("k_cache", "at most 65535 kv heads", cache.heads_k));
    }
    if kv.seqlen_k_add < 0 || kv.seqlen_k_add > cache.cache_rows {
        return Err(arg_err("k", format!("at most {} new tokens (the cache's capacity)", cache.cache_rows), kv.seqlen_k_add));
    }
    if !q.device.is_cuda() {
        return Err(Error::device("q", "a CUDA tensor", q.device));
    }
    check_outputs(out, lse, q, varlen, batch, heads, seqlen_q, q.shape[0])?;
    let base = Problem {
        varlen,
        batch,
        seqlen_q,
        seqlen_k: cache.cache_rows,
        heads,
        heads_k: cache.heads_k,
        head_dim: d,
        dtype: q.dtype,
        device: q.device.id,
    };
    Ok(KvProblem { base, cache })
}

/// The checks of `attn_fwd_kvcache` from metadata alone (`attn_kvcache_check`): `validate`
/// without the outputs, then the variant's.
#[allow(clippy::too_many_arguments)]
pub fn check(q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, cu_seqlens_q: Option<&TensorMeta>,
             cu_seqlens_k: Option<&TensorMeta>, max_seqlen_q: i64, kv: &KvCache<&TensorMeta>,
             variant: &AttnVariant<&TensorMeta>) -> Result<VariantKind> {
    let p = validate(q, k, v, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, kv)?;
    variant.validate(&p.base, q)
}

/// The split count of a call (`requested` as flash_attn's `num_splits`: 0 = heuristic): a pure
/// function of the shapes and the device's SM count, so the caller can size the partials'
/// workspace before the launch.
#[allow(clippy::too_many_arguments)]
pub fn plan_splits(device: i32, batch: i64, seqlen_q: i64, heads: i64, heads_k: i64, key_len: i64, head_dim: i64,
                   paged: bool, requested: i64) -> Result<u32> {
    if !(0..=MAX_SPLITS as i64).contains(&requested) {
        return Err(arg_err("num_splits", format!("0 (heuristic) or 1..={MAX_SPLITS}"), requested));
    }
    for (name, v) in [("batch", batch), ("seqlen_q", seqlen_q), ("heads", heads), ("heads_k", heads_k),
                      ("key_len", key_len), ("head_dim", head_dim)] {
        if v < 0 {
            return Err(arg_err(name, "a size >= 0", v));
        }
    }
    if batch == 0 || seqlen_q == 0 || heads_k == 0 || key_len == 0 {
        return Ok(1);
    }
    let arch = crate::device::arch(device)?;
    let config = kvcache_config(head_dim.clamp(8, 256) as u32, paged, crate::ops::attention::VariantKind::PLAIN, DType::F16, arch);
    let group = (heads / heads_k).max(1) as u64;
    let blocks = batch as u64 * heads_k as u64 * row_blocks(seqlen_q as u64, group);
    Ok(num_splits(blocks, key_len as u64, crate::device::sm_count(device)?, blocks_per_sm(&config), requested as u32))
}

static KERNELS: KernelMap<AttnKvcacheConfig> = KernelMap::new();
static COMBINE: KernelMap<SplitCombineConfig> = KernelMap::new();
static APPEND: KernelMap<KvAppendConfig> = KernelMap::new();

/// Bytes of k and v that a call reads at most (every sequence's whole capacity) and the FLOPs of
/// its visible pairs at full capacity: an upper bound (lengths live on the device), marked inexact.
fn work(p: &KvProblem) -> Work {
    let b = &p.base;
    let elem = b.dtype.size_bytes() as f64;
    let kv_bytes = 2.0 * (b.batch * p.cache.cache_rows * b.heads_k * b.head_dim) as f64 * elem;
    let q_bytes = 2.0 * (b.batch * b.seqlen_q * b.heads * b.head_dim) as f64 * elem;
    let flops = 4.0 * (b.batch * b.heads * b.seqlen_q * p.cache.cache_rows * b.head_dim) as f64;
    Work { flops, bytes: kv_bytes + q_bytes, exact: false }
}

/// The split partials (o_accum, lse_accum) of `attn_fwd_kvcache`: both or neither (an
/// ArgumentError naming `lse_accum` otherwise).
pub fn accum_pair<'a>(o_accum: Option<&'a TensorView>, lse_accum: Option<&'a TensorView>)
                      -> Result<Option<(&'a TensorView, &'a TensorView)>> {
    match (o_accum, lse_accum) {
        (Some(o), Some(l)) => Ok(Some((o, l))),
        (None, None) => Ok(None),
        _ => Err(arg_err("lse_accum", "given together with o_accum", "only one of the two")),
    }
}

/// Validate everything, then launch the kv-cache forward on `stream` (and, with `accum` — the
/// split partials (o_accum, lse_accum) — the combine). Never synchronises; empty inputs launch
/// nothing.
#[allow(clippy::too_many_arguments)]
pub fn attn_fwd_kvcache(q: &TensorView, k: &TensorView, v: &TensorView, out: &TensorView, lse: &TensorView,
                        cu_seqlens_q: Option<&TensorView>, cu_seqlens_k: Option<&TensorView>, max_seqlen_q: i64,
                        kv: &KvCache<&TensorView>, accum: Option<(&TensorView, &TensorView)>, softmax_scale: f32,
                        variant: &AttnVariant<&TensorView>, stream: u64) -> Result<()> {
    let p = validate(&q.meta, &k.meta, &v.meta, Some(&out.meta), Some(&lse.meta), cu_seqlens_q.map(|t| &t.meta),
                     cu_seqlens_k.map(|t| &t.meta), max_seqlen_q, &kv.map(|t| &t.meta))?;
    let kind = variant.metas().validate(&p.base, &q.meta)?;
    if kind.dropout {
        return Err(arg_err("dropout_p", "0 (the kv-cache forward has no dropout)", variant.dropout_p));
    }
    if !softmax_scale.is_finite() || softmax_scale <= 0.0 {
        return Err(arg_err("softmax_scale", "a finite number > 0", softmax_scale));
    }
    let b = &p.base;
    let splits = match accum {
        None => 1,
        Some((o_acc, l_acc)) => {
            let s = o_acc.meta.shape.first().copied().unwrap_or(0);
            if !(1..=MAX_SPLITS as i64).contains(&s) {
                return Err(arg_err("o_accum", format!("1..={MAX_SPLITS} splits (dim 0)"), s));
            }
            check_dtype("o_accum", &o_acc.meta, DType::F32, "")?;
            check_dtype("lse_accum", &l_acc.meta, DType::F32, "")?;
            check_shape("o_accum", &o_acc.meta, &[s, b.batch, b.heads, b.seqlen_q, b.head_dim], " (splits, batch, heads, seqlen_q, head_dim)")?;
            check_shape("lse_accum", &l_acc.meta, &[s, b.batch, b.heads, b.seqlen_q], " (splits, batch, heads, seqlen_q)")?;
            for (arg, t) in [("o_accum", o_acc), ("lse_accum", l_acc)] {
                if t.meta.strides != TensorMeta::contiguous_strides(&t.meta.shape) && t.meta.numel() > 1 {
                    return Err(arg_err(arg, "a contiguous tensor", format!("strides {:?}", t.meta.strides)));
                }
                check_device(arg, &t.meta, "q", &q.meta)?;
            }
            s
        }
    };
    if b.is_empty() || b.heads == 0 {
        return Ok(());
    }
    for (arg, t) in [("q", q), ("k_cache", k), ("v_cache", v), ("out", out), ("softmax_lse", lse)] {
        check_not_null(arg, t)?;
    }
    for (arg, t) in [("q", q), ("k_cache", k), ("v_cache", v), ("out", out)] {
        check_tile_layout(arg, t)?;
    }
    let arch = crate::device::arch(b.device)?;
    let config = kvcache_config(b.head_dim as u32, p.cache.paged, kind, b.dtype, arch);
    let mut prm = AttnKvcacheParams {
        base: params(b, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, variant),
        seqlens_k: kv.cache_seqlens.map_or(std::ptr::null(), |t| t.ptr as *const i32),
        leftpad_k: kv.cache_leftpad.map_or(std::ptr::null(), |t| t.ptr as *const i32),
        batch_idx: kv.cache_batch_idx.map_or(std::ptr::null(), |t| t.ptr as *const i32),
        block_table: kv.block_table.map_or(std::ptr::null(), |t| t.ptr as *const i32),
        o_accum: accum.map_or(std::ptr::null_mut(), |(o, _)| o.ptr as *mut f32),
        lse_accum: accum.map_or(std::ptr::null_mut(), |(_, l)| l.ptr as *mut f32),
        block_table_batch_stride: kv.block_table.map_or(0, |t| t.meta.strides[0]),
        seqlen_k_add: kv.seqlen_k_add as i32,
        cache_rows: p.cache.cache_rows as i32,
        cache_batches: p.cache.cache_batches.max(1) as i32,
        page_size: p.cache.page_size as i32,
        num_splits: splits as i32,
        group: (b.heads / b.heads_k) as i32,
    };
    // The cache's own strides (dim 0: a cache row or a page; packed varlen: none).
    for (t, dst) in [(k, 0), (v, 1)] {
        let s = &t.meta.strides;
        let (bs, rs, hs) = if p.cache.packed { (0, s[0], s[1]) } else { (s[0], s[1], s[2]) };
        let f = &mut prm.base;
        if dst == 0 {
            (f.k_batch_stride, f.k_row_stride, f.k_head_stride) = (bs, rs, hs);
        } else {
            (f.v_batch_stride, f.v_row_stride, f.v_head_stride) = (bs, rs, hs);
        }
    }
    prm.base.total_k = if p.cache.packed { k.meta.shape[0] as i32 } else { 0 };
    if cu_seqlens_k.is_none() {
        prm.base.cu_seqlens_k = std::ptr::null();
    }
    let group = (b.heads / b.heads_k) as u64;
    let shape = LaunchShape {
        grid: ((row_blocks(b.seqlen_q as u64, group) * splits as u64) as u32, b.heads_k as u32, b.batch as u32),
        block: (AttnKvcacheConfig::THREADS, 1, 1),
        dynamic_smem_bytes: config.smem_bytes(),
    };
    shape.check()?;
    let kernel = KERNELS.get(&config, b.device)?;
    let info = LaunchInfo { op: "ferroattn::attn_fwd_kvcache", work: work(&p) };
    // SAFETY: `prm` mirrors the kernel's AttnKvcacheParams; every pointer lies within the caller's
    // tensors (device-side indices are clamped by the kernel), kept alive in stream order.
    unsafe { launch(kernel, b.device, &shape, stream, &mut prm, &info)? };
    if splits > 1 {
        let rows = (b.batch * b.heads * b.seqlen_q) as u64;
        let combine = COMBINE.get(&SplitCombineConfig { dtype: b.dtype, arch }, b.device)?;
        let cshape = LaunchShape { grid: (rows.div_ceil(4) as u32, 1, 1), block: (128, 1, 1), dynamic_smem_bytes: 0 };
        let elem = b.dtype.size_bytes() as f64;
        let cinfo = LaunchInfo {
            op: "ferroattn::attn_fwd_kvcache",
            work: Work { flops: 0.0, bytes: rows as f64 * (splits as f64 * (b.head_dim as f64 + 1.0) * 4.0 + b.head_dim as f64 * elem + 4.0), exact: true },
        };
        // SAFETY: as above; the combine reads the partials the forward wrote in stream order.
        unsafe { launch(combine, b.device, &cshape, stream, &mut prm, &cinfo)? };
    }
    Ok(())
}

/// The append's tensors (`T`: views or metadata): k_new / v_new (b, s_new, h_k, d); q / q_rot
/// (b, s_q, h, d) when q is rotated; cos / sin (seqlen_ro, rotary_dim / 2) in q's dtype.
pub struct AppendTensors<T> {
    pub k_new: T,
    pub v_new: T,
    pub q: Option<T>,
    pub q_rot: Option<T>,
    pub cos: Option<T>,
    pub sin: Option<T>,
}

/// The append's tensors and flags.
pub struct AppendArgs<'a> {
    pub tensors: AppendTensors<&'a TensorView>,
    pub interleaved: bool,
    /// Query token i at position cache_seqlens + i (causal / local calls), else all at cache_seqlens.
    pub q_per_token: bool,
}

fn strides3(t: &TensorMeta) -> [i64; 3] {
    [t.strides[0], t.strides[1], t.strides[2]]
}

/// The validated sizes of a cache append.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendProblem {
    pub cache: CacheLayout,
    pub batch: i64,
    pub s_new: i64,
    pub heads_k: i64,
    pub head_dim: i64,
    pub s_q: i64,
    pub heads: i64,
    pub rotary_dim: i64,
    pub seqlen_ro: i64,
}

/// The append's metadata.
pub type AppendMetas<'a> = AppendTensors<&'a TensorMeta>;

/// Validate a cache append from metadata alone (`kv.cache_seqlens` is required): k / v
/// (b, s_new, h_k, d) of the cache's heads and head dim and dtype, at most the cache's capacity
/// new tokens; cos / sin (seqlen_ro >= capacity, rotary_dim / 2) contiguous in k's dtype with
/// rotary_dim a multiple of 16 <= d; q / q_rot (b, s_q, h, d).
pub fn validate_append(k_cache: &TensorMeta, v_cache: &TensorMeta, a: &AppendMetas, kv: &KvCache<&TensorMeta>) -> Result<AppendProblem> {
    let (kn, vn) = (a.k_new, a.v_new);
    if !matches!(kn.dtype, DType::F16 | DType::BF16) {
        return Err(Error::dtype("k", "float16 or bfloat16", kn.dtype));
    }
    check_rank("k", kn, &[4], "(batch, seqlen_new, heads_k, head_dim)")?;
    check_strides("k", kn)?;
    check_dtype("v", vn, kn.dtype, " (k's dtype)")?;
    check_shape("v", vn, &kn.shape, " (k's shape)")?;
    check_strides("v", vn)?;
    let (batch, s_new, heads_k, d) = (kn.shape[0], kn.shape[1], kn.shape[2], kn.shape[3]);
    let cache = validate_cache(k_cache, v_cache, kn, batch, false, kv)?;
    if cache.heads_k != heads_k || cache.head_dim != d {
        return Err(arg_err("k", format!("(batch, seqlen_new, {}, {}) (the cache's heads and head dim)", cache.heads_k, cache.head_dim),
                           format!("shape {}", fmt_shape(&kn.shape))));
    }
    if d % 8 != 0 || d > 256 {
        return Err(arg_err("k", "head dim a multiple of 8 in 8..=256", d));
    }
    if s_new > cache.cache_rows {
        return Err(arg_err("k", format!("at most {} new tokens (the cache's capacity)", cache.cache_rows), s_new));
    }
    if kv.cache_seqlens.is_none() {
        return Err(arg_err("cache_seqlens", "a tensor when k and v are appended", "None"));
    }
    let (rotary_dim, seqlen_ro) = match (a.cos, a.sin) {
        (None, None) => (0, 0),
        (Some(cm), Some(sm)) => {
            check_dtype("rotary_cos", cm, kn.dtype, " (q's dtype)")?;
            check_dtype("rotary_sin", sm, kn.dtype, " (q's dtype)")?;
            if cm.ndim() != 2 {
                return Err(arg_err("rotary_cos", "2 dims (seqlen_ro, rotary_dim / 2)", format!("shape {}", fmt_shape(&cm.shape))));
            }
            check_shape("rotary_sin", sm, &cm.shape, " (rotary_cos's shape)")?;
            let rd = cm.shape[1] * 2;
            if rd % 16 != 0 || rd > d || rd == 0 {
                return Err(arg_err("rotary_cos", format!("rotary_dim = 2 x dim 1 a multiple of 16 in 16..={d}"), rd));
            }
            if cm.shape[0] < cache.cache_rows {
                return Err(arg_err("rotary_cos", format!("at least {} rows (the cache's capacity)", cache.cache_rows), cm.shape[0]));
            }
            for (arg, t) in [("rotary_cos", cm), ("rotary_sin", sm)] {
                if t.strides != TensorMeta::contiguous_strides(&t.shape) {
                    return Err(arg_err(arg, "a contiguous tensor", format!("strides {:?}", t.strides)));
                }
                if kn.device.is_cuda() {
                    check_device(arg, t, "k", kn)?;
                }
            }
            (rd, cm.shape[0])
        }
        _ => return Err(arg_err("rotary_sin", "given together with rotary_cos", "only one of the two")),
    };
    let (s_q, heads) = match (a.q, a.q_rot) {
        (Some(q), Some(qr)) => {
            check_rank("q", q, &[4], "(batch, seqlen_q, heads, head_dim)")?;
            check_dtype("q", q, kn.dtype, " (k's dtype)")?;
            check_strides("q", q)?;
            if q.shape[0] != batch || q.shape[3] != d {
                return Err(arg_err("q", format!("shape ({batch}, seqlen_q, heads, {d})"), format!("shape {}", fmt_shape(&q.shape))));
            }
            check_shape("q_rot", qr, &q.shape, " (q's shape)")?;
            check_dtype("q_rot", qr, kn.dtype, "")?;
            check_dense("q_rot", qr)?;
            (q.shape[1], q.shape[2])
        }
        (None, None) => (0, 0),
        _ => return Err(arg_err("q_rot", "given together with q", "only one of the two")),
    };
    if !kn.device.is_cuda() {
        return Err(Error::device("k", "a CUDA tensor", kn.device));
    }
    check_device("v", vn, "k", kn)?;
    Ok(AppendProblem { cache, batch, s_new, heads_k, head_dim: d, s_q, heads, rotary_dim, seqlen_ro })
}

/// Validate and launch the cache append (kernels/attention/kv_append.cuh): k_new (rotated) and
/// v_new into the cache at cache_seqlens, q rotated into q_rot. `kv.cache_seqlens` is required.
pub fn kv_append(k_cache: &TensorView, v_cache: &TensorView, a: &AppendArgs, kv: &KvCache<&TensorView>, stream: u64) -> Result<()> {
    let t = &a.tensors;
    let metas = AppendMetas {
        k_new: &t.k_new.meta,
        v_new: &t.v_new.meta,
        q: t.q.map(|t| &t.meta),
        q_rot: t.q_rot.map(|t| &t.meta),
        cos: t.cos.map(|t| &t.meta),
        sin: t.sin.map(|t| &t.meta),
    };
    let ap = validate_append(&k_cache.meta, &v_cache.meta, &metas, &kv.map(|t| &t.meta))?;
    let AppendProblem { cache, batch, s_new, heads_k, head_dim: d, s_q, heads, rotary_dim, seqlen_ro } = ap;
    let (kn, vn) = (&t.k_new.meta, &t.v_new.meta);
    for (arg, t) in [("rotary_cos", t.cos), ("rotary_sin", t.sin)] {
        if let Some(t) = t {
            if !t.ptr.is_multiple_of(16) {
                return Err(arg_err(arg, "a 16-byte aligned data pointer", format!("{:#x}", t.ptr)));
            }
        }
    }
    for (arg, t) in [("q", t.q), ("q_rot", t.q_rot)] {
        if let Some(t) = t {
            check_tile_layout(arg, t)?;
        }
    }
    if batch == 0 || (s_new == 0 && s_q == 0) {
        return Ok(());
    }
    for (arg, t) in [("k", t.k_new), ("v", t.v_new), ("k_cache", k_cache), ("v_cache", v_cache)] {
        check_not_null(arg, t)?;
        check_tile_layout(arg, t)?;
    }
    let arch = crate::device::arch(kn.device.id)?;
    let items = (batch * s_new * heads_k + batch * s_q * heads) as u64;
    let kvs = |t: &TensorMeta| [t.strides[0], t.strides[1], t.strides[2]];
    let zero = [0i64; 3];
    let mut prm = KvAppendParams {
        k_new: t.k_new.ptr as *const c_void,
        v_new: t.v_new.ptr as *const c_void,
        k_cache: k_cache.ptr as *mut c_void,
        v_cache: v_cache.ptr as *mut c_void,
        q: t.q.map_or(std::ptr::null(), |t| t.ptr as *const c_void),
        q_rot: t.q_rot.map_or(std::ptr::null_mut(), |t| t.ptr as *mut c_void),
        cos: t.cos.map_or(std::ptr::null(), |t| t.ptr as *const c_void),
        sin: t.sin.map_or(std::ptr::null(), |t| t.ptr as *const c_void),
        seqlens: kv.cache_seqlens.map_or(std::ptr::null(), |t| t.ptr as *const i32),
        batch_idx: kv.cache_batch_idx.map_or(std::ptr::null(), |t| t.ptr as *const i32),
        block_table: kv.block_table.map_or(std::ptr::null(), |t| t.ptr as *const i32),
        kn: strides3(kn),
        vn: strides3(vn),
        kc: kvs(&k_cache.meta),
        vc: kvs(&v_cache.meta),
        qs: t.q.map_or(zero, |t| strides3(&t.meta)),
        qr: t.q_rot.map_or(zero, |t| strides3(&t.meta)),
        block_table_batch_stride: kv.block_table.map_or(0, |t| t.meta.strides[0]),
        batch: batch as i32,
        s_new: s_new as i32,
        heads_k: heads_k as i32,
        s_q: s_q as i32,
        heads: heads as i32,
        head_dim: d as i32,
        rotary_dim: rotary_dim as i32,
        seqlen_ro: seqlen_ro as i32,
        interleaved: a.interleaved as i32,
        q_per_token: a.q_per_token as i32,
        cache_rows: cache.cache_rows as i32,
        cache_batches: cache.cache_batches as i32,
        page_size: cache.page_size as i32,
    };
    let kernel = APPEND.get(&KvAppendConfig { dtype: kn.dtype, arch }, kn.device.id)?;
    let shape = LaunchShape { grid: (items.div_ceil(4) as u32, 1, 1), block: (128, 1, 1), dynamic_smem_bytes: 0 };
    let elem = kn.dtype.size_bytes() as f64;
    let info = LaunchInfo {
        op: "ferroattn::kv_append",
        work: Work { flops: 0.0, bytes: items as f64 * d as f64 * elem * 2.0, exact: true },
    };
    // SAFETY: `prm` mirrors KvAppendParams; the kernel skips every position or index outside the
    // cache, so no device-side value moves a write outside k_cache / v_cache.
    unsafe { launch(kernel, kn.device.id, &shape, stream, &mut prm, &info) }
}

#[cfg(test)]
mod tests;
