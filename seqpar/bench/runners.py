"""What gets timed: the single-GPU limit, seqpar's methods, and the peers (through ``.peers/``).

A runner is built once per (preset, configuration) on every rank and returns ``{mode: callable}``; each
callable runs one forward (under no_grad) or one forward+backward on preallocated local shards.
Inputs are random local shards drawn on each rank (timing does not need a shared global tensor, and the
long presets would not fit one).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .presets import MethodSpec, Preset

__all__ = ["forget_meshes", "limit_runner", "ours_runner", "peer_runners"]

Runner = dict[str, Callable[[], object]]


def _dtype(preset: Preset) -> torch.dtype:
    return getattr(torch, preset.dtype)


def _local(preset: Preset, world: int, device: torch.device, heads: int, seed: int,
           seq_len: int | None = None) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    s = preset.seq_len if seq_len is None else seq_len
    return torch.randn(preset.batch, s // world, heads, preset.head_dim, device=device, dtype=_dtype(preset),
                       generator=g)


def _modes(preset: Preset, fwd: Callable[[], object], fwd_bwd: Callable[[], object]) -> Runner:
    table = {"fwd": fwd, "fwd+bwd": fwd_bwd}
    return {m: table[m] for m in preset.modes}


def limit_runner(preset: Preset, device: torch.device, seq_len: int | None = None) -> Runner:
    """Single-GPU cuDNN (SDPA) on the full sequence, or flex with the preset's mask; call it on one rank only."""
    s = preset.seq_len if seq_len is None else seq_len
    call = _sdpa_call(preset, device) if preset.mask is None else _flex_call(preset, device, s)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(preset.batch, h, s, preset.head_dim, device=device, dtype=_dtype(preset), generator=g)
               for h in (preset.heads, preset.kv_heads, preset.kv_heads))
    do = torch.randn_like(q)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            return call(q, k, v)

    def fwd_bwd():
        return torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do)

    return _modes(preset, fwd, fwd_bwd)


def _sdpa_call(preset: Preset, device: torch.device) -> Callable[..., torch.Tensor]:
    """cuDNN through SDPA (math on CPU), ``(B, H, S, D)`` tensors."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.CUDNN_ATTENTION if device.type == "cuda" else SDPBackend.MATH
    gqa = preset.kv_heads != preset.heads

    def call(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=preset.causal, enable_gqa=gqa)
    return call


def _flex_call(preset: Preset, device: torch.device, s: int) -> Callable[..., torch.Tensor]:
    """flex_attention with the preset's mask as a block mask (compiled on CUDA), ``(B, H, S, D)`` tensors; off
    CUDA, where flex has no backward, SDPA's math kernel with the mask evaluated densely (the CPU smoke sizes)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fn = preset.mask_mod().mod(device, s)
    mod = (lambda b, h, qi, ki: fn(b, h, qi, ki) & (ki <= qi)) if preset.causal else fn
    gqa = preset.kv_heads != preset.heads
    if device.type != "cuda":
        pos = torch.arange(s, device=device)
        zero = torch.zeros((), dtype=torch.long, device=device)
        dense = mod(zero, zero, pos[:, None], pos[None, :]).expand(s, s)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)
    bm = create_block_mask(mod, None, None, s, s, device=device, _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=gqa)


_MESHES: dict[tuple[int, int], Any] = {}


def forget_meshes() -> None:
    """Drop the meshes built for 2D methods and PyTorch's CP (the process group they were made on is gone)."""
    _MESHES.clear()


