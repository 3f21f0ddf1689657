//! 2:4 sparsity: compress / decompress on the GPU (kernels/sparse24/compress.cuh) and their
//! host (CPU reference) entry points.

use super::*;

pub(super) static COMPRESS: KernelMap<Sparse24CompressConfig> = KernelMap::new();

/// Launch compress (`dense` = w, with its `bad_groups` counter) or decompress (`dense` = out)
/// between the dense matrix and the compressed pair `values` / `meta` of layout `l`.
#[allow(clippy::too_many_arguments)]
pub(super) fn compress_launch(
    kind: CompressKind,
    l: &Layout,
    dense: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    bad_groups: Option<&TensorView>,
    prune: bool,
    stream: u64,
) -> Result<()> {
    let (device, dtype) = (dense.meta.device.id, dense.meta.dtype);
    let mut prm = Sparse24CompressParams {
        dense: dense.ptr as *mut c_void,
        values: values.ptr as *mut c_void,
        meta: meta.ptr as *mut u32,
        bad_groups: bad_groups.map_or(std::ptr::null_mut(), |b| b.ptr as *mut i32),
        dense_row_stride: dense.meta.strides[0],
        m: l.m as i32,
        k: l.k as i32,
        m_pad: l.m_pad as i32,
        k_pad: l.k_pad as i32,
        prune: prune as i32,
    };
    let dense_bytes = (l.m * l.k * dtype.size_bytes()) as f64;
    let arch = crate::device::arch(device)?;
    let config = Sparse24CompressConfig { kind, dtype, arch };
    let words = (l.m_pad / 16) as u64 * (l.k_pad / 2) as u64;
    let shape = LaunchShape {
        grid: (
            words.div_ceil(Sparse24CompressConfig::THREADS as u64) as u32,
            1,
            1,
        ),
        block: (Sparse24CompressConfig::THREADS, 1, 1),
        dynamic_smem_bytes: 0,
    };
    shape.check()?;
    let kernel = COMPRESS.get(&config, device)?;
    let info = LaunchInfo {
        op: "ferroattn::sparse24_compress",
        work: work::compress(
            l,
            dtype.size_bytes() as u64,
            dense_bytes,
            kind == CompressKind::Compress,
        ),
    };
    // SAFETY: `prm` mirrors Sparse24CompressParams; the caller keeps the tensors alive in stream order.
    unsafe { launch(kernel, device, &shape, stream, &mut prm, &info) }
}

/// GPU compress of w into values / meta; bad_groups (int32 (1,)) is set to the number of
/// groups with more than 2 non-zeros (zeroed on `stream`, then counted by the kernel).
pub fn compress(
    w: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    bad_groups: &TensorView,
    prune: bool,
    stream: u64,
) -> Result<()> {
    let l = validate_compress(w, values, meta, Some(bad_groups), true)?;
    check_not_null("bad_groups", bad_groups)?;
    // the kernel stores values 16 bytes at a time (and metadata as 4-byte words)
    for (arg, t) in [("values", values), ("meta", meta)] {
        check_aligned(arg, t, 16)?;
    }
    let device = w.meta.device.id;
    crate::device::bind(device)?;
    // SAFETY: bad_groups is a validated int32 (1,) CUDA tensor of this device.
    unsafe { cudarc::driver::result::memset_d8_async(bad_groups.ptr, 0, 4, stream as _) }
        .call("cuMemsetD8Async")?;
    if l.m_pad == 0 || l.k_pad == 0 {
        return Ok(());
    }
    for (arg, t) in [("w", w), ("values", values), ("meta", meta)] {
        check_not_null(arg, t)?;
    }
    compress_launch(CompressKind::Compress, &l, w, values, meta, Some(bad_groups), prune, stream)
}

