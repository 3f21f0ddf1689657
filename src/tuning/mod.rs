//! Tile-size heuristics: pure functions, unit-tested on CPU.
pub mod attention;
pub mod attention_bwd;
pub mod attention_kvcache;
pub mod attention_sm90;
pub mod gemm;
pub mod gemm_problem;
pub mod gemm_sm90;
pub mod grid;
pub mod knobs;
pub mod sparse24;
pub mod variant;
