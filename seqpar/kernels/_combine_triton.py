"""The Triton kernel of ``combine`` (Note [One merge per call], Note [Covered rows]): imported only on CUDA with
Triton installed.

One launch covers every row of the result. Program ``(j, b * H + h)`` takes the ``BLOCK_R`` rows of block j of one
(batch, head) and reads the spans its block list names (``offsets``/``entries``, CSR). A span is one row of the
table ``tab (n, 12)``: ``[out address, stride b, stride s, stride h, lse address, stride b, stride h, stride s,
first row, end row, the partial's row 0, fp32 flag]`` (strides in elements, the last dim contiguous): the
partial's rows ``[first, end)`` of the local rows, the partial starting at local row ``row 0``; its rows outside
the span are not read. Weighted: the max of the spans' lse, then one pass of ``exp(lse_i - max) o_i`` in fp32
registers (an fp32 span, flag 1, is read as fp32: an accumulator folded with partials of another dtype), the
result divided by the weights' sum and stored once in the output dtype, with ``lse = max + log(sum)``; a row no
span covers gives (0, -inf). Unweighted: the fp32 sum (0 where no span covers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["TABLE_WIDTH", "block_rows", "launch"]

TABLE_WIDTH = 12
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _span_rows(tab, e, r, rmask):
    """The mask of block rows ``r`` inside span ``e``, and their rows in the span's partial."""
    lo = tl.load(tab + e * 12 + 8)
    hi = tl.load(tab + e * 12 + 9)
    return rmask & (r >= lo) & (r < hi), r - tl.load(tab + e * 12 + 10)


@triton.jit
def _lse(tab, e, b, h, r, rmask):
    m, pr = _span_rows(tab, e, r, rmask)
    la = tl.load(tab + e * 12 + 4).to(tl.pointer_type(tl.float32))
    lp = la + b * tl.load(tab + e * 12 + 5) + h * tl.load(tab + e * 12 + 6) + pr * tl.load(tab + e * 12 + 7)
    return tl.load(lp, mask=m, other=float("-inf"))


@triton.jit
def _rows(tab, e, b, h, r, rmask, d, dmask, DT: tl.constexpr):
    m, pr = _span_rows(tab, e, r, rmask)
    m2 = m[:, None] & dmask[None, :]
    off = b * tl.load(tab + e * 12 + 1) + h * tl.load(tab + e * 12 + 3) + pr[:, None] * tl.load(tab + e * 12 + 2)
    if tl.load(tab + e * 12 + 11) != 0:
        x = tl.load(tl.load(tab + e * 12).to(tl.pointer_type(tl.float32)) + off + d[None, :], mask=m2, other=0.0)
    else:
        x = tl.load(tl.load(tab + e * 12).to(tl.pointer_type(DT)) + off + d[None, :], mask=m2,
                    other=0.0).to(tl.float32)
    return x


@triton.jit
def _combine(tab, offs, ents, out_ptr, out_sb, out_sr, out_sh, lse_ptr, lse_sb, lse_sh, lse_sr, R, H,
             D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr,
             WEIGHTED: tl.constexpr):
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    r = (j * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    rmask = r < R
    dmask = d < D
    first = tl.load(offs + j)
    last = tl.load(offs + j + 1)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    if WEIGHTED:
        m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
        for i in range(first, last):
            m = tl.maximum(m, _lse(tab, tl.load(ents + i), b, h, r, rmask))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for i in range(first, last):
            e = tl.load(ents + i)
            w = tl.exp(_lse(tab, e, b, h, r, rmask) - m_safe)                # rows outside the span: weight 0
            s += w
            acc += _rows(tab, e, b, h, r, rmask, d, dmask, DT) * w[:, None]
        seen = s > 0
        acc = acc * tl.where(seen, 1.0 / tl.where(seen, s, 1.0), 0.0)[:, None]
        lse = tl.where(seen, m_safe + tl.log(tl.where(seen, s, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * lse_sb + h * lse_sh + r * lse_sr, lse, mask=rmask)
    else:
        for i in range(first, last):
            acc += _rows(tab, tl.load(ents + i), b, h, r, rmask, d, dmask, DT)
    tl.store(out_ptr + b * out_sb + h * out_sh + r[:, None] * out_sr + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def block_rows(head_dim: int) -> int:
    """Rows per program (and per block list) for value head dim ``head_dim``."""
    return max(8, min(64, 8192 // triton.next_power_of_2(head_dim)))


def launch(table: torch.Tensor, offsets: torch.Tensor, entries: torch.Tensor, out_BSHD: torch.Tensor,
           lse_BHS: torch.Tensor | None, dtype: torch.dtype, weighted: bool, block_r: int) -> None:
    """Run the kernel: ``out (B, R, H, D)`` (and ``lse (B, H, R)`` when weighted) from the spans of ``table``;
    ``dtype``: the partials' dtype (spans flagged fp32 are read as fp32); ``block_r``: the block lists' rows."""
    B, R, H, D = out_BSHD.shape
    lse = lse_BHS if lse_BHS is not None else out_BSHD                  # unused when unweighted
    ls = lse_BHS.stride() if lse_BHS is not None else (0, 0, 0)
    grid = (triton.cdiv(R, block_r), B * H)
    _combine[grid](table, offsets, entries, out_BSHD, out_BSHD.stride(0), out_BSHD.stride(1), out_BSHD.stride(2),
                   lse, ls[0], ls[1], ls[2], R, H, D=D, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(D),
                   DT=_TL[dtype], WEIGHTED=weighted, num_warps=4)
