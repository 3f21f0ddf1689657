//! 2:4 structured sparsity: compress / decompress (GPU kernels and the CPU reference of
//! host.rs) and the sparse matmul out = act(x @ w.T + bias) with w 2:4-compressed.
//! Validation (shared by the metadata-only `matmul_check` and the launches), kernel parameter
//! structs (mirrors of kernels/sparse24/params.cuh) and launches.
//!
//! The compressed layout is documented in host.rs (the reference).

pub mod host;

use crate::dtype::DType;
use crate::error::{CudaResultExt, Error, Result};
use crate::arch::Arch;
use crate::jit::{impl_kernel_spec, KernelMap, KernelSpec};
use crate::launch::launch;
use crate::launch_record::{LaunchInfo, LaunchShape};
use crate::ops::validate::{
    check_device, check_dtype, check_no_self_overlap, check_not_null, check_shape, check_strides,
};
use crate::ops::gemm::problem::Activation;
use crate::ops::work;
use crate::tensor::{fmt_shape, overlaps, TensorMeta, TensorView};
use crate::tma::{Swizzle, TensorMap, Tiled};
use crate::tuning::sparse24::{
    compress_production_configs, fuse_split, matmul_config, matmul_production_configs, parse_wgmma_epilogue,
    parse_wgmma_mainloop, parse_wgmma_split, parse_wgmma_split_fuse, parse_wgmma_stream_k, parse_wgmma_tile,
    wgmma_bm128_config, wgmma_config_variant, wgmma_pipelined_configs, wgmma_production_configs, wgmma_schedule,
    wgmma_split_config, wgmma_stream_k_config, CompressKind, Sparse24CompressConfig, Sparse24MatmulConfig,
    FusePolicy, Sparse24WgmmaConfig, SplitPolicy, StreamKPolicy, Tile, TilePolicy, WgmmaSchedule, WgmmaSplit,
};
use host::Layout;
use std::ffi::c_void;

/// Mirror of `struct Sparse24MatmulParams` (kernels/sparse24/params.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Sparse24MatmulParams {
    pub x: *const c_void,
    pub values: *const c_void,
    pub meta: *const u32,
    pub bias: *const c_void,
    pub out: *mut c_void,
    pub x_row_stride: i64,
    pub out_row_stride: i64,
    pub rows: i32,
    pub n: i32,
    pub k: i32,
    pub k_pad: i32,
    pub bias_kind: i32,
    pub vec_out: i32,
    pub row_tiles: i32,
    pub n_tiles: i32,
}

/// Mirror of `struct Sparse24WgmmaParams` (kernels/sparse24/wgmma_sp.cuh; 640 bytes, the kernel
/// static_asserts the C layout): the TMA maps of x, values and meta, then the mma_sp parameters
/// (x / values / meta pointers informational, row_tiles = ceil(rows / block_r), n_tiles =
/// m_pad / 128).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Sparse24WgmmaParams {
    pub tma_x: TensorMap,
    pub tma_values: TensorMap,
    pub tma_meta: TensorMap,
    pub p: Sparse24MatmulParams,
    /// Split-k (kernel form Epi = 2) only: the fp32 workspace (splits, rows, ws_row_stride).
    pub ws: *mut f32,
    pub ws_split_stride: i64,
    pub ws_row_stride: i64,
    pub splits: i32,
    pub chunk_tiles: i32,
    /// Fused split-k (kernel form Epi = 3) only: one zeroed counter per tile; stream-K (Epi = 4): one
    /// zeroed counter per CTA.
    pub flags: *mut u32,
    /// Stream-K (kernel form Epi = 4) only: tiles run whole before the stream-K tail.
    pub dp_tiles: i32,
}

/// Mirror of `struct Sparse24CompressParams` (kernels/sparse24/params.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Sparse24CompressParams {
    pub dense: *mut c_void,
    pub values: *mut c_void,
    pub meta: *mut u32,
    pub bad_groups: *mut i32,
    pub dense_row_stride: i64,
    pub m: i32,
    pub k: i32,
    pub m_pad: i32,
    pub k_pad: i32,
    pub prune: i32,
}

impl_kernel_spec!(
    Sparse24MatmulConfig,
    kernel: |_| Sparse24MatmulConfig::KERNEL,
    header: |_| "sparse24/mma_sp.cuh",
    smem: |c| c.smem_bytes(),
);

impl_kernel_spec!(
    Sparse24WgmmaConfig,
    kernel: |_| Sparse24WgmmaConfig::KERNEL,
    header: |_| "sparse24/wgmma_sp.cuh",
    smem: |c| c.smem_bytes(),
);

impl_kernel_spec!(
    Sparse24CompressConfig,
    kernel: |c| Sparse24CompressConfig::kernel(c),
    header: |_| "sparse24/compress.cuh",
    smem: |_| 0,
);

/// What `precompile` builds for this family: (matmul configs, compress configs).
pub fn production_specs(arch: Arch) -> (Vec<Sparse24MatmulConfig>, Vec<Sparse24CompressConfig>) {
    (
        matmul_production_configs(arch),
        compress_production_configs(arch),
    )
}

/// What `precompile` should build for the wgmma_sp backend (sm_90a only; empty elsewhere).
/// Not yet part of `production_specs` (its callers in src/ops/mod.rs take a pair).
pub fn wgmma_production_specs(arch: Arch) -> Vec<Sparse24WgmmaConfig> {
    wgmma_production_configs(arch)
}

/// The opt-in pipelined-mainloop wgmma_sp specs ($FERROATTN_WGMMA_SP_MAINLOOP=pipe; not
/// precompiled, checked for spills by the sparse24 tests).
pub fn wgmma_pipelined_specs(arch: Arch) -> Vec<Sparse24WgmmaConfig> {
    wgmma_pipelined_configs(arch)
}

/// Largest m, k, rows, n the kernels index with 32-bit counts.
const MAX_DIM: i64 = i32::MAX as i64 - 256;

/// The compressed layout of a (m, k) matrix; m, k >= 0 and small enough for 32-bit counts.
pub fn layout(m: i64, k: i64) -> Result<Layout> {
    for (arg, v) in [("m", m), ("k", k)] {
        if !(0..=MAX_DIM).contains(&v) {
            return Err(Error::argument(
                arg,
                format!("an integer in [0, {MAX_DIM}]"),
                v,
            ));
        }
    }
    Ok(Layout::new(m as usize, k as usize))
}

fn check_rank2(arg: &str, t: &TensorMeta, what: &str) -> Result<()> {
    if t.strides.len() != t.shape.len() {
        return Err(Error::argument(
            arg,
            format!("{} strides", t.shape.len()),
            format!("{} strides", t.strides.len()),
        ));
    }
    if t.shape.len() != 2 {
        return Err(Error::argument(
            arg,
            format!("2 dims {what}"),
            format!("{} dims (shape {})", t.shape.len(), fmt_shape(&t.shape)),
        ));
    }
    if let Some(s) = t.shape.iter().find(|&&s| s < 0) {
        return Err(Error::argument(arg, "non-negative sizes", s));
    }
    Ok(())
}

/// Row-major contiguous (strides of size-1 dims are ignored).
fn check_contiguous(arg: &str, t: &TensorMeta) -> Result<()> {
    let want = TensorMeta::contiguous_strides(&t.shape);
    let ok = t
        .shape
        .iter()
        .zip(t.strides.iter().zip(&want))
        .all(|(&n, (&s, &w))| n <= 1 || s == w);
    if !ok {
        return Err(Error::argument(
            arg,
            format!("a contiguous tensor (strides {want:?})"),
            format!("strides {:?} for shape {}", t.strides, fmt_shape(&t.shape)),
        ));
    }
    Ok(())
}

