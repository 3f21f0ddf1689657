//! The one-call eager forward: which `flash_attn_func` calls may skip the Python layer's
//! argument handling and launch from a single native call (`_native.attn_fwd_fast`), and what
//! that call launches.
//!
//! The rule is a subset, never a second set of rules: a call is taken only when every argument
//! is already in the normal form the Python path would produce without a copy, a pad or a
//! change of route, so both routes launch the same kernel with the same parameters. Anything
//! else — an unusual type, a variant, a pad, a misaligned view, a decode-shaped call, an empty
//! or invalid tensor — is declined (None) and the caller runs the Python path, which owns the
//! argument checks and their error messages.
//!
//! Taken here (on the tensors' views): padded q (b, s_q, h, d), k and v (b, s_k, h_k, d), all
//! non-empty, of one 16-bit dtype on one CUDA device; h a multiple of h_k; d a multiple of 8 in
//! 8..=256 (no pad); every tensor tile-aligned (`ops::_to_native.tile_aligned`'s rule: the data
//! pointer and the strides of dims of size > 1 multiples of 16 bytes, stride(-1) == 1). The
//! route is the Python path's: decode-shaped calls (`tuning::attention_kvcache::use_kvcache_path`)
//! take the kv-cache kernel with its split count (`kvcache::plan_splits`, num_splits 0), the rest
//! the forward kernel; `causal` is dropped at s_q == 1 (flash_attn's rule, ops/variant.py
//! `AttnVariant.from_flash_attn`: a no-op mask there). The binding (src/python/attention_fast.rs)
//! checks the Python side: exact argument types, the values of the plain variant (no dropout,
//! window, softcap, ALiBi, sinks, returned softmax), a positive scale finite in fp32, and the
//! eager rule of `ops/_eager.py`.

use crate::dtype::DType;
use crate::error::Result;
use crate::ops::attention::VariantKind;
use crate::tensor::TensorView;
use crate::tuning::attention_kvcache::use_kvcache_path;

/// Which kernel a taken call launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastRoute {
    /// The attention forward (`attn_fwd`).
    Dense,
    /// The kv-cache kernel over k / v as a contiguous cache of s_k rows, `splits` key splits
    /// (> 1: fp32 partials o_accum (splits, b, h, s_q, d) and lse_accum (splits, b, h, s_q)).
    Decode { splits: u32 },
}

/// What a taken call allocates and passes: lse (b, h, s_q) fp32, the default scale's head dim,
/// the mask after flash_attn's normalisation, the route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastForward {
    pub lse_shape: [i64; 3],
    pub head_dim: i64,
    pub causal: bool,
    pub route: FastRoute,
}

/// The pointer and strides of `t` as the kernels read rows in place (module docs).
fn tile_aligned(t: &TensorView) -> bool {
    let elem = t.meta.dtype.size_bytes() as i64;
    let m = &t.meta;
    t.ptr % 16 == 0
        && m.strides.last() == Some(&1)
        && m.shape.iter().zip(&m.strides).rev().skip(1).all(|(&n, &s)| n <= 1 || (s * elem) % 16 == 0)
}

/// The call the one-call forward launches for q, k, v (module docs), or None to decline.
/// `splits(b, s_q, h, h_k, s_k, d)` plans a decode route's key splits
/// (`kvcache::plan_splits` on the call's device; a parameter so that the rule is testable
/// without a GPU).
pub fn fast_forward(q: &TensorView, k: &TensorView, v: &TensorView, causal: bool,
                    splits: impl FnOnce(i64, i64, i64, i64, i64, i64) -> Result<u32>) -> Result<Option<FastForward>> {
    let Some((b, s_q, h, h_k, s_k, d)) = fast_sizes(q, k, v) else { return Ok(None) };
    let causal = causal && s_q != 1;
    let kind = if causal { VariantKind::CAUSAL } else { VariantKind::PLAIN };
    let route = if use_kvcache_path(s_q as u64, (h / h_k) as u64, s_k as u64, kind) {
        FastRoute::Decode { splits: splits(b, s_q, h, h_k, s_k, d)? }
    } else {
        FastRoute::Dense
    };
    Ok(Some(FastForward { lse_shape: [b, h, s_q], head_dim: d, causal, route }))
}

/// (b, s_q, h, h_k, s_k, d) of a call whose layout the one-call forward takes, else None.
fn fast_sizes(q: &TensorView, k: &TensorView, v: &TensorView) -> Option<(i64, i64, i64, i64, i64, i64)> {
    let (qm, km, vm) = (&q.meta, &k.meta, &v.meta);
    if qm.shape.len() != 4 || km.shape.len() != 4 || km.shape != vm.shape {
        return None;
    }
    if !matches!(qm.dtype, DType::F16 | DType::BF16) || km.dtype != qm.dtype || vm.dtype != qm.dtype {
        return None;
    }
    if !qm.device.is_cuda() || km.device != qm.device || vm.device != qm.device {
        return None;
    }
    let (b, s_q, h, d) = (qm.shape[0], qm.shape[1], qm.shape[2], qm.shape[3]);
    let (s_k, h_k) = (km.shape[1], km.shape[2]);
    if km.shape[0] != b || km.shape[3] != d || b < 1 || s_q < 1 || s_k < 1 || h_k < 1 || h % h_k != 0 {
        return None;
    }
    if d % 8 != 0 || !(8..=256).contains(&d) || s_q > i32::MAX as i64 || s_k > i32::MAX as i64 {
        return None;
    }
    if !(tile_aligned(q) && tile_aligned(k) && tile_aligned(v)) {
        return None;
    }
    Some((b, s_q, h, h_k, s_k, d))
}

