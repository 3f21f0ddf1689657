//! 2:4 sparse matmul, the Hopper `wgmma .sp` path (kernels/sparse24/wgmma_sp.cuh): tensor maps
//! and the launches of its schedules (tiles, banded, stream-k, split-k, fused split-k).

use super::*;

pub(super) static WGMMA: KernelMap<Sparse24WgmmaConfig> = KernelMap::new();

/// What a wgmma_sp call launches ([`wgmma_plan`]): the schedule (src/tuning/sparse24/schedule.rs
/// `wgmma_schedule`) resolved to the kernels that run, with what sets their workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WgmmaLaunch {
    /// Whole tiles of this config on the persistent grid (`launch_wgmma_tiles`).
    Tiles(Sparse24WgmmaConfig),
    /// The banded schedule (`launch_wgmma_banded`).
    Banded { head_tiles: u64 },
    /// The stream-K tail kernel on `grid` CTAs (`launch_wgmma_stream_k`).
    StreamK { dp_tiles: u64, grid: u64 },
    /// Fused split-k of this config (Epi = 3) on `grid` CTAs (`launch_wgmma_split_fused`).
    SplitFused { config: Sparse24WgmmaConfig, split: WgmmaSplit, grid: u64 },
    /// Split-k partial products of this config (Epi = 2) on `grid` CTAs, then the reduce
    /// (`launch_wgmma_split`).
    Split { config: Sparse24WgmmaConfig, split: WgmmaSplit, grid: u64 },
}

/// The plan of a wgmma_sp call: the config whose tensor maps are built (`config`, its `tiles`
/// output tiles and the `k_tiles` 128-k stages), the production config (`base`) and the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct WgmmaPlan {
    pub base: Sparse24WgmmaConfig,
    pub config: Sparse24WgmmaConfig,
    pub tiles: u64,
    pub k_tiles: u64,
    pub launch: WgmmaLaunch,
}

/// One fp32 partial slot of a `cfg` tile: 256 consumer threads x (block_n / 128) x (block_r / 2).
fn slot_bytes(cfg: &Sparse24WgmmaConfig) -> u64 {
    256 * (cfg.block_n as u64 / 128) * (cfg.block_r as u64 / 2) * 4
}

/// The fp32 row stride of the split-k chunks: n rounded up to 4 (the reduce reads float4s).
fn split_row_stride(p: &MatmulProblem) -> u64 {
    (p.n as u64).div_ceil(4) * 4
}

impl WgmmaPlan {
    /// The workspace of the launch (src/ops/workspace.rs; empty: none): stream-K one partial slot
    /// and one counter per CTA; fused split-k one slot and one counter per tile; split-k `splits`
    /// chunks (rows, n rounded up to 4) of fp32, no counters.
    pub fn workspace(&self, p: &MatmulProblem) -> WorkspaceLayout {
        match self.launch {
            WgmmaLaunch::Tiles(_) | WgmmaLaunch::Banded { .. } => WorkspaceLayout::NONE,
            WgmmaLaunch::StreamK { grid, .. } => WorkspaceLayout::with_counters(grid, slot_bytes(&self.config), grid),
            WgmmaLaunch::SplitFused { config, .. } => {
                WorkspaceLayout::with_counters(self.tiles, slot_bytes(&config), self.tiles)
            }
            WgmmaLaunch::Split { split, .. } => {
                WorkspaceLayout::partials(split.splits as u64, p.rows as u64 * split_row_stride(p) * 4)
            }
        }
    }
}

