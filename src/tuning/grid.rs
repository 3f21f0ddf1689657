//! Persistent-kernel grids: how many CTAs a persistent kernel (one that loops over work tiles,
//! CTA i taking tiles i, i + gridDim.x, ...) is launched with. Pure functions, unit-tested on CPU;
//! the policy is the `persistent_grid` knob (src/tuning/knobs.rs).
//!
//! Used by the wgmma kernels: dense GEMM on sm_90a (kernels/gemm/sm90.cuh, non-cluster schedules)
//! and 2:4 sparse GEMM (kernels/sparse24/wgmma_sp.cuh). Any grid in 1..=tiles is correct for them.

/// How the persistent grid is sized (the `persistent_grid` knob).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GridPolicy {
    /// The fewest CTAs that keep the wave count ceil(tiles / SMs) ([`balanced_grid`]); the default.
    Balanced,
    /// One CTA per SM (min(tiles, SMs)): the grid before the balanced rule.
    Full,
    /// Balanced over at most this many SMs (>= 1): for experiments.
    Max(u64),
}

impl GridPolicy {
    /// CTAs for `tiles` work tiles on `sms` SMs under this policy (always in 1..=max(tiles, 1)).
    pub fn grid(self, tiles: u64, sms: u64) -> u64 {
        match self {
            GridPolicy::Balanced => balanced_grid(tiles, sms),
            GridPolicy::Full => tiles.min(sms.max(1)).max(1),
            GridPolicy::Max(n) => balanced_grid(tiles, n.min(sms.max(1))),
        }
    }
}

/// The FEWEST CTAs (at most one per SM) that keep the wave count ceil(tiles / sms), i.e.
/// ceil(tiles / ceil(tiles / sms)); every CTA then runs ceil(tiles / sms) tiles or one fewer, and
/// a partial last wave leaves whole SMs idle for the whole call instead of running a short tail on
/// some of them. tiles <= sms: `tiles` (at least 1). Examples (132 SMs): 2048 tiles -> 128 CTAs (16
/// waves either way), 3584 -> 128, 7168 -> 131, 2752 -> 132.
/// Why (H200, paired same-process runs, bench/NOTES.md "wgmma_sp balanced persistent grid vs
/// cuSPARSELt"): for the 2:4 kernel, where this gives 128 CTAs instead of 132 the same waves
/// finish 1.7-4.4 % sooner (8192^3, 16384x4096x11008, 8192x14336x4096, bf16 and fp16); grids that
/// stay at 131-132 are unchanged (0.999-1.004x); no measured shape got slower. Mechanism not
/// isolated: the software power cap was flagged in most timing windows (fewer busy SMs, higher
/// clocks), and 128 concurrent CTAs cover whole raster groups (132 straddle them).
pub fn balanced_grid(tiles: u64, sms: u64) -> u64 {
    let sms = sms.max(1);
    if tiles <= sms {
        return tiles.max(1);
    }
    tiles.div_ceil(tiles.div_ceil(sms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_grid_keeps_the_waves_with_the_fewest_ctas() {
        // the shapes measured for the balanced rule (256 x 128 tiles of the 2:4 kernel, 132 SMs)
        assert_eq!(balanced_grid(2048, 132), 128);
        assert_eq!(balanced_grid(3584, 132), 128);
        assert_eq!(balanced_grid(7168, 132), 131);
        assert_eq!(balanced_grid(2752, 132), 132);
        assert_eq!(balanced_grid(1792, 132), 128);
        assert_eq!(balanced_grid(1, 132), 1);
        assert_eq!(balanced_grid(0, 132), 1);
        assert_eq!(balanced_grid(132, 132), 132);
        assert_eq!(balanced_grid(133, 132), 67);
        assert_eq!(balanced_grid(5, 0), 1);
        for tiles in 1..3000u64 {
            for sms in [1u64, 7, 78, 114, 132] {
                let g = balanced_grid(tiles, sms);
                assert!(g >= 1 && g <= sms.min(tiles), "{tiles} {sms} -> {g}");
                // same number of waves as one CTA per SM, and one CTA fewer would need more
                assert_eq!(
                    tiles.div_ceil(g),
                    tiles.div_ceil(sms.min(tiles)),
                    "{tiles} {sms}"
                );
                if g > 1 {
                    assert!(tiles.div_ceil(g - 1) > tiles.div_ceil(g), "{tiles} {sms}");
                }
            }
        }
    }

    #[test]
    fn policy_grids() {
        assert_eq!(GridPolicy::Full.grid(2048, 132), 132);
        assert_eq!(GridPolicy::Full.grid(5, 132), 5);
        assert_eq!(GridPolicy::Full.grid(0, 132), 1);
        assert_eq!(GridPolicy::Balanced.grid(2048, 132), 128);
        assert_eq!(GridPolicy::Max(100).grid(2048, 132), 98);
        assert_eq!(GridPolicy::Max(500).grid(2048, 132), 128);
    }
}
