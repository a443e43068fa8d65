"""Host time of one planned call on CPU (gloo, W = 1, tiny shapes: all host work), and of resolving ``mesh=None`` to
the default group object (``seqpar.runtime.call._owner``, where the checkout has it).

    PYTHONPATH=<checkout> python benchmarks/call_host_cost.py
"""

import tempfile
import timeit

import torch
import torch.distributed as dist

import seqpar
from seqpar.runtime import call


def _us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/f", rank=0, world_size=1)
    if hasattr(call, "_owner"):
        print(f"_owner(None): {_us(lambda: call._owner(None), 100000):.3f} us")
    q = k = v = torch.randn(1, 64, 2, 16)

    def attend():
        return seqpar.attention(q, k, v, causal=True, method="ring", layout="zigzag", check_ranks=False)

    attend()
    print(f"seqpar.attention W=1 tiny, per call: {_us(attend, 2000):.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
