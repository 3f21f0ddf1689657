//! The Hopper GEMM family (kernels/gemm/sm90.cuh and kernels/gemm/sm90_pingpong.cuh, sm_90a:
//! TMA and mbarrier pipeline, wgmma, warp specialisation, persistent tiles): which problems it
//! runs, its TMA tensor maps, kernel parameters, launch shape and launch of a validated
//! [`GemmProblem`]. The kernel (schedule) follows the `gemm_sm90_schedule` knob (default
//! `DEFAULT_POLICY`; src/tuning/knobs.rs).
//!
//! Operand rules (what TMA accepts; anything else goes to the wmma path): a and b fp16/bf16
//! with a 16-byte aligned pointer, a leading dim that is a multiple of 8 elements (16 bytes)
//! when more than one row/column is used, and a batch stride that is a multiple of 8 elements
//! (or 0: broadcast). out is written by TMA stores: pointer, row stride and batch stride
//! 16-byte aligned (when used). c / aux (read / written directly in column pairs): pointer, row
//! stride and batch stride aligned to two elements. m, n, k <= 2^31 - 513 and fewer than 2^31
//! tiles per batch entry (int32 TMA coordinates and tile indices).

use crate::tuning::gemm_problem::{GemmProblem, Operand};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::arch::Arch;
use crate::jit::{impl_kernel_spec, KernelMap, KernelSpec};
use crate::launch::launch as launch_kernel;
use crate::launch_record::{LaunchInfo, LaunchShape};
use crate::tma::{Swizzle, TensorMap, Tiled};
use crate::ops::workspace::Workspace;
use crate::tuning::gemm_sm90::{config, production_configs, schedule_for, GemmSm90Config, Schedule, SplitK, BLOCK_K, GROUP_M, THREADS};
use crate::tuning::knobs::Knobs;

pub(crate) mod splitk; // pub(crate): the 2:4 split-k path (src/ops/sparse24) shares its reduce kernel
pub use splitk::{reduce_production_specs, GemmSplitkReduceParams};

/// Whether `supports` may return true. The kernel passed its H200 checks (84/84 layouts, tails,
/// batches, broadcasts, epilogues vs an fp32 reference; compute-sanitizer memcheck clean) through
/// a harness that builds the same tensor maps and parameter bytes as this file
/// (bench/NOTES.md "Dense GEMM, Hopper path"); set to false to send every problem to the wmma path.
const VERIFIED_ON_GPU: bool = true;

/// Mirror of `struct GemmSm90Params` in kernels/gemm/sm90.cuh (change both together).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemmSm90Params {
    pub tma_a: TensorMap,
    pub tma_b: TensorMap,
    pub tma_out: TensorMap,
    pub out: u64,
    pub c: u64,
    pub bias: u64,
    pub aux: u64,
    pub out_row_stride: i64,
    pub out_batch_stride: i64,
    pub c_row_stride: i64,
    pub c_batch_stride: i64,
    pub aux_row_stride: i64,
    pub aux_batch_stride: i64,
    pub tiles: i64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub batch: i32,
    pub a_batch_step: i32,
    pub b_batch_step: i32,
    pub tiles_m: i32,
    pub tiles_n: i32,
    pub group_m: i32,
    pub activation: i32,
    pub bias_f32: i32,
    pub alpha: f32,
    pub beta: f32,
}

impl_kernel_spec!(GemmSm90Config, smem: |c| c.smem_bytes());

/// What `precompile` builds for this family (sm_90a only).
pub fn production_specs(arch: Arch) -> Vec<GemmSm90Config> {
    production_configs(arch)
}

/// A (TMA-loaded) input operand: its pointer, leading dim and batch stride are 16-byte aligned
/// wherever they are used.
fn tma_operand_ok(o: &Operand) -> bool {
    matches!(o.dtype, DType::F16 | DType::BF16) && o.vector_aligned(8)
}

