//! Hopper (sm_90a) dense GEMM specialisations: pure functions, unit-tested on CPU.
//!
//! `config` picks the kernel specialisation for one problem; `production_configs` lists every
//! specialisation `ferroattn precompile` builds (and CI checks for spills).

use crate::dtype::DType;
use crate::arch::Arch;
use crate::tuning::gemm_problem::Activation;

/// Rows of the tile of one work unit (every schedule in production uses 128).
pub const BLOCK_M: u32 = 128;
/// K depth of one pipeline stage (one 128-byte swizzle row of 16-bit elements).
pub const BLOCK_K: u32 = 64;
/// Threads per CTA: one producer and two consumer warpgroups.
pub const THREADS: u32 = 384;
/// Shared memory of the epilogue's TMA-store buffers: 2 consumer warpgroups x 2 x 8 KiB.
pub const EPILOGUE_SMEM: u32 = 2 * 2 * 8192;

/// How the two consumer warpgroups share the work (bench/NOTES.md "Dense GEMM, Hopper path").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// `gemm_sm90` (kernels/gemm/sm90.cuh): both consumer warpgroups on one 128 x 256 tile (64
    /// rows each); the tensor cores idle during every tile's epilogue.
    Cooperative,
    /// `gemm_sm90_pingpong` (kernels/gemm/sm90_pingpong.cuh): each consumer warpgroup owns a
    /// 128 x 128 tile; mainloops alternate, so one warpgroup's epilogue overlaps the other's
    /// mainloop.
    PingPong,
    /// `gemm_sm90_pingpong_c2`: PingPong in 2-CTA clusters along m, B multicast to both CTAs
    /// (half of B's L2 -> shared-memory traffic).
    PingPongCluster2,
}

impl Schedule {
    /// CTAs per cluster (the kernel's `__cluster_dims__`; the grid is a multiple of it).
    pub fn cluster(self) -> u32 {
        match self {
            Schedule::PingPongCluster2 => 2,
            _ => 1,
        }
    }
}

/// Largest k for which the k-rule (`SchedulePolicy::ByK`) picks `Schedule::PingPong`.
pub const PINGPONG_MAX_K: i64 = 4096;

/// How a problem's schedule is chosen (the `gemm_sm90_schedule` knob).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulePolicy {
    /// One schedule for every problem.
    Fixed(Schedule),
    /// PingPong for k <= PINGPONG_MAX_K without an activation, where the cooperative kernel's
    /// exposed epilogue is ~13 % of a tile's time and hiding it won 3-10 % in the harness;
    /// Cooperative for larger k, where the epilogue share is small and PingPong's 128 x 128 tiles
    /// (1.33x the L2 -> shared-memory bytes per MAC, lower clocks under the power cap) lost
    /// 3-15 %, and for activations (bias + erf-GELU with PingPong: -4 % to -8 % in 3 of 4
    /// measurements). bench/NOTES.md "Dense GEMM, Hopper path": harness median over
    /// the target grid 0.940 -> 0.952 and 0.934 -> 0.944 in two device calls.
    ByK,
}

/// The production policy. Fixed(Cooperative) = the cooperative kernel for every problem: the k-rule has
/// passed the harness on the GPU but not yet the GPU tests through the wheel (switch to ByK
/// after they pass; the `gemm_sm90_schedule` knob `auto` selects it at run time meanwhile).
/// PingPongCluster2 is correct but ~0.4x cuBLAS in its current form (never chosen by default).
pub const DEFAULT_POLICY: SchedulePolicy = SchedulePolicy::Fixed(Schedule::Cooperative);

/// The schedule `policy` picks for a problem with inner dimension `k` and epilogue `activation`.
pub fn schedule_for(policy: SchedulePolicy, k: i64, activation: Activation) -> Schedule {
    match policy {
        SchedulePolicy::Fixed(s) => s,
        SchedulePolicy::ByK if k <= PINGPONG_MAX_K && activation == Activation::None => Schedule::PingPong,
        SchedulePolicy::ByK => Schedule::Cooperative,
    }
}

