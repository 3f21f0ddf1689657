//! Validation, params layout and launch-free checks of the 2:4 ops (CPU).

use super::*;
use crate::ops::test_support::{check_err, check_layout_with_nvrtc, header_fields, t};
use crate::tensor::Device;

fn sp(n: i64, k: i64, dtype: DType) -> (TensorMeta, TensorMeta) {
    let l = layout(n, k).unwrap();
    let vs = l.values_shape().map(|v| v as i64);
    let ms = l.meta_shape().map(|v| v as i64);
    (t(&vs, dtype), t(&ms, DType::I16))
}

#[test]
fn params_mirror_the_kernel_header() {
    assert_eq!(
        header_fields("sparse24/params.cuh", "Sparse24MatmulParams"),
        [
            "x",
            "values",
            "meta",
            "bias",
            "out",
            "x_row_stride",
            "out_row_stride",
            "rows",
            "n",
            "k",
            "k_pad",
            "bias_kind",
            "vec_out",
            "row_tiles",
            "n_tiles"
        ]
    );
    assert_eq!(
        header_fields("sparse24/params.cuh", "Sparse24CompressParams"),
        [
            "dense",
            "values",
            "meta",
            "bad_groups",
            "dense_row_stride",
            "m",
            "k",
            "m_pad",
            "k_pad",
            "prune"
        ]
    );
    check_layout_with_nvrtc::<Sparse24MatmulParams>(
        "sparse24/params.cuh",
        "ferroattn::Sparse24MatmulParams",
    );
    check_layout_with_nvrtc::<Sparse24CompressParams>(
        "sparse24/params.cuh",
        "ferroattn::Sparse24CompressParams",
    );
}

#[test]
fn valid_matmul_problems() {
    for (rows, n, k) in [(1, 1, 1), (7, 33, 17), (4096, 4096, 4096), (0, 8, 8)] {
        let x = t(&[rows, k], DType::BF16);
        let (v, m) = sp(n, k, DType::BF16);
        let out = t(&[rows, n], DType::BF16);
        let bias = t(&[n], DType::F32);
        let p = validate_matmul(&x, &v, &m, Some(&out), Some(&bias), n, k, "gelu_tanh").unwrap();
        assert_eq!((p.rows, p.n, p.k, p.bias_kind), (rows, n, k, 2));
        assert_eq!(p.activation, Activation::GeluTanh);
        let w = work::matmul(&p, 4.0 * n as f64);
        assert_eq!(w.flops, 2.0 * rows as f64 * n as f64 * k as f64);
    }
    // a strided x (a column slice of a wider matrix) and a strided out are fine
    let mut x = t(&[5, 64], DType::F16);
    x.strides = vec![128, 1];
    let (v, m) = sp(16, 64, DType::F16);
    let mut out = t(&[5, 16], DType::F16);
    out.strides = vec![40, 1];
    validate_matmul(&x, &v, &m, Some(&out), None, 16, 64, "none").unwrap();
}

