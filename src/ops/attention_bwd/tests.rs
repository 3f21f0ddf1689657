use crate::ops::attention::{AttnVariant, VariantKind};
use super::*;
use crate::tensor::Device;
use crate::tuning::attention_bwd::BwdKind;

use crate::ops::test_support::{check_err, header_fields, t};

/// One backward call's metadata; every tensor contiguous on cuda:0.
#[derive(Clone)]
struct Call {
    dout: TensorMeta,
    q: TensorMeta,
    k: TensorMeta,
    v: TensorMeta,
    out: TensorMeta,
    lse: TensorMeta,
    dq: TensorMeta,
    dk: TensorMeta,
    dv: TensorMeta,
    d: TensorMeta,
    dq_accum: Option<TensorMeta>,
    cq: Option<TensorMeta>,
    ck: Option<TensorMeta>,
    mq: i64,
    mk: i64,
    deterministic: bool,
}

impl Call {
    /// Every tensor derived from q, k and lse: dout, out, dq and dq_accum (fp32) like q; v, dk
    /// and dv like k; softmax_d like lse. `cu` is both cu_seqlens (varlen) or None (padded).
    fn new(q: TensorMeta, k: TensorMeta, lse: TensorMeta, cu: Option<TensorMeta>, mq: i64, mk: i64) -> Call {
        let dq_accum = TensorMeta { dtype: DType::F32, ..q.clone() };
        Call {
            dout: q.clone(),
            out: q.clone(),
            dq: q.clone(),
            dk: k.clone(),
            dv: k.clone(),
            d: lse.clone(),
            dq_accum: Some(dq_accum),
            v: k.clone(),
            q,
            k,
            lse,
            cq: cu.clone(),
            ck: cu,
            mq,
            mk,
            deterministic: false,
        }
    }

    fn padded(b: i64, sq: i64, sk: i64, h: i64, hk: i64, d: i64) -> Call {
        let (q, k) = (t(&[b, sq, h, d], DType::F16), t(&[b, sk, hk, d], DType::F16));
        Call::new(q, k, t(&[b, h, sq], DType::F32), None, sq, sk)
    }

    fn varlen(batch: i64, tq: i64, tk: i64, h: i64, hk: i64, d: i64) -> Call {
        let (q, k) = (t(&[tq, h, d], DType::BF16), t(&[tk, hk, d], DType::BF16));
        Call::new(q, k, t(&[h, tq], DType::F32), Some(t(&[batch + 1], DType::I32)), tq.min(7), tk.min(9))
    }

    fn grads(&self) -> GradsMeta<'_> {
        GradsMeta {
            dq: &self.dq,
            dk: &self.dk,
            dv: &self.dv,
            softmax_d: &self.d,
            dq_accum: self.dq_accum.as_ref(),
            deterministic: self.deterministic,
        }
    }

    /// `attn_bwd_check` (with_grads false) or the full validation of `attn_bwd`.
    fn run_with(&self, with_grads: bool) -> Result<Problem> {
        let g = self.grads();
        validate(
            &self.dout,
            &self.q,
            &self.k,
            &self.v,
            &self.out,
            &self.lse,
            self.cq.as_ref(),
            self.ck.as_ref(),
            self.mq,
            self.mk,
            with_grads.then_some(&g),
        )
    }

    fn run(&self) -> Result<Problem> {
        self.run_with(true)
    }

    /// Views at distinct, far-apart 256-byte aligned addresses.
    fn views(&self) -> Vec<TensorView> {
        let metas = [
            &self.dout, &self.q, &self.k, &self.v, &self.out, &self.lse, &self.dq, &self.dk,
            &self.dv, &self.d,
        ];
        let mut v: Vec<TensorView> = metas
            .iter()
            .enumerate()
            .map(|(i, m)| TensorView {
                meta: (*m).clone(),
                ptr: 0x1000_0000 * (i as u64 + 1),
            })
            .collect();
        for (i, m) in [&self.dq_accum, &self.cq, &self.ck].into_iter().enumerate() {
            let meta = m.clone().unwrap_or_else(|| t(&[0], DType::F32));
            v.push(TensorView {
                meta,
                ptr: 0x1000_0000 * (i as u64 + 11),
            });
        }
        v
    }

    /// The tensors of `views` (as made by `views()`): the optional ones where this call has them.
    fn tensors<'a>(&self, views: &'a [TensorView]) -> BwdTensors<'a> {
        BwdTensors {
            dout: &views[0],
            q: &views[1],
            k: &views[2],
            v: &views[3],
            out: &views[4],
            softmax_lse: &views[5],
            dq: &views[6],
            dk: &views[7],
            dv: &views[8],
            softmax_d: &views[9],
            dq_accum: self.dq_accum.as_ref().map(|_| &views[10]),
            cu_seqlens_q: self.cq.as_ref().map(|_| &views[11]),
            cu_seqlens_k: self.ck.as_ref().map(|_| &views[12]),
        }
    }

    fn launch(&self, views: &[TensorView], scale: f32) -> Result<()> {
        attn_bwd(
            &self.tensors(views),
            self.mq,
            self.mk,
            scale,
            &AttnVariant::causal(true),
            self.deterministic,
            0,
        )
    }
}

