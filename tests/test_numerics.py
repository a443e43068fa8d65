"""The numerics helpers' rounding: the sinks' rescale rounds once, and stays differentiable where autograd records."""

from __future__ import annotations

import torch

from seqpar.numerics import apply_sinks
from seqpar.tolerances import judge


def _rows(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(2, 7, 3, 5, generator=g).to(dtype)
    lse = torch.randn(2, 3, 7, generator=g)
    lse[0, 1, 2] = float("-inf")                         # a row that saw no key: zeros out, L = the sink
    sinks = torch.randn(3, generator=g)
    return out, lse, sinks


def test_sink_rescale_rounds_once():
    """The factor multiplies in lse's dtype and the product is rounded once into out's: bit-equal to the fp32
    product rounded, never the product of a factor rounded to bf16 first (Note [Attention sinks])."""
    out, lse, sinks = _rows()
    got, total = apply_sinks(out, lse, sinks)
    scale = torch.exp(lse - torch.logaddexp(lse, sinks.view(1, -1, 1))).nan_to_num(0.0)
    want = (out.float() * scale.transpose(1, 2).unsqueeze(-1)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(total, torch.logaddexp(lse, sinks.view(1, -1, 1)))
    exact = out.double() * scale.double().transpose(1, 2).unsqueeze(-1)
    ulp = torch.finfo(torch.bfloat16).eps
    assert ((got.double() - exact).abs() <= exact.abs() * ulp / 2 + 1e-30).all()     # one rounding: half an ulp


def test_sink_rescale_is_differentiable_when_recorded():
    """A sinks parameter that requires grad, under grad mode (an HF model's sinks in eval without no_grad):
    the same values, and the gradient reaches the sinks."""
    out, lse, sinks = _rows(torch.float32, seed=1)
    with torch.no_grad():
        plain, _ = apply_sinks(out, lse, sinks)
    s = sinks.clone().requires_grad_()
    got, total = apply_sinks(out, lse, s)
    assert torch.equal(got, plain) and got.requires_grad
    (g,) = torch.autograd.grad(got.sum() + total[torch.isfinite(total)].sum(), s)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_a_sum_is_judged_against_its_terms():
    """``judge(..., scale=)``: a sum whose terms cancel is judged against the terms' magnitude (never below its
    own): 1e-6 off a sum of 0.01 whose terms reach 1 is fp32 noise, not a 1e-4 error."""
    truth, got = torch.tensor([0.01], dtype=torch.float64), torch.tensor([0.01 + 1e-6], dtype=torch.float64)
    assert not judge("dsinks", got, truth, None, "float32").ok
    assert judge("dsinks", got, truth, None, "float32", scale=1.0).ok
    assert judge("dsinks", got, truth, None, "float32", scale=1e-9).error == judge("dsinks", got, truth, None,
                                                                                    "float32").error