/// Whether the sm90 family runs `p` correctly on `arch` under `knobs` (module docs list the rules).
pub fn supports(p: &GemmProblem, arch: Arch, knobs: &Knobs) -> bool {
    if !VERIFIED_ON_GPU || arch != Arch::Sm90a {
        return false;
    }
    let out_ok = |o: &Operand| matches!(o.dtype, DType::F16 | DType::BF16 | DType::F32) && o.vector_aligned(2);
    let out_tma_ok = out_ok(&p.out) && p.out.vector_aligned(16 / p.out.dtype.size_bytes() as i64);
    // int32 TMA coordinates and tile offsets: a tile's last coordinate (+ 255) must not wrap.
    let limit = i32::MAX as i64 - 512;
    let cfg = config_for(p, knobs);
    let tiles = tiles_m(p, cfg.block_m) * tiles_n(p, cfg.block_n);
    tma_operand_ok(&p.a)
        && tma_operand_ok(&p.b)
        && out_tma_ok
        && p.c.as_ref().is_none_or(out_ok)
        && p.aux.as_ref().is_none_or(out_ok)
        && p.m <= limit
        && p.n <= limit
        && p.k <= limit
        && p.batch <= i32::MAX as i64
        && tiles <= i32::MAX as i64
}

/// The kernel schedule for `p` (the `gemm_sm90_schedule` knob).
fn schedule(p: &GemmProblem, knobs: &Knobs) -> Schedule {
    schedule_for(knobs.gemm_sm90_schedule, p.k, p.activation)
}

/// The specialisation for `p`: its layouts, the schedule and the `gemm_sm90_fast_epilogue` knob
/// (the branch-free epilogue loop for calls without c and aux; off, every call takes the general
/// loop, whose specialisations are not precompiled: NVRTC builds them on first use).
fn config_for(p: &GemmProblem, knobs: &Knobs) -> GemmSm90Config {
    // a (m, k) is K-major when row-major; b (k, n) is K-major when column-major.
    config(
        p.input_dtype(),
        p.out_dtype(),
        p.a.row_major(),
        !p.b.row_major(),
        p.activation,
        knobs.gemm_sm90_fast_epilogue,
        schedule(p, knobs),
    )
}

fn tiles_m(p: &GemmProblem, block_m: u32) -> i64 {
    (p.m + block_m as i64 - 1) / block_m as i64
}

fn tiles_n(p: &GemmProblem, block_n: u32) -> i64 {
    (p.n + block_n as i64 - 1) / block_n as i64
}

/// The rank-3 tensor map of an input operand: (contiguous dim, other dim, batch), box
/// (64, `box_other`, 1), 128-byte swizzle. A dim of size 1 gets a stride that meets TMA's
/// rules (it is never stepped over). Returns the map and the batch coordinate step (0 when the
/// operand is broadcast over the batch).
fn operand_map(arg: &str, o: &Operand, batch: i64, k_major_dims: (i64, i64), box_other: u32) -> Result<(TensorMap, i32)> {
    let elem = o.dtype.size_bytes() as u64;
    let (inner, outer) = k_major_dims;
    let ld = o.leading_dim() as u64 * elem;
    let round16 = |x: u64| x.div_ceil(16).max(1) * 16;
    let ld = if outer > 1 { ld } else { round16(inner as u64 * elem) };
    let broadcast = o.batch_stride == 0 || batch == 1;
    let (batch_dim, batch_stride) = if broadcast {
        (1, round16(ld * outer as u64))
    } else {
        (batch as u64, o.batch_stride as u64 * elem)
    };
    let map = Tiled {
        dtype: o.dtype,
        ptr: o.ptr,
        dims: vec![inner as u64, outer as u64, batch_dim],
        strides_bytes: vec![ld, batch_stride],
        box_dims: vec![BLOCK_K, box_other, 1],
        swizzle: Swizzle::B128,
    }
    .encode(arg)?;
    Ok((map, if broadcast { 0 } else { 1 }))
}

