"""Host cost of posting a collective on torch's fake process group, per kind, against the same on no group at all.

    python3 benchmarks/gpu/probe_fake_host.py      (one GPU, a few seconds)

rank 0 of 8 on the fake group (``FakeStore``), CUDA buffers of a Ulysses all-to-all at 2K tokens per rank (16 MiB);
each line: microseconds of host time per posted collective (``seqpar.bench.suites.host_us``: the median of 7 bursts
of 200), with the buffers as they are and as the empty views ``seqpar.comm.link.wire`` hands a fake group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from seqpar.bench.suites import host_us


def main() -> None:
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    x = torch.empty(8 * 1024 * 1024, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    big = torch.empty(8 * x.numel(), dtype=x.dtype, device="cuda")
    cases = {
        "all_to_all_single": lambda a, b, c: dist.all_to_all_single(b, a, async_op=True).wait(),
        "all_gather_into_tensor": lambda a, b, c: dist.all_gather_into_tensor(c, a, async_op=True).wait(),
        "isend+irecv": lambda a, b, c: [w.wait() for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, a, 1), dist.P2POp(dist.irecv, b, 7)])],
        "empty copy_ (a kernel launch, for scale)": lambda a, b, c: b.copy_(a),
    }
    for name, fn in cases.items():
        full = host_us(lambda fn=fn: fn(x, y, big), 200)
        empty = host_us(lambda fn=fn: fn(x[:0], y[:0], big[:0]), 200)
        print(f"{name}: {full:.1f} us as they are, {empty:.1f} us as empty views", flush=True)


if __name__ == "__main__":
    main()