fn expect_err(c: &Call, kind: &str, arg: &str, parts: &[&str]) {
    check_err(c.run(), kind, arg, parts);
}

/// One error case: an edit of a fresh valid call, then the error kind, argument named and
/// message parts `expect_err` requires.
type Case = (fn(&mut Call), &'static str, &'static str, &'static [&'static str]);

/// Each case's edit applied to its own `base()` call must fail as the case says.
fn expect_errs(base: fn() -> Call, cases: &[Case]) {
    for (i, (edit, kind, arg, parts)) in cases.iter().enumerate() {
        let mut c = base();
        edit(&mut c);
        eprintln!("case {i}: {arg}");
        expect_err(&c, kind, arg, parts);
    }
}

fn padded_2x4() -> Call {
    Call::padded(2, 4, 4, 2, 2, 64)
}

fn varlen_2x10() -> Call {
    Call::varlen(2, 10, 10, 2, 2, 64)
}

#[test]
fn params_layout_matches_header() {
    use std::mem::{align_of, offset_of, size_of};
    // AttnFwdParams (296 bytes), 6 pointers, 15 long long, in declaration order (bwd_params.cuh).
    assert_eq!(offset_of!(AttnBwdParams, fwd), 0);
    assert_eq!(size_of::<AttnFwdParams>(), 296);
    assert_eq!(offset_of!(AttnBwdParams, dout), 296);
    assert_eq!(offset_of!(AttnBwdParams, dq), 304);
    assert_eq!(offset_of!(AttnBwdParams, dk), 312);
    assert_eq!(offset_of!(AttnBwdParams, dv), 320);
    assert_eq!(offset_of!(AttnBwdParams, softmax_d), 328);
    assert_eq!(offset_of!(AttnBwdParams, dq_accum), 336);
    assert_eq!(offset_of!(AttnBwdParams, do_batch_stride), 344);
    assert_eq!(offset_of!(AttnBwdParams, dq_batch_stride), 344 + 3 * 8);
    assert_eq!(offset_of!(AttnBwdParams, dk_batch_stride), 344 + 6 * 8);
    assert_eq!(offset_of!(AttnBwdParams, dv_batch_stride), 344 + 9 * 8);
    assert_eq!(offset_of!(AttnBwdParams, dqa_batch_stride), 344 + 12 * 8);
    assert_eq!(offset_of!(AttnBwdParams, dqa_head_stride), 344 + 14 * 8);
    assert_eq!(size_of::<AttnBwdParams>(), 464);
    assert_eq!(align_of::<AttnBwdParams>(), 8);
    // every field of the header is mirrored, by name, in order
    let names = header_fields("attention/bwd_params.cuh", "AttnBwdParams");
    let mut want = vec!["fwd", "dout", "dq", "dk", "dv", "softmax_d", "dq_accum"].into_iter().map(String::from).collect::<Vec<_>>();
    for g in ["do", "dq", "dk", "dv", "dqa"] {
        want.extend(["batch", "row", "head"].map(|s| format!("{g}_{s}_stride")));
    }
    assert_eq!(names, want);
}

#[test]
fn params_layout_matches_nvrtc() {
    crate::ops::test_support::check_layout_with_nvrtc::<AttnBwdParams>("attention/bwd_params.cuh", "AttnBwdParams");
}