/// The wgmma_sp plan of a validated problem `p` with input `x` on `arch` with `sms` SMs under
/// `knobs` (the kernel forms, the schedule, the persistent grid): the one decision that both the
/// launch ([`launch_wgmma`]) and the workspace planner (`matmul_workspace`) follow. Errors:
/// ArgumentError naming `backend` when wgmma_sp cannot run the call; `x` with too many tiles.
pub(super) fn wgmma_plan(p: &MatmulProblem, x: &TensorView, arch: Arch, sms: u64, knobs: &Knobs) -> Result<WgmmaPlan> {
    if let Some(why) = wgmma_unsupported(x, arch, knobs) {
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
        knobs.wgmma_sp_epilogue.form(),
        knobs.wgmma_sp_mainloop.meta_sets(),
    );
    let rows = p.rows as u64;
    let k_tiles = (p.layout.k_pad as u64).div_ceil(128);
    // the schedule (src/tuning/sparse24/schedule.rs `wgmma_schedule`): split-k, the 128-row tile, the stream-K
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
            knobs.sparse24_splitk,
            if staged { knobs.wgmma_sp_tile } else { TilePolicy::Only256 },
            if staged { knobs.wgmma_sp_streamk } else { StreamKPolicy::Off },
        )
    } else {
        WgmmaSchedule::Tiles
    };
    let config = match schedule {
        WgmmaSchedule::Bm128 => wgmma_bm128_config(p.activation, p.dtype, arch),
        WgmmaSchedule::StreamK { .. } => wgmma_stream_k_config(p.activation, p.dtype, arch),
        _ => base,
    };
    let (row_tiles, n_tiles) = tile_grid(p, config.block_r, config.block_n)?;
    let tiles = row_tiles * n_tiles;
    let grid_of = |units: u64| knobs.persistent_grid.grid(units, sms);
    let launch = match schedule {
        WgmmaSchedule::Split(s) => {
            // split-k where the tiles leave SMs idle (the maps are the production tile's); more
            // work units than 32-bit indices: whole tiles
            let units = tiles * s.splits as u64;
            let fused_cfg = wgmma_config_variant(p.activation, p.dtype, arch, 3, 1);
            if units > i32::MAX as u64 {
                WgmmaLaunch::Tiles(config)
            } else if fuse_split(s.splits, knobs.sparse24_splitk_fuse) && grid_of(units) <= sms {
                // a unit waits only for a unit of lower index: every CTA must be resident
                WgmmaLaunch::SplitFused { config: fused_cfg, split: s, grid: grid_of(units) }
            } else {
                WgmmaLaunch::Split { config: split_cfg, split: s, grid: grid_of(units) }
            }
        }
        WgmmaSchedule::StreamK { dp_tiles, grid } => {
            // an owner waits for CTAs of higher index, so all must be resident (grid <= SMs); sizes
            // past the kernel's 64-bit range arithmetic, or no tail: whole tiles of the production
            // tile with the same maps
            let grid = grid.min(sms);
            let overflow = (tiles.saturating_sub(dp_tiles)).saturating_mul(k_tiles).saturating_mul(grid + 1) > (1u64 << 62);
            if grid == 0 || dp_tiles >= tiles || overflow {
                WgmmaLaunch::Tiles(base)
            } else {
                WgmmaLaunch::StreamK { dp_tiles, grid }
            }
        }
        WgmmaSchedule::Banded { head_tiles } => WgmmaLaunch::Banded { head_tiles },
        WgmmaSchedule::Bm128 | WgmmaSchedule::Tiles => WgmmaLaunch::Tiles(config),
    };
    Ok(WgmmaPlan { base, config, tiles, k_tiles, launch })
}

/// Launch the wgmma_sp kernels of `plan` (from [`wgmma_plan`] for `p` and `x`) for a validated
/// problem whose pointers `matmul` has checked; `prm` carries the mma_sp parameters (row_tiles /
/// n_tiles are recomputed for the wgmma tile); `ws` is the caller's workspace, checked for
/// `plan.workspace(p)` (None when that is empty).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_wgmma(
    p: &MatmulProblem,
    plan: &WgmmaPlan,
    x: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    mut prm: Sparse24MatmulParams,
    ws: Option<&Workspace>,
    info: &LaunchInfo,
    stream: u64,
) -> Result<()> {
    let config = plan.config;
    let (rows, k) = (p.rows as u64, p.k as u64);
    let (m_pad, k_pad) = (p.layout.m_pad as u64, p.layout.k_pad as u64);
    let sms = crate::device::sm_count(p.device)? as u64;
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
    prm.row_tiles = row_tiles as i32;
    prm.n_tiles = n_tiles as i32;
    let mut params = Sparse24WgmmaParams {
        tma_x,
        tma_values,
        tma_meta,
        p: prm,
        ws: std::ptr::null_mut(),
        ws_split_stride: 0,
        ws_row_stride: 0,
        splits: 1,
        chunk_tiles: plan.k_tiles as i32,
        flags: std::ptr::null_mut(),
        dp_tiles: 0,
    };
    let need = |ws: Option<&Workspace>| {
        ws.copied().ok_or_else(|| Error::argument("workspace", "this call's split-k / stream-K workspace", "None"))
    };
    match plan.launch {
        WgmmaLaunch::Tiles(cfg) => launch_wgmma_tiles(p, &mut params, &cfg, plan.tiles, sms, info, stream),
        WgmmaLaunch::Banded { head_tiles } => {
            launch_wgmma_banded(p, &mut params, &config, values.ptr, meta.ptr, head_tiles, sms, info, stream)
        }
        WgmmaLaunch::StreamK { dp_tiles, grid } => {
            params.dp_tiles = dp_tiles as i32;
            launch_with_slots(p, &mut params, &config, grid, &need(ws)?, info, stream)
        }
        WgmmaLaunch::SplitFused { config: cfg, split, grid } => {
            params.splits = split.splits as i32;
            params.chunk_tiles = split.chunk_tiles as i32;
            launch_with_slots(p, &mut params, &cfg, grid, &need(ws)?, info, stream)
        }
        WgmmaLaunch::Split { config: cfg, split, grid } => {
            launch_wgmma_split(p, &mut params, &cfg, split, grid, &need(ws)?, info, stream)
        }
    }
}

