//! The compile-time part of an attention variant (`VariantKind`: mask kind, softcap, ALiBi, sinks,
//! dropout on/off): one specialisation of every attention kernel, the template argument
//! `AttnVariant<Mask, Softcap, Alibi, Sinks, Dropout, ReturnSoftmax>` of
//! kernels/attention/variant.cuh. A pure description: the heuristics here read it, and
//! `ops::attention::variant` derives it from a validated call (`AttnVariant::validate`).

/// Which keys a query row sees (kernels/attention/variant.cuh, RowKeys).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum MaskKind {
    /// Every key.
    #[default]
    None,
    /// Bottom-right causal: row i sees keys j <= i + s_k − s_q.
    Causal,
    /// A local window [i + s_k − s_q − left, i + s_k − s_q + right] (a side may be unbounded).
    Local,
}

impl MaskKind {
    fn code(self) -> u32 {
        match self {
            MaskKind::None => 0,
            MaskKind::Causal => 1,
            MaskKind::Local => 2,
        }
    }
}

/// The compile-time part of a variant: one specialisation of every attention kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct VariantKind {
    pub mask: MaskKind,
    pub softcap: bool,
    pub alibi: bool,
    pub sinks: bool,
    pub dropout: bool,
    /// Dropout, testing only: the forward also writes the softmax and the mask (S_dmask).
    pub return_softmax: bool,
}

impl VariantKind {
    /// No mask, no score modification.
    pub const PLAIN: VariantKind =
        VariantKind { mask: MaskKind::None, softcap: false, alibi: false, sinks: false, dropout: false, return_softmax: false };
    /// The bottom-right causal mask alone.
    pub const CAUSAL: VariantKind = VariantKind { mask: MaskKind::Causal, ..VariantKind::PLAIN };

    /// The C++ type of kernels/attention/variant.cuh this kind instantiates.
    pub fn cuda_type(&self) -> String {
        format!(
            "ferroattn::AttnVariant<{}, {}, {}, {}, {}, {}>",
            self.mask.code(),
            self.softcap,
            self.alibi,
            self.sinks,
            self.dropout,
            self.return_softmax
        )
    }

    pub fn causal(&self) -> bool {
        self.mask == MaskKind::Causal
    }

    /// PLAIN or CAUSAL.
    pub fn from_causal(causal: bool) -> VariantKind {
        if causal { VariantKind::CAUSAL } else { VariantKind::PLAIN }
    }

    /// The kind the backward kernels specialise on: sinks change nothing there (the forward's
    /// LSE includes them; their gradient is formed from LSE and D on the host side).
    pub fn for_backward(self) -> VariantKind {
        VariantKind { sinks: false, return_softmax: false, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_render_the_cuda_type() {
        assert_eq!(VariantKind::PLAIN.cuda_type(), "ferroattn::AttnVariant<0, false, false, false, false, false>");
        let k = VariantKind { mask: MaskKind::Local, softcap: true, alibi: false, sinks: true, dropout: true, return_softmax: false };
        assert_eq!(k.cuda_type(), "ferroattn::AttnVariant<2, true, false, true, true, false>");
    }
}
