//! Stamps (experimental; off the default path).
//!
//! A stamp is a mark taken by a kernel instead of an event: `profiler_stamp`
//! (kernels/profiler/stamp.cuh, one thread, compiled by the JIT engine like every other kernel,
//! JIT-only: not in the precompile sets) writes %globaltimer (GPU nanoseconds) into one slot of a
//! per-device buffer, launched on the caller's stream. Host cost per stamp: the capture check (as
//! for a mark), the stamp book's lock and one cuLaunchKernel (no cuEventRecord). The question it
//! answers (scripts/profiler_overhead.py, modes *_stamp*): is a kernel launch cheaper in situ than
//! an event record? Stamps are resolved by one device synchronisation + one copy of the slots.
//!
//! Slots: STAMP_SLOTS per device (u64 each), handed out in order; once every stamp of a device is
//! resolved or released the next stamp starts at slot 0 again. More than STAMP_SLOTS unresolved
//! stamps on a device: not recorded (id 0, counted as dropped). A released (not resolved) stamp's
//! kernel may still be queued: releasing while such a stamp runs on another stream than the next
//! stamps of the same slot is a race (the hooks release only after a resolve or discard between
//! forwards; the experiment resolves every forward).

use super::book::unknown_id;
use super::capture::{capturing, scoped_may_record, Scope};
use super::driver::{bind_cached, lock};
use super::stamp_book::StampBook;
use crate::error::{CudaResultExt, Result};
use cudarc::driver::{result as cu, sys};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Slots per device (8 bytes each: 512 KiB).
pub const STAMP_SLOTS: u32 = 1 << 16;

/// Which kernel of kernels/profiler/stamp.cuh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StampKernel {
    /// `profiler_stamp(u64* slot)`.
    Stamp,
    /// `profiler_globaltimer_probe(u64* out, int iters)`.
    Probe,
}

/// The stamp kernels' KernelSpec (JIT-only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StampSpec {
    pub kernel: StampKernel,
    pub arch: crate::arch::Arch,
}

impl crate::jit::KernelSpec for StampSpec {
    fn kernel(&self) -> &'static str {
        match self.kernel {
            StampKernel::Stamp => "ferroattn::profiler_stamp",
            StampKernel::Probe => "ferroattn::profiler_globaltimer_probe",
        }
    }
    fn header(&self) -> &'static str {
        "profiler/stamp.cuh"
    }
    fn name_expression(&self) -> String {
        self.kernel().to_string()
    }
    fn arch(&self) -> crate::arch::Arch {
        self.arch
    }
    fn dynamic_smem_bytes(&self) -> u32 {
        0
    }
}

static STAMP_KERNELS: crate::jit::KernelMap<StampSpec> = crate::jit::KernelMap::new();

/// The counters of `profiler_stamp_stats()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StampStats {
    /// Stamps recorded and not yet resolved or released.
    pub live: usize,
    /// Stamps not recorded because every slot of their device was unresolved.
    pub dropped: u64,
    /// Slots per device.
    pub slots: u32,
}

/// A device's slot buffer (CUdeviceptr) and stamp kernel (CUfunction as usize).
#[derive(Clone, Copy, Debug)]
struct StampDevice {
    buf: u64,
    function: usize,
}

struct Stamps {
    book: StampBook,
    devices: BTreeMap<i32, StampDevice>,
}

static STAMPS: Mutex<Stamps> = Mutex::new(Stamps {
    book: StampBook::new(STAMP_SLOTS),
    devices: BTreeMap::new(),
});

/// Stamp counters. Needs no driver.
pub fn stamp_stats() -> StampStats {
    let s = lock(&STAMPS);
    StampStats {
        live: s.book.stamps.len(),
        dropped: s.book.dropped,
        slots: s.book.slots,
    }
}

/// The stamp kernel and slot buffer of `device` (its primary context current): made on the
/// first call (JIT compile or disk cache, cuMemAlloc of STAMP_SLOTS × 8 bytes, zeroed).
fn stamp_device(device: i32) -> Result<StampDevice> {
    if let Some(d) = lock(&STAMPS).devices.get(&device) {
        return Ok(*d);
    }
    let spec = StampSpec {
        kernel: StampKernel::Stamp,
        arch: crate::device::arch(device)?,
    };
    let kernel = STAMP_KERNELS.get(&spec, device)?;
    crate::device::bind(device)?;
    let bytes = STAMP_SLOTS as usize * 8;
    // SAFETY: a plain device allocation in the current (primary) context, zeroed before use.
    let buf = unsafe { cu::malloc_sync(bytes) }.call("cuMemAlloc")?;
    unsafe { cu::memset_d8_sync(buf, 0, bytes) }.call("cuMemsetD8")?;
    let mut s = lock(&STAMPS);
    // another thread may have won: keep the first (the loser's 512 KiB stay allocated)
    let d = *s.devices.entry(device).or_insert(StampDevice {
        buf,
        function: kernel.function() as usize,
    });
    Ok(d)
}

