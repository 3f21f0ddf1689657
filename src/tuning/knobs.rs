//! Tuning knobs: the switches that choose between kernel paths, as one typed value. Read from
//! the environment once (the first call of `get`), changeable afterwards through `set` (tests and
//! A/B benchmarks: `ferroattn._native.set_tuning_knob`). A malformed value is an ArgumentError
//! naming the variable, never silently ignored. The pure `tuning/` functions take the knobs they
//! need as arguments; only the ops layer calls `get`.
//!
//! | variable | values (default first) | effect |
//! |---|---|---|
//! | `FERROATTN_ATTN_FWD_FAMILY` | `auto`, `sm80`, `sm90` | attention-forward kernel family: `auto` and `sm90` take the Hopper kernel wherever it supports the call (on sm_90a), `sm80` always the mma.sync kernel |
//! | `FERROATTN_ATTN_BWD_FAMILY` | `auto`, `sm80`, `sm90` | attention-backward family: `sm90` takes the Hopper dK/dV/dQ kernel wherever its plan supports the call, `auto` only where it measured faster (`tuning::attention_bwd::bwd_plan_sm90`), `sm80` never |

use crate::error::{Error, Result};
use std::sync::RwLock;

/// Which attention-forward family a call may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FamilyChoice {
    /// The dispatcher's choice (the fastest family that supports the call).
    #[default]
    Auto,
    /// Always the sm80 (mma.sync) family.
    Sm80,
    /// The sm90 family wherever it supports the call (else sm80).
    Sm90,
}

impl FamilyChoice {
    fn parse(var: &str, value: &str) -> Result<FamilyChoice> {
        match value.trim() {
            "" | "auto" => Ok(FamilyChoice::Auto),
            "sm80" => Ok(FamilyChoice::Sm80),
            "sm90" => Ok(FamilyChoice::Sm90),
            other => Err(Error::argument(var, "one of auto, sm80, sm90", format!("{other:?}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FamilyChoice::Auto => "auto",
            FamilyChoice::Sm80 => "sm80",
            FamilyChoice::Sm90 => "sm90",
        }
    }
}

/// Every knob, typed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Knobs {
    pub attn_fwd_family: FamilyChoice,
    pub attn_bwd_family: FamilyChoice,
}

/// (knob name, environment variable) of every knob.
pub const KNOBS: [(&str, &str); 2] = [
    ("attn_fwd_family", "FERROATTN_ATTN_FWD_FAMILY"),
    ("attn_bwd_family", "FERROATTN_ATTN_BWD_FAMILY"),
];

impl Knobs {
    /// Set knob `name` from its text form; `source` names the variable or argument in errors.
    fn set_text(&mut self, name: &str, value: &str, source: &str) -> Result<()> {
        match name {
            "attn_fwd_family" => self.attn_fwd_family = FamilyChoice::parse(source, value)?,
            "attn_bwd_family" => self.attn_bwd_family = FamilyChoice::parse(source, value)?,
            other => {
                let names: Vec<_> = KNOBS.iter().map(|(n, _)| *n).collect();
                return Err(Error::argument("name", format!("one of {}", names.join(", ")), format!("{other:?}")));
            }
        }
        Ok(())
    }

    /// The knobs as the environment sets them.
    pub fn from_env() -> Result<Knobs> {
        let mut k = Knobs::default();
        for (name, var) in KNOBS {
            if let Ok(v) = std::env::var(var) {
                k.set_text(name, &v, var)?;
            }
        }
        Ok(k)
    }

    /// (name, value) of every knob.
    pub fn items(&self) -> Vec<(&'static str, &'static str)> {
        vec![("attn_fwd_family", self.attn_fwd_family.name()), ("attn_bwd_family", self.attn_bwd_family.name())]
    }
}

static CURRENT: RwLock<Option<Knobs>> = RwLock::new(None);

/// The current knobs (the environment's on first use).
pub fn get() -> Result<Knobs> {
    if let Some(k) = *CURRENT.read().unwrap_or_else(|e| e.into_inner()) {
        return Ok(k);
    }
    let mut w = CURRENT.write().unwrap_or_else(|e| e.into_inner());
    if w.is_none() {
        *w = Some(Knobs::from_env()?);
    }
    Ok(w.expect("set above"))
}

/// Change one knob for the rest of the process (`value` in the variable's text form).
pub fn set(name: &str, value: &str) -> Result<()> {
    let mut k = get()?;
    k.set_text(name, value, "value")?;
    *CURRENT.write().unwrap_or_else(|e| e.into_inner()) = Some(k);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn family_values_parse_and_bad_ones_name_the_variable() {
        assert_eq!(FamilyChoice::parse("V", "auto").unwrap(), FamilyChoice::Auto);
        assert_eq!(FamilyChoice::parse("V", " sm90 ").unwrap(), FamilyChoice::Sm90);
        assert_eq!(FamilyChoice::parse("V", "sm80").unwrap(), FamilyChoice::Sm80);
        let e = FamilyChoice::parse("FERROATTN_ATTN_FWD_FAMILY", "hopper").unwrap_err().to_string();
        assert!(e.contains("FERROATTN_ATTN_FWD_FAMILY") && e.contains("hopper"), "{e}");
    }

    #[test]
    fn unknown_knob_names_are_rejected() {
        let mut k = Knobs::default();
        let e = k.set_text("attn_family", "sm80", "value").unwrap_err().to_string();
        assert!(e.contains("attn_fwd_family"), "{e}");
        k.set_text("attn_fwd_family", "sm80", "value").unwrap();
        k.set_text("attn_bwd_family", "sm90", "value").unwrap();
        assert_eq!(k.items(), vec![("attn_fwd_family", "sm80"), ("attn_bwd_family", "sm90")]);
        let e = k.set_text("attn_bwd_family", "fast", "FERROATTN_ATTN_BWD_FAMILY").unwrap_err().to_string();
        assert!(e.contains("FERROATTN_ATTN_BWD_FAMILY") && e.contains("fast"), "{e}");
    }
}