#[test]
fn matmul_errors_name_the_argument() {
    let (n, k) = (48i64, 40i64);
    let x = t(&[3, k], DType::F16);
    let (v, m) = sp(n, k, DType::F16);
    let out = t(&[3, n], DType::F16);
    let ok = |x: &TensorMeta,
              v: &TensorMeta,
              m: &TensorMeta,
              o: &TensorMeta,
              b: Option<&TensorMeta>,
              act: &str| { validate_matmul(x, v, m, Some(o), b, n, k, act) };
    check_err(
        ok(&x, &v, &m, &out, None, "tanh"),
        "Argument",
        "activation",
        &["gelu_tanh", "\"tanh\""],
    );
    check_err(
        validate_matmul(&x, &v, &m, None, None, 0, k, "none"),
        "Argument",
        "n",
        &["0"],
    );
    check_err(
        ok(&t(&[3, k], DType::F32), &v, &m, &out, None, "none"),
        "DType",
        "x",
        &["float16 or bfloat16", "float32"],
    );
    check_err(
        ok(&t(&[3, k + 1], DType::F16), &v, &m, &out, None, "none"),
        "Argument",
        "x",
        &["40 columns", "(3, 41)"],
    );
    check_err(
        ok(&t(&[2, 3, k], DType::F16), &v, &m, &out, None, "none"),
        "Argument",
        "x",
        &["2 dims", "3 dims"],
    );
    let mut xs = x.clone();
    xs.strides = vec![k, 2];
    check_err(
        ok(&xs, &v, &m, &out, None, "none"),
        "Argument",
        "x",
        &["stride 1 in the last dim"],
    );
    check_err(
        ok(&x, &t(&[128, 64], DType::F16), &m, &out, None, "none"),
        "Argument",
        "values",
        &["(128, 32)", "(128, 64)", "sparse24_layout(48, 40)"],
    );
    check_err(
        ok(&x, &t(&[128, 32], DType::BF16), &m, &out, None, "none"),
        "DType",
        "values",
        &["float16 (x's dtype)", "bfloat16"],
    );
    let mut vs = v.clone();
    vs.strides = vec![1, 128];
    check_err(
        ok(&x, &vs, &m, &out, None, "none"),
        "Argument",
        "values",
        &["contiguous"],
    );
    check_err(
        ok(&x, &v, &t(&[8, 64], DType::I32), &out, None, "none"),
        "DType",
        "meta",
        &["int16", "int32"],
    );
    check_err(
        ok(&x, &v, &t(&[128, 4], DType::I16), &out, None, "none"),
        "Argument",
        "meta",
        &["(8, 64)", "(128, 4)"],
    );
    check_err(
        ok(&x, &v, &m, &t(&[3, n], DType::BF16), None, "none"),
        "DType",
        "out",
        &["float16"],
    );
    check_err(
        ok(&x, &v, &m, &t(&[4, n], DType::F16), None, "none"),
        "Argument",
        "out",
        &["(3, 48)", "(4, 48)"],
    );
    let mut os = out.clone();
    os.strides = vec![8, 1];
    check_err(
        ok(&x, &v, &m, &os, None, "none"),
        "Argument",
        "out",
        &["do not overlap"],
    );
    check_err(
        ok(&x, &v, &m, &out, Some(&t(&[n], DType::BF16)), "none"),
        "DType",
        "bias",
        &["float16 (x's dtype) or float32"],
    );
    check_err(
        ok(&x, &v, &m, &out, Some(&t(&[n + 1], DType::F16)), "none"),
        "Argument",
        "bias",
        &["(48,)", "(49,)"],
    );
    let mut xc = x.clone();
    xc.device = Device::CPU;
    check_err(
        ok(&xc, &v, &m, &out, None, "none"),
        "Device",
        "x",
        &["CUDA", "cpu"],
    );
    let mut mc = m.clone();
    mc.device = Device::cuda(1);
    check_err(
        ok(&x, &v, &mc, &out, None, "none"),
        "Device",
        "meta",
        &["cuda:0", "cuda:1"],
    );
    check_err(
        pick_backend("cublas"),
        "Argument",
        "backend",
        &["auto, mma_sp, wgmma_sp"],
    );
    assert_eq!(pick_backend("wgmma_sp").unwrap(), "wgmma_sp");
    assert_eq!(pick_backend("auto").unwrap(), "mma_sp");
}

fn view(meta: TensorMeta, ptr: u64) -> TensorView {
    TensorView { meta, ptr }
}

fn host(shape: &[i64], dtype: DType, buf: &mut [u16]) -> TensorView {
    let mut m = t(shape, dtype);
    m.device = Device::CPU;
    view(m, buf.as_mut_ptr() as u64)
}

