//! The attention variant argument of attn_fwd / attn_bwd and their metadata checks: Python's
//! `ferroattn.ops.variant.AttnVariant`, read by attribute, into `ops::attention::AttnVariant`.

use super::attention::{meta_of, MetaTuple};
use crate::dlpack::{import, Imported};
use crate::error::Result;
use crate::ops::attention::{AttnVariant, VariantKind};
use crate::tensor::{TensorMeta, TensorView};
use pyo3::prelude::*;

/// The attributes of a Python `AttnVariant`: tensors (a launch) or `TensorMeta` tuples (a
/// metadata check) in `alibi_slopes` / `sinks`, None when absent.
#[derive(FromPyObject)]
pub(super) struct VariantArg<'py> {
    causal: bool,
    window_left: i64,
    window_right: i64,
    softcap: f64,
    alibi_slopes: Option<Bound<'py, PyAny>>,
    sinks: Option<Bound<'py, PyAny>>,
}

impl<'py> VariantArg<'py> {
    fn with<T>(&self, alibi_slopes: Option<T>, sinks: Option<T>) -> AttnVariant<T> {
        AttnVariant {
            causal: self.causal,
            window_left: self.window_left,
            window_right: self.window_right,
            softcap: self.softcap,
            alibi_slopes,
            sinks,
        }
    }

    /// The variant with metadata tuples (the `*_check` functions).
    pub(super) fn metas(&self) -> Result<AttnVariant<TensorMeta>> {
        let m = |arg: &str, t: &Option<Bound<'py, PyAny>>| -> Result<Option<TensorMeta>> {
            t.as_ref().map(|t| meta_of(arg, t.extract::<MetaTuple>()?, "float32")).transpose()
        };
        Ok(self.with(m("alibi_slopes", &self.alibi_slopes)?, m("sinks", &self.sinks)?))
    }

    /// The variant's tensors imported through DLPack (a launch); keep the result alive for the call.
    pub(super) fn import(&self) -> Result<AttnVariant<Imported>> {
        let t = |arg: &str, t: &Option<Bound<'py, PyAny>>| t.as_ref().map(|t| import(t, arg)).transpose();
        Ok(self.with(t("alibi_slopes", &self.alibi_slopes)?, t("sinks", &self.sinks)?))
    }
}

/// Views of an imported variant.
pub(super) fn views(v: &AttnVariant<Imported>) -> AttnVariant<&TensorView> {
    v.map(|t| &t.view)
}

/// `validate` of a metadata variant against a validated problem.
pub(super) fn check(
    v: &AttnVariant<TensorMeta>,
    p: &crate::ops::attention::Problem,
    q: &TensorMeta,
) -> Result<VariantKind> {
    v.map(|t| t).validate(p, q)
}