fn check_16bit_float(arg: &str, t: &TensorMeta) -> Result<()> {
    if !matches!(t.dtype, DType::F16 | DType::BF16) {
        return Err(Error::dtype(arg, "float16 or bfloat16", t.dtype));
    }
    Ok(())
}

/// values and meta of a (m, k) matrix: shapes of `l`, `dtype` / int16, contiguous, on `dense`'s device.
fn check_compressed(
    values: &TensorMeta,
    meta: &TensorMeta,
    l: &Layout,
    dtype: DType,
    dense: &str,
) -> Result<()> {
    let why = format!(" (sparse24_layout({}, {}))", l.m, l.k);
    check_rank2("values", values, "(m_pad, k_pad / 2)")?;
    check_dtype("values", values, dtype, &format!(" ({dense}'s dtype)"))?;
    let vs = l.values_shape().map(|v| v as i64);
    check_shape("values", values, &vs, &why)?;
    check_contiguous("values", values)?;
    check_rank2("meta", meta, "(m_pad / 16, k_pad)")?;
    check_dtype("meta", meta, DType::I16, "")?;
    let ms = l.meta_shape().map(|v| v as i64);
    check_shape("meta", meta, &ms, &why)?;
    check_contiguous("meta", meta)?;
    Ok(())
}

/// A dense (m, k) 16-bit matrix with stride 1 along k: w of compress, out of decompress.
fn check_dense_matrix(arg: &str, t: &TensorMeta) -> Result<Layout> {
    check_rank2(arg, t, "(m, k)")?;
    check_16bit_float(arg, t)?;
    check_strides(arg, t)?;
    check_no_self_overlap(arg, t, "rows that do not overlap (row stride >= k)")?;
    layout(t.shape[0], t.shape[1])
}

/// [start, end) bytes spanned by a tensor with non-negative strides (empty: None).
fn byte_span(t: &TensorView) -> Option<(u128, u128)> {
    let m = &t.meta;
    if m.shape.contains(&0) {
        return None;
    }
    let e = m.dtype.size_bytes() as u128;
    let last: u128 = m
        .shape
        .iter()
        .zip(&m.strides)
        .map(|(&n, &s)| (n.max(1) - 1) as u128 * s.max(0) as u128 * e)
        .sum();
    Some((t.ptr as u128, t.ptr as u128 + last + e))
}

/// No pair may share memory. `strict` (host reference: the tensors become Rust slices): the
/// byte spans must be disjoint; otherwise elements must be disjoint (`tensor::overlaps`, so
/// e.g. x and out may be interleaved column slices of one buffer).
fn check_no_overlap(pairs: &[(&str, &TensorView, &str, &TensorView)], strict: bool) -> Result<()> {
    for (a, ta, b, tb) in pairs {
        let spans = match (byte_span(ta), byte_span(tb)) {
            (Some((a0, a1)), Some((b0, b1))) => a0 < b1 && b0 < a1,
            _ => false,
        };
        if spans && (strict || overlaps(ta, tb)) {
            return Err(Error::argument(
                *a,
                format!("memory that does not overlap {b}"),
                "an overlapping tensor",
            ));
        }
    }
    Ok(())
}

fn check_device_kind(arg: &str, t: &TensorMeta, cuda: bool) -> Result<()> {
    if t.device.is_cuda() != cuda {
        let want = if cuda {
            "a CUDA tensor"
        } else {
            "a CPU tensor"
        };
        return Err(Error::device(arg, want, t.device));
    }
    Ok(())
}

/// Validate compress arguments (GPU when `cuda`, else the host reference).
fn validate_compress(
    w: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    bad: Option<&TensorView>,
    cuda: bool,
) -> Result<Layout> {
    let l = check_dense_matrix("w", &w.meta)?;
    check_compressed(&values.meta, &meta.meta, &l, w.meta.dtype, "w")?;
    if let Some(b) = bad {
        check_dtype("bad_groups", &b.meta, DType::I32, "")?;
        check_shape("bad_groups", &b.meta, &[1], "")?;
    }
    check_device_kind("w", &w.meta, cuda)?;
    check_device("values", &values.meta, "w", &w.meta)?;
    check_device("meta", &meta.meta, "w", &w.meta)?;
    if let Some(b) = bad {
        check_device("bad_groups", &b.meta, "w", &w.meta)?;
    }
    let mut pairs = vec![
        ("values", values, "w", w),
        ("meta", meta, "w", w),
        ("meta", meta, "values", values),
    ];
    if let Some(b) = bad {
        pairs.extend([
            ("bad_groups", b, "w", w),
            ("bad_groups", b, "values", values),
            ("bad_groups", b, "meta", meta),
        ]);
    }
    check_no_overlap(&pairs, !cuda)?;
    Ok(l)
}

fn validate_decompress(
    values: &TensorView,
    meta: &TensorView,
    out: &TensorView,
    cuda: bool,
) -> Result<Layout> {
    let l = check_dense_matrix("out", &out.meta)?;
    check_compressed(&values.meta, &meta.meta, &l, out.meta.dtype, "out")?;
    check_device_kind("out", &out.meta, cuda)?;
    check_device("values", &values.meta, "out", &out.meta)?;
    check_device("meta", &meta.meta, "out", &out.meta)?;
    check_no_overlap(
        &[("out", out, "values", values), ("out", out, "meta", meta)],
        !cuda,
    )?;
    Ok(l)
}

static COMPRESS: KernelMap<Sparse24CompressConfig> = KernelMap::new();

/// Launch compress (`dense` = w, with its `bad_groups` counter) or decompress (`dense` = out)
/// between the dense matrix and the compressed pair `values` / `meta` of layout `l`.
#[allow(clippy::too_many_arguments)]
fn compress_launch(
    kind: CompressKind,
    l: &Layout,
    dense: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    bad_groups: Option<&TensorView>,
    prune: bool,
    stream: u64,
) -> Result<()> {
    let (device, dtype) = (dense.meta.device.id, dense.meta.dtype);
    let mut prm = Sparse24CompressParams {
        dense: dense.ptr as *mut c_void,
        values: values.ptr as *mut c_void,
        meta: meta.ptr as *mut u32,
        bad_groups: bad_groups.map_or(std::ptr::null_mut(), |b| b.ptr as *mut i32),
        dense_row_stride: dense.meta.strides[0],
        m: l.m as i32,
        k: l.k as i32,
        m_pad: l.m_pad as i32,
        k_pad: l.k_pad as i32,
        prune: prune as i32,
    };
    let dense_bytes = (l.m * l.k * dtype.size_bytes()) as f64;
    let arch = crate::device::arch(device)?;
    let config = Sparse24CompressConfig { kind, dtype, arch };
    let words = (l.m_pad / 16) as u64 * (l.k_pad / 2) as u64;
    let shape = LaunchShape {
        grid: (
            words.div_ceil(Sparse24CompressConfig::THREADS as u64) as u32,
            1,
            1,
        ),
        block: (Sparse24CompressConfig::THREADS, 1, 1),
        dynamic_smem_bytes: 0,
    };
    shape.check()?;
    let kernel = COMPRESS.get(&config, device)?;
    let info = LaunchInfo {
        op: "ferroattn::sparse24_compress",
        work: work::sparse24_compress(
            l,
            dtype.size_bytes() as u64,
            dense_bytes,
            kind == CompressKind::Compress,
        ),
    };
    // SAFETY: `prm` mirrors Sparse24CompressParams; the caller keeps the tensors alive in stream order.
    unsafe { launch(kernel, device, &shape, stream, &mut prm, &info) }
}

