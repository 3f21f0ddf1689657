//! Operations: validate → tuning config → JIT kernel → launch. One file per kernel family;
//! workspace.rs is the split-k / stream-K workspace the GEMM and 2:4 families share.

pub mod attention;
pub mod attention_bwd;
pub mod gemm;
pub(crate) mod persistent;
pub mod sparse24;
#[cfg(test)]
pub(crate) mod test_support;
pub(crate) mod validate;
pub mod workspace;

use crate::error::Result;
use crate::arch::Arch;
use crate::jit::precompile as pc;

/// Compile every production configuration of every kernel family (attention forward,
/// attention backward, kv-cache attention (split forward, combine, append), dense GEMM (wmma, sm90, sm90 split-k reduce), 2:4 sparse) for each arch name (no GPU needed); reports in that order.
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
    let kvcache: Vec<_> = archs.iter().flat_map(|a| attention::kvcache::production_specs(*a)).collect();
    reports.extend(pc::precompile(&kvcache)?);
    for a in &archs {
        let (combine, append) = attention::kvcache::production_helper_specs(*a);
        reports.extend(pc::precompile(&combine)?);
        reports.extend(pc::precompile(&append)?);
    }
    let gemm_wmma: Vec<_> = archs
        .iter()
        .flat_map(|a| gemm::wmma::production_specs(*a))
        .collect();
    reports.extend(pc::precompile(&gemm_wmma)?);
    let gemm_sm90: Vec<_> = archs
        .iter()
        .flat_map(|a| gemm::sm90::production_specs(*a))
        .collect();
    reports.extend(pc::precompile(&gemm_sm90)?);
    let gemm_splitk: Vec<_> = archs
        .iter()
        .flat_map(|a| gemm::sm90::reduce_production_specs(*a))
        .collect();
    reports.extend(pc::precompile(&gemm_splitk)?);
    for a in &archs {
        let (sp_matmul, sp_compress) = sparse24::production_specs(*a);
        reports.extend(pc::precompile(&sp_compress)?);
        reports.extend(pc::precompile(&sp_matmul)?);
        reports.extend(pc::precompile(&sparse24::wgmma_production_specs(*a))?);
    }
    if check_spills {
        pc::check_spills(&reports)?;
    }
    Ok(reports)
}
