//! The persistent grid of a launch: reads $FERROATTN_PERSISTENT_GRID (per call) and applies
//! [`GridPolicy`] (src/tuning/grid.rs) to a kernel's work tiles and the device's SM count.

use crate::error::{Error, Result};
use crate::tuning::grid::GridPolicy;

/// The environment variable that selects the [`GridPolicy`]: unset / "balanced" (default),
/// "full" (one CTA per SM), or an integer n >= 1 (balanced over at most n SMs).
pub const GRID_ENV: &str = "FERROATTN_PERSISTENT_GRID";

/// CTAs for a persistent kernel with `tiles` work tiles on a device with `sms` SMs.
/// Errors: ArgumentError naming $FERROATTN_PERSISTENT_GRID when its value is not one of the above.
pub fn persistent_grid(tiles: u64, sms: u64) -> Result<u64> {
    let v = std::env::var(GRID_ENV).ok();
    let policy = GridPolicy::parse(v.as_deref()).ok_or_else(|| {
        Error::argument(
            GRID_ENV,
            "unset, \"balanced\", \"full\" or an integer >= 1",
            format!("{:?}", v.clone().unwrap_or_default()),
        )
    })?;
    Ok(policy.grid(tiles, sms))
}
