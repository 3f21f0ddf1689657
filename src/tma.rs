//! TMA tensor maps (Hopper's bulk tensor copy engine, `cp.async.bulk.tensor`): host-side
//! encoding of tiled `CUtensorMap`s with `cuTensorMapEncodeTiled` (CUDA driver API,
//! "Tensor Map Object Management"). A map describes a strided global tensor (dims innermost
//! first) and the box one copy moves into shared memory; kernels receive it by value as a
//! `__grid_constant__` parameter (kernels/gemm/sm90.cuh `TmaMap`).
//!
//! The driver's rules, checked here so that a bad map is an ArgumentError naming the tensor
//! instead of a CUDA_ERROR_INVALID_VALUE (CUDA driver API reference, cuTensorMapEncodeTiled):
//! rank 1..=5; global address 16-byte aligned; every dim in 1..=2^32; every stride (bytes,
//! dims 1..) a multiple of 16 below 2^40; box dims in 1..=256, the innermost box dim times the
//! element size a multiple of 16 bytes and, when swizzled, at most the swizzle span.
//!
//! Host time: every Hopper launch needs its maps, and encoding one costs the driver more than
//! moving its address. So [`Tiled::encode`] keeps, per thread, the last map encoded for each
//! request without its address (dtype, dims, strides, box, swizzle: what a model's layers repeat
//! call after call) and answers a repeat with that map, its address moved by
//! `cuTensorMapReplaceAddress` when the tensor moved (the driver's own call for exactly this),
//! or as it is when it did not. At most [`MAP_CACHE_ENTRIES`] requests are kept per thread.

use crate::dtype::DType;
use crate::error::{CudaResultExt, Error, Result};
use cudarc::driver::sys;
use std::cell::RefCell;
use std::collections::HashMap;

/// An encoded tensor map: 128 opaque bytes, 128-byte aligned (CUDA 13 `CUtensorMap`).
pub type TensorMap = sys::CUtensorMap;

/// Shared-memory swizzle of the box (the wgmma canonical layouts use 128 B).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Swizzle {
    None,
    B32,
    B64,
    B128,
}

impl Swizzle {
    /// The swizzle span in bytes (None: no limit on the inner box row).
    fn span(self) -> Option<u64> {
        match self {
            Swizzle::None => None,
            Swizzle::B32 => Some(32),
            Swizzle::B64 => Some(64),
            Swizzle::B128 => Some(128),
        }
    }

    fn raw(self) -> sys::CUtensorMapSwizzle {
        use sys::CUtensorMapSwizzle::*;
        match self {
            Swizzle::None => CU_TENSOR_MAP_SWIZZLE_NONE,
            Swizzle::B32 => CU_TENSOR_MAP_SWIZZLE_32B,
            Swizzle::B64 => CU_TENSOR_MAP_SWIZZLE_64B,
            Swizzle::B128 => CU_TENSOR_MAP_SWIZZLE_128B,
        }
    }
}

/// A tiled tensor map request. `dims[0]` is the contiguous dim; `strides_bytes[i]` is the
/// byte stride of dim i + 1 (a dim of size 1 may carry any stride that meets the rules: pass
/// a multiple of 16).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tiled {
    pub dtype: DType,
    pub ptr: u64,
    pub dims: Vec<u64>,
    pub strides_bytes: Vec<u64>,
    pub box_dims: Vec<u32>,
    pub swizzle: Swizzle,
}