/// The schedules `policy` can pick (what `production_configs` builds).
pub fn policy_schedules(policy: SchedulePolicy) -> Vec<Schedule> {
    match policy {
        SchedulePolicy::Fixed(s) => vec![s],
        SchedulePolicy::ByK => vec![Schedule::Cooperative, Schedule::PingPong],
    }
}

/// Whether production kernels carry the branch-free epilogue loop (FastEpi) that calls without c
/// and aux take: stmatrix stores of 16-bit outputs, no per-element predicates (bench/NOTES.md
/// "Dense GEMM, Hopper path"). The `gemm_sm90_fast_epilogue` knob 0 selects the general loop at run
/// time (src/ops/gemm/sm90.rs).
pub const DEFAULT_FAST_EPILOGUE: bool = true;

/// One specialisation of
/// `ferroattn::gemm_sm90<T, TOut, AKMajor, BKMajor, BN, Stages, Act, FastEpi>`
/// (kernels/gemm/sm90.cuh, Schedule::Cooperative) or
/// `ferroattn::gemm_sm90_pingpong[_c2]<T, TOut, AKMajor, BKMajor, BM, BN, Stages, Act, FastEpi>`
/// (kernels/gemm/sm90_pingpong.cuh): the single source of truth for its template arguments,
/// launch shape and cache key.
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
    /// Which kernel (consumer-warpgroup schedule).
    pub schedule: Schedule,
    /// Rows of one work unit's tile (128).
    pub block_m: u32,
    /// Columns of one work unit's tile: 128 or 256 (the wgmma N).
    pub block_n: u32,
    /// TMA/mbarrier pipeline depth.
    pub stages: u32,
    /// The epilogue activation (a template argument: one epilogue per kernel).
    pub activation: Activation,
    /// Adds the branch-free epilogue loop for calls without c and aux (FastEpi; production:
    /// `DEFAULT_FAST_EPILOGUE`).
    pub fast_epilogue: bool,
    pub arch: Arch,
}

impl GemmSm90Config {
    /// The kernel's qualified name.
    pub fn kernel(&self) -> &'static str {
        match self.schedule {
            Schedule::Cooperative => "ferroattn::gemm_sm90",
            Schedule::PingPong => "ferroattn::gemm_sm90_pingpong",
            Schedule::PingPongCluster2 => "ferroattn::gemm_sm90_pingpong_c2",
        }
    }

    /// The header (under kernels/) that defines the kernel.
    pub fn header(&self) -> &'static str {
        match self.schedule {
            Schedule::Cooperative => "gemm/sm90.cuh",
            _ => "gemm/sm90_pingpong.cuh",
        }
    }

    /// The NVRTC name expression that instantiates this specialisation.
    pub fn name_expression(&self) -> String {
        let tile = match self.schedule {
            Schedule::Cooperative => format!("{}", self.block_n),
            _ => format!("{}, {}", self.block_m, self.block_n),
        };
        format!(
            "{}<{}, {}, {}, {}, {}, {}, {}, {}>",
            self.kernel(),
            self.dtype.cuda_type(),
            self.out_dtype.cuda_type(),
            self.a_k_major,
            self.b_k_major,
            tile,
            self.stages,
            self.activation.code(),
            self.fast_epilogue
        )
    }

    /// Dynamic shared memory in bytes: `stages` A and B tiles, the epilogue's store buffers
    /// (two 8 KiB buffers per consumer warpgroup), full/empty mbarriers and the slack that
    /// aligns the tiles to 1024 bytes (the kernels' static_asserts use the same sum).
    pub fn smem_bytes(&self) -> u32 {
        self.stages * (self.block_m + self.block_n) * BLOCK_K * 2 + EPILOGUE_SMEM + 2 * self.stages * 8 + 1024
    }
}

/// m-tiles per raster group (tile order of the persistent schedule): 16 x 128 rows against
/// ~8 x 256 columns keeps the 132 concurrently running tiles of an H200 roughly square.
pub const GROUP_M: i32 = 16;

