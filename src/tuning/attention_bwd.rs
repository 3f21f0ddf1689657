//! Attention-backward launch plans and tile sizes: pure functions, unit-tested on CPU.
//!
//! One backward call is a short sequence of kernels (`bwd_plan`), FlashAttention-2 style
//! (paper §3.2, Alg. 2): a preprocess kernel (D = rowsum(dO ∘ O), zero dq_accum), one or two
//! dK/dV kernels (one block per key tile and kv head, looping over the query tiles of every
//! query head of its GQA group), and either the dQ conversion (default: dQ accumulated with
//! fp32 atomics by the dK/dV kernel) or the dQ kernel (deterministic: one block per query tile
//! loops over the key tiles and writes dQ itself; no atomics anywhere).
//! Kernels: kernels/attention/bwd_prep.cuh, bwd_dkdv_sm80.cuh (which forwards kernel head dim
//! 256 with dK and dV to the single-pass bwd_dkdv_wide_sm80.cuh), bwd_dq_sm80.cuh.

use crate::dtype::DType;
use crate::arch::Arch;
use crate::tuning::variant::{MaskKind, VariantKind};
use crate::tuning::attention::{kernel_head_dim, production_points};
use crate::tuning::knobs::FamilyChoice;

/// Which backward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BwdKind {
    /// `ferroattn::attn_bwd_preprocess<HeadDim, BlockM, T>`: softmax_d = rowsum(dout ∘ out),
    /// zeroes dq_accum (when not null). Grid (ceil(seqlen_q / block_m), num_heads, batch).
    Preprocess,
    /// `ferroattn::attn_bwd_dkdv_sm80<HeadDim, BlockM, BlockN, NumWarps, Stages, V,
    /// WithDK, WithDV, WithDQ, T[, DqDirect]>`: dK and/or dV of one key tile (and, WithDQ, dS·K
    /// added to dq_accum with atomics); `DqDirect` (default false) is rendered, as `true`, only
    /// where `wide_dq_direct()`. Grid (ceil(seqlen_k / block_n), num_heads_k, batch).
    DkDv { dk: bool, dv: bool, dq: bool },
    /// `ferroattn::attn_bwd_dq_sm80<HeadDim, BlockM, BlockN, NumWarps, Stages, V, T>`:
    /// dQ of one query tile, written directly (deterministic path).
    /// Grid (ceil(seqlen_q / block_m), num_heads, batch).
    Dq,
    /// `ferroattn::attn_bwd_convert_dq<HeadDim, BlockM, T[, Tiled]>`: dq = T(softmax_scale ·
    /// dq_accum); `tiled`: dq_accum in the tile layout of `DkDvSm90 { dq_tiled: true }` (the
    /// argument rendered only then). Grid (ceil(seqlen_q / block_m), num_heads, batch).
    ConvertDq { tiled: bool },
    /// `ferroattn::attn_bwd_sm90<HeadDim, Stages, V, T[, DqOverlap[, Varlen[, WithDq[, DqTiled[,
    /// MaskWarps]]]]]>`
    /// (kernels/attention/bwd_sm90.cuh, sm_90a): dK, dV and (`dq`) the atomic dQ (into dq_accum)
    /// of one 128-key tile with wgmma and TMA; the Hopper plan's middle kernel (`bwd_plan_sm90`).
    /// `dq_overlap` (the kernel's `DqOverlap`): dQ issued with dK and reduced while dK runs, instead
    /// of after dV and dK have completed; `varlen` (`Varlen`): the varlen layout; `dq` (`WithDq`):
    /// false on the deterministic plan (dK and dV only; the Dq kernel follows); `dq_tiled`
    /// (`DqTiled`): dq_accum in tiles, one bulk reduction per warpgroup and query tile (padded
    /// layout with dQ only); `mask_warps` (`MaskWarps`): the dropout keep words formed by the
    /// producer warpgroup's idle warps (dropout variants only). Each template argument is rendered
    /// only when it or a later one differs from its default. Grid (ceil(seqlen_k / 128),
    /// num_heads_k, batch).
    DkDvSm90 { dq_overlap: bool, varlen: bool, dq: bool, dq_tiled: bool, mask_warps: bool },
}

/// One specialisation of one backward kernel: template arguments, launch shape, cache key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnBwdConfig {
    pub kind: BwdKind,
    /// Kernel head dim: a multiple of 32 in 32..=256 (the call's head dim is masked).
    pub head_dim: u32,
    /// Query rows per tile (per block for Preprocess / Dq / ConvertDq).
    pub block_m: u32,
    /// Keys per tile (per block for DkDv); unused (0) for Preprocess / ConvertDq.
    pub block_n: u32,
    pub num_warps: u32,
    /// cp.async pipeline depth (query tiles for DkDv, key tiles for Dq); 0 when unused.
    pub stages: u32,
    /// The variant's compile-time part (`VariantKind::for_backward`; unused, PLAIN, for the
    /// elementwise kernels).
    pub variant: VariantKind,
    pub dtype: DType,
    pub arch: Arch,
}

