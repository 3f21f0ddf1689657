//! 2:4 structured sparsity: compress / decompress (GPU kernels and the CPU reference of
//! host.rs) and the sparse matmul out = act(x @ w.T + bias) with w 2:4-compressed.
//! Validation (shared by the metadata-only `matmul_check` and the launches), kernel parameter
//! structs (mirrors of kernels/sparse24/params.cuh) and launches.
//!
//! The compressed layout is documented in host.rs (the reference).
//!
//! Files: this one (kernel parameter mirrors, production specs, the backend choice and the
//! `matmul` entry with its mma.sp launch), validate.rs (argument checks from metadata),
//! compress.rs (compress / decompress launches and host entry points), wgmma.rs (the Hopper
//! `wgmma .sp` path and its schedules; its switches are tuning knobs, src/tuning/knobs.rs), work.rs
//! (FLOPs and bytes of each launch), host.rs (the CPU reference).

pub mod host;

mod compress;
mod validate;
mod wgmma;
mod work;
pub use compress::{compress, compress_host, decompress, decompress_host};
pub use validate::{layout, validate_matmul, MatmulProblem};
use compress::*;
use validate::*;
use wgmma::*;

use crate::dtype::DType;
use crate::error::{CudaResultExt, Error, Result};
use crate::arch::Arch;
use crate::jit::{impl_kernel_spec, KernelMap, KernelSpec};
use crate::launch::launch;
use crate::launch_record::{LaunchInfo, LaunchShape};
use crate::ops::validate::{
    check_device, check_dtype, check_no_self_overlap, check_not_null, check_shape, check_strides,
};
use crate::tuning::gemm_problem::Activation;
use crate::ops::workspace::{Workspace, WorkspaceLayout};
use crate::tensor::{fmt_shape, overlaps, TensorMeta, TensorView};
use crate::tma::{Swizzle, TensorMap, Tiled};
use crate::tuning::sparse24::{
    compress_production_configs, fuse_split, matmul_config, matmul_production_configs, wgmma_bm128_config,
    wgmma_config_variant, wgmma_pipelined_configs, wgmma_production_configs, wgmma_schedule, wgmma_split_config,
    wgmma_stream_k_config, CompressKind, Sparse24CompressConfig, Sparse24MatmulConfig, Sparse24WgmmaConfig,
    StreamKPolicy, TilePolicy, WgmmaSchedule, WgmmaSplit,
};
use crate::tuning::knobs::Knobs;
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

/// The opt-in pipelined-mainloop wgmma_sp specs (the `wgmma_sp_mainloop` knob `pipe`; not
/// precompiled, checked for spills by the sparse24 tests).
pub fn wgmma_pipelined_specs(arch: Arch) -> Vec<Sparse24WgmmaConfig> {
    wgmma_pipelined_configs(arch)
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

/// Rows (tokens) from which backend "auto" runs wgmma_sp where it can run (sm_90a, TMA-aligned x,
/// not disabled); mma_sp below (its small tiles suit decode-sized calls). 46 because with split-k
/// (GPU time only, bench/results/sparse24_splitk_20261130T1105/): wgmma_sp (split where the rule
/// says) beats mma_sp on all four LLM weight shapes at 64, 96 and 128 rows in bf16 and fp16 (e.g.
/// 64 x 4096 x 11008: 31.0 vs 51.4 us; 64 x 4096 x 4096: 21.6 vs 22.3), mma_sp wins at 16 rows
/// everywhere (15.3 vs 19.7 us at 4096 x 4096). 46 is the boundary of the dispatch table of
/// python/ferroattn/sparse24/dispatch.py between its 32-row entries (measured on mma_sp) and
/// 64-row entries (measured on wgmma_sp): rows >= 46 are nearest to 64 in log space, so each
/// table entry describes the kernel that runs. The crossover between 16 and 64 rows is not
/// measured.
pub const WGMMA_MIN_ROWS: i64 = 46;

/// The kernel "auto" runs for problem `p` on `arch` with input `x` under `knobs`.
fn auto_backend(p: &MatmulProblem, x: &TensorView, arch: Arch, knobs: &Knobs) -> &'static str {
    if p.rows >= WGMMA_MIN_ROWS && wgmma_unsupported(x, arch, knobs).is_none() {
        "wgmma_sp"
    } else {
        "mma_sp"
    }
}

