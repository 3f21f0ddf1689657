//! 2:4 sparsity: argument validation of compress / decompress and of the sparse matmul (from
//! metadata alone, shared by `matmul_check` and the launches).

use super::*;

/// Largest m, k, rows, n the kernels index with 32-bit counts.
pub(super) const MAX_DIM: i64 = i32::MAX as i64 - 256;

/// The compressed layout of a (m, k) matrix; m, k >= 0 and small enough for 32-bit counts.
pub fn layout(m: i64, k: i64) -> Result<Layout> {
    for (arg, v) in [("m", m), ("k", k)] {
        if !(0..=MAX_DIM).contains(&v) {
            return Err(Error::argument(
                arg,
                format!("an integer in [0, {MAX_DIM}]"),
                v,
            ));
        }
    }
    Ok(Layout::new(m as usize, k as usize))
}

pub(super) fn check_rank2(arg: &str, t: &TensorMeta, what: &str) -> Result<()> {
    if t.strides.len() != t.shape.len() {
        return Err(Error::argument(
            arg,
            format!("{} strides", t.shape.len()),
            format!("{} strides", t.strides.len()),
        ));
    }
    if t.shape.len() != 2 {
        return Err(Error::argument(
            arg,
            format!("2 dims {what}"),
            format!("{} dims (shape {})", t.shape.len(), fmt_shape(&t.shape)),
        ));
    }
    if let Some(s) = t.shape.iter().find(|&&s| s < 0) {
        return Err(Error::argument(arg, "non-negative sizes", s));
    }
    Ok(())
}

/// Row-major contiguous (strides of size-1 dims are ignored).
pub(super) fn check_contiguous(arg: &str, t: &TensorMeta) -> Result<()> {
    let want = TensorMeta::contiguous_strides(&t.shape);
    let ok = t
        .shape
        .iter()
        .zip(t.strides.iter().zip(&want))
        .all(|(&n, (&s, &w))| n <= 1 || s == w);
    if !ok {
        return Err(Error::argument(
            arg,
            format!("a contiguous tensor (strides {want:?})"),
            format!("strides {:?} for shape {}", t.strides, fmt_shape(&t.shape)),
        ));
    }
    Ok(())
}

pub(super) fn check_16bit_float(arg: &str, t: &TensorMeta) -> Result<()> {
    if !matches!(t.dtype, DType::F16 | DType::BF16) {
        return Err(Error::dtype(arg, "float16 or bfloat16", t.dtype));
    }
    Ok(())
}

/// values and meta of a (m, k) matrix: shapes of `l`, `dtype` / int16, contiguous, on `dense`'s device.
pub(super) fn check_compressed(
    values: &TensorMeta,
    meta: &TensorMeta,
    l: &Layout,
    dtype: DType,
    dense: &str,
) -> Result<()> {
    let why = format!(" (sparse24_layout({}, {}))", l.m, l.k);
    check_rank2("values", values, "(m_pad, k_pad / 2)")?;
    check_dtype("values", values, dtype, &format!(" ({dense}'s dtype)"))?;
    let vs = l.values_shape().map(|v| v as i64);
    check_shape("values", values, &vs, &why)?;
    check_contiguous("values", values)?;
    check_rank2("meta", meta, "(m_pad / 16, k_pad)")?;
    check_dtype("meta", meta, DType::I16, "")?;
    let ms = l.meta_shape().map(|v| v as i64);
    check_shape("meta", meta, &ms, &why)?;
    check_contiguous("meta", meta)?;
    Ok(())
}

/// A dense (m, k) 16-bit matrix with stride 1 along k: w of compress, out of decompress.
pub(super) fn check_dense_matrix(arg: &str, t: &TensorMeta) -> Result<Layout> {
    check_rank2(arg, t, "(m, k)")?;
    check_16bit_float(arg, t)?;
    check_strides(arg, t)?;
    check_no_self_overlap(arg, t, "rows that do not overlap (row stride >= k)")?;
    layout(t.shape[0], t.shape[1])
}

/// [start, end) bytes spanned by a tensor with non-negative strides (empty: None).
pub(super) fn byte_span(t: &TensorView) -> Option<(u128, u128)> {
    let m = &t.meta;
    if m.shape.contains(&0) {
        return None;
    }
    let e = m.dtype.size_bytes() as u128;
    let last: u128 = m
        .shape
        .iter()
        .zip(&m.strides)
        .map(|(&n, &s)| (n.max(1) - 1) as u128 * s.max(0) as u128 * e)
        .sum();
    Some((t.ptr as u128, t.ptr as u128 + last + e))
}

/// No pair may share memory. `strict` (host reference: the tensors become Rust slices): the
/// byte spans must be disjoint; otherwise elements must be disjoint (`tensor::overlaps`, so
/// e.g. x and out may be interleaved column slices of one buffer).
pub(super) fn check_no_overlap(pairs: &[(&str, &TensorView, &str, &TensorView)], strict: bool) -> Result<()> {
    for (a, ta, b, tb) in pairs {
        let spans = match (byte_span(ta), byte_span(tb)) {
            (Some((a0, a1)), Some((b0, b1))) => a0 < b1 && b0 < a1,
            _ => false,
        };
        if spans && (strict || overlaps(ta, tb)) {
            return Err(Error::argument(
                *a,
                format!("memory that does not overlap {b}"),
                "an overlapping tensor",
            ));
        }
    }
    Ok(())
}

