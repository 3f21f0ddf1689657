//! Tuning knobs: the switches that choose between kernel paths, as one typed value. Read from
//! the environment once (the first call of `get`), changeable afterwards through `set` (tests and
//! A/B benchmarks: `ferroattn._native.set_tuning_knob(name, value)`, read back with
//! `ferroattn._native.tuning_knobs()`). A malformed value is an ArgumentError naming the variable
//! (or the knob), the values it takes and the value given; never silently ignored. The pure
//! `tuning/` functions take the knobs they need as arguments; only the ops layer calls `get`.
//!
//! The table of every knob (variable, name, values, effect) is in docs/DEVELOPING.md ("Tuning
//! knobs"); a test checks that it lists exactly `KNOBS` with their defaults. The text forms of
//! the values are in knobs/values.rs.

mod values;

use crate::error::{Error, Result};
use crate::tuning::attention::KvRelease;
use crate::tuning::gemm::{StreamK, WmmaTile};
use crate::tuning::gemm_sm90::{SchedulePolicy, DEFAULT_FAST_EPILOGUE, DEFAULT_POLICY};
use crate::tuning::grid::GridPolicy;
use crate::tuning::sparse24::{FusePolicy, SplitPolicy, StreamKPolicy, Tile, TilePolicy, WgmmaEpilogue, WgmmaMainloop};
use std::sync::RwLock;
pub use values::{Choice, FamilyChoice, KnobValue, RasterGroup, RingStages};

/// The value of knob text `value` (trimmed; empty: `default`); `source` (the variable or the knob
/// name) and the accepted values are named in the error.
fn parse_knob<T: KnobValue>(source: &str, value: &str, default: T) -> Result<T> {
    match value.trim() {
        "" => Ok(default),
        t => T::parse(t).ok_or_else(|| Error::argument(source, T::EXPECTED, shown(value))),
    }
}

/// How an error shows a rejected knob text: quoted, and cut to its first `SHOWN_CHARS` characters
/// (with the full length) when it is longer, so a huge value does not become a huge message.
fn shown(value: &str) -> String {
    const SHOWN_CHARS: usize = 64;
    let n = value.chars().count();
    if n <= SHOWN_CHARS {
        return format!("{value:?}");
    }
    let head: String = value.chars().take(SHOWN_CHARS).collect();
    format!("{head:?}… ({n} characters)")
}

