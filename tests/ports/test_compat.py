"""What the compat adapters do beyond the peers' own tests: the peers' defects they must not have, and the
arguments they must refuse instead of ignoring (PEERS.md §2 and §13).

yunchang: both ``use_ulysses_low`` placements give the single-process result with every ``ring_impl_type``
(yunchang's basic and stripe extraction mismatch its groups when it is False: defect 7); GQA and MQA with
fewer KV heads than the Ulysses degree (defect 8); the packed ring functions run (Y1); gradients in fp32 and
fp64 are right and in the input dtype (Y2, Y3, Y4); ``TORCH_MATH`` merges with real lse values (Y5);
``AsyncLongContextAttention`` is differentiable (defect 10). Values seqpar cannot honour raise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ports.common import assert_close, flash_attn_func

from seqpar.compat import yunchang as yc


def _inputs(seqlen: int, heads: int, kv_heads: int, dtype=torch.float32, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, 8, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(batch, seqlen, kv_heads, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    dout = torch.randn(batch, seqlen, heads, 8, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def _layer_case(layer, ring_impl_type: str, q, k, v, dout, causal: bool, rd: int, ud: int) -> None:
    """``layer`` on this rank's tokens against the dense reference, out and dq/dk/dv asserted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    extract = yc.EXTRACT_FUNC_DICT[ring_impl_type]
    local = [extract(t, rank, world, rd=rd, ud=ud).detach().clone().requires_grad_() for t in (q, k, v)]
    out = layer(*local, causal=causal)
    out.backward(extract(dout, rank, world, rd=rd, ud=ud))
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attn_func(*ref_in, causal=causal)
    ref.backward(dout)
    assert_close(f"{ring_impl_type} out", out, extract(ref.detach(), rank, world, rd=rd, ud=ud))
    for name, mine, theirs in zip(("dq", "dk", "dv"), local, ref_in):
        assert mine.grad.dtype == mine.dtype
        assert_close(f"{ring_impl_type} {name}", mine.grad, extract(theirs.grad, rank, world, rd=rd, ud=ud))