#[test]
fn host_round_trip_through_tensor_views() {
    let (rows, cols) = (19i64, 37i64);
    let l = layout(rows, cols).unwrap();
    // a 2:4 matrix: group j of row r keeps positions (r + j) % 4 and (r + j + 2) % 4
    let mut w = vec![0u16; (rows * cols) as usize];
    for r in 0..rows as usize {
        for c in 0..cols as usize {
            let (j, i) = (c / 4, c % 4);
            if i == (r + j) % 4 || i == (r + j + 2) % 4 {
                w[r * cols as usize + c] =
                    half::f16::from_f32(1.0 + (r * 41 + c) as f32 / 64.0).to_bits();
            }
        }
    }
    let mut values = vec![0xffffu16; l.m_pad * l.k_pad / 2];
    let mut meta = vec![0xffffu16; l.m_pad * l.k_pad / 16];
    let vs = l.values_shape().map(|v| v as i64);
    let ms = l.meta_shape().map(|v| v as i64);
    let wv = host(&[rows, cols], DType::F16, &mut w);
    let vv = host(&vs, DType::F16, &mut values);
    let mv = host(&ms, DType::I16, &mut meta);
    assert_eq!(compress_host(&wv, &vv, &mv, false).unwrap(), 0);
    let mut out = vec![0x7777u16; (rows * cols) as usize];
    let ov = host(&[rows, cols], DType::F16, &mut out);
    decompress_host(&vv, &mv, &ov).unwrap();
    assert_eq!(out, w);
    // errors: a CUDA tensor to the host reference, overlapping outputs
    let mut wc = wv.clone();
    wc.meta.device = Device::cuda(0);
    check_err(
        compress_host(&wc, &vv, &mv, false),
        "Device",
        "w",
        &["a CPU tensor"],
    );
    let alias = view(vv.meta.clone(), wv.ptr);
    check_err(
        compress_host(&wv, &alias, &mv, false),
        "Argument",
        "values",
        &["does not overlap w"],
    );
    let mut big = vec![0u16; (rows * 70) as usize];
    let wide = host(&[rows, 70], DType::F16, &mut big);
    check_err(
        decompress_host(&vv, &mv, &wide),
        "Argument",
        "values",
        &["sparse24_layout(19, 70)", "(128, 64)"],
    );
}

#[test]
fn layout_errors() {
    check_err(layout(-1, 4), "Argument", "m", &["-1"]);
    check_err(layout(4, i64::MAX), "Argument", "k", &[]);
    let l = layout(300, 4100).unwrap();
    assert_eq!((l.m_pad, l.k_pad), (384, 4160));
}

#[test]
fn representative_kernels_compile_without_spills() {
    // (every production configuration: `python -m ferroattn precompile --check-spills`)
    if crate::jit::nvrtc::tests::toolchain().is_none() {
        return;
    }
    for arch in [Arch::Sm80, Arch::Sm90a] {
        let (mm, cc) = production_specs(arch);
        let picks: Vec<_> = mm
            .iter()
            .filter(|c| {
                (c.dtype == DType::BF16
                    && c.activation == Activation::GeluErf
                    && c.tile.block_n == 128)
                    || (c.dtype == DType::F16
                        && c.activation == Activation::None
                        && c.tile.block_r <= 32)
                    || (c.dtype == DType::F16 && c.activation == Activation::Silu && !c.vec_x)
            })
            .copied()
            .collect();
        assert_eq!(picks.len(), 4);
        let mut reports = crate::jit::precompile::precompile(&picks).unwrap();
        reports.extend(crate::jit::precompile::precompile(&cc).unwrap());
        for r in &reports {
            eprintln!(
                "{} [{}]: {} registers, {} spill bytes",
                r.config, r.arch, r.resources.registers, r.resources.spill_stores
            );
        }
        crate::jit::precompile::check_spills(&reports).unwrap();
    }
}

/// Every production configuration for sm_80 and sm_90a, no spills (slow: ~100 NVRTC compiles;
/// `cargo test --release --lib sparse24 -- --ignored`, or `python -m ferroattn precompile`).
#[test]
#[ignore]
fn all_production_configs_compile_without_spills() {
    if crate::jit::nvrtc::tests::toolchain().is_none() {
        return;
    }
    for arch in [Arch::Sm80, Arch::Sm90a] {
        let (mm, cc) = production_specs(arch);
        let mut reports = crate::jit::precompile::precompile(&mm).unwrap();
        reports.extend(crate::jit::precompile::precompile(&cc).unwrap());
        // wgmma_sp (sm_90a): the 42 production specs, the 10 opt-in pipelined-mainloop ones and the 10 stream-K ones
        reports.extend(crate::jit::precompile::precompile(&wgmma_production_specs(arch)).unwrap());
        reports.extend(crate::jit::precompile::precompile(&wgmma_pipelined_specs(arch)).unwrap());
        reports.extend(crate::jit::precompile::precompile(&crate::tuning::sparse24::wgmma_stream_k_configs(arch)).unwrap());
        let max = reports.iter().map(|r| r.resources.registers).max().unwrap();
        eprintln!("{arch}: {} kernels, at most {max} registers", reports.len());
        crate::jit::precompile::check_spills(&reports).unwrap();
    }
}

