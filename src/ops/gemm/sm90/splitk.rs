//! Split-k for small-m dense GEMMs on the Hopper path, without a change to the GEMM kernel.
//!
//! A problem with too few 128 x 256 tiles to fill the SMs (`splitk_plan` in
//! src/tuning/gemm_sm90.rs: decode-sized m) is cut along k into `splits` equal chunks of `kc`
//! (a multiple of 64) and run as a *batched* GEMM of the existing sm90 kernel: batch entry s
//! reads a[:, s·kc .. (s+1)·kc] and b[s·kc .. (s+1)·kc, :] through the batch stride of its rank-3
//! tensor maps (a: kc·col_stride elements, b: kc·row_stride elements, for either layout) and
//! writes its raw fp32 product (alpha 1, beta 0, no bias, no activation) to entry s of a
//! workspace (splits, m, n) (row stride n: a multiple of 4 wherever sm90 runs). Then
//! kernels/gemm/splitk_reduce.cuh computes out = act(alpha · Σ_s ws[s] + bias + beta · c) (aux =
//! the pre-activation value) in a fixed order (deterministic), honouring out / c / aux row strides.
//!
//! For a K-major operand the batch stride (kc elements) is smaller than the row stride: the
//! driver documents only "multiple of 16 bytes, below 2^40" as requirements of every stride
//! (cuda.h, cuTensorMapEncodeTiled); its "each dimension includes the previous one" code block
//! is an example of packed strides. Should the driver reject such a map, `launch` returns
//! Ok(false) before anything was launched and the caller runs the problem unsplit.
//!
//! Workspace: the caller's (src/ops/workspace.rs): `workspace` gives its layout, `splits` fp32
//! slots of m x n; the Python op layer allocates it with torch from the planner's answer
//! (`_native.gemm_workspace`), so a captured CUDA graph replays with the same memory. It holds
//! no counters: every slot is written by the GEMM before the reduce reads it.

use super::{config_for, prepare, tiles_m, tiles_n, tma_operand_ok};
use crate::dtype::DType;
use crate::error::Result;
use crate::arch::Arch;
use crate::jit::{impl_kernel_spec, Kernel, KernelMap, KernelSpec};
use crate::launch::launch as launch_kernel;
use crate::launch_record::{LaunchInfo, LaunchShape, Work};
use crate::tuning::gemm_problem::{Activation, GemmProblem, Operand};
use crate::tuning::gemm_sm90::{
    splitk_plan, splitk_reduce_production_configs, GemmSplitkReduceConfig, SplitK,
    SPLITK_REDUCE_THREADS,
};
use crate::ops::workspace::{Workspace, WorkspaceLayout};
use crate::tuning::knobs::Knobs;

/// Mirror of `struct GemmSplitkReduceParams` in kernels/gemm/splitk_reduce.cuh (change both).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemmSplitkReduceParams {
    pub ws: u64,
    pub out: u64,
    pub c: u64,
    pub bias: u64,
    pub aux: u64,
    pub ws_row_stride: i64,
    pub ws_split_stride: i64,
    pub out_row_stride: i64,
    pub c_row_stride: i64,
    pub aux_row_stride: i64,
    pub m: i32,
    pub n: i32,
    pub splits: i32,
    pub bias_kind: i32,
    pub alpha: f32,
    pub beta: f32,
}

impl_kernel_spec!(
    GemmSplitkReduceConfig,
    kernel: |c| c.kernel(),
    header: |c| c.header(),
    smem: |_c| 0,
);

/// What `precompile` builds for the reduce step (sm_90a only: 3 out dtypes x 5 activations).
pub fn reduce_production_specs(arch: Arch) -> Vec<GemmSplitkReduceConfig> {
    splitk_reduce_production_configs(arch)
}

static REDUCE_KERNELS: KernelMap<GemmSplitkReduceConfig> = KernelMap::new();

/// The split-k plan for `p` (a problem sm90 supports) on a device of `sms` SMs, or None: split-k
/// off (the `gemm_sm90_splitk` knob), the rule declines (`splitk_plan`), or the split operands
/// would not be TMA-loadable (pure).
pub fn plan(p: &GemmProblem, knobs: &Knobs, sms: i64) -> Option<SplitK> {
    if !knobs.gemm_sm90_splitk || p.batch != 1 {
        return None;
    }
    let cfg = config_for(p, knobs);
    let tiles = tiles_m(p, cfg.block_m) * tiles_n(p, cfg.block_n);
    plan_for(p, tiles, cfg.schedule.cluster(), sms)
}

