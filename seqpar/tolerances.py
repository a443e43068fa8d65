"""How close is close enough: the flash-attn rule, not hand-tuned numbers.

Error is the normalised max error ``max |got - truth| / max |truth|`` against the fp64 oracle.

* fp64 inputs: at most 1e-10.
* fp32 inputs: at most 1e-5 (our kernels accumulate in fp32; the oracle is fp64).
* bf16 / fp16 inputs: at most twice the error of a single-device computation in the same dtype (the dense
  computation with every op in that dtype), plus a floor of 1e-5 - flash-attn's test rule, with the floor
  of the fp32 rule: kernels accumulate in fp32, so a low-precision run cannot be held closer to the truth
  than an fp32 run where the single-device computation happens to be exact (a gradient that is exactly
  zero, e.g. a query that sees only itself, comes out as fp32 rounding noise of ~1e-6).

The sinks' gradient is one sum per head over every row of the batch, ``-sum_i P_sink,i Delta_i``, whose terms
have both signs: where they cancel, the sum keeps no relative accuracy (a sum's forward error is bounded in its
terms' magnitudes, not its own). And each term's ``Delta_i = O_i . dO_i - dlse_i`` is itself a difference, rounded
like its parts. So its error is normalised by ``max_h sum_i P_sink,i (sum_d |O_id dO_id| + |dlse_i|)`` (the oracle's
``dsinks_terms``), which is never below ``max |dsinks|``: found by the fuzz (2026-11-27), an fp32 sum over 12 rows of
one head read 1.15e-5 against its own magnitude, every other field ~1e-7; and a row whose ``Delta`` cancelled
335-fold (0.32633 - 0.32730, twenty-third session) read 1.13e-5 against the terms' net magnitude, 9e-9 against their
parts'.

Where the rule is tight: a distributed result in low precision is a sum of partials each rounded to the input
dtype by its kernel (a pass-KV rank's dq over its steps, dK/dV summed at their owner, a merged out; the sinks'
rescale adds one rounding to out), so it carries up to W roundings where the single device has one. And the
backward takes ``Delta = rowsum(dO O)`` from the rounded O, as FA2's does: on a row whose attention sits on one
key (a window of 0, one valid token, with sinks taking the rest) ``dP - Delta`` cancels and the rounding of O is
amplified, where the single-device computation differentiates its softmax directly. On tiny shapes whose
single-device error is itself a fraction of one rounding the ratio can pass 2: the long fuzz runs of 2026-11-27
(``benchmarks/results/fuzz-2026-11-27*.txt``) had 10 such examples of 11200, at most 5.1x (the second class),
all bf16 or fp16 at 3-24 tokens, each exact in fp32. The rule is kept: an allowance of W roundings would also pass a
merge done in the input dtype instead of fp32, the regression it exists to catch; CI's fixed sample passes it.

lse must have -inf exactly where the oracle does (rows that see nothing) and is compared on finite
entries; out and the gradients must be finite everywhere (fully masked rows give zeros, not NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FIELDS", "Verdict", "judge", "rel_error"]

FIELDS = ("out", "lse", "dq", "dk", "dv")
_ABS = {"float64": 1e-10, "float32": 1e-5}
_FLOOR = 1e-5


def rel_error(got: torch.Tensor, truth: torch.Tensor, scale: float | None = None) -> float:
    """``max |got - truth| / max |truth|`` over finite truth entries (absolute when truth is all zero);
    ``scale``: the normaliser instead of ``max |truth|`` (a sum's terms' magnitude)."""
    finite = torch.isfinite(truth)
    g, t = got.double()[finite], truth.double()[finite]
    if t.numel() == 0:
        return 0.0
    scale = t.abs().max().item() if scale is None else max(scale, t.abs().max().item())
    return (g - t).abs().max().item() / (scale if scale > 0 else 1.0)


@dataclass
class Verdict:
    error: float
    limit: float
    baseline: float | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.note and self.error <= self.limit

    def __str__(self) -> str:
        base = f" (single-device {self.baseline:.2e})" if self.baseline is not None else ""
        return f"error {self.error:.2e} limit {self.limit:.2e}{base}{' ' + self.note if self.note else ''}"


def judge(name: str, got: torch.Tensor, truth: torch.Tensor, baseline: torch.Tensor | None, dtype: str,
          scale: float | None = None) -> Verdict:
    """The verdict for one field; ``baseline`` is the same-dtype single-device result (low precision); ``scale``
    normalises the errors instead of ``max |truth|`` (``rel_error``)."""
    note = ""
    if name == "lse":
        if not torch.equal(torch.isneginf(got), torch.isneginf(truth)):
            note = "lse is -inf on different rows than the oracle"
        if torch.isnan(got).any() or torch.isposinf(got).any():
            note = "lse has NaN or +inf"
    elif not torch.isfinite(got).all():
        note = f"{name} has NaN or inf"
    err = rel_error(got, truth, scale)
    if baseline is None:
        return Verdict(err, _ABS.get(dtype, 1e-5), None, note)
    base_err = rel_error(baseline, truth, scale)
    return Verdict(err, 2.0 * base_err + _FLOOR, base_err, note)
