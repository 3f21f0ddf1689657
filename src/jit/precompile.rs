//! Ahead-of-time compilation of a set of specialisations (no GPU needed): fills the disk
//! cache and reports each kernel's resources from the ptxas log.

use super::{obtain, ptxas, KernelSpec};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// One compiled kernel, as `precompile()` reports it.
#[derive(Clone, Debug)]
pub struct Report {
    pub kernel: &'static str,
    /// The name expression (the exact template instantiation).
    pub config: String,
    pub arch: &'static str,
    pub resources: ptxas::Resources,
    pub dynamic_smem_bytes: u32,
    pub cubin_bytes: usize,
    pub compile_seconds: f64,
    pub from_cache: bool,
}

impl Report {
    pub fn spills(&self) -> bool {
        self.resources.spill_stores > 0 || self.resources.spill_loads > 0
    }
}

fn one<K: KernelSpec>(spec: &K) -> Result<Report> {
    let o = obtain(spec)?;
    let resources = ptxas::parse(&o.compiled.log, &o.compiled.lowered_name).unwrap_or_default();
    Ok(Report {
        kernel: spec.kernel(),
        config: spec.name_expression(),
        arch: spec.arch().name(),
        resources,
        dynamic_smem_bytes: spec.dynamic_smem_bytes(),
        cubin_bytes: o.compiled.cubin.len(),
        compile_seconds: o.compile_seconds,
        from_cache: o.from_cache,
    })
}

/// Compile (or find in the disk cache) every spec, on all CPU cores; reports keep the
/// order of `specs`. The first compile error (in `specs` order) is returned.
pub fn precompile<K: KernelSpec>(specs: &[K]) -> Result<Vec<Report>> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<Report>>>> =
        Mutex::new((0..specs.len()).map(|_| None).collect());
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(specs.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= specs.len() {
                    break;
                }
                let r = one(&specs[i]);
                results.lock().unwrap()[i] = Some(r);
            });
        }
    });
    results
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("every spec was compiled"))
        .collect()
}

/// CompileError naming every spilling kernel, or Ok.
pub fn check_spills(reports: &[Report]) -> Result<()> {
    let spilling: Vec<String> = reports
        .iter()
        .filter(|r| r.spills())
        .map(|r| {
            format!(
                "{} [{}]: {} bytes spill stores, {} bytes spill loads, {} registers",
                r.config,
                r.arch,
                r.resources.spill_stores,
                r.resources.spill_loads,
                r.resources.registers
            )
        })
        .collect();
    if spilling.is_empty() {
        return Ok(());
    }
    let mut archs: Vec<&str> = reports
        .iter()
        .filter(|r| r.spills())
        .map(|r| r.arch)
        .collect();
    archs.dedup();
    Err(Error::Compile {
        name: format!(
            "{} production configuration(s) without spills",
            spilling.len()
        ),
        arch: archs.join(","),
        reason: "register spills".to_string(),
        log: spilling.join("\n"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(arch: &'static str, spill_stores: u32) -> Report {
        Report {
            kernel: "k",
            config: format!("k<{spill_stores}>"),
            arch,
            resources: ptxas::Resources {
                registers: 255,
                spill_stores,
                ..Default::default()
            },
            dynamic_smem_bytes: 0,
            cubin_bytes: 1,
            compile_seconds: 0.0,
            from_cache: false,
        }
    }

    #[test]
    fn spills_are_reported_per_kernel() {
        check_spills(&[report("sm_80", 0), report("sm_90a", 0)]).unwrap();
        let e = check_spills(&[report("sm_80", 0), report("sm_90a", 4), report("sm_90a", 8)])
            .unwrap_err();
        let Error::Compile { arch, log, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(arch, "sm_90a");
        assert!(
            log.contains("k<4> [sm_90a]: 4 bytes spill stores") && log.contains("k<8>"),
            "{log}"
        );
        assert!(!log.contains("k<0>"));
    }
}