/// What a taken `flash_attn_with_kvcache` call launches: the append of `s_new` tokens first (when
/// > 0), then the kv-cache kernel with `splits` key splits (fp32 partials as [`FastRoute::Decode`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastKvcache {
    pub lse_shape: [i64; 3],
    pub head_dim: i64,
    pub causal: bool,
    pub s_new: i64,
    pub splits: u32,
}

/// The one-call path of `flash_attn_with_kvcache` (module docs; src/python/attention_fast.rs checks
/// the arguments' types): q as [`fast_forward`] takes it; k_cache / v_cache one contiguous-row
/// cache (b, s_cache, h_k, d) of q's dtype, device and batch (no cache_batch_idx, leftpad or
/// pages), tile-aligned; the new k / v, when given, (b, s_new, h_k, d) with 1 <= s_new <= s_cache,
/// and then `cache_seqlens` int32 (b,) contiguous on the device (None: the whole cache, no append);
/// `num_splits` 0..=128. `splits` plans the key splits as in [`fast_forward`] (capacity s_cache).
#[allow(clippy::too_many_arguments)]
pub fn fast_kvcache(q: &TensorView, k_cache: &TensorView, v_cache: &TensorView,
                    new_kv: Option<(&TensorView, &TensorView)>, cache_seqlens: Option<&TensorView>, causal: bool,
                    num_splits: i64,
                    splits: impl FnOnce(i64, i64, i64, i64, i64, i64, i64) -> Result<u32>) -> Result<Option<FastKvcache>> {
    let Some((b, s_q, h, h_k, s_cache, d)) = fast_sizes(q, k_cache, v_cache) else { return Ok(None) };
    if k_cache.meta.shape[0] != b || !(0..=128).contains(&num_splits) {
        return Ok(None);
    }
    let s_new = match new_kv {
        None => 0,
        Some((kn, vn)) => {
            let shape = &kn.meta.shape;
            let same = |t: &TensorView| t.meta.dtype == q.meta.dtype && t.meta.device == q.meta.device && tile_aligned(t);
            if shape.len() != 4 || vn.meta.shape != *shape || shape[0] != b || shape[2] != h_k || shape[3] != d
                || !(1..=s_cache).contains(&shape[1]) || !same(kn) || !same(vn) {
                return Ok(None);
            }
            shape[1]
        }
    };
    match cache_seqlens {
        Some(sl) => {
            let m = &sl.meta;
            if m.dtype != DType::I32 || m.shape != [b] || m.device != q.meta.device || (b > 1 && m.strides[0] != 1) {
                return Ok(None);
            }
        }
        None if s_new > 0 => return Ok(None),   // the Python path names cache_seqlens
        None => {}
    }
    let causal = causal && s_q != 1;
    let splits = splits(b, s_q, h, h_k, s_cache, d, num_splits)?;
    Ok(Some(FastKvcache { lse_shape: [b, h, s_q], head_dim: d, causal, s_new, splits }))
}