impl AttnBwdConfig {
    /// The kernel's qualified name (without template arguments).
    pub fn kernel(&self) -> &'static str {
        match self.kind {
            BwdKind::Preprocess => "ferroattn::attn_bwd_preprocess",
            BwdKind::DkDv { .. } => "ferroattn::attn_bwd_dkdv_sm80",
            BwdKind::Dq => "ferroattn::attn_bwd_dq_sm80",
            BwdKind::ConvertDq { .. } => "ferroattn::attn_bwd_convert_dq",
            BwdKind::DkDvSm90 { .. } => "ferroattn::attn_bwd_sm90",
        }
    }

    /// The header (under kernels/) that defines the kernel.
    pub fn header(&self) -> &'static str {
        match self.kind {
            BwdKind::Preprocess | BwdKind::ConvertDq { .. } => "attention/bwd_prep.cuh",
            BwdKind::DkDv { .. } => "attention/bwd_dkdv_sm80.cuh",
            BwdKind::Dq => "attention/bwd_dq_sm80.cuh",
            BwdKind::DkDvSm90 { .. } => "attention/bwd_sm90.cuh",
        }
    }

    /// The NVRTC name expression that instantiates this specialisation.
    pub fn name_expression(&self) -> String {
        let t = self.dtype.cuda_type();
        let (hd, bm, bn, nw, st, c) =
            (self.head_dim, self.block_m, self.block_n, self.num_warps, self.stages, self.variant.cuda_type());
        match self.kind {
            BwdKind::Preprocess | BwdKind::ConvertDq { tiled: false } => {
                format!("{}<{hd}, {bm}, {t}>", self.kernel())
            }
            BwdKind::ConvertDq { tiled: true } => format!("{}<{hd}, {bm}, {t}, true>", self.kernel()),
            BwdKind::DkDv { dk, dv, dq } => {
                let direct = if self.wide_dq_direct() { ", true" } else { "" };
                format!("{}<{hd}, {bm}, {bn}, {nw}, {st}, {c}, {dk}, {dv}, {dq}, {t}{direct}>", self.kernel())
            }
            BwdKind::Dq => format!("{}<{hd}, {bm}, {bn}, {nw}, {st}, {c}, {t}>", self.kernel()),
            BwdKind::DkDvSm90 { dq_overlap, varlen, dq, dq_tiled, mask_warps } => {
                // (value, the kernel's default) of the optional arguments, in order
                let optional = [(dq_overlap, false), (varlen, false), (dq, true), (dq_tiled, false), (mask_warps, false)];
                let n = optional.iter().rposition(|(v, d)| v != d).map_or(0, |i| i + 1);
                let tail: String = optional[..n].iter().map(|(v, _)| format!(", {v}")).collect();
                format!("{}<{hd}, {st}, {c}, {t}{tail}>", self.kernel())
            }
        }
    }

    pub fn threads(&self) -> u32 {
        self.num_warps * 32
    }

    /// The dK/dV kernel stages its dq_accum reductions through a block_m × head_dim fp32
    /// shared-memory tile (`attn_bwd_dkdv_sm80_dq_stage()` in bwd_dkdv_sm80.cuh): sm_90a, with
    /// dQ, kernel head dims 64 and 128.
    pub fn dq_staged(&self) -> bool {
        matches!(self.kind, BwdKind::DkDv { dq: true, .. })
            && self.arch == Arch::Sm90a
            && matches!(self.head_dim, 64 | 128)
    }

    /// The single-pass wide dK/dV kernel (kernels/attention/bwd_dkdv_wide_sm80.cuh, reached
    /// through attn_bwd_dkdv_sm80 when HeadDim > 128 with dK and dV): tile 64 × 64, 8 warps.
    pub fn is_wide(&self) -> bool {
        matches!(self.kind, BwdKind::DkDv { dk: true, dv: true, .. }) && self.head_dim > 128
    }

    /// The wide kernel with dQ on sm_90a, where it can stage its dq_accum reductions.
    fn wide_dq_sm90a(&self) -> bool {
        self.is_wide() && matches!(self.kind, BwdKind::DkDv { dq: true, .. }) && self.arch == Arch::Sm90a
    }

    /// The wide kernel stages its dq_accum reductions through 8 × 16 × 32 fp32 of shared memory
    /// (`attn_bwd_dkdv_wide_dq_stage()`, 2 dQ passes): sm_90a, with dQ, except the variants of
    /// `WIDE_DQ_DIRECT`, whose staged build spills. The one place that decides the staging:
    /// `smem_bytes` and the kernel's `DqDirect` argument (`wide_dq_direct`) follow it.
    pub fn wide_dq_staged(&self) -> bool {
        self.wide_dq_sm90a() && !WIDE_DQ_DIRECT.contains(&self.variant.for_backward())
    }

    /// The wide kernel's `DqDirect` template argument: sm_90a with dQ but not `wide_dq_staged()`
    /// (direct red.v4 reductions after a lane-pair exchange, 4 dQ passes, as on sm_100+).
    /// Elsewhere the argument keeps its default (false), so those name expressions are unchanged.
    pub fn wide_dq_direct(&self) -> bool {
        self.wide_dq_sm90a() && !self.wide_dq_staged()
    }

    /// Dynamic shared memory in bytes (the formulas the kernels document and static_assert):
    /// - DkDv: K and V tiles (block_n × d each), `stages` × (Q and dO tiles, block_m × d each),
    ///   the dSᵀ tiles (block_n × block_m; two with dq and d ≤ 128: the dQ product of query
    ///   tile i runs after the barrier that opens tile i+1, from the other buffer) and `stages` × (LSE, D)
    ///   rows (2 × block_m fp32); 16-bit elements; plus a block_m × d fp32 dQ staging tile where
    ///   `dq_staged()`.
    /// - DkDv, wide (`is_wide()`): K and V tiles, `stages` × (Q and dO tiles), the P and dS
    ///   tiles (block_m × block_n each), 16-bit; `stages` × (LSE, D) rows; plus 16 KiB of fp32
    ///   dQ staging where `wide_dq_staged()`.
    /// - Dq: Q and dO tiles (block_m × d each) and `stages` × (K and V tiles, block_n × d each).
    /// - DkDvSm90 (`AttnBwdSm90Smem` in bwd_sm90.cuh): K and V (block_n × d each), `stages` ×
    ///   (Q and dO, block_m × d each), with dQ two dSᵀ tiles (block_n × block_m), 16-bit; with dQ
    ///   two fp32 dQ staging tiles (block_m rows of 64 fp32 padded to 288 B); `stages` × (LSE, D) rows;
    ///   `stages` × a 16-byte tile record; with `mask_warps` `stages` × 1 KiB of keep words; (1 + 3
    ///   `stages`) mbarriers of 8 B; 1 KiB of alignment slack.
    /// - Preprocess / ConvertDq: none.
    pub fn smem_bytes(&self) -> u32 {
        let (d, bm, bn, st) = (self.head_dim, self.block_m, self.block_n, self.stages);
        match self.kind {
            BwdKind::DkDvSm90 { dq, mask_warps, .. } => {
                let dq_tiles = if dq { 2 } else { 0 };
                let keep = if mask_warps { st * 1024 } else { 0 };
                (2 * bn * d + 2 * st * bm * d + dq_tiles * bn * bm) * 2 + dq_tiles * bm * 288 + st * bm * 8 + st * 16
                    + keep + 8 * (1 + 3 * st) + 1024
            }
            BwdKind::Preprocess | BwdKind::ConvertDq { .. } => 0,
            BwdKind::DkDv { .. } if self.is_wide() => {
                let stage = if self.wide_dq_staged() { 8 * 16 * 32 * 4 } else { 0 };
                (2 * bn * d + 2 * st * bm * d + 2 * bm * bn) * 2 + st * bm * 8 + stage
            }
            BwdKind::DkDv { dq, .. } => {
                let ds_tiles = if dq && d <= 128 { 2 } else { 1 };
                let stage = if self.dq_staged() { bm * d * 4 } else { 0 };
                (2 * bn * d + 2 * st * bm * d + ds_tiles * bn * bm) * 2 + st * bm * 8 + stage
            }
            BwdKind::Dq => (2 * bm * d + 2 * st * bn * d) * 2,
        }
    }

    /// Grid for a problem: (x, y, z).
    pub fn grid(&self, seqlen_q: u64, seqlen_k: u64, heads: u64, heads_k: u64, batch: u64) -> (u64, u64, u64) {
        match self.kind {
            BwdKind::DkDv { .. } | BwdKind::DkDvSm90 { .. } => (seqlen_k.div_ceil(self.block_n as u64), heads_k, batch),
            _ => (seqlen_q.div_ceil(self.block_m as u64), heads, batch),
        }
    }

    /// Needs the fp32 dq_accum workspace.
    pub fn uses_dq_accum(&self) -> bool {
        matches!(self.kind, BwdKind::DkDv { dq: true, .. } | BwdKind::ConvertDq { .. } | BwdKind::DkDvSm90 { dq: true, .. })
    }
}

