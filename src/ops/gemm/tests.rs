use crate::tuning::gemm_problem::{Activation, GemmProblem, Operand};
use super::wmma::{launch_shape, params, production_specs, GemmWmmaParams};
use super::*;
use crate::jit::KernelSpec;
use crate::ops::test_support::{check_err, header_fields, t};
use crate::tensor::Device;
use crate::tuning::gemm::{wmma_config, GemmWmmaConfig, WmmaTile};

/// a (batch, m, k), b (batch, k, n), out (batch, m, n), all contiguous on cuda:0.
fn metas(batch: i64, m: i64, n: i64, k: i64, d: DType, od: DType) -> (TensorMeta, TensorMeta, TensorMeta) {
    (t(&[batch, m, k], d), t(&[batch, k, n], d), t(&[batch, m, n], od))
}

fn ok(a: &TensorMeta, b: &TensorMeta, o: &TensorMeta) -> Result<(Sizes, Activation)> {
    validate(a, b, o, None, None, None, 0.0, "none")
}

#[test]
fn valid_calls_report_sizes() {
    let (a, b, o) = metas(3, 5, 7, 9, DType::BF16, DType::F32);
    let (s, act) = validate(&a, &b, &o, None, None, None, 0.0, "gelu_erf").unwrap();
    assert_eq!(s, Sizes { batch: 3, m: 5, n: 7, k: 9 });
    assert_eq!(act, Activation::GeluErf);
    // column-major a and b (transposed views), broadcast a, c broadcast over the batch
    let mut a2 = a.clone();
    a2.strides = vec![0, 1, 5];
    let mut b2 = b.clone();
    b2.strides = vec![63, 1, 9];
    let mut c = t(&[1, 5, 7], DType::F32);
    c.strides = vec![0, 7, 1];
    let bias = t(&[7], DType::BF16);
    let aux = t(&[3, 5, 7], DType::F32);
    validate(&a2, &b2, &o, Some(&c), Some(&bias), Some(&aux), 1.0, "silu").unwrap();
    // c is ignored when beta == 0 (even a wrong one)
    let junk = t(&[2, 2], DType::I32);
    validate(&a, &b, &o, Some(&junk), None, None, 0.0, "relu").unwrap();
    // size-1 dims may have any stride
    let (mut a1, b1, o1) = metas(1, 1, 4, 6, DType::F16, DType::F16);
    a1.strides = vec![99, 99, 3];
    ok(&a1, &b1, &o1).unwrap();
}

#[test]
fn dtype_errors_name_the_argument() {
    let (a, b, o) = metas(1, 4, 4, 4, DType::F32, DType::F32);
    check_err(ok(&a, &b, &o), "DType", "a", &["float16 or bfloat16", "float32"]);
    let (a, _, o) = metas(1, 4, 4, 4, DType::F16, DType::F32);
    let b = t(&[1, 4, 4], DType::BF16);
    check_err(ok(&a, &b, &o), "DType", "b", &["float16 (a's dtype)", "bfloat16"]);
    let (a, b, _) = metas(1, 4, 4, 4, DType::F16, DType::F32);
    let o = t(&[1, 4, 4], DType::F64);
    check_err(ok(&a, &b, &o), "DType", "out", &["float16, bfloat16 or float32", "float64"]);
    let (a, b, o) = metas(1, 4, 4, 4, DType::BF16, DType::F32);
    let c = t(&[1, 4, 4], DType::BF16);
    check_err(validate(&a, &b, &o, Some(&c), None, None, 1.0, "none"), "DType", "c", &["float32 (out's dtype)", "bfloat16"]);
    let bias = t(&[4], DType::F16);
    check_err(validate(&a, &b, &o, None, Some(&bias), None, 0.0, "none"), "DType", "bias", &["bfloat16 (a's dtype) or float32", "float16"]);
    let aux = t(&[1, 4, 4], DType::F16);
    check_err(validate(&a, &b, &o, None, None, Some(&aux), 0.0, "none"), "DType", "aux", &["float32 (out's dtype)"]);
}

