"""Long-context generation with the prompt and the KV cache sharded over ranks (seqpar + transformers).

A Llama-architecture model built from a config (random weights: this shows the machinery and its cost, not
a trained model's text) reads a prompt longer than one GPU's share and generates with transformers' own
``generate``: ``seqpar.integrations.huggingface.generate`` prefills the prompt sharded (each rank runs the
model on its tokens; attention by ``--method``), then every decode step attends to every rank's slice of the
cache and merges exactly, so all ranks produce the same tokens as one process would.

    torchrun --nproc-per-node 8 examples/generate_long_context.py --preset gpu-1m
    torchrun --nproc-per-node 8 examples/generate_long_context.py --preset gpu-4m          # chunked prefill
    python examples/generate_long_context.py --preset cpu-tiny --spawn 4 --check            # CPU, gloo

Printed on rank 0: prefill seconds (to the first generated token), decode tokens/s, and per rank the KV cache
bytes (allocated and live) and the peak device memory. ``--check`` (CPU) also runs ``model.generate`` on one
process and asserts the same tokens. Timing comes from a transformers streamer: the prompt arrives when
``generate`` starts decoding (the sharded prefill is done by then) and every token after it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seqpar.bench.inference import PRESETS, build_model, parse_tokens
from seqpar.integrations import huggingface as sp_hf


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One run."""

    model: str
    """A ``seqpar.bench.inference.PRESETS`` model."""
    context: int
    """Prompt tokens."""
    new_tokens: int
    method: str = "ring"
    layout: str | None = None
    prefill_chunk: int | None = None
    """Prefill at most this many tokens per forward (bounds activation memory; later chunks extend the cache)."""
    device: str = "cuda"


RUNS = {
    "gpu-1m": Preset(model="small", context=1 << 20, new_tokens=64),
    "gpu-4m": Preset(model="small", context=4 << 20, new_tokens=64, prefill_chunk=1 << 20),
    "cpu-tiny": Preset(model="tiny", context=2000, new_tokens=12, prefill_chunk=700, device="cpu"),
}


class _Clock:
    """A transformers streamer that records when the prompt and each new token arrive (rank-local host time)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        value.cpu()                      # the token exists on the host: a real arrival time
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate(p: Preset, check: bool) -> dict[str, Any]:
    """Run ``p`` on this rank (torch.distributed initialised); returns what rank 0 prints."""
    device = torch.device("cuda", torch.cuda.current_device()) if p.device == "cuda" else torch.device("cpu")
    model = build_model(PRESETS[p.model], device)
    ids = torch.randint(0, model.config.vocab_size, (1, p.context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    clock = _Clock()
    dist.barrier()
    t0 = time.perf_counter()
    out = sp_hf.generate(model, ids, method=p.method, layout=p.layout, prefill_chunk=p.prefill_chunk,
                         max_new_tokens=p.new_tokens, do_sample=False, streamer=clock, return_dict_in_generate=True,
                         pad_token_id=None)
    prompt_at, first, last = clock.times[0], clock.times[1], clock.times[-1]
    cache = getattr(out, "cache", None)                     # transformers >= 5.2x; past_key_values before
    mem = (cache if cache is not None else out.past_key_values).kv.memory()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"kv_gib": mem["allocated"] / 2**30, "kv_live_gib": mem["live"] / 2**30,
                                      "peak_gib": peak, "rows": mem["rows"]})
    result = {"prefill_s": prompt_at - t0, "first_token_s": first - t0,
              "decode_tok_s": (len(clock.times) - 2) / (last - first) if len(clock.times) > 2 else float("nan"),
              "tokens": out.sequences[0, p.context:].tolist(), "ranks": per_rank}
    if check and dist.get_rank() == 0:
        ref = model.generate(ids, max_new_tokens=p.new_tokens, do_sample=False, pad_token_id=None)
        result["matches_one_process"] = bool(torch.equal(ref[0, p.context:].cpu(), out.sequences[0, p.context:].cpu()))
    return result


def _print(p: Preset, res: dict[str, Any]) -> None:
    world = len(res["ranks"])
    print(f"{p.context} prompt tokens over {world} ranks ({p.method}), {p.new_tokens} new tokens")
    print(f"  prefill {res['prefill_s']:.2f} s, first token at {res['first_token_s']:.2f} s, "
          f"decode {res['decode_tok_s']:.1f} tokens/s")
    for r, m in enumerate(res["ranks"]):
        print(f"  rank {r}: KV {m['kv_gib'] * 1024:.1f} MiB allocated, {m['kv_live_gib'] * 1024:.1f} MiB live "
              f"({m['rows']} rows over all layers), peak {m['peak_gib']:.2f} GiB")
    print(f"  tokens: {res['tokens'][:16]}{' ...' if len(res['tokens']) > 16 else ''}")
    if "matches_one_process" in res:
        print(f"  same tokens as one process: {res['matches_one_process']}")


def _run(rank: int, world: int, init: str | None, p: Preset, check: bool) -> None:
    backend = "nccl" if p.device == "cuda" else "gloo"
    if p.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if init is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        res = generate(p, check)
        if dist.get_rank() == 0:
            _print(p, res)
            if check and not res["matches_one_process"]:
                raise SystemExit("the sharded generate differs from one process")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpu-1m", choices=sorted(RUNS))
    ap.add_argument("--context", type=parse_tokens, default=None, help="override the preset's prompt length")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--method", default=None)
    ap.add_argument("--spawn", type=int, default=0, help="start N local ranks (file:// rendezvous) instead of torchrun")
    ap.add_argument("--check", action="store_true", help="also generate on one process; the tokens must match")
    args = ap.parse_args(argv)
    p = RUNS[args.preset]
    over = {k: v for k, v in (("context", args.context), ("new_tokens", args.new_tokens), ("method", args.method))
            if v is not None}
    p = replace(p, **over)
    if args.spawn:
        fd, init = tempfile.mkstemp(prefix="seqpar_gen_")
        os.close(fd)
        os.unlink(init)
        mp.spawn(_run, args=(args.spawn, init, p, args.check), nprocs=args.spawn)
    elif "RANK" in os.environ:
        _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, p, args.check)
    else:
        sys.exit("launch with torchrun, or pass --spawn N")


if __name__ == "__main__":
    main()