/// Rows per block of the elementwise kernels (Preprocess, ConvertDq) and their warps.
const ELEMENTWISE_ROWS: u32 = 64;
const ELEMENTWISE_WARPS: u32 = 8;

/// dK/dV tile for a kernel head dim: (block_m, block_n, num_warps, stages). Each warp owns
/// block_n / num_warps keys (16 or 32 rows of the mma) and keeps their dK and dV accumulators
/// in registers. Larger key tiles halve the dq_accum atomics per FLOP (the dQ part dominated
/// the first version). Measured on H200 against SDPA-flash: bench/NOTES.md ("Backward").
/// The atomic-dQ kernel (WithDQ) goes through `dkdv_dq_tile` (smaller tiles for some variants).
pub fn dkdv_tile(head_dim: u32, variant: VariantKind) -> (u32, u32, u32, u32) {
    let _ = variant;
    match head_dim {
        0..=64 => (64, 128, 4, 2),
        65..=96 => (64, 128, 8, 2),
        97..=128 => (64, 128, 8, 2),
        // d256 where the wide kernel does not fit (99 KiB GPUs, split): 8 warps of 16 keys (v5:
        // +43 % over 32×64×4w); elsewhere d256 runs WIDE_TILE (dkdv_wide).
        225..=256 => (32, 128, 8, 2),
        _ => (32, 64, 4, 2),
    }
}

// The production variants besides plain, causal and dropout, as the backward sees them
// (`production_variants` less sinks).
const LOCAL: VariantKind = VariantKind { mask: MaskKind::Local, ..VariantKind::PLAIN };
const SOFTCAP_CAUSAL: VariantKind = VariantKind { softcap: true, ..VariantKind::CAUSAL };
const SOFTCAP_LOCAL: VariantKind = VariantKind { softcap: true, ..LOCAL };
const ALIBI_CAUSAL: VariantKind = VariantKind { alibi: true, ..VariantKind::CAUSAL };
const SOFTCAP: VariantKind = VariantKind { softcap: true, ..VariantKind::PLAIN };

/// Tile of the dK/dV kernel that also adds dQ to dq_accum (the default, non-deterministic path;
/// every other dK/dV kernel takes `dkdv_tile`). With `dkdv_tile`'s 64-query tile, the production
/// variants below spill (ptxas, f16 = bf16; B of spill stores): the variant's terms and bounds
/// need a few registers next to dK/dV and the dQ product's. They take 32-query tiles
/// (0 spills, sm_80 and sm_90a): the same keys per block and per warp, so the dq_accum
/// reductions, K/V loads and Q/dO re-reads per FLOP are unchanged; twice the query tiles, so
/// twice the barriers, and each warp's dQ product covers half the columns (more dS reads per mma).
/// - d 128 (8 warps of 16 keys) keeps its 64-query tile: the kernel takes 32-query steps for
///   these variants instead (its accumulator budget, kernels/attention/bwd_dkdv_sm80.cuh), 0
///   spills. The 32-query tiles cost window and ALiBi +12 % of backward time on H200
///   (bench/NOTES.md).
/// - d 64, softcap: sm_80 causal 20, local 28, plain 8; sm_90a local 4 (causal and plain 0).
///
/// Other variants (plain, causal, dropout, and combinations outside the production set) keep
/// `dkdv_tile` (bench/NOTES.md, "Attention variants").
pub fn dkdv_dq_tile(head_dim: u32, variant: VariantKind, arch: Arch) -> (u32, u32, u32, u32) {
    let variant = variant.for_backward();
    let staged = arch == Arch::Sm90a;
    let spills: &[VariantKind] = match (head_dim, staged) {
        (64, false) => &[SOFTCAP_CAUSAL, SOFTCAP_LOCAL, SOFTCAP],
        (64, true) => &[SOFTCAP_LOCAL],
        _ => &[],
    };
    let (block_m, block_n, num_warps, stages) = dkdv_tile(head_dim, variant);
    if spills.contains(&variant) {
        (block_m / 2, block_n, num_warps, stages)
    } else {
        (block_m, block_n, num_warps, stages)
    }
}

/// Tile of the single-pass wide dK/dV kernel (kernel head dim 256): (block_m, block_n,
/// num_warps, stages); fit() takes sm_80's 163 KiB to one stage.
pub const WIDE_TILE: (u32, u32, u32, u32) = (64, 64, 8, 2);

/// Shared memory of the wide kernel with one stage and no dQ staging (147 968 B at d256).
const WIDE_MIN_SMEM: u32 = (2 * 64 * 256 + 2 * 64 * 256 + 2 * 64 * 64) * 2 + 64 * 8;

/// Kernel head dim 256 runs the single-pass wide kernel (P and dS through shared memory, 5
/// products; +20-29 % over the split on H200, bench/NOTES.md "Backward v8") where one block of
/// it fits in the arch's shared memory (sm_80/87, sm_90a, sm_100+), else the split; for every
/// variant (those whose staged dQ reductions spill on sm_90a reduce directly:
/// `AttnBwdConfig::wide_dq_staged`).
pub fn dkdv_wide(head_dim: u32, arch: Arch) -> bool {
    head_dim == 256 && arch.max_smem_per_block() >= WIDE_MIN_SMEM
}

/// dK and dV in separate kernels (each recomputes P) when both accumulators would not fit in
/// registers together and the wide kernel does not apply.
pub fn dkdv_split(head_dim: u32, arch: Arch) -> bool {
    head_dim > 128 && !dkdv_wide(head_dim, arch)
}

/// The variants (as the backward sees them) whose wide kernel with dQ (atomic path) spills
/// with the staged dQ reductions (sm_90a, ptxas, f16 = bf16): softcap-local 4 B, ALiBi-causal
/// 8 B, softcap 8 B (local, softcap-causal, ALiBi, plain, causal and dropout: 0; sm_80's
/// one-stage build and the deterministic build without dQ stage nothing). They keep the wide
/// kernel with the direct reductions (`AttnBwdConfig::wide_dq_staged` false, 4 dQ passes,
/// 214 016 B of shared memory instead of 230 400): 0 spills. Direct ran ~10 % below staged for
/// plain (186-207 vs 211-230 TFLOP/s) and ~8 % above the split (173-192) that these variants
/// took before (bench/NOTES.md "Backward v8", "Attention variants").
const WIDE_DQ_DIRECT: [VariantKind; 3] = [SOFTCAP_LOCAL, ALIBI_CAUSAL, SOFTCAP];

