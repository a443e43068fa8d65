"""RL training where N responses share one prompt: one packed prefix tree instead of N prompt copies.

A policy-gradient step (GRPO-style) scores N sampled responses to one prompt. The usual packing repeats the
prompt before every response; the prefix tree packs the prompt once and lets every response see it
(``seqpar.masks.shared_prefix``). This example computes the same loss both ways on a small self-contained
model (token embedding, 2 decoder blocks with RoPE, GQA ``seqpar.attention`` and a SwiGLU MLP, LM head;
random weights from a fixed seed), checks that the losses and every parameter gradient agree, and prints
what the tree saves: tokens, attention FLOPs (exact visible query-key pairs) and measured forward+backward time.

    python examples/rl_shared_prefix.py                          # one process: prompt 512, 8 responses of 64
    python examples/rl_shared_prefix.py --world 2                # 2 gloo ranks, zigzag layout
    python examples/rl_shared_prefix.py --prompt 128 --responses 4 --response-len 32,48,16,40 --json

Note [Two packings of one RL group]
    Prompt p (P tokens), responses r_1..r_N (lengths n_i). Both rows hold the same loss terms: response i's
    token j is predicted from the hidden state of the token before it (the prompt's last token for j = 0,
    which in the tree is one row shared by every response).

    packed tree (one row of P + sum n_i tokens; causal=False, mask_mod=shared_prefix(P, [n_1, ..., n_N])):

        tokens   p p p p | r1 r1 r1 | r2 r2 | r3 r3 r3          keys ->  p p p p r1 r1 r1 r2 r2 r3 r3 r3
        RoPE     0 1 2 3 | 4  5  6  | 4  5  | 4  5  6               r2   x x x x  .  .  .  x  .  .  .  .
                                                                    r2   x x x x  .  .  .  x  x  .  .  .

    duplicated (N documents [p r_i], cu_seqlens at their boundaries, causal=True, RoPE from 0 per document):

        tokens   p p p p r1 r1 r1 | p p p p r2 r2 | p p p p r3 r3 r3

    Every response row sees exactly the keys it sees after its own prompt copy, at the same RoPE positions
    (RoPE makes a score depend on position differences only, and each response continues from P), so the
    two losses and their gradients agree to rounding. The tree's prompt rows are computed once and receive
    the gradient of every response at once.

Note [Counting attention work]
    Attention FLOPs are proportional to the (query, key) pairs a mask shows: each pair costs 4 D FLOPs per
    query head forward (Q K^T and P V) and about twice that backward. Exactly:

        packed tree   P (P + 1) / 2 + sum_i (n_i P + n_i (n_i + 1) / 2)
        duplicated    sum_i (P + n_i) (P + n_i + 1) / 2

    The tree saves the (N - 1) P (P + 1) / 2 pairs of the prompt copies and N - 1 copies of the prompt's
    linear work (projections, MLP, norms). seqpar computes exactly the visible pairs: a named mask's blocks
    are dense bands (Note [Masks as pieces] in ``seqpar.masks.named``), so the planned pairs of every rank
    (``seqpar.layouts.work.work``) sum to the exact count, which the example checks; ``--json`` also gives
    the busiest rank's share (busiest / mean) of each packing in the chosen layout.

Distributed (``--world N``): N spawned gloo processes (``file://`` rendezvous in a temporary directory) hold
the rows of each packing in the layout (zigzag by default; ``shard(pad=True)`` pads a length the layout
cannot split, and ``attention`` gets ``seq_len``). Each rank's loss share is its local response terms over
the global count, so shares and all-reduced gradients add up to the single-process values (Note [Loss
shares]); rank 0 also runs the duplicated packing alone (a one-rank group) as the reference.

Note [Loss shares]
    A loss term is computed on the rank holding the hidden state that predicts it; its weight is w / T (T
    response tokens in all, w the token's weight: the response's advantage, or 1 with --no-advantages).
    Every rank calls backward on its share (seqpar's backward is a collective, so a rank with no terms
    still does), then the parameter gradients are summed over the ranks: the sum is the gradient of the
    whole loss, because each rank's backward already returns the key/value gradients of its rows to the
    rank that holds them.

Note [CPU kernel]
    Both packings name seqpar's local kernel: ``cpu_flash`` (PyTorch's fused CPU attention) by default. With
    ``kernel="auto"`` on CPU, a step of three or more blocks (the duplicated row's documents, the tree's
    pieces) is grouped into one varlen call, which on CPU only the pure-torch ``reference`` kernel serves, at
    several times the time per pair: the timing would then mostly measure that kernel (``--kernel auto``
    shows it; on GPUs the varlen call runs on FA2 and "auto" is the choice).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import seqpar
from seqpar.layouts.blocks import Rule
from seqpar.layouts.work import work

__all__ = ["Config", "Packing", "PolicyLM", "duplicated", "main", "packed_tree", "pairs", "run"]

TOLERANCE = {"float32": 2e-5, "float64": 1e-10}
"""Largest relative loss error and normalised gradient error (max |a - b| / max |b| per parameter) accepted
between the two packings (and each against the one-process reference), per dtype."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """One run: the RL group's shape, the model, the parallelism."""

    prompt: int = 512
    """Prompt tokens (P)."""
    response_lens: tuple[int, ...] = (64,) * 8
    """Tokens of each response (n_1..n_N)."""
    world: int = 1
    """Sequence-parallel ranks (gloo processes on CPU)."""
    layout: str = "zigzag"
    """seqpar layout of both packings: "zigzag", "contiguous" or "balanced" (by each packing's own work)."""
    method: str = "ring"
    kernel: str = "cpu_flash"
    """seqpar's local kernel (Note [CPU kernel])."""
    dtype: str = "float32"
    advantages: bool = True
    """Weight each response's tokens by a random per-response advantage (GRPO-style); False: plain mean NLL."""
    repeats: int = 3
    """Timed forward+backward runs of each packing (the median is reported), after one warm-up."""
    seed: int = 0
    vocab: int = 256
    dim: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    mlp: int = 256
    layers: int = 2

    def __post_init__(self) -> None:
        if self.prompt < 1 or not self.response_lens or min(self.response_lens) < 1:
            raise ValueError(f"prompt and every response length must be >= 1, got prompt={self.prompt}, "
                             f"response_lens={list(self.response_lens)}")
        if self.world < 1 or self.repeats < 1:
            raise ValueError(f"world and repeats must be >= 1, got world={self.world}, repeats={self.repeats}")
        if self.dtype not in TOLERANCE:
            raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}, got {self.dtype!r}")
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"heads must be a multiple of kv_heads and head_dim even, got heads={self.heads}, "
                             f"kv_heads={self.kv_heads}, head_dim={self.head_dim}")


