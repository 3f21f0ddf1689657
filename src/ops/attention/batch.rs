//! A batch split over launches: the one home of the rule that lets an attention call have any
//! batch size although the kernels' grids put the batch on z (at most 65535 blocks,
//! `LaunchShape::check`).
//!
//! The kernels take no batch offset (one in their address arithmetic cost the dK/dV kernels
//! their last registers). Instead a call of batch b becomes launches over the slices
//! [0, 65535), [65535, 131070), … (`batch_slices`), each with a copy of the kernel parameters
//! whose per-batch pointers start at the slice's first entry (`AttnFwdParams::slice`; the
//! backward's `AttnBwdParams::slice`, src/ops/attention_bwd.rs, builds on it), and whose
//! `batch` is the slice's length:
//! - padded: every pointer advances by its tensor's batch stride times the slice start (q, k,
//!   v, o, lse; dout, dq, dk, dv, softmax_d (lse's strides), dq_accum);
//! - varlen: the batch strides are 0 and cu_seqlens_q / cu_seqlens_k advance by the slice
//!   start instead. The kernels read cu_seqlens[b] and [b + 1] and find every packed row, lse
//!   and softmax_d entry and dq_accum row from them, so the packed tensors keep their pointers
//!   (and total_q / total_k, the clamp bounds, stay the whole tensors' rows);
//! - both: ALiBi slopes advance by alibi_batch_stride (0 for (h,) slopes), S_dmask and its
//!   running max (b, h, rows, cols) and (b, h, rows, cols / 16) by whole (b) planes, and
//!   `dropout_batch0` is the slice start, so the dropout mask stays a function of the global
//!   batch index.
//!
//! Only the parameter copies differ between launches: no device allocation and no host sync
//! per slice, so a split call is captured by a CUDA graph like any other. The launch records
//! count each slice's share (`AttnSizes::slice`): a split call's records add up to the whole
//! call's FLOPs.

use crate::dtype::DType;
use crate::ops::attention::{AttnFwdParams, Problem};
use crate::ops::attention::work::AttnSizes;

/// The most batch entries one launch covers: the grid's z limit.
pub const MAX_LAUNCH_BATCH: i64 = 65535;

/// The batch entries [start, start + len) of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSlice {
    pub start: i64,
    pub len: i64,
}

impl BatchSlice {
    /// The first (and widest) slice of a batch of `batch` entries: its grid has the largest z
    /// of the call's launches.
    pub fn first(batch: i64) -> BatchSlice {
        BatchSlice { start: 0, len: batch.clamp(0, MAX_LAUNCH_BATCH) }
    }
}

/// The slices of a batch of `batch` entries, in order: they cover [0, batch) exactly, each at
/// most `MAX_LAUNCH_BATCH` long, all but the last exactly that long. None for batch <= 0.
pub fn batch_slices(batch: i64) -> impl Iterator<Item = BatchSlice> + Clone {
    (0..batch.max(0))
        .step_by(MAX_LAUNCH_BATCH as usize)
        .map(move |start| BatchSlice { start, len: (batch - start).min(MAX_LAUNCH_BATCH) })
}

/// `p` advanced by `bytes` (a null pointer stays null: an absent tensor has no slice).
pub(crate) fn advanced<T>(p: *const T, bytes: i64) -> *const T {
    if p.is_null() {
        p
    } else {
        p.wrapping_byte_offset(bytes as isize)
    }
}

pub(crate) fn advanced_mut<T>(p: *mut T, bytes: i64) -> *mut T {
    advanced(p as *const T, bytes) as *mut T
}

pub(crate) const F32_BYTES: i64 = 4;
const I32_BYTES: i64 = 4;

impl Problem {
    /// The problem one launch of slice `s` solves (its grid's batch).
    pub fn slice(&self, s: BatchSlice) -> Problem {
        Problem { batch: s.len, ..*self }
    }
}

impl AttnFwdParams {
    /// A copy for the launch over slice `s` of the call these parameters describe (batch entry
    /// 0 of the copy is entry `s.start` of the call). `dtype` is q's: the element type of q, k,
    /// v, o and S_dmask.
    pub fn slice(&self, dtype: DType, s: BatchSlice) -> AttnFwdParams {
        let e = dtype.size_bytes() as i64;
        let b = s.start;
        let (h, rows, cols) = (self.num_heads as i64, self.s_dmask_rows as i64, self.s_dmask_cols as i64);
        AttnFwdParams {
            q: advanced(self.q, b * self.q_batch_stride * e),
            k: advanced(self.k, b * self.k_batch_stride * e),
            v: advanced(self.v, b * self.v_batch_stride * e),
            o: advanced_mut(self.o, b * self.o_batch_stride * e),
            lse: advanced_mut(self.lse, b * self.lse_batch_stride * F32_BYTES),
            cu_seqlens_q: advanced(self.cu_seqlens_q, b * I32_BYTES),
            cu_seqlens_k: advanced(self.cu_seqlens_k, b * I32_BYTES),
            alibi_slopes: advanced(self.alibi_slopes, b * self.alibi_batch_stride as i64 * F32_BYTES),
            s_dmask: advanced_mut(self.s_dmask, b * h * rows * cols * e),
            s_dmask_max: advanced_mut(self.s_dmask_max, b * h * rows * (cols / 16) * F32_BYTES),
            batch: s.len as i32,
            dropout_batch0: self.dropout_batch0 + b as i32,
            ..*self
        }
    }
}

