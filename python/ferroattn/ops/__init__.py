"""torch.library custom ops of ferroattn (namespace ``ferroattn``). Importing this package (or any
submodule) registers them all: :mod:`ferroattn.ops.attention` registers
``torch.ops.ferroattn.attn_fwd`` (with its autograd formula) and :mod:`ferroattn.ops.attention_bwd`
``torch.ops.ferroattn.attn_bwd``, which that autograd formula calls; :mod:`ferroattn.ops.kvcache`
``torch.ops.ferroattn.attn_fwd_kvcache`` and ``torch.ops.ferroattn.kv_append`` (the decode path)."""
from . import attention, attention_bwd, gemm, kvcache, sparse24  # noqa: F401  (registration)