#[test]
fn wgmma_params_layout() {
    // kernels/sparse24/wgmma_sp.cuh static_asserts the same: 3 maps of 128 B, then
    // Sparse24MatmulParams (88 B) at 384; 640 bytes (dp_tiles past 512), 128-byte aligned.
    assert_eq!(std::mem::size_of::<Sparse24MatmulParams>(), 88);
    assert_eq!(std::mem::size_of::<Sparse24WgmmaParams>(), 640);
    assert_eq!(std::mem::align_of::<Sparse24WgmmaParams>(), 128);
    assert_eq!(std::mem::offset_of!(Sparse24WgmmaParams, p), 384);
    assert_eq!(std::mem::offset_of!(Sparse24MatmulParams, rows), 56);
    // split-k fields (Epi = 2) in the tail padding: the size stays 512
    assert_eq!(std::mem::offset_of!(Sparse24WgmmaParams, ws), 472);
    assert_eq!(std::mem::offset_of!(Sparse24WgmmaParams, ws_split_stride), 480);
    assert_eq!(std::mem::offset_of!(Sparse24WgmmaParams, ws_row_stride), 488);
    assert_eq!(std::mem::offset_of!(Sparse24WgmmaParams, splits), 496);
    assert_eq!(std::mem::offset_of!(Sparse24WgmmaParams, chunk_tiles), 500);
    assert_eq!(std::mem::offset_of!(Sparse24WgmmaParams, flags), 504);
    // stream-K (Epi = 4)
    assert_eq!(std::mem::offset_of!(Sparse24WgmmaParams, dp_tiles), 512);
    check_layout_with_nvrtc::<Sparse24WgmmaParams>(
        "sparse24/wgmma_sp.cuh",
        "ferroattn::Sparse24WgmmaParams",
    );
}

#[test]
fn wgmma_backend_is_accepted_and_auto_falls_back_to_mma_sp() {
    assert_eq!(pick_backend("wgmma_sp").unwrap(), "wgmma_sp");
    assert_eq!(pick_backend("auto").unwrap(), "mma_sp");
    assert_eq!(pick_backend("mma_sp").unwrap(), "mma_sp");
    assert!(pick_backend("cusparselt").is_err());
}