/// Why wgmma_sp cannot run this call (None: it can): the `sparse24_wgmma` knob on, an sm_90a
/// device, and x readable by TMA (16-byte aligned data pointer and row stride; stride 1 along k is
/// validated already).
fn wgmma_unsupported(x: &TensorView, arch: Arch, knobs: &Knobs) -> Option<String> {
    if !knobs.sparse24_wgmma {
        return Some("the sparse24_wgmma knob off (FERROATTN_SPARSE24_WGMMA=0)".into());
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

/// Rows of x move with 16-byte copies: aligned pointer, row stride and k multiples of 8.
fn vec_ok(t: &TensorView, cols: i64) -> bool {
    t.ptr.is_multiple_of(16)
        && cols % 8 == 0
        && (t.meta.shape[0] <= 1 || t.meta.strides[0] % 8 == 0)
}

static MATMUL: KernelMap<Sparse24MatmulConfig> = KernelMap::new();

/// A validated matmul call ([`validate_call`]): the problem, the backend that runs it and what the
/// launch needs (None: rows == 0, nothing to launch): the knobs, the device's arch and, for
/// wgmma_sp, its plan.
struct Call {
    p: MatmulProblem,
    ran: &'static str,
    launch: Option<(Knobs, Arch, Option<WgmmaPlan>)>,
}

/// The common part of [`matmul`] and [`matmul_workspace`]: every check, the backend choice and the
/// wgmma_sp plan.
#[allow(clippy::too_many_arguments)]
fn validate_call(
    x: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    out: &TensorView,
    bias: Option<&TensorView>,
    n: i64,
    k: i64,
    activation: &str,
    backend: &str,
) -> Result<Call> {
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
        return Ok(Call { p, ran, launch: None });
    }
    let knobs = crate::tuning::knobs::get()?;
    let arch = crate::device::arch(p.device)?;
    if backend == "auto" {
        ran = auto_backend(&p, x, arch, &knobs);
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
    let plan = if ran == "wgmma_sp" {
        Some(wgmma_plan(&p, x, arch, crate::device::sm_count(p.device)? as u64, &knobs)?)
    } else {
        None
    };
    Ok(Call { p, ran, launch: Some((knobs, arch, plan)) })
}

/// Bytes of the workspace a [`matmul`] call with these arguments needs (0: none; only wgmma_sp's
/// split-k, fused split-k and stream-K schedules have one): the same checks and plan as the
/// launch, so the caller allocates exactly what it checks (`_native.sparse24_matmul_workspace`;
/// src/ops/workspace.rs).
#[allow(clippy::too_many_arguments)]
pub fn matmul_workspace(
    x: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    out: &TensorView,
    bias: Option<&TensorView>,
    n: i64,
    k: i64,
    activation: &str,
    backend: &str,
) -> Result<u64> {
    let call = validate_call(x, values, meta, out, bias, n, k, activation, backend)?;
    Ok(match &call.launch {
        Some((_, _, Some(plan))) => plan.workspace(&call.p).bytes(),
        _ => 0,
    })
}

/// Validate everything, then launch out = act(x @ w.T + bias) on `stream`; returns the backend
/// that ran. Never synchronises; rows == 0 launches nothing. `workspace`: the caller's uint8
/// buffer of at least [`matmul_workspace`] bytes (None when that is 0), or its allocator
/// (`workspace::Source`), checked here (an error naming `workspace` otherwise).
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
    workspace: &mut crate::ops::workspace::Source<'_>,
    stream: u64,
) -> Result<&'static str> {
    workspace.precheck("workspace")?;
    let Call { p, ran, launch: prepared } = validate_call(x, values, meta, out, bias, n, k, activation, backend)?;
    let Some((knobs, arch, plan)) = prepared else { return Ok(ran) };
    let need = plan.as_ref().map_or(WorkspaceLayout::NONE, |w| w.workspace(&p));
    let tensors = [("x", Some(x)), ("values", Some(values)), ("meta", Some(meta)), ("out", Some(out)), ("bias", bias)];
    let given = workspace.resolve(&need)?;
    let ws = crate::ops::workspace::check("workspace", given.as_ref(), need, "x", &x.meta, &tensors)?;
    let config = matmul_config(
        p.rows as u64,
        p.layout.m_pad as u64,
        crate::device::sm_count(p.device)?,
        p.activation,
        vec_ok(x, p.k),
        p.dtype,
        arch,
        knobs.sparse24_tile,
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
        work: work::matmul(&p, bias_bytes),
    };
    if let Some(plan) = plan {
        launch_wgmma(&p, &plan, x, values, meta, prm, ws.as_ref(), &info, stream)?;
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