/// Launch the stamp kernel for a new stamp of `device` on `s` (the checks done).
fn record_stamp(device: i32, s: sys::CUstream) -> Result<u64> {
    let mut st = lock(&STAMPS);
    let dev = match st.devices.get(&device) {
        Some(d) => *d,
        None => {
            drop(st);
            let d = stamp_device(device)?;
            st = lock(&STAMPS);
            d
        }
    };
    let Some((id, slot)) = st.book.alloc(device) else {
        return Ok(0);
    };
    let mut ptr: u64 = dev.buf + 8 * slot as u64;
    let mut args = [&mut ptr as *mut u64 as *mut std::ffi::c_void];
    // SAFETY: the loaded stamp kernel (one u64* parameter), a slot inside this device's buffer
    // (never freed), on the caller's stream; launched 1 x 1.
    let launched = unsafe {
        cu::launch_kernel(
            dev.function as sys::CUfunction,
            (1, 1, 1),
            (1, 1, 1),
            0,
            s,
            &mut args,
        )
    }
    .call("cuLaunchKernel(profiler_stamp)");
    if let Err(e) = launched {
        st.book.unalloc(id);
        return Err(e);
    }
    Ok(id)
}

/// [`mark`](super::mark) with a stamp: the full capture check on `stream` (a raw CUstream of `device`; 0 =
/// its legacy stream), then the stamp kernel launched there. Returns the stamp's id (> 0), or 0
/// when nothing was recorded (capturing stream, every slot unresolved). The first stamp of a
/// device compiles (or loads) the kernel and allocates the slots.
pub fn stamp(device: i32, stream: u64) -> Result<u64> {
    bind_cached(device)?;
    let s = stream as sys::CUstream;
    if capturing(s) {
        return Ok(0);
    }
    record_stamp(device, s)
}

/// [`mark_scoped`](super::mark_scoped) with a stamp (the same capture checks, [`Scope`] for [`Scope`]).
pub fn stamp_scoped(device: i32, stream: u64, scope: Scope) -> Result<u64> {
    bind_cached(device)?;
    if !scoped_may_record(stream, scope) {
        return Ok(0);
    }
    record_stamp(device, stream as sys::CUstream)
}

fn unknown_stamp(id: u64) -> crate::error::Error {
    unknown_id("stamps", "profiler_stamp", id)
}

/// The %globaltimer value (ns) of each stamp of `ids`, in that order. Waits for every stream of
/// each involved device's primary context (cuCtxSynchronize), then copies the slot range once
/// per device; the stamps are forgotten (also when that fails: then the first CudaError).
/// ArgumentError naming `stamps`, nothing forgotten, for an id that is not an unresolved stamp.
/// No ids: no driver call.
pub fn stamps_resolve(ids: &[u64]) -> Result<Vec<u64>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let (taken, devices) = {
        let mut s = lock(&STAMPS);
        let taken = s.book.take(ids).map_err(unknown_stamp)?;
        let devices = s.devices.clone();
        (taken, devices)
    };
    let read = (|| -> Result<Vec<u64>> {
        let mut out = vec![0u64; taken.len()];
        let mut per_device: BTreeMap<i32, Vec<usize>> = BTreeMap::new();
        for (i, (d, _)) in taken.iter().enumerate() {
            per_device.entry(*d).or_default().push(i);
        }
        for (d, idx) in per_device {
            let dev = devices
                .get(&d)
                .copied()
                .ok_or_else(|| unknown_stamp(ids[idx[0]]))?;
            crate::device::bind(d)?;
            cu::ctx::synchronize().call("cuCtxSynchronize")?;
            let lo = idx.iter().map(|&i| taken[i].1).min().unwrap_or(0);
            let hi = idx.iter().map(|&i| taken[i].1).max().unwrap_or(0);
            let mut host = vec![0u64; (hi - lo + 1) as usize];
            // SAFETY: slots lo..=hi lie inside the device's buffer (slot < STAMP_SLOTS).
            unsafe { cu::memcpy_dtoh_sync(&mut host, dev.buf + 8 * lo as u64) }
                .call("cuMemcpyDtoH")?;
            for i in idx {
                out[i] = host[(taken[i].1 - lo) as usize];
            }
        }
        Ok(out)
    })();
    lock(&STAMPS).book.finish(taken.iter().map(|(d, _)| *d));
    read
}

