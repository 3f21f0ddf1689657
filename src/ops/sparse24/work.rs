//! FLOPs and compulsory bytes of one 2:4 sparse launch: the `flops` / `bytes` the launch
//! recorder (src/profiler/) reports. Pure arithmetic.

use super::host::Layout;
use super::MatmulProblem;
use crate::launch_record::Work;

/// One 2:4 sparse matmul launch: FLOPs counted dense, 2·rows·n·k (DESIGN.md
/// §5: sparse counts dense FLOPs); bytes: x (rows, k), the compressed weight (values
/// (m_pad, k_pad / 2) and 2 bits of metadata per kept element, padding included), out
/// (rows, n) and the bias (`bias_bytes`, 0 without).
pub fn matmul(p: &MatmulProblem, bias_bytes: f64) -> Work {
    let e = p.dtype.size_bytes() as f64;
    let (rows, n, k) = (p.rows as f64, p.n as f64, p.k as f64);
    let l = &p.layout;
    let kept = (l.m_pad * l.k_pad / 2) as f64;
    Work {
        flops: 2.0 * rows * n * k,
        bytes: rows * k * e + kept * e + kept / 4.0 + rows * n * e + bias_bytes,
        exact: true,
    }
}

/// One 2:4 compress (`compress`) or decompress launch: no FLOPs; bytes: the dense matrix
/// (`dense_bytes`), values and metadata of `l` (`elem` bytes per value), and the 4-byte
/// bad_groups counter of compress.
pub fn compress(l: &Layout, elem: u64, dense_bytes: f64, compress: bool) -> Work {
    let kept = (l.m_pad * l.k_pad / 2) as f64;
    Work {
        flops: 0.0,
        bytes: dense_bytes + kept * elem as f64 + kept / 4.0 + if compress { 4.0 } else { 0.0 },
        exact: true,
    }
}
