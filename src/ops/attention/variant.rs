//! The attention variant: everything an attention call computes beyond softmax(scale·q·kᵀ)·v
//! (mask, softcap, ALiBi, sinks), as one value shared by the forward and the backward.
//!
//! `AttnVariant` is what the caller gives (Python's `ferroattn.ops.variant.AttnVariant`, field by
//! field): the flash_attn arguments after flash_attn's own normalisation (a window side of
//! seqlen_k or more is already -1, causal already forces right = 0). `validate` checks it against the
//! problem and returns its compile-time part, `VariantKind` (a template argument of every
//! attention kernel, `AttnVariant<Mask, Softcap, Alibi, Sinks>` in
//! kernels/attention/variant.cuh); `fill_params` writes the run-time part into the kernel
//! parameters. `visible_pairs` is the one count of unmasked (query, key) pairs, for the FLOP
//! counts of the launch records, the op's FLOP formula and the benchmarks.
//!
//! `VariantKind` and `MaskKind` are pure descriptions that the heuristics read too: they live
//! in `tuning::variant` (tuning imports nothing from ops) and are re-exported here.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::attention::{AttnFwdParams, Problem};
use crate::ops::validate::{check_device, check_dtype, check_shape};
use crate::tensor::{fmt_shape, TensorMeta, TensorView};
pub use crate::tuning::variant::{MaskKind, VariantKind};

/// The softcaps the kernels take (`softcap` 0 = off): float32 keeps the cap, 1 / cap and
/// scale / cap normal numbers.
pub const SOFTCAP_RANGE: (f64, f64) = (1.0 / (1u64 << 60) as f64, (1u64 << 60) as f64);

/// (left, right) sides of a window in keys, None = unbounded.
pub type Window = (Option<u64>, Option<u64>);

/// A side of a window that sees every key, as the kernels take it: larger than any sequence
/// (their bounds are computed in 64 bits).
const UNBOUNDED: i32 = i32::MAX;

/// The variant of one call. `T` is `TensorMeta` (validation from metadata) or `TensorView`
/// (a launch).
#[derive(Clone, Debug)]
pub struct AttnVariant<T> {
    /// Bottom-right causal mask (forces `window_right` = 0).
    pub causal: bool,
    /// Window sides (flash_attn's `window_size`), -1 = unbounded.
    pub window_left: i64,
    pub window_right: i64,
    /// Logit softcapping c (0 = off): score = c·tanh(scale·q·k / c).
    pub softcap: f64,
    /// ALiBi slopes, fp32 (h,) or (b, h): score −= slope·|i + s_k − s_q − j|.
    pub alibi_slopes: Option<T>,
    /// Attention sinks, fp32 (h,): one logit per query head in every row's softmax.
    pub sinks: Option<T>,
    /// Dropout probability in [0, 1) (0 = off), applied to P after the softmax.
    pub dropout_p: f64,
    /// Dropout: int64 (2,) on q's device, word 0 the Philox key (word 1 unused, kept for
    /// flash_attn's (seed, offset) shape).
    pub rng_state: Option<T>,
    /// Dropout, for testing: q's dtype (b, h, rows, cols) (rows >= s_q, cols >= s_k, cols a
    /// multiple of 16, contiguous) receives exp(s − m_running), negated where dropped, and
    /// `s_dmask_max` fp32 (b, h, rows, cols / 16) the running row max (natural log) per 16 keys.
    pub s_dmask: Option<T>,
    pub s_dmask_max: Option<T>,
}

impl<T> Default for AttnVariant<T> {
    fn default() -> Self {
        AttnVariant {
            causal: false,
            window_left: -1,
            window_right: -1,
            softcap: 0.0,
            alibi_slopes: None,
            sinks: None,
            dropout_p: 0.0,
            rng_state: None,
            s_dmask: None,
            s_dmask_max: None,
        }
    }
}

impl<T> AttnVariant<T> {
    /// The plain or causal call (no window, softcap, ALiBi or sinks).
    pub fn causal(causal: bool) -> Self {
        AttnVariant { causal, ..Default::default() }
    }

    /// The same variant with its tensors mapped (e.g. views to their metadata).
    pub fn map<'a, U>(&'a self, f: impl Fn(&'a T) -> U) -> AttnVariant<U> {
        AttnVariant {
            causal: self.causal,
            window_left: self.window_left,
            window_right: self.window_right,
            softcap: self.softcap,
            alibi_slopes: self.alibi_slopes.as_ref().map(&f),
            sinks: self.sinks.as_ref().map(&f),
            dropout_p: self.dropout_p,
            rng_state: self.rng_state.as_ref().map(&f),
            s_dmask: self.s_dmask.as_ref().map(&f),
            s_dmask_max: self.s_dmask_max.as_ref().map(&f),
        }
    }