#[test]
fn shape_and_stride_errors_name_the_argument() {
    let (a, b, o) = metas(2, 4, 6, 8, DType::F16, DType::F16);
    check_err(ok(&t(&[4, 8], DType::F16), &b, &o), "Argument", "a", &["3 dims (batch, m, k)", "2 dims"]);
    check_err(ok(&a, &t(&[2, 7, 6], DType::F16), &o), "Argument", "b", &["(2, 8, n >= 1)", "(2, 7, 6)"]);
    check_err(ok(&a, &t(&[3, 8, 6], DType::F16), &o), "Argument", "b", &["(2, 8, n >= 1)"]);
    check_err(ok(&a, &b, &t(&[2, 4, 5], DType::F16)), "Argument", "out", &["(batch, m, n) = (2, 4, 6)", "(2, 4, 5)"]);
    // empty dims
    let (a0, b0, o0) = metas(2, 0, 6, 8, DType::F16, DType::F16);
    check_err(ok(&a0, &b0, &o0), "Argument", "a", &["m >= 1"]);
    let (a0, b0, o0) = metas(2, 4, 6, 0, DType::F16, DType::F16);
    check_err(ok(&a0, &b0, &o0), "Argument", "a", &["k >= 1"]);
    let (a0, b0, o0) = metas(2, 4, 0, 8, DType::F16, DType::F16);
    check_err(ok(&a0, &b0, &o0), "Argument", "b", &["n >= 1"]);
    // neither of the last two dims of stride 1
    let mut a2 = a.clone();
    a2.strides = vec![64, 16, 2];
    check_err(ok(&a2, &b, &o), "Argument", "a", &["stride 1 in one of the last two dims", "[64, 16, 2]"]);
    let mut b2 = b.clone();
    b2.strides = vec![-48, 6, 1];
    check_err(ok(&a, &b2, &o), "Argument", "b", &["non-negative strides", "-48"]);
    // out column-major, out overlapping itself, out broadcast over the batch
    let mut o2 = o.clone();
    o2.strides = vec![24, 1, 4];
    check_err(ok(&a, &b, &o2), "Argument", "out", &["stride 1 in the last dim"]);
    let mut o3 = o.clone();
    o3.strides = vec![24, 3, 1];
    check_err(ok(&a, &b, &o3), "Argument", "out", &["non-overlapping"]);
    let mut o4 = o.clone();
    o4.strides = vec![0, 6, 1];
    check_err(ok(&a, &b, &o4), "Argument", "out", &["non-overlapping"]);
    // c: required when beta != 0, shape, broadcast allowed only for c
    check_err(validate(&a, &b, &o, None, None, None, 0.5, "none"), "Argument", "c", &["beta = 0.5 != 0", "None"]);
    let c = t(&[2, 4, 5], DType::F16);
    check_err(validate(&a, &b, &o, Some(&c), None, None, 1.0, "none"), "Argument", "c", &["(2, 4, 6) (or batch 1, broadcast)"]);
    let aux1 = t(&[1, 4, 6], DType::F16);
    check_err(validate(&a, &b, &o, None, None, Some(&aux1), 0.0, "none"), "Argument", "aux", &["(2, 4, 6)", "(1, 4, 6)"]);
    // bias shape and contiguity
    let bias = t(&[5], DType::F16);
    check_err(validate(&a, &b, &o, None, Some(&bias), None, 0.0, "none"), "Argument", "bias", &["(n,) = (6,)", "(5,)"]);
    let mut bias2 = t(&[6], DType::F32);
    bias2.strides = vec![2];
    check_err(validate(&a, &b, &o, None, Some(&bias2), None, 0.0, "none"), "Argument", "bias", &["contiguous", "stride 2"]);
    // activation names
    check_err(validate(&a, &b, &o, None, None, None, 0.0, "gelu"), "Argument", "activation", &["one of none, relu, gelu_tanh, gelu_erf, silu", "\"gelu\""]);
    // sizes beyond int32
    let (ab, bb, ob) = metas(1, 1 << 31, 2, 2, DType::F16, DType::F16);
    check_err(ok(&ab, &bb, &ob), "Argument", "a", &["m <= 2147483647"]);
}

