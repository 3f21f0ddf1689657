"""torch.library custom ops of ferroattn (namespace ``ferroattn``). Importing a submodule
registers its ops; :mod:`ferroattn.ops.attention` registers ``torch.ops.ferroattn.attn_fwd``."""
