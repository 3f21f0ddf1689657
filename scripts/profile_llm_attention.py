#!/usr/bin/env python3
"""Where does a Llama prefill spend its time with ferroattn vs sdpa? (GPU machine only.)

Builds the demo's Llama-3.2-1B-shaped model (seeded random weights), runs one 2k-token prefill
per attention implementation under torch.profiler, and prints the top CUDA kernels, the total
CUDA time and the host-side synchronisations (cudaStreamSynchronize / cudaMemcpy device->host),
which stall the GPU between layers. A diagnostic for bench/NOTES.md, not a benchmark.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ferroattn.demo import build_llm
from ferroattn.integrations.transformers import register


def main() -> int:
    if not torch.cuda.is_available():
        print("profile_llm_attention: no CUDA GPU", file=sys.stderr)
        return 3
    register()
    model = build_llm("llama-3.2-1b", "cuda", "bfloat16", "sdpa")
    ids = torch.randint(0, 30000, (1, 2048), device="cuda")
    for impl in ("ferroattn", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            for _ in range(3):
                model(input_ids=ids, use_cache=False)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model(input_ids=ids, use_cache=False)
                torch.cuda.synchronize()
        ka = prof.key_averages()
        syncs = {e.key: e.count for e in ka if "Synchronize" in e.key or "Memcpy" in e.key or "item" in e.key}
        print(f"== {impl}: syncs/copies {syncs}")
        print(ka.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
