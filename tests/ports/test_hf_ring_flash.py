"""ring-flash-attn's HF training flow on seqpar: ``substitute_hf_flash_attn`` + ``update_ring_flash_attn_params``.

As ring-flash-attn's users train: packed documents with per-document ``position_ids``, GLOBAL ``cu_seqlens``
given to ``update_ring_flash_attn_params`` every step, ``torch.chunk`` pieces of the batch fed to the model
loaded with the ``attn_implementation`` that ``substitute_hf_flash_attn`` returns ("seqpar_ring_attn" on CPU,
where flash-attn is absent). Each rank's loss is its tokens' cross-entropy sum over the global target count
(targets shifted on the global sequence, never across documents), gradients are summed over the ranks. Against
the same model with transformers' "sdpa" on the whole batch (which reads the documents from the restarting
``position_ids``): loss, logits, every gradient at each of 3 SGD steps with new documents each step, and the
final parameters within 1e-5, at W = 2 and 4. Mistral (every layer a sliding window) shows the window is
applied in global positions. Then the misuses that must raise instead of computing something else.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from _workers_hf import VOCAB, _errors, build

import seqpar
from seqpar.testing import rel_error

TOL = 1e-5
DOCS = ((0, 5, 19, 33, 48), (0, 30, 48), (0, 48))      # per step; documents cross the rank edges at W = 2, 4


def _batch(cu: tuple[int, ...], step: int) -> dict[str, torch.Tensor]:
    """The global packed batch of one step (the same on every rank)."""
    g = torch.Generator().manual_seed(100 + step)
    S = cu[-1]
    ids = torch.randint(0, VOCAB, (1, S), generator=g)
    pos = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(cu)])[None]
    shift = torch.cat([ids[:, 1:], ids.new_full((1, 1), -100)], 1)
    for end in cu[1:-1]:
        shift[:, end - 1] = -100               # the last token of a document predicts nothing
    return {"input_ids": ids, "position_ids": pos, "shift_labels": shift}


def _loss(logits: torch.Tensor, shift: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), shift.flatten(), ignore_index=-100,
                                             reduction="sum") / count


def train(spec: dict) -> dict[str, float]:
    """3 SGD steps through ring-flash-attn's flow vs one process; the largest normalised errors."""
    world, rank = dist.get_world_size(), dist.get_rank()
    name = seqpar.substitute_hf_flash_attn(None, heads_k_stride=spec.get("stride", 1))
    ref, sp = build(spec["family"], "sdpa"), build(spec["family"], name)
    opt_ref, opt_sp = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (ref, sp))
    errors = {"loss": 0.0, "logits": 0.0}
    for step, cu in enumerate(DOCS):
        batch = _batch(cu, step)
        count = (batch["shift_labels"] != -100).sum()
        for o in (opt_ref, opt_sp):
            o.zero_grad(set_to_none=True)
        out_ref = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss_ref = _loss(out_ref.logits, batch["shift_labels"], count)
        loss_ref.backward()

        seqpar.update_ring_flash_attn_params(torch.tensor(cu, dtype=torch.int32), None)
        local = {k: v.chunk(world, dim=1)[rank] for k, v in batch.items()}
        out = sp(input_ids=local["input_ids"], position_ids=local["position_ids"])
        loss = _loss(out.logits, local["shift_labels"], count)
        loss.backward()
        for p in sp.parameters():
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        errors["loss"] = max(errors["loss"], rel_error(total, loss_ref.detach()))
        truth = out_ref.logits.detach().chunk(world, dim=1)[rank]
        errors["logits"] = max(errors["logits"], rel_error(out.logits.detach(), truth))
        _errors("grad:", sp, ref, errors)
        opt_ref.step()
        opt_sp.step()
    _errors("param:", sp, ref, errors, what="param")
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_llama_trains_as_one_process(pools, world):
    specs = [{"family": "llama"}] + ([{"family": "mistral", "stride": 2}] if world == 2 else [])
    for spec in specs:
        for r, errors in enumerate(pools(world).run(train, spec)):
            bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= TOL}
            assert not bad, f"{spec} rank {r}: {bad}"
            assert any(k.startswith("grad:") for k in errors)


def misuse(kind: str) -> tuple[str, str] | None:
    """One misuse of the flow; ``(type name, message)`` of what it raised on this rank, None if nothing."""
    world, rank = dist.get_world_size(), dist.get_rank()
    name = seqpar.substitute_hf_flash_attn(None, heads_k_stride=1)
    model = build("llama", name)
    batch = {k: v.chunk(world, dim=1)[rank] for k, v in _batch(DOCS[0], 0).items()}
    seqpar.update_ring_flash_attn_params(torch.tensor(DOCS[1], dtype=torch.int32))   # another batch's documents
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if kind == "stale documents":
        pass
    elif kind == "padding mask":
        seqpar.update_ring_flash_attn_params(torch.tensor(DOCS[0], dtype=torch.int32))
        mask = torch.ones_like(batch["input_ids"])
        mask[:, -1] = 0
        kwargs["attention_mask"] = mask
    elif kind == "wrong length":
        seqpar.update_ring_flash_attn_params(torch.tensor((0, 40), dtype=torch.int32))
    elif kind == "bad stride":
        seqpar.substitute_hf_flash_attn(None, heads_k_stride=3)
        seqpar.update_ring_flash_attn_params(torch.tensor(DOCS[0], dtype=torch.int32))
    try:
        with torch.no_grad():
            model(**kwargs)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize(("kind", "etype", "fragment"), [
    ("stale documents", "ValueError", "position_ids must be this rank's positions within the documents given to "
                                      "update_ring_flash_attn_params"),
    ("padding mask", "ValueError", "attention_mask must have no padding with attn_implementation='seqpar_ring_attn'"),
    ("wrong length", "ValueError", "must end at the global length 48"),
    ("bad stride", "ValueError", "heads_k_stride must be None or a positive divisor of the KV heads (2)"),
])
def test_misuse_raises_on_every_rank(pools, kind, etype, fragment):
    for r, res in enumerate(pools(2).run(misuse, kind)):
        assert res is not None, f"rank {r} accepted {kind}"
        assert res[0] == etype and fragment in res[1], res
        assert f"(rank {r} of 2)" in res[1], res


def registers_flash_attention_2(_: int) -> tuple[str, bool]:
    """With flash-attn importable (faked), the entry is "flash_attention_2"; transformers' own is put back."""
    import transformers.utils
    from transformers import AttentionInterface

    before = AttentionInterface._global_mapping["flash_attention_2"]
    available = transformers.utils.is_flash_attn_2_available
    transformers.utils.is_flash_attn_2_available = lambda: True
    try:
        name = seqpar.substitute_hf_flash_attn(None, 1)
        return name, AttentionInterface._global_mapping["flash_attention_2"] is not before
    finally:
        transformers.utils.is_flash_attn_2_available = available
        AttentionInterface._global_mapping["flash_attention_2"] = before


def test_substitute_takes_flash_attention_2_where_flash_attn_is_installed(pools):
    assert pools(2).run(registers_flash_attention_2, 0) == [("flash_attention_2", True)] * 2