/// GPU compress of w into values / meta; bad_groups (int32 (1,)) is set to the number of
/// groups with more than 2 non-zeros (zeroed on `stream`, then counted by the kernel).
pub fn compress(
    w: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    bad_groups: &TensorView,
    prune: bool,
    stream: u64,
) -> Result<()> {
    let l = validate_compress(w, values, meta, Some(bad_groups), true)?;
    check_not_null("bad_groups", bad_groups)?;
    // the kernel stores values 16 bytes at a time (and metadata as 4-byte words)
    for (arg, t) in [("values", values), ("meta", meta)] {
        check_aligned(arg, t, 16)?;
    }
    let device = w.meta.device.id;
    crate::device::bind(device)?;
    // SAFETY: bad_groups is a validated int32 (1,) CUDA tensor of this device.
    unsafe { cudarc::driver::result::memset_d8_async(bad_groups.ptr, 0, 4, stream as _) }
        .call("cuMemsetD8Async")?;
    if l.m_pad == 0 || l.k_pad == 0 {
        return Ok(());
    }
    for (arg, t) in [("w", w), ("values", values), ("meta", meta)] {
        check_not_null(arg, t)?;
    }
    compress_launch(CompressKind::Compress, &l, w, values, meta, Some(bad_groups), prune, stream)
}

/// GPU decompress of values / meta into out (m, k).
pub fn decompress(
    values: &TensorView,
    meta: &TensorView,
    out: &TensorView,
    stream: u64,
) -> Result<()> {
    let l = validate_decompress(values, meta, out, true)?;
    // the kernel loads values 16 bytes at a time (and metadata as 4-byte words): a misaligned view
    // would be a misaligned-address fault, which poisons the CUDA context
    for (arg, t) in [("values", values), ("meta", meta)] {
        check_aligned(arg, t, 16)?;
    }
    if l.m == 0 || l.k == 0 {
        return Ok(());
    }
    for (arg, t) in [("values", values), ("meta", meta), ("out", out)] {
        check_not_null(arg, t)?;
    }
    compress_launch(CompressKind::Decompress, &l, out, values, meta, None, false, stream)
}

/// The elements of a validated host tensor, from its data pointer: (rows - 1) · row_stride + cols.
fn host_len(t: &TensorView) -> usize {
    let m = &t.meta;
    if m.shape.contains(&0) {
        return 0;
    }
    ((m.shape[0] - 1) * m.strides[0] + m.shape[1]) as usize
}

/// # Safety
/// `t` is a validated host tensor of 16-bit elements that stays alive and is not written
/// through another alias while the slice lives.
unsafe fn host_slice<'a>(t: &TensorView, len: usize) -> &'a [u16] {
    if len == 0 {
        return &[];
    }
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts(t.ptr as *const u16, len) }
}

/// # Safety
/// As `host_slice`, and no other slice of the same memory exists.
unsafe fn host_slice_mut<'a>(t: &TensorView, len: usize) -> &'a mut [u16] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts_mut(t.ptr as *mut u16, len) }
}

/// `t`'s data pointer is a multiple of `bytes` (the host reference reads u16 / u32 elements; the
/// GPU kernels read values 16 bytes at a time, and TMA needs 16-byte aligned values / meta).
fn check_aligned(arg: &str, t: &TensorView, bytes: u64) -> Result<()> {
    if !t.ptr.is_multiple_of(bytes) {
        return Err(Error::argument(
            arg,
            format!("a {bytes}-byte aligned data pointer"),
            format!("address {:#x}", t.ptr),
        ));
    }
    Ok(())
}

/// The CPU reference of `compress` on host tensors; returns bad_groups.
pub fn compress_host(
    w: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    prune: bool,
) -> Result<usize> {
    let l = validate_compress(w, values, meta, None, false)?;
    for (arg, t) in [("w", w), ("values", values), ("meta", meta)] {
        check_not_null(arg, t)?;
        check_aligned(arg, t, 2)?;
    }
    let nv = l.m_pad * l.k_pad / 2;
    let nm = l.m_pad * l.k_pad / 16;
    // SAFETY: validated host tensors of those lengths, pairwise non-overlapping; the caller
    // (the Python binding) keeps them alive for the call.
    let (wd, vd, md) = unsafe {
        (
            host_slice(w, host_len(w)),
            host_slice_mut(values, nv),
            host_slice_mut(meta, nm),
        )
    };
    let mat = host::Matrix {
        data: wd,
        rows: l.m,
        cols: l.k,
        row_stride: w.meta.strides[0].max(0) as usize,
    };
    Ok(match w.meta.dtype {
        DType::F16 => host::compress::<half::f16>(&mat, vd, md, prune),
        _ => host::compress::<half::bf16>(&mat, vd, md, prune),
    })
}

/// The CPU reference of `decompress` on host tensors.
pub fn decompress_host(values: &TensorView, meta: &TensorView, out: &TensorView) -> Result<()> {
    let l = validate_decompress(values, meta, out, false)?;
    if l.m == 0 || l.k == 0 {
        return Ok(());
    }
    for (arg, t) in [("values", values), ("meta", meta), ("out", out)] {
        check_not_null(arg, t)?;
        check_aligned(arg, t, 2)?;
    }
    let nv = l.m_pad * l.k_pad / 2;
    let nm = l.m_pad * l.k_pad / 16;
    // SAFETY: as in compress_host.
    let (vd, md, od) = unsafe {
        (
            host_slice(values, nv),
            host_slice(meta, nm),
            host_slice_mut(out, host_len(out)),
        )
    };
    host::decompress(vd, md, od, l.m, l.k, out.meta.strides[0].max(0) as usize);
    Ok(())
}

/// A validated sparse matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulProblem {
    pub rows: i64,
    pub n: i64,
    pub k: i64,
    pub layout: Layout,
    pub dtype: DType,
    pub activation: Activation,
    /// 0 none, 1 x's dtype, 2 float32.
    pub bias_kind: i32,
    pub device: i32,
}