    /// (left, right) window sides in keys, None = unbounded, with `causal` folded in.
    pub fn window(&self) -> Window {
        let side = |w: i64| (w >= 0).then_some(w as u64);
        let right = if self.causal { Some(0) } else { side(self.window_right) };
        (side(self.window_left), right)
    }

    /// The mask kind: none (both sides unbounded), causal (left unbounded, right 0 through
    /// `causal` or the window), else local.
    pub fn mask(&self) -> MaskKind {
        match self.window() {
            (None, None) => MaskKind::None,
            (None, Some(0)) => MaskKind::Causal,
            _ => MaskKind::Local,
        }
    }
}

impl AttnVariant<&TensorMeta> {
    /// Checks the variant against a validated problem; returns its compile-time part.
    /// Errors name the argument: `window_size` (a side < -1), `softcap` (negative or not
    /// finite), `alibi_slopes` (fp32, q's device, (h,) or (b, h), contiguous), `sinks` (fp32,
    /// q's device, (h,), contiguous).
    pub fn validate(&self, p: &Problem, q: &TensorMeta) -> Result<VariantKind> {
        for w in [self.window_left, self.window_right] {
            if w < -1 {
                return Err(Error::argument(
                    "window_size",
                    "sides >= -1 (-1 = unbounded)",
                    format!("({}, {})", self.window_left, self.window_right),
                ));
            }
        }
        // float32 keeps the cap, 1 / cap and scale / cap normal numbers in [2^-60, 2^60]
        let cap_ok = self.softcap == 0.0 || (SOFTCAP_RANGE.0..=SOFTCAP_RANGE.1).contains(&self.softcap);
        if !cap_ok {
            return Err(Error::argument("softcap", "0 (no softcapping) or a number in [2**-60, 2**60]", self.softcap));
        }
        if let Some(a) = self.alibi_slopes {
            check_dtype("alibi_slopes", a, DType::F32, "")?;
            let ok = a.shape == [p.heads] || a.shape == [p.batch, p.heads];
            if !ok {
                return Err(Error::argument(
                    "alibi_slopes",
                    format!("shape ({},) or ({}, {}) (heads or batch x heads)", p.heads, p.batch, p.heads),
                    format!("shape {}", fmt_shape(&a.shape)),
                ));
            }
            if a.shape.last().is_some_and(|&n| n > 1) && a.strides.last() != Some(&1) {
                return Err(Error::argument(
                    "alibi_slopes",
                    "a contiguous last dim (stride 1)",
                    format!("strides {:?} for shape {}", a.strides, fmt_shape(&a.shape)),
                ));
            }
            if q.device.is_cuda() {
                check_device("alibi_slopes", a, "q", q)?;
            }
        }
        if let Some(s) = self.sinks {
            check_dtype("s_aux", s, DType::F32, "")?;
            check_shape("s_aux", s, &[p.heads], " (one logit per query head)")?;
            check_contiguous("s_aux", s)?;
            if q.device.is_cuda() {
                check_device("s_aux", s, "q", q)?;
            }
        }
        self.validate_dropout(p, q)?;
        Ok(VariantKind {
            mask: self.mask(),
            softcap: self.softcap > 0.0,
            alibi: self.alibi_slopes.is_some(),
            sinks: self.sinks.is_some(),
            dropout: self.dropout_p > 0.0,
            return_softmax: self.s_dmask.is_some(),
        })
    }

