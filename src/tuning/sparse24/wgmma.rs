//! 2:4 sparse kernels, the Hopper `wgmma .sp` path: its configurations (template arguments, launch
//! shape, shared memory) and the parsers of its epilogue / mainloop forms. Pure functions.

use super::*;

/// One specialisation of `ferroattn::sparse24_matmul_wgmma<T, BN, Stages, Act>`
/// (kernels/sparse24/wgmma_sp.cuh, sm_90a only): wgmma.mma_async.sp, `block_n` w rows (two
/// consumer warpgroups of block_n / 2, one or two m64 blocks each) × `block_r` x rows per tile,
/// 128 logical k per TMA stage, 384 threads (producer warpgroup + 2 consumers), persistent grid
/// of min(tiles, SMs) CTAs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sparse24WgmmaConfig {
    /// Tokens (x rows) per tile: the wgmma N (128, 192 or 256); the kernel's `BN`.
    pub block_r: u32,
    /// w rows (output features) per tile: 128 or 256; the kernel's `BM`.
    pub block_n: u32,
    pub stages: u32,
    pub activation: Activation,
    pub dtype: DType,
    pub arch: Arch,
    /// Epilogue form, the kernel's `Epi`: 0 = stores straight from the accumulator registers,
    /// 1 = staged through shared memory (stmatrix .trans, 16-byte coalesced stores; +16.1 KiB),
    /// 2 = split-k partial products (raw fp32 to a workspace; activation None; see
    /// `wgmma_split_plan`), 3 = split-k with the reduce fused (chunks pass a running sum through
    /// a workspace slot per tile; the last runs the staged epilogue; opt-in, see
    /// `wgmma_fused_split_configs`), 4 = stream-K tail (whole tiles, then the remaining tiles'
    /// stages spread over the CTAs; staged epilogue; see `WgmmaSchedule::StreamK`).
    pub epilogue: u32,
    /// Mainloop form, the kernel's `Sets` (metadata register sets): 1 = wgmma.wait_group 0 after
    /// every stage (production); 2 = two alternating metadata register sets and wait_group 1 (one
    /// stage of wgmmas stays in flight across the stage boundary; opt-in until measured,
    /// the `wgmma_sp_mainloop` knob `pipe`). Same shared memory.
    pub meta_sets: u32,
}

impl Sparse24WgmmaConfig {
    pub const KERNEL: &'static str = "ferroattn::sparse24_matmul_wgmma";
    pub const THREADS: u32 = 384;

    pub fn name_expression(&self) -> String {
        // Epi = 0 and Sets = 1 are the template defaults: those name expressions stay the 5- / 6-
        // argument ones (Sets = 2 spells Epi out)
        let epi = if self.meta_sets != 1 {
            format!(", {}, {}", self.epilogue, self.meta_sets)
        } else if self.epilogue == 0 {
            String::new()
        } else {
            format!(", {}", self.epilogue)
        };
        format!(
            "{}<{}, {}, {}, {}, {}{}>",
            Self::KERNEL,
            self.dtype.cuda_type(),
            self.block_r,
            self.stages,
            self.activation.code(),
            self.block_n,
            epi
        )
    }

    /// Dynamic shared memory (bytes): `stages` × (values block_n × 128 B + x 2 × block_r × 128 B +
    /// metadata block_n × 16 B) + 2 × `stages` mbarriers + 1 KiB alignment slack
    /// (`sparse24_wgmma_smem_bytes` in wgmma_sp.cuh, which static_asserts <= 227 KiB).
    /// The staged epilogue (`epilogue` 1) adds 128 B of alignment + two 8 KiB buffers.
    pub fn smem_bytes(&self) -> u32 {
        self.stages * (128 * self.block_n + 256 * self.block_r + 16 * self.block_n)
            + 16 * self.stages
            + 1024
            + if self.epilogue == 1 || self.epilogue == 3 || self.epilogue == 4 {
                128 + 2 * 8192
            } else {
                0
            }
    }
}

/// The wgmma_sp configuration for a call: 256 w rows × 128 tokens, 3 stages (205 KiB of shared
/// memory): the fastest of the four tiles measured on the H200 (bench/NOTES.md "2:4 wgmma_sp":
/// 1.24× / 1.31× torch dense at 8192³ / 4096×11008×4096 bf16; 128 × 128 × 4 stages
/// 0.91× / 1.04×).
pub fn wgmma_config(activation: Activation, dtype: DType, arch: Arch) -> Sparse24WgmmaConfig {
    wgmma_config_epilogue(activation, dtype, arch, WGMMA_EPILOGUE_DEFAULT)
}

/// `wgmma_config` with an explicit epilogue form (0 direct, 1 staged; see
/// `Sparse24WgmmaConfig::epilogue`) and the production mainloop (`WGMMA_META_SETS_DEFAULT`).
pub fn wgmma_config_epilogue(
    activation: Activation,
    dtype: DType,
    arch: Arch,
    epilogue: u32,
) -> Sparse24WgmmaConfig {
    wgmma_config_variant(activation, dtype, arch, epilogue, WGMMA_META_SETS_DEFAULT)
}

/// `wgmma_config` with an explicit epilogue form and mainloop form (`meta_sets` 1: wait_group 0
/// per stage, 2: pipelined; see `Sparse24WgmmaConfig::meta_sets`).
pub fn wgmma_config_variant(
    activation: Activation,
    dtype: DType,
    arch: Arch,
    epilogue: u32,
    meta_sets: u32,
) -> Sparse24WgmmaConfig {
    Sparse24WgmmaConfig {
        block_r: 128,
        block_n: 256,
        stages: 3,
        activation,
        dtype,
        arch,
        epilogue,
        meta_sets,
    }
}