#[test]
fn wgmma_kernels_compile_without_spills() {
    if crate::jit::nvrtc::tests::toolchain().is_none() {
        return;
    }
    assert!(wgmma_production_specs(Arch::Sm80).is_empty());
    let specs = wgmma_production_specs(Arch::Sm90a);
    assert_eq!(specs.len(), 42);
    // the two split-k partial-product kernels (Epi = 2)
    let split: Vec<_> = specs.iter().filter(|c| c.epilogue == 2).copied().collect();
    assert_eq!(split.len(), 2);
    assert!(split.iter().all(|c| c.activation == Activation::None && c.meta_sets == 1));
    // four representative specialisations, both epilogue forms (all twenty: ~40 s of NVRTC;
    // gelu_erf is the one that spilled in a first staged-epilogue draft)
    let picks: Vec<_> = specs
        .iter()
        .filter(|c| c.epilogue < 2 && c.block_n == 256)
        .filter(|c| {
            (c.dtype == DType::BF16 && c.activation == Activation::None)
                || (c.dtype == DType::F16 && c.activation == Activation::GeluErf)
        })
        .copied()
        .collect();
    assert_eq!(picks.len(), 4);
    assert!(picks.iter().any(|c| c.epilogue == 0) && picks.iter().any(|c| c.epilogue == 1));
    // the opt-in pipelined mainloop (Sets = 2), same two dtype / activation picks: it spilled at
    // this tile while a __trap() sat on the consumer path (ptxas then allocates at 168 registers)
    assert!(wgmma_pipelined_specs(Arch::Sm80).is_empty());
    let piped: Vec<_> = wgmma_pipelined_specs(Arch::Sm90a)
        .into_iter()
        .filter(|c| {
            (c.dtype == DType::BF16 && c.activation == Activation::None)
                || (c.dtype == DType::F16 && c.activation == Activation::GeluErf)
        })
        .collect();
    assert_eq!(piped.len(), 2);
    assert!(piped.iter().all(|c| c.meta_sets == 2));
    // the opt-in fused split-k form (Epi = 3), same two picks
    let fused: Vec<_> = crate::tuning::sparse24::wgmma_fused_split_configs(Arch::Sm90a)
        .into_iter()
        .filter(|c| {
            (c.dtype == DType::BF16 && c.activation == Activation::None)
                || (c.dtype == DType::F16 && c.activation == Activation::GeluErf)
        })
        .collect();
    assert_eq!(fused.len(), 2);
    // the 128-row tile (4 stages) and the stream-K tail form (Epi = 4), same two picks each
    let sched: Vec<_> = specs
        .iter()
        .copied()
        .chain(crate::tuning::sparse24::wgmma_stream_k_configs(Arch::Sm90a))
        .filter(|c| c.block_n == 128 || c.epilogue == 4)
        .filter(|c| {
            (c.dtype == DType::BF16 && c.activation == Activation::None)
                || (c.dtype == DType::F16 && c.activation == Activation::GeluErf)
        })
        .collect();
    assert_eq!(sched.len(), 4);
    let picks: Vec<_> = picks.into_iter().chain(piped).chain(split).chain(fused).chain(sched).collect();
    let reports = crate::jit::precompile::precompile(&picks).unwrap();
    for r in &reports {
        eprintln!(
            "{} [{}]: {} registers, {} spill bytes",
            r.config, r.arch, r.resources.registers, r.resources.spill_stores
        );
    }
    crate::jit::precompile::check_spills(&reports).unwrap();
}

#[test]
fn gpu_compress_and_decompress_reject_misaligned_values_and_meta() {
    // the kernels move values 16 bytes at a time: a view 2 bytes off (e.g. a Sparse24Tensor built from
    // a sliced buffer) must be an ArgumentError, not a misaligned-address fault that poisons the context
    for (vptr, mptr, arg) in [(0x2000_0002u64, 0x3000_0000u64, "values"), (0x2000_0000, 0x3000_0002, "meta")] {
        let (vs, ms) = sp(512, 256, DType::BF16);
        let out = view(t(&[512, 256], DType::BF16), 0x1000_0000);
        let r = decompress(&view(vs, vptr), &view(ms, mptr), &out, 0);
        check_err(r, "Argument", arg, &["16-byte aligned", "address 0x"]);
        let (vs, ms) = sp(512, 256, DType::BF16);
        let bad = view(t(&[1], DType::I32), 0x4000_0000);
        let r = compress(&out, &view(vs, vptr), &view(ms, mptr), &bad, false, 0);
        check_err(r, "Argument", arg, &["16-byte aligned"]);
    }
}

