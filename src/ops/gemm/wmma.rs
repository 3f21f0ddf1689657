//! The WMMA GEMM family (kernels/gemm/wmma.cuh, sm_80+): kernel parameters, launch shape and
//! launch of a validated [`GemmProblem`].

use crate::tuning::gemm_problem::GemmProblem;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::arch::Arch;
use crate::jit::{impl_kernel_spec, KernelMap, KernelSpec};
use crate::launch::launch as launch_kernel;
use crate::launch_record::{LaunchInfo, LaunchShape};
use crate::ops::workspace::{Workspace, WorkspaceLayout};
use crate::tuning::gemm::{smem_of, stream_k_plan, wmma_config, wmma_production_configs, GemmWmmaConfig, StreamKPlan, WmmaTile};
use crate::tuning::grid::GridPolicy;
use crate::tuning::knobs::{Knobs, RasterGroup};
use std::ffi::c_void;

/// Mirror of `struct GemmWmmaParams` in kernels/gemm/wmma.cuh (change both together).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemmWmmaParams {
    pub a: *const c_void,
    pub b: *const c_void,
    pub out: *mut c_void,
    pub c: *const c_void,
    pub bias: *const c_void,
    pub aux: *mut c_void,
    pub a_ld: i64,
    pub a_batch_stride: i64,
    pub b_ld: i64,
    pub b_batch_stride: i64,
    pub out_ld: i64,
    pub out_batch_stride: i64,
    pub c_ld: i64,
    pub c_batch_stride: i64,
    pub aux_ld: i64,
    pub aux_batch_stride: i64,
    pub batch: i64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub tiles_m: i32,
    pub tiles_n: i32,
    pub alpha: f32,
    pub beta: f32,
    pub activation: i32,
    pub bias_f32: i32,
    /// Tile rows per raster group (the `gemm_wmma_group` knob).
    pub group: i32,
    /// Stream-k tail of a persistent tile ([`StreamKPlan`]): first tail item, workspace of
    /// grid x bm x bn fp32 partial tiles, grid x warps zeroed flags (NULL: no tail).
    pub sk_first: i64,
    pub sk_ws: *mut f32,
    pub sk_flags: *mut u32,
}

impl_kernel_spec!(
    GemmWmmaConfig,
    kernel: |_| GemmWmmaConfig::KERNEL,
    header: |_| GemmWmmaConfig::HEADER,
    smem: |c| c.smem_bytes(),
);

/// What `precompile` builds for this family.
pub fn production_specs(arch: Arch) -> Vec<GemmWmmaConfig> {
    wmma_production_configs(arch)
}

/// Kernel parameters of a validated problem for `config`'s tiling.
pub fn params(p: &GemmProblem, config: &GemmWmmaConfig) -> GemmWmmaParams {
    let (tiles_m, tiles_n) = config.tiles(p.m, p.n);
    let null = std::ptr::null::<c_void>();
    GemmWmmaParams {
        a: p.a.ptr as *const c_void,
        b: p.b.ptr as *const c_void,
        out: p.out.ptr as *mut c_void,
        c: p.c.map_or(null, |c| c.ptr as *const c_void),
        bias: p.bias.map_or(null, |(ptr, _)| ptr as *const c_void),
        aux: p.aux.map_or(null as *mut c_void, |t| t.ptr as *mut c_void),
        a_ld: p.a.leading_dim(),
        a_batch_stride: p.a.batch_stride,
        b_ld: p.b.leading_dim(),
        b_batch_stride: p.b.batch_stride,
        out_ld: p.out.row_stride,
        out_batch_stride: p.out.batch_stride,
        c_ld: p.c.map_or(0, |c| c.row_stride),
        c_batch_stride: p.c.map_or(0, |c| c.batch_stride),
        aux_ld: p.aux.map_or(0, |t| t.row_stride),
        aux_batch_stride: p.aux.map_or(0, |t| t.batch_stride),
        batch: p.batch,
        // validated: m, n, k <= i32::MAX; tiles fewer
        m: p.m as i32,
        n: p.n as i32,
        k: p.k as i32,
        tiles_m: tiles_m as i32,
        tiles_n: tiles_n as i32,
        alpha: p.alpha,
        beta: if p.c.is_some() { p.beta } else { 0.0 },
        activation: p.activation.code(),
        bias_f32: i32::from(matches!(p.bias, Some((_, DType::F32)))),
        group: RasterGroup::DEFAULT.0 as i32,
        sk_first: 0,
        sk_ws: std::ptr::null_mut(),
        sk_flags: std::ptr::null_mut(),
    }
}

