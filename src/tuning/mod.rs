//! Tile-size heuristics: pure functions, unit-tested on CPU.
pub mod attention;