/// The workspace a wgmma_sp plan asks the caller for (src/ops/workspace.rs) on a 132-SM sm_90a
/// device: split-k chunks, fused split-k slots + counters per tile, stream-K slots + counters per
/// CTA, nothing for whole tiles.
#[test]
fn wgmma_plans_size_their_workspace() {
    use crate::tuning::sparse24::{FusePolicy, SplitPolicy};
    let plan_of = |rows: i64, n: i64, k: i64, knobs: &Knobs| {
        let (v, m) = sp(n, k, DType::BF16);
        let x = t(&[rows, k], DType::BF16);
        let out = t(&[rows, n], DType::BF16);
        let p = validate_matmul(&x, &v, &m, Some(&out), None, n, k, "none").unwrap();
        let plan = wgmma_plan(&p, &view(x, 0x10000), Arch::Sm90a, 132, knobs).unwrap();
        (plan, plan.workspace(&p))
    };
    let only256 = Knobs { wgmma_sp_tile: TilePolicy::Only256, ..Knobs::default() };
    // split-k (auto, unfused): 256 x 4096 x 11008 -> 4 chunks of (256, 4096) fp32
    let unfused = Knobs { sparse24_splitk_fuse: FusePolicy::Off, ..only256 };
    let (plan, ws) = plan_of(256, 4096, 11008, &unfused);
    let WgmmaLaunch::Split { split, .. } = plan.launch else { panic!("{plan:?}") };
    assert_eq!(split.splits, 4);
    assert_eq!((ws.slots, ws.slot_bytes, ws.counters), (4, 256 * 4096 * 4, 0));
    // n % 4 != 0: the chunks' rows are padded to a multiple of 4 columns
    let forced = Knobs { sparse24_splitk: SplitPolicy::Force(3), ..unfused };
    let (plan, ws) = plan_of(300, 1030, 4160, &forced);
    assert!(matches!(plan.launch, WgmmaLaunch::Split { split: WgmmaSplit { splits: 3, .. }, .. }), "{plan:?}");
    assert_eq!(ws.bytes(), 3 * 300 * 1032 * 4);
    // fused split-k (2 chunks, fuse auto): one 128 KiB slot and one counter per 128 x 256 tile
    let two = Knobs { sparse24_splitk: SplitPolicy::Force(2), ..only256 };
    let (plan, ws) = plan_of(512, 4096, 11008, &two);
    let WgmmaLaunch::SplitFused { grid, .. } = plan.launch else { panic!("{plan:?}") };
    assert_eq!((plan.tiles, grid), (4 * 16, 128));
    assert_eq!((ws.slots, ws.slot_bytes, ws.counters), (64, 128 * 1024, 64));
    assert_eq!(ws.bytes(), 64 * 128 * 1024 + 64 * 4);
    // more units than SMs (256 on a balanced grid of 128 CTAs): still one slot per tile
    let (plan, ws) = plan_of(1024, 4096, 4096, &Knobs { sparse24_splitk_fuse: FusePolicy::On, ..two });
    assert!(matches!(plan.launch, WgmmaLaunch::SplitFused { grid: 128, .. }), "{plan:?}");
    assert_eq!(ws.bytes(), 128 * 128 * 1024 + 128 * 4);
    // stream-K (forced on): one slot and one counter per CTA, at most one CTA per SM
    let sk = Knobs { wgmma_sp_streamk: StreamKPolicy::On, ..Knobs::default() };
    let (plan, ws) = plan_of(2048, 4096, 4096, &sk);
    let WgmmaLaunch::StreamK { grid, .. } = plan.launch else { panic!("{plan:?}") };
    assert_eq!(grid, 132);
    assert_eq!((ws.slots, ws.slot_bytes, ws.counters), (132, 128 * 1024, 132));
    // whole tiles (a full wave), split-k off: no workspace
    let (plan, ws) = plan_of(2048, 4096, 4096, &only256);
    assert!(matches!(plan.launch, WgmmaLaunch::Tiles(_)), "{plan:?}");
    assert!(ws.is_empty());
    let off = Knobs { sparse24_splitk: SplitPolicy::Off, ..only256 };
    assert!(plan_of(256, 4096, 11008, &off).1.is_empty());
    // wgmma_sp cannot run: the plan is the error the launch gives, naming backend
    let (v, m) = sp(64, 64, DType::BF16);
    let (x, out) = (t(&[64, 64], DType::BF16), t(&[64, 64], DType::BF16));
    let p = validate_matmul(&x, &v, &m, Some(&out), None, 64, 64, "none").unwrap();
    check_err(wgmma_plan(&p, &view(x.clone(), 0x10002), Arch::Sm90a, 132, &only256), "Argument", "backend", &["16-byte"]);
    check_err(wgmma_plan(&p, &view(x, 0x10000), Arch::Sm80, 108, &only256), "Argument", "backend", &["sm_90"]);
}