/// The stream-k plan of a persistent launch of `config` for `p` on `sms` SMs: only when every
/// item is interior (m, n, k multiples of the tile, 16-byte copy vectors), over one CTA per SM
/// (or the `persistent_grid` knob's integer cap, for tests), by the `gemm_wmma_streamk` knob.
pub fn stream_k(p: &GemmProblem, config: &GemmWmmaConfig, sms: u32, knobs: &Knobs) -> Option<StreamKPlan> {
    let t = config.tile;
    if !t.persistent
        || p.m % t.bm as i64 != 0
        || p.n % t.bn as i64 != 0
        || p.k % t.bk as i64 != 0
        || config.vec_a != 8
        || config.vec_b != 8
    {
        return None;
    }
    let cap = match knobs.persistent_grid {
        GridPolicy::Max(n) => n.min(u64::from(sms)),
        _ => u64::from(sms),
    };
    let (tm, tn) = config.tiles(p.m, p.n);
    let items = tm.saturating_mul(tn).saturating_mul(p.batch.max(1) as u64);
    stream_k_plan(items, (p.k / t.bk as i64) as u64, cap, knobs.gemm_wmma_streamk)
}

/// Grid (tiles_m · tiles_n, min(batch, 65535)): the kernel loops over the batch in steps of
/// gridDim.y, so any batch count runs. Block: the tile's threads; smem from the config.
/// (A persistent tile's grid is set by [`persistent_shape`] instead.)
pub fn launch_shape(p: &GemmProblem, config: &GemmWmmaConfig) -> LaunchShape {
    let (tm, tn) = config.tiles(p.m, p.n);
    LaunchShape {
        grid: (
            u32::try_from(tm.saturating_mul(tn)).unwrap_or(u32::MAX),
            p.batch.clamp(1, 65535) as u32,
            1,
        ),
        block: (config.threads(), 1, 1),
        dynamic_smem_bytes: config.smem_bytes(),
    }
}

/// Launch shape of a persistent tile (`WmmaTile::persistent`): grid (g, 1, 1) with g the
/// persistent grid of `policy` (src/tuning/grid.rs) over the tiles_m · tiles_n · batch work items
/// and `sms` SMs; the kernel loops over the items.
pub fn persistent_shape(p: &GemmProblem, config: &GemmWmmaConfig, sms: u32, policy: GridPolicy) -> LaunchShape {
    let (tm, tn) = config.tiles(p.m, p.n);
    let items = tm.saturating_mul(tn).saturating_mul(p.batch.max(1) as u64);
    let g = policy.grid(items, u64::from(sms));
    LaunchShape { grid: (u32::try_from(g).unwrap_or(u32::MAX), 1, 1), ..launch_shape(p, config) }
}

/// The tile forced by the `gemm_wmma_tile` knob (tuning experiments), or None.
///
/// # Errors
/// `ArgumentError` naming FERROATTN_GEMM_WMMA_TILE when the tile's ring does not fit `arch`'s
/// shared memory for every layout.
fn tile_override(tile: Option<WmmaTile>, arch: Arch) -> Result<Option<WmmaTile>> {
    let Some(t) = tile else { return Ok(None) };
    let smem = [(true, true), (true, false), (false, true), (false, false)]
        .iter()
        .map(|&(a, b)| smem_of(t, a, b))
        .max()
        .unwrap_or(0);
    if smem > arch.max_smem_per_block() {
        return Err(Error::argument(
            "FERROATTN_GEMM_WMMA_TILE",
            format!("a tile whose shared memory fits {arch} ({} bytes per block)", arch.max_smem_per_block()),
            format!("{t:?} ({smem} bytes)"),
        ));
    }
    Ok(Some(t))
}

