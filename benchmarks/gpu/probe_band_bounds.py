"""Does a band ``mask_mod`` that reads its bounds from a tensor slow flex's kernel, and does int32 help? One GPU, W = 1.

    python3 benchmarks/gpu/probe_band_bounds.py [--seqs 16384,131072] [--rounds 9] [--burst 5]

``window_size=(4095, 0)``, causal, GQA 32/8, D 128, bf16, inputs that require grad. The twenty-seventh session's
path-by-path probe (``probe_train_fwd_paths.py``) left a 5% kernel gap at 128K between flex called directly and
``seqpar.attention`` and pointed at the band ``mask_mod``'s int64 bounds, within its 7% round-to-round noise. Here
every variant is timed in interleaved bursts (``burst_ms``), so drift hits all alike:

- flex with flex's own block mask and a ``mask_mod`` whose bounds are Python constants, an int32 tensor, an int64
  tensor (seqpar's ``_mask_mod`` before this probe), and the constants with flex's ``USE_TMA`` kernel option;
- ``seqpar.attention`` as committed, and with its band ``mask_mod`` swapped for the int64, int32 and constant forms
  (the probe patches ``seqpar.kernels.flex._mask_mod`` and empties the block-mask cache; the library is not
  changed by running it; each form keeps its own block-mask cache).

Each for a training forward (no backward) and forward+backward. Prints one line per variant: median ms per round,
the median of the rounds, and the ratio to flex with constant bounds.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.timing import burst_ms
from seqpar.kernels import flex as sp_flex
from seqpar.masks import Band

FLEX = torch.compile(flex_attention, dynamic=False)
DEV = torch.device("cuda")
LEFT = 4095
COMMITTED = sp_flex._mask_mod


def band_mod(form: str, lo: int, hi: int):
    """A band ``mask_mod`` ``lo <= k - q <= hi`` with its bounds as ``form``: const, int32 or int64."""
    if form == "const":
        def const_mod(b, h, qi, ki):
            d = ki - qi
            return (d >= lo) & (d <= hi)
        return const_mod
    bounds = torch.tensor([lo, hi], device=DEV, dtype=getattr(torch, form))

    def tensor_mod(b, h, qi, ki):
        d = ki - qi
        return (d >= bounds[0]) & (d <= bounds[1])
    return tensor_mod


def patched(form: str):
    """``seqpar.kernels.flex._mask_mod`` with bands in ``form`` (None: as committed)."""
    def mask_mod(mask, m, n, device):
        if form is None or not isinstance(mask, Band):
            return COMMITTED(mask, m, n, device)
        big = sp_flex._BIG
        return band_mod(form, -big if mask.lo is None else mask.lo, big if mask.hi is None else mask.hi)
    return mask_mod


def with_form(form, fn):
    """``fn`` run with bands in ``form``, each form with its own block-mask cache (no mask rebuilt in a burst)."""
    def call():
        sp_flex._mask_mod, sp_flex._BANDS = PATCHES[form], CACHES[form]
        return fn()
    return call


PATCHES = {form: patched(form) for form in (None, "int64", "int32", "const")}
CACHES = {form: type(sp_flex._BANDS)() for form in PATCHES}


def variants(S: int, fb: bool) -> dict:
    q = torch.randn(1, S, 32, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, S, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    ref = create_block_mask(band_mod("const", -LEFT, 0), None, None, S, S, device=DEV, _compile=True)
    fields = ("seq_lengths", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
              "q_indices", "full_q_num_blocks", "full_q_indices", "BLOCK_SIZE")

    def flex(form, options=None):
        bm = type(ref)(*[getattr(ref, f) for f in fields], band_mod(form, -LEFT, 0))
        return lambda: FLEX(qt, kt, vt, block_mask=bm, scale=128 ** -0.5, enable_gqa=True,
                            kernel_options=options).transpose(1, 2)

    def ours():
        return seqpar.attention(q, k, v, causal=True, window_size=(LEFT, 0), layout="contiguous")

    calls = {f"flex, {form} bounds": flex(form) for form in ("const", "int32", "int64")}
    calls["flex, const bounds, USE_TMA"] = flex("const", {"USE_TMA": True})
    calls |= {f"seqpar, {name}": with_form(form, ours)
              for name, form in (("as committed", None), ("int64 bands", "int64"), ("int32 bands", "int32"),
                                 ("const bands", "const"))}
    if fb:
        return {name: (lambda fn=fn: fn().backward(do)) for name, fn in calls.items()}
    return calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="16384,131072", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--burst", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    torch._dynamo.config.recompile_limit = 64
    for S in args.seqs:
        for fb in (False, True):
            fns = variants(S, fb)
            rounds = [burst_ms(fns, DEV, burst=args.burst, rounds=1, warmup=3 if i == 0 else 0)
                      for i in range(args.rounds)]
            med = {name: statistics.median(r[name] for r in rounds) for name in fns}
            base = med["flex, const bounds"]
            for name in fns:
                per = " ".join(f"{r[name]:.2f}" for r in rounds)
                print(f"S={S} {'fwd+bwd' if fb else 'train fwd'} {name:28s} median {med[name]:8.3f} ms "
                      f"({med[name] / base:.3f}x)  rounds: {per}", flush=True)
            del fns
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
