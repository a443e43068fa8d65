"""All-to-all between sequence-sharded and head-sharded tensors (Ulysses, ALGORITHMS.md §5), with autograd.

Pure communication: tensors are cut, moved and reassembled; no attention is computed here. Two families:

* ``post_*`` functions post one ``all_to_all_single`` (asynchronous) and return a ``Pending`` whose
  ``wait()`` completes it and unpacks the result; methods call them inside their own autograd Functions.
* ``qkv_seq_to_heads``, ``seq_to_heads`` and ``heads_to_seq`` are the same moves as differentiable
  functions (autograd Functions whose backward is the adjoint move), for callers composing their own layers.

Where the ``post_*`` functions take a group, a ``seqpar.comm.symmetric.Pulls`` in its place moves the all-to-all on
copy engines: send buffers in its lane, each rank pulling its slots (Note [Copy-engine all-to-all]).

Note [Ulysses all-to-all]
    U ranks of a group hold consecutive sequence pieces: rank u holds rows ``[u L, (u+1) L)`` of the group's
    sequence (S = U L rows), all heads. Head-sharded, rank u holds all S rows for head slot u. One
    collective moves everything: the send buffer is ``(U, B, L, Hs, D)`` where slot ``u`` (dim 0) is what
    destination u gets - its heads of my rows; the receive buffer has the same shape, slot ``u'`` holding
    source u''s rows of my heads, so concatenating slots along the sequence gives the full sequence::

        seq-sharded  (B, L, H, D) on rank u'   --a2a-->   head-sharded (B, U*L, H/U, D) on rank u
        send[u]  = x[:, :, u*H/U:(u+1)*H/U]               x_h[:, u'*L:(u'+1)*L] = recv[u']

    q, k and v travel in ONE buffer ``(U, B, L, F)``, per destination and token the features ``[q heads |
    k heads | v heads]`` flattened (``F = H/U D + Hkv_slot (D + Dv)``: the value head dim may differ), and
    the gradients return the same way. The adjoint of a permutation is its inverse, so the backward of each
    move is the opposite move.

Note [GQA head slots]
    Destination u runs query heads ``[u H/U, (u+1) H/U)``; with ``G = H / Hkv`` they use KV heads
    ``h // G``. Each destination gets exactly those KV heads (ALGORITHMS.md §5.2):

    * U divides Hkv: slot u = KV heads ``[u Hkv/U, (u+1) Hkv/U)``; no replication.
    * Hkv divides U: slot u = the single KV head ``u // (U/Hkv)``; each head goes to ``U/Hkv`` consecutive
      destinations, replicated on the wire only (the send buffer is written from a broadcast view, never a
      replicated copy). The backward receives ``U/Hkv`` partial dK/dV per head and sums them (the adjoint of
      replication), in the accumulation dtype.

    Any other (H, Hkv, U) is rejected by the methods before any collective (``HeadSlots.valid_degrees``).

Note [Wide copies]
    Every move above is a permutation copy whose innermost run is one head (D elements, contiguous on both
    sides). PyTorch's generic strided copy computes an address per element, so a bf16 copy moves 2 bytes per
    index calculation: on an H100 the query's send copy at 16K rows x 32 heads x 128 took 176 us (1.5 TB/s)
    and the output's return copy as long, a sixth of a Ulysses rank's forward on packed 128K rows (emulated
    W = 8, ``benchmarks/gpu/probe_host.py``). Where every stride and address is 16-byte aligned (a head of 8+
    half-precision elements) the copy runs on ``complex128`` views of the same bytes: 16 bytes per element,
    the same bits moved. Under ``torch.compile`` the plain copy is traced (the compiler fuses it anyway).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from ..errors import rank_suffix
from . import link as _link
from .symmetric import Pulls

__all__ = ["HeadSlots", "Pending", "contiguous", "heads_to_seq", "pack_qkv", "packed_qkv_shape",
           "post_grads_heads_to_seq", "post_heads_to_seq", "post_heads_to_seq_raw", "post_packed_qkv",
           "post_qkv_seq_to_heads", "post_seq_to_heads", "qkv_seq_to_heads", "seq_to_heads", "unpack_heads"]

T = TypeVar("T")


@dataclass(frozen=True)
class HeadSlots:
    """How H query heads and Hkv KV heads split over U ranks (Note [GQA head slots])."""

    heads: int
    kv_heads: int
    degree: int

    def __post_init__(self) -> None:
        if not self.is_valid(self.heads, self.kv_heads, self.degree):
            raise ValueError(f"no head slots for heads={self.heads}, kv_heads={self.kv_heads} over "
                             f"{self.degree} ranks (valid degrees: {self.valid_degrees(self.heads, self.kv_heads)})"
                             f"{rank_suffix()}")

    @staticmethod
    def is_valid(heads: int, kv_heads: int, degree: int) -> bool:
        return (degree >= 1 and heads % degree == 0 and heads % kv_heads == 0
                and (kv_heads % degree == 0 or degree % kv_heads == 0))

    @staticmethod
    def valid_degrees(heads: int, kv_heads: int) -> list[int]:
        """Every degree U the slot scheme serves: U divides H, and U divides Hkv or Hkv divides U."""
        return [d for d in range(1, heads + 1) if HeadSlots.is_valid(heads, kv_heads, d)]

    @property
    def q_per_rank(self) -> int:
        return self.heads // self.degree

    @property
    def kv_per_rank(self) -> int:
        """KV heads in one destination's slot."""
        return max(self.kv_heads // self.degree, 1)

    @property
    def replicas(self) -> int:
        """Destinations each KV head goes to (1 unless Hkv < U)."""
        return max(self.degree // self.kv_heads, 1)


class Pending(Generic[T]):
    """A posted all-to-all. ``wait()`` completes it (a stream dependency on NCCL, a blocking wait on gloo)
    and returns the unpacked result, also kept as ``result``; the buffers stay referenced until then.
    ``wait()`` is idempotent (a schedule's fault handling may complete it again)."""

    _UNSET = object()

    def __init__(self, work: Any, finish: Callable[[], T], keep: tuple[torch.Tensor, ...] = ()):
        self._work, self._finish, self._keep = work, finish, keep
        self._result: Any = Pending._UNSET

    def wait(self) -> T:
        if self._result is Pending._UNSET:
            if self._work is not None:
                self._work.wait()
            self._work, self._keep = None, ()
            self._result = self._finish()
        return self._result

    @property
    def result(self) -> T:
        """The unpacked result (after ``wait``)."""
        return self.wait()

    @staticmethod
    def done(value: T) -> Pending[T]:
        return Pending(None, lambda: value)


@functools.lru_cache(maxsize=512)
def _wide_layout(strides: tuple[int, ...], last: int, n: int) -> bool:
    """Whether a tensor of these strides, last dim and element size can be viewed with 16-byte elements (a call's
    views recur call after call: decided once per layout)."""
    return strides[-1] == 1 and (last * n) % 16 == 0 and all((st * n) % 16 == 0 for st in strides[:-1])


def _wide(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` viewed with 16-byte elements (its last dim contiguous, every stride and address 16-byte aligned), or
    None. Note [Wide copies]."""
    if (x.dim() == 0 or x.is_complex() or x.data_ptr() % 16 or torch.compiler.is_compiling()
            or not _wide_layout(x.stride(), x.shape[-1], x.element_size())):
        return None
    return x.view(torch.complex128)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` (src broadcast to dst), moving 16 bytes per element where both allow (Note [Wide
    copies])."""
    wd, ws = (_wide(dst), _wide(src)) if dst.dtype == src.dtype else (None, None)
    if wd is not None and ws is not None:
        wd.copy_(ws)
    else:
        dst.copy_(src)
    return dst


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()`` through ``_copy`` (Note [Wide copies]): ``x`` itself when already contiguous."""
    return x if x.is_contiguous() else _copy(torch.empty(x.shape, dtype=x.dtype, device=x.device), x)


def _size(group: dist.ProcessGroup | Pulls | None) -> int:
    return group.size() if isinstance(group, Pulls) else dist.get_world_size(group)


def _empty(group: dist.ProcessGroup | Pulls | None, shape: Sequence[int], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """A send buffer: on copy engines, a region of the group's lane (Note [Copy-engine all-to-all])."""
    if isinstance(group, Pulls):
        return group.empty(tuple(shape), dtype)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _send(view: torch.Tensor, group: dist.ProcessGroup | Pulls | None) -> torch.Tensor:
    """``view`` as a contiguous send buffer (``view`` itself where it is one and no lane needs it)."""
    if isinstance(group, Pulls):
        return _copy(group.empty(tuple(view.shape), view.dtype), view)
    return contiguous(view)


def _check_split(x: torch.Tensor, dim: int, U: int, what: str) -> None:
    if x.shape[dim] % U:
        raise ValueError(f"{what} (dim {dim} of shape {tuple(x.shape)}) must be divisible by the group size {U}, "
                         f"got {x.shape[dim]}{rank_suffix()}")


def _post(send: torch.Tensor, group: dist.ProcessGroup | Pulls | None) -> tuple[Any, torch.Tensor]:
    if isinstance(group, Pulls):
        return group.post(send)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(*_link.wire(group, recv, send), group=group, async_op=True)
    if _link.installed() is not None:                   # Note [Modelled link]: the bytes bound for other ranks
        U = _size(group)
        work = _link.delay(work, "a2a", send.nbytes * (U - 1) / U, U, send.device)
    return work, recv


def _slots_write(send_UBLF: torch.Tensor, lo: int, t_BLKD: torch.Tensor, heads_total: int, per: int,
                 rep: int) -> int:
    """Write ``t (B, L, Hx, d)`` into feature columns from ``lo``: destination u gets heads ``[j per, (j+1) per)``
    with ``j = u // rep`` (replicated on the wire only, from a broadcast view); returns the next column."""
    d = t_BLKD.shape[-1]
    dst = send_UBLF[..., lo:lo + per * d].unflatten(-1, (per, d)).unflatten(0, (heads_total // per, rep))
    _copy(dst, t_BLKD.unflatten(2, (heads_total // per, per)).movedim(2, 0).unsqueeze(1))
    return lo + per * d


def post_qkv_seq_to_heads(q_BLHD: torch.Tensor, k_BLKD: torch.Tensor, v_BLKD: torch.Tensor,
                          group: dist.ProcessGroup | None) -> Pending[tuple[torch.Tensor, ...]]:
    """Post the packed q/k/v move to head-sharded (Note [Ulysses all-to-all], Note [GQA head slots]).

    Args:
        q_BLHD: ``(B, L, H, D)`` this rank's rows, all query heads.
        k_BLKD: ``(B, L, Hkv, D)``; v_BLKD: ``(B, L, Hkv, Dv)``; same dtype and device.
        group: the Ulysses group (U ranks, in sequence-piece order).

    Returns:
        Pending ``(q (B, U L, H/U, D), k (B, U L, Hkv_slot, D), v (B, U L, Hkv_slot, Dv))``, each contiguous.
    """
    if _size(group) == 1:
        return Pending.done((q_BLHD, k_BLKD, v_BLKD))
    return post_packed_qkv(pack_qkv(q_BLHD, k_BLKD, v_BLKD, group), q_BLHD.shape[2], k_BLKD.shape[2],
                           D=q_BLHD.shape[-1], group=group)


def packed_qkv_shape(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], U: int
                     ) -> tuple[int, int, int, int]:
    """``(U, B, L, F)``: the send buffer of ``pack_qkv`` for these local shapes over U ranks."""
    B, L, H, D = q_shape
    slots = HeadSlots(H, k_shape[2], U)
    return U, B, L, slots.q_per_rank * D + slots.kv_per_rank * (k_shape[-1] + v_shape[-1])


def pack_qkv(q_BLHD: torch.Tensor, k_BLKD: torch.Tensor, v_BLKD: torch.Tensor, group: dist.ProcessGroup | None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The send buffer of ``post_qkv_seq_to_heads`` (U > 1): every destination's query and KV heads side by side,
    written into ``out`` (``packed_qkv_shape``) where given (Note [Staged calls] in ``seqpar.runtime.graphs``)."""
    U = _size(group)
    H, Hkv = q_BLHD.shape[2], k_BLKD.shape[2]
    slots = HeadSlots(H, Hkv, U)
    hq, hk, rep = slots.q_per_rank, slots.kv_per_rank, slots.replicas
    send_UBLF = out if out is not None else _empty(group, packed_qkv_shape(q_BLHD.shape, k_BLKD.shape, v_BLKD.shape, U),
                                                    q_BLHD.dtype, q_BLHD.device)
    at = _slots_write(send_UBLF, 0, q_BLHD, H, hq, 1)
    at = _slots_write(send_UBLF, at, k_BLKD, Hkv, hk, rep)
    _slots_write(send_UBLF, at, v_BLKD, Hkv, hk, rep)
    return send_UBLF


def post_packed_qkv(send_UBLF: torch.Tensor, heads: int, kv_heads: int, *, D: int,
                    group: dist.ProcessGroup | None) -> Pending[tuple[torch.Tensor, ...]]:
    """Post ``pack_qkv``'s buffer (``heads`` / ``kv_heads`` globally, head dim ``D``): Pending ``(q, k, v)``
    head-sharded, as ``post_qkv_seq_to_heads`` returns them."""
    U, B, L, F = send_UBLF.shape
    slots = HeadSlots(heads, kv_heads, U)
    hq, hk = slots.q_per_rank, slots.kv_per_rank
    Dv = (F - hq * D) // hk - D
    work, recv_UBLF = _post(send_UBLF, group)

    def finish() -> tuple[torch.Tensor, ...]:
        def rows(lo: int, n: int, d: int) -> torch.Tensor:   # (U, B, L, n d) -> (B, U L, n, d), source-major rows
            return recv_UBLF[..., lo:lo + n * d].unflatten(-1, (n, d)).movedim(0, 1).reshape(B, U * L, n, d)
        return rows(0, hq, D), rows(hq * D, hk, D), rows(hq * D + hk * D, hk, Dv)

    return Pending(work, finish, (send_UBLF, recv_UBLF))


def post_grads_heads_to_seq(dq_BSHD: torch.Tensor, dk_BSKD: torch.Tensor, dv_BSKD: torch.Tensor, kv_heads: int,
                            group: dist.ProcessGroup | None, wire_dtype: torch.dtype
                            ) -> Pending[tuple[torch.Tensor, ...]]:
    """Post the adjoint of ``post_qkv_seq_to_heads``: head-sharded gradients back to sequence-sharded.

    Args:
        dq_BSHD: ``(B, U L, H/U, D)``; dk_BSKD: ``(B, U L, Hkv_slot, D)``; dv_BSKD: ``(B, U L, Hkv_slot, Dv)``.
        kv_heads: the global KV head count Hkv.
        group: the Ulysses group.
        wire_dtype: dtype of the send buffer.

    Returns:
        Pending ``(dq (B, L, H, D), dk (B, L, Hkv, D), dv (B, L, Hkv, Dv))``: dq in ``wire_dtype``; dk/dv in
        ``wire_dtype`` without replication, else replica sums in fp32 (fp64 for an fp64 wire).
    """
    U = _size(group)
    if U == 1:
        return Pending.done((dq_BSHD, dk_BSKD, dv_BSKD))
    B, S, hq, D = dq_BSHD.shape
    hk, L, Dv = dk_BSKD.shape[2], S // U, dv_BSKD.shape[-1]
    rep = U * hk // kv_heads
    send_UBLF = _empty(group, (U, B, L, hq * D + hk * (D + Dv)), wire_dtype, dq_BSHD.device)
    at = 0
    for t_BShd in (dq_BSHD, dk_BSKD, dv_BSKD):
        n, d = t_BShd.shape[2], t_BShd.shape[3]
        _copy(send_UBLF[..., at:at + n * d].unflatten(-1, (n, d)), t_BShd.unflatten(1, (U, L)).movedim(1, 0))
        at += n * d
    work, recv_UBLF = _post(send_UBLF, group)
    acc = torch.float64 if wire_dtype == torch.float64 else torch.float32

    def finish() -> tuple[torch.Tensor, ...]:
        dq = contiguous(recv_UBLF[..., : hq * D].unflatten(-1, (hq, D)).movedim(0, 2)).reshape(B, L, U * hq, D)
        out = [dq]
        for lo, d in ((hq * D, D), (hq * D + hk * D, Dv)):
            part = recv_UBLF[..., lo:lo + hk * d].unflatten(-1, (hk, d)).unflatten(0, (kv_heads // hk, rep))
            part = part.sum(1, dtype=acc) if rep > 1 else part.squeeze(1)         # adjoint of replication
            out.append(contiguous(part.movedim(0, 2)).reshape(B, L, kv_heads, d))
        return tuple(out)

    return Pending(work, finish, (send_UBLF, recv_UBLF))


def post_seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None, *, seq_dim: int = 1,
                      head_dim: int = 2) -> Pending[torch.Tensor]:
    """Post one tensor's move from sequence-sharded to head-sharded (Note [Ulysses all-to-all]).

    ``x`` has L rows at ``seq_dim`` and H heads at ``head_dim`` (e.g. dO ``(B, L, H, D)`` with the defaults,
    dlse ``(B, H, L)`` with ``seq_dim=2, head_dim=1``); the result has ``U L`` rows and ``H/U`` heads there.
    """
    U = _size(group)
    if U == 1:
        return Pending.done(x)
    _check_split(x, head_dim, U, "heads")
    send = _send(x.unflatten(head_dim, (U, x.shape[head_dim] // U)).movedim(head_dim, 0), group)
    work, recv = _post(send, group)             # recv[u'] = source u''s rows; seq dim sits at seq_dim + 1

    def finish() -> torch.Tensor:
        return contiguous(recv.movedim(0, seq_dim)).flatten(seq_dim, seq_dim + 1)

    return Pending(work, finish, (send, recv))


def post_heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None, *, seq_dim: int = 1,
                      head_dim: int = 2) -> Pending[torch.Tensor]:
    """Post the inverse of ``post_seq_to_heads``: ``U L`` rows and ``H/U`` heads -> L rows and H heads."""
    if _size(group) == 1:
        return Pending.done(x)
    work, send, recv = _post_heads(x, group, seq_dim)
    return Pending(work, lambda: contiguous(recv.movedim(0, head_dim)).flatten(head_dim, head_dim + 1), (send, recv))


def post_heads_to_seq_raw(x: torch.Tensor, group: dist.ProcessGroup | None, *, seq_dim: int = 1
                          ) -> Pending[torch.Tensor]:
    """``post_heads_to_seq`` (U > 1) up to its receive buffer ``(U, ...)``, source-major, which ``unpack_heads`` lays
    out (Note [Staged calls] in ``seqpar.runtime.graphs``)."""
    work, send, recv = _post_heads(x, group, seq_dim)
    return Pending(work, lambda: recv, (send, recv))


def _post_heads(x: torch.Tensor, group: dist.ProcessGroup | None, seq_dim: int) -> tuple[Any, torch.Tensor,
                                                                                          torch.Tensor]:
    U = _size(group)
    _check_split(x, seq_dim, U, "sequence length")
    send = _send(x.unflatten(seq_dim, (U, x.shape[seq_dim] // U)).movedim(seq_dim, 0), group)
    work, recv = _post(send, group)             # recv[u'] = my rows of source u''s heads
    return work, send, recv


def unpack_heads(recv: torch.Tensor, *, head_dim: int = 2) -> torch.Tensor:
    """A ``post_heads_to_seq_raw`` receive buffer as L rows and H heads, always a new tensor (the buffer may be a
    graph's, which its next replay overwrites)."""
    return _copy(torch.empty(recv.movedim(0, head_dim).shape, dtype=recv.dtype, device=recv.device),
                 recv.movedim(0, head_dim)).flatten(head_dim, head_dim + 1)


class _QKVSeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, grad_dtype):
        ctx.group, ctx.grad_dtype, ctx.kv_heads = group, grad_dtype, k.shape[2]
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return post_qkv_seq_to_heads(q, k, v, group).wait()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        U = _size(ctx.group)
        rep = HeadSlots(dq.shape[2] * U, ctx.kv_heads, U).replicas
        acc = torch.float64 if ctx.dtypes[0] == torch.float64 else torch.float32
        wire = ctx.dtypes[0] if rep == 1 else (acc if ctx.grad_dtype == torch.float32 else ctx.grad_dtype)
        grads = post_grads_heads_to_seq(dq, dk, dv, ctx.kv_heads, ctx.group, wire).wait()
        return (*(g.to(dt) for g, dt in zip(grads, ctx.dtypes)), None, None)


class _Redistribute(torch.autograd.Function):
    """``post_seq_to_heads`` (``to_heads``) or ``post_heads_to_seq``; the backward is the other one (adjoints)."""

    @staticmethod
    def forward(ctx, x, group, seq_dim, head_dim, to_heads):
        ctx.args = (group, seq_dim, head_dim, to_heads)
        post = post_seq_to_heads if to_heads else post_heads_to_seq
        return post(x, group, seq_dim=seq_dim, head_dim=head_dim).wait()

    @staticmethod
    def backward(ctx, g):
        group, seq_dim, head_dim, to_heads = ctx.args
        post = post_heads_to_seq if to_heads else post_seq_to_heads
        return post(g, group, seq_dim=seq_dim, head_dim=head_dim).wait(), None, None, None, None


def qkv_seq_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None,
                     *, grad_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable packed move of ``q (B, L, H, D)``, ``k, v (B, L, Hkv, D)`` to head-sharded.

    Returns ``(B, U L, H/U, D)`` and ``(B, U L, Hkv_slot, D)`` (Note [GQA head slots]). The backward moves the
    gradients back in one collective; replicated KV heads' partials travel in ``grad_dtype`` and are summed.
    Raises ValueError when (H, Hkv, U) has no head slots.
    """
    return _QKVSeqToHeads.apply(q, k, v, group, grad_dtype)


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None = None, *, seq_dim: int = 1,
                 head_dim: int = 2) -> torch.Tensor:
    """Differentiable ``post_seq_to_heads``: L rows x H heads -> U L rows x H/U heads."""
    return _Redistribute.apply(x, group, seq_dim, head_dim, True)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None = None, *, seq_dim: int = 1,
                 head_dim: int = 2) -> torch.Tensor:
    """Differentiable ``post_heads_to_seq``: U L rows x H/U heads -> L rows x H heads."""
    return _Redistribute.apply(x, group, seq_dim, head_dim, False)