#[test]
fn valid_calls() {
    let p = Call::padded(2, 97, 113, 8, 2, 72).run().unwrap();
    assert_eq!(
        (p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.heads_k, p.head_dim),
        (2, 97, 113, 8, 2, 72)
    );
    let p = Call::varlen(3, 20, 30, 4, 4, 128).run().unwrap();
    assert!(p.varlen);
    assert_eq!((p.batch, p.seqlen_q, p.seqlen_k), (3, 7, 9));
    // metadata only (attn_bwd_check): outputs not looked at
    let mut c = Call::padded(1, 3, 5, 2, 1, 64);
    c.dq = t(&[9], DType::F32);
    c.dq_accum = None;
    c.run_with(false).unwrap();
    // deterministic: dq_accum ignored, also when given and wrong
    let mut c = Call::padded(1, 3, 5, 2, 1, 64);
    c.deterministic = true;
    c.dq_accum = Some(t(&[1], DType::F16));
    c.run().unwrap();
    c.dq_accum = None;
    c.run().unwrap();
    // inputs (out, dout) may have any strides with stride(-1) == 1: here a transposed layout
    // with padded rows (not dense)
    let mut c = Call::padded(2, 5, 5, 4, 4, 32);
    c.dout.strides = vec![64, 2 * 4 * 64, 2 * 64, 1];
    c.out.strides = vec![4 * 5 * 40, 4 * 40, 40, 1];
    c.run().unwrap();
    // outputs: slices of a packed (b, s, 3, h, d) gradient
    let mut c = Call::padded(2, 5, 5, 4, 4, 32);
    for g in [&mut c.dq, &mut c.dk, &mut c.dv] {
        g.strides = vec![5 * 3 * 4 * 32, 3 * 4 * 32, 32, 1];
    }
    c.run().unwrap();
}

#[test]
fn forward_checks_are_reused() {
    expect_errs(padded_2x4, &[
        (|c| c.q.dtype = DType::F32, "DType", "q", &["float16 or bfloat16", "float32"]),
        (|c| c.q.device = Device::CPU, "Device", "q", &["CUDA", "cpu"]),
    ]);
    let c = Call::padded(1, 4, 4, 6, 4, 64);
    expect_err(&c, "Argument", "k", &["divides q's 6", "4 heads"]);
    expect_errs(varlen_2x10, &[
        (|c| c.ck = None, "Argument", "cu_seqlens_k", &["cu_seqlens_q was given", "None"]),
        (|c| c.mq = 0, "Argument", "max_seqlen_q", &[">= 1", "got 0"]),
    ]);
}

#[test]
fn softmax_lse_errors() {
    expect_errs(padded_2x4, &[
        (|c| c.lse.dtype = DType::F16, "DType", "softmax_lse", &["float32", "float16"]),
        (
            |c| {
                c.lse = t(&[2, 4, 2], DType::F32);
                c.d = c.lse.clone();
            },
            "Argument",
            "softmax_lse",
            &["(2, 2, 4) (batch, heads, seqlen_q)", "(2, 4, 2)"],
        ),
        (|c| c.lse.strides = vec![16, 4, 1], "Argument", "softmax_lse", &["dense"]), // not dense
        (|c| c.lse.device = Device::cuda(1), "Device", "softmax_lse", &["cuda:0", "cuda:1"]),
    ]);
    let mut c = Call::varlen(2, 10, 10, 3, 3, 64);
    c.lse = t(&[3, 11], DType::F32);
    expect_err(&c, "Argument", "softmax_lse", &["(3, 10) (heads, total_q)", "(3, 11)"]);
}

impl Call {
    fn field(&mut self, arg: &str) -> &mut TensorMeta {
        match arg {
            "out" => &mut self.out,
            "dout" => &mut self.dout,
            "dq" => &mut self.dq,
            "dk" => &mut self.dk,
            "dv" => &mut self.dv,
            _ => unreachable!("{arg}"),
        }
    }

    /// A valid padded call (b 2, s_q 4, s_k 6, h 4, h_k 2, d 64) with `arg` edited by `f`.
    fn edited(arg: &str, f: impl Fn(&mut TensorMeta)) -> Call {
        let mut c = Call::padded(2, 4, 6, 4, 2, 64);
        f(c.field(arg));
        c
    }
}