#[test]
fn device_errors_come_after_argument_errors() {
    let (mut a, b, o) = metas(1, 4, 4, 4, DType::F16, DType::F16);
    a.device = Device::CPU;
    let mut b_cpu = b.clone();
    b_cpu.device = Device::CPU;
    let mut o_cpu = o.clone();
    o_cpu.device = Device::CPU;
    check_err(ok(&a, &b_cpu, &o_cpu), "Device", "a", &["a CUDA tensor", "cpu"]);
    let (a, b, o) = metas(1, 4, 4, 4, DType::F16, DType::F16);
    let mut b1 = b.clone();
    b1.device = Device::cuda(1);
    check_err(ok(&a, &b1, &o), "Device", "b", &["a tensor on cuda:0 (a's device)", "cuda:1"]);
    let mut bias = t(&[4], DType::F16);
    bias.device = Device::cuda(1);
    check_err(validate(&a, &b, &o, None, Some(&bias), None, 0.0, "none"), "Device", "bias", &["cuda:1"]);
    // an argument error on CPU tensors is reported as such (CPU-testable)
    let (mut a, mut b, mut o) = metas(1, 4, 4, 4, DType::F16, DType::F16);
    for x in [&mut a, &mut b, &mut o] {
        x.device = Device::CPU;
    }
    check_err(validate(&a, &b, &o, None, None, None, 0.0, "tanh"), "Argument", "activation", &["\"tanh\""]);
}

fn view(meta: TensorMeta, ptr: u64) -> TensorView {
    TensorView { meta, ptr }
}

#[test]
fn problem_normalises_operands_and_rejects_overlap() {
    let (a, b, o) = metas(2, 4, 6, 8, DType::F16, DType::F32);
    let mut bt = b.clone();
    bt.strides = vec![48, 1, 8]; // column-major b
    let (av, bv, ov) = (view(a, 0x1000), view(bt, 0x2000), view(o, 0x3000));
    let p = problem(&av, &bv, &ov, None, None, None, 2.0, 0.0, "relu").unwrap();
    assert_eq!((p.batch, p.m, p.n, p.k), (2, 4, 6, 8));
    assert!(p.a.row_major() && p.a.leading_dim() == 8 && p.a.batch_stride == 32);
    assert!(!p.b.row_major() && p.b.leading_dim() == 8 && p.b.batch_stride == 48);
    assert_eq!((p.out.row_stride, p.out.batch_stride, p.out.dtype), (6, 24, DType::F32));
    assert_eq!((p.alpha, p.activation, p.c), (2.0, Activation::Relu, None));
    // the scales must be finite in fp32
    for (alpha, beta, arg) in [(f32::NAN, 0.0, "alpha"), (f32::INFINITY, 0.0, "alpha"), (1.0, f32::NEG_INFINITY, "beta")] {
        check_err(problem(&av, &bv, &ov, None, None, None, alpha, beta, "relu"), "Argument", arg, &["finite in float32"]);
    }
    // beta == 0: c dropped even when given
    let cv = view(t(&[2, 4, 6], DType::F32), 0x5000);
    let p = problem(&av, &bv, &ov, Some(&cv), None, None, 1.0, 0.0, "none").unwrap();
    assert_eq!(p.c, None);
    // out over a (in place), aux over out, out over bias
    let over_a = view(ov.meta.clone(), 0x1000 + 16);
    check_err(problem(&av, &bv, &over_a, None, None, None, 1.0, 0.0, "none"), "Argument", "out", &["does not overlap a"]);
    let aux = view(ov.meta.clone(), 0x3000 + 8);
    check_err(problem(&av, &bv, &ov, None, None, Some(&aux), 1.0, 0.0, "none"), "Argument", "out", &["does not overlap aux"]);
    let bias = view(t(&[6], DType::F32), 0x3000 + 40);
    check_err(problem(&av, &bv, &ov, None, Some(&bias), None, 1.0, 0.0, "none"), "Argument", "out", &["does not overlap bias"]);
    // NULL data
    let null_b = view(bv.meta.clone(), 0);
    check_err(problem(&av, &null_b, &ov, None, None, None, 1.0, 0.0, "none"), "Argument", "b", &["non-NULL"]);
}

