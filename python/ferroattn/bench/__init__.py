"""Benchmarks: ferroattn against its peers, in one process, on one GPU.

``python -m ferroattn bench attention [--quick] [--out DIR]`` runs :mod:`.attention`.

One concept per module:

- :mod:`.timing`    how a GPU call is timed (triton ``do_bench`` median, else CUDA events with an
                    L2 flush), rotating input sets, host-side cost per call;
- :mod:`.peers`     the peers: torch SDPA restricted to one backend (flash, cuDNN, efficient);
- :mod:`.ceilings`  measured ceilings: bf16 matmul TFLOP/s, device-to-device copy GB/s;
- :mod:`.attention` the attention grid (FlashAttention-3 paper: 16k tokens, hidden 2048);
- :mod:`.report`    FLOP formulas, run metadata, summary statistics, tables and the raw JSON.

Importing this package does not import torch.
"""
