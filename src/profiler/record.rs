//! What a launch record says: the kernel's driver figures and occupancy, the description
//! taken at launch, and the drained record with its GPU times.

use crate::launch_record::Work;

/// Per-function figures from the driver, for one block size and dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelAttrs {
    /// Registers per thread (CU_FUNC_ATTRIBUTE_NUM_REGS).
    pub registers: i32,
    /// Static shared memory per block in bytes (CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES).
    pub static_smem_bytes: i32,
    /// cuOccupancyMaxActiveBlocksPerMultiprocessor(function, block threads, dynamic smem).
    pub max_active_blocks_per_sm: i32,
    /// CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR of the launch's device.
    pub max_threads_per_sm: i32,
}

/// Theoretical occupancy: resident warps (blocks per SM × warps per block, a partial warp
/// counting whole) over the most warps an SM holds (max threads per SM / 32), in [0, 1].
pub fn theoretical_occupancy(
    max_active_blocks_per_sm: i32,
    block_threads: u32,
    max_threads_per_sm: i32,
) -> f64 {
    let max_warps = max_threads_per_sm / 32;
    if max_warps <= 0 || max_active_blocks_per_sm <= 0 {
        return 0.0;
    }
    let warps = max_active_blocks_per_sm as f64 * block_threads.div_ceil(32) as f64;
    (warps / max_warps as f64).clamp(0.0, 1.0)
}

/// Everything known about a launch when it is made.
#[derive(Clone, Debug, PartialEq)]
pub struct Description {
    /// The custom op, e.g. "ferroattn::attn_fwd".
    pub op: &'static str,
    /// Short kernel name, e.g. "attn_fwd_sm80".
    pub kernel: &'static str,
    /// The configuration's NVRTC name expression.
    pub config: String,
    /// e.g. "sm_90a".
    pub arch: &'static str,
    pub device: i32,
    /// The raw CUstream launched on.
    pub stream: u64,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub dynamic_smem_bytes: u32,
    pub attrs: KernelAttrs,
    /// [`theoretical_occupancy`] of this launch.
    pub occupancy: f64,
    pub work: Work,
}

/// One drained record.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// Position among the recorded launches of this process (0, 1, 2, …, in launch order).
    pub seq: u64,
    pub desc: Description,
    /// cuEventElapsedTime(start, end): the kernel's GPU time in milliseconds.
    pub gpu_ms: f64,
    /// cuEventElapsedTime(reference, start) in milliseconds; None without a reference event
    /// or where the driver refuses it.
    pub start_ms: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn occupancy_is_resident_warps_over_the_sm_maximum() {
        assert_eq!(theoretical_occupancy(2, 128, 2048), 8.0 / 64.0);
        assert_eq!(theoretical_occupancy(1, 256, 2048), 0.125);
        assert_eq!(theoretical_occupancy(16, 128, 2048), 1.0);
        assert_eq!(
            theoretical_occupancy(1, 33, 2048),
            2.0 / 64.0,
            "a partial warp counts whole"
        );
        assert_eq!(theoretical_occupancy(64, 1024, 2048), 1.0, "clamped");
        assert_eq!(theoretical_occupancy(0, 128, 2048), 0.0);
        assert_eq!(theoretical_occupancy(2, 128, 0), 0.0);
    }
}
