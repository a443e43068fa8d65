"""Why a graphed flex call fails to capture: the engine path (``return_lse=True``, W = 1) with ``graphs=True``, softcap
and a generic ``mask_mod``, with flex's forward on TMA (as committed) and without; dynamo's recompile reasons logged.

    TORCH_LOGS=recompiles,graph_breaks python3 benchmarks/gpu/probe_capture.py
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.kernels import flex as sp_flex
from seqpar.runtime import call as sp_call

DEV = torch.device("cuda")
ON = sp_flex.TMA_ARCHS


def main() -> None:
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, 1024, 8, 64, device=DEV, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 1024, 2, 64, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    cases = {"softcap": {"softcap": 5.0}, "mask_mod": {"mask_mod": lambda b, h, qi, ki: (qi - ki) % 64 < 48},
             "window": {"window_size": (200, 0)}}
    for tma in (False, True):
        for name, kw in cases.items():
            sp_flex.TMA_ARCHS = ON if tma else frozenset()
            sp_call.cache_clear()
            try:
                for _ in range(3):
                    leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
                    out, _lse = seqpar.attention(*leaves, causal=True, layout="contiguous", return_lse=True,
                                                graphs=True, **kw)
                    out.sum().backward()
                print(f"== tma={tma} {name}: captured and replayed", flush=True)
            except Exception:
                print(f"== tma={tma} {name}: FAILED\n{traceback.format_exc()[-3000:]}", flush=True)
    sp_flex.TMA_ARCHS = ON


if __name__ == "__main__":
    main()