/// Validate sparse24_matmul arguments from metadata alone (`out` None from Python's check
/// before it allocates).
#[allow(clippy::too_many_arguments)]
pub fn validate_matmul(
    x: &TensorMeta,
    values: &TensorMeta,
    meta: &TensorMeta,
    out: Option<&TensorMeta>,
    bias: Option<&TensorMeta>,
    n: i64,
    k: i64,
    activation: &str,
) -> Result<MatmulProblem> {
    let activation = Activation::parse("activation", activation)?;
    for (arg, v) in [("n", n), ("k", k)] {
        if !(1..=MAX_DIM).contains(&v) {
            return Err(Error::argument(
                arg,
                format!("an integer in [1, {MAX_DIM}]"),
                v,
            ));
        }
    }
    check_rank2("x", x, "(rows, k)")?;
    check_16bit_float("x", x)?;
    check_strides("x", x)?;
    let rows = x.shape[0];
    if x.shape[1] != k {
        return Err(Error::argument(
            "x",
            format!("{k} columns (k)"),
            format!("shape {}", fmt_shape(&x.shape)),
        ));
    }
    if rows > MAX_DIM {
        return Err(Error::argument(
            "x",
            format!("at most {MAX_DIM} rows"),
            rows,
        ));
    }
    let l = layout(n, k)?;
    check_compressed(values, meta, &l, x.dtype, "x")?;
    let bias_kind = match bias {
        None => 0,
        Some(b) => {
            if b.dtype != x.dtype && b.dtype != DType::F32 {
                return Err(Error::dtype(
                    "bias",
                    format!("{} (x's dtype) or float32", x.dtype),
                    b.dtype,
                ));
            }
            check_shape("bias", b, &[n], " (n,)")?;
            check_strides("bias", b)?;
            if b.dtype == DType::F32 {
                2
            } else {
                1
            }
        }
    };
    if let Some(o) = out {
        check_rank2("out", o, "(rows, n)")?;
        check_dtype("out", o, x.dtype, " (x's dtype)")?;
        check_shape("out", o, &[rows, n], " (rows, n)")?;
        check_strides("out", o)?;
        check_no_self_overlap("out", o, "rows that do not overlap (row stride >= n)")?;
    }
    if !x.device.is_cuda() {
        return Err(Error::device("x", "a CUDA tensor", x.device));
    }
    check_device("values", values, "x", x)?;
    check_device("meta", meta, "x", x)?;
    if let Some(b) = bias {
        check_device("bias", b, "x", x)?;
    }
    if let Some(o) = out {
        check_device("out", o, "x", x)?;
    }
    Ok(MatmulProblem {
        rows,
        n,
        k,
        layout: l,
        dtype: x.dtype,
        activation,
        bias_kind,
        device: x.device.id,
    })
}

/// The backends of sparse24_matmul. "auto" runs wgmma_sp from WGMMA_MIN_ROWS rows where it can
/// run, else mma_sp (`auto_backend`; pick_backend's answer for "auto" is the fallback, mma_sp).
pub const BACKENDS: [&str; 3] = ["auto", "mma_sp", "wgmma_sp"];

fn pick_backend(backend: &str) -> Result<&'static str> {
    match backend {
        "auto" | "mma_sp" => Ok("mma_sp"),
        "wgmma_sp" => Ok("wgmma_sp"),
        _ => Err(Error::argument(
            "backend",
            format!("one of {}", BACKENDS.join(", ")),
            format!("{backend:?}"),
        )),
    }
}

/// (row tiles, weight-row tiles) of a launch with block_r x block_n output tiles (a last weight-row
/// tile may reach past m_pad); ArgumentError on `x` when there are more than 2^31 - 1 tiles (32-bit tile indices and
/// grid.x).
fn tile_grid(p: &MatmulProblem, block_r: u32, block_n: u32) -> Result<(u64, u64)> {
    let row_tiles = (p.rows as u64).div_ceil(block_r as u64);
    let n_tiles = (p.layout.m_pad as u64).div_ceil(block_n as u64);
    if row_tiles * n_tiles > i32::MAX as u64 {
        return Err(Error::argument(
            "x",
            "fewer rows (more than 2^31 - 1 output tiles)",
            p.rows,
        ));
    }
    Ok((row_tiles, n_tiles))
}

/// Whether the wgmma_sp kernel may run: on unless FERROATTN_SPARSE24_WGMMA is "0" (a switch for a
/// GPU run that finds it wrong; its harness passed 23/23 on the H200 after the metadata-register
/// fix, bench/results/sparse24_wgmma_harness_20261130T0412/).
fn wgmma_enabled() -> bool {
    std::env::var("FERROATTN_SPARSE24_WGMMA").map_or(true, |v| v.trim() != "0")
}

/// Rows (tokens) from which backend "auto" runs wgmma_sp where it can run (sm_90a, TMA-aligned x,
/// not disabled); mma_sp below (its small tiles suit decode-sized calls). 46 because with split-k
/// (GPU time only, bench/results/sparse24_splitk_20261130T1105/): wgmma_sp (split where the rule
/// says) beats mma_sp on all four LLM weight shapes at 64, 96 and 128 rows in bf16 and fp16 (e.g.
/// 64 x 4096 x 11008: 31.0 vs 51.4 us; 64 x 4096 x 4096: 21.6 vs 22.3), mma_sp wins at 16 rows
/// everywhere (15.3 vs 19.7 us at 4096 x 4096). 46 is the boundary of python/ferroattn/sparse24.py's
/// dispatch table between its 32-row entries (measured on mma_sp) and 64-row entries (measured on
/// wgmma_sp): rows >= 46 are nearest to 64 in log space, so each table entry describes the kernel
/// that runs. The crossover between 16 and 64 rows is not measured.
pub const WGMMA_MIN_ROWS: i64 = 46;

/// The kernel "auto" runs for problem `p` on `arch` with input `x`.
fn auto_backend(p: &MatmulProblem, x: &TensorView, arch: Arch) -> &'static str {
    if p.rows >= WGMMA_MIN_ROWS && wgmma_unsupported(x, arch).is_none() {
        "wgmma_sp"
    } else {
        "mma_sp"
    }
}

/// Why wgmma_sp cannot run this call (None: it can): an sm_90a device, and x readable by TMA
/// (16-byte aligned data pointer and row stride; stride 1 along k is validated already).
fn wgmma_unsupported(x: &TensorView, arch: Arch) -> Option<String> {
    if !wgmma_enabled() {
        return Some("FERROATTN_SPARSE24_WGMMA=0".into());
    }
    if arch != Arch::Sm90a {
        return Some(format!("a {arch:?} device (wgmma_sp needs sm_90)"));
    }
    if !x.ptr.is_multiple_of(16) {
        return Some(format!(
            "x at address {:#x} (TMA needs 16-byte alignment)",
            x.ptr
        ));
    }
    if x.meta.shape[0] > 1 && (x.meta.strides[0] * 2) % 16 != 0 {
        return Some(format!(
            "x row stride {} elements (TMA needs a multiple of 8)",
            x.meta.strides[0]
        ));
    }
    None
}

static WGMMA: KernelMap<Sparse24WgmmaConfig> = KernelMap::new();