/// The wgmma_sp mainloop form (kernel template `Sets`: metadata register sets per consumer thread;
/// the `wgmma_sp_mainloop` knob).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum WgmmaMainloop {
    /// wgmma.wait_group 0 after every stage (Sets = 1).
    Wait0 = 1,
    /// Two alternating metadata register sets, one stage of wgmmas in flight (Sets = 2).
    Pipe = 2,
}

impl WgmmaMainloop {
    /// The production form: wait_group 0 per stage. The pipelined form is spill-free at the
    /// production tile (0 spills, 0 metadata hazards in SASS) and correct, but measured 0-4 % slower
    /// on the H200 (bench/results/sparse24_ab_pipe_nvidia-h200_20261130T0628.json): it stays opt-in.
    pub const DEFAULT: WgmmaMainloop = WgmmaMainloop::Wait0;

    /// The kernel's `Sets` template argument.
    pub const fn meta_sets(self) -> u32 {
        self as u32
    }
}

/// The production mainloop form's `Sets` (`WgmmaMainloop::DEFAULT`).
pub const WGMMA_META_SETS_DEFAULT: u32 = WgmmaMainloop::DEFAULT.meta_sets();

/// The wgmma_sp epilogue form of the whole-tile kernels (kernel template `Epi` 0 or 1; the
/// `wgmma_sp_epilogue` knob).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum WgmmaEpilogue {
    /// Stores straight from the accumulator registers (Epi = 0).
    Direct = 0,
    /// Staged through shared memory with 16-byte stores (Epi = 1).
    Staged = 1,
}

impl WgmmaEpilogue {
    /// The production form: staged. H200 same-process A/B, 2026-11-30 05:38: staged / direct
    /// 1.05-1.10x on every k = 4096 LLM shape (bf16 8192x11008x4096: 966 vs 884 dense-equivalent
    /// TFLOP/s), 1.03x at 8192^3, 0.99-1.01x at k = 11008; outputs bitwise equal
    /// (bench/results/sparse24_ab_epilogue_nvidia-h200_20261130T053800.json).
    pub const DEFAULT: WgmmaEpilogue = WgmmaEpilogue::Staged;

    /// The kernel's `Epi` template argument.
    pub const fn form(self) -> u32 {
        self as u32
    }
}

/// The production epilogue form's `Epi` (`WgmmaEpilogue::DEFAULT`).
pub const WGMMA_EPILOGUE_DEFAULT: u32 = WgmmaEpilogue::DEFAULT.form();

/// The opt-in pipelined-mainloop configurations (`meta_sets` 2, staged epilogue; every dtype and
/// activation) for `arch`: not precompiled (NVRTC builds one on its first call), but held to the
/// same no-spill rule by the sparse24 tests.
pub fn wgmma_pipelined_configs(arch: Arch) -> Vec<Sparse24WgmmaConfig> {
    if arch != Arch::Sm90a {
        return Vec::new();
    }
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for activation in Activation::ALL {
            out.push(wgmma_config_variant(activation, dtype, arch, 1, 2));
        }
    }
    out
}

/// Every configuration `wgmma_config` / `wgmma_split_config` / the fused split / `wgmma_schedule`'s
/// 128-row tile return for `arch` (none below or above Hopper: wgmma is sm_90a
/// only): what precompile builds (20 + 2 split-k partial-product kernels + 10 fused split-k kernels +
/// 10 BM-128 kernels).
pub fn wgmma_production_configs(arch: Arch) -> Vec<Sparse24WgmmaConfig> {
    if arch != Arch::Sm90a {
        return Vec::new();
    }
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for activation in Activation::ALL {
            for epilogue in [0, 1] {
                out.push(wgmma_config_epilogue(activation, dtype, arch, epilogue));
            }
        }
        out.push(wgmma_split_config(dtype, arch));
    }
    out.extend(wgmma_fused_split_configs(arch));
    for dtype in [DType::F16, DType::BF16] {
        for activation in Activation::ALL {
            out.push(wgmma_bm128_config(activation, dtype, arch));
        }
    }
    out
}

/// The opt-in stream-K kernels (`epilogue` 4, every dtype and activation; the `wgmma_sp_streamk` knob
/// "on" / "dp:N") for `arch`: not precompiled (NVRTC builds one on its first call; the auto rule
/// never picks them, see `wgmma_schedule`), held to the no-spill rule by the sparse24 tests.
pub fn wgmma_stream_k_configs(arch: Arch) -> Vec<Sparse24WgmmaConfig> {
    if arch != Arch::Sm90a {
        return Vec::new();
    }
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for activation in Activation::ALL {
            out.push(wgmma_stream_k_config(activation, dtype, arch));
        }
    }
    out
}

/// The 128 w-row x 128 token tile (staged epilogue, 4 stages: 222 400 B of shared memory) that
/// `wgmma_schedule` picks when the 256-row tiles would leave most SMs idle (H200: 0.91x / 1.04x
/// torch dense per SM at 8192^3 / 4096 x 11008 x 4096, against 1.24x / 1.31x for 256 x 128: worse per
/// SM, but twice the CTAs).
pub fn wgmma_bm128_config(activation: Activation, dtype: DType, arch: Arch) -> Sparse24WgmmaConfig {
    Sparse24WgmmaConfig {
        block_n: 128,
        stages: 4,
        ..wgmma_config_variant(activation, dtype, arch, 1, 1)
    }
}

/// The stream-K tail kernel (`epilogue` 4: whole tiles first, then the tail's stages spread evenly
/// over the CTAs; staged epilogue) at the production tile.
pub fn wgmma_stream_k_config(activation: Activation, dtype: DType, arch: Arch) -> Sparse24WgmmaConfig {
    wgmma_config_variant(activation, dtype, arch, 4, 1)
}

