"""Port of ring-flash-attention test/test_llama3_flash_attn_varlen_func.py (tests/ports/README.md: what changed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ports.common import assert_close, flash_attn_varlen_qkvpacked_func  # was: from flash_attn import (the latter)
from utils import log, run_script, set_seed

from seqpar.compat.ring_flash_attn import (  # was: from ring_flash_attn import ...
    llama3_flash_attn_prepare_cu_seqlens,
    llama3_flash_attn_varlen_qkvpacked_func,
)


def main():
    rank = dist.get_rank()
    set_seed(rank)
    world_size = dist.get_world_size()
    dtype = torch.float32                  # was torch.bfloat16
    device = torch.device("cpu")           # was cuda:{rank}

    nheads = 5
    d = 8
    dropout_p = 0
    causal = True
    deterministic = False

    cu_seqlens = [0, 13, 70, 120]          # was [0, 120, 1248, 4232]: documents still cross rank edges
    cu_seqlens_tensor = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    max_seqlen = (cu_seqlens_tensor[1:] - cu_seqlens_tensor[:-1]).max().item()
    total_length = cu_seqlens[-1]
    local_length = total_length // world_size

    assert cu_seqlens_tensor[-1] % world_size == 0
    assert d % 8 == 0

    qkv = torch.randn(total_length, 3, nheads, d, device=device, dtype=dtype, requires_grad=True)
    dist.broadcast(qkv, src=0)
    dout = torch.randn(total_length, nheads, d, device=device, dtype=dtype)
    dist.broadcast(dout, src=0)

    local_qkv = qkv[rank * local_length: (rank + 1) * local_length].detach().clone()
    local_dout = dout[rank * local_length: (rank + 1) * local_length].detach().clone()
    local_qkv.requires_grad = True

    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_tensor, max_seqlen, dropout_p=dropout_p,
                                                   causal=causal, window_size=(-1, -1), alibi_slopes=None,
                                                   deterministic=deterministic, return_attn_probs=True)
    local_out = out[rank * local_length: (rank + 1) * local_length]
    if lse.dim() == 2:
        local_lse = lse[:, rank * local_length: (rank + 1) * local_length]

    local_cu_seqlens_q, local_cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice = \
        llama3_flash_attn_prepare_cu_seqlens(cu_seqlens_tensor, causal=causal, rank=rank, world_size=world_size)

    llama3_out, llama3_lse, _ = llama3_flash_attn_varlen_qkvpacked_func(
        local_qkv, local_cu_seqlens_q, local_cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride=1,
        local_k_slice=local_k_slice, dropout_p=dropout_p, causal=causal, window_size=(-1, -1), alibi_slopes=None,
        deterministic=deterministic, return_attn_probs=True)

    log("out", out, rank0_only=True)
    log("out diff", local_out - llama3_out)
    assert_close("out", llama3_out, local_out)
    if lse.dim() == 2:
        log("lse", lse, rank0_only=True)
        log("lse diff", local_lse - llama3_lse)
        assert_close("lse", llama3_lse, local_lse)

    out.backward(dout)
    dqkv = qkv.grad
    local_dqkv = dqkv[rank * local_length: (rank + 1) * local_length]

    llama3_out.backward(local_dout)
    llama3_dqkv = local_qkv.grad

    log("local_dq", local_dqkv[:, 0])
    for i, name in enumerate(("dq", "dk", "dv")):
        log(f"{name} diff", local_dqkv[:, i] - llama3_dqkv[:, i])
        assert_close(name, llama3_dqkv[:, i], local_dqkv[:, i])


def script(argv: list[str]) -> None:
    run_script(main, argv, globals(), ("flash_attn_varlen_qkvpacked_func", "llama3_flash_attn_prepare_cu_seqlens",
                                       "llama3_flash_attn_varlen_qkvpacked_func"))


@pytest.mark.parametrize("world", [2, 4])
def test_llama3_flash_attn_varlen_func(pools, world):
    pools(world).run(script, [])


def test_llama3_flash_attn_varlen_func_compile(pools):
    """Upstream's ``compile`` rerun (``torch.compile``, inductor, ``capture_scalar_outputs``)."""
    pools(2).run(script, ["compile"])