/// dQ-kernel tile (deterministic path): (block_m, block_n, num_warps, stages). Each warp owns
/// block_m / num_warps query rows and keeps their dQ accumulators (d/2 fp32 per 16 rows) plus
/// S and dP of one key tile in registers: two 16-row m-tiles per warp where d <= 96 (half the
/// K/V shared-memory reads per FLOP), one above. d > 224 takes a single K/V stage so that two
/// blocks fit in an SM's shared memory. Measured on H200 (b·s = 16k, bf16; bench/NOTES.md
/// "Backward — dQ / preprocess"). The same tiles for every variant: those of the production set
/// compile without spills at d 64 / 128 / 256 (sm_80, sm_90a).
pub fn dq_tile(head_dim: u32, variant: VariantKind) -> (u32, u32, u32, u32) {
    let _ = variant;
    match head_dim {
        0..=32 => (128, 64, 4, 2),
        33..=96 => (128, 32, 4, 2),
        97..=128 => (64, 64, 4, 2),
        129..=224 => (64, 32, 4, 2),
        _ => (64, 32, 4, 1),
    }
}

fn fit(mut c: AttnBwdConfig) -> AttnBwdConfig {
    // GPUs with less shared memory per block (sm_86/89/120: 99 KiB) get a shallower pipeline,
    // then (dK/dV) shorter query tiles down to 32 rows, then fewer keys per block with the same
    // keys per warp (block_n and num_warps halved together keep the kernel's constraints).
    let max = c.arch.max_smem_per_block();
    while c.smem_bytes() > max {
        if c.stages > 1 {
            c.stages -= 1;
        } else if matches!(c.kind, BwdKind::DkDv { .. }) && !c.is_wide() && c.block_m > 32 {
            c.block_m /= 2;
        } else if matches!(c.kind, BwdKind::DkDv { .. }) && !c.is_wide() && c.num_warps > 1 {
            c.block_n /= 2;
            c.num_warps /= 2;
        } else {
            break;
        }
    }
    c
}

/// The kernels of one backward call, in launch order.
pub fn bwd_plan(head_dim: u32, variant: VariantKind, deterministic: bool, dtype: DType, arch: Arch) -> Vec<AttnBwdConfig> {
    let hd = kernel_head_dim(head_dim);
    let variant = variant.for_backward();
    let elementwise = |kind| AttnBwdConfig {
        kind,
        head_dim: hd,
        block_m: ELEMENTWISE_ROWS,
        block_n: 0,
        num_warps: ELEMENTWISE_WARPS,
        stages: 0,
        variant: VariantKind::PLAIN,
        dtype,
        arch,
    };
    let tiled = |kind, (block_m, block_n, num_warps, stages): (u32, u32, u32, u32)| {
        fit(AttnBwdConfig { kind, head_dim: hd, block_m, block_n, num_warps, stages, variant, dtype, arch })
    };
    let dkdv = |dk, dv, dq| {
        let tile = if dq { dkdv_dq_tile(hd, variant, arch) } else { dkdv_tile(hd, variant) };
        tiled(BwdKind::DkDv { dk, dv, dq }, tile)
    };
    let dq_atomic = !deterministic;
    let mut plan = vec![elementwise(BwdKind::Preprocess)];
    if dkdv_wide(hd, arch) {
        plan.push(tiled(BwdKind::DkDv { dk: true, dv: true, dq: dq_atomic }, WIDE_TILE));
    } else if hd > 128 {
        // dkdv_split
        plan.push(dkdv(false, true, false));
        plan.push(dkdv(true, false, dq_atomic));
    } else {
        plan.push(dkdv(true, true, dq_atomic));
    }
    if deterministic {
        plan.push(tiled(BwdKind::Dq, dq_tile(hd, variant)));
    } else {
        plan.push(elementwise(BwdKind::ConvertDq { tiled: false }));
    }
    plan
}

/// Whether a head dim can take the Hopper backward's tiled dq_accum: it is the kernel head dim
/// itself (64 or 128), so the tiles' columns are the call's and the conversion kernel, whose head
/// dim is `kernel_head_dim`'s, reads whole 64-column chunks.
pub fn dq_tile_head_dim(head_dim: u32) -> bool {
    matches!(head_dim, 64 | 128)
}

/// Stages of the Hopper backward's query ring.
pub const SM90_STAGES: u32 = 2;

/// The Hopper backward's plan where its kernel has a specialisation: sm_90a, head dims up to 128
/// (kernel head dim 64 or 128). The atomic-dQ path: preprocess → `BwdKind::DkDvSm90` (dK, dV,
/// dQ into dq_accum) → dQ conversion; `deterministic`: preprocess → `DkDvSm90` without dQ → the
/// sm80 Dq kernel (dQ written directly, no atomics anywhere: bitwise reproducible). None
/// elsewhere (the call takes `bwd_plan`). The caller also needs the padded layout and the tensor
/// maps (src/ops/attention_bwd/sm90.rs).
/// `family`: `Auto` takes the Hopper plan only where it measured faster than the sm80 plan (the
/// atomic path at kernel head dim 128: 1.07-1.09x at 1k-8k tokens; at 64 it ran 0.60-0.74x,
/// bench/NOTES.md "Hopper backward"; the deterministic plan at both head dims: 1.14-1.30x at 64,
/// 1.36-1.44x at 128, "Hopper forward forms measured"), `Sm90` wherever the kernel has a
/// specialisation (tests, A/B runs: knob `attn_bwd_family=sm90`), `Sm80` never.
/// `dq_overlap`: the kernel's product order (`BwdKind::DkDvSm90`; knob `attn_sm90_bwd_dq_overlap`;
/// without dQ there is no order to choose, so the deterministic plan ignores it);
/// `varlen`: the call's layout (varlen calls reach here only under knob `attn_sm90_bwd_varlen`);
/// `dq_tiled`: the call's dq_accum may take the tile layout (knob `attn_sm90_bwd_dq_tiled` and
/// the shape: src/ops/attention_bwd/sm90.rs `dq_tileable`); taken on the atomic path of the padded
/// layout, where the kernel (`DqTiled`) and the conversion (`ConvertDq { tiled }`) both read it;
/// `mask_warps`: knob `attn_sm90_bwd_mask_warps`, taken by the dropout variants (`MaskWarps`).
#[allow(clippy::too_many_arguments)]
pub fn bwd_plan_sm90(
    head_dim: u32,
    variant: VariantKind,
    deterministic: bool,
    dtype: DType,
    arch: Arch,
    family: FamilyChoice,
    dq_overlap: bool,
    varlen: bool,
    dq_tiled: bool,
    mask_warps: bool,
) -> Option<Vec<AttnBwdConfig>> {
    let hd = if head_dim <= 64 { 64 } else { 128 };
    let chosen = match family {
        FamilyChoice::Sm80 => false,
        FamilyChoice::Auto => hd == 128 || deterministic,
        FamilyChoice::Sm90 => true,
    };
    if !chosen || arch != Arch::Sm90a || head_dim > 128 {
        return None;
    }
    let with_dq = !deterministic;
    let tiled = dq_tiled && with_dq && !varlen && dq_tile_head_dim(head_dim);
    let mut plan = bwd_plan(head_dim, variant, deterministic, dtype, arch);
    let mut config = sm90_dkdv_config(head_dim, variant, dtype, arch, dq_overlap && with_dq, varlen, with_dq);
    if let BwdKind::DkDvSm90 { dq_tiled, mask_warps: mw, .. } = &mut config.kind {
        *dq_tiled = tiled;
        *mw = mask_warps && config.variant.dropout;
    }
    plan[1] = config;
    if tiled {
        plan[2].kind = BwdKind::ConvertDq { tiled: true };
    }
    Some(plan)
}