/// Launch the wgmma_sp kernel (kernels/sparse24/wgmma_sp.cuh) for a validated problem whose
/// pointers `matmul` has checked; `prm` carries the mma_sp parameters (row_tiles / n_tiles are
/// recomputed for the wgmma tile).
fn launch_wgmma(
    p: &MatmulProblem,
    x: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    mut prm: Sparse24MatmulParams,
    info: &LaunchInfo,
    stream: u64,
) -> Result<()> {
    let arch = crate::device::arch(p.device)?;
    if let Some(why) = wgmma_unsupported(x, arch) {
        return Err(Error::argument(
            "backend",
            "a call wgmma_sp supports (sm_90 device, 16-byte aligned x rows), or backend=\"mma_sp\"",
            format!("\"wgmma_sp\" with {why}"),
        ));
    }
    let base = wgmma_config_variant(
        p.activation,
        p.dtype,
        arch,
        wgmma_epilogue()?,
        wgmma_mainloop()?,
    );
    let (rows, k) = (p.rows as u64, p.k as u64);
    let (m_pad, k_pad) = (p.layout.m_pad as u64, p.layout.k_pad as u64);
    let sms = crate::device::sm_count(p.device)? as u64;
    let k_tiles = k_pad.div_ceil(128);
    // the schedule (src/tuning/sparse24.rs `wgmma_schedule`): split-k, the 128-row tile, the stream-K
    // tail or whole tiles. The partial-product kernel has the production tile and mainloop, so split-k
    // needs them; the opt-in pipelined mainloop never splits. The 128-row tile and stream-K (precompiled
    // with the staged epilogue) only run with the staged epilogue.
    let split_cfg = wgmma_split_config(p.dtype, arch);
    let same_tile = (split_cfg.block_r, split_cfg.block_n, split_cfg.stages)
        == (base.block_r, base.block_n, base.stages);
    let schedule = if base.meta_sets == 1 && same_tile {
        let (rt, nt) = tile_grid(p, base.block_r, base.block_n)?;
        let staged = base.epilogue == 1;
        wgmma_schedule(
            rt * nt,
            k_tiles,
            rows,
            p.n as u64,
            sms,
            wgmma_split_policy()?,
            if staged { wgmma_tile_policy()? } else { TilePolicy::Only256 },
            if staged { wgmma_stream_k_policy()? } else { StreamKPolicy::Off },
        )
    } else {
        WgmmaSchedule::Tiles
    };
    let config = match schedule {
        WgmmaSchedule::Bm128 => wgmma_bm128_config(p.activation, p.dtype, arch),
        WgmmaSchedule::StreamK { .. } => wgmma_stream_k_config(p.activation, p.dtype, arch),
        _ => base,
    };
    let round16 = |v: u64| v.div_ceil(16).max(1) * 16;
    // x (rows, k): dims (k, rows, 1), box (64, block_r, 1), 128-byte swizzle; zero fill past
    // rows and k. A dim of size 1 gets a stride that meets TMA's rules (never stepped over).
    let ldx = if rows > 1 {
        x.meta.strides[0] as u64 * 2
    } else {
        round16(k * 2)
    };
    let tma_x = Tiled {
        dtype: p.dtype,
        ptr: x.ptr,
        dims: vec![k, rows, 1],
        strides_bytes: vec![ldx, round16(ldx * rows)],
        box_dims: vec![64, config.block_r, 1],
        swizzle: Swizzle::B128,
    }
    .encode("x")?;
    let (tma_values, tma_meta) = w_maps(p.dtype, values.ptr, meta.ptr, k_pad, m_pad, 0, config.block_n)?;
    let (row_tiles, n_tiles) = tile_grid(p, config.block_r, config.block_n)?;
    let tiles = row_tiles * n_tiles;
    prm.row_tiles = row_tiles as i32;
    prm.n_tiles = n_tiles as i32;
    // persistent grid: by default the fewest CTAs that keep ceil(tiles / SMs) waves
    // (src/tuning/grid.rs; $FERROATTN_PERSISTENT_GRID)
    let mut params = Sparse24WgmmaParams {
        tma_x,
        tma_values,
        tma_meta,
        p: prm,
        ws: std::ptr::null_mut(),
        ws_split_stride: 0,
        ws_row_stride: 0,
        splits: 1,
        chunk_tiles: k_tiles as i32,
        flags: std::ptr::null_mut(),
        dp_tiles: 0,
    };
    match schedule {
        WgmmaSchedule::Split(s) => {
            // split-k where the tiles leave SMs idle (the maps above are the production tile's)
            if fuse_split(s.splits, wgmma_split_fuse_policy()?) {
                let fused_cfg = wgmma_config_variant(p.activation, p.dtype, arch, 3, 1);
                if launch_wgmma_split_fused(p, &mut params, &fused_cfg, s, tiles, sms, info, stream)? {
                    return Ok(());
                }
            }
            if launch_wgmma_split(p, &mut params, &split_cfg, s, tiles, sms, info, stream)? {
                return Ok(());
            }
        }
        WgmmaSchedule::StreamK { dp_tiles, grid } => {
            if launch_wgmma_stream_k(p, &mut params, &config, dp_tiles, grid, tiles, k_tiles, sms, info, stream)? {
                return Ok(());
            }
            // not launched (no workspace): whole tiles with the same maps (production tile)
            let plain = base;
            return launch_wgmma_tiles(p, &mut params, &plain, tiles, sms, info, stream);
        }
        WgmmaSchedule::Banded { head_tiles } => {
            return launch_wgmma_banded(p, &mut params, &config, values.ptr, meta.ptr, head_tiles, sms, info, stream);
        }
        WgmmaSchedule::Bm128 | WgmmaSchedule::Tiles => {}
    }
    launch_wgmma_tiles(p, &mut params, &config, tiles, sms, info, stream)
}

/// The TMA maps of the compressed weight's w rows `row0 .. m_pad - 1` (`row0` a multiple of 128, so
/// the 16-row metadata groups and the layout's 128-row padding stay aligned): values (m_pad - row0,
/// k_pad / 2), box (64, block_n, 1) = one stage's 128 logical k of block_n w rows (rows past m_pad are
/// zero fill), 128-byte swizzle; metadata as 4-byte words ((m_pad - row0) / 16, k_pad / 2), box (64,
/// block_n / 16, 1), no swizzle, encoded as float32 (TMA copies the bits; src/tma.rs has no integer
/// types). Layout: src/ops/sparse24/host.rs.
fn w_maps(
    dtype: DType,
    values_ptr: u64,
    meta_ptr: u64,
    k_pad: u64,
    m_pad: u64,
    row0: u64,
    block_n: u32,
) -> Result<(TensorMap, TensorMap)> {
    let round16 = |v: u64| v.div_ceil(16).max(1) * 16;
    let rows = m_pad - row0;
    let values = Tiled {
        dtype,
        ptr: values_ptr + row0 * k_pad,
        dims: vec![k_pad / 2, rows, 1],
        strides_bytes: vec![k_pad, round16(k_pad * rows)],
        box_dims: vec![64, block_n, 1],
        swizzle: Swizzle::B128,
    }
    .encode("values")?;
    let meta = Tiled {
        dtype: DType::F32,
        ptr: meta_ptr + (row0 / 16) * 2 * k_pad,
        dims: vec![k_pad / 2, rows / 16, 1],
        strides_bytes: vec![2 * k_pad, round16(2 * k_pad * (rows / 16))],
        box_dims: vec![64, block_n / 16, 1],
        swizzle: Swizzle::None,
    }
    .encode("meta")?;
    Ok((values, meta))
}

