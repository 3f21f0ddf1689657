"""Benchmarks: ferroattn against its peers, in one process, on one GPU.

``python -m ferroattn bench attention [--quick] [--out DIR]`` runs :mod:`.attention`,
``... bench attention --backward`` :mod:`.attention_bwd`, ``... bench training`` :mod:`.training`.

One concept per module:

- :mod:`.timing`    how a GPU call is timed (triton ``do_bench`` median, else CUDA events with an
                    L2 flush), rotating input sets, host-side cost per call;
- :mod:`.peers`     the peers: torch SDPA restricted to one backend (flash, cuDNN, efficient);
- :mod:`.ceilings`  measured ceilings: bf16 matmul TFLOP/s, device-to-device copy GB/s;
- :mod:`.attention` the attention grid (FlashAttention-3 paper: 16k tokens, hidden 2048);
- :mod:`.attention_bwd` the same grid for the backward: backward alone and forward + backward;
- :mod:`.training`  Llama-3.2-1B-config training with ferroattn vs sdpa (eager as the bf16 noise
                    yardstick): per-step losses, step-0 gradients vs fp32, pass rules;
- :mod:`.memory`    peak GPU memory of one attention forward + backward (ours vs SDPA-flash);
- :mod:`.report`    FLOP formulas, run metadata, summary statistics, tables and the raw JSON.

Importing this package does not import torch.
"""
