//! The attention variant argument of attn_fwd / attn_bwd and their metadata checks: Python's
//! `ferroattn.ops.variant.AttnVariant`, read by attribute, into `ops::attention::AttnVariant`.

use super::args::{meta_of, MetaTuple};
use crate::dlpack::{import, Imported};
use crate::error::Result;
use crate::ops::attention::AttnVariant;
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
    dropout_p: f64,
    rng_state: Option<Bound<'py, PyAny>>,
    s_dmask: Option<Bound<'py, PyAny>>,
    s_dmask_max: Option<Bound<'py, PyAny>>,
}

impl<'py> VariantArg<'py> {
    /// `obj` read as a variant; an object without the attributes is a TypeError naming `variant`.
    pub(super) fn from_obj(obj: &Bound<'py, PyAny>) -> Result<Self> {
        obj.extract::<VariantArg<'py>>().map_err(|e| {
            let shown = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            pyo3::exceptions::PyTypeError::new_err(format!(
                "variant: expected a ferroattn.ops.variant.AttnVariant, got {shown} ({})",
                e.value(obj.py())
            ))
            .into()
        })
    }

    /// The variant with each tensor attribute converted by `f(argument name, attribute)`.
    fn convert<T>(&self, f: impl Fn(&str, &Option<Bound<'py, PyAny>>) -> Result<Option<T>>) -> Result<AttnVariant<T>> {
        Ok(AttnVariant {
            causal: self.causal,
            window_left: self.window_left,
            window_right: self.window_right,
            softcap: self.softcap,
            alibi_slopes: f("alibi_slopes", &self.alibi_slopes)?,
            sinks: f("s_aux", &self.sinks)?,
            dropout_p: self.dropout_p,
            rng_state: f("rng_state", &self.rng_state)?,
            s_dmask: f("s_dmask", &self.s_dmask)?,
            s_dmask_max: f("s_dmask_max", &self.s_dmask_max)?,
        })
    }

    /// The variant with metadata tuples (the `*_check` functions).
    pub(super) fn metas(&self) -> Result<AttnVariant<TensorMeta>> {
        let expected = |arg: &str| match arg {
            "rng_state" => "int64",
            "s_dmask" => "float16 or bfloat16",
            _ => "float32",
        };
        self.convert(|arg, t| t.as_ref().map(|t| meta_of(arg, t.extract::<MetaTuple>()?, expected(arg))).transpose())
    }

    /// The variant's tensors imported through DLPack (a launch); keep the result alive for the call.
    pub(super) fn import(&self) -> Result<AttnVariant<Imported>> {
        self.convert(|arg, t| {
            t.as_ref()
                .map(|t| if arg.starts_with("s_dmask") { crate::dlpack::import_writable(t, arg) } else { import(t, arg) })
                .transpose()
        })
    }
}

/// Views of an imported variant.
pub(super) fn views(v: &AttnVariant<Imported>) -> AttnVariant<&TensorView> {
    v.map(|t| &t.view)
}

/// The metadata variant of a `*_check` call: the plain call when `variant` is None.
pub(super) fn optional_metas(variant: Option<&Bound<'_, PyAny>>) -> Result<AttnVariant<TensorMeta>> {
    Ok(match variant.filter(|v| !v.is_none()) {
        Some(v) => VariantArg::from_obj(v)?.metas()?,
        None => AttnVariant::default(),
    })
}