/// The tensor map the epilogue stores out through: (n, m, batch), box (128 bytes of columns,
/// 64 rows, 1), 128-byte swizzle (kernels/gemm/sm90.cuh `epilogue`).
fn out_map(p: &GemmProblem) -> Result<TensorMap> {
    let o = &p.out;
    let elem = o.dtype.size_bytes() as u64;
    let round16 = |x: u64| x.div_ceil(16).max(1) * 16;
    let ld = if p.m > 1 { o.row_stride as u64 * elem } else { round16(p.n as u64 * elem) };
    let (batch_dim, batch_stride) = if p.batch > 1 {
        (p.batch as u64, o.batch_stride as u64 * elem)
    } else {
        (1, round16(ld * p.m as u64))
    };
    Tiled {
        dtype: o.dtype,
        ptr: o.ptr,
        dims: vec![p.n as u64, p.m as u64, batch_dim],
        strides_bytes: vec![ld, batch_stride],
        box_dims: vec![(128 / elem) as u32, 64, 1],
        swizzle: Swizzle::B128,
    }
    .encode("out")
}

static KERNELS: KernelMap<GemmSm90Config> = KernelMap::new();

/// Launch the sm90 kernel for `p` on `stream` (raw CUstream). Never synchronises.
///
/// With `split` (`splitk::plan`: small-m problems, too few 128 x 256 tiles to fill the SMs) the
/// problem runs split-k (src/ops/gemm/sm90/splitk.rs: one batched launch of this kernel over
/// k-chunks into the caller's fp32 workspace `ws`, then kernels/gemm/splitk_reduce.cuh); where
/// the split views cannot be built (a tensor map the driver rejects) it runs unsplit.
///
/// # Safety
/// `p` must come from `tuning::gemm_problem` (validated, pointers live until the kernel has run
/// in stream order) and `supports(p, Sm90a, knobs)` must hold; `ws` (given with `split`) was
/// checked for `splitk::workspace(p, split)` and lives as long as the tensors.
pub unsafe fn launch(p: &GemmProblem, knobs: &Knobs, split: Option<SplitK>, ws: Option<&Workspace>, stream: u64) -> Result<()> {
    if !supports(p, crate::device::arch(p.device)?, knobs) {
        return Err(Error::argument(
            "backend",
            "a problem the sm90 path supports (16-byte aligned TMA operands on an sm_90 device)",
            "an unsupported problem for \"sm90\"",
        ));
    }
    if let (Some(s), Some(ws)) = (split, ws) {
        // SAFETY: forwarded from the caller.
        if unsafe { splitk::launch(p, knobs, s, ws, stream)? } {
            return Ok(());
        }
    }
    let prepared = prepare(p, knobs)?;
    // SAFETY: forwarded from the caller.
    unsafe { prepared.launch(p, stream) }
}

/// One GEMM launch, ready to go: kernel, parameter bytes, launch shape.
struct Prepared {
    kernel: &'static crate::jit::Kernel,
    params: GemmSm90Params,
    shape: LaunchShape,
}

impl Prepared {
    /// # Safety
    /// As `launch`; `p` is the problem `self` was prepared from.
    unsafe fn launch(mut self, p: &GemmProblem, stream: u64) -> Result<()> {
        let info = LaunchInfo {
            op: "ferroattn::gemm",
            work: super::work::gemm(p),
        };
        // SAFETY: `params` mirrors GemmSm90Params; the caller keeps the tensors alive.
        unsafe { launch_kernel(self.kernel, p.device, &self.shape, stream, &mut self.params, &info) }
    }
}