def _yunchang_extract(kind: str, x: torch.Tensor, rank: int, rd: int, ud: int) -> torch.Tensor:
    """yunchang 0.6.4's extraction with Ulysses groups on consecutive ranks (rank = ring rank * ud + u)."""
    rho, u = divmod(rank, ud)
    if kind == "basic":
        return x.chunk(rd * ud, dim=1)[rank]
    if kind == "zigzag":
        chunks = x.chunk(2 * rd, dim=1)
        return torch.cat([chunks[rho], chunks[2 * rd - 1 - rho]], dim=1).chunk(ud, dim=1)[u]
    b, s = x.shape[:2]
    strided = x.reshape(b, s // rd, rd, -1).transpose(1, 2).reshape(b, s, *x.shape[2:])
    return strided.chunk(rd * ud, dim=1)[rank]


def placements(_: int) -> None:
    """W = 4, U = R = 2, both placements x every ring_impl_type, causal and not; GQA (2 KV heads) and MQA."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for low in (True, False):
        yc.set_seq_parallel_pg(2, 2, rank, world, use_ulysses_low=low)
        if low:                                   # the same tokens as yunchang's helpers give
            x = torch.arange(2 * 48 * 3.0).reshape(2, 48, 3)
            for kind in ("basic", "zigzag", "strip"):
                assert torch.equal(yc.EXTRACT_FUNC_DICT[kind](x, rank, world, rd=2, ud=2),
                                   _yunchang_extract(kind, x, rank, 2, 2)), kind
        for ring_impl_type, causal, kv_heads in (("basic", True, 4), ("zigzag", True, 2), ("strip", True, 1),
                                                 ("basic", False, 2)):
            q, k, v, dout = _inputs(48, 4, kv_heads)
            layer = yc.LongContextAttention(ring_impl_type=ring_impl_type)
            _layer_case(layer, ring_impl_type, q, k, v, dout, causal, 2, 2)
    yc.set_seq_parallel_pg(4, 1, rank, world)               # Ulysses 4 over 2 KV heads: replicated on the wire
    q, k, v, dout = _inputs(48, 8, 2, batch=2)
    _layer_case(yc.AsyncLongContextAttention(ring_impl_type="zigzag"), "zigzag", q, k, v, dout, True, 1, 4)
    _layer_case(yc.LongContextAttention(ring_impl_type="zigzag", attn_type=yc.AttnType.TORCH_MATH), "zigzag",
                q, k, v, dout, True, 1, 4)


def _ring_calls(local: list[torch.Tensor]) -> dict:
    q, k, v = local
    return {
        "ring_flash_attn_func": lambda: yc.ring_flash_attn_func(q, k, v, causal=True, return_attn_probs=True),
        "ring_flash_attn_kvpacked_func": lambda: yc.ring_flash_attn_kvpacked_func(
            q, torch.stack((k, v), 2), causal=True, return_attn_probs=True),
        "ring_flash_attn_qkvpacked_func": lambda: yc.ring_flash_attn_qkvpacked_func(
            torch.stack((q, k, v), 2), causal=True, return_attn_probs=True),
        "ring_pytorch_attn_func": lambda: yc.ring_pytorch_attn_func(
            q, k, v, causal=True, return_attn_probs=True, attn_type=yc.AttnType.TORCH_MATH),
    }


def ring_functions(_: int) -> None:
    """yunchang's ring functions over the world: packed forms (Y1), fp64 and fp32 gradients (Y2-Y4)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for dtype in (torch.float32, torch.float64):
        q, k, v, dout = _inputs(32, 4, 4, dtype)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, lse, _ = flash_attn_func(*ref_in, causal=True, return_attn_probs=True)
        ref.backward(dout)
        local = [t.chunk(world, 1)[rank].clone().requires_grad_() for t in (q, k, v)]
        calls = _ring_calls(local)
        for name, call in calls.items():
            for t in local:
                t.grad = None
            out, out_lse, none = call()
            assert none is None
            out.backward(dout.chunk(world, 1)[rank])
            assert_close(f"{name} {dtype} out", out, ref.detach().chunk(world, 1)[rank])
            assert_close(f"{name} {dtype} lse", out_lse, lse.chunk(world, 2)[rank])
            for g, mine, theirs in zip(("dq", "dk", "dv"), local, ref_in):
                assert_close(f"{name} {dtype} {g}", mine.grad, theirs.grad.chunk(world, 1)[rank])


def refusals(_: int) -> list[str]:
    """Each value yunchang accepts that seqpar cannot honour: ``type: message`` of what it raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    yc.set_seq_parallel_pg(2, 1, rank, world)
    x = torch.randn(1, 8, 2, 8)
    calls = [
        lambda: yc.LongContextAttention(use_sync=True),
        lambda: yc.LongContextAttention(attn_type=yc.AttnType.FA3),
        lambda: yc.LongContextAttention(attn_type=yc.AttnType.SAGE_FP8),
        lambda: yc.LongContextAttention(attn_processor=torch.nn.Identity()),
        lambda: yc.LongContextAttention(ring_impl_type="basic_flashinfer"),
        lambda: yc.LongContextAttention(ring_impl_type="ring"),
        lambda: yc.LongContextAttention(scatter_idx=1, gather_idx=2),
        lambda: yc.LongContextAttention()(x, x, x, 0.0, None, True, (-1, -1), 0.0, None, False, False, "extra"),
        lambda: yc.LongContextAttention()(x, x, x, dropout_p=0.1),
        lambda: yc.UlyssesAttention(attn_type=yc.AttnType.NPU),
        lambda: yc.ring_flashinfer_attn_func(x, x, x),
        lambda: yc.set_seq_parallel_pg(2, 1, rank + 1, world),
        lambda: yc.basic_extract_local(torch.randn(1, 8, 2), rank, world, rd=2, ud=1),
    ]
    msgs = []
    for call in calls:
        try:
            call()
            msgs.append("no error")
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    return msgs


def test_placements_gqa_and_async(pools):
    pools(4).run(placements, 0)


def test_ring_functions_packed_and_dtypes(pools):
    pools(2).run(ring_functions, 0)


REFUSED = [
    "NotImplementedError: use_sync must be False",
    "NotImplementedError: attn_type=AttnType.FA3 is not supported: FlashAttention-3",
    "NotImplementedError: attn_type=AttnType.SAGE_FP8 is not supported: SageAttention's quantized",
    "NotImplementedError: attn_processor must be None",
    "NotImplementedError: ring_impl_type='basic_flashinfer' runs FlashInfer",
    "ValueError: ring_impl_type must be one of ['basic', 'basic_pytorch', 'strip', 'zigzag'], got 'ring'",
    "NotImplementedError: scatter_idx and gather_idx must be (2, 1)",
    "TypeError: forward takes no arguments after return_attn_probs",
    "NotImplementedError: dropout_p is not supported yet",
    "NotImplementedError: attn_type=AttnType.NPU is not supported",
    "NotImplementedError: ring_flashinfer_attn_* run FlashInfer's kernel",
    "ValueError: rank and world_size must be this process's global rank and the world size",
    "ValueError: rd and ud must be the degrees given to set_seq_parallel_pg (ring 1, ulysses 2), got rd=2, ud=1",
]


def test_refusals(pools):
    for r, msgs in enumerate(pools(2).run(refusals, 0)):
        assert len(msgs) == len(REFUSED)
        for msg, start in zip(msgs, REFUSED):
            assert msg.startswith(start), msg
            assert f"(rank {r} of 2)" in msg, msg
