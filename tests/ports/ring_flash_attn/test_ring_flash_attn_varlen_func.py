"""Port of ring-flash-attention test/test_ring_flash_attn_varlen_func.py (tests/ports/README.md: what changed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ports.common import assert_close, flash_attn_varlen_qkvpacked_func  # was: from flash_attn import (the latter)
from utils import log, run_script, set_seed

import seqpar
from seqpar.compat.ring_flash_attn import ring_flash_attn_varlen_qkvpacked_func  # was: from ring_flash_attn import


def extract_local(value, cu_seqlens, rank, world_size):
    local_values = []
    for i in range(len(cu_seqlens) - 1):
        start, end = cu_seqlens[i], cu_seqlens[i + 1]
        local_values.append(value[start:end].chunk(world_size, dim=0)[rank].detach().clone())
    return torch.cat(local_values, dim=0).contiguous()


def extract_lse(lse, cu_seqlens):
    values = []
    if lse.dim() == 2:
        for i in range(len(cu_seqlens) - 1):
            start, end = cu_seqlens[i], cu_seqlens[i + 1]
            values.append(lse[:, start:end])
    else:
        assert lse.dim() == 3
        for i in range(len(cu_seqlens) - 1):
            start, end = cu_seqlens[i], cu_seqlens[i + 1]
            values.append(lse[i, :, : end - start])
    return values


def main():
    rank = dist.get_rank()
    set_seed(rank)
    world_size = dist.get_world_size()
    dtype = torch.float32                  # was torch.bfloat16
    device = torch.device("cpu")           # was cuda:{rank}

    nheads = 5
    d = 8                                  # was 128
    dropout_p = 0
    causal = True
    deterministic = False

    cu_seqlens = [0, 8, 48, 104]           # was [0, 120, 1248, 4232]: every document divides by W
    cu_seqlens_tensor = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    max_seqlen = (cu_seqlens_tensor[1:] - cu_seqlens_tensor[:-1]).max().item()
    total_length = cu_seqlens[-1]

    assert torch.all(cu_seqlens_tensor % world_size == 0)
    assert d % 8 == 0

    qkv = torch.randn(total_length, 3, nheads, d, device=device, dtype=dtype, requires_grad=True)
    dist.broadcast(qkv, src=0)
    dout = torch.randn(total_length, nheads, d, device=device, dtype=dtype)
    dist.broadcast(dout, src=0)

    local_cu_seqlens_tensor = cu_seqlens_tensor // world_size
    local_max_seqlen = max_seqlen // world_size

    local_qkv = extract_local(qkv, cu_seqlens, rank, world_size)
    local_qkv.requires_grad = True
    local_dout = extract_local(dout, cu_seqlens, rank, world_size)

    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_tensor, max_seqlen, dropout_p=dropout_p,
                                                   causal=causal, window_size=(-1, -1), alibi_slopes=None,
                                                   deterministic=deterministic, return_attn_probs=True)
    local_out = extract_local(out, cu_seqlens, rank, world_size)
    lse_list = extract_lse(lse, cu_seqlens)

    ring_out, ring_lse, _ = ring_flash_attn_varlen_qkvpacked_func(
        local_qkv, local_cu_seqlens_tensor, local_max_seqlen, dropout_p=dropout_p, causal=causal,
        window_size=(-1, -1), alibi_slopes=None, deterministic=deterministic, return_attn_probs=True)
    ring_lse_list = extract_lse(ring_lse, local_cu_seqlens_tensor.tolist())

    log("out", out, rank0_only=True)
    log("out diff", local_out - ring_out)
    assert_close("out", ring_out, local_out)
    for lse, ring_lse in zip(lse_list, ring_lse_list):
        local_lse = lse.chunk(world_size, dim=-1)[rank]
        log("lse", lse, rank0_only=True)
        log("lse diff", local_lse - ring_lse)
        assert_close("lse", ring_lse, local_lse)

    out.backward(dout)
    dqkv = qkv.grad
    local_dqkv = extract_local(dqkv, cu_seqlens, rank, world_size)

    ring_out.backward(local_dout)
    ring_dqkv = local_qkv.grad

    log("local_dqkv", local_dqkv)
    for i, name in enumerate(("dq", "dk", "dv")):
        log(f"{name} diff", local_dqkv[:, i] - ring_dqkv[:, i])
        assert_close(name, ring_dqkv[:, i], local_dqkv[:, i])


def script(argv: list[str]) -> None:
    run_script(main, argv, globals(), ("flash_attn_varlen_qkvpacked_func", "ring_flash_attn_varlen_qkvpacked_func"))


WAITS = pytest.mark.skipif("doc_zigzag" not in seqpar.methods.get("ring").layouts,
                           reason="waits on the document layouts (doc_contiguous, doc_zigzag) in seqpar.attention")


@WAITS
@pytest.mark.parametrize("world", [2, 4])
def test_ring_flash_attn_varlen_func(pools, world):
    pools(world).run(script, [])


@WAITS
def test_ring_flash_attn_varlen_func_compile(pools):
    """Upstream's ``compile`` rerun (``torch.compile``, inductor, ``capture_scalar_outputs``)."""
    pools(2).run(script, ["compile"])