/// The configuration one problem runs with under `schedule`. Cooperative: 128 x 256 x 64 tiles,
/// 4 stages (192 KiB of the 227 KiB a block may use, 32 KiB more for the epilogue's store
/// buffers); PingPong / PingPongCluster2: 128 x 128 x 64 tiles per warpgroup, 6 stages (192 KiB);
/// bench/NOTES.md has the measurements.
pub fn config(
    dtype: DType,
    out_dtype: DType,
    a_k_major: bool,
    b_k_major: bool,
    activation: Activation,
    fast_epilogue: bool,
    schedule: Schedule,
) -> GemmSm90Config {
    let (block_n, stages) = match schedule {
        Schedule::Cooperative => (256, 4),
        _ => (128, 6),
    };
    GemmSm90Config {
        dtype,
        out_dtype,
        a_k_major,
        b_k_major,
        schedule,
        block_m: BLOCK_M,
        block_n,
        stages,
        activation,
        fast_epilogue,
        arch: Arch::Sm90a,
    }
}

/// Every configuration `config` returns by default (the schedules DEFAULT_POLICY can pick;
/// fast_epilogue = DEFAULT_FAST_EPILOGUE; sm_90a only, empty for other archs).
pub fn production_configs(arch: Arch) -> Vec<GemmSm90Config> {
    if arch != Arch::Sm90a {
        return Vec::new();
    }
    let schedules = policy_schedules(DEFAULT_POLICY);
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for out_dtype in [DType::F16, DType::BF16, DType::F32] {
            for a_k_major in [true, false] {
                for b_k_major in [true, false] {
                    for act in Activation::ALL {
                        for &schedule in &schedules {
                            out.push(config(dtype, out_dtype, a_k_major, b_k_major, act, DEFAULT_FAST_EPILOGUE, schedule));
                        }
                    }
                }
            }
        }
    }
    out
}

/// A split-k plan (src/ops/gemm/sm90/splitk.rs): k is cut into `splits` equal chunks of `kc`
/// (a multiple of BLOCK_K) that run as the batch entries of one sm90 GEMM launch into an fp32
/// workspace (splits, m, n); kernels/gemm/splitk_reduce.cuh then sums the chunks and applies the
/// epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitK {
    pub splits: i64,
    pub kc: i64,
}

/// The split-k plan for a problem of `batch` x (m, n, k) whose unsplit launch would have `tiles`
/// work units (`tiles_m * tiles_n`, 128 x 256 tiles) on a device of `sms` SMs with a schedule of
/// `cluster` CTAs per cluster; None = run unsplit.
///
/// Rule (decode-sized GEMMs, bench/NOTES.md "Small-m dense GEMMs": 16 tiles of an m = 16,
/// n = 4096 problem leave 116 of 132 SMs idle while the weight streams through 16): split only
/// a single problem (batch == 1) of a non-cluster schedule whose tiles fill less than half of
/// the SMs (2 * tiles < sms), with k a multiple of BLOCK_K (the chunks must be equal: the
/// kernel's k tail is TMA's zero fill at the tensor map's k extent, which a batch view gives
/// every chunk, so an unequal last chunk would read the next chunk's k instead of zeros), into
/// the largest number of chunks `splits` >= 2 that divides k / BLOCK_K, keeps every chunk at
/// least two BLOCK_K steps deep and keeps `splits * tiles <= sms` (one wave: every work unit
/// runs concurrently).
pub fn splitk_plan(batch: i64, k: i64, tiles: i64, cluster: u32, sms: i64) -> Option<SplitK> {
    let bk = BLOCK_K as i64;
    if batch != 1 || cluster != 1 || tiles < 1 || 2 * tiles >= sms || k % bk != 0 || k < 2 * bk * 2 {
        return None;
    }
    let k_tiles = k / bk;
    let most = (sms / tiles).min(k_tiles / 2);
    (2..=most)
        .rev()
        .find(|s| k_tiles % s == 0)
        .map(|splits| SplitK { splits, kc: k / splits })
}

