"""seqpar.choose_pass: the bytes-per-step rule of ALGORITHMS.md §7.1."""

from __future__ import annotations

import pytest
import torch

import seqpar


def test_mha_self_attention_prefers_pass_kv_by_the_lse_bytes():
    c = seqpar.choose_pass(batch=2, q_len=1024, heads=8, head_dim=64, backward=False)
    assert c.kv_bytes == 2 * 2 * 1024 * 8 * 64 * 2
    assert c.q_bytes == 2 * 1024 * 8 * (2 * 64 * 2 + 4)
    assert c.choice == "kv"


def test_gqa_prefers_pass_kv_and_backward_counts():
    c = seqpar.choose_pass(batch=1, q_len=4096, heads=32, kv_heads=8, head_dim=128)
    B, L, H, Hkv, D, e, eg = 1, 4096, 32, 8, 128, 2, 4
    assert c.kv_bytes == 2 * B * L * Hkv * D * e + 2 * B * L * Hkv * D * eg
    assert c.q_bytes == B * L * H * (2 * D * e + 4) + B * L * H * (2 * D * e + 8) + B * L * H * D * eg
    assert c.choice == "kv"
    no_delta = seqpar.choose_pass(batch=1, q_len=4096, heads=32, kv_heads=8, head_dim=128, send_delta=False)
    assert no_delta.q_bytes - c.q_bytes == B * L * H * (D * e - 4)


def test_few_queries_against_long_kv_prefer_pass_q():
    decode = seqpar.choose_pass(batch=1, q_len=1, kv_len=8192, heads=32, kv_heads=8, head_dim=128, backward=False)
    assert decode.choice == "q"
    # persistent-KV prefill: T new tokens against T + P cached, T / (T + P) = 0.1 < Hkv / H = 0.25
    prefill = seqpar.choose_pass(batch=1, q_len=100, kv_len=1000, heads=32, kv_heads=8, head_dim=128,
                                 dtype=torch.float16, backward=False)
    assert prefill.choice == "q"
    assert prefill.q_bytes < prefill.kv_bytes


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        seqpar.choose_pass(batch=1, q_len=8, heads=6, kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="q_len must be a positive int"):
        seqpar.choose_pass(batch=1, q_len=0, heads=4, head_dim=8)
    with pytest.raises(TypeError, match="dtype must be a floating torch"):
        seqpar.choose_pass(batch=1, q_len=8, heads=4, head_dim=8, dtype=torch.int8)