/// The workspace of split `s` of `p`: `splits` fp32 slots of (m, n), row stride n (pure).
pub fn workspace(p: &GemmProblem, s: SplitK) -> WorkspaceLayout {
    WorkspaceLayout::partials(s.splits as u64, (p.m * p.n * 4) as u64)
}

/// `plan` with the device's numbers given (pure).
fn plan_for(p: &GemmProblem, tiles: i64, cluster: u32, sms: i64) -> Option<SplitK> {
    let s = splitk_plan(p.batch, p.k, tiles, cluster, sms)?;
    // the workspace rows must be TMA-storable fp32 (n % 4 == 0 holds wherever sm90 runs)
    if p.n % 4 != 0 {
        return None;
    }
    let q = split_problem(p, s, 0x10000);
    (tma_operand_ok(&q.a) && tma_operand_ok(&q.b)).then_some(s)
}

/// The batched problem of the split: batch entry s = k-chunk s of a and b, out = the fp32
/// workspace at `ws` (splits, m, n) with row stride n, no epilogue (pure).
fn split_problem(p: &GemmProblem, s: SplitK, ws: u64) -> GemmProblem {
    let a = Operand { cols: s.kc, batch_stride: s.kc * p.a.col_stride, ..p.a };
    let b = Operand { rows: s.kc, batch_stride: s.kc * p.b.row_stride, ..p.b };
    let out = Operand {
        ptr: ws,
        rows: p.m,
        cols: p.n,
        row_stride: p.n,
        col_stride: 1,
        batch_stride: p.m * p.n,
        dtype: DType::F32,
    };
    GemmProblem {
        batch: s.splits,
        k: s.kc,
        a,
        b,
        out,
        c: None,
        bias: None,
        aux: None,
        alpha: 1.0,
        beta: 0.0,
        activation: Activation::None,
        ..*p
    }
}

/// The reduce kernel's parameters for `p` and workspace `ws` (pure).
fn reduce_params(p: &GemmProblem, s: SplitK, ws: u64) -> GemmSplitkReduceParams {
    let bias_kind = match p.bias {
        None => 0,
        Some((_, DType::F32)) => 1,
        Some((_, DType::F16)) => 2,
        Some(_) => 3, // bf16 (validated: a's dtype or fp32)
    };
    GemmSplitkReduceParams {
        ws,
        out: p.out.ptr,
        c: p.c.map_or(0, |c| c.ptr),
        bias: p.bias.map_or(0, |(ptr, _)| ptr),
        aux: p.aux.map_or(0, |a| a.ptr),
        ws_row_stride: p.n,
        ws_split_stride: p.m * p.n,
        out_row_stride: p.out.row_stride,
        c_row_stride: p.c.map_or(0, |c| c.row_stride),
        aux_row_stride: p.aux.map_or(0, |a| a.row_stride),
        m: p.m as i32,
        n: p.n as i32,
        splits: s.splits as i32,
        bias_kind,
        alpha: p.alpha,
        beta: p.beta,
    }
}

/// The reduce launch: one thread per 4 columns of a row, 256 per block, at most 16 blocks per SM
/// (grid-stride loop beyond).
fn reduce_shape(m: i64, n: i64, sms: i64) -> LaunchShape {
    let quads = m * ((n + 3) / 4);
    let t = SPLITK_REDUCE_THREADS as i64;
    let blocks = ((quads + t - 1) / t).clamp(1, 16 * sms.max(1));
    LaunchShape { grid: (blocks as u32, 1, 1), block: (SPLITK_REDUCE_THREADS, 1, 1), dynamic_smem_bytes: 0 }
}

/// Compulsory traffic of the reduce (workspace read, c / bias read, out / aux written).
fn reduce_work(p: &GemmProblem, s: SplitK) -> Work {
    let mn = (p.m * p.n) as f64;
    let e = p.out.dtype.size_bytes() as f64;
    let mut bytes = s.splits as f64 * mn * 4.0 + mn * e;
    bytes += if p.c.is_some() { mn * e } else { 0.0 } + if p.aux.is_some() { mn * e } else { 0.0 };
    bytes += p.bias.map_or(0.0, |(_, d)| p.n as f64 * d.size_bytes() as f64);
    Work { flops: 0.0, bytes, exact: true }
}

/// The reduce kernel for `out_dtype` outputs with `activation` on `device` (sm_90a; compiled on
/// first use unless precompiled). Shared with the 2:4 split-k path (src/ops/sparse24).
pub(crate) fn reduce_kernel(out_dtype: DType, activation: Activation, device: i32) -> Result<&'static Kernel> {
    let rcfg = GemmSplitkReduceConfig { out_dtype, activation, arch: Arch::Sm90a };
    REDUCE_KERNELS.get(&rcfg, device)
}