/// The banded schedule (`WgmmaSchedule::Banded`): the first `head_tiles` 256-row feature tiles as whole
/// tiles of `head_cfg` (the production tile; `params` holds its maps), then w rows 256 head_tiles ..
/// m_pad - 1 as a second launch of the 128-row tile on the same stream: its own maps (offset into
/// values / meta), out and bias offset by those features, n and the layout cut to them. Each launch
/// records its share of the call's work.
#[allow(clippy::too_many_arguments)]
fn launch_wgmma_banded(
    p: &MatmulProblem,
    params: &mut Sparse24WgmmaParams,
    head_cfg: &Sparse24WgmmaConfig,
    values_ptr: u64,
    meta_ptr: u64,
    head_tiles: u64,
    sms: u64,
    info: &LaunchInfo,
    stream: u64,
) -> Result<()> {
    let row0 = head_tiles * head_cfg.block_n as u64;
    let (m_pad, k_pad) = (p.layout.m_pad as u64, p.layout.k_pad as u64);
    let bias_bytes = |sub: &MatmulProblem| match p.bias_kind {
        1 => (sub.n as usize * p.dtype.size_bytes()) as f64,
        2 => (sub.n as usize * 4) as f64,
        _ => 0.0,
    };
    // head: the production tile over features 0 .. row0 - 1 (every tile interior along w rows)
    let head = MatmulProblem {
        n: row0 as i64,
        layout: Layout { m: row0 as usize, m_pad: row0 as usize, ..p.layout },
        ..*p
    };
    let (row_tiles, _) = tile_grid(&head, head_cfg.block_r, head_cfg.block_n)?;
    params.p.n_tiles = head_tiles as i32;
    let head_info = LaunchInfo { op: info.op, work: work::sparse24_matmul(&head, bias_bytes(&head)) };
    launch_wgmma_tiles(&head, params, head_cfg, row_tiles * head_tiles, sms, &head_info, stream)?;
    // tail: features row0 .. n - 1 on the 128-row tile
    let tail_cfg = wgmma_bm128_config(p.activation, p.dtype, head_cfg.arch);
    let tail = MatmulProblem {
        n: p.n - row0 as i64,
        layout: Layout { m: p.layout.m - row0 as usize, m_pad: (m_pad - row0) as usize, ..p.layout },
        ..*p
    };
    let (tma_values, tma_meta) = w_maps(p.dtype, values_ptr, meta_ptr, k_pad, m_pad, row0, tail_cfg.block_n)?;
    let (row_tiles, n_tiles) = tile_grid(&tail, tail_cfg.block_r, tail_cfg.block_n)?;
    let out_elem = p.dtype.size_bytes() as u64;
    let bias_elem = if p.bias_kind == 2 { 4 } else { p.dtype.size_bytes() as u64 };
    let mut prm = params.p;
    prm.out = (prm.out as u64 + row0 * out_elem) as *mut c_void;
    if !prm.bias.is_null() {
        prm.bias = (prm.bias as u64 + row0 * bias_elem) as *const c_void;
    }
    prm.n = tail.n as i32;
    prm.row_tiles = row_tiles as i32;
    prm.n_tiles = n_tiles as i32;
    let mut tail_params = Sparse24WgmmaParams { tma_values, tma_meta, p: prm, ..*params };
    let tail_info = LaunchInfo { op: info.op, work: work::sparse24_matmul(&tail, bias_bytes(&tail)) };
    launch_wgmma_tiles(&tail, &mut tail_params, &tail_cfg, row_tiles * n_tiles, sms, &tail_info, stream)
}

/// Whole tiles on the persistent grid (by default the fewest CTAs that keep ceil(tiles / SMs)
/// waves; src/tuning/grid.rs, $FERROATTN_PERSISTENT_GRID).
fn launch_wgmma_tiles(
    p: &MatmulProblem,
    params: &mut Sparse24WgmmaParams,
    config: &Sparse24WgmmaConfig,
    tiles: u64,
    sms: u64,
    info: &LaunchInfo,
    stream: u64,
) -> Result<()> {
    let shape = LaunchShape {
        grid: (crate::ops::persistent::persistent_grid(tiles, sms)? as u32, 1, 1),
        block: (Sparse24WgmmaConfig::THREADS, 1, 1),
        dynamic_smem_bytes: config.smem_bytes(),
    };
    shape.check()?;
    let kernel = WGMMA.get(config, p.device)?;
    // SAFETY: `params` mirrors Sparse24WgmmaParams; the maps describe the validated tensors,
    // which the caller keeps alive in stream order.
    unsafe { launch(kernel, p.device, &shape, stream, params, info) }
}

/// Stream-K tail wgmma_sp (kernel form Epi = 4, `WgmmaSchedule::StreamK`): `grid` CTAs (<= the SMs:
/// an owner waits for CTAs of higher index, so all must be resident; else Ok(false)); tiles 0 ..
/// dp_tiles - 1 whole, the rest's stages in `grid` equal ranges. Workspace: one 128 KiB fp32 slot per
/// CTA (the partial sum of its first segment when that starts inside a tile) + one counter per CTA
/// (zeroed here with cuMemsetD32Async). Ok(false): nothing launched (no workspace, or sizes past the
/// kernel's 64-bit range arithmetic).
#[allow(clippy::too_many_arguments)]
fn launch_wgmma_stream_k(
    p: &MatmulProblem,
    params: &mut Sparse24WgmmaParams,
    cfg: &Sparse24WgmmaConfig,
    dp_tiles: u64,
    grid: u64,
    tiles: u64,
    k_tiles: u64,
    sms: u64,
    info: &LaunchInfo,
    stream: u64,
) -> Result<bool> {
    use crate::ops::gemm::sm90::splitk;
    let grid = grid.min(sms);
    if grid == 0 || dp_tiles >= tiles || (tiles - dp_tiles).saturating_mul(k_tiles).saturating_mul(grid + 1) > (1u64 << 62) {
        return Ok(false);
    }
    // slot per CTA: 256 consumer threads x (block_n / 128) x (block_r / 2) fp32
    let slot_bytes = 256 * (cfg.block_n as u64 / 128) * (cfg.block_r as u64 / 2) * 4;
    let flags_off = grid * slot_bytes;
    let bytes = flags_off + grid * 4;
    let shape = LaunchShape {
        grid: (grid as u32, 1, 1),
        block: (Sparse24WgmmaConfig::THREADS, 1, 1),
        dynamic_smem_bytes: cfg.smem_bytes(),
    };
    shape.check()?;
    let kernel = WGMMA.get(cfg, p.device)?;
    crate::device::bind(p.device)?;
    // SAFETY: the body enqueues the counter memset and the kernel on `stream` only; the maps in
    // `params` describe the validated tensors, which the caller keeps alive in stream order; the
    // workspace lives until the kernel has run (stream-ordered free).
    unsafe {
        splitk::with_workspace(p.device, bytes as usize, stream, |ws| {
            cudarc::driver::sys::cuMemsetD32Async(ws + flags_off, 0, grid as usize, stream as _)
                .result()
                .call("cuMemsetD32Async")?;
            params.ws = ws as *mut f32;
            params.flags = (ws + flags_off) as *mut u32;
            params.dp_tiles = dp_tiles as i32;
            launch(kernel, p.device, &shape, stream, params, info)?;
            Ok(true)
        })
    }
}

