use super::*;
use std::mem::{offset_of, size_of};

#[test]
fn params_mirror_the_cuda_layout() {
    assert_eq!(size_of::<AttnFwdParams>(), 296);
    assert_eq!(offset_of!(AttnKvcacheParams, seqlens_k), 296);
    assert_eq!(offset_of!(AttnKvcacheParams, block_table_batch_stride), 296 + 48);
    assert_eq!(offset_of!(AttnKvcacheParams, group), 296 + 56 + 20);
    assert_eq!(size_of::<AttnKvcacheParams>(), 376);
    assert_eq!(offset_of!(KvAppendParams, kn), 88);
    assert_eq!(offset_of!(KvAppendParams, batch), 88 + 19 * 8);
    assert_eq!(size_of::<KvAppendParams>(), 88 + 19 * 8 + 13 * 4 + 4);
}

fn meta(shape: &[i64], dtype: DType) -> TensorMeta {
    TensorMeta { shape: shape.to_vec(), strides: TensorMeta::contiguous_strides(shape), dtype, device: crate::tensor::Device::cuda(0) }
}

#[test]
fn a_paged_cache_holds_its_block_tables_pages() {
    let q = meta(&[2, 1, 8, 128], DType::BF16);
    let k = meta(&[10, 16, 2, 128], DType::BF16);
    let bt = meta(&[2, 5], DType::I32);
    let sl = meta(&[2], DType::I32);
    let kv = KvCache { cache_seqlens: Some(&sl), block_table: Some(&bt), ..Default::default() };
    let p = validate(&q, &k, &k, None, None, None, None, 0, &kv).unwrap();
    assert!(p.cache.paged);
    assert_eq!((p.cache.cache_rows, p.cache.page_size, p.cache.cache_batches), (80, 16, 10));
    assert_eq!(p.base.seqlen_k, 80);
}

#[test]
fn bad_cache_arguments_name_themselves() {
    let q = meta(&[2, 1, 8, 64], DType::F16);
    let k = meta(&[2, 100, 2, 64], DType::F16);
    let err = |kv: &KvCache<&TensorMeta>, k: &TensorMeta| validate(&q, k, k, None, None, None, None, 0, kv).unwrap_err().to_string();
    let bad_sl = meta(&[3], DType::I32);
    assert!(err(&KvCache { cache_seqlens: Some(&bad_sl), ..Default::default() }, &k).contains("cache_seqlens"));
    let bad_dtype = meta(&[2], DType::I64);
    assert!(err(&KvCache { cache_seqlens: Some(&bad_dtype), ..Default::default() }, &k).contains("cache_seqlens"));
    let bt = meta(&[2, 4], DType::I32);
    let lp = meta(&[2], DType::I32);
    assert!(err(&KvCache { block_table: Some(&bt), cache_leftpad: Some(&lp), ..Default::default() }, &k).contains("cache_leftpad"));
    let small = meta(&[1, 100, 2, 64], DType::F16);
    assert!(err(&KvCache::default(), &small).contains("k_cache"));
    let heads = meta(&[2, 100, 3, 64], DType::F16);
    assert!(err(&KvCache::default(), &heads).contains("k_cache"));
    let too_many = KvCache { seqlen_k_add: 101, ..Default::default() };
    assert!(err(&too_many, &k).contains("k"));
}

/// The kv-cache kernels (split forward at every production point, combine, append) compile
/// without spills for sm_80 and sm_90a (`precompile --check-spills` covers them too; alone:
/// `cargo test --release -- --ignored kvcache_kernels_do_not_spill --nocapture`).
#[test]
#[ignore]
fn kvcache_kernels_do_not_spill() {
    if crate::jit::nvrtc::tests::toolchain().is_none() {
        return;
    }
    let mut reports = Vec::new();
    for arch in [Arch::Sm80, Arch::Sm90a] {
        let mut specs = production_specs(arch);
        // ALiBi (flash_attn_with_kvcache takes slopes) and a tail head dim compile too
        specs.push(kvcache_config(96, false, crate::ops::attention::VariantKind { alibi: true, ..crate::ops::attention::VariantKind::CAUSAL }, DType::F16, arch));
        reports.extend(crate::jit::precompile::precompile(&specs).unwrap());
        let (combine, append) = production_helper_specs(arch);
        reports.extend(crate::jit::precompile::precompile(&combine).unwrap());
        reports.extend(crate::jit::precompile::precompile(&append).unwrap());
    }
    for r in &reports {
        println!("{} {} regs {} spill {}/{} stack {}", r.config, r.arch, r.resources.registers, r.resources.spill_stores, r.resources.spill_loads, r.resources.stack_bytes);
    }
    crate::jit::precompile::check_spills(&reports).unwrap();
}

#[test]
fn the_split_count_is_validated() {
    assert!(plan_splits(0, 1, 1, 8, 8, 100, 64, false, 129).unwrap_err().to_string().contains("num_splits"));
    assert!(plan_splits(0, 1, 1, 8, 8, 100, 64, false, -1).is_err());
    assert_eq!(plan_splits(0, 0, 1, 8, 8, 100, 64, false, 0).unwrap(), 1);
}
