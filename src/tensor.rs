//! The only tensor description inside the crate: shape, strides (in elements), dtype and
//! device ([`TensorMeta`]), plus the data pointer for a real tensor ([`TensorView`]).
//! Neither owns memory; the caller keeps the data alive (DLPack import, Python object).

use crate::dtype::DType;

/// DLPack device type codes we name (api-contracts §5.1).
pub const DL_CPU: i32 = 1;
pub const DL_CUDA: i32 = 2;

/// A DLPack device: (device type, ordinal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    pub kind: i32,
    pub id: i32,
}

impl Device {
    pub const CPU: Device = Device {
        kind: DL_CPU,
        id: 0,
    };

    pub fn cuda(id: i32) -> Device {
        Device { kind: DL_CUDA, id }
    }

    pub fn is_cuda(&self) -> bool {
        self.kind == DL_CUDA
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            DL_CPU => write!(f, "cpu"),
            DL_CUDA => write!(f, "cuda:{}", self.id),
            3 => write!(f, "cuda_host:{}", self.id),
            13 => write!(f, "cuda_managed:{}", self.id),
            k => write!(f, "dlpack_device({k}):{}", self.id),
        }
    }
}

/// Tensor metadata without data (also what `attn_fwd_check` receives for fake tensors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    pub shape: Vec<i64>,
    /// In elements, one per dim (never absent: importers fill C-contiguous strides).
    pub strides: Vec<i64>,
    pub dtype: DType,
    pub device: Device,
}

impl TensorMeta {
    /// From the parts Python passes as `TensorMeta`: (shape, strides, dtype name, (dl type, id)).
    /// `expected` describes the dtypes the caller accepts; it is the error message's "expected"
    /// when `dtype` is not a dtype ferroattn knows at all (e.g. float8, complex).
    pub fn from_parts(
        arg: &str,
        shape: Vec<i64>,
        strides: Vec<i64>,
        dtype: &str,
        device: (i32, i32),
        expected: &str,
    ) -> crate::Result<Self> {
        let dtype = DType::from_name(dtype)
            .ok_or_else(|| crate::Error::dtype(arg, expected, format!("{dtype:?}")))?;
        Ok(TensorMeta {
            shape,
            strides,
            dtype,
            device: Device {
                kind: device.0,
                id: device.1,
            },
        })
    }

    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }

    /// Row-major strides for `shape`.
    pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
        let mut strides = vec![0; shape.len()];
        let mut acc = 1i64;
        for i in (0..shape.len()).rev() {
            strides[i] = acc;
            acc = acc.saturating_mul(shape[i].max(1));
        }
        strides
    }
}

/// A tensor the kernels may read or write: metadata plus the address of element 0
/// (DLPack `data + byte_offset`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorView {
    pub meta: TensorMeta,
    pub ptr: u64,
}

/// True when some element (index vector) of a tensor may share memory with another of the same
/// tensor. Exact for "nested" layouts (every used stride at least the extent of the dims with
/// smaller strides: contiguous tensors, their permutations and slices such as one part of a
/// packed qkv buffer); any other layout with a used dim of stride 0 or interleaved strides is
/// reported as overlapping. Negative strides are not handled (callers reject them first).
pub fn self_overlaps(t: &TensorMeta) -> bool {
    let mut dims: Vec<(i64, i64)> = t
        .strides
        .iter()
        .zip(&t.shape)
        .filter(|(_, &n)| n > 1)
        .map(|(&s, &n)| (s, n))
        .collect();
    if t.shape.contains(&0) {
        return false;
    }
    dims.sort_unstable();
    let mut extent: i128 = 1; // one past the largest offset reached by the dims so far
    for (s, n) in dims {
        if (s as i128) < extent {
            return true;
        }
        extent += (n as i128 - 1) * s as i128;
    }
    false
}

