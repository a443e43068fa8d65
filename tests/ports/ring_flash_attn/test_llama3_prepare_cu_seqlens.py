"""Port of ring-flash-attention test/test_llama3_prepare_cu_seqlens.py (tests/ports/README.md: what changed).

Upstream prints each rank's values; the port asserts them too: the ones ring-flash-attn 0.1.8's
``llama3_flash_attn_prepare_cu_seqlens`` returns for these boundaries (derived by hand from its definition,
rank r holding rows [2r, 2r + 2) of 16).
"""

from __future__ import annotations

import pytest
import torch
from utils import run_script

from seqpar.compat.ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens  # was: from ring_flash_attn import

RING_FLASH_ATTN_VALUES = {  # rank: (cu_seqlens_q, cu_seqlens_k, local_k_slice)
    0: ([0, 2], [0, 2], (0, 2)),
    1: ([0, 2], [0, 4], (0, 4)),
    2: ([0, 2], [0, 6], (0, 6)),
    3: ([0, 1, 2], [0, 7, 8], (0, 8)),
    4: ([0, 2], [0, 3], (7, 10)),
    5: ([0, 2], [0, 5], (7, 12)),
    6: ([0, 2], [0, 7], (7, 14)),
    7: ([0, 2], [0, 2], (14, 16)),
}


def main():
    device = torch.device("cpu")           # was cuda
    cu_seqlens = [0, 7, 14, 16]
    cu_seqlens_tensor = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)

    world_size = 8
    for rank in range(world_size):
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice = llama3_flash_attn_prepare_cu_seqlens(
            cu_seqlens_tensor, causal=True, rank=rank, world_size=world_size)

        assert max_seqlen_q == (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()
        assert max_seqlen_k == (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()
        print(f"RANK: {rank}")
        print(f"  cu_seqlens_q: {cu_seqlens_q}")
        print(f"  cu_seqlens_k: {cu_seqlens_k}")
        print(f"  local_k_slice: {local_k_slice}")
        want_q, want_k, (lo, hi) = RING_FLASH_ATTN_VALUES[rank]
        assert (cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), local_k_slice) == (want_q, want_k, slice(lo, hi))
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)


@pytest.mark.parametrize("argv", [[], ["compile"]], ids=["eager", "compile"])
def test_llama3_prepare_cu_seqlens(argv):
    run_script(main, argv, globals(), ("llama3_flash_attn_prepare_cu_seqlens",))
