//! FLOPs and compulsory bytes of one dense GEMM launch: the `flops` / `bytes` the launch
//! recorder (src/profiler/) reports. Pure arithmetic.

use crate::launch_record::Work;
use crate::tuning::gemm_problem::{GemmProblem, Operand};

/// One dense GEMM launch: FLOPs 2·batch·m·n·k (DESIGN.md §5); bytes: every
/// distinct element read or written once: a and b (a broadcast operand, batch stride 0, once),
/// c when read (beta != 0; likewise), bias, out and aux.
pub fn gemm(p: &GemmProblem) -> Work {
    let batch = p.batch as f64;
    let bytes = |o: &Operand| {
        let copies = if o.batch_stride == 0 { 1.0 } else { batch };
        copies * o.rows as f64 * o.cols as f64 * o.dtype.size_bytes() as f64
    };
    let mut total = bytes(&p.a) + bytes(&p.b) + bytes(&p.out);
    total += p.c.as_ref().map_or(0.0, bytes) + p.aux.as_ref().map_or(0.0, bytes);
    total += p.bias.map_or(0.0, |(_, d)| p.n as f64 * d.size_bytes() as f64);
    Work {
        flops: 2.0 * batch * p.m as f64 * p.n as f64 * p.k as f64,
        bytes: total,
        exact: true,
    }
}
