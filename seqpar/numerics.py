"""The numeric rules every schedule follows, each written once: accumulation dtype, wire dtype, Delta, the lse
gradient, attention sinks.

    acc_dtype(x.dtype)                     fp32 (fp64 for fp64 inputs): every running sum and merge
    wire_dtype(grad_dtype, x.dtype)        gradient partials on the wire; running sums stay in acc_dtype
    GradRows(do, out, dlse)                what a kernel backward needs about the final rows: Delta, or (dO, O)
                                           with the lse gradient folded in (Note [Folding the lse gradient])
    apply_sinks / sink_grad                gpt-oss style sinks on the final rows (Note [Attention sinks])

Note [Folding the lse gradient]
    A gradient on lse adds ``dlse_i P_ij`` to ``dS_ij`` (``d lse_i / d s_ij = P_ij``), which is the ordinary
    backward with ``Delta_i = rowsum(dO_i O_i) - dlse_i``. Kernels that take Delta (reference) get it
    directly. Fused kernels (cuDNN, FA2, FA3, flex's backward kernel) recompute Delta from the O they are given
    and use O for nothing else, so we hand them ``O' = O - dlse * w / |w|^2`` and ``dO' = w``: then ``rowsum(w O') =
    rowsum(w O) - dlse`` exactly in real arithmetic. ``w = dO`` on every row whose ``|dO|`` is at least
    ``tau = max(|dlse| 2^-k, floor)``; a row with a smaller (or zero) dO gets ``w = dO + tau e_0``, which
    perturbs that row's dV and dP contribution by at most ``tau`` - far below the dtype's resolution of
    the result (k = 30 for fp32 and bf16, 60 for fp64, 12 for fp16's narrow range). ``|O' - O| <= |dlse| /
    |w| <= 2^k`` keeps O' in range. Measured on an H100 (bf16, cuDNN,
    ``benchmarks/results/2026-11-23-h100-probe``): dq/dk/dv errors against fp64 within 1.1x of the plain
    backward's, with and without zero dO rows. On CUDA the fold is one fused kernel (``torch.compile`` of the
    same function: it reads dO, O and dlse once and writes dO', O' once) instead of a second attention kernel.

Note [Attention sinks]
    A sink is one learned logit per query head that joins every row's softmax denominator (gpt-oss):
    ``L_i = logaddexp(lse_i, sink_h)`` and ``out_i = exp(lse_i - L_i) * out_i`` - a virtual key whose value is
    zero. It enters once per row, on the final merged row (never per block), so every method gets it from
    the same place: the owner of the row after its last merge. Backward needs nothing new from kernels:
    with the final ``(out, L)`` every block's gradient is exact (the virtual key contributes ``dS = -P_sink
    Delta`` to nothing but the sink), and ``d sink_h = -sum_i exp(sink_h - L_i) Delta_i`` over this rank's
    rows (a parameter gradient: the sequence-parallel gradient reduction sums it over ranks, like every other
    parameter's). The rescale multiplies in lse's dtype and rounds once into out's: a low-precision row is rounded
    twice in all (the kernel's output, then this product), where scaling by the factor rounded to bf16 first
    rounded it three times - up to 2.2x a single-device computation's error on a row that sees one key
    (found by the fuzz, 2026-11-27).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["GradRows", "acc_dtype", "apply_sinks", "delta", "sink_grad", "wire_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def wire_dtype(grad_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """Gradient partials on the wire: ``grad_dtype``, widened to fp64 for fp64 inputs when it is fp32.

    Only the bytes that travel use it: running sums stay in ``acc_dtype`` and are cast into the wire buffer.
    """
    return acc_dtype(dtype) if grad_dtype == torch.float32 else grad_dtype


def delta(do_BSHD: torch.Tensor, out_BSHD: torch.Tensor, dlse_BHS: torch.Tensor | None) -> torch.Tensor:
    """``Delta = rowsum(dO * O) - dlse`` as ``(B, H, S)`` in the accumulation dtype."""
    acc = acc_dtype(out_BSHD.dtype)
    d = (do_BSHD.to(acc) * out_BSHD.to(acc)).sum(-1).transpose(1, 2)
    return d if dlse_BHS is None else d - dlse_BHS.to(acc)


#: per dtype: (k, floor) of Note [Folding the lse gradient]; fp16's range (65504, min normal 2^-14) is the tight one
_FOLD = {torch.float16: (12, 2.0 ** -14), torch.float64: (60, 2.0 ** -900)}


def _fold(do_BSHD: torch.Tensor, out_BSHD: torch.Tensor, dlse_BHS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dO', O')`` in the input dtype with ``rowsum(dO' O') = rowsum(dO O) - dlse`` (Note above)."""
    B, S, H, Dv = do_BSHD.shape
    k, floor = _FOLD.get(out_BSHD.dtype, (30, 2.0 ** -100))
    rows = (do_BSHD.reshape(-1, Dv), out_BSHD.reshape(-1, Dv), dlse_BHS.transpose(1, 2).reshape(-1, 1))
    # inside a CUDA graph capture the plain torch form (compiling there is not capturable; Note [Graphed calls])
    fused = do_BSHD.is_cuda and not torch.cuda.is_current_stream_capturing()
    fold = _fused_fold() if fused else _fold_rows
    w, o = fold(*rows, 2.0 ** -k, floor)
    return w.view(B, S, H, Dv), o.view(B, S, H, Dv)