/// Launch the reduce `kernel` (from `reduce_kernel`) over `params.m` x `params.n` on `stream`;
/// `op` and `work` describe the launch to the recorder. Shared with the 2:4 split-k path.
///
/// # Safety
/// `params.ws` holds `params.splits` fp32 chunks written earlier in stream order; every pointer
/// in `params` stays valid until the kernel has run.
pub(crate) unsafe fn launch_reduce(
    kernel: &Kernel,
    device: i32,
    params: &mut GemmSplitkReduceParams,
    op: &'static str,
    work: Work,
    stream: u64,
) -> Result<()> {
    let sms = crate::device::sm_count(device)? as i64;
    let shape = reduce_shape(params.m as i64, params.n as i64, sms);
    let info = LaunchInfo { op, work };
    // SAFETY: forwarded to the caller; `params` mirrors GemmSplitkReduceParams.
    unsafe { launch_kernel(kernel, device, &shape, stream, params, &info) }
}

/// Run `p` split-k on `stream` into the caller's workspace `ws` (`workspace(p, s)`): the batched
/// GEMM, then the reduce. Ok(false): nothing was launched (a split tensor map the driver
/// rejects): run `p` unsplit.
///
/// # Safety
/// As `super::launch` (`p` validated, supported, its tensors live until the kernels have run);
/// `ws` was checked for `workspace(p, s)` and lives as long.
pub unsafe fn launch(p: &GemmProblem, knobs: &Knobs, s: SplitK, ws: &Workspace, stream: u64) -> Result<bool> {
    debug_assert_eq!(ws.layout, workspace(p, s));
    let q = split_problem(p, s, ws.partials());
    let Ok(gemm) = prepare(&q, knobs) else { return Ok(false) };
    let reduce = reduce_kernel(p.out.dtype, p.activation, p.device)?;
    // SAFETY: the GEMM and the reduce are enqueued on `stream`; `gemm` was prepared from `q`,
    // whose operands are views of p's (live) a and b and of the workspace.
    unsafe {
        crate::ops::workspace::launch(ws, p.device, stream, |ws| {
            gemm.launch(&q, stream)?;
            let mut params = reduce_params(p, s, ws.partials());
            launch_reduce(reduce, p.device, &mut params, "ferroattn::gemm", reduce_work(p, s), stream)?;
            Ok(true)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tuning::gemm_problem::row_major_problem;

    #[test]
    fn reduce_params_layout_matches_the_kernel_struct() {
        // 5 pointers, 5 i64, 4 i32, 2 f32 = 104 bytes.
        assert_eq!(std::mem::size_of::<GemmSplitkReduceParams>(), 104);
        assert_eq!(std::mem::offset_of!(GemmSplitkReduceParams, ws_row_stride), 40);
        assert_eq!(std::mem::offset_of!(GemmSplitkReduceParams, m), 80);
        assert_eq!(std::mem::offset_of!(GemmSplitkReduceParams, alpha), 96);
    }

    /// The element offset of (i, j) of batch entry z of `o`.
    fn at(o: &Operand, z: i64, i: i64, j: i64) -> i64 {
        z * o.batch_stride + i * o.row_stride + j * o.col_stride
    }

    #[test]
    fn split_views_address_the_k_chunks() {
        let s = SplitK { splits: 4, kc: 256 };
        for (a_row, b_row) in [(true, true), (true, false), (false, true), (false, false)] {
            let mut p = row_major_problem(1, 16, 512, 1024, DType::BF16, DType::BF16);
            // a (16, 1024) with lda 1040 / column-major lda 24; b (1024, 512) ldb 520 / 1032.
            p.a = if a_row {
                Operand { row_stride: 1040, ..p.a }
            } else {
                Operand { row_stride: 1, col_stride: 24, ..p.a }
            };
            p.b = if b_row {
                Operand { row_stride: 520, ..p.b }
            } else {
                Operand { row_stride: 1, col_stride: 1032, ..p.b }
            };
            let q = split_problem(&p, s, 0x20000);
            assert_eq!((q.batch, q.k, q.m, q.n), (4, 256, 16, 512));
            assert_eq!((q.a.rows, q.a.cols, q.b.rows, q.b.cols), (16, 256, 256, 512));
            for z in 0..4 {
                for (i, j) in [(0, 0), (15, 255), (3, 17), (7, 128)] {
                    // a[i, z·kc + j] and b[z·kc + j, jn]
                    assert_eq!(at(&q.a, z, i, j), at(&p.a, 0, i, z * 256 + j));
                    assert_eq!(at(&q.b, z, j, i + 300), at(&p.b, 0, z * 256 + j, i + 300));
                }
            }
            assert!(tma_operand_ok(&q.a) && tma_operand_ok(&q.b), "{a_row} {b_row}");
            let k = Knobs::default();
            assert_eq!(config_for(&q, &k).a_k_major, config_for(&p, &k).a_k_major);
            assert_eq!(config_for(&q, &k).b_k_major, config_for(&p, &k).b_k_major);
            assert_eq!(q.out.dtype, DType::F32);
            assert_eq!((q.out.ptr, q.out.row_stride, q.out.batch_stride), (0x20000, 512, 16 * 512));
            assert!(q.out.vector_aligned(4));
            assert!(q.c.is_none() && q.bias.is_none() && q.aux.is_none());
            assert_eq!((q.alpha, q.beta, q.activation), (1.0, 0.0, Activation::None));
            assert!(super::super::supports(&q, Arch::Sm90a, &k));
        }
    }

    #[test]
    fn plan_for_declines_what_it_cannot_split() {
        let p = row_major_problem(1, 16, 4096, 4096, DType::BF16, DType::BF16);
        assert_eq!(plan_for(&p, 16, 1, 132), Some(SplitK { splits: 8, kc: 512 }));
        let q = row_major_problem(1, 16, 4096, 1000, DType::BF16, DType::BF16);
        assert_eq!(plan_for(&q, 16, 1, 132), None);
        let r = row_major_problem(2, 16, 4096, 4096, DType::BF16, DType::BF16);
        assert_eq!(plan_for(&r, 32, 1, 132), None);
    }

    #[test]
    fn reduce_params_follow_the_epilogue_arguments() {
        let mut p = row_major_problem(1, 100, 256, 4096, DType::F16, DType::F32);
        let s = SplitK { splits: 8, kc: 512 };
        let r = reduce_params(&p, s, 0x40000);
        assert_eq!((r.ws, r.ws_row_stride, r.ws_split_stride, r.splits), (0x40000, 256, 100 * 256, 8));
        assert_eq!((r.c, r.aux, r.bias, r.bias_kind), (0, 0, 0, 0));
        p.out.row_stride = 300;
        p.c = Some(Operand { ptr: 0x50000, row_stride: 264, ..p.out });
        p.aux = Some(Operand { ptr: 0x60000, row_stride: 512, ..p.out });
        p.bias = Some((0x70000, DType::F16));
        p.alpha = 0.5;
        p.beta = -2.0;
        let r = reduce_params(&p, s, 0x40000);
        assert_eq!((r.out_row_stride, r.c_row_stride, r.aux_row_stride), (300, 264, 512));
        assert_eq!((r.c, r.aux, r.bias, r.bias_kind), (0x50000, 0x60000, 0x70000, 2));
        assert_eq!((r.alpha, r.beta), (0.5, -2.0));
        p.bias = Some((0x70000, DType::F32));
        assert_eq!(reduce_params(&p, s, 0).bias_kind, 1);
        p.bias = Some((0x70000, DType::BF16));
        assert_eq!(reduce_params(&p, s, 0).bias_kind, 3);
        let sh = reduce_shape(100, 256, 132);
        assert_eq!((sh.grid, sh.block), ((25, 1, 1), (256, 1, 1)));
        assert_eq!(reduce_shape(4096, 4096, 132).grid.0, 16 * 132);
        let w = reduce_work(&p, s);
        assert_eq!(w.bytes, 8.0 * 25600.0 * 4.0 + 3.0 * 25600.0 * 4.0 + 256.0 * 2.0); // bf16 bias
    }

    /// The 15 reduce specialisations compile for sm_90a with 0 spills and 0 stack.
    #[test]
    fn reduce_specs_compile_without_spills() {
        let Some(_) = crate::jit::nvrtc::tests::toolchain() else { return };
        let specs = reduce_production_specs(Arch::Sm90a);
        let reports = crate::jit::precompile::precompile(&specs).unwrap();
        for r in &reports {
            eprintln!("{} regs {} stack {} spills {}/{}", r.config, r.resources.registers, r.resources.stack_bytes,
                r.resources.spill_stores, r.resources.spill_loads);
        }
        crate::jit::precompile::check_spills(&reports).unwrap();
        assert!(reports.iter().all(|r| r.resources.stack_bytes == 0));
        assert_eq!(reports.len(), 15);
    }
}
