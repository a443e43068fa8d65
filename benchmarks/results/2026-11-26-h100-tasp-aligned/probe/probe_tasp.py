"""The probe of ``probe/host.txt``: ``benchmarks/gpu/probe_host.py``'s ``probe`` on TASP (16464 tokens, the padded
length of 16K over 8 before Note [Uneven sub-chunks]), TokenRing and the ring (16384), rank 0 of 8, GQA 32/8 and
MHA. Run from a source tree's root: ``python3 probe_tasp.py OUT``."""

import sys
from pathlib import Path

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, "benchmarks/gpu")
import probe_host as P

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
for kv in (8, 32):
    for method, total in (("tasp", 16464), ("tokenring", 16384), ("ring", 16384)):
        for mode in ("fwd", "fwd+bwd"):
            name = f"dense-{total}-kv{kv}-{method}-zigzag-{mode}"
            try:
                print(P.probe(name, P.case_fn(method, "zigzag", mode, total, None, 8, None, kv), out), flush=True)
            except Exception as e:
                print(name, "FAILED", type(e).__name__, e, flush=True)
