"""The work of every query under a rule with a named mask, as affine pieces: what ``balanced`` balances.

Without a mask, a token at offset p of its document sees p + 1 keys (causal). Under a named mask
(Note [Masks as pieces] in ``seqpar.masks.named``) the count of keys query p sees is a sum over the key pieces
of its document of interval lengths ``|[max(start, p + lo), min(end - 1, p + hi)]|``, each a clamped linear
function of p. Between the points where a clamp changes, the sum is affine: ``work(p) = c + slope * (p - s)``.
``affine_pieces`` cuts every document at those points and returns ``(start, length, c, slope)`` pieces, which
the balancer treats like documents (Note [Balanced layout]: its zigzag split and its head-and-tail cuts keep a
piece's average work for any affine work, not only for the causal ramp).
Cost: O(P_q * P_k) relation lookups for P_q query pieces and P_k key pieces per document (one for masks that
relate a piece only to itself), and O(1) per breakpoint.
"""

from __future__ import annotations

import itertools

from .blocks import Rule

__all__ = ["affine_pieces"]

Piece = tuple[int, int, int, int]        # (global start, length, work of the first query, work step per query)


def _count(p: int, spans: list[tuple[int, int, int | None, int | None]]) -> int:
    total = 0
    for ks, ke, lo, hi in spans:
        first = ks if lo is None else max(ks, p + lo)
        last = ke - 1 if hi is None else min(ke - 1, p + hi)
        total += max(0, last - first + 1)
    return total


def _pieces_of(a: int, b: int, mask) -> list[tuple[int, int, int]]:
    """``(start, end, piece)`` of the mask's pieces inside ``[a, b)``."""
    out, p = [], a
    while p < b:
        e = min(b, mask.piece_end(p))
        out.append((p, e, mask.piece(p)))
        p = e
    return out


def affine_pieces(bounds: tuple[int, ...], rule: Rule) -> tuple[Piece, ...]:
    """Every document of ``bounds`` cut into pieces of affine work under ``rule`` (module docstring)."""
    mask = rule.pieces
    lo_r, hi_r = rule.delta_bounds()
    out: list[Piece] = []
    for a, b in itertools.pairwise(bounds):
        if a == b:
            continue
        first = len(out)                    # pieces merge only within a document
        if mask is None:
            parts = [(a, b, 0)]
        else:
            parts = _pieces_of(a, b, mask)
        for qs, qe, qp in parts:
            spans = []
            for ks, ke, kp in parts:
                rel = (None, None) if mask is None else mask.relation(qp, kp)
                if rel is None:
                    continue
                lo = rel[0] if lo_r is None else lo_r if rel[0] is None else max(rel[0], lo_r)
                hi = rel[1] if hi_r is None else hi_r if rel[1] is None else min(rel[1], hi_r)
                spans.append((ks, ke, lo, hi))
            cuts = {qs, qe}
            for ks, ke, lo, hi in spans:     # where p + lo or p + hi crosses a key piece's ends
                edges = ((ks, ke) if lo is None else (ks - lo, ke - lo)) + (() if hi is None else (ks - hi, ke - hi))
                for edge in edges:
                    for x in (edge - 1, edge, edge + 1):
                        if qs < x < qe:
                            cuts.add(x)
            pts = sorted(cuts)
            for s, e in itertools.pairwise(pts):
                c = _count(s, spans)
                slope = _count(s + 1, spans) - c if e - s > 1 else 0
                if len(out) > first and out[-1][0] + out[-1][1] == s and out[-1][3] == slope \
                        and out[-1][2] + slope * out[-1][1] == c:
                    out[-1] = (out[-1][0], out[-1][1] + e - s, out[-1][2], slope)     # one affine stretch
                else:
                    out.append((s, e - s, c, slope))
    return tuple(out)
