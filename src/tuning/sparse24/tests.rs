use super::*;
use crate::tuning::attention::tests::assert_fits_smem;

#[test]
fn heuristic_tiles_are_valid_and_fit() {
    for arch in Arch::ALL {
        for c in matmul_production_configs(arch) {
            assert!(c.tile.valid(), "{:?}", c.tile);
            assert_fits_smem(&c);
        }
    }
    assert_eq!(matmul_production_configs(Arch::Sm90a).len(), 2 * 5 * 5);
}

#[test]
fn tiles_fill_the_gpu() {
    let h = |rows, n| tile_for(rows, n, 132, Arch::Sm90a);
    assert_eq!(h(1, 4096), VEC_TILES[3]);
    assert_eq!(h(16, 14336), VEC_TILES[3]);
    assert_eq!(h(31, 4096), VEC_TILES[2]);
    assert_eq!(h(16384, 4096), VEC_TILES[0]);
    assert_eq!(h(1024, 4096), VEC_TILES[0], "256 blocks of 264 slots");
    assert_eq!(
        h(128, 4096),
        VEC_TILES[2],
        "128 x 128: 32 blocks; 64 x 64: 128"
    );
    assert_eq!(h(128, 14336), VEC_TILES[1]);
    assert_eq!(
        h(40, 128),
        VEC_TILES[3],
        "nothing fills the GPU: the smallest tile"
    );
    assert_eq!(resident_blocks(&VEC_TILES[0], Arch::Sm90a), 2);
    assert_eq!(resident_blocks(&VEC_TILES[0], Arch::Sm80), 1);
    assert_eq!(resident_blocks(&VEC_TILES[3], Arch::Sm90a), 6);
    // every production configuration is one the heuristic can pick (or the scalar tile)
    let prod = matmul_production_configs(Arch::Sm90a);
    for rows in [1u64, 7, 16, 17, 31, 33, 64, 65, 128, 1000, 4096] {
        for n in [128u64, 4096, 11008, 14336] {
            let c = matmul_config(
                rows,
                n,
                132,
                Activation::Relu,
                true,
                DType::BF16,
                Arch::Sm90a,
                None,
            );
            assert!(prod.contains(&c), "{c:?}");
        }
    }
}

#[test]
fn smem_formula() {
    let c = matmul_config(
        4096,
        4096,
        132,
        Activation::None,
        true,
        DType::BF16,
        Arch::Sm90a,
        None,
    );
    // 4 × (128·32·2 + 128·64·2 + 8·128) = 4 × 25600
    assert_eq!(c.smem_bytes(), 102_400);
    // sm_86 (99 KiB): one stage fewer
    let c = matmul_config(
        4096,
        4096,
        84,
        Activation::None,
        true,
        DType::BF16,
        Arch::Sm86,
        None,
    );
    assert_eq!(c.tile.block_n, 128);
    assert_eq!(c.tile.stages, 3);
    // the largest tile: 2 stages of 128 x 256 hold the 256 x (128 + 8) epilogue tile too
    let t = Tile {
        block_n: 128,
        block_r: 256,
        warps_n: 2,
        warps_r: 4,
        stages: 2,
    };
    let c = matmul_config(
        1,
        128,
        132,
        Activation::None,
        true,
        DType::F16,
        Arch::Sm90a,
        Some(t),
    );
    assert_eq!(c.smem_bytes(), 2 * (8192 + 32768 + 1024));
    assert!(c.smem_bytes() >= 256 * 136 * 2);
}

#[test]
fn name_expressions() {
    let c = matmul_config(
        7,
        128,
        108,
        Activation::Silu,
        false,
        DType::F16,
        Arch::Sm80,
        None,
    );
    assert_eq!(
        c.name_expression(),
        "ferroattn::sparse24_matmul_sm80<64, 64, 2, 2, 4, 4, false, __half>"
    );
    let c = Sparse24CompressConfig {
        kind: CompressKind::Decompress,
        dtype: DType::BF16,
        arch: Arch::Sm80,
    };
    assert_eq!(
        c.name_expression(),
        "ferroattn::sparse24_decompress<__nv_bfloat16>"
    );
}