/// The Hopper dK/dV(/dQ: `dq`) kernel's configuration for a call of `head_dim` (<= 128) and
/// `variant`, whether or not `bwd_plan_sm90` takes it (kernel work compiles declined variants with it).
pub fn sm90_dkdv_config(
    head_dim: u32,
    variant: VariantKind,
    dtype: DType,
    arch: Arch,
    dq_overlap: bool,
    varlen: bool,
    dq: bool,
) -> AttnBwdConfig {
    AttnBwdConfig {
        kind: BwdKind::DkDvSm90 { dq_overlap, varlen, dq, dq_tiled: false, mask_warps: false },
        head_dim: if head_dim <= 64 { 64 } else { 128 },
        block_m: 64,
        block_n: 128,
        num_warps: 12,
        stages: SM90_STAGES,
        variant: variant.for_backward(),
        dtype,
        arch,
    }
}

/// Every configuration `bwd_plan` (and, on sm_90a, `bwd_plan_sm90` in both product orders and
/// layouts: the `dq_overlap` and `varlen` ones are A/B candidates) can return for `arch` at the
/// production points: what `precompile` builds (held to no spills by `precompile --check-spills`). The score-modifying
/// and local variants' atomic-dQ dK/dV kernels take the smaller tiles of `dkdv_dq_tile` and, in
/// the wide kernel, the direct dQ reductions of `WIDE_DQ_DIRECT` where the default ones spill.
pub fn bwd_production_configs(arch: Arch) -> Vec<AttnBwdConfig> {
    let mut out: Vec<AttnBwdConfig> = Vec::new();
    for (hd, variant, dtype) in production_points() {
        for deterministic in [false, true] {
            // (dq_overlap, varlen, dq_tiled): the tiled dq_accum is the padded layout's only. The
            // mask warps' forms are not here: compiled on first use (their producer warps spill
            // at 24 registers: bench/NOTES.md "Hopper backward: the dropout mask from the
            // producer's idle warps")
            let forms = [
                (false, false, false),
                (true, false, false),
                (false, true, false),
                (true, true, false),
                (false, false, true),
                (true, false, true),
            ];
            let hopper = forms.into_iter().flat_map(|(overlap, varlen, tiled)| {
                bwd_plan_sm90(hd, variant, deterministic, dtype, arch, FamilyChoice::Sm90, overlap, varlen, tiled, false)
                    .unwrap_or_default()
            });
            for c in bwd_plan(hd, variant, deterministic, dtype, arch).into_iter().chain(hopper) {
                if !out.contains(&c) {
                    out.push(c);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_production_config_fits_its_arch() {
        for arch in Arch::ALL {
            for c in bwd_production_configs(arch) {
                crate::tuning::attention::tests::assert_fits_smem(&c);
                if c.is_wide() {
                    // the wide kernel's static_asserts: 64 x 64 on 8 warps, kernel head dim 256
                    assert_eq!((c.block_m, c.block_n, c.num_warps, c.head_dim), (64, 64, 8, 256), "{c:?}");
                } else if let BwdKind::DkDv { .. } = c.kind {
                    assert_eq!(c.block_n % (16 * c.num_warps), 0, "{}", c.name_expression());
                }
                if let BwdKind::Dq = c.kind {
                    assert_eq!(c.block_m % (16 * c.num_warps), 0, "{}", c.name_expression());
                }
            }
        }
    }

    #[test]
    fn sm90a_dq_kernels_stage_the_reductions_at_d64_and_d128() {
        for (d, want) in [(64u32, 115_712u32), (128, 197_632)] {
            let c = bwd_plan(d, VariantKind::from_causal(false), false, DType::BF16, Arch::Sm90a)[1];
            assert!(c.dq_staged(), "{c:?}");
            let (bm, bn, st) = (c.block_m, c.block_n, c.stages);
            assert_eq!((bm, bn, st), (64, 128, 2), "tile changed: recheck the staging and these sizes");
            // K, V + 2 stages of Q, dO + 2 dS^T tiles (16-bit), LSE/D rows, fp32 staging tile
            assert_eq!(c.smem_bytes(), (2 * bn * d + 2 * st * bm * d + 2 * bn * bm) * 2 + st * bm * 8 + bm * d * 4);
            assert_eq!(c.smem_bytes(), want);
        }
        // d64 keeps two blocks per SM (228 KiB, 1 KiB reserved per block)
        assert!(2 * (bwd_plan(64, VariantKind::from_causal(true), false, DType::F16, Arch::Sm90a)[1].smem_bytes() + 1024) <= 228 * 1024);
        for c in [
            bwd_plan(128, VariantKind::from_causal(false), true, DType::BF16, Arch::Sm90a)[1], // no dQ (deterministic)
            bwd_plan(128, VariantKind::from_causal(false), false, DType::BF16, Arch::Sm80)[1],
            bwd_plan(96, VariantKind::from_causal(false), false, DType::BF16, Arch::Sm90a)[1],
            bwd_plan(256, VariantKind::from_causal(false), false, DType::BF16, Arch::Sm90a)[2],
        ] {
            assert!(!c.dq_staged(), "{c:?}");
        }
    }

    #[test]
    fn hopper_plan_takes_the_atomic_path_up_to_head_dim_128() {
        let local = VariantKind { mask: MaskKind::Local, ..VariantKind::PLAIN };
        let sm90 = FamilyChoice::Sm90;
        let p = bwd_plan_sm90(96, VariantKind::CAUSAL, false, DType::BF16, Arch::Sm90a, FamilyChoice::Auto, false, false, false, false).unwrap();
        let kinds: Vec<_> = p.iter().map(|c| c.kind).collect();
        assert_eq!(kinds, vec![BwdKind::Preprocess, BwdKind::DkDvSm90 { dq_overlap: false, varlen: false, dq: true, dq_tiled: false, mask_warps: false }, BwdKind::ConvertDq { tiled: false }]);
        assert_eq!((p[1].head_dim, p[1].block_m, p[1].block_n, p[1].threads()), (128, 64, 128, 384));
        assert_eq!(
            p[1].name_expression(),
            "ferroattn::attn_bwd_sm90<128, 2, ferroattn::AttnVariant<1, false, false, false, false, false>, __nv_bfloat16>"
        );
        // K, V 64 KiB + 2 x (Q, dO) 64 KiB + 2 dS^T 32 KiB + 2 staging tiles + LSE/D + 2 tile
        // records + 7 barriers + slack
        assert_eq!(p[1].smem_bytes(), 65536 + 65536 + 32768 + 2 * 64 * 288 + 1024 + 32 + 56 + 1024);
        assert_eq!(p[1].grid(1000, 300, 8, 2, 3), (3, 2, 3));
        assert!(p[1].uses_dq_accum());
        // the overlapped product order: the same kernel with `DqOverlap` rendered, the same memory
        let o = bwd_plan_sm90(96, VariantKind::CAUSAL, false, DType::BF16, Arch::Sm90a, FamilyChoice::Auto, true, false, false, false).unwrap();
        assert_eq!(o[1].kind, BwdKind::DkDvSm90 { dq_overlap: true, varlen: false, dq: true, dq_tiled: false, mask_warps: false });
        // varlen: its template argument (after DqOverlap's), every variant in both orders
        let vl = bwd_plan_sm90(96, VariantKind::CAUSAL, false, DType::BF16, Arch::Sm90a, FamilyChoice::Auto, false, true, false, false).unwrap();
        assert!(vl[1].name_expression().ends_with("__nv_bfloat16, false, true>"), "{}", vl[1].name_expression());
        // the tiled dq_accum: the kernel's last argument and the conversion's, the same memory;
        // never on the varlen layout or the deterministic plan
        let tl = bwd_plan_sm90(128, VariantKind::CAUSAL, false, DType::BF16, Arch::Sm90a, FamilyChoice::Auto, false, false, true, false).unwrap();
        assert!(tl[1].name_expression().ends_with("__nv_bfloat16, false, false, true, true>"), "{}", tl[1].name_expression());
        assert_eq!(tl[2].kind, BwdKind::ConvertDq { tiled: true });
        assert_eq!(tl[2].name_expression(), "ferroattn::attn_bwd_convert_dq<128, 64, __nv_bfloat16, true>");
        assert_eq!(tl[1].smem_bytes(), p[1].smem_bytes());
        let tv = bwd_plan_sm90(128, VariantKind::CAUSAL, false, DType::BF16, Arch::Sm90a, FamilyChoice::Auto, false, true, true, false).unwrap();
        assert_eq!(tv[1].kind, BwdKind::DkDvSm90 { dq_overlap: false, varlen: true, dq: true, dq_tiled: false, mask_warps: false });
        assert_eq!(tv[2].kind, BwdKind::ConvertDq { tiled: false });
        for hd in [32, 96, 100] {
            let t = bwd_plan_sm90(hd, VariantKind::CAUSAL, false, DType::BF16, Arch::Sm90a, sm90, false, false, true, false).unwrap();
            assert_eq!(t[2].kind, BwdKind::ConvertDq { tiled: false }, "{hd}");
        }
        // the mask warps: the dropout variants only, their keep words in the shared-memory formula
        let dropout = VariantKind { dropout: true, ..VariantKind::CAUSAL };
        let mw = bwd_plan_sm90(128, dropout, false, DType::BF16, Arch::Sm90a, sm90, false, false, false, true).unwrap();
        assert!(mw[1].name_expression().ends_with(", true, false, true>"), "{}", mw[1].name_expression());
        let plain_dropout = bwd_plan_sm90(128, dropout, false, DType::BF16, Arch::Sm90a, sm90, false, false, false, false).unwrap();
        assert_eq!(mw[1].smem_bytes(), plain_dropout[1].smem_bytes() + 2 * 1024);
        let no_dropout = bwd_plan_sm90(128, VariantKind::CAUSAL, false, DType::BF16, Arch::Sm90a, sm90, false, false, false, true).unwrap();
        assert_eq!(no_dropout[1].kind, p[1].kind);
        let td = bwd_plan_sm90(128, VariantKind::CAUSAL, true, DType::BF16, Arch::Sm90a, FamilyChoice::Auto, false, false, true, false).unwrap();
        assert!(matches!(td[1].kind, BwdKind::DkDvSm90 { dq: false, dq_tiled: false, .. }));
        let sl = VariantKind { softcap: true, ..local };
        for (overlap, varlen) in [(false, true), (true, true), (false, false)] {
            assert!(bwd_plan_sm90(128, sl, false, DType::BF16, Arch::Sm90a, sm90, overlap, varlen, false, false).is_some());
        }
        assert!(o[1].name_expression().ends_with("__nv_bfloat16, true>"), "{}", o[1].name_expression());
        assert_eq!(o[1].smem_bytes(), p[1].smem_bytes());
        let prod = bwd_production_configs(Arch::Sm90a);
        for overlap in [false, true] {
            let n = prod.iter().filter(|c| matches!(c.kind, BwdKind::DkDvSm90 { dq_overlap, .. } if dq_overlap == overlap)).count();
            assert!(n > 0, "{overlap}");
        }
        assert_eq!(bwd_plan_sm90(64, local, false, DType::F16, Arch::Sm90a, sm90, false, false, false, false).unwrap()[1].head_dim, 64);
        // the dispatcher's choice: head dim 128 only (64 measured slower); the sm80 knob: never
        assert!(bwd_plan_sm90(64, VariantKind::CAUSAL, false, DType::F16, Arch::Sm90a, FamilyChoice::Auto, false, false, false, false).is_none());
        assert!(bwd_plan_sm90(128, VariantKind::CAUSAL, false, DType::F16, Arch::Sm90a, FamilyChoice::Sm80, false, false, false, false).is_none());
        for (hd, v, det, arch) in [
            (160, VariantKind::CAUSAL, true, Arch::Sm90a),
            (160, VariantKind::CAUSAL, false, Arch::Sm90a),
            (128, VariantKind::CAUSAL, false, Arch::Sm80),
        ] {
            assert!(bwd_plan_sm90(hd, v, det, DType::BF16, arch, sm90, false, false, false, false).is_none(), "{hd} {v:?} {det} {arch:?}");
        }
        // every variant at both kernel head dims, the d128 local window and dropout with a mask too
        let softcap_local = VariantKind { softcap: true, ..local };
        let dropout_causal = VariantKind { dropout: true, ..VariantKind::CAUSAL };
        for v in [local, softcap_local, dropout_causal, VariantKind { dropout: true, ..VariantKind::PLAIN }] {
            for hd in [64, 128] {
                assert!(bwd_plan_sm90(hd, v, false, DType::BF16, Arch::Sm90a, sm90, false, false, false, false).is_some(), "{hd} {v:?}");
            }
            assert!(bwd_plan_sm90(128, v, false, DType::F16, Arch::Sm90a, FamilyChoice::Auto, false, false, false, false).is_some(), "{v:?}");
        }
    }

    #[test]
    fn deterministic_hopper_plan_leaves_dq_to_the_dq_kernel() {
        let sm90 = FamilyChoice::Sm90;
        for hd in [64u32, 96, 128] {
            for overlap in [false, true] {
                for varlen in [false, true] {
                    let p = bwd_plan_sm90(hd, VariantKind::CAUSAL, true, DType::BF16, Arch::Sm90a, sm90, overlap, varlen, false, false).unwrap();
                    let kinds: Vec<_> = p.iter().map(|c| c.kind).collect();
                    // dq_overlap has nothing to order without dQ: always the plain kernel order
                    assert_eq!(kinds, vec![BwdKind::Preprocess, BwdKind::DkDvSm90 { dq_overlap: false, varlen, dq: false, dq_tiled: false, mask_warps: false }, BwdKind::Dq]);
                    assert!(!p.iter().any(|c| c.uses_dq_accum()), "{hd}: no dq_accum on the deterministic path");
                    // the Dq kernel is the sm80 plan's, the same as without the Hopper kernel
                    assert_eq!(p[2], bwd_plan(hd, VariantKind::CAUSAL, true, DType::BF16, Arch::Sm90a)[2]);
                    let name = p[1].name_expression();
                    let tail = if varlen { ", false, true, false>" } else { ", false, false, false>" };
                    assert!(name.ends_with(tail), "{name}");
                }
            }
            // without the dS^T and staging tiles: 2 x 16 KiB x (d / 64) x ... less
            let with = sm90_dkdv_config(hd, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, false, false, true);
            let without = sm90_dkdv_config(hd, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, false, false, false);
            assert_eq!(with.smem_bytes() - without.smem_bytes(), 2 * 128 * 64 * 2 + 2 * 64 * 288);
        }
        // the dispatcher's choice: the Hopper plan at both head dims (measured faster); the sm80 knob: never
        for hd in [64, 128] {
            let auto = bwd_plan_sm90(hd, VariantKind::CAUSAL, true, DType::F16, Arch::Sm90a, FamilyChoice::Auto, false, false, false, false);
            assert!(matches!(auto.unwrap()[1].kind, BwdKind::DkDvSm90 { dq: false, .. }));
            assert!(bwd_plan_sm90(hd, VariantKind::CAUSAL, true, DType::F16, Arch::Sm90a, FamilyChoice::Sm80, false, false, false, false).is_none());
        }
        // every production variant, and the default name of the atomic kernel is unchanged
        let prod = bwd_production_configs(Arch::Sm90a);
        assert!(prod.iter().any(|c| matches!(c.kind, BwdKind::DkDvSm90 { dq: false, varlen: false, .. })));
        assert!(prod.iter().any(|c| matches!(c.kind, BwdKind::DkDvSm90 { dq: false, varlen: true, .. })));
        // the tiled dq_accum's forms are precompiled (padded only); the mask warps' are not (they spill)
        assert!(prod.iter().any(|c| matches!(c.kind, BwdKind::DkDvSm90 { dq_tiled: true, varlen: false, .. })));
        assert!(!prod.iter().any(|c| matches!(c.kind, BwdKind::DkDvSm90 { dq_tiled: true, varlen: true, .. })));
        assert!(prod.iter().any(|c| c.kind == BwdKind::ConvertDq { tiled: true }));
        assert!(!prod.iter().any(|c| matches!(c.kind, BwdKind::DkDvSm90 { mask_warps: true, .. })));
        let atomic = sm90_dkdv_config(128, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, false, false, true);
        assert!(atomic.name_expression().ends_with("__nv_bfloat16>"), "{}", atomic.name_expression());
    }

    #[test]
    fn plans_have_the_documented_shape() {
        let p = bwd_plan(128, VariantKind::from_causal(true), false, DType::BF16, Arch::Sm90a);
        assert_eq!(p.len(), 3);
        assert_eq!(p[0].kind, BwdKind::Preprocess);
        assert_eq!(p[1].kind, BwdKind::DkDv { dk: true, dv: true, dq: true });
        assert_eq!(p[2].kind, BwdKind::ConvertDq { tiled: false });
        assert!(p.iter().any(|c| c.uses_dq_accum()));
        // d256 on 99 KiB GPUs: split (the wide kernel needs 147 968 B)
        let p = bwd_plan(256, VariantKind::from_causal(false), true, DType::F16, Arch::Sm86);
        let kinds: Vec<_> = p.iter().map(|c| c.kind).collect();
        assert_eq!(
            kinds,
            vec![
                BwdKind::Preprocess,
                BwdKind::DkDv { dk: false, dv: true, dq: false },
                BwdKind::DkDv { dk: true, dv: false, dq: false },
                BwdKind::Dq
            ]
        );
        assert!(!p.iter().any(|c| c.uses_dq_accum()));
        assert_eq!(
            p[1].name_expression(),
            format!("ferroattn::attn_bwd_dkdv_sm80<256, {}, {}, {}, {}, ferroattn::AttnVariant<0, false, false, false, false, false>, false, true, false, __half>",
                p[1].block_m, p[1].block_n, p[1].num_warps, p[1].stages)
        );
        assert_eq!(p[0].name_expression(), "ferroattn::attn_bwd_preprocess<256, 64, __half>");
    }

    #[test]
    fn plain_and_causal_keep_their_tiles() {
        for arch in Arch::ALL {
            for v in [VariantKind::PLAIN, VariantKind::CAUSAL] {
                assert_keeps_wide_staging(v, arch);
                for hd in (32..=256).step_by(32) {
                    assert_eq!(dkdv_dq_tile(hd, v, arch), dkdv_tile(hd, v), "{hd} {v:?} {arch:?}");
                }
            }
        }
    }

    /// d256 of a variant outside `WIDE_DQ_DIRECT` (plain, causal, dropout, ...): the wide kernel
    /// on both paths where it fits, its dQ reductions staged on sm_90a, `DqDirect` never rendered.
    fn assert_keeps_wide_staging(v: VariantKind, arch: Arch) {
        for det in [false, true] {
            let p = bwd_plan(256, v, det, DType::BF16, arch);
            let c = p[1];
            assert_eq!(c.is_wide(), dkdv_wide(256, arch), "{v:?} {arch:?}");
            assert!(!c.wide_dq_direct(), "{v:?} {arch:?}");
            assert_eq!(c.wide_dq_staged(), c.is_wide() && !det && arch == Arch::Sm90a, "{v:?} {arch:?}");
            if c.is_wide() {
                assert_eq!(p.len(), 3);
                assert!(c.name_expression().ends_with(&format!(", {det_dq}, __nv_bfloat16>", det_dq = !det)));
            }
        }
    }

    /// The tiles of the atomic-dQ dK/dV kernel of the production variants (besides plain,
    /// causal and dropout) at d 64 / 128 / 256; the deterministic path keeps dkdv_tile / WIDE_TILE.
    #[test]
    fn score_and_window_variants_take_the_spill_free_tiles() {
        let (plain, causal) = (VariantKind::PLAIN, VariantKind::CAUSAL);
        let local = VariantKind { mask: MaskKind::Local, ..plain };
        let soft = |v: VariantKind| VariantKind { softcap: true, ..v };
        let alibi = |v: VariantKind| VariantKind { alibi: true, ..v };
        // (variant, d64 sm_80, d64 sm_90a, d128 sm_80, d128 sm_90a block_m; d256 sm_90a direct dQ)
        let want = [
            (local, 64, 64, 64, 64, false),
            (soft(causal), 32, 64, 64, 64, false),
            (soft(local), 32, 32, 64, 64, true),
            (alibi(plain), 64, 64, 64, 64, false),
            (alibi(causal), 64, 64, 64, 64, true),
            (soft(plain), 32, 64, 64, 64, true),
            // sinks change nothing in the backward
            (VariantKind { sinks: true, ..soft(local) }, 32, 32, 64, 64, true),
        ];
        for (v, m64_80, m64_90, m128_80, m128_90, direct256) in want {
            for (hd, arch, bm) in [(64, Arch::Sm80, m64_80), (64, Arch::Sm90a, m64_90), (128, Arch::Sm80, m128_80), (128, Arch::Sm90a, m128_90)] {
                let p = bwd_plan(hd, v, false, DType::BF16, arch);
                assert_eq!(p[1].kind, BwdKind::DkDv { dk: true, dv: true, dq: true });
                assert_eq!((p[1].block_m, p[1].block_n, p[1].stages), (bm, 128, 2), "{hd} {v:?} {arch:?}");
                assert_eq!(p[1].num_warps, if hd == 64 { 4 } else { 8 });
                assert_eq!(p[1].dq_staged(), arch == Arch::Sm90a);
                let det = bwd_plan(hd, v, true, DType::BF16, arch);
                let (bm, bn, nw, _) = dkdv_tile(hd, v);
                assert_eq!((det[1].block_m, det[1].block_n, det[1].num_warps), (bm, bn, nw), "{hd} {v:?} {arch:?}");
            }
            for arch in [Arch::Sm80, Arch::Sm90a] {
                let p = bwd_plan(256, v, false, DType::BF16, arch);
                let kinds: Vec<_> = p.iter().map(|c| c.kind).collect();
                assert_eq!(
                    kinds,
                    vec![BwdKind::Preprocess, BwdKind::DkDv { dk: true, dv: true, dq: true }, BwdKind::ConvertDq { tiled: false }],
                    "{v:?} {arch:?}"
                );
                let c = p[1];
                let st = if arch == Arch::Sm90a { 2 } else { 1 };
                assert!(c.is_wide());
                assert_eq!((c.block_m, c.block_n, c.num_warps, c.stages), (64, 64, 8, st));
                let direct = direct256 && arch == Arch::Sm90a;
                assert_eq!(c.wide_dq_direct(), direct, "{v:?} {arch:?}");
                assert_eq!(c.wide_dq_staged(), arch == Arch::Sm90a && !direct, "{v:?} {arch:?}");
                // K, V + stages x (Q, dO) + P, dS (16-bit), LSE/D rows [+ 16 KiB fp32 dQ staging]
                let want = (2 * 64 * 256 + st * 2 * 64 * 256 + 2 * 64 * 64) * 2 + st * 64 * 8
                    + if c.wide_dq_staged() { 16384 } else { 0 };
                assert_eq!(c.smem_bytes(), want, "{v:?} {arch:?}");
                assert_eq!(c.smem_bytes(), if direct { 214_016 } else if st == 2 { 230_400 } else { 147_968 });
                assert_eq!(
                    c.name_expression(),
                    format!(
                        "ferroattn::attn_bwd_dkdv_sm80<256, 64, 64, 8, {st}, {}, true, true, true, __nv_bfloat16{}>",
                        v.for_backward().cuda_type(),
                        if direct { ", true" } else { "" }
                    )
                );
                // deterministic: the wide kernel without dQ (nothing staged, DqDirect not rendered)
                let d = bwd_plan(256, v, true, DType::BF16, arch)[1];
                assert!(d.is_wide() && !d.wide_dq_staged() && !d.wide_dq_direct(), "{v:?} {arch:?}");
                assert!(d.name_expression().ends_with(", true, true, false, __nv_bfloat16>"));
            }
        }
        // dropout: its own tiles (dkdv_tile)
        for v in [VariantKind { dropout: true, ..plain }, VariantKind { dropout: true, ..causal }] {
            for arch in Arch::ALL {
                assert_keeps_wide_staging(v, arch);
                for hd in (32..=256).step_by(32) {
                    assert_eq!(dkdv_dq_tile(hd, v, arch), dkdv_tile(hd, v));
                }
            }
        }
        // combinations outside the production set keep the default tiles
        for v in [alibi(local), soft(alibi(causal)), VariantKind { dropout: true, ..soft(local) }] {
            for arch in Arch::ALL {
                assert_keeps_wide_staging(v, arch);
                for hd in (32..=256).step_by(32) {
                    assert_eq!(dkdv_dq_tile(hd, v, arch), dkdv_tile(hd, v));
                }
            }
        }
    }

    #[test]
    fn d256_runs_the_wide_kernel_where_it_fits() {
        for arch in Arch::ALL {
            for det in [false, true] {
                let p = bwd_plan(256, VariantKind::from_causal(true), det, DType::BF16, arch);
                let wide = arch.max_smem_per_block() >= 163 * 1024;
                assert_eq!(dkdv_wide(256, arch), wide, "{arch:?}");
                if !wide {
                    assert!(p.iter().all(|c| !c.is_wide()));
                    continue;
                }
                assert_eq!(p.len(), 3, "{p:?}");
                let c = p[1];
                assert_eq!(c.kind, BwdKind::DkDv { dk: true, dv: true, dq: !det });
                assert!(c.is_wide() && !c.dq_staged());
                let st = if arch == Arch::Sm80 || arch == Arch::Sm87 { 1 } else { 2 };
                assert_eq!((c.block_m, c.block_n, c.num_warps, c.stages), (64, 64, 8, st), "{arch:?}");
                let staged = !det && arch == Arch::Sm90a;
                assert_eq!(c.wide_dq_staged(), staged);
                // K, V + stages x (Q, dO) + P, dS (16-bit), LSE/D rows, 16 KiB fp32 dQ staging
                let want = (2 * 64 * 256 + st * 2 * 64 * 256 + 2 * 64 * 64) * 2 + st * 64 * 8
                    + if staged { 16384 } else { 0 };
                assert_eq!(c.smem_bytes(), want, "{arch:?}");
                assert!(c.smem_bytes() <= arch.max_smem_per_block());
                assert_eq!(
                    c.name_expression(),
                    format!("ferroattn::attn_bwd_dkdv_sm80<256, 64, 64, 8, {st}, ferroattn::AttnVariant<1, false, false, false, false, false>, true, true, {}, __nv_bfloat16>", !det)
                );
            }
        }
        assert_eq!(bwd_plan(256, VariantKind::from_causal(false), false, DType::F16, Arch::Sm90a)[1].smem_bytes(), 230_400);
        assert_eq!(bwd_plan(256, VariantKind::from_causal(false), false, DType::F16, Arch::Sm80)[1].smem_bytes(), 147_968);
        // d160..224 keep the split everywhere
        assert!(bwd_plan(224, VariantKind::from_causal(false), false, DType::F16, Arch::Sm90a).iter().all(|c| !c.is_wide()));
        assert!(dkdv_split(224, Arch::Sm90a) && !dkdv_split(256, Arch::Sm90a) && dkdv_split(256, Arch::Sm89));
    }
}
