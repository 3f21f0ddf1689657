//! The persistent grid of a launch: the `persistent_grid` knob's `GridPolicy`
//! (src/tuning/grid.rs) applied to a kernel's work tiles and the device's SM count.

use crate::error::Result;
use crate::tuning::knobs;

/// CTAs for a persistent kernel with `tiles` work tiles on a device with `sms` SMs.
/// Errors: ArgumentError naming $FERROATTN_PERSISTENT_GRID when its value is malformed.
pub fn persistent_grid(tiles: u64, sms: u64) -> Result<u64> {
    Ok(knobs::get()?.persistent_grid.grid(tiles, sms))
}