fn data_type(dtype: DType) -> Option<sys::CUtensorMapDataType> {
    use sys::CUtensorMapDataType::*;
    match dtype {
        DType::F16 => Some(CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
        DType::BF16 => Some(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
        DType::F32 => Some(CU_TENSOR_MAP_DATA_TYPE_FLOAT32),
        _ => None,
    }
}

/// Requests (without their address) whose map [`Tiled::encode`] keeps per thread.
pub const MAP_CACHE_ENTRIES: usize = 256;

/// A request without its address, in fixed arrays (no allocation per lookup); `check` has
/// bounded the rank to 1..=5.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct MapKey {
    dtype: DType,
    rank: usize,
    dims: [u64; 5],
    strides_bytes: [u64; 4],
    box_dims: [u32; 5],
    swizzle: Swizzle,
}

/// A kept map and the address it holds.
struct Kept {
    map: TensorMap,
    ptr: u64,
}

thread_local! {
    static MAPS: RefCell<HashMap<MapKey, Kept>> = RefCell::new(HashMap::new());
}

impl Tiled {
    fn key(&self) -> MapKey {
        let mut k = MapKey {
            dtype: self.dtype,
            rank: self.dims.len(),
            dims: [0; 5],
            strides_bytes: [0; 4],
            box_dims: [0; 5],
            swizzle: self.swizzle,
        };
        k.dims[..self.dims.len()].copy_from_slice(&self.dims);
        k.strides_bytes[..self.strides_bytes.len()].copy_from_slice(&self.strides_bytes);
        k.box_dims[..self.box_dims.len()].copy_from_slice(&self.box_dims);
        k
    }

    /// The driver's rules (module docs); `arg` names the tensor in errors.
    pub fn check(&self, arg: &str) -> Result<()> {
        let rank = self.dims.len();
        let bad = |expected: &str, actual: String| Err(Error::argument(arg, expected, actual));
        if data_type(self.dtype).is_none() {
            return Err(Error::dtype(arg, "float16, bfloat16 or float32", self.dtype.name()));
        }
        if !(1..=5).contains(&rank) || self.box_dims.len() != rank || self.strides_bytes.len() + 1 != rank {
            return bad(
                "a tensor map of rank 1..=5 with rank box dims and rank - 1 strides",
                format!(
                    "{} dims, {} box dims, {} strides",
                    rank,
                    self.box_dims.len(),
                    self.strides_bytes.len()
                ),
            );
        }
        if self.ptr % 16 != 0 {
            return bad("a 16-byte aligned address (TMA)", format!("{:#x}", self.ptr));
        }
        if let Some(d) = self.dims.iter().find(|&&d| d == 0 || d > 1 << 32) {
            return bad("dims in 1..=2^32 (TMA)", format!("dim {d} in {:?}", self.dims));
        }
        if let Some(s) = self.strides_bytes.iter().find(|&&s| s % 16 != 0 || s >= 1 << 40) {
            return bad(
                "byte strides that are multiples of 16 below 2^40 (TMA)",
                format!("stride {s} B in {:?}", self.strides_bytes),
            );
        }
        if let Some(b) = self.box_dims.iter().find(|&&b| b == 0 || b > 256) {
            return bad("box dims in 1..=256 (TMA)", format!("box dim {b} in {:?}", self.box_dims));
        }
        let inner = self.box_dims[0] as u64 * self.dtype.size_bytes() as u64;
        if inner % 16 != 0 || self.swizzle.span().is_some_and(|s| inner > s) {
            return bad(
                "an inner box row that is a multiple of 16 bytes within the swizzle span (TMA)",
                format!("{inner} bytes with {:?}", self.swizzle),
            );
        }
        Ok(())
    }

    /// The encoded map (no device work; needs the driver loaded): the kept map of the same
    /// request when there is one (module docs), else a fresh encoding, which is then kept.
    /// Out-of-bounds box elements are filled with zeros on load.
    pub fn encode(&self, arg: &str) -> Result<TensorMap> {
        self.check(arg)?;
        let key = self.key();
        let kept = MAPS.with(|m| {
            let mut m = m.borrow_mut();
            let kept = m.get_mut(&key)?;
            if kept.ptr != self.ptr {
                // SAFETY: `kept.map` is a map the driver encoded; the address meets the rules
                // (checked above), so the call only rewrites the map's address field.
                let r = unsafe { sys::cuTensorMapReplaceAddress(&mut kept.map, self.ptr as *mut std::ffi::c_void) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    return None; // encode afresh below (which reports the driver's error)
                }
                kept.ptr = self.ptr;
            }
            Some(kept.map)
        });
        if let Some(map) = kept {
            return Ok(map);
        }
        let map = self.encode_fresh()?;
        MAPS.with(|m| {
            let mut m = m.borrow_mut();
            if m.len() >= MAP_CACHE_ENTRIES {
                m.clear();
            }
            m.insert(key, Kept { map, ptr: self.ptr });
        });
        Ok(map)
    }

    /// `cuTensorMapEncodeTiled` of a checked request.
    fn encode_fresh(&self) -> Result<TensorMap> {
        let rank = self.dims.len();
        let ones = [1u32; 5];
        let mut map = std::mem::MaybeUninit::<TensorMap>::zeroed();
        // SAFETY: every array holds `rank` (strides: rank - 1) elements as the call requires;
        // the map is written by the driver and is plain data.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                data_type(self.dtype).expect("checked"),
                rank as u32,
                self.ptr as *mut std::ffi::c_void,
                self.dims.as_ptr(),
                self.strides_bytes.as_ptr(),
                self.box_dims.as_ptr(),
                ones.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                self.swizzle.raw(),
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .call("cuTensorMapEncodeTiled")?;
        // SAFETY: initialised by the successful call above.
        Ok(unsafe { map.assume_init() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiled() -> Tiled {
        Tiled {
            dtype: DType::BF16,
            ptr: 0x10000,
            dims: vec![4096, 4096, 1],
            strides_bytes: vec![8192, 16],
            box_dims: vec![64, 128, 1],
            swizzle: Swizzle::B128,
        }
    }

    #[test]
    fn driver_rules_are_checked_before_encoding() {
        tiled().check("a").unwrap();
        let e = Tiled { ptr: 0x10008, ..tiled() }.check("a").unwrap_err().to_string();
        assert!(e.starts_with("a: expected a 16-byte aligned address") && e.contains("0x10008"), "{e}");
        let e = Tiled { strides_bytes: vec![8190, 16], ..tiled() }.check("b").unwrap_err().to_string();
        assert!(e.starts_with("b: expected byte strides") && e.contains("8190"), "{e}");
        let e = Tiled { box_dims: vec![128, 128, 1], ..tiled() }.check("a").unwrap_err().to_string();
        assert!(e.contains("256 bytes with B128"), "{e}");
        let e = Tiled { box_dims: vec![64, 512, 1], ..tiled() }.check("a").unwrap_err().to_string();
        assert!(e.contains("box dim 512"), "{e}");
        let e = Tiled { dims: vec![4096, 0, 1], ..tiled() }.check("a").unwrap_err().to_string();
        assert!(e.contains("dim 0"), "{e}");
        let e = Tiled { dims: vec![4096, 4096], ..tiled() }.check("a").unwrap_err().to_string();
        assert!(e.contains("2 dims, 3 box dims, 2 strides"), "{e}");
        assert!(Tiled { dtype: DType::I32, ..tiled() }.check("a").is_err());
        // unswizzled boxes may be wider than 128 bytes
        Tiled { box_dims: vec![128, 8, 1], swizzle: Swizzle::None, ..tiled() }.check("a").unwrap();
    }

    #[test]
    fn kept_maps_are_keyed_by_everything_but_the_address() {
        let k = tiled().key();
        assert!(Tiled { ptr: 0x20000, ..tiled() }.key() == k);
        for other in [
            Tiled { dtype: DType::F16, ..tiled() },
            Tiled { dims: vec![4096, 4095, 1], ..tiled() },
            Tiled { strides_bytes: vec![8192, 32], ..tiled() },
            Tiled { box_dims: vec![64, 64, 1], ..tiled() },
            Tiled { swizzle: Swizzle::B64, box_dims: vec![32, 128, 1], ..tiled() },
            Tiled { dims: vec![4096, 4096], strides_bytes: vec![8192], box_dims: vec![64, 128], ..tiled() },
        ] {
            assert!(other.key() != k);
        }
    }
}
