//! The GPU architectures kernels are compiled for: a hardware fact, read by `device`
//! (what the device is), `jit` (what to compile for) and `tuning` (what fits).

use crate::error::{Error, Result};

/// A GPU architecture kernels are compiled for (CUBIN, not PTX).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arch {
    Sm80,
    Sm86,
    Sm87,
    Sm89,
    /// Hopper: always the arch-specific `sm_90a` (wgmma, setmaxnreg need it).
    Sm90a,
    Sm100,
    Sm103,
    Sm110,
    Sm120,
    Sm121,
}

impl Arch {
    pub const ALL: [Arch; 10] = [
        Arch::Sm80,
        Arch::Sm86,
        Arch::Sm87,
        Arch::Sm89,
        Arch::Sm90a,
        Arch::Sm100,
        Arch::Sm103,
        Arch::Sm110,
        Arch::Sm120,
        Arch::Sm121,
    ];

    /// Most dynamic shared memory one block may opt into, in bytes (CUDA programming guide,
    /// "Technical Specifications per Compute Capability").
    pub fn max_smem_per_block(self) -> u32 {
        match self {
            Arch::Sm80 | Arch::Sm87 => 163 * 1024,
            Arch::Sm86 | Arch::Sm89 | Arch::Sm120 | Arch::Sm121 => 99 * 1024,
            Arch::Sm90a | Arch::Sm100 | Arch::Sm103 | Arch::Sm110 => 227 * 1024,
        }
    }

    /// Shared memory of one SM, in bytes (same source): what the blocks on it share.
    pub fn max_smem_per_sm(self) -> u32 {
        match self {
            Arch::Sm80 | Arch::Sm87 => 164 * 1024,
            Arch::Sm86 | Arch::Sm89 | Arch::Sm120 | Arch::Sm121 => 100 * 1024,
            Arch::Sm90a | Arch::Sm100 | Arch::Sm103 | Arch::Sm110 => 228 * 1024,
        }
    }

    /// The NVRTC `--gpu-architecture` value and cache directory name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm86 => "sm_86",
            Arch::Sm87 => "sm_87",
            Arch::Sm89 => "sm_89",
            Arch::Sm90a => "sm_90a",
            Arch::Sm100 => "sm_100",
            Arch::Sm103 => "sm_103",
            Arch::Sm110 => "sm_110",
            Arch::Sm120 => "sm_120",
            Arch::Sm121 => "sm_121",
        }
    }

    /// Parse a name as `precompile` receives it; "sm_90" means sm_90a (as `from_sm` does).
    pub fn from_name(name: &str) -> Result<Arch> {
        if name == "sm_90" {
            return Ok(Arch::Sm90a);
        }
        Arch::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| {
                Error::argument(
                    "archs",
                    format!("one of {}", Arch::ALL.map(|a| a.name()).join(", ")),
                    format!("{name:?}"),
                )
            })
    }

    /// The arch to compile for on a device of compute capability major.minor. A CUBIN
    /// runs on later minors of its major, so an unknown minor takes the nearest lower
    /// known one; sm_90 devices get sm_90a; below sm_80 → UnsupportedGpu.
    pub fn from_sm(major: i32, minor: i32) -> Result<Arch> {
        let known: &[(i32, Arch)] = match major {
            8 => &[
                (0, Arch::Sm80),
                (6, Arch::Sm86),
                (7, Arch::Sm87),
                (9, Arch::Sm89),
            ],
            9 => &[(0, Arch::Sm90a)],
            10 => &[(0, Arch::Sm100), (3, Arch::Sm103)],
            11 => &[(0, Arch::Sm110)],
            12 => &[(0, Arch::Sm120), (1, Arch::Sm121)],
            _ => &[],
        };
        known
            .iter()
            .rev()
            .find(|(m, _)| *m <= minor)
            .map(|(_, a)| *a)
            .ok_or(Error::UnsupportedGpu { major, minor })
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_mapping() {
        assert_eq!(Arch::from_sm(8, 0).unwrap(), Arch::Sm80);
        assert_eq!(Arch::from_sm(8, 6).unwrap(), Arch::Sm86);
        assert_eq!(Arch::from_sm(8, 9).unwrap(), Arch::Sm89);
        assert_eq!(Arch::from_sm(8, 8).unwrap(), Arch::Sm87); // unknown minor: nearest lower
        assert_eq!(Arch::from_sm(9, 0).unwrap(), Arch::Sm90a);
        assert_eq!(Arch::from_sm(12, 0).unwrap(), Arch::Sm120);
        assert!(matches!(
            Arch::from_sm(7, 5),
            Err(Error::UnsupportedGpu { major: 7, minor: 5 })
        ));
        assert!(matches!(
            Arch::from_sm(6, 1),
            Err(Error::UnsupportedGpu { .. })
        ));
        assert!(matches!(
            Arch::from_sm(99, 0),
            Err(Error::UnsupportedGpu { .. })
        ));
        for a in Arch::ALL {
            assert_eq!(Arch::from_name(a.name()).unwrap(), a);
        }
        assert_eq!(Arch::from_name("sm_90").unwrap(), Arch::Sm90a);
        assert_eq!(Arch::Sm90a.name(), "sm_90a");
        let e = Arch::from_name("sm_75").unwrap_err().to_string();
        assert!(
            e.contains("archs") && e.contains("sm_75") && e.contains("sm_90a"),
            "{e}"
        );
    }
}
