use crate::ops::attention::{AttnVariant, VariantKind};
use super::*;
use crate::tensor::Device;

use crate::ops::test_support::{check_err, header_fields, t};

struct Call {
    q: TensorMeta,
    k: TensorMeta,
    v: TensorMeta,
    out: Option<TensorMeta>,
    lse: Option<TensorMeta>,
    cq: Option<TensorMeta>,
    ck: Option<TensorMeta>,
    mq: i64,
    mk: i64,
}

impl Call {
    fn padded(b: i64, sq: i64, sk: i64, h: i64, hk: i64, d: i64) -> Call {
        Call {
            q: t(&[b, sq, h, d], DType::F16),
            k: t(&[b, sk, hk, d], DType::F16),
            v: t(&[b, sk, hk, d], DType::F16),
            out: Some(t(&[b, sq, h, d], DType::F16)),
            lse: Some(t(&[b, h, sq], DType::F32)),
            cq: None,
            ck: None,
            mq: sq,
            mk: sk,
        }
    }

    fn varlen(batch: i64, tq: i64, tk: i64, h: i64, hk: i64, d: i64) -> Call {
        Call {
            q: t(&[tq, h, d], DType::BF16),
            k: t(&[tk, hk, d], DType::BF16),
            v: t(&[tk, hk, d], DType::BF16),
            out: Some(t(&[tq, h, d], DType::BF16)),
            lse: Some(t(&[h, tq], DType::F32)),
            cq: Some(t(&[batch + 1], DType::I32)),
            ck: Some(t(&[batch + 1], DType::I32)),
            mq: tq.min(7),
            mk: tk.min(9),
        }
    }

    fn run(&self) -> Result<Problem> {
        validate(
            &self.q,
            &self.k,
            &self.v,
            self.out.as_ref(),
            self.lse.as_ref(),
            self.cq.as_ref(),
            self.ck.as_ref(),
            self.mq,
            self.mk,
        )
    }
}

fn expect_err(c: &Call, kind: &str, arg: &str, parts: &[&str]) {
    check_err(c.run(), kind, arg, parts);
}

#[test]
fn params_layout_matches_header() {
    use std::mem::{align_of, offset_of, size_of};
    // 7 pointers, 14 long long, 6 int, 2 float, 2 int, then the variant, in declaration order (params.cuh).
    assert_eq!(offset_of!(AttnFwdParams, q), 0);
    assert_eq!(offset_of!(AttnFwdParams, cu_seqlens_k), 48);
    assert_eq!(offset_of!(AttnFwdParams, q_batch_stride), 56);
    assert_eq!(offset_of!(AttnFwdParams, lse_head_stride), 56 + 13 * 8);
    assert_eq!(offset_of!(AttnFwdParams, batch), 168);
    assert_eq!(offset_of!(AttnFwdParams, seqlen_k), 188);
    assert_eq!(offset_of!(AttnFwdParams, softmax_scale), 192);
    assert_eq!(offset_of!(AttnFwdParams, softmax_scale_log2), 196);
    assert_eq!(offset_of!(AttnFwdParams, total_q), 200);
    assert_eq!(offset_of!(AttnFwdParams, total_k), 204);
    // the variant's run-time part: 2 pointers, then 7 four-byte fields
    assert_eq!(offset_of!(AttnFwdParams, alibi_slopes), 208);
    assert_eq!(offset_of!(AttnFwdParams, sinks), 216);
    assert_eq!(offset_of!(AttnFwdParams, window_left), 224);
    assert_eq!(offset_of!(AttnFwdParams, raw_scale_inv), 244);
    assert_eq!(offset_of!(AttnFwdParams, alibi_batch_stride), 248);
    assert_eq!(offset_of!(AttnFwdParams, rng_state), 256);
    assert_eq!(offset_of!(AttnFwdParams, s_dmask_cols), 288);
    assert_eq!(offset_of!(AttnFwdParams, dropout_batch0), 292);
    assert_eq!(size_of::<AttnFwdParams>(), 296);
    assert_eq!(align_of::<AttnFwdParams>(), 8);
    // every field of the header is mirrored, by name, in order
    let names = header_fields("attention/params.cuh", "AttnFwdParams");
    assert_eq!(names.len(), 48, "{names:?}");
    assert_eq!(names.first(), Some(&"q"));
    assert_eq!(names.last(), Some(&"dropout_batch0"));
}