@functools.lru_cache(maxsize=1)
def _fused_fold():
    # default shapes: the row count turns dynamic on its second value, the head dim stays static, so the
    # reduction over a row is one persistent pass (each input read once, each output written once)
    return torch.compile(_fold_rows)


def _fold_rows(do: torch.Tensor, out: torch.Tensor, dl: torch.Tensor, rel: float, floor: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fold on ``(N, Dv)`` rows with ``dl (N, 1)``: ``tau = max(|dl| rel, floor)``, ``w = dO + tau e_0`` on
    rows with ``|dO| < tau``, ``O' = O - dl w / |w|^2`` (``|w|^2`` from ``|dO|^2``: one reduction)."""
    acc = acc_dtype(out.dtype)
    g, o, d = do.to(acc), out.to(acc), dl.to(acc)
    tau = (d.abs() * rel).clamp_min(floor)
    n2 = (g * g).sum(-1, keepdim=True)
    bump = torch.where(n2 < tau * tau, tau, torch.zeros_like(tau))
    w = g + bump * (torch.arange(g.shape[-1], device=g.device) == 0)
    ww = n2 + bump * (2 * g[:, :1] + bump)
    return w.to(do.dtype), (o - d * w / ww).to(out.dtype)


class GradRows:
    """The final rows' backward inputs, in the two forms kernels take (Note [Folding the lse gradient]).

    Args:
        do: ``(B, S, H, Dv)`` the gradient of the output rows.
        out: ``(B, S, H, Dv)`` the final output rows.
        dlse: ``(B, H, S)`` the gradient of the final lse, or None.
    """

    def __init__(self, do: torch.Tensor, out: torch.Tensor | None, dlse: torch.Tensor | None):
        self.do, self.out, self.dlse = do, out, dlse
        self._delta: torch.Tensor | None = None
        self._folded: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def given(do: torch.Tensor, *, delta: torch.Tensor | None = None,
              folded: tuple[torch.Tensor, torch.Tensor] | None = None) -> GradRows:
        """Rows that arrived in one of the two forms (pass-Q's travelling bundle): Delta, or (dO', O')."""
        rows = GradRows(do, None, None)
        rows._delta, rows._folded = delta, folded
        return rows

    @property
    def delta(self) -> torch.Tensor:
        """``rowsum(dO O) - dlse`` ``(B, H, S)``, computed once."""
        if self._delta is None:      # rows that arrived folded: rowsum(dO' O') is Delta by construction
            self._delta = delta(self.do, self.out, self.dlse) if self.out is not None else delta(*self._folded, None)
        return self._delta

    @property
    def folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dO', O')`` for kernels that recompute Delta from O; ``(dO, O)`` when there is no dlse."""
        if self._folded is None:
            assert self.out is not None, "these rows arrived as Delta: no folded pair without out"
            self._folded = (self.do, self.out) if self.dlse is None else _fold(self.do, self.out, self.dlse)
        return self._folded


def apply_sinks(out_BSHD: torch.Tensor, lse_BHS: torch.Tensor, sinks_H: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The final rows with per-head sink logits in the denominator (Note [Attention sinks]).

    Args:
        out_BSHD: merged output ``(B, S, H, Dv)`` (any float dtype).
        lse_BHS: its lse ``(B, H, S)`` (fp32/fp64; -inf on rows that saw no key).
        sinks_H: ``(H,)`` sink logits.

    Returns:
        ``(out * exp(lse - L), L)`` with ``L = logaddexp(lse, sink)``, out in its dtype.
    """
    s = sinks_H.to(device=lse_BHS.device, dtype=lse_BHS.dtype).view(1, -1, 1)
    total = torch.logaddexp(lse_BHS, s)
    scale = torch.exp(lse_BHS - total)
    if torch.is_grad_enabled() and (out_BSHD.requires_grad or scale.requires_grad):    # autograd records it:
        scale = scale.nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)                    # nothing in place, no out=
        return (out_BSHD.to(scale.dtype) * scale).to(out_BSHD.dtype), total
    scale = scale.nan_to_num_(0.0).transpose(1, 2).unsqueeze(-1)
    # computed in lse's dtype, rounded once into out's, with no out-sized copy in the wider dtype
    return torch.mul(out_BSHD, scale, out=torch.empty_like(out_BSHD)), total


def sink_grad(rows: GradRows, lse_BHS: torch.Tensor, sinks_H: torch.Tensor) -> torch.Tensor:
    """``d sink_h = -sum_{b, i} exp(sink_h - L_i) Delta_i`` over this rank's rows, in the sinks' dtype."""
    s = sinks_H.to(lse_BHS.dtype).view(1, -1, 1)
    p_sink = torch.exp(s - lse_BHS)
    return -(p_sink * rows.delta.to(lse_BHS.dtype)).sum((0, 2)).to(sinks_H.dtype)