#[test]
fn tile_override_parsing() {
    assert_eq!(
        Tile::parse("128, 64,2,2,3"),
        Some(Tile {
            block_n: 128,
            block_r: 64,
            warps_n: 2,
            warps_r: 2,
            stages: 3
        })
    );
    assert_eq!(Tile::parse("128,64,2,2"), None);
    assert_eq!(Tile::parse("96,64,2,2,3"), None, "block_n must divide 128");
    assert_eq!(Tile::parse("128,64,4,4,3"), None, "at most 8 warps");
    assert_eq!(Tile::parse("a,b,c,d,e"), None);
}

#[test]
fn wgmma_split_rule() {
    let auto = SplitPolicy::Auto;
    // 512 x 4096 x 11008: 64 tiles, 86 stages: two chunks fill 128 SMs
    assert_eq!(
        wgmma_split_plan(64, 86, 512, 4096, 132, auto),
        Some(WgmmaSplit { splits: 2, chunk_tiles: 43 })
    );
    // 256 x 4096 x 11008: 32 tiles -> 4 chunks of 22 (the last 20)
    assert_eq!(
        wgmma_split_plan(32, 86, 256, 4096, 132, auto),
        Some(WgmmaSplit { splits: 4, chunk_tiles: 22 })
    );
    // decode: 16 x 4096 x 4096, 16 tiles x 32 stages -> 8 chunks of 4
    assert_eq!(
        wgmma_split_plan(16, 32, 16, 4096, 132, auto),
        Some(WgmmaSplit { splits: 8, chunk_tiles: 4 })
    );
    // a full wave or more of tiles: no split (8192^3: 2048 tiles; 172 tiles = 1.3 waves)
    assert_eq!(wgmma_split_plan(2048, 64, 8192, 8192, 132, auto), None);
    assert_eq!(wgmma_split_plan(172, 32, 512, 11008, 132, auto), None);
    // 86 tiles x 32 stages: 3 chunks would be 2 waves of 11 stages, but 256 x 11008 fp32
    // partials x 3 cost more than the 10 stages saved
    assert_eq!(wgmma_split_plan(86, 32, 256, 11008, 132, auto), None);
    // too few stages to split
    assert_eq!(wgmma_split_plan(1, 1, 16, 256, 132, auto), None);
    assert_eq!(wgmma_split_plan(1, 7, 16, 256, 132, auto), None);
    assert_eq!(wgmma_split_plan(1, 8, 16, 256, 132, auto), None);
    assert_eq!(wgmma_split_plan(1, 16, 16, 256, 132, auto), Some(WgmmaSplit { splits: 4, chunk_tiles: 4 }));
    // forced and off
    assert_eq!(wgmma_split_plan(16, 32, 16, 4096, 132, SplitPolicy::Off), None);
    assert_eq!(
        wgmma_split_plan(172, 32, 512, 11008, 132, SplitPolicy::Force(3)),
        Some(WgmmaSplit { splits: 3, chunk_tiles: 11 })
    );
    assert_eq!(wgmma_split_plan(16, 32, 16, 4096, 132, SplitPolicy::Force(1)), None);
    // 5 chunks of 32 stages: chunk 7 -> 5 chunks (7,7,7,7,4); 12 of 32: chunk 3 -> 11 chunks
    assert_eq!(
        wgmma_split_plan(16, 32, 16, 4096, 132, SplitPolicy::Force(5)),
        Some(WgmmaSplit { splits: 5, chunk_tiles: 7 })
    );
    assert_eq!(
        wgmma_split_plan(16, 32, 16, 4096, 132, SplitPolicy::Force(12)),
        Some(WgmmaSplit { splits: 11, chunk_tiles: 3 })
    );
    assert_eq!(
        wgmma_split_plan(16, 3, 16, 4096, 132, SplitPolicy::Force(9)),
        Some(WgmmaSplit { splits: 3, chunk_tiles: 1 })
    );
    // every plan: chunks cover the stages exactly, none empty, within the limits
    for tiles in [1u64, 2, 5, 16, 33, 43, 64, 65, 66, 100, 131, 132] {
        for k_tiles in [2u64, 3, 8, 9, 31, 32, 33, 64, 86, 87, 128] {
            for rows in [1u64, 16, 128, 256, 1000] {
                let policies = [auto, SplitPolicy::Force(2), SplitPolicy::Force(7), SplitPolicy::Force(200)];
                for policy in policies {
                    if let Some(p) = wgmma_split_plan(tiles, k_tiles, rows, 4096, 132, policy) {
                        let (s, c) = (p.splits as u64, p.chunk_tiles as u64);
                        assert!(s >= 2 && c >= 1, "{p:?}");
                        assert!((s - 1) * c < k_tiles && s * c >= k_tiles, "{tiles} {k_tiles} {p:?}");
                        if policy == auto {
                            assert!(c >= WGMMA_SPLIT_MIN_CHUNK && s <= WGMMA_SPLIT_MAX, "{p:?}");
                        }
                    }
                }
            }
        }
    }
    // the partial-product kernel: Epi 2, no activation, no staging buffer
    let c = wgmma_split_config(DType::F16, Arch::Sm90a);
    assert_eq!(c.name_expression(), "ferroattn::sparse24_matmul_wgmma<__half, 128, 3, 0, 256, 2>");
    assert_eq!(c.smem_bytes(), wgmma_config_epilogue(Activation::None, DType::F16, Arch::Sm90a, 0).smem_bytes());
    assert!(wgmma_production_configs(Arch::Sm90a).contains(&c));
    // fused split-k (Epi 3): every activation, the staged epilogue's buffer, precompiled
    let fused = wgmma_fused_split_configs(Arch::Sm90a);
    assert_eq!(fused.len(), 10);
    assert!(fused.iter().all(|f| f.epilogue == 3 && f.meta_sets == 1));
    let f = fused[0];
    assert_eq!(f.smem_bytes(), Sparse24WgmmaConfig { epilogue: 1, ..f }.smem_bytes());
    assert!(f.name_expression().ends_with(", 256, 3>"), "{}", f.name_expression());
    assert!(wgmma_fused_split_configs(Arch::Sm80).is_empty());
    assert!(fused.iter().all(|f| wgmma_production_configs(Arch::Sm90a).contains(f)));
    // when the fused form runs
    assert!(fuse_split(2, FusePolicy::Auto));
    assert!(!fuse_split(3, FusePolicy::Auto));
    assert!(!fuse_split(16, FusePolicy::Auto));
    assert!(fuse_split(16, FusePolicy::On));
    assert!(!fuse_split(2, FusePolicy::Off));
}