#[test]
fn params_layout_matches_nvrtc() {
    crate::ops::test_support::check_layout_with_nvrtc::<AttnFwdParams>("attention/params.cuh", "AttnFwdParams");
}

#[test]
fn valid_padded_and_varlen() {
    let p = Call::padded(2, 97, 113, 8, 2, 64).run().unwrap();
    assert_eq!(
        (p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.heads_k, p.head_dim),
        (2, 97, 113, 8, 2, 64)
    );
    assert!(!p.varlen && !p.is_empty());
    let p = Call::varlen(3, 20, 30, 4, 4, 128).run().unwrap();
    assert!(p.varlen);
    assert_eq!((p.batch, p.seqlen_q, p.seqlen_k), (3, 7, 9));
    // metadata-only check (attn_fwd_check): no out / lse
    let mut c = Call::padded(1, 1, 1, 1, 1, 8);
    c.out = None;
    c.lse = None;
    c.run().unwrap();
}

#[test]
fn empty_inputs_are_valid_and_launch_nothing() {
    assert!(Call::padded(0, 5, 5, 2, 2, 64).run().unwrap().is_empty());
    assert!(Call::padded(2, 0, 5, 2, 2, 64).run().unwrap().is_empty());
    let p = Call::padded(2, 5, 0, 2, 2, 64).run().unwrap();
    assert!(
        !p.is_empty(),
        "s_k = 0 still launches: the kernel writes 0 / +inf"
    );
    let mut c = Call::varlen(0, 0, 0, 2, 2, 64);
    c.mq = 0;
    c.mk = 0;
    assert!(c.run().unwrap().is_empty());
}

#[test]
fn dtype_errors() {
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.q.dtype = DType::F32;
    expect_err(&c, "DType", "q", &["float16 or bfloat16", "float32"]);
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.k.dtype = DType::BF16;
    expect_err(&c, "DType", "k", &["float16 (q's dtype)", "bfloat16"]);
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.out.as_mut().unwrap().dtype = DType::BF16;
    expect_err(&c, "DType", "out", &["float16", "bfloat16"]);
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.lse.as_mut().unwrap().dtype = DType::F16;
    expect_err(&c, "DType", "softmax_lse", &["float32", "float16"]);
    let mut c = Call::varlen(2, 10, 10, 2, 2, 64);
    c.cq.as_mut().unwrap().dtype = DType::I64;
    expect_err(&c, "DType", "cu_seqlens_q", &["int32", "int64"]);
}

#[test]
fn device_errors() {
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.q.device = Device::CPU;
    expect_err(&c, "Device", "q", &["CUDA", "cpu"]);
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.v.device = Device::cuda(1);
    expect_err(&c, "Device", "v", &["cuda:0", "cuda:1"]);
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.lse.as_mut().unwrap().device = Device::CPU;
    expect_err(&c, "Device", "softmax_lse", &["cuda:0", "cpu"]);
    let mut c = Call::varlen(2, 10, 10, 2, 2, 64);
    c.ck.as_mut().unwrap().device = Device::CPU;
    expect_err(&c, "Device", "cu_seqlens_k", &["cuda:0", "cpu"]);
}

