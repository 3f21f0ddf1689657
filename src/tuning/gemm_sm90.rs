//! Hopper (sm_90a) dense GEMM specialisations: pure functions, unit-tested on CPU.
//!
//! `config` picks the kernel specialisation for one problem; `production_configs` lists every
//! specialisation `ferroattn precompile` builds (and CI checks for spills).

use crate::dtype::DType;
use crate::jit::Arch;
use crate::ops::gemm::problem::Activation;

/// Rows of the CTA tile (two consumer warpgroups of 64 rows; kernels/gemm/sm90.cuh).
pub const BLOCK_M: u32 = 128;
/// K depth of one pipeline stage (one 128-byte swizzle row of 16-bit elements).
pub const BLOCK_K: u32 = 64;
/// Threads per CTA: one producer and two consumer warpgroups.
pub const THREADS: u32 = 384;
/// Shared memory of the epilogue's TMA-store buffers: 2 consumer warpgroups x 2 x 8 KiB.
pub const EPILOGUE_SMEM: u32 = 2 * 2 * 8192;

/// One specialisation of
/// `ferroattn::gemm_sm90<T, TOut, AKMajor, BKMajor, BN, Stages, Act, FastEpi>`
/// (kernels/gemm/sm90.cuh): the single source of truth for its template arguments, launch
/// shape and cache key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmSm90Config {
    /// a / b element type (fp16 or bf16).
    pub dtype: DType,
    /// out / c / aux element type (fp16, bf16 or fp32).
    pub out_dtype: DType,
    /// a is K-major (row-major (m, k)); else M-major (column-major).
    pub a_k_major: bool,
    /// b is K-major (column-major (k, n)); else N-major (row-major).
    pub b_k_major: bool,
    /// Columns of the CTA tile: 128 or 256 (the wgmma N).
    pub block_n: u32,
    /// TMA/mbarrier pipeline depth.
    pub stages: u32,
    /// The epilogue activation (a template argument: one epilogue per kernel).
    pub activation: Activation,
    /// Adds the branch-free epilogue loop for calls without c and aux (FastEpi; compiled and
    /// checked for spills, not yet run on a GPU: off by default, see `config`).
    pub fast_epilogue: bool,
    pub arch: Arch,
}

impl GemmSm90Config {
    pub const KERNEL: &'static str = "ferroattn::gemm_sm90";

    /// The NVRTC name expression that instantiates this specialisation.
    pub fn name_expression(&self) -> String {
        format!(
            "{}<{}, {}, {}, {}, {}, {}, {}, {}>",
            Self::KERNEL,
            self.dtype.cuda_type(),
            self.out_dtype.cuda_type(),
            self.a_k_major,
            self.b_k_major,
            self.block_n,
            self.stages,
            self.activation.code(),
            self.fast_epilogue
        )
    }

    /// Dynamic shared memory in bytes: `stages` A and B tiles, the epilogue's store buffers
    /// (two 8 KiB buffers per consumer warpgroup), full/empty mbarriers and the slack that
    /// aligns the tiles to 1024 bytes (the kernel's static_assert uses the same sum).
    pub fn smem_bytes(&self) -> u32 {
        self.stages * (BLOCK_M + self.block_n) * BLOCK_K * 2 + EPILOGUE_SMEM + 2 * self.stages * 8 + 1024
    }
}

/// m-tiles per raster group (tile order of the persistent schedule): 16 x 128 rows against
/// ~8 x 256 columns keeps the 132 concurrently running tiles of an H200 roughly square.
pub const GROUP_M: i32 = 16;

/// The configuration one problem runs with. 128 x 256 x 64 tiles, 4 stages (192 KiB of the
/// 227 KiB a block may use, 32 KiB more for the epilogue's store buffers); bench/NOTES.md
/// (from .dev/gemm_sm90/NOTES.md) has the measurements.
pub fn config(
    dtype: DType,
    out_dtype: DType,
    a_k_major: bool,
    b_k_major: bool,
    activation: Activation,
    fast_epilogue: bool,
) -> GemmSm90Config {
    GemmSm90Config {
        dtype,
        out_dtype,
        a_k_major,
        b_k_major,
        block_n: 256,
        stages: 4,
        activation,
        fast_epilogue,
        arch: Arch::Sm90a,
    }
}

/// Every configuration `config` returns by default (fast_epilogue off; sm_90a only, empty for
/// other archs).
pub fn production_configs(arch: Arch) -> Vec<GemmSm90Config> {
    if arch != Arch::Sm90a {
        return Vec::new();
    }
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for out_dtype in [DType::F16, DType::BF16, DType::F32] {
            for a_k_major in [true, false] {
                for b_k_major in [true, false] {
                    for act in Activation::ALL {
                        out.push(config(dtype, out_dtype, a_k_major, b_k_major, act, false));
                    }
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
    fn production_configs_are_distinct_and_fit() {
        let all = production_configs(Arch::Sm90a);
        assert_eq!(all.len(), 2 * 3 * 4 * 5);
        for (i, c) in all.iter().enumerate() {
            assert!(c.smem_bytes() <= Arch::Sm90a.max_smem_per_block(), "{c:?}");
            assert!(all[..i].iter().all(|o| o != c));
        }
        assert!(production_configs(Arch::Sm80).is_empty());
    }

    #[test]
    fn name_expression_and_smem() {
        let c = config(DType::BF16, DType::F32, true, false, Activation::Silu, false);
        assert_eq!(
            c.name_expression(),
            "ferroattn::gemm_sm90<__nv_bfloat16, float, true, false, 256, 4, 4, false>"
        );
        let f = config(DType::F16, DType::F16, false, true, Activation::None, true);
        assert!(f.name_expression().ends_with("<__half, __half, false, true, 256, 4, 0, true>"));
        assert_eq!(f.smem_bytes(), c.smem_bytes());
        assert_eq!(c.smem_bytes(), 4 * 384 * 128 + 32768 + 64 + 1024);
    }
}
