//! The split-k / stream-K workspace of the dense GEMM family (src/ops/gemm: sm90 split-k, the
//! wmma stream-k tail) and the 2:4 family (src/ops/sparse24: wgmma_sp split-k, fused split-k,
//! stream-K): its layout, the checks of the tensor that holds it and the launch helper that
//! readies it. Both families plan, check and launch through this module only.
//!
//! Who allocates: the caller (DESIGN §1, "who allocates"). The Python op layer passes the launch
//! its allocator (`ops/_to_native.py` `allocate_workspace`: a uint8 tensor from torch on the call's
//! device and current stream); the launch plans, asks it for exactly [`WorkspaceLayout::bytes`]
//! of the path it takes ([`Source::Alloc`]; nothing when that is 0), checks the tensor ([`check`])
//! and uses it, all in one native call. A caller may instead allocate beforehand with the bytes
//! of the call's planner (`_native.gemm_workspace`, `_native.sparse24_matmul_workspace`: the same
//! plan as the launch) and pass the tensor ([`Source::Given`]). Nothing here allocates or frees
//! device memory, so under CUDA-graph capture the workspace is a block of the graph's private
//! pool at the same address on every replay, and torch's memory accounting sees it.
//!
//! Layout ([`WorkspaceLayout`]): `slots` partial-sum slots of `slot_bytes` each from byte 0
//! (fp32 split-k chunks, or one fp32 partial tile per CTA / per tile), then, from
//! [`WorkspaceLayout::counters_offset`] (16-byte aligned), `counters` u32 counters / flags.
//!
//! Counters: the kernels need them zero when they start and leave them non-zero. [`launch`]
//! enqueues one cuMemsetD32Async over them on the launch stream before the kernels. Stream order
//! makes that correct in eager use (the previous user of the memory is ordered before it by
//! torch's allocator); under capture the memset becomes a memset node of the graph ahead of the
//! kernel nodes, so every replay zeroes them again. The partial slots need no initial value
//! (every slot is written before it is read).

use crate::dtype::DType;
use crate::error::{CudaResultExt, Error, Result};
use crate::ops::validate::{check_device, check_dtype, check_not_null};
use crate::tensor::{fmt_shape, overlaps, TensorMeta, TensorView};

/// Alignment of the workspace pointer and of the counters (bytes): TMA stores and 16-byte vector
/// accesses to the partial slots.
pub const ALIGN: u64 = 16;

/// The workspace of one launch (module docs): `slots` × `slot_bytes` of partials, then
/// `counters` u32 counters zeroed before the kernels. All zero: the launch needs no workspace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkspaceLayout {
    pub slots: u64,
    pub slot_bytes: u64,
    pub counters: u64,
}

impl WorkspaceLayout {
    /// No workspace.
    pub const NONE: WorkspaceLayout = WorkspaceLayout { slots: 0, slot_bytes: 0, counters: 0 };

    /// `slots` partial slots of `slot_bytes` each, no counters (split-k chunks read by a reduce).
    pub fn partials(slots: u64, slot_bytes: u64) -> WorkspaceLayout {
        WorkspaceLayout { slots, slot_bytes, counters: 0 }
    }

    /// `slots` partial slots of `slot_bytes` each, then `counters` zeroed u32 counters.
    pub fn with_counters(slots: u64, slot_bytes: u64, counters: u64) -> WorkspaceLayout {
        WorkspaceLayout { slots, slot_bytes, counters }
    }

    /// Byte offset of the first counter: the partials' bytes rounded up to [`ALIGN`].
    pub fn counters_offset(&self) -> u64 {
        self.slots.saturating_mul(self.slot_bytes).saturating_add(ALIGN - 1) / ALIGN * ALIGN
    }

    /// Bytes the caller allocates (0: no workspace).
    pub fn bytes(&self) -> u64 {
        if self.counters == 0 {
            self.slots.saturating_mul(self.slot_bytes)
        } else {
            self.counters_offset().saturating_add(self.counters.saturating_mul(4))
        }
    }

    pub fn is_empty(&self) -> bool {
        self.bytes() == 0
    }
}

/// A checked workspace ([`check`]): the device address of byte 0 and the layout it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workspace {
    pub ptr: u64,
    pub layout: WorkspaceLayout,
}

impl Workspace {
    /// Address of the first partial slot.
    pub fn partials(&self) -> u64 {
        self.ptr
    }

    /// Address of partial slot `i`.
    pub fn slot(&self, i: u64) -> u64 {
        self.ptr + i * self.layout.slot_bytes
    }

    /// Address of the first counter.
    pub fn counters(&self) -> u64 {
        self.ptr + self.layout.counters_offset()
    }
}

/// The rules a workspace tensor meets whatever the call: uint8, one dim, contiguous (stride 1).
/// Checked from metadata, before the call's other tensors, so these errors name `arg` on any
/// device (its device is checked by [`check`]).
pub(crate) fn check_meta(arg: &str, t: &TensorMeta) -> Result<()> {
    check_dtype(arg, t, DType::U8, " (a byte buffer)")?;
    if t.ndim() != 1 {
        return Err(Error::argument(arg, "1 dim (bytes)", format!("{} dims (shape {})", t.ndim(), fmt_shape(&t.shape))));
    }
    if t.shape[0] > 1 && t.strides[0] != 1 {
        return Err(Error::argument(arg, "a contiguous tensor (stride 1)", format!("stride {}", t.strides[0])));
    }
    Ok(())
}