impl AttnSizes {
    /// The sizes of one launch over slice `s`: its batch entries, and its share of the query and
    /// key rows (padded: exactly len · s; varlen, where the lengths live on the device: the
    /// rows in proportion, rounded so that the slices' shares add up to the total). The pair
    /// count follows from the batch, so the slices' FLOPs add up to the whole call's.
    pub fn slice(&self, s: BatchSlice) -> AttnSizes {
        if self.batch == 0 {
            return *self;
        }
        let upto = |rows: u64, end: i64| (rows as u128 * end.max(0) as u128 / self.batch as u128) as u64;
        let share = |rows: u64| upto(rows, s.start + s.len) - upto(rows, s.start);
        AttnSizes {
            batch: s.len.max(0) as u64,
            rows_q: share(self.rows_q),
            rows_k: share(self.rows_k),
            ..*self
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn slices_cover_the_batch_exactly() {
        for batch in [0i64, 1, 2, 65534, 65535, 65536, 65537, 131069, 131070, 131071, 200_000, 1 << 20] {
            let slices: Vec<_> = batch_slices(batch).collect();
            let mut next = 0;
            for (i, s) in slices.iter().enumerate() {
                assert_eq!(s.start, next, "{batch}: slices in order, no gap, no overlap");
                assert!(s.len >= 1 && s.len <= MAX_LAUNCH_BATCH, "{batch}: {s:?}");
                if i + 1 < slices.len() {
                    assert_eq!(s.len, MAX_LAUNCH_BATCH, "{batch}: only the last slice is short");
                }
                next += s.len;
            }
            assert_eq!(next, batch);
            assert_eq!(slices.len() as u64, (batch as u64).div_ceil(MAX_LAUNCH_BATCH as u64));
            if batch > 0 {
                assert_eq!(slices[0], BatchSlice::first(batch));
            }
        }
        assert_eq!(batch_slices(-3).count(), 0);
        assert_eq!(
            batch_slices(65537).collect::<Vec<_>>(),
            [BatchSlice { start: 0, len: 65535 }, BatchSlice { start: 65535, len: 2 }]
        );
    }

    #[test]
    fn sizes_of_the_slices_add_up_to_the_call() {
        use crate::ops::attention::work::causal_window;
        let sizes = |varlen, batch: u64, rows_q: u64, rows_k: u64| AttnSizes {
            batch,
            rows_q,
            rows_k,
            seqlen_q: 3,
            seqlen_k: 5,
            heads: 2,
            heads_k: 1,
            head_dim: 64,
            elem_bytes: 2,
            varlen,
        };
        // padded: exactly len · s rows per slice
        let whole = sizes(false, 200_000, 200_000 * 3, 200_000 * 5);
        let parts: Vec<_> = batch_slices(200_000).map(|s| whole.slice(s)).collect();
        assert_eq!(parts[0], AttnSizes { batch: 65535, rows_q: 65535 * 3, rows_k: 65535 * 5, ..whole });
        assert_eq!(parts[3].batch, 200_000 - 3 * 65535);
        // varlen: the rows in proportion, adding up to the total
        let whole_v = sizes(true, 65537, 196_613, 327_689);
        let parts_v: Vec<_> = batch_slices(65537).map(|s| whole_v.slice(s)).collect();
        assert_eq!(parts_v.iter().map(|p| p.rows_q).sum::<u64>(), 196_613);
        assert_eq!(parts_v.iter().map(|p| p.rows_k).sum::<u64>(), 327_689);
        for (whole, parts) in [(whole, parts), (whole_v, parts_v)] {
            assert_eq!(parts.iter().map(|p| p.batch).sum::<u64>(), whole.batch);
            for w in [causal_window(true), causal_window(false), (Some(1), Some(2))] {
                // integer-valued FLOP counts: the sums are exact
                assert_eq!(parts.iter().map(|p| p.fwd(w).flops).sum::<f64>(), whole.fwd(w).flops);
                assert_eq!(parts.iter().map(|p| p.pairs(w)).sum::<f64>(), whole.pairs(w));
            }
        }
    }

    use crate::arch::Arch;
    use crate::ops::attention::{launch_shape, params, validate, AttnVariant, VariantKind};
    use crate::tuning::attention::fwd_config;
    use crate::ops::test_support::t;
    use crate::tensor::{TensorMeta, TensorView};

    pub(crate) const B: i64 = 65537;
    pub(crate) const LAST: BatchSlice = BatchSlice { start: 65535, len: 2 };

    /// A view of `m` at `ptr`.
    pub(crate) fn view(m: TensorMeta, ptr: u64) -> TensorView {
        TensorView { meta: m, ptr }
    }

    /// The tensors of a padded (b 65537, s_q 4, s_k 6, h 2, h_k 1, d 64) or varlen (65537
    /// sequences in 3 · 65537 query and 5 · 65537 key rows) bf16 call, at distinct addresses:
    /// q k v out lse, cu_seqlens_q/k (varlen), (b, h) ALiBi slopes, rng_state, S_dmask (rows 16,
    /// cols 32) and its max, dout dq dk dv softmax_d dq_accum.
    pub(crate) fn views(varlen: bool) -> Vec<TensorView> {
        let bf = DType::BF16;
        let metas = if varlen {
            let (tq, tk) = (3 * B, 5 * B);
            vec![t(&[tq, 2, 64], bf), t(&[tk, 1, 64], bf), t(&[tk, 1, 64], bf), t(&[tq, 2, 64], bf),
                 t(&[2, tq], DType::F32), t(&[B + 1], DType::I32), t(&[B + 1], DType::I32)]
        } else {
            vec![t(&[B, 4, 2, 64], bf), t(&[B, 6, 1, 64], bf), t(&[B, 6, 1, 64], bf), t(&[B, 4, 2, 64], bf),
                 t(&[B, 2, 4], DType::F32), t(&[0], DType::I32), t(&[0], DType::I32)]
        };
        let q = metas[0].clone();
        let (k, lse) = (metas[1].clone(), metas[4].clone());
        let rest = [
            t(&[B, 2], DType::F32),
            t(&[2], DType::I64),
            t(&[B, 2, 16, 32], bf),
            t(&[B, 2, 16, 2], DType::F32),
            q.clone(),
            q.clone(),
            k.clone(),
            k,
            lse,
            TensorMeta { dtype: DType::F32, ..q },
        ];
        metas.into_iter().chain(rest).enumerate().map(|(i, m)| view(m, (i as u64 + 1) << 40)).collect()
    }

    pub(crate) fn variant(v: &[TensorView]) -> AttnVariant<&TensorView> {
        AttnVariant {
            causal: true,
            alibi_slopes: Some(&v[7]),
            dropout_p: 0.25,
            rng_state: Some(&v[8]),
            s_dmask: Some(&v[9]),
            s_dmask_max: Some(&v[10]),
            ..Default::default()
        }
    }

    pub(crate) fn fwd(varlen: bool, v: &[TensorView]) -> (Problem, AttnFwdParams) {
        let (cq, ck) = if varlen { (Some(&v[5]), Some(&v[6])) } else { (None, None) };
        let p = validate(&v[0].meta, &v[1].meta, &v[2].meta, Some(&v[3].meta), Some(&v[4].meta),
                         cq.map(|c| &c.meta), ck.map(|c| &c.meta), 4, 6).unwrap();
        let var = variant(v);
        var.metas().validate(&p, &v[0].meta).unwrap();
        (p, params(&p, &v[0], &v[1], &v[2], &v[3], &v[4], cq, ck, 0.125, &var))
    }

    pub(crate) fn addr<T>(p: *const T) -> u64 {
        p as u64
    }

    /// The fields a slice leaves alone are the whole call's.
    pub(crate) fn same_fields(a: &AttnFwdParams, b: &AttnFwdParams) {
        assert_eq!(
            (a.q_batch_stride, a.q_row_stride, a.k_batch_stride, a.o_head_stride, a.lse_batch_stride, a.lse_head_stride),
            (b.q_batch_stride, b.q_row_stride, b.k_batch_stride, b.o_head_stride, b.lse_batch_stride, b.lse_head_stride)
        );
        assert_eq!(
            (a.num_heads, a.num_heads_k, a.head_dim, a.seqlen_q, a.seqlen_k, a.total_q, a.total_k),
            (b.num_heads, b.num_heads_k, b.head_dim, b.seqlen_q, b.seqlen_k, b.total_q, b.total_k)
        );
        assert_eq!((a.alibi_batch_stride, a.s_dmask_rows, a.s_dmask_cols, a.dropout_threshold), (b.alibi_batch_stride, b.s_dmask_rows, b.s_dmask_cols, b.dropout_threshold));
        assert_eq!((addr(a.sinks), addr(a.rng_state)), (addr(b.sinks), addr(b.rng_state)));
        assert_eq!((a.softmax_scale, a.window_left, a.window_right), (b.softmax_scale, b.window_left, b.window_right));
    }

    #[test]
    fn a_padded_slice_starts_every_per_batch_pointer_at_its_first_entry() {
        let v = views(false);
        let (p, prm) = fwd(false, &v);
        assert_eq!(p.batch, B);
        let first = prm.slice(DType::BF16, BatchSlice::first(B));
        assert_eq!((first.batch, first.dropout_batch0), (65535, 0));
        assert_eq!((addr(first.q), addr(first.s_dmask), addr(first.alibi_slopes)), (v[0].ptr, v[9].ptr, v[7].ptr));
        let s = prm.slice(DType::BF16, LAST);
        same_fields(&s, &prm);
        assert_eq!((s.batch, s.dropout_batch0), (2, 65535));
        let n = 65535u64;
        // bf16 q, k, v, out (b, s, h, d): batch strides s · h · 64 elements of 2 bytes
        assert_eq!(addr(s.q), v[0].ptr + n * 4 * 2 * 64 * 2);
        assert_eq!(addr(s.k), v[1].ptr + n * 6 * 64 * 2);
        assert_eq!(addr(s.v), v[2].ptr + n * 6 * 64 * 2);
        assert_eq!(addr(s.o), v[3].ptr + n * 4 * 2 * 64 * 2);
        // fp32 lse (b, h, s_q)
        assert_eq!(addr(s.lse), v[4].ptr + n * 2 * 4 * 4);
        assert!(s.cu_seqlens_q.is_null() && s.cu_seqlens_k.is_null());
        // fp32 (b, h) slopes; bf16 S_dmask (b, h, 16, 32) and its fp32 max (b, h, 16, 2)
        assert_eq!(addr(s.alibi_slopes), v[7].ptr + n * 2 * 4);
        assert_eq!(addr(s.s_dmask), v[9].ptr + n * 2 * 16 * 32 * 2);
        assert_eq!(addr(s.s_dmask_max), v[10].ptr + n * 2 * 16 * 2 * 4);
        // the grid of each launch: the whole batch is beyond the grid, every slice within it
        assert_eq!(p.slice(LAST).batch, 2);
        let cfg = fwd_config(64, VariantKind::CAUSAL, DType::BF16, Arch::Sm80);
        assert!(launch_shape(&p, &cfg).check().is_err());
        let grids: Vec<_> = batch_slices(B).map(|s| launch_shape(&p.slice(s), &cfg).grid).collect();
        assert_eq!(grids, [(1, 2, 65535), (1, 2, 2)]);
        // (h,) slopes are shared by every batch entry: no offset
        let mut var = variant(&v);
        let h_slopes = view(t(&[2], DType::F32), 0x77 << 40);
        var.alibi_slopes = Some(&h_slopes);
        let prm = params(&p, &v[0], &v[1], &v[2], &v[3], &v[4], None, None, 0.125, &var);
        assert_eq!(addr(prm.slice(DType::BF16, LAST).alibi_slopes), 0x77 << 40);
    }

    #[test]
    fn a_varlen_slice_advances_cu_seqlens_only() {
        let v = views(true);
        let (p, prm) = fwd(true, &v);
        assert!(p.varlen && p.batch == B);
        let s = prm.slice(DType::BF16, LAST);
        same_fields(&s, &prm);
        assert_eq!((s.batch, s.dropout_batch0), (2, 65535));
        // packed tensors: the kernels find their rows through cu_seqlens[b], [b + 1]
        assert_eq!([addr(s.q), addr(s.k), addr(s.v), addr(s.o), addr(s.lse)], [v[0].ptr, v[1].ptr, v[2].ptr, v[3].ptr, v[4].ptr]);
        assert_eq!((s.total_q, s.total_k), (3 * B as i32, 5 * B as i32));
        // int32 cu_seqlens: entries 65535 and 65536 (and 65537, read as [b + 1]) of the call's
        assert_eq!((addr(s.cu_seqlens_q), addr(s.cu_seqlens_k)), (v[5].ptr + 65535 * 4, v[6].ptr + 65535 * 4));
        // per-sequence tensors still move by whole batch entries
        assert_eq!(addr(s.alibi_slopes), v[7].ptr + 65535 * 2 * 4);
        assert_eq!(addr(s.s_dmask), v[9].ptr + 65535 * 2 * 16 * 32 * 2);
        assert_eq!(addr(s.s_dmask_max), v[10].ptr + 65535 * 2 * 16 * 2 * 4);
    }
}