#[test]
fn wgmma_configs() {
    for arch in Arch::ALL {
        let prod = wgmma_production_configs(arch);
        assert_eq!(
            prod.len(),
            if arch == Arch::Sm90a { 42 } else { 0 },
            "{arch:?}"
        );
        for c in prod {
            assert_fits_smem(&c);
        }
    }
    let c = wgmma_config_epilogue(Activation::Silu, DType::BF16, Arch::Sm90a, 0);
    assert_eq!(
        c.name_expression(),
        "ferroattn::sparse24_matmul_wgmma<__nv_bfloat16, 128, 3, 4, 256>"
    );
    let s = Sparse24WgmmaConfig { epilogue: 1, ..c };
    assert_eq!(
        s.name_expression(),
        "ferroattn::sparse24_matmul_wgmma<__nv_bfloat16, 128, 3, 4, 256, 1>"
    );
    // sparse24_wgmma_smem_bytes(128, 3, 256, 1)
    assert_eq!(s.smem_bytes(), c.smem_bytes() + 128 + 16384);
    assert!(s.smem_bytes() <= 227 * 1024);
    assert_eq!(
        wgmma_config(Activation::Silu, DType::BF16, Arch::Sm90a).epilogue,
        WGMMA_EPILOGUE_DEFAULT
    );
    // the pipelined mainloop: Sets = 2 spells Epi out; same shared memory; opt-in
    let pipe = Sparse24WgmmaConfig { meta_sets: 2, ..s };
    assert_eq!(
        pipe.name_expression(),
        "ferroattn::sparse24_matmul_wgmma<__nv_bfloat16, 128, 3, 4, 256, 1, 2>"
    );
    assert_eq!(
        Sparse24WgmmaConfig {
            epilogue: 0,
            ..pipe
        }
        .name_expression(),
        "ferroattn::sparse24_matmul_wgmma<__nv_bfloat16, 128, 3, 4, 256, 0, 2>"
    );
    assert_eq!(pipe.smem_bytes(), s.smem_bytes());
    assert_eq!(c.meta_sets, 1);
    assert_eq!(WGMMA_META_SETS_DEFAULT, 1);
    assert_eq!(
        wgmma_config(Activation::Silu, DType::BF16, Arch::Sm90a).meta_sets,
        WGMMA_META_SETS_DEFAULT
    );
    assert!(wgmma_production_configs(Arch::Sm90a)
        .iter()
        .all(|c| c.meta_sets == 1));
    let piped = wgmma_pipelined_configs(Arch::Sm90a);
    assert_eq!(piped.len(), 10);
    assert!(piped.iter().all(|c| c.meta_sets == 2 && c.epilogue == 1));
    assert!(wgmma_pipelined_configs(Arch::Sm80).is_empty());
    // sparse24_wgmma_smem_bytes(128, 3, 256) in wgmma_sp.cuh
    assert_eq!(
        c.smem_bytes(),
        3 * (128 * 256 + 256 * 128 + 16 * 256) + 16 * 3 + 1024
    );
    let big = Sparse24WgmmaConfig {
        block_r: 256,
        block_n: 128,
        stages: 2,
        ..c
    };
    assert!(big.smem_bytes() <= 227 * 1024);
}