/// Declares `Knobs` (one typed field per knob, with its default), `KNOBS` (name, variable) and
/// the text access by name, from one list.
macro_rules! knobs {
    ($( $(#[$doc:meta])* $field:ident : $ty:ty = $default:expr, $var:literal; )*) => {
        /// Every knob, typed.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct Knobs {
            $( $(#[$doc])* pub $field: $ty, )*
        }

        impl Default for Knobs {
            fn default() -> Knobs {
                Knobs { $( $field: $default, )* }
            }
        }

        /// (knob name, environment variable) of every knob.
        pub const KNOBS: &[(&str, &str)] = &[ $( (stringify!($field), $var), )* ];

        impl Knobs {
            /// Set knob `name` from its text form; `source` names the variable or knob in errors.
            /// ArgumentError naming `name` for an unknown knob, naming `source` for a bad value.
            fn set_text(&mut self, name: &str, value: &str, source: &str) -> Result<()> {
                match name {
                    $( stringify!($field) => self.$field = parse_knob(source, value, $default)?, )*
                    other => {
                        let names: Vec<_> = KNOBS.iter().map(|(n, _)| *n).collect();
                        return Err(Error::argument("name", format!("one of {}", names.join(", ")), shown(other)));
                    }
                }
                Ok(())
            }

            /// (name, text form of the value) of every knob.
            pub fn items(&self) -> Vec<(&'static str, String)> {
                vec![ $( (stringify!($field), self.$field.text()), )* ]
            }
        }
    };
}

knobs! {
    /// Attention-forward kernel family.
    attn_fwd_family: FamilyChoice = FamilyChoice::Auto, "FERROATTN_ATTN_FWD_FAMILY";
    /// Attention-backward kernel family.
    attn_bwd_family: FamilyChoice = FamilyChoice::Auto, "FERROATTN_ATTN_BWD_FAMILY";
    /// How the Hopper attention forward's K/V ring releases its slots (auto: `FwdPolicy::form`'s rule).
    attn_sm90_fwd_kv_release: Choice<KvRelease> = Choice::Auto, "FERROATTN_ATTN_SM90_FWD_KV_RELEASE";
    /// A forced K/V ring depth of the Hopper attention forward.
    attn_sm90_fwd_stages: RingStages = RingStages::Auto, "FERROATTN_ATTN_SM90_FWD_STAGES";
    /// The Hopper attention forward's persistent form (one block per SM over its share of tiles;
    /// auto: `FwdPolicy::form`'s rule).
    attn_sm90_fwd_persistent: Choice<bool> = Choice::Auto, "FERROATTN_ATTN_SM90_FWD_PERSISTENT";
    /// Whether head dims 129..=192 run on the dedicated 192 Hopper attention forward.
    attn_sm90_fwd_d192: bool = false, "FERROATTN_ATTN_SM90_FWD_D192";
    /// Whether varlen attention forwards may run on the Hopper kernel.
    attn_sm90_fwd_varlen: bool = false, "FERROATTN_ATTN_SM90_FWD_VARLEN";
    /// The Hopper attention backward's product order: dQ issued with dK (reduced under it).
    attn_sm90_bwd_dq_overlap: bool = false, "FERROATTN_ATTN_SM90_BWD_DQ_OVERLAP";
    /// Whether varlen attention backwards may run on the Hopper kernel.
    attn_sm90_bwd_varlen: bool = false, "FERROATTN_ATTN_SM90_BWD_VARLEN";
    /// Whether the Hopper attention backward may keep dq_accum in tiles (one bulk reduction per
    /// warpgroup and query tile) where the call's shape allows it (src/ops/attention_bwd/sm90.rs).
    attn_sm90_bwd_dq_tiled: bool = false, "FERROATTN_ATTN_SM90_BWD_DQ_TILED";
    /// Whether the Hopper attention backward's dropout keep words come from the producer
    /// warpgroup's idle warps (instead of each consumer thread's own Philox calls).
    attn_sm90_bwd_mask_warps: bool = false, "FERROATTN_ATTN_SM90_BWD_MASK_WARPS";
    /// Schedule of the Hopper dense GEMM (src/tuning/gemm_sm90.rs).
    gemm_sm90_schedule: SchedulePolicy = DEFAULT_POLICY, "FERROATTN_GEMM_SM90_SCHEDULE";
    /// The Hopper dense GEMM's branch-free epilogue loop for calls without c and aux.
    gemm_sm90_fast_epilogue: bool = DEFAULT_FAST_EPILOGUE, "FERROATTN_GEMM_SM90_FAST_EPILOGUE";
    /// Split-k of small-m Hopper dense GEMMs (src/ops/gemm/sm90/splitk.rs).
    gemm_sm90_splitk: bool = true, "FERROATTN_GEMM_SM90_SPLITK";
    /// Tile rows per raster group of the WMMA GEMM.
    gemm_wmma_group: RasterGroup = RasterGroup::DEFAULT, "FERROATTN_GEMM_WMMA_GROUP";
    /// Stream-k tail of the WMMA GEMM's persistent tile.
    gemm_wmma_streamk: StreamK = StreamK::Auto, "FERROATTN_GEMM_WMMA_STREAMK";
    /// A forced WMMA GEMM tile (None: `wmma_tile`'s choice).
    gemm_wmma_tile: Option<WmmaTile> = None, "FERROATTN_GEMM_WMMA_TILE";
    /// Grid of the persistent Hopper kernels (src/tuning/grid.rs).
    persistent_grid: GridPolicy = GridPolicy::Balanced, "FERROATTN_PERSISTENT_GRID";
    /// Whether 2:4 matmuls may run the wgmma .sp kernel.
    sparse24_wgmma: bool = true, "FERROATTN_SPARSE24_WGMMA";
    /// A forced mma.sp tile (None: `matmul_config`'s choice).
    sparse24_tile: Option<Tile> = None, "FERROATTN_SPARSE24_TILE";
    /// Split-k of wgmma .sp.
    sparse24_splitk: SplitPolicy = SplitPolicy::Auto, "FERROATTN_SPARSE24_SPLITK";
    /// Whether wgmma .sp split-k fuses the reduce.
    sparse24_splitk_fuse: FusePolicy = FusePolicy::Auto, "FERROATTN_SPARSE24_SPLITK_FUSE";
    /// Which tile wgmma .sp may use.
    wgmma_sp_tile: TilePolicy = TilePolicy::Auto, "FERROATTN_WGMMA_SP_TILE";
    /// When wgmma .sp runs the stream-K tail.
    wgmma_sp_streamk: StreamKPolicy = StreamKPolicy::Auto, "FERROATTN_WGMMA_SP_STREAMK";
    /// The wgmma .sp epilogue form.
    wgmma_sp_epilogue: WgmmaEpilogue = WgmmaEpilogue::DEFAULT, "FERROATTN_WGMMA_SP_EPILOGUE";
    /// The wgmma .sp mainloop form.
    wgmma_sp_mainloop: WgmmaMainloop = WgmmaMainloop::DEFAULT, "FERROATTN_WGMMA_SP_MAINLOOP";
}

impl Knobs {
    /// The knobs as `var` (a variable's value, None when unset) sets them, leaving the variable
    /// `skip` out (its knob is being set). ArgumentError naming the first malformed variable.
    fn from_vars(var: impl Fn(&str) -> Option<String>, skip: Option<&str>) -> Result<Knobs> {
        let mut k = Knobs::default();
        for (name, v) in KNOBS {
            if skip == Some(*v) {
                continue;
            }
            if let Some(text) = var(v) {
                k.set_text(name, &text, v)?;
            }
        }
        Ok(k)
    }

    /// The knobs as the environment sets them (all but `skip`'s variable). ArgumentError naming
    /// the first malformed variable; a value that is not UTF-8 is malformed too.
    fn from_env(skip: Option<&str>) -> Result<Knobs> {
        Knobs::from_vars(crate::env_switch::env_value, skip)
    }
}

static CURRENT: RwLock<Option<Knobs>> = RwLock::new(None);

/// The current knobs (the environment's on first use). ArgumentError naming the variable when
/// one is malformed (raised by every call until the variable is fixed or its knob is set).
pub fn get() -> Result<Knobs> {
    if let Some(k) = *CURRENT.read().unwrap_or_else(|e| e.into_inner()) {
        return Ok(k);
    }
    let mut w = CURRENT.write().unwrap_or_else(|e| e.into_inner());
    if w.is_none() {
        *w = Some(Knobs::from_env(None)?);
    }
    Ok(w.expect("set above"))
}

/// Change knob `name` for the rest of the process (`value` in its variable's text form; empty:
/// the default). ArgumentError naming `name` when it is unknown or the value is malformed (the
/// knobs are then unchanged). Before the knobs were first read, the environment's other
/// variables are read now (a malformed one is an error naming it); `name`'s own variable is not,
/// so setting a knob whose variable is malformed replaces it.
pub fn set(name: &str, value: &str) -> Result<()> {
    let mut w = CURRENT.write().unwrap_or_else(|e| e.into_inner());
    let mut k = match *w {
        Some(k) => k,
        None => {
            let var = KNOBS.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
            let mut k = Knobs::default();
            k.set_text(name, value, name)?; // an unknown name or a bad value first, naming `name`
            Knobs::from_env(var)?
        }
    };
    k.set_text(name, value, name)?;
    *w = Some(k);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value of every knob other than its default, in text form.
    const OTHER: &[(&str, &str)] = &[
        ("attn_fwd_family", "sm80"),
        ("attn_bwd_family", "sm90"),
        ("attn_sm90_fwd_kv_release", "separate"),
        ("attn_sm90_fwd_stages", "3"),
        ("attn_sm90_fwd_persistent", "1"),
        ("attn_sm90_fwd_d192", "1"),
        ("attn_sm90_fwd_varlen", "1"),
        ("attn_sm90_bwd_dq_overlap", "1"),
        ("attn_sm90_bwd_varlen", "1"),
        ("attn_sm90_bwd_dq_tiled", "1"),
        ("attn_sm90_bwd_mask_warps", "1"),
        ("gemm_sm90_schedule", "auto"),
        ("gemm_sm90_fast_epilogue", "0"),
        ("gemm_sm90_splitk", "0"),
        ("gemm_wmma_group", "16"),
        ("gemm_wmma_streamk", "off"),
        ("gemm_wmma_tile", "128,128,32,2,4,4,1,1,1"),
        ("persistent_grid", "full"),
        ("sparse24_wgmma", "0"),
        ("sparse24_tile", "64,64,2,2,3"),
        ("sparse24_splitk", "3"),
        ("sparse24_splitk_fuse", "1"),
        ("wgmma_sp_tile", "band:4"),
        ("wgmma_sp_streamk", "dp:8"),
        ("wgmma_sp_epilogue", "direct"),
        ("wgmma_sp_mainloop", "pipe"),
    ];

    #[test]
    fn every_knob_parses_a_value_and_round_trips_its_text() {
        assert_eq!(OTHER.len(), KNOBS.len());
        let default = Knobs::default();
        for ((name, _), (other_name, text)) in KNOBS.iter().zip(OTHER) {
            assert_eq!(name, other_name);
            let mut k = default;
            k.set_text(name, text, name).unwrap();
            assert_ne!(k, default, "{name}={text} changed nothing");
            let got = k.items().into_iter().find(|(n, _)| n == name).unwrap().1;
            assert_eq!(&got, text, "{name}");
            k.set_text(name, " ", name).unwrap(); // empty: the default
            assert_eq!(k, default, "{name}");
        }
        // the defaults' text parses back to the defaults
        let mut k = Knobs::default();
        for (name, text) in default.items() {
            k.set_text(name, &text, name).unwrap();
        }
        assert_eq!(k, default);
    }

    #[test]
    fn malformed_environment_values_name_the_variable_and_the_value() {
        for (name, var) in KNOBS {
            let e = Knobs::from_vars(|v| (v == *var).then(|| "bogus,1".to_string()), None).unwrap_err().to_string();
            assert!(e.contains(var) && e.contains("bogus,1"), "{name}: {e}");
            // its knob being set: the variable is left out
            assert_eq!(Knobs::from_vars(|v| (v == *var).then(|| "bogus,1".to_string()), Some(var)).unwrap(), Knobs::default());
        }
        let k = Knobs::from_vars(|v| (v == "FERROATTN_SPARSE24_SPLITK").then(|| " 4 ".into()), None).unwrap();
        assert_eq!(k.sparse24_splitk, SplitPolicy::Force(4));
        assert_eq!(Knobs::from_vars(|_| None, None).unwrap(), Knobs::default());
    }

    #[test]
    fn a_long_rejected_value_is_shown_cut_with_its_length() {
        let long = "x".repeat(100_000);
        let e = Knobs::default().set_text("attn_fwd_family", &long, "attn_fwd_family").unwrap_err().to_string();
        assert!(e.len() < 400 && e.contains("100000 characters") && e.contains(&"x".repeat(64)), "{e}");
        let e = Knobs::default().set_text(&long, "1", &long).unwrap_err().to_string();
        assert!(e.len() < 1_000 && e.contains("100000 characters"), "{}", &e[..200]);
        assert_eq!(shown("sm81"), "\"sm81\"");
    }

    #[test]
    fn unknown_knob_names_are_rejected() {
        let mut k = Knobs::default();
        let e = k.set_text("attn_family", "sm80", "attn_family").unwrap_err().to_string();
        assert!(e.contains("attn_fwd_family") && e.contains("wgmma_sp_mainloop") && e.contains("attn_family"), "{e}");
        let e = k.set_text("attn_bwd_family", "fast", "attn_bwd_family").unwrap_err().to_string();
        assert!(e.contains("attn_bwd_family") && e.contains("fast") && e.contains("sm80"), "{e}");
        assert_eq!(k, Knobs::default());
    }

    #[test]
    fn production_defaults() {
        let k = Knobs::default();
        assert_eq!(k.gemm_sm90_schedule, DEFAULT_POLICY);
        assert!(k.gemm_sm90_fast_epilogue && k.gemm_sm90_splitk && k.sparse24_wgmma);
        assert_eq!(k.gemm_wmma_group, RasterGroup(8));
        assert_eq!(k.wgmma_sp_epilogue.form(), crate::tuning::sparse24::WGMMA_EPILOGUE_DEFAULT);
        assert_eq!(k.wgmma_sp_mainloop.meta_sets(), crate::tuning::sparse24::WGMMA_META_SETS_DEFAULT);
    }

    /// docs/DEVELOPING.md's knob table lists every knob once, as
    /// `| `VARIABLE` | `name` | `default`, ...`, and nothing else.
    #[test]
    fn the_developer_doc_table_lists_exactly_the_knobs() {
        let doc = include_str!("../../docs/DEVELOPING.md");
        let rows: Vec<&str> = doc.lines().filter(|l| l.starts_with("| `FERROATTN_")).collect();
        let defaults = Knobs::default().items();
        for ((name, var), (_, default)) in KNOBS.iter().zip(&defaults) {
            let head = format!("| `{var}` | `{name}` | `{default}`");
            let n = rows.iter().filter(|r| r.starts_with(&head)).count();
            assert_eq!(n, 1, "docs/DEVELOPING.md: one row starting {head:?}");
        }
        assert_eq!(rows.len(), KNOBS.len(), "docs/DEVELOPING.md knob table rows: {rows:#?}");
    }
}
