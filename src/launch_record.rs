//! What describes one launch: its shape, the work it does and the op that makes it. A leaf:
//! `launch` checks and launches with it, `profiler` records it, `ops` fill it in.

use crate::error::{Error, Result};

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub dynamic_smem_bytes: u32,
}

impl LaunchShape {
    /// Driver limits on grid dims (x < 2^31, y and z <= 65535).
    pub fn check(&self) -> Result<()> {
        let (x, y, z) = self.grid;
        if x == 0 || y == 0 || z == 0 || x > i32::MAX as u32 || y > 65535 || z > 65535 {
            return Err(Error::argument(
                "launch grid",
                "x in 1..2^31, y and z in 1..=65535",
                format!("{:?}", self.grid),
            ));
        }
        Ok(())
    }
}

/// The work one launch does, as the op computes it (each op family's `work` module:
/// src/ops/attention/work.rs, src/ops/gemm/work.rs, src/ops/sparse24/work.rs): what the launch
/// recorder reports. Plain numbers, computed whether or not recording is on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Work {
    /// Floating-point operations of the tensor-core products (2·m·n·k each).
    pub flops: f64,
    /// Compulsory global-memory traffic in bytes: every tensor read or written, once.
    pub bytes: f64,
    /// False when the counts rest on an assumption (varlen: lengths live on the device).
    pub exact: bool,
}

/// What the launch recorder needs from the op besides the kernel and the launch shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LaunchInfo {
    /// The custom op that launches it, e.g. "ferroattn::attn_fwd".
    pub op: &'static str,
    pub work: Work,
}
