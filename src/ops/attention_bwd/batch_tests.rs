//! The backward over a batch split into launches (src/ops/attention/batch.rs): each slice's
//! grid is within the limit, and `AttnBwdParams::slice` starts every gradient at the slice's
//! first entry. Shares the forward's test call (65537 batch entries).

use super::{launch_shape as bwd_launch_shape, params, AttnBwdParams, BwdTensors};
use crate::arch::Arch;
use crate::dtype::DType;
use crate::ops::attention::batch::tests::{addr, fwd, same_fields, variant, views, B, LAST};
use crate::ops::attention::{batch_slices, AttnVariant, Problem, VariantKind};
use crate::tensor::TensorView;
use crate::tuning::attention_bwd::bwd_plan;

#[test]
fn every_slice_of_the_plan_fits_the_grid() {
    let v = views(false);
    let (p, _) = fwd(false, &v);
    for det in [false, true] {
        for c in bwd_plan(64, VariantKind::CAUSAL, det, DType::BF16, Arch::Sm80) {
            assert!(bwd_launch_shape(&p, &c).unwrap().check().is_err());
            for s in batch_slices(B) {
                let shape = bwd_launch_shape(&p.slice(s), &c).unwrap();
                shape.check().unwrap();
                assert_eq!(shape.grid.2 as i64, s.len);
            }
        }
    }
}

fn bwd(varlen: bool, v: &[TensorView], deterministic: bool) -> (Problem, AttnBwdParams) {
    let (cq, ck) = if varlen { (Some(&v[5]), Some(&v[6])) } else { (None, None) };
    let tensors = BwdTensors {
        dout: &v[11],
        q: &v[0],
        k: &v[1],
        v: &v[2],
        out: &v[3],
        softmax_lse: &v[4],
        dq: &v[12],
        dk: &v[13],
        dv: &v[14],
        softmax_d: &v[15],
        dq_accum: Some(&v[16]),
        cu_seqlens_q: cq,
        cu_seqlens_k: ck,
    };
    let (p, _) = fwd(varlen, v);
    let var = AttnVariant { s_dmask: None, s_dmask_max: None, ..variant(v) };
    let ws = (!deterministic).then_some(&v[16]);
    (p, params(&p, &tensors, ws, 0.125, &var))
}

#[test]
fn a_backward_slice_starts_the_gradients_at_its_first_entry() {
    let n = 65535u64;
    for deterministic in [false, true] {
        // padded
        let v = views(false);
        let (_, prm) = bwd(false, &v, deterministic);
        let s = prm.slice(DType::BF16, LAST);
        same_fields(&s.fwd, &prm.fwd);
        assert_eq!((s.fwd.batch, s.fwd.dropout_batch0), (2, 65535));
        assert_eq!((addr(s.fwd.q), addr(s.fwd.k), addr(s.fwd.lse)), (v[0].ptr + n * 4 * 2 * 64 * 2, v[1].ptr + n * 6 * 64 * 2, v[4].ptr + n * 2 * 4 * 4));
        assert_eq!(addr(s.dout), v[11].ptr + n * 4 * 2 * 64 * 2);
        assert_eq!(addr(s.dq), v[12].ptr + n * 4 * 2 * 64 * 2);
        assert_eq!(addr(s.dk), v[13].ptr + n * 6 * 64 * 2);
        assert_eq!(addr(s.dv), v[14].ptr + n * 6 * 64 * 2);
        assert_eq!(addr(s.softmax_d), v[15].ptr + n * 2 * 4 * 4, "softmax_d moves like lse");
        if deterministic {
            assert!(s.dq_accum.is_null(), "no workspace: stays null");
        } else {
            assert_eq!(addr(s.dq_accum), v[16].ptr + n * 4 * 2 * 64 * 4, "fp32 (b, s_q, h, d)");
        }
        assert_eq!(addr(s.fwd.alibi_slopes), v[7].ptr + n * 2 * 4);
        assert_eq!(
            (s.do_batch_stride, s.dq_row_stride, s.dk_head_stride, s.dqa_batch_stride),
            (prm.do_batch_stride, prm.dq_row_stride, prm.dk_head_stride, prm.dqa_batch_stride)
        );
        // varlen: only cu_seqlens (and the per-sequence slopes) move
        let v = views(true);
        let (_, prm) = bwd(true, &v, deterministic);
        let s = prm.slice(DType::BF16, LAST);
        same_fields(&s.fwd, &prm.fwd);
        assert_eq!(
            [addr(s.fwd.q), addr(s.fwd.lse), addr(s.dout), addr(s.dq), addr(s.dk), addr(s.dv), addr(s.softmax_d)],
            [v[0].ptr, v[4].ptr, v[11].ptr, v[12].ptr, v[13].ptr, v[14].ptr, v[15].ptr]
        );
        let dqa = if deterministic { 0 } else { v[16].ptr };
        assert_eq!(addr(s.dq_accum), dqa);
        assert_eq!((addr(s.fwd.cu_seqlens_q), addr(s.fwd.cu_seqlens_k)), (v[5].ptr + n * 4, v[6].ptr + n * 4));
        assert_eq!(addr(s.fwd.alibi_slopes), v[7].ptr + n * 2 * 4);
        assert_eq!((s.fwd.batch, s.fwd.dropout_batch0), (2, 65535));
    }
}
