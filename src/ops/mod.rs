//! Operations: validate → tuning config → JIT kernel → launch. One file per kernel family.

pub mod attention;

use crate::error::Result;
use crate::jit::{precompile as pc, Arch};

/// Compile every production configuration of every kernel family for each arch name
/// (no GPU needed). With `check_spills`, a spilling configuration is a CompileError.
pub fn precompile(archs: &[String], check_spills: bool) -> Result<Vec<pc::Report>> {
    let archs = archs
        .iter()
        .map(|a| Arch::from_name(a))
        .collect::<Result<Vec<_>>>()?;
    let specs: Vec<_> = archs
        .iter()
        .flat_map(|a| attention::production_specs(*a))
        .collect();
    let reports = pc::precompile(&specs)?;
    if check_spills {
        pc::check_spills(&reports)?;
    }
    Ok(reports)
}