/// Split-k wgmma_sp: `split.splits` k chunks x `tiles` tiles as work units of the partial-product
/// kernel (`split_cfg`, Epi = 2) into a stream-ordered fp32 workspace (splits, rows, n rounded up
/// to 4), then the dense path's reduce kernel (kernels/gemm/splitk_reduce.cuh: sum in chunk order,
/// + bias, activation, rounded to x's dtype into out). The workspace and reduce launch are the
/// dense split-k's (src/ops/gemm/sm90/splitk.rs). Ok(false): nothing launched (no workspace
/// memory, or too many units): run unsplit.
#[allow(clippy::too_many_arguments)]
fn launch_wgmma_split(
    p: &MatmulProblem,
    params: &mut Sparse24WgmmaParams,
    split_cfg: &Sparse24WgmmaConfig,
    split: WgmmaSplit,
    tiles: u64,
    sms: u64,
    info: &LaunchInfo,
    stream: u64,
) -> Result<bool> {
    use crate::ops::gemm::sm90::{splitk, GemmSplitkReduceParams};
    let (rows, n) = (p.rows as u64, p.n as u64);
    let ws_row = n.div_ceil(4) * 4;
    let split_stride = rows * ws_row;
    let units = tiles * split.splits as u64;
    if units > i32::MAX as u64 {
        return Ok(false);
    }
    let bytes = split.splits as u64 * split_stride * 4;
    let shape = LaunchShape {
        grid: (crate::ops::persistent::persistent_grid(units, sms)? as u32, 1, 1),
        block: (Sparse24WgmmaConfig::THREADS, 1, 1),
        dynamic_smem_bytes: split_cfg.smem_bytes(),
    };
    shape.check()?;
    let kernel = WGMMA.get(split_cfg, p.device)?;
    let reduce = splitk::reduce_kernel(p.dtype, p.activation, p.device)?;
    // bias kinds: ours 1 = x's dtype, 2 = fp32; the reduce's 1 = fp32, 2 = fp16, 3 = bf16
    let bias_kind = match p.bias_kind {
        0 => 0,
        2 => 1,
        _ if p.dtype == DType::F16 => 2,
        _ => 3,
    };
    let e = p.dtype.size_bytes() as f64;
    let bias_bytes = match bias_kind {
        0 => 0.0,
        1 => 4.0 * n as f64,
        _ => e * n as f64,
    };
    let work = crate::launch_record::Work {
        flops: 0.0,
        bytes: (bytes + rows * n * p.dtype.size_bytes() as u64) as f64 + bias_bytes,
        exact: true,
    };
    crate::device::bind(p.device)?;
    // SAFETY: the body enqueues the partial-product kernel and the reduce on `stream` only; the
    // maps in `params` describe the validated tensors, which the caller keeps alive in stream
    // order; the workspace lives until both kernels have run (stream-ordered free).
    unsafe {
        splitk::with_workspace(p.device, bytes as usize, stream, |ws| {
            params.ws = ws as *mut f32;
            params.ws_split_stride = split_stride as i64;
            params.ws_row_stride = ws_row as i64;
            params.splits = split.splits as i32;
            params.chunk_tiles = split.chunk_tiles as i32;
            launch(kernel, p.device, &shape, stream, params, info)?;
            let mut rp = GemmSplitkReduceParams {
                ws,
                out: params.p.out as u64,
                c: 0,
                bias: params.p.bias as u64,
                aux: 0,
                ws_row_stride: ws_row as i64,
                ws_split_stride: split_stride as i64,
                out_row_stride: params.p.out_row_stride,
                c_row_stride: 0,
                aux_row_stride: 0,
                m: rows as i32,
                n: n as i32,
                splits: split.splits as i32,
                bias_kind,
                alpha: 1.0,
                beta: 0.0,
            };
            splitk::launch_reduce(reduce, p.device, &mut rp, info.op, work, stream)?;
            Ok(true)
        })
    }
}

/// Fused split-k wgmma_sp (kernel form Epi = 3; where `fuse_split` says so): `split.splits`
/// k chunks x `tiles` tiles as work units; the chunks of a tile pass a running fp32 sum through one
/// workspace slot per tile (256 x 128 fp32 = 128 KiB at the production tile) in chunk order, guarded
/// by a per-tile counter (zeroed here with cuMemsetD32Async); the last chunk runs the staged epilogue
/// into out. No reduce launch, half the workspace traffic of `launch_wgmma_split`. A unit waits only
/// for a unit of lower index, so every wait ends once all CTAs are resident: the grid must not exceed
/// the SMs (checked; else Ok(false)). Ok(false): nothing launched: run the unfused split.
#[allow(clippy::too_many_arguments)]
fn launch_wgmma_split_fused(
    p: &MatmulProblem,
    params: &mut Sparse24WgmmaParams,
    cfg: &Sparse24WgmmaConfig,
    split: WgmmaSplit,
    tiles: u64,
    sms: u64,
    info: &LaunchInfo,
    stream: u64,
) -> Result<bool> {
    use crate::ops::gemm::sm90::splitk;
    let units = tiles * split.splits as u64;
    if units > i32::MAX as u64 {
        return Ok(false);
    }
    let grid = crate::ops::persistent::persistent_grid(units, sms)?;
    if grid > sms {
        return Ok(false);
    }
    // slot per tile: 256 consumer threads x (block_n / 128) x (block_r / 2) fp32
    let slot_bytes = 256 * (cfg.block_n as u64 / 128) * (cfg.block_r as u64 / 2) * 4;
    let flags_off = tiles * slot_bytes;
    let bytes = flags_off + tiles * 4;
    let shape = LaunchShape {
        grid: (grid as u32, 1, 1),
        block: (Sparse24WgmmaConfig::THREADS, 1, 1),
        dynamic_smem_bytes: cfg.smem_bytes(),
    };
    shape.check()?;
    let kernel = WGMMA.get(cfg, p.device)?;
    crate::device::bind(p.device)?;
    // SAFETY: the body enqueues the counter memset and the kernel on `stream` only; the maps in
    // `params` describe the validated tensors, which the caller keeps alive in stream order; the
    // workspace lives until the kernel has run (stream-ordered free).
    unsafe {
        splitk::with_workspace(p.device, bytes as usize, stream, |ws| {
            cudarc::driver::sys::cuMemsetD32Async(ws + flags_off, 0, tiles as usize, stream as _)
                .result()
                .call("cuMemsetD32Async")?;
            params.ws = ws as *mut f32;
            params.flags = (ws + flags_off) as *mut u32;
            params.splits = split.splits as i32;
            params.chunk_tiles = split.chunk_tiles as i32;
            launch(kernel, p.device, &shape, stream, params, info)?;
            Ok(true)
        })
    }
}

/// Which tile wgmma_sp may use: $FERROATTN_WGMMA_SP_TILE ("auto" or unset: `wgmma_schedule`'s rule;
/// "256": the 256-row tile only; "128": the 128-row tile always; "band:H": the banded schedule with H
/// 256-row feature tiles first). Read per call (same-process A/B).
fn wgmma_tile_policy() -> Result<TilePolicy> {
    let v = std::env::var("FERROATTN_WGMMA_SP_TILE").ok();
    parse_wgmma_tile(v.as_deref()).ok_or_else(|| {
        let got = format!("{:?}", v.unwrap_or_default());
        Error::argument("FERROATTN_WGMMA_SP_TILE", "\"auto\", \"256\", \"128\", \"band:H\" (H >= 1) or unset", got)
    })
}

/// When wgmma_sp runs the stream-K tail: $FERROATTN_WGMMA_SP_STREAMK ("auto" or unset: the cost rule of
/// `wgmma_schedule`; "off": never; "on": always, the rule's tail; "dp:N": always, N whole tiles
/// first). Read per call (same-process A/B).
fn wgmma_stream_k_policy() -> Result<StreamKPolicy> {
    let v = std::env::var("FERROATTN_WGMMA_SP_STREAMK").ok();
    parse_wgmma_stream_k(v.as_deref()).ok_or_else(|| {
        let got = format!("{:?}", v.unwrap_or_default());
        Error::argument("FERROATTN_WGMMA_SP_STREAMK", "\"auto\", \"off\", \"on\", \"dp:N\" or unset", got)
    })
}

/// When split-k fuses the reduce ($FERROATTN_SPARSE24_SPLITK_FUSE: unset = `fuse_split`'s measured
/// rule, "1" always, "0" never). Read per call.
fn wgmma_split_fuse_policy() -> Result<FusePolicy> {
    let v = std::env::var("FERROATTN_SPARSE24_SPLITK_FUSE").ok();
    parse_wgmma_split_fuse(v.as_deref()).ok_or_else(|| {
        let got = format!("{:?}", v.unwrap_or_default());
        Error::argument("FERROATTN_SPARSE24_SPLITK_FUSE", "\"0\", \"1\" or unset", got)
    })
}