    fn validate_dropout(&self, p: &Problem, q: &TensorMeta) -> Result<()> {
        if !(self.dropout_p >= 0.0 && self.dropout_p < 1.0) {
            return Err(Error::argument("dropout_p", "a probability in [0, 1)", self.dropout_p));
        }
        let on = self.dropout_p > 0.0;
        match (on, self.rng_state) {
            (true, None) => return Err(Error::argument("rng_state", "an int64 (2,) tensor when dropout_p > 0", "None")),
            (_, Some(r)) => {
                check_dtype("rng_state", r, DType::I64, "")?;
                check_shape("rng_state", r, &[2], " (seed, offset)")?;
                check_contiguous("rng_state", r)?;
                if q.device.is_cuda() {
                    check_device("rng_state", r, "q", q)?;
                }
            }
            _ => {}
        }
        match (self.s_dmask, self.s_dmask_max) {
            (None, None) => Ok(()),
            (Some(s), Some(m)) => {
                if !on {
                    return Err(Error::argument("s_dmask", "None unless dropout_p > 0", "a tensor"));
                }
                check_dtype("s_dmask", s, q.dtype, " (q's dtype)")?;
                let (rows, cols) = (s.shape.get(2).copied().unwrap_or(0), s.shape.get(3).copied().unwrap_or(0));
                let ok = s.ndim() == 4 && s.shape[0] == p.batch && s.shape[1] == p.heads
                    && rows >= p.seqlen_q && cols >= p.seqlen_k && cols % 16 == 0;
                if !ok {
                    return Err(Error::argument(
                        "s_dmask",
                        format!("shape ({}, {}, >= {}, >= {} and a multiple of 16)", p.batch, p.heads, p.seqlen_q, p.seqlen_k),
                        format!("shape {}", fmt_shape(&s.shape)),
                    ));
                }
                check_contiguous("s_dmask", s)?;
                check_dtype("s_dmask_max", m, DType::F32, "")?;
                check_shape("s_dmask_max", m, &[p.batch, p.heads, rows, cols / 16], " (s_dmask's rows, cols / 16)")?;
                check_contiguous("s_dmask_max", m)?;
                if q.device.is_cuda() {
                    check_device("s_dmask", s, "q", q)?;
                    check_device("s_dmask_max", m, "q", q)?;
                }
                Ok(())
            }
            _ => Err(Error::argument("s_dmask_max", "given together with s_dmask", "only one of the two")),
        }
    }
}

/// Row-major contiguous (every used stride as a contiguous tensor's).
fn check_contiguous(arg: &str, t: &TensorMeta) -> Result<()> {
    let mut expected = 1;
    for (&n, &st) in t.shape.iter().zip(&t.strides).rev() {
        if n > 1 && st != expected {
            return Err(Error::argument(
                arg,
                "a contiguous tensor",
                format!("strides {:?} for shape {}", t.strides, fmt_shape(&t.shape)),
            ));
        }
        expected *= n.max(1);
    }
    Ok(())
}

impl AttnVariant<&TensorView> {
    pub fn metas(&self) -> AttnVariant<&TensorMeta> {
        self.map(|t| &t.meta)
    }

    /// The run-time part into the kernel parameters (after `AttnFwdParams::softmax_scale` is
    /// set): window sides (unbounded: larger than any sequence), softcap with the scale moved
    /// inside tanh (softmax_scale_log2 = log2(e), raw_scale = 1), ALiBi and sink pointers.
    pub fn fill_params(&self, prm: &mut AttnFwdParams) {
        let (left, right) = self.window();
        let side = |w: Option<u64>| w.map_or(UNBOUNDED, |w| w.min(UNBOUNDED as u64) as i32);
        prm.window_left = side(left);
        prm.window_right = side(right);
        let scale = prm.softmax_scale;
        if self.softcap > 0.0 {
            let cap = self.softcap as f32;
            prm.softcap = cap;
            prm.softcap_in = scale / cap;
            prm.raw_scale = 1.0;
        } else {
            prm.raw_scale = scale;
        }
        prm.raw_scale_inv = 1.0 / prm.raw_scale;
        prm.softmax_scale_log2 = prm.raw_scale * std::f32::consts::LOG2_E;
        if let Some(a) = self.alibi_slopes {
            prm.alibi_slopes = a.ptr as *const f32;
            // (b, h) slopes with any batch stride (flash_attn passes alibi.stride(0)); (h,): 0
            prm.alibi_batch_stride = if a.meta.ndim() == 2 { a.meta.strides[0] as i32 } else { 0 };
        }
        if let Some(s) = self.sinks {
            prm.sinks = s.ptr as *const f32;
        }
        if self.dropout_p > 0.0 {
            prm.dropout_threshold = dropout_threshold(self.dropout_p);
            prm.dropout_scale = (1.0 / (1.0 - self.dropout_p)) as f32;
        }
        if let Some(r) = self.rng_state {
            prm.rng_state = r.ptr as *const u64;
        }
        if let (Some(s), Some(m)) = (self.s_dmask, self.s_dmask_max) {
            prm.s_dmask = s.ptr as *mut std::ffi::c_void;
            prm.s_dmask_max = m.ptr as *mut f32;
            prm.s_dmask_rows = s.meta.shape[2] as i32;
            prm.s_dmask_cols = s.meta.shape[3] as i32;
        }
    }
}

/// The 8-bit dropout threshold of `p` (kernels/attention/variant.cuh `DropoutMask`): an element
/// is dropped iff its uniform random byte is below it, so the drop probability is
/// `dropout_threshold(p) / 256`, p rounded to a multiple of 1/256 (within 1/512 of p for
/// p < 255.5/256), as FlashAttention-2's 8-bit comparison.
pub fn dropout_threshold(p: f64) -> u32 {
    ((p * 256.0).round() as u32).min(255)
}

