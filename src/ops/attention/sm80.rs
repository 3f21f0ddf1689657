//! The sm80 attention-forward family (kernels/attention/fwd_sm80.cuh, mma.sync): runs on every
//! GPU >= sm_80 and takes every call the sm90 family does not.

use crate::error::Result;
use crate::launch::launch as launch_kernel;
use crate::launch_record::LaunchInfo;
use crate::ops::attention::{batch_slices, launch_shape, AttnFwdParams, BatchSlice, Problem, KERNELS};
use crate::tuning::attention::AttnFwdConfig;

/// Launch `config` for the validated problem `p` with parameters `prm` on `stream`: one launch
/// per batch slice of at most `MAX_LAUNCH_BATCH` entries (src/ops/attention/batch.rs). `work`
/// gives each slice's launch record.
///
/// # Safety
/// `prm` must come from `ops::attention::params` for `p`; the caller keeps the tensors alive in
/// stream order.
pub unsafe fn launch(
    p: &Problem,
    config: AttnFwdConfig,
    prm: &AttnFwdParams,
    stream: u64,
    work: impl Fn(BatchSlice) -> LaunchInfo,
) -> Result<()> {
    // The first slice is the widest: its grid stands for every launch's.
    launch_shape(&p.slice(BatchSlice::first(p.batch)), &config).check()?;
    let kernel = KERNELS.get(&config, p.device)?;
    for s in batch_slices(p.batch) {
        let mut slice_prm = prm.slice(p.dtype, s);
        // SAFETY: forwarded from the caller.
        unsafe { launch_kernel(kernel, p.device, &launch_shape(&p.slice(s), &config), stream, &mut slice_prm, &work(s))? };
    }
    Ok(())
}
