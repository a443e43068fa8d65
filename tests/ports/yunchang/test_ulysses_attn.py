"""Port of yunchang test/test_ulysses_attn.py (tests/ports/README.md: what changed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ports.common import assert_close, flash_attn_func, log  # was: from flash_attn import flash_attn_func

from seqpar.compat.yunchang import UlyssesAttention  # was: from yunchang import UlyssesAttention
from seqpar.compat.yunchang.kernels import AttnType  # was: from yunchang.kernels import AttnType


def main():
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    dtype = torch.float32                  # was torch.bfloat16
    device = torch.device("cpu")           # was cuda:{rank}

    batch_size = 2
    seqlen = 120                           # was 3816
    nheads = 8
    d = 8                                  # was 128
    dropout_p = 0
    causal = True
    deterministic = False

    assert seqlen % world_size == 0
    assert d % 8 == 0

    q = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(batch_size, seqlen, nheads, d, device=device, dtype=dtype)
    for t in (q, k, v, dout):
        dist.broadcast(t, src=0)

    local_q = q.chunk(world_size, dim=1)[rank].detach().clone()
    local_q.requires_grad = True
    local_k = k.chunk(world_size, dim=1)[rank].detach().clone()
    local_k.requires_grad = True
    local_v = v.chunk(world_size, dim=1)[rank].detach().clone()
    local_v.requires_grad = True
    local_dout = dout.chunk(world_size, dim=1)[rank].detach().clone()

    sp_pg = None                           # the sequence-parallel group is the whole world
    dist_attn = UlyssesAttention(sp_pg, attn_type=AttnType.FA)

    local_out = dist_attn(local_q, local_k, local_v, dropout_p=dropout_p, causal=causal, window_size=(-1, -1),
                          softcap=0.0, alibi_slopes=None, deterministic=deterministic, return_attn_probs=True)
    local_out.backward(local_dout)

    out_ref, _, _ = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=deterministic, return_attn_probs=True)
    out_ref.backward(dout)

    local_out_ref = out_ref.chunk(world_size, dim=1)[rank]
    log("out", local_out, rank0_only=True)
    log("out diff", local_out_ref - local_out)
    assert_close("out", local_out, local_out_ref)

    for name, t, local in (("dq", q, local_q), ("dk", k, local_k), ("dv", v, local_v)):
        local_ref = t.grad.chunk(world_size, dim=1)[rank]
        log(f"load_{name}", local.grad)
        log(f"{name} diff", local_ref - local.grad)
        assert_close(name, local.grad, local_ref)


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_attn(pools, world):
    pools(world).run(main)
