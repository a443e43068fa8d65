"""What the ported peer tests share: the reference in place of flash-attn, the asserts they add, ``log`` and the
scripts' ``__main__`` block.

The peers' tests take flash-attn on one GPU as the single-process reference. Here the reference is dense
attention on the whole sequence, computed in fp64 from an explicit mask (``seqpar.testing.dense_mask``: causal,
flash-attn's windows and documents in global positions) and differentiable by autograd, behind the flash-attn
signatures the tests call. Its outputs come back in the input dtype, lse in fp32 (fp64 for fp64 inputs) in
flash-attn's shapes: ``(b, h, s)`` batch, ``(h, total)`` varlen.

``assert_close`` is the assert the ports add to every comparison the peers only print: the flash-attn rule of
``seqpar.tolerances`` (normalised max error at most 1e-5 in fp32, 1e-10 in fp64, against this fp64
reference; lse with -inf on the same rows).

``log`` prints like the peers' (every rank in turn, or rank 0 only). ``run_script`` is a script's
``if __name__ == "__main__":`` block for a pool worker that lives on: ring-flash-attn's ``compile`` rerun
rebinds module functions to ``torch.compile`` of them and sets ``capture_scalar_outputs``, exactly as upstream,
and both are undone afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from seqpar.testing import dense_mask, judge

__all__ = ["assert_close", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_qkvpacked_func", "log",
           "run_script"]


@torch.compiler.disable
def _dense(q_BSHD, k_BSHD, v_BSHD, causal, window_size, softmax_scale, cu_seqlens=None):
    """(out (B, S, H, D) in q's dtype, lse (B, H, S) fp32; fp64 for fp64 inputs), differentiable.

    Opaque to torch.compile, as flash-attn's kernels are (custom operators): a compiled caller runs it eagerly.
    """
    S, H, D = q_BSHD.shape[1:]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    G = H // k_BSHD.shape[2]
    q, k, v = (t.to(torch.float64) for t in (q_BSHD, k_BSHD, v_BSHD))
    k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    vis = dense_mask(S, causal=causal, window=tuple(window_size), cu_seqlens=cu, device=q.device)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).mul(scale).masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out.to(q_BSHD.dtype), lse.to(torch.float64 if q_BSHD.dtype == torch.float64 else torch.float32)


def _plain(dropout_p, softcap, alibi_slopes) -> None:
    if dropout_p or softcap or alibi_slopes is not None:
        raise NotImplementedError("the dense reference has no dropout, softcap or ALiBi")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_func`` on ``(b, s, h, d)``: ``out`` or ``(out, lse (b, h, s), None)``."""
    _plain(dropout_p, softcap, alibi_slopes)
    out, lse = _dense(q, k, v, causal, window_size, softmax_scale)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``qkv (b, s, 3, h, d)``."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``qkv (total, 3, h, d)``, documents ``cu_seqlens``: ``out (total, h, d)`` or ``(out, lse (h, total), None)``."""
    _plain(dropout_p, softcap, alibi_slopes)
    out, lse = _dense(qkv[None, :, 0], qkv[None, :, 1], qkv[None, :, 2], causal, window_size, softmax_scale,
                      cu_seqlens)
    return (out[0], lse[0], None) if return_attn_probs else out[0]


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """``got`` (the distributed result) against ``ref`` (the dense reference's): the flash-attn rule."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)}, reference {tuple(ref.shape)}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype}, reference {ref.dtype}"
    verdict = judge(name, got, ref, None, str(ref.dtype).removeprefix("torch."))
    assert verdict.ok, f"{name}: {verdict}"


def log(msg: str, a: torch.Tensor, rank0_only: bool = False) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    text = f"max {a.abs().max().item():.3g}, mean {a.abs().mean().item():.3g}"
    if rank0_only:
        if rank == 0:
            print(f"{msg}: {text}", flush=True)
        return
    for i in range(world_size):
        if i == rank:
            print(f"{msg}: [{rank}] {text}", flush=True)
        dist.barrier()


def run_script(main: Callable[[], None], argv: list[str], namespace: dict, compiled: tuple[str, ...]) -> None:
    """``torchrun script.py *argv`` inside a pool worker: ``argv == ["compile"]`` compiles ``compiled`` first."""
    saved = {name: namespace[name] for name in compiled}
    try:
        if len(argv) > 0 and argv[0] == "compile":
            torch._dynamo.config.capture_scalar_outputs = True
            for name in compiled:
                namespace[name] = torch.compile(namespace[name])
        main()
    finally:
        namespace.update(saved)
        torch._dynamo.config.capture_scalar_outputs = False
        torch._dynamo.reset()
