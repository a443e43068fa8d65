"""The Triton kernel of ``combine`` (Note [One merge per call]): imported only on CUDA with Triton installed.

One program takes ``BLOCK_R`` rows of one (batch, head) of a piece and reads every partial's rows through the
address table ``tab (n, 8)``: ``[out address, stride b, stride s, stride h, lse address, stride b, stride h,
stride s]`` (strides in elements; the last dim contiguous). Weighted: the max of the partials' lse, then one
pass of ``exp(lse_i - max) o_i`` in fp32 registers (the first partial may have its own dtype: an fp32
accumulator folded with bf16 partials), the result divided by the weights' sum and stored once in
the output dtype, with ``lse = max + log(sum)``; a row no partial saw gives (0, -inf). Unweighted: the fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["launch"]

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _lse(tab, i, b, h, r, rmask):
    la = tl.load(tab + i * 8 + 4).to(tl.pointer_type(tl.float32))
    lp = la + b * tl.load(tab + i * 8 + 5) + h * tl.load(tab + i * 8 + 6) + r * tl.load(tab + i * 8 + 7)
    return tl.load(lp, mask=rmask, other=float("-inf"))


@triton.jit
def _rows(tab, i, b, h, r, d, m2, DT: tl.constexpr):
    op = tl.load(tab + i * 8).to(tl.pointer_type(DT)) + b * tl.load(tab + i * 8 + 1) + h * tl.load(tab + i * 8 + 3)
    return tl.load(op + r[:, None] * tl.load(tab + i * 8 + 2) + d[None, :], mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _combine(tab, n, out_ptr, out_sb, out_sr, out_sh, lse_ptr, lse_sb, lse_sh, lse_sr, R, H,
             D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, DT0: tl.constexpr, DT: tl.constexpr,
             WEIGHTED: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    rmask = r < R
    m2 = rmask[:, None] & (d < D)[None, :]
    if WEIGHTED:
        m = _lse(tab, 0, b, h, r, rmask)
        for i in range(1, n):
            m = tl.maximum(m, _lse(tab, i, b, h, r, rmask))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(_lse(tab, 0, b, h, r, rmask) - m_safe)                 # a -inf row: weight 0
        s = w
        acc = _rows(tab, 0, b, h, r, d, m2, DT0) * w[:, None]
        for i in range(1, n):
            w = tl.exp(_lse(tab, i, b, h, r, rmask) - m_safe)
            s += w
            acc += _rows(tab, i, b, h, r, d, m2, DT) * w[:, None]
        seen = s > 0
        acc = acc * tl.where(seen, 1.0 / tl.where(seen, s, 1.0), 0.0)[:, None]
        lse = tl.where(seen, m_safe + tl.log(tl.where(seen, s, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * lse_sb + h * lse_sh + r * lse_sr, lse, mask=rmask)
    else:
        acc = _rows(tab, 0, b, h, r, d, m2, DT0)
        for i in range(1, n):
            acc += _rows(tab, i, b, h, r, d, m2, DT)
    tl.store(out_ptr + b * out_sb + h * out_sh + r[:, None] * out_sr + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m2)


def launch(table: torch.Tensor, n: int, out_BSHD: torch.Tensor, lse_BHS: torch.Tensor | None,
           dtypes: tuple[torch.dtype, torch.dtype], weighted: bool) -> None:
    """Run the kernel over a piece: ``out (B, R, H, D)`` (and ``lse (B, H, R)`` when weighted); ``dtypes``: the
    first partial's and the others'."""
    B, R, H, D = out_BSHD.shape
    block_d = triton.next_power_of_2(D)
    block_r = max(8, min(64, 8192 // block_d))
    lse = lse_BHS if lse_BHS is not None else out_BSHD                  # unused when unweighted
    ls = lse_BHS.stride() if lse_BHS is not None else (0, 0, 0)
    grid = (triton.cdiv(R, block_r), B * H)
    _combine[grid](table, n, out_BSHD, out_BSHD.stride(0), out_BSHD.stride(1), out_BSHD.stride(2),
                   lse, ls[0], ls[1], ls[2], R, H, D=D, BLOCK_R=block_r, BLOCK_D=block_d, DT0=_TL[dtypes[0]],
                   DT=_TL[dtypes[1]],
                   WEIGHTED=weighted, num_warps=4)