pub(super) fn check_device_kind(arg: &str, t: &TensorMeta, cuda: bool) -> Result<()> {
    if t.device.is_cuda() != cuda {
        let want = if cuda {
            "a CUDA tensor"
        } else {
            "a CPU tensor"
        };
        return Err(Error::device(arg, want, t.device));
    }
    Ok(())
}

/// Validate compress arguments (GPU when `cuda`, else the host reference).
pub(super) fn validate_compress(
    w: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    bad: Option<&TensorView>,
    cuda: bool,
) -> Result<Layout> {
    let l = check_dense_matrix("w", &w.meta)?;
    check_compressed(&values.meta, &meta.meta, &l, w.meta.dtype, "w")?;
    if let Some(b) = bad {
        check_dtype("bad_groups", &b.meta, DType::I32, "")?;
        check_shape("bad_groups", &b.meta, &[1], "")?;
    }
    check_device_kind("w", &w.meta, cuda)?;
    check_device("values", &values.meta, "w", &w.meta)?;
    check_device("meta", &meta.meta, "w", &w.meta)?;
    if let Some(b) = bad {
        check_device("bad_groups", &b.meta, "w", &w.meta)?;
    }
    let mut pairs = vec![
        ("values", values, "w", w),
        ("meta", meta, "w", w),
        ("meta", meta, "values", values),
    ];
    if let Some(b) = bad {
        pairs.extend([
            ("bad_groups", b, "w", w),
            ("bad_groups", b, "values", values),
            ("bad_groups", b, "meta", meta),
        ]);
    }
    check_no_overlap(&pairs, !cuda)?;
    Ok(l)
}

pub(super) fn validate_decompress(
    values: &TensorView,
    meta: &TensorView,
    out: &TensorView,
    cuda: bool,
) -> Result<Layout> {
    let l = check_dense_matrix("out", &out.meta)?;
    check_compressed(&values.meta, &meta.meta, &l, out.meta.dtype, "out")?;
    check_device_kind("out", &out.meta, cuda)?;
    check_device("values", &values.meta, "out", &out.meta)?;
    check_device("meta", &meta.meta, "out", &out.meta)?;
    check_no_overlap(
        &[("out", out, "values", values), ("out", out, "meta", meta)],
        !cuda,
    )?;
    Ok(l)
}

/// A validated sparse matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulProblem {
    pub rows: i64,
    pub n: i64,
    pub k: i64,
    pub layout: Layout,
    pub dtype: DType,
    pub activation: Activation,
    /// 0 none, 1 x's dtype, 2 float32.
    pub bias_kind: i32,
    pub device: i32,
}

/// Validate sparse24_matmul arguments from metadata alone (`out` None from Python's check
/// before it allocates).
#[allow(clippy::too_many_arguments)]
pub fn validate_matmul(
    x: &TensorMeta,
    values: &TensorMeta,
    meta: &TensorMeta,
    out: Option<&TensorMeta>,
    bias: Option<&TensorMeta>,
    n: i64,
    k: i64,
    activation: &str,
) -> Result<MatmulProblem> {
    let activation = Activation::parse("activation", activation)?;
    for (arg, v) in [("n", n), ("k", k)] {
        if !(1..=MAX_DIM).contains(&v) {
            return Err(Error::argument(
                arg,
                format!("an integer in [1, {MAX_DIM}]"),
                v,
            ));
        }
    }
    check_rank2("x", x, "(rows, k)")?;
    check_16bit_float("x", x)?;
    check_strides("x", x)?;
    let rows = x.shape[0];
    if x.shape[1] != k {
        return Err(Error::argument(
            "x",
            format!("{k} columns (k)"),
            format!("shape {}", fmt_shape(&x.shape)),
        ));
    }
    if rows > MAX_DIM {
        return Err(Error::argument(
            "x",
            format!("at most {MAX_DIM} rows"),
            rows,
        ));
    }
    let l = layout(n, k)?;
    check_compressed(values, meta, &l, x.dtype, "x")?;
    let bias_kind = match bias {
        None => 0,
        Some(b) => {
            if b.dtype != x.dtype && b.dtype != DType::F32 {
                return Err(Error::dtype(
                    "bias",
                    format!("{} (x's dtype) or float32", x.dtype),
                    b.dtype,
                ));
            }
            check_shape("bias", b, &[n], " (n,)")?;
            check_strides("bias", b)?;
            if b.dtype == DType::F32 {
                2
            } else {
                1
            }
        }
    };
    if let Some(o) = out {
        check_rank2("out", o, "(rows, n)")?;
        check_dtype("out", o, x.dtype, " (x's dtype)")?;
        check_shape("out", o, &[rows, n], " (rows, n)")?;
        check_strides("out", o)?;
        check_no_self_overlap("out", o, "rows that do not overlap (row stride >= n)")?;
    }
    if !x.device.is_cuda() {
        return Err(Error::device("x", "a CUDA tensor", x.device));
    }
    check_device("values", values, "x", x)?;
    check_device("meta", meta, "x", x)?;
    if let Some(b) = bias {
        check_device("bias", b, "x", x)?;
    }
    if let Some(o) = out {
        check_device("out", o, "x", x)?;
    }
    Ok(MatmulProblem {
        rows,
        n,
        k,
        layout: l,
        dtype: x.dtype,
        activation,
        bias_kind,
        device: x.device.id,
    })
}

