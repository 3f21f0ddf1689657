//! Argument checks shared by the op families (attention, attention backward, GEMM, 2:4
//! sparse). Each names the argument, the expected and the actual value (`Error`).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{fmt_shape, overlaps, self_overlaps, TensorMeta, TensorView};

/// Non-negative strides, and stride 1 in the last dim unless it has size <= 1.
pub(crate) fn check_strides(arg: &str, t: &TensorMeta) -> Result<()> {
    if let Some(s) = t.strides.iter().find(|&&s| s < 0) {
        return Err(Error::argument(
            arg,
            "non-negative strides",
            format!("stride {s} in {:?}", t.strides),
        ));
    }
    if t.strides.last() != Some(&1) && t.shape.last().is_some_and(|&d| d > 1) {
        return Err(Error::argument(
            arg,
            "stride 1 in the last dim",
            format!(
                "stride {} (strides {:?})",
                t.strides.last().unwrap(),
                t.strides
            ),
        ));
    }
    Ok(())
}

/// A non-empty tensor must have a data pointer.
pub(crate) fn check_not_null(arg: &str, t: &TensorView) -> Result<()> {
    if t.ptr == 0 && t.meta.shape.iter().all(|&n| n > 0) {
        return Err(Error::argument(arg, "a non-NULL data pointer", "NULL"));
    }
    Ok(())
}

/// `t` on `base`'s device (`base_arg` names it in the message).
pub(crate) fn check_device(arg: &str, t: &TensorMeta, base_arg: &str, base: &TensorMeta) -> Result<()> {
    if t.device != base.device {
        return Err(Error::device(
            arg,
            format!("a tensor on {} ({base_arg}'s device)", base.device),
            t.device,
        ));
    }
    Ok(())
}

/// dtype `want`; `why` is appended to the expected value (e.g. " (q's dtype)").
pub(crate) fn check_dtype(arg: &str, t: &TensorMeta, want: DType, why: &str) -> Result<()> {
    if t.dtype != want {
        return Err(Error::dtype(arg, format!("{want}{why}"), t.dtype));
    }
    Ok(())
}

/// shape `want`; `why` is appended to the expected value.
pub(crate) fn check_shape(arg: &str, t: &TensorMeta, want: &[i64], why: &str) -> Result<()> {
    if t.shape != want {
        return Err(Error::argument(
            arg,
            format!("shape {}{why}", fmt_shape(want)),
            format!("shape {}", fmt_shape(&t.shape)),
        ));
    }
    Ok(())
}

/// `v` (described by `what`) fits the kernels' 32-bit counts.
pub(crate) fn check_i32(arg: &str, what: &str, v: i64) -> Result<()> {
    if v > i32::MAX as i64 {
        return Err(Error::argument(arg, format!("{what} <= {}", i32::MAX), v));
    }
    Ok(())
}

/// A written tensor must not reach one element by two indices; `expected` words the rule.
pub(crate) fn check_no_self_overlap(arg: &str, t: &TensorMeta, expected: &str) -> Result<()> {
    if self_overlaps(t) {
        return Err(Error::argument(
            arg,
            expected,
            format!("strides {:?} for shape {}", t.strides, fmt_shape(&t.shape)),
        ));
    }
    Ok(())
}

/// A written tensor's rule (`check_no_self_overlap`) in the attention and GEMM messages.
pub(crate) const NO_ELEMENT_TWICE: &str = "a non-overlapping tensor (no element reachable by two indices)";

/// No written tensor may share an element with a later written tensor or with any read
/// tensor (the kernels read inputs while writing). With `say_why`, the expected value adds
/// "(it is written while X is in use)".
pub(crate) fn check_disjoint(
    writes: &[(&str, Option<&TensorView>)],
    reads: &[(&str, Option<&TensorView>)],
    say_why: bool,
) -> Result<()> {
    for (i, (wa, w)) in writes.iter().enumerate() {
        let Some(w) = w else { continue };
        for (ra, r) in writes[i + 1..].iter().chain(reads) {
            let Some(r) = r else { continue };
            if overlaps(w, r) {
                let why = if say_why {
                    format!(" (it is written while {ra} is in use)")
                } else {
                    String::new()
                };
                return Err(Error::argument(
                    *wa,
                    format!("memory that does not overlap {ra}{why}"),
                    format!(
                        "a tensor at {:#x} (shape {}, strides {:?}) overlapping {ra} at {:#x} (shape {}, strides {:?})",
                        w.ptr,
                        fmt_shape(&w.meta.shape),
                        w.meta.strides,
                        r.ptr,
                        fmt_shape(&r.meta.shape),
                        r.meta.strides
                    ),
                ));
            }
        }
    }
    Ok(())
}
