"""Port of ring-flash-attention test/test_zigzag_ring_flash_attn_func.py (tests/ports/README.md: what changed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ports.common import assert_close, flash_attn_qkvpacked_func  # was: from flash_attn import (the latter)
from utils import log, run_script, set_seed

from seqpar.compat.ring_flash_attn import zigzag_ring_flash_attn_qkvpacked_func  # was: from ring_flash_attn import ...


def extract_local(value, rank, world_size, dim=1):
    chunks = value.chunk(2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - rank - 1]], dim=dim).contiguous()


def main():
    rank = dist.get_rank()
    set_seed(rank)
    world_size = dist.get_world_size()
    dtype = torch.float32                  # was torch.bfloat16
    device = torch.device("cpu")           # was cuda:{rank}

    batch_size = 1
    seqlen = 136                           # was 3824
    nheads = 5
    d = 8                                  # was 128
    dropout_p = 0
    causal = True
    deterministic = False

    assert causal
    assert seqlen % (2 * world_size) == 0
    assert d % 8 == 0

    qkv = torch.randn(batch_size, seqlen, 3, nheads, d, device=device, dtype=dtype, requires_grad=True)
    dist.broadcast(qkv, src=0)
    dout = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype)
    dist.broadcast(dout, src=0)

    local_qkv = extract_local(qkv, rank, world_size).detach().clone()
    local_qkv.requires_grad = True
    local_dout = extract_local(dout, rank, world_size).detach().clone()

    out, lse, _ = flash_attn_qkvpacked_func(qkv, dropout_p=dropout_p, causal=causal, window_size=(-1, -1),
                                            alibi_slopes=None, deterministic=deterministic, return_attn_probs=True)
    local_out = extract_local(out, rank, world_size)
    local_lse = extract_local(lse, rank, world_size, dim=2)

    ring_out, ring_lse, _ = zigzag_ring_flash_attn_qkvpacked_func(
        local_qkv, dropout_p=dropout_p, causal=causal, window_size=(-1, -1), alibi_slopes=None,
        deterministic=deterministic, return_attn_probs=True)

    log("out", out, rank0_only=True)
    log("lse", lse, rank0_only=True)
    log("out diff", local_out - ring_out)
    assert_close("out", ring_out, local_out)
    log("lse diff", local_lse - ring_lse)
    assert_close("lse", ring_lse, local_lse)

    out.backward(dout)
    dqkv = qkv.grad
    local_dqkv = extract_local(dqkv, rank, world_size)

    ring_out.backward(local_dout)
    ring_dqkv = local_qkv.grad

    log("local_dqkv", local_dqkv)
    for i, name in enumerate(("dq", "dk", "dv")):     # upstream indexes [:, i], the sequence axis (README)
        log(f"{name} diff", local_dqkv[:, :, i] - ring_dqkv[:, :, i])
        assert_close(name, ring_dqkv[:, :, i], local_dqkv[:, :, i])


def script(argv: list[str]) -> None:
    run_script(main, argv, globals(), ("flash_attn_qkvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func"))


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_ring_flash_attn_func(pools, world):
    pools(world).run(script, [])


def test_zigzag_ring_flash_attn_func_compile(pools):
    """Upstream's ``compile`` rerun (``torch.compile``, inductor, ``capture_scalar_outputs``)."""
    pools(2).run(script, ["compile"])