/// The kernels' fp32 scale of a caller's `softmax_scale` when the one-call path may pass it
/// unchanged: positive and finite in fp32 (else None: zero, negative and overflowing scales
/// take the Python path's mapping and checks, ops/attention.py `positive_scale`).
pub fn fast_scale(softmax_scale: Option<f64>, head_dim: i64) -> Option<f64> {
    let s = softmax_scale.unwrap_or_else(|| (head_dim as f64).powf(-0.5));
    let s32 = s as f32;
    (s32.is_finite() && s32 > 0.0).then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Device, TensorMeta};

    fn view(shape: &[i64], dtype: DType, ptr: u64) -> TensorView {
        let mut strides = vec![1i64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        TensorView {
            meta: TensorMeta { shape: shape.to_vec(), strides, dtype, device: Device::cuda(0) },
            ptr,
        }
    }

    fn plan(q: &TensorView, k: &TensorView, causal: bool) -> Option<FastForward> {
        fast_forward(q, k, k, causal, |_, _, _, _, _, _| Ok(3)).unwrap()
    }

    #[test]
    fn takes_the_plain_padded_call_on_its_route() {
        let q = view(&[2, 128, 16, 64], DType::BF16, 4096);
        let k = view(&[2, 256, 4, 64], DType::BF16, 8192);
        assert_eq!(plan(&q, &k, true),
                   Some(FastForward { lse_shape: [2, 16, 128], head_dim: 64, causal: true, route: FastRoute::Dense }));
        // decode-shaped: 1 and 2 queries against 4096 keys take the kv-cache kernel; s_q == 1 drops causal
        let long_k = view(&[2, 4096, 4, 64], DType::BF16, 8192);
        for (s_q, causal) in [(1, false), (2, true)] {
            let qd = view(&[2, s_q, 16, 64], DType::BF16, 4096);
            assert_eq!(plan(&qd, &long_k, true), Some(FastForward {
                lse_shape: [2, 16, s_q], head_dim: 64, causal, route: FastRoute::Decode { splits: 3 } }));
        }
        let (one, short_k) = (view(&[2, 1, 16, 64], DType::BF16, 4096), view(&[2, 4, 4, 64], DType::BF16, 8192));
        assert_eq!(plan(&one, &short_k, true).map(|f| (f.causal, f.route)), Some((false, FastRoute::Dense)));
    }

    #[test]
    fn declines_what_the_python_path_changes_or_checks() {
        let k = view(&[2, 256, 4, 64], DType::BF16, 8192);
        let q = |shape: &[i64], dtype, ptr| view(shape, dtype, ptr);
        let cases = [
            q(&[2, 128, 16, 60], DType::BF16, 4096),   // pad to 64
            q(&[2, 128, 16, 64], DType::F32, 4096),    // dtype
            q(&[2, 128, 16, 64], DType::F16, 4096),    // dtype differs from k's
            q(&[2, 128, 16, 64], DType::BF16, 4098),   // misaligned pointer
            q(&[2, 128, 6, 64], DType::BF16, 4096),    // h not a multiple of h_k
            q(&[0, 128, 16, 64], DType::BF16, 4096),   // empty
            q(&[128, 16, 64], DType::BF16, 4096),      // varlen rank
        ];
        for c in &cases {
            assert_eq!(plan(c, &k, false), None, "{:?}", c.meta);
        }
        let q = view(&[2, 128, 16, 64], DType::BF16, 4096);
        let mut strided = view(&[2, 128, 16, 64], DType::BF16, 4096);
        strided.meta.strides[3] = 2;
        assert_eq!(plan(&strided, &k, false), None);
        let mut odd_rows = view(&[2, 128, 16, 64], DType::BF16, 4096);
        odd_rows.meta.strides[1] = 16 * 64 + 4;   // rows 8 bytes apart from 16-byte alignment
        assert_eq!(plan(&odd_rows, &k, false), None);
        let mut cpu = view(&[2, 128, 16, 64], DType::BF16, 4096);
        cpu.meta.device = Device::CPU;
        assert_eq!(plan(&cpu, &k, false), None);
        let v_other = view(&[2, 256, 4, 32], DType::BF16, 8192);
        assert_eq!(fast_forward(&q, &k, &v_other, false, |_, _, _, _, _, _| Ok(1)).unwrap(), None);
    }

    #[test]
    fn kvcache_call_takes_a_plain_contiguous_cache_with_or_without_an_append() {
        let q = view(&[2, 1, 16, 64], DType::BF16, 4096);
        let cache = view(&[2, 1024, 4, 64], DType::BF16, 8192);
        let new = view(&[2, 1, 4, 64], DType::BF16, 16384);
        let sl = view(&[2], DType::I32, 256);
        let plan = |new_kv, sl, splits| fast_kvcache(&q, &cache, &cache, new_kv, sl, true, splits,
                                                     |_, _, _, _, _, _, n| Ok(if n == 0 { 4 } else { n as u32 })).unwrap();
        assert_eq!(plan(Some((&new, &new)), Some(&sl), 0),
                   Some(FastKvcache { lse_shape: [2, 16, 1], head_dim: 64, causal: false, s_new: 1, splits: 4 }));
        assert_eq!(plan(None, None, 7).map(|f| (f.s_new, f.splits)), Some((0, 7)));
        assert_eq!(plan(Some((&new, &new)), None, 0), None);               // an append needs cache_seqlens
        assert_eq!(plan(None, Some(&sl), 129), None);                       // num_splits
        let sl64 = view(&[2], DType::I64, 256);
        assert_eq!(plan(None, Some(&sl64), 0), None);                       // cache_seqlens not int32
        let wide = view(&[2, 1, 8, 64], DType::BF16, 16384);
        assert_eq!(plan(Some((&wide, &wide)), Some(&sl), 0), None);         // new k with other heads
        let other_batch = view(&[3, 1024, 4, 64], DType::BF16, 8192);
        assert_eq!(fast_kvcache(&q, &other_batch, &other_batch, None, None, true, 0, |_, _, _, _, _, _, _| Ok(1))
                       .unwrap(), None);                                    // a cache of more rows: cache_batch_idx's case
    }

    #[test]
    fn scale_is_taken_only_positive_and_finite_in_fp32() {
        assert_eq!(fast_scale(None, 64), Some(0.125));
        assert_eq!(fast_scale(Some(0.5), 64), Some(0.5));
        for bad in [0.0, -0.125, 1e300, f64::NAN, f64::INFINITY, 1e-50] {
            assert_eq!(fast_scale(Some(bad), 64), None, "{bad}");
        }
    }
}