fn problem_of(batch: i64, m: i64, n: i64, k: i64) -> GemmProblem {
    crate::tuning::gemm_problem::row_major_problem(batch, m, n, k, DType::BF16, DType::F32)
}

#[test]
fn work_counts_flops_and_compulsory_bytes() {
    let mut p = problem_of(3, 100, 60, 40);
    let w = super::work::gemm(&p);
    assert_eq!(w.flops, 2.0 * 3.0 * 100.0 * 60.0 * 40.0);
    assert_eq!(w.bytes, 3.0 * (100.0 * 40.0 * 2.0 + 40.0 * 60.0 * 2.0 + 100.0 * 60.0 * 4.0));
    assert!(w.exact);
    // broadcast b counts once; c (broadcast), bias (bf16) and aux add their bytes
    p.b.batch_stride = 0;
    let mut c = p.out;
    c.batch_stride = 0;
    p.c = Some(c);
    p.beta = 1.0;
    p.bias = Some((0x20000, DType::BF16));
    p.aux = Some(p.out);
    let w = super::work::gemm(&p);
    let a = 3.0 * 100.0 * 40.0 * 2.0;
    let b = 40.0 * 60.0 * 2.0;
    let out = 3.0 * 100.0 * 60.0 * 4.0;
    assert_eq!(w.bytes, a + b + out + 100.0 * 60.0 * 4.0 + 60.0 * 2.0 + out);
}

#[test]
fn backend_choice() {
    let k = crate::tuning::knobs::Knobs::default();
    let choose_backend = |p: &GemmProblem, arch, backend| choose_backend(p, arch, &k, backend);
    let p = problem_of(1, 64, 64, 64);
    for arch in [Arch::Sm80, Arch::Sm90a] {
        assert_eq!(choose_backend(&p, arch, "wmma").unwrap(), "wmma");
        let auto = choose_backend(&p, arch, "auto").unwrap();
        assert!(backends_for(arch).contains(&auto));
    }
    assert_eq!(backends_for(Arch::Sm80), vec!["wmma"]);
    assert_eq!(backends_for(Arch::Sm90a), vec!["sm90", "wmma"]);
    // a 2-byte aligned operand: sm90 (TMA) cannot take it; auto falls back to wmma
    let mut odd = problem_of(1, 64, 64, 64);
    odd.a.ptr += 2;
    assert_eq!(choose_backend(&odd, Arch::Sm90a, "auto").unwrap(), "wmma");
    check_err(choose_backend(&odd, Arch::Sm90a, "sm90"), "Argument", "backend", &["[\"wmma\"]", "does not support this problem"]);
    check_err(choose_backend(&p, Arch::Sm80, "sm90"), "Argument", "backend", &["[\"wmma\"]", "\"sm90\" (this device (sm_80) has no sm90 path)"]);
    check_err(choose_backend(&p, Arch::Sm80, "cublas"), "Argument", "backend", &["\"auto\", \"wmma\", \"sm90\"", "\"cublas\""]);
}