/// The TMA maps of the compressed weight's w rows `row0 .. m_pad - 1` (`row0` a multiple of 128, so
/// the 16-row metadata groups and the layout's 128-row padding stay aligned): values (m_pad - row0,
/// k_pad / 2), box (64, block_n, 1) = one stage's 128 logical k of block_n w rows (rows past m_pad are
/// zero fill), 128-byte swizzle; metadata as 4-byte words ((m_pad - row0) / 16, k_pad / 2), box (64,
/// block_n / 16, 1), no swizzle, encoded as float32 (TMA copies the bits; src/tma.rs has no integer
/// types). Layout: src/ops/sparse24/host.rs.
pub(super) fn w_maps(
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
pub(super) fn launch_wgmma_banded(
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
    let head_info = LaunchInfo { op: info.op, work: work::matmul(&head, bias_bytes(&head)) };
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
    let tail_info = LaunchInfo { op: info.op, work: work::matmul(&tail, bias_bytes(&tail)) };
    launch_wgmma_tiles(&tail, &mut tail_params, &tail_cfg, row_tiles * n_tiles, sms, &tail_info, stream)
}

/// Whole tiles on the persistent grid (by default the fewest CTAs that keep ceil(tiles / SMs)
/// waves; src/tuning/grid.rs, the `persistent_grid` knob).
pub(super) fn launch_wgmma_tiles(
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

/// Launch the wgmma_sp kernel `cfg` on `grid` CTAs with the slots + counters workspace `ws`
/// (`WgmmaPlan::workspace`: one partial slot and one counter per CTA for stream-K (Epi = 4), per
/// tile for fused split-k (Epi = 3)); the counters are zeroed on `stream` before the kernel
/// (src/ops/workspace.rs `launch`); sets `params.ws` / `params.flags`.
///
/// Stream-K (`WgmmaSchedule::StreamK`): tiles 0 .. dp_tiles - 1 whole, the rest's stages in `grid`
/// equal ranges; a slot holds the partial sum of a CTA's first segment when that starts inside a
/// tile. Fused split-k (where `fuse_split` says so): `splits` k chunks x tiles as work units; the
/// chunks of a tile pass a running fp32 sum through its slot in chunk order, guarded by its counter;
/// the last chunk runs the staged epilogue into out (no reduce launch, half the workspace traffic of
/// `launch_wgmma_split`). Either way a CTA waits only for others that are resident: `grid` <= SMs
/// (`wgmma_plan` checks it).
fn launch_with_slots(
    p: &MatmulProblem,
    params: &mut Sparse24WgmmaParams,
    cfg: &Sparse24WgmmaConfig,
    grid: u64,
    ws: &Workspace,
    info: &LaunchInfo,
    stream: u64,
) -> Result<()> {
    let shape = LaunchShape {
        grid: (grid as u32, 1, 1),
        block: (Sparse24WgmmaConfig::THREADS, 1, 1),
        dynamic_smem_bytes: cfg.smem_bytes(),
    };
    shape.check()?;
    let kernel = WGMMA.get(cfg, p.device)?;
    // SAFETY: the counter memset and the kernel are enqueued on `stream` only; the maps in
    // `params` describe the validated tensors, which the caller keeps alive in stream order with
    // the workspace.
    unsafe {
        crate::ops::workspace::launch(ws, p.device, stream, |ws| {
            params.ws = ws.partials() as *mut f32;
            params.flags = ws.counters() as *mut u32;
            launch(kernel, p.device, &shape, stream, params, info)
        })
    }
}

/// Split-k wgmma_sp: `split.splits` k chunks x the tiles as work units of the partial-product
/// kernel (`split_cfg`, Epi = 2) on `grid` CTAs into the caller's fp32 workspace `ws` (splits, rows,
/// n rounded up to 4), then the dense path's reduce kernel (kernels/gemm/splitk_reduce.cuh: sum in
/// chunk order, + bias, activation, rounded to x's dtype into out; src/ops/gemm/sm90/splitk.rs).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_wgmma_split(
    p: &MatmulProblem,
    params: &mut Sparse24WgmmaParams,
    split_cfg: &Sparse24WgmmaConfig,
    split: WgmmaSplit,
    grid: u64,
    ws: &Workspace,
    info: &LaunchInfo,
    stream: u64,
) -> Result<()> {
    use crate::ops::gemm::sm90::{splitk, GemmSplitkReduceParams};
    let (rows, n) = (p.rows as u64, p.n as u64);
    let ws_row = split_row_stride(p);
    let split_stride = rows * ws_row;
    let bytes = split.splits as u64 * split_stride * 4;
    let shape = LaunchShape {
        grid: (grid as u32, 1, 1),
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
    // SAFETY: the partial-product kernel and the reduce are enqueued on `stream` only; the maps in
    // `params` describe the validated tensors, which the caller keeps alive in stream order with
    // the workspace (checked for these chunks).
    unsafe {
        crate::ops::workspace::launch(ws, p.device, stream, |ws| {
            params.ws = ws.partials() as *mut f32;
            params.ws_split_stride = split_stride as i64;
            params.ws_row_stride = ws_row as i64;
            params.splits = split.splits as i32;
            params.chunk_tiles = split.chunk_tiles as i32;
            launch(kernel, p.device, &shape, stream, params, info)?;
            let mut rp = GemmSplitkReduceParams {
                ws: ws.partials(),
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
            splitk::launch_reduce(reduce, p.device, &mut rp, info.op, work, stream)
        })
    }
}