/// Forget the unresolved stamps among `ids` (others ignored); how many. Needs no driver.
pub fn stamps_release(ids: &[u64]) -> usize {
    lock(&STAMPS).book.release(ids)
}

/// %globaltimer as the GPU updates it: one thread of `profiler_globaltimer_probe` reads it
/// `iters` times on `device`'s legacy stream (waits for it). Returns [smallest non-zero step,
/// reads that changed, last - first, largest step] (ns, count, ns, ns).
pub fn globaltimer_probe(device: i32, iters: i32) -> Result<[u64; 4]> {
    if iters < 1 {
        return Err(crate::error::Error::argument("iters", "an int >= 1", iters));
    }
    let spec = StampSpec {
        kernel: StampKernel::Probe,
        arch: crate::device::arch(device)?,
    };
    let kernel = STAMP_KERNELS.get(&spec, device)?;
    crate::device::bind(device)?;
    // SAFETY: 32 bytes in the current context, freed below.
    let buf = unsafe { cu::malloc_sync(32) }.call("cuMemAlloc")?;
    let run = (|| -> Result<[u64; 4]> {
        let mut ptr = buf;
        let mut n = iters;
        let mut args = [
            &mut ptr as *mut u64 as *mut std::ffi::c_void,
            &mut n as *mut i32 as *mut std::ffi::c_void,
        ];
        // SAFETY: the probe kernel (u64*, int), a 32-byte buffer, one thread.
        unsafe {
            cu::launch_kernel(
                kernel.function(),
                (1, 1, 1),
                (1, 1, 1),
                0,
                std::ptr::null_mut(),
                &mut args,
            )
        }
        .call("cuLaunchKernel(profiler_globaltimer_probe)")?;
        cu::ctx::synchronize().call("cuCtxSynchronize")?;
        let mut out = [0u64; 4];
        // SAFETY: the 32-byte buffer written by the probe.
        unsafe { cu::memcpy_dtoh_sync(&mut out, buf) }.call("cuMemcpyDtoH")?;
        Ok(out)
    })();
    // SAFETY: allocated above; the probe has finished (synchronised) or never ran.
    let _ = unsafe { cu::free_sync(buf) };
    run
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn stamp_spec_names_the_header_and_kernels() {
        use crate::jit::KernelSpec;
        let s = StampSpec {
            kernel: StampKernel::Stamp,
            arch: crate::arch::Arch::Sm90a,
        };
        assert_eq!(s.name_expression(), "ferroattn::profiler_stamp");
        assert_eq!(s.dynamic_smem_bytes(), 0);
        let text =
            crate::jit::sources::get(s.header()).expect("kernels/profiler/stamp.cuh embedded");
        for k in [StampKernel::Stamp, StampKernel::Probe] {
            let name = StampSpec { kernel: k, ..s }.kernel();
            let short = name.rsplit("::").next().unwrap();
            assert!(
                text.contains(&format!("__global__ void {short}(")),
                "{short}"
            );
        }
        assert!(text.contains("%%globaltimer"));
    }

    #[test]
    fn stamp_kernels_compile_without_spills() {
        // JIT-only kernels (not in the precompile sets): compiled here so a broken header fails a test
        if crate::jit::nvrtc::tests::toolchain().is_none() {
            return;
        }
        let specs: Vec<StampSpec> = [crate::arch::Arch::Sm80, crate::arch::Arch::Sm90a]
            .into_iter()
            .flat_map(|arch| {
                [StampKernel::Stamp, StampKernel::Probe].map(|kernel| StampSpec { kernel, arch })
            })
            .collect();
        let reports = crate::jit::precompile::precompile(&specs).unwrap();
        assert_eq!(reports.len(), 4);
        for r in &reports {
            assert!(r.cubin_bytes > 0, "{}", r.config);
        }
        crate::jit::precompile::check_spills(&reports).unwrap();
    }

    #[test]
    fn stamp_functions_without_a_driver() {
        assert_eq!(stamps_release(&[u64::MAX - 1]), 0);
        assert_eq!(stamps_resolve(&[]).unwrap(), Vec::<u64>::new());
        assert!(matches!(
            stamps_resolve(&[u64::MAX - 1]),
            Err(Error::Argument { .. })
        ));
        assert!(matches!(
            globaltimer_probe(0, 0),
            Err(Error::Argument { .. })
        ));
        assert_eq!(stamp_stats().slots, STAMP_SLOTS);
        if !crate::device::cuda_available() {
            assert!(stamp(0, 0).is_err(), "no device: an error, not a stamp");
            assert!(stamp_scoped(0, 0, Scope::Open).is_err());
        }
    }
}
