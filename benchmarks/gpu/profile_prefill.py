"""Where a one-GPU prefill spends its time: seqpar's sharded prefill against transformers' SDPA path.

    torchrun --nproc-per-node 1 benchmarks/gpu/profile_prefill.py --context 32k

Both paths prefill the same prompt with the ``small`` inference preset, warm (one untimed prefill first),
under ``torch.profiler``; prints each path's time, its top CUDA kernels and its top host operators, so a gap
between the two shows where it comes from.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from seqpar.bench.inference import PRESETS, build_model, parse_tokens
from seqpar.inference import ShardedKVCache
from seqpar.integrations.hf_generate import SeqparCache, prefill, serving


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="32k", type=parse_tokens)
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model = build_model(PRESETS["small"], dev)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context - 1), device=dev)

    def ours():
        cache = SeqparCache(ShardedKVCache(layers=model.config.num_hidden_layers, batch=1))
        with serving(model, cache, method="ring"):
            prefill(model, cache, ids, method="ring")

    def theirs():
        from transformers import DynamicCache
        with torch.no_grad():
            model.base_model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)

    for name, fn in (("transformers", theirs), ("seqpar", ours)):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"== {name}: {start.elapsed_time(end):.2f} ms")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