/// Where a launch's workspace comes from: a tensor the caller allocated beforehand (its planner's
/// bytes; None when it needs none), or the caller's allocator, asked for exactly the bytes of the
/// plan the launch takes (nothing when it needs none) — one call plans, allocates and launches.
/// Either way the memory is the caller's (module docs, "who allocates").
pub enum Source<'a> {
    Given(Option<&'a TensorView>),
    Alloc(&'a mut (dyn FnMut(u64) -> Result<TensorView> + Send)),
}

impl Source<'_> {
    /// The checks a given tensor gets before the launch is planned (its metadata rules).
    pub(crate) fn precheck(&self, arg: &str) -> Result<()> {
        match self {
            Source::Given(Some(w)) => check_meta(arg, &w.meta),
            _ => Ok(()),
        }
    }

    /// The tensor for a launch that needs `layout`: the given one, or a new allocation of
    /// `layout.bytes()` (none when that is 0).
    pub(crate) fn resolve(&mut self, layout: &WorkspaceLayout) -> Result<Option<TensorView>> {
        match self {
            Source::Given(w) => Ok(w.cloned()),
            Source::Alloc(_) if layout.is_empty() => Ok(None),
            Source::Alloc(alloc) => alloc(layout.bytes()).map(Some),
        }
    }
}

/// `t` checked for a launch that needs `layout`, on `base`'s device (`base_arg` names it), not
/// overlapping any of `others` (the call's tensors). None when `layout` is empty (a given
/// tensor is then left unused). Errors name `arg`: missing, fewer than `layout.bytes()` bytes, a
/// pointer not 16-byte aligned, the [`check_meta`] rules, another device, an overlap.
pub(crate) fn check(
    arg: &str,
    t: Option<&TensorView>,
    layout: WorkspaceLayout,
    base_arg: &str,
    base: &TensorMeta,
    others: &[(&str, Option<&TensorView>)],
) -> Result<Option<Workspace>> {
    let need = layout.bytes();
    if let Some(t) = t {
        check_meta(arg, &t.meta)?;
        check_device(arg, &t.meta, base_arg, base)?;
    }
    if need == 0 {
        return Ok(None);
    }
    let Some(t) = t else {
        return Err(Error::argument(
            arg,
            format!("a uint8 tensor of at least {need} bytes (this call's split-k / stream-K workspace)"),
            "None",
        ));
    };
    let have = t.meta.shape[0];
    if (have as u64) < need {
        return Err(Error::argument(arg, format!("at least {need} bytes (this call's split-k / stream-K workspace)"), format!("{have} bytes")));
    }
    check_not_null(arg, t)?;
    if !t.ptr.is_multiple_of(ALIGN) {
        return Err(Error::argument(arg, format!("a {ALIGN}-byte aligned data pointer"), format!("address {:#x}", t.ptr)));
    }
    for (other_arg, o) in others {
        if let Some(o) = o {
            if overlaps(t, o) {
                return Err(Error::argument(
                    arg,
                    format!("memory that does not overlap {other_arg}"),
                    format!("a buffer at {:#x} overlapping {other_arg} at {:#x}", t.ptr, o.ptr),
                ));
            }
        }
    }
    Ok(Some(Workspace { ptr: t.ptr, layout }))
}