#[test]
fn shape_errors() {
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.q = t(&[4, 2, 64], DType::F16);
    expect_err(&c, "Argument", "q", &["4 dims", "3 dims", "(4, 2, 64)"]);
    let mut c = Call::varlen(2, 10, 10, 2, 2, 64);
    c.k = t(&[1, 10, 2, 64], DType::BF16);
    expect_err(&c, "Argument", "k", &["3 dims", "varlen", "4 dims"]);
    let c = Call::padded(1, 4, 4, 2, 2, 100);
    expect_err(&c, "Argument", "q", &["multiple of 8", "head dim 100"]);
    let c = Call::padded(1, 4, 4, 2, 2, 264);
    expect_err(&c, "Argument", "q", &["8..=256", "264"]);
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.k = t(&[1, 4, 2, 32], DType::F16);
    c.v = t(&[1, 4, 2, 32], DType::F16);
    expect_err(&c, "Argument", "k", &["head dim 64", "head dim 32"]);
    let c = Call::padded(1, 4, 4, 6, 4, 64);
    expect_err(&c, "Argument", "k", &["divides q's 6", "4 heads"]);
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.v = t(&[1, 5, 2, 64], DType::F16);
    expect_err(
        &c,
        "Argument",
        "v",
        &["(1, 4, 2, 64) (k's shape)", "(1, 5, 2, 64)"],
    );
    let mut c = Call::padded(2, 4, 4, 2, 2, 64);
    c.k = t(&[3, 4, 2, 64], DType::F16);
    c.v = t(&[3, 4, 2, 64], DType::F16);
    expect_err(&c, "Argument", "k", &["batch size 2", "batch size 3"]);
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.out = Some(t(&[1, 4, 2, 32], DType::F16));
    expect_err(&c, "Argument", "out", &["(1, 4, 2, 64)", "(1, 4, 2, 32)"]);
    let mut c = Call::padded(2, 4, 4, 2, 2, 64);
    c.lse = Some(t(&[2, 4, 2], DType::F32));
    expect_err(
        &c,
        "Argument",
        "softmax_lse",
        &["(2, 2, 4) (batch, heads, seqlen_q)", "(2, 4, 2)"],
    );
    let mut c = Call::varlen(2, 10, 10, 3, 3, 64);
    c.lse = Some(t(&[2, 3, 5], DType::F32));
    expect_err(&c, "Argument", "softmax_lse", &["(3, 10) (heads, total_q)"]);
    // any batch up to 2^31 - 1 (the launches split it: batch.rs); beyond, q or cu_seqlens_q named
    assert_eq!(Call::padded(70000, 4, 4, 2, 2, 64).run().unwrap().batch, 70000);
    assert_eq!(Call::varlen(70000, 10, 10, 2, 2, 64).run().unwrap().batch, 70000);
    let c = Call::padded(1 << 31, 4, 4, 2, 2, 64);
    expect_err(&c, "Argument", "q", &["batch size <= 2147483647", "2147483648"]);
    let c = Call::varlen(1 << 31, 10, 10, 2, 2, 64);
    expect_err(&c, "Argument", "cu_seqlens_q", &["batch size <= 2147483647", "2147483648"]);
}

#[test]
fn stride_errors() {
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.q.strides = vec![1024, 256, 128, 2];
    expect_err(
        &c,
        "Argument",
        "q",
        &["stride 1 in the last dim", "stride 2"],
    );
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.out.as_mut().unwrap().strides[3] = 0;
    expect_err(&c, "Argument", "out", &["stride 1 in the last dim"]);
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    c.k.strides = vec![1, 2, 3];
    expect_err(&c, "Argument", "k", &["4 strides", "3 strides"]);
    // a transposed (non-contiguous) layout with unit last stride is fine
    let mut c = Call::padded(2, 4, 4, 2, 2, 64);
    c.q.strides = vec![64, 2 * 2 * 64, 2 * 64, 1];
    c.run().unwrap();
}

#[test]
fn cu_seqlens_errors() {
    let mut c = Call::varlen(2, 10, 10, 2, 2, 64);
    c.ck = None;
    expect_err(
        &c,
        "Argument",
        "cu_seqlens_k",
        &["cu_seqlens_q was given", "None"],
    );
    let mut c = Call::varlen(2, 10, 10, 2, 2, 64);
    c.ck = Some(t(&[4], DType::I32));
    expect_err(&c, "Argument", "cu_seqlens_k", &["length 3", "length 4"]);
    let mut c = Call::varlen(2, 10, 10, 2, 2, 64);
    c.cq.as_mut().unwrap().strides = vec![2];
    expect_err(&c, "Argument", "cu_seqlens_q", &["contiguous", "stride 2"]);
    let mut c = Call::varlen(2, 10, 10, 2, 2, 64);
    c.cq = Some(t(&[3, 1], DType::I32));
    expect_err(&c, "Argument", "cu_seqlens_q", &["1 dims", "2 dims"]);
    let mut c = Call::varlen(2, 10, 10, 2, 2, 64);
    c.cq = Some(t(&[0], DType::I32));
    c.ck = Some(t(&[0], DType::I32));
    expect_err(
        &c,
        "Argument",
        "cu_seqlens_q",
        &["batch + 1 >= 1", "length 0"],
    );
    let mut c = Call::varlen(2, 10, 10, 2, 2, 64);
    c.mq = 0;
    expect_err(&c, "Argument", "max_seqlen_q", &[">= 1", "got 0"]);
    let mut c = Call::varlen(2, 10, 10, 2, 2, 64);
    c.mk = -1;
    expect_err(&c, "Argument", "max_seqlen_k", &["got -1"]);
}

