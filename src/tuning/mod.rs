//! Tile-size heuristics: pure functions, unit-tested on CPU.
pub mod attention;
pub mod attention_bwd;