#[test]
fn launch_shape_and_params() {
    let p = problem_of(1 << 20, 3, 17, 5);
    let cfg = wmma_config(&p, None, 132, Arch::Sm90a);
    // k = 5: a's rows are 10 bytes apart -> 2-byte copies, the narrow path takes SMALL
    assert_eq!((cfg.vec_a, cfg.vec_b, cfg.tile), (1, 1, WmmaTile::SMALL));
    let s = launch_shape(&p, &cfg);
    assert_eq!(s.grid, (1, 65535, 1));
    assert_eq!(s.block, (128, 1, 1));
    assert_eq!(s.dynamic_smem_bytes, cfg.smem_bytes());
    s.check().unwrap();
    let mut p = problem_of(2, 4096, 4096, 4096);
    p.bias = Some((0x40000, DType::F32));
    let cfg = wmma_config(&p, None, 132, Arch::Sm90a);
    assert_eq!((cfg.vec_a, cfg.vec_b, cfg.tile), (8, 8, WmmaTile::LARGE_SM90));
    let s = launch_shape(&p, &cfg);
    assert_eq!(s.grid, (32 * 16, 2, 1));
    let prm = params(&p, &cfg);
    assert_eq!((prm.tiles_m, prm.tiles_n, prm.m, prm.batch), (32, 16, 4096, 2));
    assert_eq!((prm.a_ld, prm.b_ld, prm.out_ld, prm.out_batch_stride), (4096, 4096, 4096, 4096 * 4096));
    assert_eq!((prm.bias_f32, prm.beta, prm.c), (1, 0.0, std::ptr::null()));
    // sm_86 (99 KiB of shared memory per block) cannot hold LARGE's ring: MEDIUM
    assert_eq!(wmma_config(&p, None, 84, Arch::Sm86).tile, WmmaTile::MEDIUM);
    // the persistent tile (opt-in override): one row of the grid, balanced over the items
    // (tiles x batch; 2 x 512 = 1024 items on 132 SMs: 8 waves -> 128 CTAs), same block and smem
    let balanced = crate::tuning::grid::GridPolicy::Balanced;
    let ps = WmmaTile { persistent: true, ..WmmaTile::LARGE_SM90 };
    let cfg = wmma_config(&p, Some(ps), 132, Arch::Sm90a);
    let s = super::wmma::persistent_shape(&p, &cfg, 132, balanced);
    assert_eq!((s.grid, s.block, s.dynamic_smem_bytes), ((128, 1, 1), (256, 1, 1), cfg.smem_bytes()));
    let big = problem_of(1 << 20, 128, 256, 64); // a batch of 2^20 one-tile entries
    let s = super::wmma::persistent_shape(&big, &wmma_config(&big, Some(ps), 132, Arch::Sm90a), 132, balanced);
    assert_eq!(s.grid, (132, 1, 1));
    s.check().unwrap();
}

#[test]
fn params_mirror_the_kernel_header() {
    let names = header_fields("gemm/wmma.cuh", "GemmWmmaParams");
    assert_eq!(
        names,
        [
            "a", "b", "out", "c", "bias", "aux", "a_ld", "a_batch_stride", "b_ld", "b_batch_stride",
            "out_ld", "out_batch_stride", "c_ld", "c_batch_stride", "aux_ld", "aux_batch_stride",
            "batch", "m", "n", "k", "tiles_m", "tiles_n", "alpha", "beta", "activation", "bias_f32", "group",
            "sk_first", "sk_ws", "sk_flags"
        ]
    );
    assert_eq!(std::mem::size_of::<GemmWmmaParams>(), 6 * 8 + 11 * 8 + 5 * 4 + 4 * 4 + 4 + 3 * 8);
    crate::ops::test_support::check_layout_with_nvrtc::<GemmWmmaParams>("gemm/wmma.cuh", "ferroattn::GemmWmmaParams");
}

#[test]
fn activation_codes_match_the_header() {
    let text = crate::jit::sources::get("common/activation.cuh").unwrap();
    for (name, act) in [
        ("kActNone", Activation::None),
        ("kActRelu", Activation::Relu),
        ("kActGeluTanh", Activation::GeluTanh),
        ("kActGeluErf", Activation::GeluErf),
        ("kActSilu", Activation::Silu),
    ] {
        assert!(text.contains(&format!("{name} = {}", act.code())), "{name}");
    }
}