#[test]
fn launch_shape_and_params() {
    let arch = Arch::Sm80;
    let c = Call::padded(3, 200, 50, 8, 2, 80);
    let p = c.run().unwrap();
    let cfg = fwd_config(80, VariantKind::from_causal(true), DType::F16, arch);
    assert_eq!(cfg.head_dim, 96);
    let s = launch_shape(&p, &cfg);
    assert_eq!(s.grid, (200u32.div_ceil(cfg.block_m), 8, 3));
    assert_eq!(s.block, (cfg.num_warps * 32, 1, 1));
    assert_eq!(s.dynamic_smem_bytes, cfg.smem_bytes());
    s.check().unwrap();

    let view = |m: &TensorMeta, ptr: u64| TensorView {
        meta: m.clone(),
        ptr,
    };
    let (q, k, v) = (view(&c.q, 0x1000), view(&c.k, 0x2000), view(&c.v, 0x3000));
    let (o, l) = (
        view(c.out.as_ref().unwrap(), 0x4000),
        view(c.lse.as_ref().unwrap(), 0x5000),
    );
    let prm = params(&p, &q, &k, &v, &o, &l, None, None, 0.125, &AttnVariant::causal(false));
    assert_eq!(prm.q as u64, 0x1000);
    assert_eq!(prm.o as u64, 0x4000);
    assert!(prm.cu_seqlens_q.is_null());
    assert_eq!(
        (prm.q_batch_stride, prm.q_row_stride, prm.q_head_stride),
        (200 * 8 * 80, 8 * 80, 80)
    );
    assert_eq!(
        (prm.k_batch_stride, prm.k_row_stride, prm.k_head_stride),
        (50 * 2 * 80, 2 * 80, 80)
    );
    assert_eq!((prm.lse_batch_stride, prm.lse_head_stride), (8 * 200, 200));
    assert_eq!(
        (
            prm.batch,
            prm.num_heads,
            prm.num_heads_k,
            prm.head_dim,
            prm.seqlen_q,
            prm.seqlen_k
        ),
        (3, 8, 2, 80, 200, 50)
    );
    assert!((prm.softmax_scale_log2 - 0.125 * std::f32::consts::LOG2_E).abs() < 1e-7);

    let c = Call::varlen(2, 10, 12, 4, 2, 64);
    let p = c.run().unwrap();
    let (q, k, v) = (view(&c.q, 1), view(&c.k, 2), view(&c.v, 3));
    let (o, l) = (
        view(c.out.as_ref().unwrap(), 4),
        view(c.lse.as_ref().unwrap(), 5),
    );
    let (cq, ck) = (
        view(c.cq.as_ref().unwrap(), 6),
        view(c.ck.as_ref().unwrap(), 7),
    );
    let prm = params(&p, &q, &k, &v, &o, &l, Some(&cq), Some(&ck), 1.0, &AttnVariant::causal(false));
    assert_eq!(
        (prm.q_batch_stride, prm.q_row_stride, prm.q_head_stride),
        (0, 4 * 64, 64)
    );
    assert_eq!((prm.lse_batch_stride, prm.lse_head_stride), (0, 10));
    assert_eq!((prm.cu_seqlens_q as u64, prm.cu_seqlens_k as u64), (6, 7));
    assert_eq!((prm.seqlen_q, prm.seqlen_k, prm.batch), (7, 9, 2));
}

#[test]
fn attn_fwd_without_gpu_fails_cleanly_after_validation() {
    let c = Call::padded(1, 4, 4, 2, 2, 64);
    let view = |m: &TensorMeta| TensorView {
        meta: m.clone(),
        ptr: 0x1000,
    };
    let (q, k, v, o, l) = (
        view(&c.q),
        view(&c.k),
        view(&c.v),
        view(c.out.as_ref().unwrap()),
        view(c.lse.as_ref().unwrap()),
    );
    let r = attn_fwd(&q, &k, &v, &o, &l, None, None, 4, 4, 0.125, &AttnVariant::causal(false), 0);
    if !crate::device::cuda_available() {
        assert!(matches!(r, Err(Error::NoDevice(_))), "{r:?}");
    }
    // bad arguments are reported before any device access
    let mut bad = q.clone();
    bad.meta.dtype = DType::F32;
    assert!(matches!(
        attn_fwd(&bad, &k, &v, &o, &l, None, None, 4, 4, 0.125, &AttnVariant::causal(false), 0),
        Err(Error::DType { .. })
    ));
    // empty input: no device needed at all
    let e = Call::padded(0, 4, 4, 2, 2, 64);
    let (q, k, v, o, l) = (
        view(&e.q),
        view(&e.k),
        view(&e.v),
        view(e.out.as_ref().unwrap()),
        view(e.lse.as_ref().unwrap()),
    );
    attn_fwd(&q, &k, &v, &o, &l, None, None, 4, 4, 0.125, &AttnVariant::causal(false), 0).unwrap();
}