/// GPU decompress of values / meta into out (m, k).
pub fn decompress(
    values: &TensorView,
    meta: &TensorView,
    out: &TensorView,
    stream: u64,
) -> Result<()> {
    let l = validate_decompress(values, meta, out, true)?;
    // the kernel loads values 16 bytes at a time (and metadata as 4-byte words): a misaligned view
    // would be a misaligned-address fault, which poisons the CUDA context
    for (arg, t) in [("values", values), ("meta", meta)] {
        check_aligned(arg, t, 16)?;
    }
    if l.m == 0 || l.k == 0 {
        return Ok(());
    }
    for (arg, t) in [("values", values), ("meta", meta), ("out", out)] {
        check_not_null(arg, t)?;
    }
    compress_launch(CompressKind::Decompress, &l, out, values, meta, None, false, stream)
}

/// The elements of a validated host tensor, from its data pointer: (rows - 1) · row_stride + cols.
pub(super) fn host_len(t: &TensorView) -> usize {
    let m = &t.meta;
    if m.shape.contains(&0) {
        return 0;
    }
    ((m.shape[0] - 1) * m.strides[0] + m.shape[1]) as usize
}

/// # Safety
/// `t` is a validated host tensor of 16-bit elements that stays alive and is not written
/// through another alias while the slice lives.
unsafe fn host_slice<'a>(t: &TensorView, len: usize) -> &'a [u16] {
    if len == 0 {
        return &[];
    }
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts(t.ptr as *const u16, len) }
}

/// # Safety
/// As `host_slice`, and no other slice of the same memory exists.
unsafe fn host_slice_mut<'a>(t: &TensorView, len: usize) -> &'a mut [u16] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts_mut(t.ptr as *mut u16, len) }
}

/// `t`'s data pointer is a multiple of `bytes` (the host reference reads u16 / u32 elements; the
/// GPU kernels read values 16 bytes at a time, and TMA needs 16-byte aligned values / meta).
pub(super) fn check_aligned(arg: &str, t: &TensorView, bytes: u64) -> Result<()> {
    if !t.ptr.is_multiple_of(bytes) {
        return Err(Error::argument(
            arg,
            format!("a {bytes}-byte aligned data pointer"),
            format!("address {:#x}", t.ptr),
        ));
    }
    Ok(())
}

/// The CPU reference of `compress` on host tensors; returns bad_groups.
pub fn compress_host(
    w: &TensorView,
    values: &TensorView,
    meta: &TensorView,
    prune: bool,
) -> Result<usize> {
    let l = validate_compress(w, values, meta, None, false)?;
    for (arg, t) in [("w", w), ("values", values), ("meta", meta)] {
        check_not_null(arg, t)?;
        check_aligned(arg, t, 2)?;
    }
    let nv = l.m_pad * l.k_pad / 2;
    let nm = l.m_pad * l.k_pad / 16;
    // SAFETY: validated host tensors of those lengths, pairwise non-overlapping; the caller
    // (the Python binding) keeps them alive for the call.
    let (wd, vd, md) = unsafe {
        (
            host_slice(w, host_len(w)),
            host_slice_mut(values, nv),
            host_slice_mut(meta, nm),
        )
    };
    let mat = host::Matrix {
        data: wd,
        rows: l.m,
        cols: l.k,
        row_stride: w.meta.strides[0].max(0) as usize,
    };
    Ok(match w.meta.dtype {
        DType::F16 => host::compress::<half::f16>(&mat, vd, md, prune),
        _ => host::compress::<half::bf16>(&mat, vd, md, prune),
    })
}

/// The CPU reference of `decompress` on host tensors.
pub fn decompress_host(values: &TensorView, meta: &TensorView, out: &TensorView) -> Result<()> {
    let l = validate_decompress(values, meta, out, false)?;
    if l.m == 0 || l.k == 0 {
        return Ok(());
    }
    for (arg, t) in [("values", values), ("meta", meta), ("out", out)] {
        check_not_null(arg, t)?;
        check_aligned(arg, t, 2)?;
    }
    let nv = l.m_pad * l.k_pad / 2;
    let nm = l.m_pad * l.k_pad / 16;
    // SAFETY: as in compress_host.
    let (vd, md, od) = unsafe {
        (
            host_slice(values, nv),
            host_slice(meta, nm),
            host_slice_mut(out, host_len(out)),
        )
    };
    host::decompress(vd, md, od, l.m, l.k, out.meta.strides[0].max(0) as usize);
    Ok(())
}