/// The Rust smem formula equals the kernel's constexpr for every production config and a few
/// others (NVRTC static_assert; skipped without the toolchain).
#[test]
fn smem_formula_matches_the_kernel() {
    let Some(arch) = crate::jit::nvrtc::tests::toolchain() else { return };
    let mut cfgs: Vec<GemmWmmaConfig> = production_specs(arch);
    for (a, b) in [(true, true), (false, false)] {
        cfgs.push(GemmWmmaConfig { tile: WmmaTile::MEDIUM, a_row_major: a, b_row_major: b, ..cfgs[0] });
    }
    let mut src = String::from("#include \"gemm/wmma.cuh\"\n");
    for c in &cfgs {
        let t = &c.tile;
        src += &format!(
            "static_assert(ferroattn::gemm_wmma_smem_bytes<{}, {}, {}, {}, {}, {}, {}, {}>() == {}, \"smem\");\n",
            t.bm, t.bn, t.bk, t.warps_m, t.warps_n, t.stages, c.a_row_major, c.b_row_major, c.smem_bytes()
        );
    }
    // the persistent tile's formula (opt-in tile override)
    for (a, b) in [(true, true), (true, false), (false, true), (false, false)] {
        let c = GemmWmmaConfig {
            tile: WmmaTile { persistent: true, ..WmmaTile::LARGE_SM90 },
            a_row_major: a,
            b_row_major: b,
            ..cfgs[0]
        };
        let t = &c.tile;
        src += &format!(
            "static_assert(ferroattn::gemm_wmma_persistent_smem_bytes<{}, {}, {}, {}, {}, {}, {}, {}>() == {}, \"smem\");\n",
            t.bm, t.bn, t.bk, t.warps_m, t.warps_n, t.stages, a, b, c.smem_bytes()
        );
    }
    src += "__global__ void probe() {}\n";
    let opts = crate::jit::nvrtc::options(arch).unwrap();
    crate::jit::nvrtc::compile(&src, "probe", &opts, arch.name()).unwrap();
}

#[test]
fn production_specs_cover_the_aligned_heuristic() {
    for arch in [Arch::Sm80, Arch::Sm90a] {
        let specs = production_specs(arch);
        for (m, n, batch) in [(4096, 4096, 1), (2048, 2048, 1), (16, 4096, 1), (104, 104, 1), (1024, 1024, 64)] {
            for (ar, br) in [(true, true), (true, false), (false, true), (false, false)] {
                let mut p = problem_of(batch, m, n, 64);
                if !ar {
                    p.a = Operand { row_stride: 1, col_stride: m, ..p.a };
                }
                if !br {
                    p.b = Operand { row_stride: 1, col_stride: 64, ..p.b };
                }
                let c = wmma_config(&p, None, 132, arch);
                assert!(specs.contains(&c), "{c:?} not precompiled");
                assert_eq!(c.header(), "gemm/wmma.cuh");
            }
        }
    }
}

/// Every production configuration compiles for sm_80 and sm_90a without spills (slow: ~100
/// NVRTC compiles; `python -m ferroattn precompile --check-spills` runs the same in CI).
#[test]
#[ignore]
fn production_specs_compile_without_spills() {
    let Some(_) = crate::jit::nvrtc::tests::toolchain() else { return };
    let specs: Vec<_> = [Arch::Sm80, Arch::Sm90a].into_iter().flat_map(production_specs).collect();
    let reports = crate::jit::precompile::precompile(&specs).unwrap();
    for r in &reports {
        eprintln!("{} {} regs {} spills {}/{}", r.config, r.arch, r.resources.registers, r.resources.spill_stores, r.resources.spill_loads);
    }
    crate::jit::precompile::check_spills(&reports).unwrap();
}