# ---------------------------------------------------------------------------------------------- the model


def rope(x_BSHD: torch.Tensor, pos_S: torch.Tensor) -> torch.Tensor:
    """Rotary embedding at the given position ids (one per local row, in local order)."""
    half = x_BSHD.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=x_BSHD.dtype) / half)
    ang = pos_S.to(x_BSHD.dtype)[:, None] * freq[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    a, b = x_BSHD[..., :half], x_BSHD[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(q (B, L, H, D), k (B, L, Hkv, D), v (B, L, Hkv, D)) -> out (B, L, H, D)``: the packing's attention."""


class Block(nn.Module):
    """Pre-norm decoder block: GQA attention with RoPE, then a SwiGLU MLP."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.norm1, self.norm2 = nn.RMSNorm(c.dim, eps=1e-6), nn.RMSNorm(c.dim, eps=1e-6)
        self.qkv = nn.Linear(c.dim, (c.heads + 2 * c.kv_heads) * c.head_dim, bias=False)
        self.out = nn.Linear(c.heads * c.head_dim, c.dim, bias=False)
        self.up = nn.Linear(c.dim, 2 * c.mlp, bias=False)
        self.down = nn.Linear(c.mlp, c.dim, bias=False)

    def forward(self, x_BLC: torch.Tensor, pos_L: torch.Tensor, attend: Attend) -> torch.Tensor:
        B, L, _ = x_BLC.shape
        c = self.c
        q, k, v = self.qkv(self.norm1(x_BLC)).split([c.heads * c.head_dim, c.kv_heads * c.head_dim,
                                                     c.kv_heads * c.head_dim], -1)
        q_BLHD = rope(q.view(B, L, c.heads, c.head_dim), pos_L)
        k_BLHD = rope(k.view(B, L, c.kv_heads, c.head_dim), pos_L)
        o_BLHD = attend(q_BLHD, k_BLHD, v.view(B, L, c.kv_heads, c.head_dim))
        x_BLC = x_BLC + self.out(o_BLHD.reshape(B, L, -1))
        gate, up = self.up(self.norm2(x_BLC)).chunk(2, -1)
        return x_BLC + self.down(F.silu(gate) * up)


class PolicyLM(nn.Module):
    """Token embedding, ``c.layers`` decoder blocks, final norm; ``log_probs`` applies the LM head."""

    def __init__(self, c: Config):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim, eps=1e-6)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens_BL: torch.Tensor, pos_L: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Hidden states ``(B, L, dim)`` of the local rows."""
        x = self.embed(tokens_BL)
        for blk in self.blocks:
            x = blk(x, pos_L, attend)
        return self.norm(x)

    def log_probs(self, hidden_NC: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        """``log p(target | hidden)`` of each row ``(N,)``."""
        return torch.log_softmax(self.head(hidden_NC).float(), -1).gather(-1, targets_N[:, None])[:, 0]


def build_model(c: Config) -> PolicyLM:
    """The model with random weights from ``c.seed`` (the same on every rank)."""
    torch.manual_seed(c.seed)
    return PolicyLM(c).to(getattr(torch, c.dtype))


# ------------------------------------------------------------------------------------------- the packings


@dataclass(frozen=True, eq=False)
class Packing:
    """One row of tokens and its loss terms (Note [Two packings of one RL group]); global tensors ``(S,)``.

    The loss is ``-sum(weight * log p(target | hidden[source])) / len(target)``.
    """

    name: str
    tokens: torch.Tensor
    """int64 ``(S,)`` token ids."""
    rope: torch.Tensor
    """int64 ``(S,)`` RoPE position ids."""
    source: torch.Tensor
    """int64 ``(T,)``: the global row whose hidden state predicts each response token."""
    target: torch.Tensor
    """int64 ``(T,)``: the response token."""
    weight: torch.Tensor
    """``(T,)``: the term's weight (the response's advantage, or 1)."""
    causal: bool
    mask_mod: Any = None
    cu_seqlens: tuple[int, ...] | None = None

    @property
    def seq_len(self) -> int:
        return int(self.tokens.numel())


def group(c: Config) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The RL group from ``c.seed``: prompt ids ``(P,)``, each response's ids ``(n_i,)``, advantages ``(N,)``."""
    g = torch.Generator().manual_seed(c.seed + 1)
    prompt = torch.randint(0, c.vocab, (c.prompt,), generator=g)
    responses = [torch.randint(0, c.vocab, (n,), generator=g) for n in c.response_lens]
    rewards = torch.randn(len(responses), generator=g, dtype=torch.float64)
    adv = (rewards - rewards.mean()) / rewards.std().clamp_min(1e-6) if len(responses) > 1 else rewards.abs()
    return prompt, responses, adv if c.advantages else torch.ones_like(adv)


def packed_tree(c: Config) -> Packing:
    """prompt | r_1 | ... | r_N, with ``shared_prefix`` (causal=False) and RoPE continuing from P per response."""
    prompt, responses, adv = group(c)
    P = c.prompt
    tokens = torch.cat([prompt, *responses])
    rope_ids = torch.cat([torch.arange(P)] + [torch.arange(P, P + len(r)) for r in responses])
    source, target, weight, start = [], [], [], P
    for r, a in zip(responses, adv):
        n = len(r)
        source.append(torch.cat([torch.tensor([P - 1]), torch.arange(start, start + n - 1)]))
        target.append(r)
        weight.append(torch.full((n,), float(a), dtype=torch.float64))
        start += n
    mask = seqpar.masks.shared_prefix(P, list(c.response_lens))
    return Packing("packed", tokens, rope_ids, torch.cat(source), torch.cat(target), torch.cat(weight),
                   causal=False, mask_mod=mask,
                   cu_seqlens=(0, len(tokens)) if c.layout == "balanced" else None)


def duplicated(c: Config) -> Packing:
    """[prompt r_1] [prompt r_2] ... as documents (``cu_seqlens``), causal, RoPE from 0 in each document."""
    prompt, responses, adv = group(c)
    P = c.prompt
    tokens, rope_ids, source, target, weight, cu = [], [], [], [], [], [0]
    for r, a in zip(responses, adv):
        n, start = len(r), cu[-1]
        tokens += [prompt, r]
        rope_ids.append(torch.arange(P + n))
        source.append(torch.arange(start + P - 1, start + P + n - 1))
        target.append(r)
        weight.append(torch.full((n,), float(a), dtype=torch.float64))
        cu.append(start + P + n)
    return Packing("duplicated", torch.cat(tokens), torch.cat(rope_ids), torch.cat(source), torch.cat(target),
                   torch.cat(weight), causal=True, cu_seqlens=tuple(cu))


def pairs(prompt: int, response_lens: Sequence[int]) -> dict[str, int]:
    """Exact visible (query, key) pairs of each packing (Note [Counting attention work])."""
    P = prompt
    tree = P * (P + 1) // 2 + sum(n * P + n * (n + 1) // 2 for n in response_lens)
    dup = sum((P + n) * (P + n + 1) // 2 for n in response_lens)
    return {"packed": tree, "duplicated": dup}


# ------------------------------------------------------------------------------------------ one step


@dataclass(frozen=True, eq=False)
class Sharded:
    """This rank's part of a packing: local tokens and RoPE ids ``(1, L)``, its loss terms, and the attention."""

    tokens: torch.Tensor
    rope: torch.Tensor
    rows: torch.Tensor
    """int64 local row of each of this rank's loss terms."""
    target: torch.Tensor
    weight: torch.Tensor
    total: int
    """Loss terms over all ranks (the mean's denominator)."""
    attend: Attend


def shard(pack: Packing, c: Config, mesh: Any) -> Sharded:
    """This rank's rows of ``pack`` in ``c.layout`` (padded at the end when the layout cannot split S)."""
    where = dict(mesh=mesh, method=c.method, layout=c.layout, cu_seqlens=pack.cu_seqlens, causal=pack.causal,
                 mask_mod=pack.mask_mod)
    S = pack.seq_len
    info = seqpar.shard_info(S, **where)
    tokens = seqpar.shard(pack.tokens[None], pad=True, **where)
    rope_ids = seqpar.shard(pack.rope[None], pad=True, **where)[0]
    local = torch.full((info.padded_len,), -1, dtype=torch.long)
    local[info.positions] = torch.arange(info.positions.numel())
    rows = local[pack.source]
    mine = rows >= 0
    dtype = getattr(torch, c.dtype)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return seqpar.attention(q, k, v, mesh=mesh, method=c.method, layout=c.layout, causal=pack.causal,
                                mask_mod=pack.mask_mod, cu_seqlens=pack.cu_seqlens,
                                kernel=c.kernel, seq_len=S if info.padded_len != S else None)

    return Sharded(tokens, rope_ids, rows[mine], pack.target[mine], pack.weight[mine].to(dtype),
                   int(pack.source.numel()), attend)


def loss_share(model: PolicyLM, s: Sharded) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the loss (Note [Loss shares]) and of its scale ``sum |w log p| / T``."""
    hidden = model(s.tokens, s.rope, s.attend)[0]
    terms = s.weight * model.log_probs(hidden.index_select(0, s.rows), s.target).to(s.weight.dtype)
    return -terms.sum() / s.total, terms.detach().abs().sum() / s.total


@dataclass(frozen=True, eq=False)
class Result:
    """One forward+backward: the whole loss, its scale (advantages may cancel it to near 0) and gradients."""

    loss: float
    scale: float
    grads: dict[str, torch.Tensor]


def step(model: PolicyLM, s: Sharded, mesh: Any) -> Result:
    """One forward+backward: the whole loss and every parameter's whole gradient (summed over ranks)."""
    model.zero_grad(set_to_none=True)
    share, scale = loss_share(model, s)
    share.backward()
    sums = torch.stack([share.detach(), scale])
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if dist.get_world_size(mesh) > 1:
        for t in (sums, *grads.values()):
            dist.all_reduce(t, group=mesh)
    return Result(float(sums[0]), float(sums[1]), grads)


def timed(model: PolicyLM, shards: dict[str, Sharded], mesh: Any, repeats: int) -> dict[str, float]:
    """Median seconds of a forward+backward of each packing (the slowest rank's), after one warm-up each; the
    packings take turns, so a machine busy with other work slows both alike."""
    times: dict[str, list[float]] = {name: [] for name in shards}
    for i in range(repeats + 1):
        for name, s in shards.items():
            dist.barrier(group=mesh)
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            loss_share(model, s)[0].backward()
            if i:
                times[name].append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=mesh)
    return dict(zip(times, slowest.tolist()))


def compare(a: Result, b: Result) -> dict[str, float]:
    """The loss error relative to b's scale and the largest normalised gradient error over every parameter."""
    grad = max(float((a.grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in b.grads.items())
    return {"loss_error": abs(a.loss - b.loss) / max(b.scale, 1e-30), "grad_error": grad}


def balance(pack: Packing, c: Config, mesh: Any) -> dict[str, Any]:
    """The pairs seqpar plans for ``pack`` on every rank (``layouts.work``) and busiest / mean."""
    lay = seqpar.api.placement(mesh, c.method, c.layout, pack.cu_seqlens, causal=pack.causal,
                               mask_mod=pack.mask_mod)[0]
    padded = -(-pack.seq_len // lay.divisor) * lay.divisor
    per_rank = work(lay, padded, Rule(causal=pack.causal, mask=pack.mask_mod),
                    pack.cu_seqlens or (0, pack.seq_len))
    return {"planned_pairs": sum(per_rank), "busiest_over_mean": max(per_rank) * len(per_rank) / sum(per_rank)}


# ------------------------------------------------------------------------------------------- the run


def run(c: Config) -> dict[str, Any]:
    """Both packings on the initialised default group: agreement, pairs, time. Returns the summary (every rank)."""
    world = dist.get_world_size()
    ref_group = dist.new_group([0]) if world > 1 else None    # every rank creates it; rank 0 uses it
    model = build_model(c)
    packs = {p.name: p for p in (packed_tree(c), duplicated(c))}
    shards = {name: shard(p, c, None) for name, p in packs.items()}
    results = {name: step(model, s, None) for name, s in shards.items()}
    errors = {"packed_vs_duplicated": compare(results["packed"], results["duplicated"])}
    if world > 1:
        if dist.get_rank() == 0:
            ref = step(model, shard(packs["duplicated"], c, ref_group), ref_group)
            errors["packed_vs_one_process"] = compare(results["packed"], ref)
            errors["duplicated_vs_one_process"] = compare(results["duplicated"], ref)
        dist.barrier()
    times = timed(model, shards, None, c.repeats)
    exact = pairs(c.prompt, c.response_lens)
    planned = {name: balance(p, c, None) for name, p in packs.items()}
    per_pair = 4 * c.heads * c.head_dim * c.layers             # forward FLOPs of one visible pair, all layers
    tol = TOLERANCE[c.dtype]
    return {
        "config": {**asdict(c), "response_lens": list(c.response_lens)},
        "tokens": {n: p.seq_len for n, p in packs.items()},
        "response_tokens": int(packs["packed"].target.numel()),
        "pairs": exact,
        "attention_flops_fwd": {n: v * per_pair for n, v in exact.items()},
        "attention_flops_ratio": exact["duplicated"] / exact["packed"],
        "tokens_ratio": packs["duplicated"].seq_len / packs["packed"].seq_len,
        "planned": planned,
        "loss": {n: r.loss for n, r in results.items()},
        "errors": errors,
        "tolerance": tol,
        "agree": all(e["loss_error"] <= tol and e["grad_error"] <= tol for e in errors.values()),
        "planned_exact": all(planned[n]["planned_pairs"] == exact[n] for n in exact),
        "time_s": times,
        "speedup": times["duplicated"] / times["packed"],
    }


def _worker(rank: int, c: Config, init_file: str, out_file: str) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads() // c.world))     # the cores (or OMP_NUM_THREADS) shared
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=c.world)
    try:
        summary = run(c)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(summary, f)
    finally:
        dist.destroy_process_group()


def launch(c: Config) -> dict[str, Any]:
    """``run`` on ``c.world`` gloo ranks: in this process for 1, spawned processes otherwise."""
    with tempfile.TemporaryDirectory(prefix="seqpar_rl_") as tmp:
        init, out = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "summary.json")
        if c.world == 1:
            _worker(0, c, init, out)
        else:
            mp.spawn(_worker, args=(c, init, out), nprocs=c.world)
        with open(out) as f:
            return json.load(f)


def _fmt_flops(x: float) -> str:
    return f"{x / 1e9:.2f} GFLOP" if x >= 1e8 else f"{x / 1e6:.1f} MFLOP"


def report(s: dict[str, Any]) -> str:
    """The human-readable summary."""
    c = s["config"]
    lens = c["response_lens"]
    shape = f"{len(lens)} x {lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))
    t, p, f, tm = s["tokens"], s["pairs"], s["attention_flops_fwd"], s["time_s"]
    lines = [f"RL group: prompt {c['prompt']} + responses {shape} ({s['response_tokens']} response tokens), "
             f"world {c['world']} ({c['method']}, {c['layout']}), {c['dtype']}",
             f"{'':22}{'packed tree':>16}{'duplicated':>16}{'saved':>10}",
             f"{'tokens':22}{t['packed']:>16,}{t['duplicated']:>16,}{s['tokens_ratio']:>9.2f}x",
             f"{'attention pairs':22}{p['packed']:>16,}{p['duplicated']:>16,}{s['attention_flops_ratio']:>9.2f}x",
             f"{'attention FLOPs (fwd)':22}{_fmt_flops(f['packed']):>16}{_fmt_flops(f['duplicated']):>16}"
             f"{s['attention_flops_ratio']:>9.2f}x",
             f"{'fwd+bwd time (median)':22}{tm['packed'] * 1e3:>13.1f} ms{tm['duplicated'] * 1e3:>13.1f} ms"
             f"{s['speedup']:>9.2f}x"]
    if c["world"] > 1:
        b = {n: v["busiest_over_mean"] for n, v in s["planned"].items()}
        lines.append(f"{'busiest rank / mean':22}{b['packed']:>16.2f}{b['duplicated']:>16.2f}   (attention pairs, "
                     f"{c['layout']})")
    for name, e in s["errors"].items():
        lines.append(f"{name.replace('_', ' ')}: loss error {e['loss_error']:.1e}, "
                     f"max grad error {e['grad_error']:.1e} (tolerance {s['tolerance']:.0e})")
    what = "advantage-weighted loss" if c["advantages"] else "loss (mean NLL)"
    lines.append(f"{what} {s['loss']['packed']:.6f} (packed) vs {s['loss']['duplicated']:.6f} (duplicated): "
                 f"{'agree' if s['agree'] else 'DISAGREE'}; planned pairs = exact: {s['planned_exact']}")
    return "\n".join(lines)


def _lens(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or comma-separated ints, got {text!r}") from None


def config_from_args(argv: Sequence[str] | None = None) -> tuple[Config, bool]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--responses", type=int, default=8, help="responses sharing the prompt")
    ap.add_argument("--response-len", type=_lens, default=[64],
                    help="tokens per response, or one length per response (comma-separated)")
    ap.add_argument("--world", type=int, default=1, help="sequence-parallel gloo ranks to spawn")
    ap.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "balanced"])
    ap.add_argument("--kernel", default="cpu_flash", help="seqpar kernel (default cpu_flash: Note [CPU kernel])")
    ap.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    ap.add_argument("--advantages", action=argparse.BooleanOptionalAction, default=True,
                    help="weight each response's tokens by a random advantage (default) or by 1")
    ap.add_argument("--repeats", type=int, default=3, help="timed forward+backward runs of each packing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = ap.parse_args(argv)
    lens = args.response_len * args.responses if len(args.response_len) == 1 else args.response_len
    if len(lens) != args.responses:
        ap.error(f"--response-len must give 1 or --responses ({args.responses}) lengths, got {len(lens)}")
    try:
        c = Config(prompt=args.prompt, response_lens=tuple(lens), world=args.world, layout=args.layout,
                   kernel=args.kernel, dtype=args.dtype, advantages=args.advantages, repeats=args.repeats,
                   seed=args.seed)
    except ValueError as e:
        ap.error(str(e))
    return c, args.json


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example; exits non-zero when the packings disagree. Returns the summary."""
    c, as_json = config_from_args(argv)
    summary = launch(c)
    print(json.dumps(summary) if as_json else report(summary))
    if not (summary["agree"] and summary["planned_exact"]):
        sys.exit(f"the packed tree and the duplicated packing disagree: {summary['errors']}, "
                 f"planned {summary['planned']} vs exact {summary['pairs']}")
    return summary


if __name__ == "__main__":
    main()