/// How wgmma_sp splits k: $FERROATTN_SPARSE24_SPLITK ("auto" or unset: the cost rule of
/// `wgmma_split_plan`; "off" / "0": never; a number n >= 1: n chunks). Read per call
/// (same-process A/B in benchmarks).
fn wgmma_split_policy() -> Result<SplitPolicy> {
    let v = std::env::var("FERROATTN_SPARSE24_SPLITK").ok();
    parse_wgmma_split(v.as_deref()).ok_or_else(|| {
        Error::argument(
            "FERROATTN_SPARSE24_SPLITK",
            "\"auto\", \"off\", \"0\", a chunk count >= 1, or unset",
            format!("{:?}", v.unwrap_or_default()),
        )
    })
}

/// The wgmma_sp epilogue form: $FERROATTN_WGMMA_SP_EPILOGUE ("direct" / "0": stores from the
/// accumulator registers; "smem" / "staged" / "1": staged through shared memory; unset: the
/// production default `WGMMA_EPILOGUE_DEFAULT`). Read per call (same-process A/B in benchmarks).
fn wgmma_epilogue() -> Result<u32> {
    wgmma_form_env(
        "FERROATTN_WGMMA_SP_EPILOGUE",
        "\"direct\", \"smem\", \"0\", \"1\" or unset",
        parse_wgmma_epilogue,
    )
}

/// The wgmma_sp mainloop form: $FERROATTN_WGMMA_SP_MAINLOOP ("wait0" / "1": wgmma.wait_group 0
/// after every stage; "pipe" / "2": two metadata register sets, one stage of wgmmas in flight;
/// unset: the production default `WGMMA_META_SETS_DEFAULT`). Read per call (same-process A/B).
fn wgmma_mainloop() -> Result<u32> {
    wgmma_form_env(
        "FERROATTN_WGMMA_SP_MAINLOOP",
        "\"wait0\", \"pipe\", \"1\", \"2\" or unset",
        parse_wgmma_mainloop,
    )
}

/// A wgmma_sp kernel form chosen by the environment variable `var`, read per call: `parse` maps
/// its value (None when unset) to the form, or to None for a value it does not know, which
/// raises ArgumentError naming `var`, the `expected` values and the value given.
fn wgmma_form_env(
    var: &str,
    expected: &str,
    parse: fn(Option<&str>) -> Option<u32>,
) -> Result<u32> {
    let v = std::env::var(var).ok();
    parse(v.as_deref())
        .ok_or_else(|| Error::argument(var, expected, format!("{:?}", v.unwrap_or_default())))
}

/// A tile forced by $FERROATTN_SPARSE24_TILE ("block_n,block_r,warps_n,warps_r,stages"; for
/// experiments and benchmarks of alternative tiles). Unset: None; malformed: ArgumentError.
fn tile_override() -> Result<Option<Tile>> {
    match std::env::var("FERROATTN_SPARSE24_TILE") {
        Err(_) => Ok(None),
        Ok(s) if s.is_empty() => Ok(None),
        Ok(s) => Tile::parse(&s).map(Some).ok_or_else(|| {
            Error::argument(
                "FERROATTN_SPARSE24_TILE",
                "block_n,block_r,warps_n,warps_r,stages of a valid tile",
                format!("{s:?}"),
            )
        }),
    }
}

/// Rows of x move with 16-byte copies: aligned pointer, row stride and k multiples of 8.
fn vec_ok(t: &TensorView, cols: i64) -> bool {
    t.ptr.is_multiple_of(16)
        && cols % 8 == 0
        && (t.meta.shape[0] <= 1 || t.meta.strides[0] % 8 == 0)
}

static MATMUL: KernelMap<Sparse24MatmulConfig> = KernelMap::new();

/// Validate everything, then launch out = act(x @ w.T + bias) on `stream`; returns the backend
/// that ran. Never synchronises; rows == 0 launches nothing.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    x: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    out: &TensorView,
    bias: Option<&TensorView>,
    n: i64,
    k: i64,
    activation: &str,
    backend: &str,
    stream: u64,
) -> Result<&'static str> {
    let p = validate_matmul(
        &x.meta,
        &values.meta,
        &meta.meta,
        Some(&out.meta),
        bias.map(|b| &b.meta),
        n,
        k,
        activation,
    )?;
    let mut ran = pick_backend(backend)?;
    let mut pairs = vec![
        ("out", out, "x", x),
        ("out", out, "values", values),
        ("out", out, "meta", meta),
    ];
    if let Some(b) = bias {
        pairs.push(("out", out, "bias", b));
    }
    check_no_overlap(&pairs, false)?;
    if p.rows == 0 {
        return Ok(ran);
    }
    if backend == "auto" {
        ran = auto_backend(&p, x, crate::device::arch(p.device)?);
    }
    for (arg, t) in [("x", x), ("values", values), ("meta", meta), ("out", out)] {
        check_not_null(arg, t)?;
    }
    for (arg, t) in [("values", values), ("meta", meta)] {
        check_aligned(arg, t, 16)?;
    }
    if let Some(b) = bias {
        check_not_null("bias", b)?;
        let e = b.meta.dtype.size_bytes() as u64;
        if !b.ptr.is_multiple_of(e) {
            return Err(Error::argument(
                "bias",
                format!("a {e}-byte aligned data pointer"),
                format!("address {:#x}", b.ptr),
            ));
        }
    }
    for (arg, t) in [("x", x), ("out", out)] {
        if !t.ptr.is_multiple_of(2) {
            return Err(Error::argument(
                arg,
                "a 2-byte aligned data pointer",
                format!("address {:#x}", t.ptr),
            ));
        }
    }
    let arch = crate::device::arch(p.device)?;
    let config = matmul_config(
        p.rows as u64,
        p.layout.m_pad as u64,
        crate::device::sm_count(p.device)?,
        p.activation,
        vec_ok(x, p.k),
        p.dtype,
        arch,
        tile_override()?,
    );
    let t = &config.tile;
    let (row_tiles, n_tiles) = tile_grid(&p, t.block_r, t.block_n)?;
    let blocks = row_tiles * n_tiles;
    let shape = LaunchShape {
        grid: (blocks as u32, 1, 1),
        block: (config.threads(), 1, 1),
        dynamic_smem_bytes: config.smem_bytes(),
    };
    let mut prm = Sparse24MatmulParams {
        x: x.ptr as *const c_void,
        values: values.ptr as *const c_void,
        meta: meta.ptr as *const u32,
        bias: bias.map_or(std::ptr::null(), |b| b.ptr as *const c_void),
        out: out.ptr as *mut c_void,
        x_row_stride: x.meta.strides[0],
        out_row_stride: out.meta.strides[0],
        rows: p.rows as i32,
        n: p.n as i32,
        k: p.k as i32,
        k_pad: p.layout.k_pad as i32,
        bias_kind: p.bias_kind,
        vec_out: vec_ok(out, p.n) as i32,
        row_tiles: row_tiles as i32,
        n_tiles: n_tiles as i32,
    };
    let bias_bytes = bias.map_or(0.0, |b| (p.n as usize * b.meta.dtype.size_bytes()) as f64);
    let info = LaunchInfo {
        op: "ferroattn::sparse24_matmul",
        work: work::sparse24_matmul(&p, bias_bytes),
    };
    if ran == "wgmma_sp" {
        launch_wgmma(&p, x, values, meta, prm, &info, stream)?;
        return Ok(ran);
    }
    shape.check()?;
    let kernel = MATMUL.get(&config, p.device)?;
    // SAFETY: `prm` mirrors Sparse24MatmulParams; the caller keeps the tensors alive in stream order.
    unsafe { launch(kernel, p.device, &shape, stream, &mut prm, &info) }?;
    Ok(ran)
}

#[cfg(test)]
mod tests;