/// Whether two tensors share at least one byte. Byte ranges are compared first; when they
/// intersect (e.g. dq, dk, dv as interleaved slices of one packed buffer) the question is
/// answered exactly by searching for an integer solution of
/// `ptr_a + Σ i·stride_a·size_a + u = ptr_b + Σ j·stride_b·size_b + w` (indices within the
/// shapes, u / w bytes within an element), largest stride first with interval pruning: a few
/// nodes for nested layouts. If the search exceeds its budget (pathological layouts) the answer
/// is "no overlap": the caller's promise is then trusted. Strides must be non-negative.
pub fn overlaps(a: &TensorView, b: &TensorView) -> bool {
    fn byte_range(t: &TensorView) -> Option<(i128, i128)> {
        let m = &t.meta;
        if m.shape.contains(&0) {
            return None;
        }
        let e = m.dtype.size_bytes() as i128;
        let last: i128 = m
            .shape
            .iter()
            .zip(&m.strides)
            .map(|(&n, &s)| (n as i128 - 1) * s as i128 * e)
            .sum();
        Some((t.ptr as i128, t.ptr as i128 + last + e))
    }
    let (Some((a_lo, a_hi)), Some((b_lo, b_hi))) = (byte_range(a), byte_range(b)) else {
        return false;
    };
    if a_hi <= b_lo || b_hi <= a_lo {
        return false;
    }
    // Terms (byte stride, lowest coefficient, highest coefficient); b's enter negated.
    let mut terms: Vec<(i128, i128, i128)> = Vec::new();
    let mut add = |stride: i128, lo: i128, hi: i128| {
        if stride == 0 || lo == hi {
            return;
        }
        match terms.iter_mut().find(|t| t.0 == stride) {
            Some(t) => {
                t.1 += lo;
                t.2 += hi;
            }
            None => terms.push((stride, lo, hi)),
        }
    };
    for (t, sign) in [(a, 1i128), (b, -1i128)] {
        let e = t.meta.dtype.size_bytes() as i128;
        for (&n, &s) in t.meta.shape.iter().zip(&t.meta.strides) {
            let span = n as i128 - 1;
            if sign > 0 {
                add(s as i128 * e, 0, span);
            } else {
                add(s as i128 * e, -span, 0);
            }
        }
        if sign > 0 {
            add(1, 0, e - 1);
        } else {
            add(1, -(e - 1), 0);
        }
    }
    terms.sort_unstable_by_key(|t| std::cmp::Reverse(t.0));
    // suffix[i] = (min, max) reachable by terms[i..]
    let mut suffix = vec![(0i128, 0i128); terms.len() + 1];
    for i in (0..terms.len()).rev() {
        let (s, lo, hi) = terms[i];
        suffix[i] = (suffix[i + 1].0 + lo * s, suffix[i + 1].1 + hi * s);
    }
    fn search(
        terms: &[(i128, i128, i128)],
        suffix: &[(i128, i128)],
        i: usize,
        rest: i128,
        budget: &mut u32,
    ) -> Option<bool> {
        if i == terms.len() {
            return Some(rest == 0);
        }
        if *budget == 0 {
            return None;
        }
        *budget -= 1;
        let (s, lo, hi) = terms[i];
        let (rmin, rmax) = suffix[i + 1];
        // rest - c·s must lie in [rmin, rmax]
        let c_lo = lo.max((rest - rmax).div_euclid(s) + ((rest - rmax).rem_euclid(s) != 0) as i128);
        let c_hi = hi.min((rest - rmin).div_euclid(s));
        let mut c = c_lo;
        while c <= c_hi {
            match search(terms, suffix, i + 1, rest - c * s, budget) {
                Some(false) => {}
                other => return other,
            }
            c += 1;
        }
        Some(false)
    }
    let mut budget = 100_000;
    search(
        &terms,
        &suffix,
        0,
        b.ptr as i128 - a.ptr as i128,
        &mut budget,
    )
    .unwrap_or(false)
}