/// Ready `ws` on `stream` and run `body` (the launches that use it): the counters (if any) are
/// zeroed first with cuMemsetD32Async on `stream` (module docs: a memset node under capture).
///
/// # Safety
/// `ws` came from [`check`] on memory that stays allocated until the work `body` enqueues has
/// run (the caller's torch tensor: stream-ordered reuse); `body` enqueues only on `stream`.
pub(crate) unsafe fn launch<T>(ws: &Workspace, device: i32, stream: u64, body: impl FnOnce(&Workspace) -> Result<T>) -> Result<T> {
    if ws.layout.counters > 0 {
        crate::device::bind(device)?;
        // SAFETY: the counters lie inside the checked workspace (`check`: at least `bytes()`
        // bytes), 4-byte aligned (`counters_offset` is a multiple of ALIGN); ordered on `stream`.
        unsafe { cudarc::driver::sys::cuMemsetD32Async(ws.counters(), 0, ws.layout.counters as usize, stream as _) }
            .result()
            .call("cuMemsetD32Async")?;
    }
    body(ws)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Device;

    fn bytes(n: i64, ptr: u64) -> TensorView {
        TensorView {
            meta: TensorMeta { shape: vec![n], strides: vec![1], dtype: DType::U8, device: Device::cuda(0) },
            ptr,
        }
    }

    fn base() -> TensorMeta {
        TensorMeta { shape: vec![4, 4], strides: vec![4, 1], dtype: DType::BF16, device: Device::cuda(0) }
    }

    #[test]
    fn layout_bytes_and_offsets() {
        assert_eq!(WorkspaceLayout::NONE.bytes(), 0);
        assert!(WorkspaceLayout::NONE.is_empty());
        let p = WorkspaceLayout::partials(8, 16 * 4096 * 4);
        assert_eq!(p.bytes(), 8 * 16 * 4096 * 4);
        assert_eq!(p.counters_offset(), p.bytes());
        // slots + one counter per slot: counters right after the (16-byte multiple) partials
        let c = WorkspaceLayout::with_counters(132, 128 * 1024, 132);
        assert_eq!(c.counters_offset(), 132 * 128 * 1024);
        assert_eq!(c.bytes(), 132 * 128 * 1024 + 132 * 4);
        // an odd partial size: the counters start at the next multiple of 16
        let o = WorkspaceLayout::with_counters(3, 10, 5);
        assert_eq!((o.counters_offset(), o.bytes()), (32, 52));
        // counters only
        let f = WorkspaceLayout::with_counters(0, 0, 7);
        assert_eq!((f.counters_offset(), f.bytes()), (0, 28));
        let ws = Workspace { ptr: 0x1000, layout: c };
        assert_eq!((ws.partials(), ws.slot(2), ws.counters()), (0x1000, 0x1000 + 2 * 128 * 1024, 0x1000 + 132 * 128 * 1024));
        // no overflow panics on absurd sizes
        assert!(WorkspaceLayout::with_counters(u64::MAX, 2, 1).bytes() > u64::MAX / 2);
    }

    #[test]
    fn check_accepts_a_big_enough_aligned_buffer() {
        let l = WorkspaceLayout::with_counters(2, 64, 2);
        let t = bytes(l.bytes() as i64, 0x10000);
        assert_eq!(check("workspace", Some(&t), l, "a", &base(), &[]).unwrap(), Some(Workspace { ptr: 0x10000, layout: l }));
        let larger = bytes(4096, 0x10000);
        assert!(check("workspace", Some(&larger), l, "a", &base(), &[]).unwrap().is_some());
        // an empty layout needs nothing, and ignores a given (well-formed) buffer
        assert_eq!(check("workspace", None, WorkspaceLayout::NONE, "a", &base(), &[]).unwrap(), None);
        assert_eq!(check("workspace", Some(&larger), WorkspaceLayout::NONE, "a", &base(), &[]).unwrap(), None);
    }

    #[test]
    fn check_errors_name_the_workspace() {
        let l = WorkspaceLayout::partials(4, 1024);
        let err = |t: Option<&TensorView>, others: &[(&str, Option<&TensorView>)]| {
            check("workspace", t, l, "a", &base(), others).unwrap_err().to_string()
        };
        let e = err(None, &[]);
        assert!(e.starts_with("workspace: expected a uint8 tensor of at least 4096 bytes") && e.ends_with("got None"), "{e}");
        let e = err(Some(&bytes(4095, 0x10000)), &[]);
        assert_eq!(e, "workspace: expected at least 4096 bytes (this call's split-k / stream-K workspace), got 4095 bytes");
        let e = err(Some(&bytes(8192, 0x10008)), &[]);
        assert!(e.contains("16-byte aligned") && e.contains("0x10008"), "{e}");
        let e = err(Some(&bytes(8192, 0)), &[]);
        assert!(e.contains("non-NULL"), "{e}");
        let mut f32s = bytes(1024, 0x10000);
        f32s.meta.dtype = DType::F32;
        let e = check("workspace", Some(&f32s), l, "a", &base(), &[]).unwrap_err();
        assert!(matches!(e, Error::DType { .. }) && e.to_string().starts_with("workspace: expected dtype uint8"), "{e}");
        let mut strided = bytes(8192, 0x10000);
        strided.meta.strides = vec![2];
        assert!(err(Some(&strided), &[]).contains("contiguous"));
        let mut two_d = bytes(8192, 0x10000);
        two_d.meta.shape = vec![2, 4096];
        two_d.meta.strides = vec![4096, 1];
        assert!(err(Some(&two_d), &[]).contains("1 dim"));
        let mut other_gpu = bytes(8192, 0x10000);
        other_gpu.meta.device = Device::cuda(1);
        let e = check("workspace", Some(&other_gpu), l, "a", &base(), &[]).unwrap_err();
        assert!(matches!(e, Error::Device { .. }) && e.to_string().starts_with("workspace:"), "{e}");
        // a workspace inside an output of the call
        let out = bytes(1 << 20, 0x10000);
        let e = err(Some(&bytes(8192, 0x20000)), &[("out", Some(&out))]);
        assert!(e.contains("does not overlap out"), "{e}");
    }

    #[test]
    fn meta_rules_hold_on_any_device() {
        let mut cpu = bytes(16, 0).meta;
        cpu.device = Device::CPU;
        check_meta("workspace", &cpu).unwrap();
        cpu.dtype = DType::I32;
        assert!(check_meta("workspace", &cpu).unwrap_err().to_string().starts_with("workspace: expected dtype uint8"));
    }
}