/// Σ_{y = c}^{c + n − 1} clamp(y, 0, s_k): the visible keys of n consecutive rows whose bound
/// is y (one side of the window).
fn clamped_sum(c: i128, n: i128, s_k: i128) -> i128 {
    // P(y) = Σ_{z = 0}^{y − 1} clamp(z, 0, s_k) for y >= 0.
    let prefix = |y: i128| -> i128 {
        let y = y.max(0);
        if y <= s_k + 1 {
            y * (y - 1) / 2
        } else {
            s_k * (s_k + 1) / 2 + (y - s_k - 1) * s_k
        }
    };
    prefix(c + n) - prefix(c)
}

/// (query, key) pairs of one (batch, head) that the window shows: row i (0-based) sees keys
/// [i + s_k − s_q − left, i + s_k − s_q + right] ∩ [0, s_k), a side None = unbounded (causal:
/// right = Some(0), left None). Closed form: with d = s_k − s_q, row i sees
/// clamp(i + d + right + 1, 0, s_k) − clamp(i + d − left, 0, s_k) keys.
pub fn visible_pairs(s_q: u64, s_k: u64, window: Window) -> u128 {
    if s_q == 0 || s_k == 0 {
        return 0;
    }
    let (sq, sk) = (s_q as i128, s_k as i128);
    let d = sk - sq;
    let hi = match window.1 {
        Some(r) => clamped_sum(d + r as i128 + 1, sq, sk),
        None => sq * sk,
    };
    let lo = match window.0 {
        Some(l) => clamped_sum(d - l as i128, sq, sk),
        None => 0,
    };
    (hi - lo).max(0) as u128
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropout_threshold_rounds_p_to_a_byte() {
        assert_eq!(dropout_threshold(0.0), 0);
        assert_eq!(dropout_threshold(0.1), 26); // 25.6
        assert_eq!(dropout_threshold(0.5), 128);
        assert_eq!(dropout_threshold(0.999), 255); // clamped: 255.74
        for k in 0..1000 {
            let p = k as f64 / 1000.0;
            let t = dropout_threshold(p);
            assert!(t <= 255);
            if p < 255.5 / 256.0 {
                assert!((t as f64 / 256.0 - p).abs() <= 1.0 / 512.0 + 1e-12, "p {p}: {t}");
            }
        }
    }

    fn brute(s_q: u64, s_k: u64, (l, r): Window) -> u128 {
        let mut n = 0;
        for i in 0..s_q as i64 {
            let diag = i + s_k as i64 - s_q as i64;
            for j in 0..s_k as i64 {
                let right_ok = r.is_none_or(|r| j <= diag + r as i64);
                let left_ok = l.is_none_or(|l| j >= diag - l as i64);
                if right_ok && left_ok {
                    n += 1;
                }
            }
        }
        n
    }

    #[test]
    fn visible_pairs_match_a_brute_force_count() {
        let sides = [None, Some(0), Some(1), Some(3), Some(7), Some(40)];
        for s_q in [0, 1, 2, 5, 17, 33] {
            for s_k in [0, 1, 3, 5, 16, 40] {
                for l in sides {
                    for r in sides {
                        assert_eq!(visible_pairs(s_q, s_k, (l, r)), brute(s_q, s_k, (l, r)), "{s_q} {s_k} {l:?} {r:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_window_costs_its_visible_pairs() {
        // a 4k window at 32k keys (causal): about 1/4 of causal's pairs
        let causal = visible_pairs(32768, 32768, (None, Some(0)));
        let window = visible_pairs(32768, 32768, (Some(4095), Some(0)));
        assert_eq!(causal, 32768 * 32769 / 2);
        assert_eq!(window, 4096 * 32768 - 4095 * 4096 / 2);
    }

    #[test]
    fn masks_from_the_flash_attn_arguments() {
        let v = |causal, l, r| AttnVariant::<()> { causal, window_left: l, window_right: r, ..Default::default() };
        assert_eq!(v(false, -1, -1).mask(), MaskKind::None);
        assert_eq!(v(true, -1, -1).mask(), MaskKind::Causal);
        assert_eq!(v(false, -1, 0).mask(), MaskKind::Causal);
        assert_eq!(v(true, 5, -1).mask(), MaskKind::Local);
        assert_eq!(v(true, 5, -1).window(), (Some(5), Some(0)));
        assert_eq!(v(false, -1, 3).mask(), MaskKind::Local);
        assert_eq!(v(false, 2, -1).window(), (Some(2), None));
    }
}