/// Render a shape like Python does: `(2, 3)`, `(5,)`.
pub fn fmt_shape(shape: &[i64]) -> String {
    match shape {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_are_row_major() {
        assert_eq!(TensorMeta::contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(TensorMeta::contiguous_strides(&[]), Vec::<i64>::new());
        assert_eq!(TensorMeta::contiguous_strides(&[0, 3]), vec![3, 1]);
    }

    fn view(ptr: u64, shape: &[i64], strides: &[i64], dtype: DType) -> TensorView {
        TensorView {
            meta: TensorMeta {
                shape: shape.to_vec(),
                strides: strides.to_vec(),
                dtype,
                device: Device::cuda(0),
            },
            ptr,
        }
    }

    #[test]
    fn self_overlap() {
        let m = |shape: &[i64], strides: &[i64]| view(0, shape, strides, DType::F16).meta;
        assert!(!self_overlaps(&m(&[2, 3, 4], &[12, 4, 1])));
        assert!(!self_overlaps(&m(&[2, 3, 4], &[4, 8, 1]))); // permuted
        assert!(!self_overlaps(&m(&[2, 5, 4, 8], &[480, 96, 8, 1]))); // q part of packed qkv
        assert!(!self_overlaps(&m(&[1, 3, 4], &[0, 4, 1]))); // size-1 dims are never used
        assert!(!self_overlaps(&m(&[0, 3, 4], &[0, 0, 0]))); // empty
        assert!(self_overlaps(&m(&[2, 3, 4], &[0, 4, 1]))); // broadcast
        assert!(self_overlaps(&m(&[2, 3, 4], &[12, 2, 1]))); // rows overlap
    }

    #[test]
    fn cross_overlap() {
        use DType::{F16, F32};
        // dq, dk, dv: interleaved slices of one packed (b, s, 3, h, d) gradient
        let (b, s, h, d) = (2i64, 5i64, 4i64, 8i64);
        let st = [s * 3 * h * d, 3 * h * d, d, 1];
        let base = 0x10000u64;
        let dq = view(base, &[b, s, h, d], &st, F16);
        let dk = view(base + (h * d * 2) as u64, &[b, s, h, d], &st, F16);
        let dv = view(base + (2 * h * d * 2) as u64, &[b, s, h, d], &st, F16);
        assert!(!overlaps(&dq, &dk) && !overlaps(&dk, &dv) && !overlaps(&dq, &dv));
        assert!(overlaps(&dq, &dq));
        // shifted by one element: the last element of each q row meets dk's first
        let dk1 = view(base + (h * d * 2 - 2) as u64, &[b, s, h, d], &st, F16);
        assert!(overlaps(&dq, &dk1));
        // a fp32 tensor whose first element straddles the end of a fp16 row
        let f = view(base + (d * 2 - 2) as u64, &[1], &[1], F32);
        assert!(overlaps(&dq, &f) && overlaps(&f, &dq));
        // disjoint ranges
        let far = view(
            base + 1_000_000,
            &[b, s, h, d],
            &[s * h * d, h * d, d, 1],
            F16,
        );
        assert!(!overlaps(&dq, &far));
        // an empty tensor overlaps nothing
        assert!(!overlaps(&dq, &view(base, &[0, 3], &[3, 1], F16)));
        // a transposed view of the same memory
        let t = view(base, &[b, h, s, d], &[st[0], st[2], st[1], 1], F16);
        assert!(overlaps(&dq, &t));
        // a small contiguous tensor in the gap between dq's first and second row: no overlap;
        // moved half a row back: overlap
        let gap = view(base + (h * d * 2) as u64, &[4, 8], &[8, 1], F16);
        assert!(!overlaps(&dq, &gap));
        let half = view(base + (h * d) as u64, &[4, 8], &[8, 1], F16);
        assert!(overlaps(&dq, &half));
    }

    #[test]
    fn formatting() {
        assert_eq!(fmt_shape(&[5]), "(5,)");
        assert_eq!(fmt_shape(&[2, 3]), "(2, 3)");
        assert_eq!(Device::cuda(1).to_string(), "cuda:1");
        assert_eq!(Device::CPU.to_string(), "cpu");
    }
}