def ours_runner(spec: MethodSpec, preset: Preset, device: torch.device, group: dist.ProcessGroup | None = None,
                kernel: str = "auto", check_ranks: bool = True, graphs: bool | None = None) -> Runner:
    """seqpar.attention with ``spec`` on local shards (``check_ranks``: seqpar's agreement round; ``graphs``: its
    ``graphs=`` argument)."""
    import seqpar

    world = dist.get_world_size(group)
    mesh: Any = group
    if spec.ulysses is not None:
        key = (spec.ulysses, world)
        if key not in _MESHES:
            _MESHES[key] = seqpar.make_mesh(ulysses=spec.ulysses, device_type=device.type)
        mesh = _MESHES[key]
    # a length the method's layout cannot split runs padded, padding masked out
    divisor = seqpar.api.placement_divisor(mesh, spec.method, spec.layout)
    padded = -(-preset.seq_len // divisor) * divisor
    q = _local(preset, world, device, preset.heads, 1, padded)
    k = _local(preset, world, device, preset.kv_heads, 2, padded)
    v = _local(preset, world, device, preset.kv_heads, 3, padded)
    do = torch.randn_like(q)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    kw = {"mesh": mesh, "method": spec.method, "layout": spec.layout, "causal": preset.causal, "kernel": kernel,
          "check_ranks": check_ranks, "graphs": graphs, "mask_mod": preset.mask_mod(), **dict(spec.options)}
    if padded != preset.seq_len:
        kw["seq_len"] = preset.seq_len

    def fwd():
        with torch.no_grad():
            return seqpar.attention(q, k, v, **kw)

    def fwd_bwd():
        out = seqpar.attention(qg, kg, vg, **kw)
        return torch.autograd.grad(out, (qg, kg, vg), do)

    return _modes(preset, fwd, fwd_bwd)


# ----------------------------------------------------------------------------------------------- peers
# The peers run through ../shared/peers (copied into the ignored folder .peers/ and put on PYTHONPATH):
# a stand-in flash_attn routing to PyTorch's FA2, plus the peers' wheels. Their defaults and quirks are
# kept as PEERS.md measured them (ring-flash-attn llama3 with heads_k_stride=1; yunchang AttnType.FA).

def _shard(x: torch.Tensor, layout: str, world: int, rank: int) -> torch.Tensor:
    if layout == "contig":
        return x.chunk(world, dim=1)[rank].contiguous()
    if layout == "zigzag":
        c = x.chunk(2 * world, dim=1)
        return torch.cat([c[rank], c[2 * world - 1 - rank]], dim=1).contiguous()
    return x[:, rank::world].contiguous()


def _peer_inputs(preset: Preset, device: torch.device):
    world = dist.get_world_size()
    return [_local(preset, world, device, h, s) for h, s in
            ((preset.heads, 1), (preset.kv_heads, 2), (preset.kv_heads, 3), (preset.heads, 4))]


def _wrap(preset: Preset, device: torch.device, call: Callable[..., torch.Tensor]) -> Runner:
    q, k, v, do = _peer_inputs(preset, device)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            return call(q, k, v)

    def fwd_bwd():
        out = call(qg, kg, vg)
        return torch.autograd.grad(out, (qg, kg, vg), do)

    return _modes(preset, fwd, fwd_bwd)


def _rfa():
    stub = types.ModuleType("ring_flash_attn.adapters")       # its HF adapter breaks on transformers 5
    stub.substitute_hf_flash_attn = stub.update_ring_flash_attn_params = None
    sys.modules.setdefault("ring_flash_attn.adapters", stub)
    import ring_flash_attn

    return ring_flash_attn


def peer_runners(preset: Preset, device: torch.device) -> dict[str, Callable[[], Runner]]:
    """Factories of every peer configuration that applies to ``preset`` (built lazily, one at a time). Each reads
    its rank when it builds: an emulated world becomes another rank between configurations."""
    world = dist.get_world_size()
    causal = preset.causal
    out: dict[str, Callable[[], Runner]] = {}

    def rfa_fn(name):
        return lambda q, k, v: getattr(_rfa(), name)(q, k, v, causal=causal)

    out["peer:ring-flash-attn/ring"] = lambda: _wrap(preset, device, rfa_fn("ring_flash_attn_func"))
    if causal:
        out["peer:ring-flash-attn/zigzag"] = lambda: _wrap(preset, device, rfa_fn("zigzag_ring_flash_attn_func"))
        out["peer:ring-flash-attn/stripe"] = lambda: _wrap(preset, device, rfa_fn("stripe_flash_attn_func"))

        def llama3():
            rfa = _rfa()
            cu = torch.tensor([0, preset.seq_len], device=device, dtype=torch.int32)
            cq, ck, mq, mk, sl = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, causal, dist.get_rank(), world)
            return _wrap(preset, device, lambda q, k, v: rfa.llama3_flash_attn_varlen_func(
                q[0], k[0], v[0], cq, ck, mq, mk, heads_k_stride=1, local_k_slice=sl, causal=causal).unsqueeze(0))
        out["peer:ring-flash-attn/llama3"] = llama3

    for ud in sorted({world, 2, 1}, reverse=True):
        if world % ud or (ud > preset.kv_heads and preset.kv_heads < preset.heads):
            continue
        rd = world // ud
        impl = "zigzag" if rd > 1 and causal else "basic"

        def yunchang(ud=ud, rd=rd, impl=impl):
            from yunchang import LongContextAttention, set_seq_parallel_pg
            from yunchang.kernels import AttnType

            set_seq_parallel_pg(ud, rd, dist.get_rank(), world)
            attn = LongContextAttention(ring_impl_type=impl, attn_type=AttnType.FA)
            return _wrap(preset, device, lambda q, k, v: attn(q, k, v, causal=causal))
        out[f"peer:yunchang/u{ud}r{rd}/{impl}"] = yunchang

    for backend_name in ("flash", "cudnn"):
        for rot in ("allgather", "alltoall"):
            out[f"peer:torch-cp/{rot}/{backend_name}"] = \
                lambda b=backend_name, r=rot: _torch_cp(preset, device, b, r)
    return out


def _torch_cp(preset: Preset, device: torch.device, backend_name: str, rotate: str) -> Runner:
    """PyTorch's context parallel: buffers sharded in place inside the context manager, SDPA patched."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import _attention as cp_private
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    world = dist.get_world_size()
    if (-1, world) not in _MESHES:
        _MESHES[(-1, world)] = init_device_mesh(device.type, (world,))
    mesh = _MESHES[(-1, world)]
    if hasattr(cp_private, "set_rotate_method"):
        cp_private.set_rotate_method(rotate)
    if hasattr(cp_private, "_cp_options"):
        cp_private._cp_options.enable_load_balance = preset.causal
    backend = SDPBackend.FLASH_ATTENTION if backend_name == "flash" else SDPBackend.CUDNN_ATTENTION
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(preset.batch, h, preset.seq_len, preset.head_dim, device=device, dtype=_dtype(preset),
                           generator=g) for h in (preset.heads, preset.kv_heads, preset.kv_heads))
    gqa = preset.kv_heads != preset.heads
    stack = contextlib.ExitStack()
    stack.enter_context(context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]))
    stack.enter_context(sdpa_kernel(backend))
    do = torch.randn_like(q)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=preset.causal, enable_gqa=gqa)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=preset.causal, enable_gqa=gqa)
        return torch.autograd.grad(out, (qg, kg, vg), do)

    runner = _modes(preset, fwd, fwd_bwd)
    runner["__exit__"] = stack.close       # leave the context (restores SDPA) after timing
    return runner
