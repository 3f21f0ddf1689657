//! Operations: validate → tuning config → JIT kernel → launch. One file per kernel family.

pub mod attention;
pub mod attention_bwd;
#[cfg(test)]
pub(crate) mod test_support;
pub mod work;

use crate::error::Result;
use crate::jit::{precompile as pc, Arch};

/// Compile every production configuration of every kernel family (attention forward, then
/// attention backward) for each arch name (no GPU needed); reports in that order.
/// With `check_spills`, a spilling configuration is a CompileError.
pub fn precompile(archs: &[String], check_spills: bool) -> Result<Vec<pc::Report>> {
    let archs = archs
        .iter()
        .map(|a| Arch::from_name(a))
        .collect::<Result<Vec<_>>>()?;
    let fwd: Vec<_> = archs
        .iter()
        .flat_map(|a| attention::production_specs(*a))
        .collect();
    let bwd: Vec<_> = archs
        .iter()
        .flat_map(|a| attention_bwd::production_specs(*a))
        .collect();
    let mut reports = pc::precompile(&fwd)?;
    reports.extend(pc::precompile(&bwd)?);
    if check_spills {
        pc::check_spills(&reports)?;
    }
    Ok(reports)
}