#[test]
fn production_specs_cover_fwd_config() {
    for arch in [Arch::Sm80, Arch::Sm90a] {
        let specs = production_specs(arch);
        for d in (8..=256).step_by(8) {
            for causal in [false, true] {
                for dtype in [DType::F16, DType::BF16] {
                    let cfg = fwd_config(d, VariantKind::from_causal(causal), dtype, arch);
                    assert!(specs.contains(&cfg), "{cfg:?} not precompiled");
                    assert!(cfg.head_dim >= d && cfg.head_dim.is_multiple_of(32));
                    assert!(
                        cfg.smem_bytes() <= 227 * 1024,
                        "{cfg:?} needs {} B smem",
                        cfg.smem_bytes()
                    );
                }
            }
        }
        assert!(specs
            .iter()
            .all(|s| s.arch == arch && (s.header() == "attention/fwd_sm80.cuh" || (arch == Arch::Sm90a && s.header() == "attention/fwd_sm90.cuh"))));
    }
    let cfg = fwd_config(64, VariantKind::from_causal(true), DType::BF16, Arch::Sm90a);
    assert_eq!(
        KernelSpec::name_expression(&cfg),
        format!(
            "ferroattn::attn_fwd_sm80<64, {}, {}, {}, {}, ferroattn::AttnVariant<1, false, false, false, false, false>, __nv_bfloat16>",
            cfg.block_m, cfg.block_n, cfg.num_warps, cfg.stages
        )
    );
}

#[test]
fn rows_must_be_16_byte_aligned() {
    let view = |ptr: u64, shape: &[i64], strides: &[i64]| TensorView {
        meta: TensorMeta {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            dtype: DType::F16,
            device: Device::cuda(0),
        },
        ptr,
    };
    // a slice of a packed head dim: a row stride of 4 * 36 elements is not 16-byte aligned
    let e = check_tile_layout("k", &view(0x1000, &[2, 5, 4, 32], &[720, 144, 36, 1])).unwrap_err();
    assert!(e.to_string().starts_with("k: ") && e.to_string().contains("stride 36"), "{e}");
    let e = check_tile_layout("q", &view(0x1008, &[2, 5, 4, 32], &[640, 128, 32, 1])).unwrap_err();
    assert!(e.to_string().contains("16-byte aligned data pointer"), "{e}");
    // strides of size-1 dims are never used, so they may be anything
    check_tile_layout("q", &view(0x1000, &[1, 1, 4, 32], &[3, 3, 32, 1])).unwrap();
}

#[test]
fn outputs_must_be_dense() {
    let mut c = Call::padded(2, 5, 5, 4, 4, 32);
    let mut o = t(&[2, 5, 4, 32], DType::F16);
    o.strides = vec![0, 128, 32, 1]; // every batch writes the same memory
    c.out = Some(o);
    expect_err(&c, "Argument", "out", &["dense, non-overlapping", "[0, 128, 32, 1]"]);
    let mut c = Call::padded(2, 5, 5, 4, 4, 32);
    let mut l = t(&[2, 4, 5], DType::F32);
    l.strides = vec![20, 4, 1]; // heads overlap
    c.lse = Some(l);
    expect_err(&c, "Argument", "softmax_lse", &["dense"]);
    // a permutation of a contiguous layout (out = empty_like of a transposed q) is fine
    let mut c = Call::padded(2, 5, 5, 4, 4, 32);
    let mut o = t(&[2, 5, 4, 32], DType::F16);
    o.strides = vec![640, 32, 160, 1];
    c.out = Some(o);
    c.run().expect("a transposed dense out is accepted");
}