/// The kernel, tensor maps, parameters and grid of `p` (a problem `supports` accepts); errors
/// from the JIT or from tensor-map encoding (an ArgumentError naming the operand).
fn prepare(p: &GemmProblem, knobs: &Knobs) -> Result<Prepared> {
    let cfg = config_for(p, knobs);
    let kernel = KERNELS.get(&cfg, p.device)?;
    // a: K-major (k, m) boxes of 64 x block_m; M-major (m, k) boxes of 64 x 64.
    let (tma_a, a_step) = if cfg.a_k_major {
        operand_map("a", &p.a, p.batch, (p.k, p.m), cfg.block_m)?
    } else {
        operand_map("a", &p.a, p.batch, (p.m, p.k), 64)?
    };
    // b: K-major (k, n) boxes of 64 x block_n (64 x 64 with B multicast: each CTA of a cluster
    // loads half of the tile's block_n = 128 rows); N-major (n, k) boxes of 64 x 64.
    let cluster = cfg.schedule.cluster();
    let (tma_b, b_step) = if cfg.b_k_major {
        operand_map("b", &p.b, p.batch, (p.k, p.n), cfg.block_n / cluster)?
    } else {
        operand_map("b", &p.b, p.batch, (p.n, p.k), 64)?
    };
    let tma_out = out_map(p)?;
    let (tm, tn) = (tiles_m(p, cfg.block_m), tiles_n(p, cfg.block_n));
    let tiles = p.batch * tm * tn;
    let sms = crate::device::sm_count(p.device)? as i64;
    // Persistent grid: one CTA per SM at most; by default the fewest CTAs that keep the wave
    // count (src/tuning/grid.rs; the `persistent_grid` knob). With clusters of 2 the work units
    // are pairs of m-tiles (kernels/gemm/sm90_pingpong.cuh) and the grid a multiple of 2.
    let grid = if cluster == 2 {
        let units = p.batch * ((tm + 1) / 2) * tn;
        2 * units.min((sms / 2).max(1))
    } else {
        knobs.persistent_grid.grid(tiles as u64, sms as u64) as i64
    };
    let (c, c_row, c_batch) = p.c.map_or((0, 0, 0), |c| (c.ptr, c.row_stride, c.batch_stride));
    let (aux, aux_row, aux_batch) = p.aux.map_or((0, 0, 0), |a| (a.ptr, a.row_stride, a.batch_stride));
    let params = GemmSm90Params {
        tma_a,
        tma_b,
        tma_out,
        out: p.out.ptr,
        c,
        bias: p.bias.map_or(0, |(ptr, _)| ptr),
        aux,
        out_row_stride: p.out.row_stride,
        out_batch_stride: p.out.batch_stride,
        c_row_stride: c_row,
        c_batch_stride: c_batch,
        aux_row_stride: aux_row,
        aux_batch_stride: aux_batch,
        tiles,
        m: p.m as i32,
        n: p.n as i32,
        k: p.k as i32,
        batch: p.batch as i32,
        a_batch_step: a_step,
        b_batch_step: b_step,
        tiles_m: tm as i32,
        tiles_n: tn as i32,
        group_m: GROUP_M,
        activation: p.activation.code(),
        bias_f32: p.bias.is_some_and(|(_, d)| d == DType::F32) as i32,
        alpha: p.alpha,
        beta: p.beta,
    };
    let shape = LaunchShape {
        grid: (grid as u32, 1, 1),
        block: (THREADS, 1, 1),
        dynamic_smem_bytes: cfg.smem_bytes(),
    };
    Ok(Prepared { kernel, params, shape })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tuning::gemm_sm90::SchedulePolicy;

    #[test]
    fn params_layout_matches_the_kernel_struct() {
        // Three 128-byte tensor maps, 4 pointers, 7 i64, 11 i32, 2 f32 = 524 bytes, padded to
        // the 128-byte alignment of the maps (kernels/gemm/sm90.cuh has the same members in order).
        assert_eq!(std::mem::align_of::<GemmSm90Params>(), 128);
        assert_eq!(std::mem::size_of::<GemmSm90Params>(), 640);
        assert_eq!(std::mem::offset_of!(GemmSm90Params, out), 384);
        assert_eq!(std::mem::offset_of!(GemmSm90Params, tiles), 464);
        assert_eq!(std::mem::offset_of!(GemmSm90Params, m), 472);
        assert_eq!(std::mem::offset_of!(GemmSm90Params, alpha), 516);
    }

    fn op(rows: i64, cols: i64, rs: i64, cs: i64, dtype: DType) -> Operand {
        Operand { ptr: 0x10000, rows, cols, row_stride: rs, col_stride: cs, batch_stride: 0, dtype }
    }

    fn problem(m: i64, n: i64, k: i64) -> GemmProblem {
        crate::tuning::gemm_problem::row_major_problem(1, m, n, k, DType::BF16, DType::BF16)
    }

    #[test]
    fn layouts_pick_the_specialisation() {
        let k = Knobs::default();
        let mut p = problem(256, 512, 128);
        assert!(config_for(&p, &k).a_k_major && !config_for(&p, &k).b_k_major);
        p.b = op(128, 512, 1, 128, DType::BF16); // b column-major: K-major
        p.a = op(256, 128, 1, 256, DType::BF16); // a column-major: M-major
        let c = config_for(&p, &k);
        assert!(!c.a_k_major && c.b_k_major);
        assert_eq!(c.schedule, Schedule::Cooperative); // DEFAULT_POLICY
        assert!(c.fast_epilogue); // the precompiled specialisation
        let by_k = Knobs { gemm_sm90_schedule: SchedulePolicy::ByK, gemm_sm90_fast_epilogue: false, ..k };
        let c = config_for(&p, &by_k);
        assert_eq!(c.schedule, Schedule::PingPong); // k = 128, no activation
        assert!(!c.fast_epilogue);
    }

    #[test]
    fn unaligned_operands_are_not_supported() {
        let p = problem(256, 512, 128);
        assert!(tma_operand_ok(&p.a) && tma_operand_ok(&p.b));
        let mut q = p;
        q.a.row_stride = 130; // 260 bytes: not a multiple of 16
        q.a.cols = 130;
        assert!(!tma_operand_ok(&q.a));
        let mut q = p;
        q.b.ptr += 8;
        assert!(!tma_operand_ok(&q.b));
        assert!(!supports(&p, Arch::Sm80, &Knobs::default()));
    }

    /// Every sm90 production specialisation compiles for sm_90a with 0 spills and 0 stack (slow:
    /// 120 NVRTC compiles; `python -m ferroattn precompile --arch sm_90a --check-spills` covers it
    /// with the other families). Run with `-- --ignored sm90_production`.
    #[test]
    #[ignore]
    fn sm90_production_specs_compile_without_spills() {
        let Some(_) = crate::jit::nvrtc::tests::toolchain() else { return };
        let specs = production_specs(Arch::Sm90a);
        assert!(!specs.is_empty());
        let reports = crate::jit::precompile::precompile(&specs).unwrap();
        for r in &reports {
            eprintln!(
                "{} regs {} stack {} spills {}/{}",
                r.config, r.resources.registers, r.resources.stack_bytes, r.resources.spill_stores, r.resources.spill_loads
            );
        }
        crate::jit::precompile::check_spills(&reports).unwrap();
        assert!(reports.iter().all(|r| r.resources.stack_bytes == 0), "a specialisation uses a stack frame");
        assert_eq!(reports.len(), specs.len());
    }

    #[test]
    fn supports_only_tma_layouts_on_sm90a() {
        let k = Knobs::default();
        let supports = |p: &GemmProblem, arch| supports(p, arch, &k);
        let p = problem(256, 512, 128);
        assert_eq!(supports(&p, Arch::Sm90a), VERIFIED_ON_GPU);
        assert!(!supports(&p, Arch::Sm80) && !supports(&p, Arch::Sm120));
        let mut q = p;
        q.out.row_stride = 516; // 1032 bytes: column pairs aligned, the TMA store is not
        assert!(!supports(&q, Arch::Sm90a));
        let mut q = p;
        q.out.dtype = DType::F32;
        q.out.row_stride = 514; // 2056 bytes
        assert!(!supports(&q, Arch::Sm90a));
        let mut q = p;
        q.batch = 2;
        q.out.batch_stride = 256 * 512;
        q.a.batch_stride = 4; // 8 bytes between batch entries of a
        assert!(!supports(&q, Arch::Sm90a));
        q.a.batch_stride = 256 * 128;
        assert_eq!(supports(&q, Arch::Sm90a), VERIFIED_ON_GPU);
        let mut q = p;
        q.c = Some(Operand { row_stride: 513, ..p.out }); // c read in pairs: odd row stride
        q.beta = 1.0;
        assert!(!supports(&q, Arch::Sm90a));
    }
}
