//! ferroattn: FlashAttention-class attention kernels, JIT-compiled by NVRTC and launched from Rust.
//!
//! Layers (DESIGN.md §2): `python` (thin PyO3 glue) → `ops` (validate → config → launch) →
//! `tuning` (pure heuristics) → `jit` (NVRTC → CUBIN → CUfunction, cached) → `launch` /
//! `device` (CUDA driver); `profiler` records launches when asked. `arch` (the GPU
//! architectures) is a leaf that `device`, `jit` and `tuning` read. Tensors cross the boundary
//! through `dlpack` and are described inside by `tensor::TensorView` only.

pub mod arch;
pub mod device;
pub mod dlpack;
pub mod dtype;
pub mod env_switch;
pub mod error;
pub mod jit;
pub mod launch;
pub mod launch_record;
pub mod ops;
pub mod profiler;
pub mod python;
pub mod tensor;
pub mod tma;
pub mod tuning;

pub use error::{Error, Result};