static KERNELS: KernelMap<GemmWmmaConfig> = KernelMap::new();

/// What a WMMA launch of a problem runs ([`plan`]): the specialisation, the launch shape and the
/// stream-k tail, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub config: GemmWmmaConfig,
    pub shape: LaunchShape,
    pub stream_k: Option<StreamKPlan>,
}

impl Plan {
    /// The workspace of the stream-k tail (src/ops/workspace.rs): one bm x bn fp32 partial tile
    /// per CTA, then grid x warps flags zeroed before the kernel; none without a tail.
    pub fn workspace(&self) -> WorkspaceLayout {
        let Some(sk) = self.stream_k else { return WorkspaceLayout::NONE };
        let t = self.config.tile;
        let tile_bytes = u64::from(t.bm) * u64::from(t.bn) * 4;
        WorkspaceLayout::with_counters(sk.grid, tile_bytes, sk.grid * u64::from(t.warps_m * t.warps_n))
    }
}

/// The WMMA launch of a validated problem on `arch` with `sms` SMs under `knobs` (the tile
/// override, the persistent grid, the stream-k tail: [`stream_k`], on one CTA per SM). Pure but
/// for the tile override's error ([`tile_override`]).
pub fn plan(p: &GemmProblem, arch: Arch, sms: u32, knobs: &Knobs) -> Result<Plan> {
    let config = wmma_config(p, tile_override(knobs.gemm_wmma_tile, arch)?, sms, arch);
    let mut shape = if config.tile.persistent {
        persistent_shape(p, &config, sms, knobs.persistent_grid)
    } else {
        launch_shape(p, &config)
    };
    let stream_k = stream_k(p, &config, sms, knobs);
    if let Some(sk) = stream_k {
        shape.grid = (sk.grid as u32, 1, 1);
    }
    Ok(Plan { config, shape, stream_k })
}

/// Launch the WMMA kernel for a validated problem on `stream` (raw CUstream) of its device, as
/// `plan` (from [`plan`] for `p`) says; a stream-k tail uses the caller's workspace `ws`, checked
/// for `plan.workspace()` (its flags are zeroed here, on `stream`). Never synchronises; blocking
/// only on the first call of a configuration (compile or load). `knobs`: the raster group. The
/// caller keeps the problem's tensors and `ws` alive until the kernel has run in stream order.
pub fn launch(p: &GemmProblem, plan: &Plan, knobs: &Knobs, ws: Option<&Workspace>, stream: u64) -> Result<()> {
    let shape = plan.shape;
    shape.check()?;
    let kernel = KERNELS.get(&plan.config, p.device)?;
    let mut prm = params(p, &plan.config);
    prm.group = knobs.gemm_wmma_group.0 as i32;
    let info = LaunchInfo {
        op: "ferroattn::gemm",
        work: super::work::gemm(p),
    };
    match (plan.stream_k, ws) {
        (Some(sk), Some(ws)) => {
            debug_assert_eq!(ws.layout, plan.workspace());
            // SAFETY: the flag memset and the kernel are enqueued on `stream`; `ws` was checked
            // for this plan's layout; `prm` as below.
            unsafe {
                crate::ops::workspace::launch(ws, p.device, stream, |ws| {
                    prm.sk_first = sk.sk_first as i64;
                    prm.sk_ws = ws.partials() as *mut f32;
                    prm.sk_flags = ws.counters() as *mut u32;
                    launch_kernel(kernel, p.device, &shape, stream, &mut prm, &info)
                })
            }
        }
        (Some(_), None) => Err(Error::argument("workspace", "the stream-k tail's workspace (Plan::workspace)", "None")),
        (None, _) => {
            // SAFETY: `prm` mirrors GemmWmmaParams; the problem was validated (pointers non-NULL
            // where used, shapes and strides in range) and the caller keeps the tensors alive in
            // stream order.
            unsafe { launch_kernel(kernel, p.device, &shape, stream, &mut prm, &info) }
        }
    }
}