/// An edit of one tensor's metadata, then the error kind and message parts expected.
type FieldCase = (fn(&mut TensorMeta), &'static str, &'static [&'static str]);

/// Each case applied to `arg` of its own `Call::edited` call must fail naming `arg`.
fn expect_field_errs(arg: &str, cases: &[FieldCase]) {
    for (edit, kind, parts) in cases {
        expect_err(&Call::edited(arg, edit), kind, arg, parts);
    }
}

#[test]
fn out_and_dout_errors() {
    for arg in ["out", "dout"] {
        expect_field_errs(arg, &[
            (|m| m.dtype = DType::BF16, "DType", &["float16 (q's dtype)", "bfloat16"]),
            (|m| *m = t(&[2, 4, 4, 32], DType::F16), "Argument", &["(2, 4, 4, 64) (q's shape)", "(2, 4, 4, 32)"]),
            (|m| *m = t(&[2, 6, 4, 64], DType::F16), "Argument", &["(2, 4, 4, 64)", "(2, 6, 4, 64)"]),
            (|m| m.strides = vec![1024, 256, 64, 2], "Argument", &["stride 1 in the last dim", "stride 2"]),
            (|m| m.strides = vec![1024, -256, 64, 1], "Argument", &["non-negative strides", "-256"]),
            (|m| m.device = Device::cuda(3), "Device", &["cuda:0", "cuda:3"]),
        ]);
    }
}

#[test]
fn gradient_output_errors() {
    for (arg, like, shape) in [
        ("dq", "q", "(2, 4, 4, 64)"),
        ("dk", "k", "(2, 6, 2, 64)"),
        ("dv", "v", "(2, 6, 2, 64)"),
    ] {
        let c = Call::edited(arg, |m| m.dtype = DType::BF16);
        expect_err(&c, "DType", arg, &[&format!("float16 ({like}'s dtype)"), "bfloat16"]);
        let c = Call::edited(arg, |m| *m = t(&[2, 5, 4, 64], DType::F16));
        expect_err(&c, "Argument", arg, &[&format!("{shape} ({like}'s shape)"), "(2, 5, 4, 64)"]);
        expect_field_errs(arg, &[
            (|m| m.dtype = DType::F32, "DType", &["float16", "float32"]),
            (|m| m.strides[3] = 3, "Argument", &["stride 1 in the last dim", "stride 3"]),
            // every batch writes the same memory
            (|m| m.strides[0] = 0, "Argument", &["non-overlapping", "strides [0, "]),
            // rows overlap (row stride < heads · d)
            (|m| m.strides[1] = 8, "Argument", &["non-overlapping"]),
            (|m| m.device = Device::CPU, "Device", &["cuda:0", "cpu"]),
        ]);
    }
}

#[test]
fn softmax_d_errors() {
    expect_errs(padded_2x4, &[
        (|c| c.d.dtype = DType::F16, "DType", "softmax_d", &["float32", "float16"]),
        (|c| c.d = t(&[2, 2, 5], DType::F32), "Argument", "softmax_d", &["(2, 2, 4) (softmax_lse's shape)", "(2, 2, 5)"]),
        (|c| c.d.strides = vec![8, 0, 1], "Argument", "softmax_d", &["dense"]),
        // dense but batch and head swapped: not lse's layout
        (|c| c.d.strides = vec![4, 8, 1], "Argument", "softmax_d", &["strides [8, 4, 1] (softmax_lse's layout", "[4, 8, 1]"]),
        (|c| c.d.device = Device::cuda(1), "Device", "softmax_d", &["cuda:0", "cuda:1"]),
    ]);
    // empty: strides never used
    let mut c = Call::padded(2, 0, 4, 2, 2, 64);
    c.d.strides = vec![1, 2, 1]; // dense, but not lse's layout
    c.lse.strides = vec![2, 1, 1];
    c.run().unwrap();
    // the same permuted layout as lse is fine
    let mut c = padded_2x4();
    c.d.strides = vec![4, 8, 1];
    c.lse.strides = vec![4, 8, 1];
    c.run().unwrap();
}

#[test]
fn dq_accum_errors() {
    fn accum(c: &mut Call) -> &mut TensorMeta {
        c.dq_accum.as_mut().unwrap()
    }
    expect_errs(padded_2x4, &[
        (|c| c.dq_accum = None, "Argument", "dq_accum", &["deterministic is False", "None"]),
        (|c| c.dq_accum = Some(t(&[2, 4, 2, 64], DType::F16)), "DType", "dq_accum", &["float32", "float16"]),
        (|c| c.dq_accum = Some(t(&[2, 4, 2, 128], DType::F32)), "Argument", "dq_accum", &["(2, 4, 2, 64) (q's shape)", "(2, 4, 2, 128)"]),
        (|c| accum(c).strides = vec![1024, 256, 128, 1], "Argument", "dq_accum", &["dense", "[1024, 256, 128, 1]"]),
        (|c| accum(c).device = Device::CPU, "Device", "dq_accum", &["cuda:0", "cpu"]),
    ]);
    expect_errs(varlen_2x10, &[
        (|c| c.dq_accum = Some(t(&[2, 10, 2, 64], DType::F32)), "Argument", "dq_accum", &["(10, 2, 64)", "(2, 10, 2, 64)"]),
    ]);
}

#[test]
fn softmax_scale_must_be_finite_and_positive() {
    let c = Call::padded(1, 4, 4, 2, 2, 64);
    let views = c.views();
    for bad in [0.0f32, -0.5, f32::NAN, f32::INFINITY, -0.0] {
        check_err(
            c.launch(&views, bad),
            "Argument",
            "softmax_scale",
            &["finite number > 0"],
        );
    }
    check_err(
        c.launch(&views, f32::NAN),
        "Argument",
        "softmax_scale",
        &["NaN"],
    );
}

#[test]
fn plan_launch_shapes() {
    let c = Call::padded(3, 200, 50, 8, 2, 80);
    let p = c.run().unwrap();
    for deterministic in [false, true] {
        let plan = bwd_plan(80, VariantKind::from_causal(true), deterministic, DType::F16, Arch::Sm80);
        let shapes = launch_shapes(&p, &plan);
        assert_eq!(shapes.len(), plan.len());
        for ((cfg, s), planned) in shapes.iter().zip(&plan) {
            assert_eq!(cfg, planned);
            assert_eq!(cfg.head_dim, 96);
            assert_eq!(s.block, (cfg.num_warps * 32, 1, 1));
            assert_eq!(s.dynamic_smem_bytes, cfg.smem_bytes());
            let want = match cfg.kind {
                BwdKind::DkDv { .. } => (50u32.div_ceil(cfg.block_n), 2, 3),
                _ => (200u32.div_ceil(cfg.block_m), 8, 3),
            };
            assert_eq!(s.grid, want, "{cfg:?}");
            s.check().unwrap();
        }
    }
    // seqlen_q == 0: only the dK/dV kernels run (they write dk = dv = 0)
    let p = Call::padded(2, 0, 70, 4, 2, 256).run().unwrap();
    assert!(needs_launch(&p));
    let plan = bwd_plan(256, VariantKind::from_causal(false), false, DType::BF16, Arch::Sm90a);
    let kinds: Vec<_> = launch_shapes(&p, &plan)
        .iter()
        .map(|(c, _)| c.kind)
        .collect();
    // d256 on sm_90a: the single-pass wide dK/dV kernel
    assert_eq!(
        kinds,
        vec![BwdKind::DkDv {
            dk: true,
            dv: true,
            dq: true
        }]
    );
    // seqlen_k == 0: dQ side only (dq = 0 from the convert or dq kernel)
    let p = Call::padded(2, 9, 0, 4, 2, 64).run().unwrap();
    for det in [false, true] {
        let plan = bwd_plan(64, VariantKind::from_causal(false), det, DType::F16, Arch::Sm80);
        let shapes = launch_shapes(&p, &plan);
        assert!(shapes
            .iter()
            .all(|(c, _)| !matches!(c.kind, BwdKind::DkDv { .. })));
        assert_eq!(shapes.len(), 2);
    }
    // nothing at all
    for p in [
        Call::padded(0, 5, 5, 2, 2, 64).run().unwrap(),
        Call::padded(2, 0, 0, 2, 2, 64).run().unwrap(),
    ] {
        assert!(!needs_launch(&p));
        for arch in [Arch::Sm80, Arch::Sm90a, Arch::Sm86] {
            assert!(launch_shapes(&p, &bwd_plan(64, VariantKind::from_causal(true), false, DType::F16, arch)).is_empty());
        }
    }
    // a grid beyond the driver's limits is caught by LaunchShape::check
    let mut p = Call::padded(1, 4, 4, 2, 2, 64).run().unwrap();
    p.seqlen_q = (i64::from(i32::MAX) + 1) * 64;
    let shapes = launch_shapes(&p, &bwd_plan(64, VariantKind::from_causal(false), false, DType::F16, Arch::Sm80));
    assert!(shapes.iter().any(|(_, s)| s.check().is_err()));
}

/// (batch, row, head) strides of dout, dq, dk, dv and dq_accum, in that order.
fn grad_strides(p: &AttnBwdParams) -> [(i64, i64, i64); 5] {
    [
        (p.do_batch_stride, p.do_row_stride, p.do_head_stride),
        (p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride),
        (p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride),
        (p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride),
        (p.dqa_batch_stride, p.dqa_row_stride, p.dqa_head_stride),
    ]
}

#[test]
fn params_values() {
    let c = Call::padded(3, 200, 50, 8, 2, 80);
    let p = c.run().unwrap();
    let views = c.views();
    let tensors = c.tensors(&views);
    assert!(tensors.dq_accum.is_some() && tensors.cu_seqlens_q.is_none());
    let prm = params(&p, &tensors, tensors.workspace(false), 0.125, &AttnVariant::causal(false));
    assert_eq!(prm.fwd.q as u64, views[1].ptr);
    assert_eq!(
        prm.fwd.o as u64, views[4].ptr,
        "fwd.o is the forward's output"
    );
    assert_eq!(prm.fwd.lse as u64, views[5].ptr, "fwd.lse is softmax_lse");
    assert_eq!(
        (prm.fwd.lse_batch_stride, prm.fwd.lse_head_stride),
        (8 * 200, 200)
    );
    assert_eq!(
        (prm.fwd.batch, prm.fwd.num_heads, prm.fwd.num_heads_k),
        (3, 8, 2)
    );
    assert_eq!(
        (prm.fwd.head_dim, prm.fwd.seqlen_q, prm.fwd.seqlen_k),
        (80, 200, 50)
    );
    assert_eq!(prm.fwd.softmax_scale, 0.125);
    assert_eq!(
        [
            prm.dout as u64,
            prm.dq as u64,
            prm.dk as u64,
            prm.dv as u64,
            prm.softmax_d as u64
        ],
        [
            views[0].ptr,
            views[6].ptr,
            views[7].ptr,
            views[8].ptr,
            views[9].ptr
        ]
    );
    assert_eq!(prm.dq_accum as u64, views[10].ptr);
    let q_strides = (200 * 8 * 80, 8 * 80, 80);
    let k_strides = (50 * 2 * 80, 2 * 80, 80);
    assert_eq!(
        grad_strides(&prm),
        [q_strides, q_strides, k_strides, k_strides, q_strides]
    );
    // deterministic: no workspace
    let prm = params(&p, &tensors, tensors.workspace(true), 0.125, &AttnVariant::causal(false));
    assert!(prm.dq_accum.is_null());
    assert_eq!(grad_strides(&prm)[4], (0, 0, 0));

    // varlen: no batch strides; each tensor's own strides
    let mut c = Call::varlen(2, 10, 12, 4, 2, 64);
    c.dout.strides = vec![4 * 72, 72, 1];
    c.dk.strides = vec![2 * 64 * 3, 64, 1];
    let p = c.run().unwrap();
    let views = c.views();
    let tensors = c.tensors(&views);
    assert!(tensors.dq_accum.is_some() && tensors.cu_seqlens_k.is_some());
    let prm = params(&p, &tensors, tensors.workspace(false), 1.0, &AttnVariant::causal(false));
    let [do_s, _, dk_s, _, dqa_s] = grad_strides(&prm);
    assert_eq!(
        [do_s, dk_s, dqa_s],
        [(0, 4 * 72, 72), (0, 2 * 64 * 3, 64), (0, 4 * 64, 64)]
    );
    assert_eq!(
        (prm.fwd.cu_seqlens_q as u64, prm.fwd.cu_seqlens_k as u64),
        (views[11].ptr, views[12].ptr)
    );
    assert_eq!(
        (prm.fwd.total_q, prm.fwd.total_k, prm.fwd.lse_head_stride),
        (10, 12, 10)
    );
}

#[test]
fn attn_bwd_without_gpu_fails_cleanly_after_validation() {
    let c = Call::padded(1, 4, 4, 2, 2, 64);
    let views = c.views();
    let r = c.launch(&views, 0.125);
    if !crate::device::cuda_available() {
        assert!(matches!(r, Err(Error::NoDevice(_))), "{r:?}");
    }
    // empty problems touch no device
    for e in [
        Call::padded(0, 4, 4, 2, 2, 64),
        Call::padded(3, 0, 0, 2, 2, 64),
    ] {
        e.launch(&e.views(), 0.125).unwrap();
    }
    // seqlen_q == 0 but keys exist: the dK/dV kernels must run, so the device is needed
    let e = Call::padded(1, 0, 4, 2, 2, 64);
    let r = e.launch(&e.views(), 0.125);
    if !crate::device::cuda_available() {
        assert!(matches!(r, Err(Error::NoDevice(_))), "{r:?}");
    }
    // CPU tensors: DeviceError naming q
    let mut c = Call::padded(1, 4, 4, 2, 2, 64);
    for m in [
        &mut c.dout,
        &mut c.q,
        &mut c.k,
        &mut c.v,
        &mut c.out,
        &mut c.lse,
        &mut c.dq,
        &mut c.dk,
        &mut c.dv,
        &mut c.d,
    ] {
        m.device = Device::CPU;
    }
    c.dq_accum.as_mut().unwrap().device = Device::CPU;
    check_err(c.launch(&c.views(), 0.125), "Device", "q", &["CUDA", "cpu"]);
}

#[test]
fn pointer_checks_before_any_device_access() {
    let c = Call::padded(1, 4, 4, 2, 2, 64);
    // (slot edited, its new pointer from the valid views, argument named, message parts)
    type Edit = (usize, fn(&[TensorView]) -> u64, &'static str, &'static [&'static str]);
    let edits: [Edit; 7] = [
        (7, |_| 0, "dk", &["non-NULL", "NULL"]), // NULL output
        (6, |v| v[6].ptr + 8, "dq", &["16-byte aligned data pointer"]), // misaligned dq
        (0, |v| v[0].ptr + 2, "dout", &["16-byte aligned"]), // misaligned dout
        (6, |v| v[1].ptr, "dq", &["does not overlap q", "overlapping q"]), // dq over q (in place)
        (8, |v| v[7].ptr, "dk", &["does not overlap dv"]), // dk and dv the same memory
        (9, |v| v[5].ptr + 4, "softmax_d", &["does not overlap softmax_lse"]),
        (10, |v| v[6].ptr + 256, "dq", &["does not overlap dq_accum"]), // dq_accum overlapping dq
    ];
    for (slot, ptr, arg, parts) in edits {
        let mut views = c.views();
        views[slot].ptr = ptr(&views);
        check_err(c.launch(&views, 0.125), "Argument", arg, parts);
    }
    // deterministic: dq_accum is ignored, whatever it points at
    let mut d = c.clone();
    d.deterministic = true;
    let mut views = d.views();
    views[10].ptr = views[6].ptr;
    let r = d.launch(&views, 0.125);
    assert!(!matches!(r, Err(Error::Argument { .. })), "{r:?}");
    // dq, dk, dv interleaved in one packed (b, s, 3, h, d) buffer: accepted
    let mut c = Call::padded(2, 5, 5, 4, 4, 32);
    let st = vec![5 * 3 * 4 * 32, 3 * 4 * 32, 32, 1];
    for g in [&mut c.dq, &mut c.dk, &mut c.dv] {
        g.strides = st.clone();
    }
    let mut views = c.views();
    let base = 0x7000_0000u64;
    for (i, slot) in [6, 7, 8].into_iter().enumerate() {
        views[slot].ptr = base + (i as u64) * 4 * 32 * 2;
    }
    let r = c.launch(&views, 0.125);
    assert!(!matches!(r, Err(Error::Argument { .. })), "{r:?}");
}

#[test]
fn production_specs_cover_bwd_plan() {
    for arch in [Arch::Sm80, Arch::Sm90a] {
        let specs = production_specs(arch);
        for d in (8..=256).step_by(8) {
            for causal in [false, true] {
                for deterministic in [false, true] {
                    for dtype in [DType::F16, DType::BF16] {
                        for cfg in bwd_plan(d, VariantKind::from_causal(causal), deterministic, dtype, arch) {
                            assert!(specs.contains(&cfg), "{cfg:?} not precompiled");
                            assert!(cfg.smem_bytes() <= arch.max_smem_per_block());
                        }
                    }
                }
            }
        }
        assert!(specs.iter().all(|s| s.arch == arch));
    }
    let cfg = bwd_plan(64, VariantKind::from_causal(true), false, DType::BF16, Arch::Sm90a)[1];
    assert_eq!(KernelSpec::header(&cfg), "attention/bwd_dkdv_sm80.cuh");
    assert_eq!(KernelSpec::kernel(&cfg), "ferroattn::attn_bwd_dkdv_sm80");
    assert_eq!(KernelSpec::dynamic_smem_bytes(&cfg), cfg.smem_bytes());
    assert_eq!(KernelSpec::name_expression(&cfg), cfg.name_expression());
    assert!(cfg
        .name_expression()
        .ends_with(", ferroattn::AttnVariant<1, false, false, false, false, false>, true, true, true, __nv_bfloat16>"));
}

/// The causal dK/dV kernels at d 128 (dQ staged on sm_90a), d 224 and d 256 (wide) compile without spills
/// (`precompile --check-spills` covers them too; this runs them alone:
/// `cargo test --release -- --ignored causal_dkdv_kernels_do_not_spill`).
#[test]
#[ignore]
fn causal_dkdv_kernels_do_not_spill() {
    if crate::jit::nvrtc::tests::toolchain().is_none() {
        return;
    }
    let mut specs = Vec::new();
    for (hd, arch) in [(128, Arch::Sm90a), (128, Arch::Sm80), (224, Arch::Sm80), (256, Arch::Sm90a)] {
        for det in [false, true] {
            for c in bwd_plan(hd, VariantKind::CAUSAL, det, DType::BF16, arch) {
                if matches!(c.kind, crate::tuning::attention_bwd::BwdKind::DkDv { .. }) && !specs.contains(&c) {
                    specs.push(c);
                }
            }
        }
    }
    let reports = crate::jit::precompile::precompile(&specs).unwrap();
    crate::jit::precompile::check_spills(&reports).unwrap();
}

/// Spills of the production kernels whose variant has `pick` set (forward and backward, both
/// archs): `cargo test --release -- --ignored production_variant_kernels -- --nocapture`.
#[test]
#[ignore]
fn production_variant_kernels_do_not_spill() {
    if crate::jit::nvrtc::tests::toolchain().is_none() {
        return;
    }
    let pick = |v: VariantKind| v.dropout;
    let mut reports = Vec::new();
    for arch in [Arch::Sm80, Arch::Sm90a] {
        let mut fwd: Vec<_> = crate::tuning::attention::fwd_production_configs(arch).into_iter().filter(|c| pick(c.variant)).collect();
        // head dim 32 (128-key softmax steps: 64 mask pairs per thread) compiles on first use
        fwd.push(crate::tuning::attention::fwd_config(32, VariantKind { dropout: true, ..VariantKind::CAUSAL }, DType::BF16, arch));
        // the returned-softmax kind (testing only) must compile; its spills are not held to zero
        let dmask = VariantKind { dropout: true, return_softmax: true, ..VariantKind::PLAIN };
        let dmask: Vec<_> = [32, 64, 128, 256].iter().map(|&d| crate::tuning::attention::fwd_config(d, dmask, DType::BF16, arch)).collect();
        crate::jit::precompile::precompile(&dmask).unwrap();
        let bwd: Vec<_> = bwd_production_configs(arch).into_iter().filter(|c| pick(c.variant)).collect();
        reports.extend(crate::jit::precompile::precompile(&fwd).unwrap());
        reports.extend(crate::jit::precompile::precompile(&bwd).unwrap());
    }
    for r in &reports {
        if r.spills() {
            println!("SPILL {} {}", r.config, r.arch);
        }
    }
    crate::jit::precompile::check_spills(&reports).unwrap();
}

/// The backward production kernels of the score-modifying and local variants (softcap, ALiBi,
/// window, their production combinations; no dropout) compile without spills for sm_80 and
/// sm_90a at d 64 / 128 / 256, both dtypes (`precompile --check-spills` covers them too; this
/// runs them alone: `cargo test --release -- --ignored score_and_window_bwd_kernels --nocapture`).
#[test]
#[ignore]
fn score_and_window_bwd_kernels_do_not_spill() {
    if crate::jit::nvrtc::tests::toolchain().is_none() {
        return;
    }
    let pick = |v: VariantKind| !v.dropout && (v.softcap || v.alibi || v.mask == crate::ops::attention::MaskKind::Local);
    let mut reports = Vec::new();
    for arch in [Arch::Sm80, Arch::Sm90a] {
        let specs: Vec<_> = bwd_production_configs(arch).into_iter().filter(|c| pick(c.variant)).collect();
        // every production variant at every production head dim, with each of its plan's kernels
        for (hd, v, dtype) in crate::tuning::attention::production_points().filter(|&(_, v, _)| pick(v)) {
            for det in [false, true] {
                for c in bwd_plan(hd, v, det, dtype, arch) {
                    assert!(specs.contains(&c) || !pick(c.variant), "{c:?} not in the production set");
                }
            }
        }
        reports.extend(crate::jit::precompile::precompile(&specs).unwrap());
    }
    for r in &reports {
        println!(
            "{} {} [{}]: {} registers, {} B spill stores, {} B spill loads",
            if r.spills() { "SPILL" } else { "ok" },
            r.config,
            r.arch,
            r.resources.registers,
            r.resources.spill_stores,
            r.resources.spill_loads
        );
    }
    crate::jit::precompile::check_spills(&reports).unwrap();
}