/// The workspace a plan asks the caller for (src/ops/workspace.rs): the sm90 split-k chunks, the
/// wmma stream-k tail's partial tiles and flags, nothing otherwise.
#[test]
fn plans_size_their_workspace() {
    use crate::tuning::gemm_sm90::SplitK;
    let k = Knobs::default();
    // sm90, m = 16, n = k = 4096 on 132 SMs: 16 tiles -> 8 chunks of 512 -> 8 x (16, 4096) fp32
    let p = crate::tuning::gemm_problem::row_major_problem(1, 16, 4096, 4096, DType::BF16, DType::BF16);
    let l = plan(&p, "sm90", Arch::Sm90a, 132, &k).unwrap();
    assert_eq!(l, Launch::Sm90 { split: Some(SplitK { splits: 8, kc: 512 }) });
    assert_eq!(l.backend(), "sm90");
    let w = l.workspace(&p);
    assert_eq!((w.slots, w.slot_bytes, w.counters), (8, 16 * 4096 * 4, 0));
    assert_eq!(w.bytes(), 2 << 20);
    // out fp32 does not change the chunks (always fp32)
    let p32 = crate::tuning::gemm_problem::row_major_problem(1, 16, 4096, 4096, DType::BF16, DType::F32);
    assert_eq!(plan(&p32, "sm90", Arch::Sm90a, 132, &k).unwrap().workspace(&p32).bytes(), 2 << 20);
    // k = 11008: 4 chunks; m = 100, n = 256 (1 tile), k = 4096: 32 chunks
    let q = crate::tuning::gemm_problem::row_major_problem(1, 16, 4096, 11008, DType::F16, DType::F16);
    assert_eq!(plan(&q, "sm90", Arch::Sm90a, 132, &k).unwrap().workspace(&q).bytes(), 4 * 16 * 4096 * 4);
    let q = crate::tuning::gemm_problem::row_major_problem(1, 100, 256, 4096, DType::F16, DType::F16);
    assert_eq!(plan(&q, "sm90", Arch::Sm90a, 132, &k).unwrap().workspace(&q).bytes(), 32 * 100 * 256 * 4);
    // no split: many tiles, a batch, k not a multiple of 64, the knob off -> no workspace
    for q in [
        crate::tuning::gemm_problem::row_major_problem(1, 2048, 4096, 4096, DType::BF16, DType::BF16),
        crate::tuning::gemm_problem::row_major_problem(2, 16, 4096, 4096, DType::BF16, DType::BF16),
        crate::tuning::gemm_problem::row_major_problem(1, 16, 4096, 1000, DType::BF16, DType::BF16),
    ] {
        let l = plan(&q, "sm90", Arch::Sm90a, 132, &k).unwrap();
        assert_eq!(l, Launch::Sm90 { split: None });
        assert!(l.workspace(&q).is_empty());
    }
    let off = Knobs { gemm_sm90_splitk: false, ..k };
    assert!(plan(&p, "sm90", Arch::Sm90a, 132, &off).unwrap().workspace(&p).is_empty());
    // wmma: 26 x 41 = 1066 items of the persistent 128 x 256 tile on 132 SMs (8 waves + 10): a
    // stream-k tail on 132 CTAs -> 132 partial tiles of 128 x 256 fp32, then 132 x 8 warps flags
    let big = crate::tuning::gemm_problem::row_major_problem(1, 26 * 128, 41 * 256, 512, DType::BF16, DType::BF16);
    let Launch::Wmma(w) = plan(&big, "wmma", Arch::Sm90a, 132, &k).unwrap() else { panic!("not wmma") };
    assert_eq!(w.config.tile, WmmaTile::LARGE_SM90);
    assert_eq!(w.stream_k.map(|s| (s.grid, s.sk_first)), Some((132, 7 * 132)));
    assert_eq!(w.shape.grid, (132, 1, 1));
    let ws = w.workspace();
    assert_eq!((ws.slots, ws.slot_bytes, ws.counters), (132, 128 * 256 * 4, 132 * 8));
    assert_eq!(ws.bytes(), 132 * 128 * 256 * 4 + 132 * 8 * 4);
    assert_eq!(Launch::Wmma(w).workspace(&big), ws);
    // the tail off, or whole waves only: no workspace
    let sk_off = Knobs { gemm_wmma_streamk: crate::tuning::gemm::StreamK::Off, ..k };
    assert!(plan(&big, "wmma", Arch::Sm90a, 132, &sk_off).unwrap().workspace(&big).is_empty());
    let whole = crate::tuning::gemm_problem::row_major_problem(1, 24 * 128, 44 * 256, 512, DType::BF16, DType::BF16); // 1056 = 8 x 132
    assert!(plan(&whole, "wmma", Arch::Sm90a, 132, &k).unwrap().workspace(&whole).is_empty());
    // the small problem on wmma: not persistent, no tail
    assert!(plan(&p, "wmma", Arch::Sm90a, 132, &k).unwrap().workspace(&p).is_empty());
}