#[test]
fn wgmma_schedule_rule() {
    use WgmmaSchedule::*;
    let (auto, t_auto, sk_auto) = (SplitPolicy::Auto, TilePolicy::Auto, StreamKPolicy::Auto);
    let sched = |tiles, k_tiles, rows, n| wgmma_schedule(tiles, k_tiles, rows, n, 132, auto, t_auto, sk_auto);
    // 256 x 128 tiles, 132 SMs. 512 x 4096 x 4096 = 64 tiles -> the 128-row tile (128 CTAs; measured
    // 20.9 vs 32.7 us); where split-k's model costs more than 0.65 k_tiles + 2 the 128-row tile
    // replaces it: 512 x 4096 x 11008 (64 tiles, 2 chunks: 63 vs 53.9), 256 x 4096 x 4096 (32
    // tiles, 3 chunks: 27.5 vs 22.8), 128 x 11008 x 4096 (43 tiles, 3 chunks: 31.1 vs 22.8)
    assert_eq!(sched(64, 32, 512, 4096), Bm128);
    assert_eq!(sched(64, 86, 512, 4096), Bm128);
    assert_eq!(sched(32, 32, 256, 4096), Bm128);
    assert_eq!(sched(43, 32, 128, 11008), Bm128);
    // fewer than 128 rows keep split-k (64 rows measured no better with the 128-row tile)
    assert_eq!(sched(43, 32, 64, 11008), Split(WgmmaSplit { splits: 3, chunk_tiles: 11 }));
    assert_eq!(sched(56, 32, 64, 14336), Split(WgmmaSplit { splits: 2, chunk_tiles: 16 }));
    // split-k keeps decode-sized calls and long k at few tiles: 16 x 4096 x 4096 (8 chunks),
    // 128 x 4096 x 4096 (4 chunks: 21.0 vs 22.8), 256 x 4096 x 11008 (4 chunks: 42 vs 57.9)
    assert_eq!(sched(16, 32, 16, 4096), Split(WgmmaSplit { splits: 8, chunk_tiles: 4 }));
    assert_eq!(sched(16, 32, 128, 4096), Split(WgmmaSplit { splits: 4, chunk_tiles: 8 }));
    assert_eq!(sched(32, 86, 256, 4096), Split(WgmmaSplit { splits: 4, chunk_tiles: 22 }));
    // never stream-K in auto (measured slower), whole tiles on the balanced grid elsewhere:
    // 2048 x 11008 x 4096 (688 tiles), 8192^3, 8192 x 14336 x 4096, 1024 x 4096 x 4096 (128 tiles),
    // 1024 x 4096 x 11008, 16384^3, 16384 x 14336 x 4096, 256 x 11008 x 4096 (86 tiles)
    // the wave rule: 1024 x 14336 x 4096 (448 tiles: 7 x 0.55 < 4 waves; measured 1.030x forced) and
    // 512 x 11008 x 4096 (172 tiles: 3 x 0.55 < 2) take the 128-row tile; 1024 x 11008 x 4096 (344
    // tiles: 6 x 0.55 > 3; measured 0.933x forced) keeps whole tiles, as do the shapes below
    assert_eq!(sched(448, 32, 1024, 14336), Bm128);
    assert_eq!(sched(172, 32, 512, 11008), Bm128);
    assert_eq!(sched(344, 32, 1024, 11008), Tiles);
    assert_eq!(wgmma_schedule(448, 32, 1024, 14336, 132, auto, TilePolicy::Only256, sk_auto), Tiles);
    assert_eq!(wgmma_schedule(448, 32, 1024, 14336, 132, SplitPolicy::Off, t_auto, sk_auto), Tiles);
    // the banded rule: 2048 x 11008 x 4096 (688 tiles = 5.2 waves): 41 feature tiles whole (656 tiles,
    // 5 waves) + the last 512 w rows as 64 128-row tiles (one wave); 4096 x 11008 x 4096 (1376 tiles =
    // 10.4 waves): 41 whole (1312, 10 waves) + 128 128-row tiles
    let (head, cost) = wgmma_banded_plan(43, 16, 32, 132).unwrap();
    assert_eq!(head, 41);
    assert!((cost - 194.8).abs() < 1e-9, "{cost}");
    assert_eq!(sched(688, 32, 2048, 11008), Banded { head_tiles: 41 });
    assert_eq!(sched(1376, 32, 4096, 11008), Banded { head_tiles: 41 });
    assert_eq!(wgmma_schedule(688, 32, 2048, 11008, 132, auto, TilePolicy::Only256, sk_auto), Tiles);
    assert_eq!(wgmma_schedule(688, 32, 2048, 11008, 132, SplitPolicy::Off, t_auto, sk_auto), Tiles);
    assert_eq!(wgmma_banded_plan(1, 16, 32, 132), None);
    // forced: "band:H" clamps H to the feature tiles - 1; a single feature tile takes the auto rule
    let band = |h, tiles, n| wgmma_schedule(tiles, 32, 1024, n, 132, auto, TilePolicy::Banded(h), sk_auto);
    assert_eq!(band(3, 8 * 43, 11008), Banded { head_tiles: 3 });
    assert_eq!(band(99, 8 * 43, 11008), Banded { head_tiles: 42 });
    assert!(!matches!(band(1, 8, 200), Banded { .. }), "one feature tile: the auto rule");
    for (tiles, k_tiles, rows, n) in [
        (512u64, 32u64, 4096u64, 4096u64),
        (2048, 64, 8192, 8192),
        (3584, 32, 8192, 14336),
        (128, 32, 1024, 4096),
        (128, 86, 1024, 4096),
        (8192, 128, 16384, 16384),
        (7168, 32, 16384, 14336),
        (86, 32, 256, 11008),
    ] {
        assert_eq!(sched(tiles, k_tiles, rows, n), Tiles, "{tiles} {k_tiles}");
    }
    // policies: "256" / "off" restore the choices before the 128-row tile; forced forms
    assert_eq!(wgmma_schedule(64, 32, 512, 4096, 132, auto, TilePolicy::Only256, sk_auto), Tiles);
    assert_eq!(
        wgmma_schedule(64, 86, 512, 4096, 132, auto, TilePolicy::Only256, sk_auto),
        Split(WgmmaSplit { splits: 2, chunk_tiles: 43 })
    );
    assert_eq!(wgmma_schedule(64, 32, 512, 4096, 132, SplitPolicy::Off, t_auto, StreamKPolicy::Off), Tiles);
    assert_eq!(
        wgmma_schedule(64, 86, 512, 4096, 132, SplitPolicy::Force(3), t_auto, sk_auto),
        Split(WgmmaSplit { splits: 3, chunk_tiles: 29 })
    );
    let with = |tile, sk| wgmma_schedule(688, 32, 2048, 11008, 132, auto, tile, sk);
    assert_eq!(with(TilePolicy::Force128, sk_auto), Bm128);
    assert_eq!(with(t_auto, StreamKPolicy::DpTiles(5)), StreamK { dp_tiles: 5, grid: 132 });
    assert_eq!(with(t_auto, StreamKPolicy::DpTiles(9999)), StreamK { dp_tiles: 687, grid: 132 });
    assert_eq!(with(t_auto, StreamKPolicy::On), StreamK { dp_tiles: 528, grid: 132 });
    assert_eq!(
        wgmma_schedule(344, 32, 1024, 11008, 132, auto, t_auto, StreamKPolicy::On),
        StreamK { dp_tiles: 132, grid: 132 }
    );
    // forced stream-K wins over split-k and the 128-row tile; forced 128 over everything
    assert_eq!(
        wgmma_schedule(16, 32, 16, 4096, 132, auto, t_auto, StreamKPolicy::DpTiles(0)),
        StreamK { dp_tiles: 0, grid: 132 }
    );
    assert_eq!(wgmma_schedule(16, 32, 16, 4096, 132, auto, TilePolicy::Force128, StreamKPolicy::On), Bm128);
    // the forced tail: the partial wave or one wave more (all tiles when tiles <= sms); the auto
    // rule: never stream-K, the 128-row tile only from 128 rows, where 2 tiles <= sms or the wave
    // rule holds
    for tiles in 1..1500u64 {
        for k_tiles in [1u64, 2, 8, 32, 33, 86] {
            let (tail, _) = wgmma_stream_k_tail(tiles, k_tiles, 132);
            assert!(tail >= 1 && tail <= tiles, "{tiles} {k_tiles}");
            if tiles > 132 {
                assert!(tail == tiles % 132 || tail == tiles % 132 + 132, "{tiles} {tail}");
            } else {
                assert_eq!(tail, tiles);
            }
            for rows in [64u64, 1024, 8192] {
                match wgmma_schedule(tiles, k_tiles, rows, 4096, 132, auto, t_auto, sk_auto) {
                    StreamK { .. } => panic!("auto never picks stream-K"),
                    Bm128 => assert!(
                        rows >= 128
                            && (2 * tiles <= 132
                                || (2 * tiles).div_ceil(132) as f64 * WGMMA_BM128_WAVE_STAGE
                                    < tiles.div_ceil(132) as f64),
                        "{tiles} {rows}"
                    ),
                    Banded { head_tiles } => assert!(rows >= 128 && tiles > 132 && head_tiles >= 1, "{tiles} {rows}"),
                    Tiles | Split(_) => {}
                }
            }
        }
    }
    // configs: 128-row tile 4 stages fits; stream-K = production tile, staged epilogue's smem
    let b = wgmma_bm128_config(Activation::None, DType::BF16, Arch::Sm90a);
    assert_eq!((b.block_n, b.block_r, b.stages, b.epilogue), (128, 128, 4, 1));
    assert_eq!(b.smem_bytes(), 222_400);
    assert!(b.smem_bytes() <= 227 * 1024);
    assert_eq!(b.name_expression(), "ferroattn::sparse24_matmul_wgmma<__nv_bfloat16, 128, 4, 0, 128, 1>");
    let s = wgmma_stream_k_config(Activation::Relu, DType::F16, Arch::Sm90a);
    assert_eq!(s.name_expression(), "ferroattn::sparse24_matmul_wgmma<__half, 128, 3, 1, 256, 4>");
    assert_eq!(s.smem_bytes(), wgmma_config(Activation::Relu, DType::F16, Arch::Sm90a).smem_bytes());
    let prod = wgmma_production_configs(Arch::Sm90a);
    assert!(prod.contains(&b) && !prod.contains(&s));
    let sk = wgmma_stream_k_configs(Arch::Sm90a);
    assert_eq!(sk.len(), 10);
    assert!(sk.contains(&s) && sk.iter().all(|c| c.epilogue == 4 && c.block_n == 256));
    assert!(wgmma_stream_k_configs(Arch::Sm80).is_empty());
}