/// Threads per block of the split-k reduce kernel (one thread per 4 columns of a row).
pub const SPLITK_REDUCE_THREADS: u32 = 256;

/// One specialisation of `ferroattn::gemm_splitk_reduce<TOut, Act>`
/// (kernels/gemm/splitk_reduce.cuh); c, aux and bias (and bias's dtype) are runtime arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmSplitkReduceConfig {
    /// out / c / aux element type (fp16, bf16 or fp32).
    pub out_dtype: DType,
    pub activation: Activation,
    pub arch: Arch,
}

impl GemmSplitkReduceConfig {
    pub fn kernel(&self) -> &'static str {
        "ferroattn::gemm_splitk_reduce"
    }

    pub fn header(&self) -> &'static str {
        "gemm/splitk_reduce.cuh"
    }

    /// The NVRTC name expression that instantiates this specialisation.
    pub fn name_expression(&self) -> String {
        format!("{}<{}, {}>", self.kernel(), self.out_dtype.cuda_type(), self.activation.code())
    }
}

/// Every reduce specialisation split-k can launch (sm_90a only, empty for other archs): 3 out
/// dtypes x 5 activations.
pub fn splitk_reduce_production_configs(arch: Arch) -> Vec<GemmSplitkReduceConfig> {
    if arch != Arch::Sm90a {
        return Vec::new();
    }
    let mut out = Vec::new();
    for out_dtype in [DType::F16, DType::BF16, DType::F32] {
        for activation in Activation::ALL {
            out.push(GemmSplitkReduceConfig { out_dtype, activation, arch });
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
        assert_eq!(all.len(), 2 * 3 * 4 * 5 * policy_schedules(DEFAULT_POLICY).len());
        for (i, c) in all.iter().enumerate() {
            assert!(c.smem_bytes() <= Arch::Sm90a.max_smem_per_block(), "{c:?}");
            assert!(all[..i].iter().all(|o| o != c));
        }
        assert!(production_configs(Arch::Sm80).is_empty());
        assert!(all.iter().all(|c| c.fast_epilogue == DEFAULT_FAST_EPILOGUE));
    }

    #[test]
    fn splitk_plan_rule() {
        let sms = 132;
        // m = 16, n = 4096: 16 tiles; k = 4096 = 64 k-tiles -> 8 chunks of 512 (128 CTAs).
        assert_eq!(splitk_plan(1, 4096, 16, 1, sms), Some(SplitK { splits: 8, kc: 512 }));
        // k = 11008 = 172 k-tiles = 4 * 43: the largest divisor <= 132 / 16 = 8 is 4.
        assert_eq!(splitk_plan(1, 11008, 16, 1, sms), Some(SplitK { splits: 4, kc: 2752 }));
        // k = 14336 = 224 k-tiles: 8 chunks; n = 14336 (56 tiles): 2 chunks.
        assert_eq!(splitk_plan(1, 14336, 16, 1, sms), Some(SplitK { splits: 8, kc: 1792 }));
        assert_eq!(splitk_plan(1, 4096, 56, 1, sms), Some(SplitK { splits: 2, kc: 2048 }));
        // m = 512, n = 4096: 64 tiles < 66 -> 2 chunks; 66 tiles or more: no split.
        assert_eq!(splitk_plan(1, 4096, 64, 1, sms), Some(SplitK { splits: 2, kc: 2048 }));
        assert_eq!(splitk_plan(1, 4096, 66, 1, sms), None);
        // one tile, small k: chunks at least 2 k-tiles deep (k = 256 -> 2 x 128).
        assert_eq!(splitk_plan(1, 256, 1, 1, sms), Some(SplitK { splits: 2, kc: 128 }));
        assert_eq!(splitk_plan(1, 192, 1, 1, sms), None);
        assert_eq!(splitk_plan(1, 64 * 131, 1, 1, sms), None); // prime k-tile count > 66
        assert_eq!(splitk_plan(1, 64 * 6, 1, 1, sms), Some(SplitK { splits: 3, kc: 128 }));
        // k not a multiple of 64, batches, clusters: never.
        assert_eq!(splitk_plan(1, 1000, 16, 1, sms), None);
        assert_eq!(splitk_plan(2, 4096, 16, 1, sms), None);
        assert_eq!(splitk_plan(1, 4096, 16, 2, sms), None);
        for tiles in 1..70 {
            for kt in 1..300 {
                if let Some(p) = splitk_plan(1, 64 * kt, tiles, 1, sms) {
                    assert!(p.splits >= 2 && p.splits * tiles <= sms && 2 * tiles < sms, "{tiles} {kt} {p:?}");
                    assert_eq!(p.splits * p.kc, 64 * kt);
                    assert!(p.kc % 64 == 0 && p.kc >= 128);
                }
            }
        }
    }

    #[test]
    fn splitk_reduce_configs() {
        let all = splitk_reduce_production_configs(Arch::Sm90a);
        assert_eq!(all.len(), 15);
        assert!(splitk_reduce_production_configs(Arch::Sm80).is_empty());
        let c = GemmSplitkReduceConfig { out_dtype: DType::BF16, activation: Activation::Silu, arch: Arch::Sm90a };
        assert!(all.contains(&c));
        assert_eq!(c.name_expression(), "ferroattn::gemm_splitk_reduce<__nv_bfloat16, 4>");
        assert_eq!(c.header(), "gemm/splitk_reduce.cuh");
    }

    #[test]
    fn name_expression_and_smem() {
        let c = config(DType::BF16, DType::F32, true, false, Activation::Silu, false, Schedule::Cooperative);
        assert_eq!(
            c.name_expression(),
            "ferroattn::gemm_sm90<__nv_bfloat16, float, true, false, 256, 4, 4, false>"
        );
        assert_eq!(c.header(), "gemm/sm90.cuh");
        let f = config(DType::F16, DType::F16, false, true, Activation::None, true, Schedule::Cooperative);
        assert!(f.name_expression().ends_with("<__half, __half, false, true, 256, 4, 0, true>"));
        assert_eq!(f.smem_bytes(), c.smem_bytes());
        assert_eq!(c.smem_bytes(), 4 * 384 * 128 + 32768 + 64 + 1024);
        let p = config(DType::BF16, DType::BF16, true, false, Activation::GeluErf, false, Schedule::PingPong);
        assert_eq!(
            p.name_expression(),
            "ferroattn::gemm_sm90_pingpong<__nv_bfloat16, __nv_bfloat16, true, false, 128, 128, 6, 3, false>"
        );
        assert_eq!(p.header(), "gemm/sm90_pingpong.cuh");
        assert_eq!(p.smem_bytes(), 6 * 256 * 128 + 32768 + 96 + 1024);
        let q = config(DType::F16, DType::F32, false, true, Activation::None, false, Schedule::PingPongCluster2);
        assert!(q.name_expression().starts_with("ferroattn::gemm_sm90_pingpong_c2<__half, float, false, true, 128, 128, 6, 0,"));
        assert_eq!((q.smem_bytes(), q.schedule.cluster()), (p.smem_bytes(), 2));
        assert_eq!(schedule_for(SchedulePolicy::ByK, 4096, Activation::None), Schedule::PingPong);
        assert_eq!(schedule_for(SchedulePolicy::ByK, 4097, Activation::None), Schedule::Cooperative);
        assert_eq!(schedule_for(SchedulePolicy::ByK, 64, Activation::Relu), Schedule::Cooperative);
        let fixed = SchedulePolicy::Fixed(Schedule::PingPong);
        assert_eq!(schedule_for(fixed, 9999, Activation::Silu), Schedule::PingPong);
        assert_eq!(policy_schedules(SchedulePolicy::ByK).len(), 2);
    }
}
