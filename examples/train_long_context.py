"""Long-context training of a Llama-architecture transformers model with sequence parallelism (seqpar).

The model is built from a config (no weights downloaded) with ``attn_implementation="seqpar"``; every rank of
the sequence-parallel group holds a shard of each sequence (``shard_batch``: global positions for RoPE, labels
shifted before sharding). Activation checkpointing on every decoder layer; the loss is computed in chunks over
the shard (``sequence_parallel_loss``: a 1M-token sequence's logits are never materialised); FSDP2 shards the
parameters over the whole data x sequence mesh.

    torchrun --nproc-per-node 4 examples/train_long_context.py --preset gpu-128k --out r128k.jsonl --plot r128k.png
    torchrun --nproc-per-node 4 examples/train_long_context.py --preset gpu-1m --out r1m.jsonl
    python examples/train_long_context.py --preset cpu-tiny --spawn 4 --check --out tiny.jsonl    # CPU, gloo
    python examples/train_long_context.py --plot-from r128k.jsonl r1m.jsonl --plot loss.png      # plot only

The recipe for a 7-8B model at a million tokens (Note [Rank 0 of W on one GPU]):

    python examples/train_long_context.py --preset gpu-1m --model llama3-8b --seq-len 1M --world 8 --emulate \
        --tile-mlp --tile-norms --offload --warmup --steps 1 --json r8b.jsonl    # a steady-state step, rank 0 of 8
    python examples/train_long_context.py --preset gpu-1m --model llama3-8b --seq-len 2M --world 8 --emulate \
        --tile-mlp --tile-norms --offload --no-keep-attention --steps 1 --search --budget-s 600 --fit-probe 4096 \
        --json r8b.jsonl                                            # the longest fit of the memory-lean recipe

``--model llama3-8b`` keeps 28 GiB of attention outputs (``--keep-attention-gib``; ``--no-keep-attention`` for the
memory-lean recipe) and ``--warmup`` makes the one timed step a steady-state one (Note [Steady-state step]).

``--check`` (CPU) trains the same model on one process (transformers' "sdpa" attention on the whole batch)
next to the sequence-parallel run and records, per step, both losses and the largest normalised error over
every parameter gradient; ``tests/test_train_example.py`` asserts on them.

Data (Note [Synthetic retrieval data]): filler tokens from a small alphabet, with (KEY, k, v) triples placed in
the first tenth of the sequence and (QUERY, k, v) triples at its end: predicting v after QUERY k needs the
token v seen ~S tokens earlier, so the answer tokens need the whole context. The loss counts every token
(filler is learnable to its alphabet's entropy quickly, which makes the curve visible in a few steps).

Memory (Note [Activation memory]): ``activation_checkpointing_enable`` keeps one ``(L, hidden)`` input per
decoder layer and recomputes the layer, seqpar's attention included, in backward (the recompute repeats the
attention's communication; every rank recomputes in the same order, so collectives match). ``--keep-attention``
keeps each layer's attention output and lse instead (1 GiB + 16 MiB per layer per 128K local tokens for an 8B) and
the recompute skips attention and its communication (``hf_memory.keep_attention``, Note [Keeping attention's
output]); ``--keep-attention-gib`` bounds them (the first layers' up to it), the same on every rank. The tiled loss
keeps one chunk of logits at a time. FSDP2 shards parameters, gradients and AdamW states over all ranks.

One JSON object per line in ``--out``: a header (config, versions, devices, command), one line per step (loss,
step time, tokens/s, peak memory of every rank), and a summary. ``--json`` appends one record per run (the
recipe's keys: ``model``, ``seq_len``, ``world``, ``emulated``, ``fits``, ``peak_gib``, ``step_s``, ``mfu``, and
more), and ``--search`` one per try plus one with ``max_seq_len`` and ``bound``.

Note [Rank 0 of W on one GPU]
    ``--world W --emulate`` runs one process as rank 0 of W on torch's fake process group (as ``python -m
    seqpar.bench --emulate-world``): collectives return at once and move nothing, so FSDP2 holds 1/W of the
    parameters, gradients and AdamW states, and seqpar's attention runs rank 0's true per-rank kernels at its
    true shapes; the values are meaningless (nothing arrives) and seqpar's agreement round is off (it cannot
    agree over a group that moves no data). Peak memory is rank 0's; the step time is its compute path with
    free communication, an upper bound on what W GPUs reach.
    Memory per local token, Llama-3-8B shape: checkpointed layer inputs 32 x 8 KiB (``--offload``: pinned host
    memory, Note [Activation offload] in seqpar.integrations.hf_memory), one layer's MLP intermediates 3 x 28
    KiB (``--tile-mlp``: one chunk at a time, Note [Tiled MLP]), the RMSNorms' fp32 upcasts and their backward's
    fp32 temporaries, 112 KiB (``--tile-norms``, Note [Tiled norms]), logits (the tiled loss: one chunk at a time).
    What stays, with all of these: ~77 KiB per local token at the step's peak (one layer's saved activations and
    gradients) and the fixed states, which ``--offload-states`` moves to the host (Note [States on the host];
    ``--offload-state-layers N``: only the root's and N layers' when the host cannot hold them all - an 8B at W = 1
    on one H100 with a 126 GiB host ran 160K tokens with 17 of 32 layers' states there).
    MFU counts model FLOPs only: 6 x (parameters doing matmuls: all but the embedding table) x tokens per rank,
    plus causal attention 6 x S^2 x heads x head_dim x layers / W per rank (forward 2, backward 4), not the
    recompute; over ``--peak-tflops`` (989: H100 SXM dense bf16). The recompute of attention is ~72 s of the 8B's
    305 s step at 1M on one H100; the 8B's default 28 GiB of kept outputs (27 of 32 layers at 1M over 8 ranks,
    1 GiB + 16 MiB each: 27.4 GiB; with the 32.3 GiB one-step peak and 7.5 GiB of AdamW states in steady state,
    ~67 GiB, 12 GiB spare of 79) saves ~61 s of it.
    ``--search`` runs each try in a fresh process (an OOM leaves nothing behind): doubling from ``--seq-len``
    until a try fails, then bisection until the bracket is under 1/16 of the start, within ``--budget-s``.
    ``bound`` is why the smallest failing try failed: "gpu memory", "host memory" (the offload's host budget
    was spent, or the process was killed), "time" (a try outlived the budget, or the budget ended before any
    try failed). A full causal step grows as S^2 (an 8B step at 1M tokens on rank 0 of 8 is minutes), so
    ``--fit-probe N`` runs each try with a sliding window of N tokens instead of causal attention: the same
    tensors, layer inputs and buffers, attention work linear in S (the attention kernel may differ: FA2 for
    windows, cuDNN for causal); such records say ``"probe"`` and carry no step time or MFU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import seqpar
from seqpar.integrations import hf_memory
from seqpar.integrations import huggingface as sp_hf
from seqpar.testing import rel_error

__all__ = ["MODELS", "PRESETS", "Preset", "main", "make_batch", "model_flops", "search", "train"]


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One run: model shape, data, parallelism, steps."""

    vocab: int = 128256
    """Vocabulary size (Llama 3's: most of the parameters at this depth are the embedding and the LM head)."""
    hidden: int = 1024
    intermediate: int = 4096
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    seq_len: int = 131072
    """Global tokens per sequence."""
    batch: int = 1
    """Sequences per data-parallel replica per step."""
    steps: int = 20
    lr: float = 3e-4
    dtype: str = "bfloat16"
    """Compute dtype (bf16 via FSDP2 mixed precision on GPU; parameters stay fp32). fp32/fp64: everything."""
    method: str = "usp"
    layout: str = "zigzag"
    ulysses: int = 2
    """Ulysses degree for method="usp" (the ring degree is the rest of the sequence-parallel group)."""
    dp: int = 1
    """Data-parallel replicas; the sequence-parallel group is world / dp ranks."""
    loss_chunk: int = 8192
    """Tokens per chunk of the tiled loss (Note [Tiled loss] in seqpar.integrations.huggingface)."""
    checkpointing: bool = True
    fsdp: bool = True
    """FSDP2 over the data x sequence mesh (grad_reduction="mean"); False: plain gradient all-reduce (dp = 1)."""
    compile: bool = False
    """torch.compile each decoder layer (graph breaks at the attention call, which runs seqpar eagerly)."""
    device: str = "cuda"
    kernel: str = "auto"
    pairs: int = 8
    """(KEY, k, v) triples per sequence."""
    model: str = "llama-323m"
    """The name of the model shape (``MODELS``), recorded in ``--json`` records."""
    head_chunks: int = 1
    """method="ring": run the ring over this many groups of KV heads (smaller fp32 buffers)."""
    tile_mlp: int = 0
    """Tokens per chunk of every decoder layer's MLP (``hf_memory.tile_mlp``); 0: the plain MLP."""
    tile_norms: int = 0
    """Tokens per chunk of every hidden-size RMSNorm (``hf_memory.tile_norms``: no fp32 copy of the hidden states
    saved, Note [Tiled norms]); 0: the plain norms."""
    offload: bool = False
    """Checkpointed layer inputs (and the other saved activations) in pinned host memory (``hf_memory``)."""
    offload_prefetch: int = 1
    """With offload: saved tensors brought back to the GPU ahead of their use in backward (``ActivationOffload(
    prefetch=...)``); 0: each when backward asks for it (one layer input less on the GPU, the copy exposed)."""
    offload_states: bool = False
    """FSDP2's ``CPUOffloadPolicy``: the fp32 parameter shards, their gradients and AdamW's states live in pinned
    host memory and the optimizer steps on the CPU; the GPU holds the bf16 parameters of the layers in use
    (Note [States on the host])."""
    offload_state_layers: int | None = None
    """With offload_states: the root's states (embeddings, final norm, LM head) and the first N decoder layers' go
    to the host, the other layers' stay on the GPU - for a host that cannot hold them all (an 8B at W = 1: 120
    GiB of states on a 126 GiB host); None: every layer's."""
    offload_reserve_gib: float | None = None
    """With offload: keep saved activations on the GPU up to its free memory at the forward less this much
    (``ActivationOffload(reserve_bytes=...)``); None: offload all of them."""
    fit_probe: int = 0
    """> 0: attention over a sliding window of this many tokens instead of causal (Note [Rank 0 of W on one
    GPU]: a memory probe with linear attention work)."""
    keep_attention: bool = False
    """Checkpointed layers keep their attention's output and lse on the GPU, so the recompute in backward runs
    everything but attention (``hf_memory.keep_attention``, Note [Keeping attention's output])."""
    keep_attention_gib: float | None = None
    """With keep_attention: GiB of kept outputs per forward (the first layers' up to it; the rest recompute
    attention as before); None: every layer's."""
    warmup: bool = False
    """Before the timed steps, one untimed forward over a short sliding window (the offload's pinned host buffers:
    the step's own sizes) and a zero-gradient AdamW step (its states; parameters unchanged): the first timed step
    is then a steady-state one (Note [Steady-state step])."""


MODELS = {
    "tiny": dict(vocab=96, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, head_dim=8),
    "llama-323m": dict(vocab=128256, hidden=1024, intermediate=4096, layers=4, heads=8, kv_heads=2, head_dim=128),
    "llama3-8b": dict(vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128),
}
"""Model shapes (random weights; Llama 3's vocabulary). llama3-8b: Llama-3-8B's architecture, 8.03B parameters."""

MODEL_DEFAULTS = {"llama3-8b": dict(method="ring", layout="zigzag", head_chunks=8, loss_chunk=4096, tile_norms=8192,
                                   keep_attention=True, keep_attention_gib=28.0)}
"""What ``--model`` also sets unless given: the 8B runs ring attention over one KV head at a time (its fp32
buffers are then 1/8 of a layer's heads), computes the loss 4096 tokens at a time (4 GiB of fp32 logits), tiles its
RMSNorms (Note [Tiled norms]: 77 KiB per local token at the step's peak instead of 161) and keeps 28 GiB of
attention outputs (27 of its 32 layers at 1M tokens over 8 ranks: Note [Rank 0 of W on one GPU]; with tiled norms
``--keep-attention-gib all`` fits too, 58.4 GiB at 1M)."""

PRESETS = {
    "gpu-128k": Preset(seq_len=131072, steps=20),
    "gpu-1m": Preset(seq_len=1048576, steps=5),
    "cpu-tiny": Preset(**MODELS["tiny"], model="tiny", seq_len=128, steps=3, lr=1e-2, dtype="float64",
                       device="cpu", loss_chunk=24, pairs=3),
}

FILLER = 16            # filler alphabet size
KEY, QUERY, FIRST = 1, 2, 3


def make_batch(p: Preset, seed: int) -> dict[str, torch.Tensor]:
    """Synthetic retrieval sequences ``(batch, seq_len)`` (Note [Synthetic retrieval data]); labels = tokens."""
    g = torch.Generator().manual_seed(seed)
    n_sym = (p.vocab - FIRST - FILLER) // 2                 # key symbols and value symbols
    if n_sym < p.pairs:
        raise ValueError(f"vocab must leave room for {p.pairs} keys and values, got vocab={p.vocab}")
    S, B = p.seq_len, p.batch
    ids = FIRST + 2 * n_sym + torch.randint(0, FILLER, (B, S), generator=g)
    for b in range(B):
        keys = torch.randperm(n_sym, generator=g)[:p.pairs]
        vals = torch.randint(0, n_sym, (p.pairs,), generator=g)
        early = torch.randperm(max(S // 10 // 3, p.pairs), generator=g)[:p.pairs].sort().values * 3
        for i, (k, v) in enumerate(zip(keys.tolist(), vals.tolist())):
            triple = torch.tensor([KEY, FIRST + k, FIRST + n_sym + v])
            ids[b, int(early[i]):int(early[i]) + 3] = triple
            end = S - 3 * (p.pairs - i)
            ids[b, end:end + 3] = torch.tensor([QUERY, FIRST + k, FIRST + n_sym + v])
    return {"input_ids": ids, "labels": ids.clone()}


def build_model(p: Preset, attn: str, device: torch.device, seed: int = 0) -> nn.Module:
    """A Llama-architecture causal LM from a config (random init, the same on every rank)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.intermediate,
                      num_hidden_layers=p.layers, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
                      head_dim=p.head_dim, max_position_embeddings=max(p.seq_len, 4096), rope_theta=1e6,
                      attention_dropout=0.0, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.to(torch.float64 if p.dtype == "float64" else torch.float32)


class TiledLossLM(nn.Module):
    """The LM whose forward returns the sequence-parallel loss, computed in chunks from the hidden states.

    A module (rather than code after ``model.model``) so FSDP2 has the LM head's weight unsharded when the
    loss reads it. Returns ``(loss share, group mean loss, group target count)`` (``SPLoss`` fields).
    """

    def __init__(self, lm: nn.Module, sp_mesh: Any, chunk: int, grad_reduction: str):
        super().__init__()
        self.lm, self.sp_mesh, self.chunk, self.grad_reduction = lm, sp_mesh, chunk, grad_reduction

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor,
                num_items_in_batch: torch.Tensor, **documents: Any) -> tuple[torch.Tensor, ...]:
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                               **documents).last_hidden_state
        res = sp_hf.sequence_parallel_loss(hidden, self.lm.lm_head.weight, shift_labels, self.sp_mesh,
                                           chunk_size=self.chunk, num_items=num_items_in_batch,
                                           grad_reduction=self.grad_reduction)
        return res.loss, res.value, res.tokens


def meshes(p: Preset, device: torch.device) -> tuple[Any, Any, int]:
    """(the sequence-parallel mesh, the FSDP mesh over all ranks, this rank's data-parallel index)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % p.dp:
        raise ValueError(f"dp must divide the world size {world}, got {p.dp}")
    sp = world // p.dp
    if p.method == "usp":
        if sp % p.ulysses:
            raise ValueError(f"ulysses must divide the sequence-parallel size {sp}, got {p.ulysses}")
        mesh = init_device_mesh(device.type, (p.dp, sp // p.ulysses, p.ulysses),
                                mesh_dim_names=("dp", "ring", "ulysses"))
        sp_mesh = mesh["ring", "ulysses"]
    else:
        mesh = init_device_mesh(device.type, (p.dp, sp), mesh_dim_names=("dp", "sp"))
        sp_mesh = mesh["sp"]
    fsdp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    return sp_mesh, fsdp_mesh, mesh.get_local_rank("dp")


def checkpoint_layers(model: nn.Module, keep: Any = None) -> None:
    """Activation checkpointing of every decoder layer (transformers >= 5.2x renamed the method); with ``keep``
    (``hf_memory.keep_attention``) its checkpoint arguments, so the recompute skips attention."""
    kwargs = keep.checkpoint_kwargs() if keep is not None else {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def train(p: Preset, out_path: str | None = None, check: bool = False, *, emulated: bool = False,
          json_path: str | None = None, peak_tflops: float = 989.0) -> list[dict[str, Any]]:
    """Run ``p.steps`` optimizer steps on an initialised process group; returns (and writes) the JSON records.

    ``emulated``: the group is a fake one (Note [Rank 0 of W on one GPU]). ``json_path``: append the run's
    recipe record there (rank 0); in one process (W = 1 or emulated) a step that runs out of memory ends the
    run with a record saying ``"fits": false`` and what ran out, instead of raising.
    """
    device = torch.device(p.device, torch.cuda.current_device()) if p.device == "cuda" else torch.device("cpu")
    _check_options(p, check)
    _host_preflight(p, dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    sp_mesh, fsdp_mesh, dp_index = meshes(p, device)
    if not p.fsdp and p.dp != 1:
        raise ValueError(f"fsdp=False supports dp=1 only (gradients are summed over the sequence group), got {p.dp}")
    options = {"head_chunks": p.head_chunks} if p.method == "ring" and p.head_chunks > 1 else {}
    # emulated: the agreement round off (a fake group moves no digests)
    handle = sp_hf.enable(sp_mesh, method=p.method, layout=p.layout, kernel=p.kernel, name="seqpar",
                          check_ranks=not emulated, **options)
    lm = build_model(p, handle.name, device)
    if p.tile_mlp:
        hf_memory.tile_mlp(lm, chunk_tokens=p.tile_mlp)
    if p.tile_norms:
        hf_memory.tile_norms(lm, chunk_tokens=p.tile_norms)
    if p.fit_probe:
        for layer in lm.model.layers:
            layer.self_attn.sliding_window = p.fit_probe        # read by seqpar's attention function
    keep = None
    if p.keep_attention:
        gib = p.keep_attention_gib
        budget = None if gib is None or gib == float("inf") else int(gib * 2**30)
        keep = hf_memory.keep_attention(handle, keep_bytes=budget)
    if p.checkpointing:
        checkpoint_layers(lm, keep)
    if p.compile:
        for layer in lm.model.layers:
            layer.compile()
    model = TiledLossLM(lm, sp_mesh, p.loss_chunk, "mean" if p.fsdp else "sum")
    if p.fsdp:
        _fully_shard(model, fsdp_mesh, p)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=0.0)
    offload = None
    if p.offload:
        reserve = None if p.offload_reserve_gib is None else int(p.offload_reserve_gib * 2**30)
        host = hf_memory._host_available() - (4 << 30) - _host_states_to_come(model) if p.offload_states else None
        offload = hf_memory.ActivationOffload(reserve_bytes=reserve, prefetch=p.offload_prefetch, host_bytes=host)
    ref = _Reference(p, device) if check else None
    records = [_header(p, check)]
    _emit(records[-1], out_path)
    failure = None
    try:
        if p.warmup:
            records[0]["warmup"] = _warmup(p, model, lm, opt, handle, dp_index, device, offload, keep)
            _emit({"warmup": records[0]["warmup"]}, out_path)
        for step in range(p.steps):
            records.append(_step(p, step, model, opt, handle, dp_index, device, sp_mesh, offload, ref, emulated,
                                 keep))
            _emit(records[-1], out_path)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not (emulated or dist.get_world_size() == 1) or not _out_of_memory(e):
            raise
        failure = e
    if failure is None:
        steady = [r["tokens_per_s"] for r in records[2:]] or [records[-1]["tokens_per_s"]]
        summary = {"summary": True, "tokens_per_s_median": sorted(steady)[len(steady) // 2],
                   "peak_mem_gib_max": max(max(r["peak_mem_gib"]) for r in records[1:]),
                   "final_loss": records[-1]["loss"]}
        records.append(summary)
        _emit(summary, out_path)
    if json_path:
        _emit(recipe_record(p, records, world=dist.get_world_size(), emulated=emulated, peak_tflops=peak_tflops,
                            device=device, offload=offload, failure=failure), json_path)
    if offload is not None:
        offload.close()
    if keep is not None:
        keep.remove()
    handle.disable()
    return records


def _check_options(p: Preset, check: bool) -> None:
    """Options that cannot go together, refused before any work."""
    if p.keep_attention and not p.checkpointing:
        raise ValueError("keep_attention keeps the attention output of checkpointed layers: it needs checkpointing "
                         "(drop --no-checkpointing or --keep-attention)")
    if p.keep_attention and p.compile:
        raise ValueError("keep_attention does not run under torch.compile: pass --no-keep-attention with --compile")
    if p.keep_attention_gib is not None and p.keep_attention_gib < 0:
        raise ValueError(f"keep_attention_gib must be >= 0 or None, got {p.keep_attention_gib}")
    if p.offload_states and not (p.fsdp and p.device == "cuda"):
        raise ValueError("offload_states moves FSDP2's parameter shards, gradients and AdamW's states to host "
                         f"memory: it needs --fsdp on a CUDA device, got fsdp={p.fsdp}, device={p.device!r}")
    if p.offload_state_layers is not None and not (p.offload_states and 0 <= p.offload_state_layers <= p.layers):
        raise ValueError(f"offload_state_layers takes 0..layers ({p.layers}) with offload_states, got "
                         f"{p.offload_state_layers} (offload_states={p.offload_states})")
    if p.offload_prefetch < 0:
        raise ValueError(f"offload_prefetch must be >= 0, got {p.offload_prefetch}")
    if p.warmup and check:
        raise ValueError("--warmup takes a zero-gradient AdamW step (its step count then differs from --check's "
                         "reference): run --check without --warmup")


# Note [Steady-state step]
#     The first step of a run pays for what later steps reuse: the offload's pinned host buffers (cudaHostRegister
#     of ~36 GiB for an 8B at 1M tokens on rank 0 of 8: 76 s of the first step's 305 s), AdamW's states (allocated
#     at the first optimizer step: 8 bytes per parameter per rank, absent from the first step's peak), cuDNN
#     plans, the allocator's segments. The recipe reports a steady-state step either way:
#       --steps N (N >= 2)  step_s and MFU are the median of steps 2..N (``steps_timed``);
#       --warmup            before the timed steps, one forward over a 128-token sliding window (the same tensors
#                           as the step's, so the offload pins exactly the buffers the step will take again;
#                           attention work linear in the length) whose graph is dropped, then a zero-gradient AdamW
#                           step (states allocated, parameters unchanged: no weight decay, update 0 / eps): the
#                           first timed step then pins nothing and its peak includes the optimizer states.
#     One step with --warmup costs a forward of matmuls (seconds) and the pinning instead of a second full step
#     (minutes at 1M tokens), which is what keeps one 1M-token call inside a 10-minute device slot.

# Note [States on the host]
#     At W = 8 an 8B rank's fixed GPU memory is mostly state, not activations: fp32 parameter shards (3.7 GiB),
#     their fp32 gradients (3.7 GiB), AdamW's two fp32 moments (7.5 GiB); at W = 1 the same states are 120 GiB.
#     ``--offload-states`` hands them to FSDP2's own CPUOffloadPolicy (torch's facility, ZeRO-Offload's layout):
#     the shards live in pinned host memory, each layer's unshard copies its shard to the GPU and all-gathers it
#     (bf16 under the mixed-precision policy), gradients are reduce-scattered and copied back, and AdamW steps on
#     the CPU over the host shards. The GPU then holds the bf16 parameters of the layers in use and the
#     activations; the host holds 16 bytes per parameter / W on top of the offloaded activations. Values: the
#     same reductions in the same order, and AdamW's CPU kernel for its CUDA one (fp32 either way).
#     ``--offload-state-layers N`` splits them for a host that cannot hold all of them (an 8B at W = 1 on a
#     126 GiB host): the root's (embeddings and LM head, 15.7 GiB at W = 1) and the first N layers' go to the
#     host (FSDP2 takes an offload policy per ``fully_shard`` call), the rest stay on the GPU (3.25 GiB per 8B
#     layer at W = 1), and AdamW steps each group on its own device. The offload's pinned pool leaves room
#     for what the host states take after sharding (gradients, moments), so neither starves the other.

WARMUP_WINDOW = 128
_ABSENT = object()


def _warmup(p: Preset, model: nn.Module, lm: nn.Module, opt: Any, handle: Any, dp_index: int, device: torch.device,
            offload: Any, keep: Any = None) -> dict[str, Any]:
    """Note [Steady-state step]: the warm-up forward and the zero-gradient AdamW step; what they took. The
    forward keeps no attention outputs (``keep``'s budget is 0 for it): no backward consumes them, and on an H100
    the 8B step's forward peaked at 77.5 GiB with the warm-up's 28 GiB of kept outputs still held."""
    t0 = time.perf_counter()
    local = handle.shard_batch(make_batch(p, seed=10**6 + dp_index))
    local = {k: v.to(device) if isinstance(v, torch.Tensor) and not k.startswith("cu_seq_lens") else v
             for k, v in local.items() if k != "labels"}
    windowed = "window" in seqpar.methods.get(p.method).features
    attns = [layer.self_attn for layer in lm.model.layers] if windowed else []
    windows = [a.__dict__.get("sliding_window", _ABSENT) for a in attns]     # fit_probe's, or none (Llama)
    for a in attns:
        a.sliding_window = WARMUP_WINDOW             # read by seqpar's attention function
    budget = keep.keep_bytes if keep is not None else None
    if keep is not None:
        keep.keep_bytes = 0
    try:
        with offload if offload is not None else contextlib.nullcontext():
            outputs = model(**local)
        del outputs                                   # the graph goes: its pinned buffers return to the pool
    finally:
        if keep is not None:
            keep.keep_bytes = budget
        for a, w in zip(attns, windows):
            if w is _ABSENT:
                del a.sliding_window
            else:
                a.sliding_window = w
    t_fwd = _since(t0, device, "warm-up forward")
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    opt.step()
    opt.zero_grad(set_to_none=True)
    rec = {"warmup_s": _since(t0, device), "forward_s": t_fwd, "window": WARMUP_WINDOW if windowed else None}
    if offload is not None:
        rec.update(pin_s=offload.stats.pin_s, host_pinned_bytes=offload._pool.held)
    return rec


def _step(p: Preset, step: int, model: nn.Module, opt: Any, handle: Any, dp_index: int, device: torch.device,
          sp_mesh: Any, offload: Any, ref: Any, emulated: bool, keep: Any = None) -> dict[str, Any]:
    """One optimizer step: forward (under the offload context), backward, AdamW; its record."""
    batch = make_batch(p, seed=1000 * step + dp_index)
    local = handle.shard_batch(batch)
    local = {k: v.to(device) if isinstance(v, torch.Tensor) and not k.startswith("cu_seq_lens") else v
             for k, v in local.items() if k != "labels"}       # document boundaries stay on the host
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with offload if offload is not None else contextlib.nullcontext():
        share, value, _ = model(**local)
    t_fwd = _since(t0, device, f"step {step}: forward")
    share.backward()
    if not p.fsdp:
        sp_hf.all_reduce_gradients(model.parameters(), sp_mesh)
    t_bwd = _since(t0, device, f"step {step}: backward")
    rec = {"step": step, "loss": float(value) if emulated else _dp_mean(value, p)}
    if ref is not None:
        rec.update(ref.step(step, model))
    opt.step()
    opt.zero_grad(set_to_none=True)
    dt = _since(t0, device)
    peak = [round(_local_peak(device), 3)] if emulated else _peak_memory(device)
    rec.update(step_time_s=dt, tokens_per_s=p.seq_len * p.batch * p.dp / dt, peak_mem_gib=peak,
               forward_s=t_fwd, backward_s=t_bwd - t_fwd)
    if offload is not None:
        rec["offload"] = offload.stats.as_dict()
    if keep is not None:
        rec["keep_attention"] = keep.stats.as_dict()
    return rec


def _since(t0: float, device: torch.device, progress: str | None = None) -> float:
    """Seconds since ``t0`` once the device is idle; with ``progress``, a line on stderr (rank 0) that says how
    far a long step got, with the peak memory so far."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if progress and dist.get_rank() == 0:
        print(f"{progress} done at {dt:.1f} s, peak {_local_peak(device):.2f} GiB", file=sys.stderr, flush=True)
    return dt


def _host_states_to_come(model: nn.Module) -> int:
    """Note [States on the host]: the host bytes the offloaded states take after sharding (which pinned the fp32
    parameter shards): each shard's gradient (FSDP2 copies it into the caching host allocator's pinned blocks, a
    power of two each) and AdamW's two moments. The offload's pinned pool leaves them room."""
    total = 0
    for q in model.parameters():
        local = q.to_local() if hasattr(q, "to_local") else q
        if local.device.type == "cpu":
            n = local.numel() * local.element_size()
            total += (1 << max(n - 1, 0).bit_length()) + 2 * n
    return total


class HostMemoryShort(RuntimeError):
    """What the recipe puts on the host cannot fit there (raised before any work; its record says "host memory")."""


def parameter_count(p: Preset, layers: int | None = None) -> int:
    """Parameters of the preset's Llama (untied embedding and LM head), from its shape; ``layers``: the root's
    and that many decoder layers' only."""
    attn = p.hidden * p.head_dim * (2 * p.heads + 2 * p.kv_heads)
    layer = attn + 3 * p.hidden * p.intermediate + 2 * p.hidden
    return 2 * p.vocab * p.hidden + (p.layers if layers is None else layers) * layer + p.hidden


def _host_preflight(p: Preset, world: int, local: int = 1, available: int | None = None) -> None:
    """Note [States on the host]: with ``offload_states`` each rank's host holds 16 bytes per parameter / W of
    fp32 state before any activation (``local`` ranks share one host). A run whose states alone pass 95% of the
    host's available memory (MemAvailable) is refused before it builds anything, so a try that cannot fit says
    why in seconds, where it would be killed by the host's OOM killer minutes in (an 8B at W = 1: 120 GiB of
    states on a 126 GiB host)."""
    if not p.offload_states:
        return
    need = 16 * parameter_count(p, p.offload_state_layers) / world * local
    have = hf_memory._host_available() if available is None else available
    if need > 0.95 * have:
        part = "" if p.offload_state_layers is None else f" (the root's and {p.offload_state_layers} layers')"
        raise HostMemoryShort(f"host out of memory: the fp32 parameter shards, gradients and AdamW states{part} "
                              f"need {need / 2**30:.1f} GiB of host memory at W = {world} (16 bytes per parameter / "
                              f"W), {have / 2**30:.1f} GiB available")


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e) or "can't allocate memory" in str(e)


def model_flops(p: Preset, world: int) -> float:
    """Model FLOPs of one step on one rank (Note [Rank 0 of W on one GPU]): 6 x matmul parameters x tokens
    plus causal attention, forward and backward, recompute not counted."""
    qo = 2 * p.hidden * p.heads * p.head_dim
    kv = 2 * p.hidden * p.kv_heads * p.head_dim
    matmul_params = p.layers * (qo + kv + 3 * p.hidden * p.intermediate) + p.vocab * p.hidden   # + LM head
    sp = world // p.dp
    tokens = p.seq_len * p.batch / sp
    attention = 6 * p.batch * p.seq_len ** 2 * p.heads * p.head_dim * p.layers / sp
    if p.fit_probe:
        attention = 0.0                   # a probe's attention is windowed: no MFU is claimed for it
    return 6 * matmul_params * tokens + attention


def recipe_record(p: Preset, records: list[dict[str, Any]], *, world: int, emulated: bool, peak_tflops: float,
                  device: torch.device, offload: Any = None, failure: BaseException | None = None) -> dict[str, Any]:
    """The recipe's record of a run (keys: model, seq_len, world, emulated, fits, peak_gib, step_s, mfu, ...)."""
    steps = [r for r in records if "step" in r]
    timed = steps[1:] or steps
    step_s = sorted(r["step_time_s"] for r in timed)[len(timed) // 2] if timed else None
    warmup = records[0].get("warmup")
    flops = model_flops(p, world)
    peak = max((max(r["peak_mem_gib"]) for r in steps), default=None)
    if failure is not None:
        peak = max(peak or 0.0, round(_local_peak(device), 3))
    rec = {"model": p.model, "seq_len": p.seq_len, "world": world, "emulated": emulated,
           "fits": failure is None, "peak_gib": peak,
           "step_s": None if failure is not None or p.fit_probe else step_s,
           "mfu": None if failure is not None or p.fit_probe or not step_s else flops / step_s / (peak_tflops * 1e12),
           "tokens_per_s_per_gpu": None if failure is not None or p.fit_probe or not step_s
           else p.seq_len * p.batch * p.dp / step_s / world,
           "probe": f"window {p.fit_probe}" if p.fit_probe else None,
           "steps_timed": len(timed), "first_step_only": len(steps) == 1,
           "steady_state": len(steps) > 1 or warmup is not None, "warmup": warmup,
           "pin_s_timed": sum((r.get("offload") or {}).get("pin_s", 0.0) for r in timed) if p.offload else None,
           "model_flops_per_rank": flops,
           "peak_tflops": peak_tflops, "method": p.method, "layout": p.layout, "head_chunks": p.head_chunks,
           "tile_mlp": p.tile_mlp, "tile_norms": p.tile_norms, "offload": p.offload,
           "offload_reserve_gib": p.offload_reserve_gib, "offload_prefetch": p.offload_prefetch,
           "offload_states": p.offload_states, "offload_state_layers": p.offload_state_layers,
           "checkpointing": p.checkpointing, "keep_attention": p.keep_attention,
           "keep_attention_gib": p.keep_attention_gib, "keep_stats": steps[-1].get("keep_attention") if steps else None,
           "loss_chunk": p.loss_chunk, "dtype": p.dtype, "device": records[0]["device"],
           "host_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
           "host_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    if device.type == "cuda":
        rec["gpu_total_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 2)
        rec["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
    if offload is not None:
        rec["offload_stats"] = offload.stats.as_dict()
    if failure is not None:
        rec.update(bound=_which_memory(failure, offload), error=str(failure).splitlines()[0][:300])
    return rec


def _which_memory(e: BaseException, offload: Any) -> str:
    """"host memory" when the offload's host budget was spent or the CPU allocator failed, else "gpu memory"."""
    if offload is not None and offload.stats.host_refused_bytes > 0:
        return "host memory"
    if isinstance(e, torch.OutOfMemoryError) or "CUDA" in str(e) or "cuda" in str(e):
        return "gpu memory"
    return "host memory"


def _local_peak(device: torch.device) -> float:
    """This rank's peak memory in GiB (CUDA: max allocated; CPU: max RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _fully_shard(model: TiledLossLM, mesh: Any, p: Preset) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = None
    if p.dtype in ("bfloat16", "float16"):
        low = getattr(torch, p.dtype)
        mp_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    kw = {"mesh": mesh} | ({"mp_policy": mp_policy} if mp_policy is not None else {})
    host = {}
    if p.offload_states:
        from torch.distributed.fsdp import CPUOffloadPolicy

        host["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    on_host = len(model.lm.model.layers) if p.offload_state_layers is None else p.offload_state_layers
    for i, layer in enumerate(model.lm.model.layers):
        fully_shard(layer, **kw, **(host if i < on_host else {}))
    fully_shard(model, **kw, **host)  # root: embeddings, final norm, LM head (kept unsharded through backward)


def _dp_mean(value: torch.Tensor, p: Preset) -> float:
    """The loss averaged over data-parallel replicas (each replica's value is its sequence group's mean)."""
    v = value.detach().double().clone()
    dist.all_reduce(v)                # every rank of a replica holds the same value: divide by the world
    return float(v) / dist.get_world_size()


def _peak_memory(device: torch.device) -> list[float]:
    """Peak memory of every rank in GiB (CUDA: max allocated; CPU: max RSS)."""
    mine = torch.tensor([_local_peak(device)], device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [round(float(t), 3) for t in parts]


class _Reference:
    """The same model on one process (every rank runs it on all replicas' batches): losses and gradients."""

    def __init__(self, p: Preset, device: torch.device):
        self.p = p
        self.model = build_model(p, "sdpa", device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=p.lr, weight_decay=0.0)

    def step(self, step: int, sp_model: nn.Module) -> dict[str, float]:
        self.opt.zero_grad(set_to_none=True)
        losses = []
        for d in range(self.p.dp):                   # the objective: the mean over replicas of their mean loss
            batch = make_batch(self.p, seed=1000 * step + d)
            logits = self.model(input_ids=batch["input_ids"]).logits        # (transformers' own loss is fp32)
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
            loss = loss / self.p.dp
            loss.backward()
            losses.append(float(loss.detach()))
        ref_grads = {f"lm.{n}": q.grad for n, q in self.model.named_parameters()}
        worst, worst_name = 0.0, ""
        for name, q in sp_model.named_parameters():
            g = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
            err = rel_error(g, ref_grads[name])
            if err > worst:
                worst, worst_name = err, name
        self.opt.step()
        return {"ref_loss": sum(losses), "grad_error": worst, "grad_error_param": worst_name}


def _header(p: Preset, check: bool) -> dict[str, Any]:
    import transformers

    n_params = (p.vocab * p.hidden * 2 + p.hidden + p.layers * (
        p.hidden * p.heads * p.head_dim * 2 + p.hidden * p.kv_heads * p.head_dim * 2
        + 3 * p.hidden * p.intermediate + 2 * p.hidden))
    dev = torch.cuda.get_device_name() if p.device == "cuda" else platform.processor() or "cpu"
    return {"config": asdict(p), "parameters": n_params, "world": dist.get_world_size(), "device": dev,
            "host": platform.node(), "torch": torch.__version__, "transformers": transformers.__version__,
            "seqpar": seqpar.__version__, "check": check, "command": " ".join(sys.argv)}


def _emit(record: dict[str, Any], path: str | None) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    line = json.dumps(record)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def plot(paths: list[str], out_png: str) -> None:
    """Loss per step of each JSON-lines file (one curve per run) into ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for path in paths:
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        head = next(r for r in recs if "config" in r)
        steps = [r for r in recs if "step" in r]
        cfg = head["config"]
        tps = next((r["tokens_per_s_median"] for r in recs if r.get("summary")), float("nan"))
        label = (f"{_si(cfg['seq_len'], 1024)} tokens, {cfg['method']} {cfg['layout']}, {head['world']} x "
                 f"{head['device']} ({_si(tps)} tokens/s)")
        ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], marker="o", label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean token cross-entropy)")
    ax.set_title(f"Llama-architecture LM, {_si(head['parameters'])} parameters, seqpar")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def _si(x: float, base: int = 1000) -> str:
    for unit in ("", "K", "M", "G"):
        if abs(x) < base or unit == "G":
            return f"{x:.0f}{unit}" if unit == "" or x >= 10 else f"{x:.1f}{unit}"
        x /= base
    return str(x)


def _quiesce() -> None:
    """Wait until every rank is done: collectives FSDP left in flight (gloo runs them in order) complete before
    the group is destroyed under them (a rank then occasionally aborted in gloo's teardown)."""
    dist.barrier()


def _init_and_train(rank: int, world: int, init_file: str, p: Preset, out: str | None, check: bool,
                    json_path: str | None = None, peak_tflops: float = 989.0) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if p.device == "cpu" else "nccl", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    try:
        if p.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        train(p, out, check, json_path=json_path, peak_tflops=peak_tflops)
        _quiesce()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    ap.add_argument("--model", choices=sorted(MODELS), help="model shape (random weights), over the preset's")
    ap.add_argument("--out", help="append JSON lines here (rank 0)")
    ap.add_argument("--json", help="append the run's recipe record (and a search's) here (rank 0)")
    ap.add_argument("--plot", help="draw the loss curve(s) into this PNG after the run (or of --plot-from files)")
    ap.add_argument("--plot-from", nargs="+", help="only plot these JSON-lines files (no training)")
    ap.add_argument("--spawn", type=int, default=0, help="start N local ranks (file:// rendezvous) instead of torchrun")
    ap.add_argument("--world", type=int, default=0, help="with --emulate: the number of ranks emulated")
    ap.add_argument("--emulate", action="store_true",
                    help="one process as rank 0 of --world on a fake group (Note [Rank 0 of W on one GPU])")
    ap.add_argument("--check", action="store_true", help="also train on one process and record loss/gradient errors")
    ap.add_argument("--seq-len", type=tokens, help="global tokens per sequence: 131072, 128K, 512K, 1M, 1.5M")
    for field in ("steps", "layers", "dp", "ulysses", "loss_chunk", "batch", "head_chunks"):
        ap.add_argument("--" + field.replace("_", "-"), type=int)
    for field in ("method", "layout", "kernel", "dtype", "device"):
        ap.add_argument("--" + field)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false", default=None)
    ap.add_argument("--no-fsdp", dest="fsdp", action="store_false", default=None)
    ap.add_argument("--compile", action="store_true", default=None)
    ap.add_argument("--tile-mlp", type=int, nargs="?", const=8192, metavar="TOKENS",
                    help="every decoder layer's MLP in chunks of TOKENS tokens (default 8192)")
    ap.add_argument("--tile-norms", type=int, nargs="?", const=8192, metavar="TOKENS",
                    help="every hidden-size RMSNorm in chunks of TOKENS tokens (default 8192)")
    ap.add_argument("--offload", action="store_true", default=None,
                    help="saved activations (checkpointed layer inputs) in pinned host memory")
    ap.add_argument("--offload-prefetch", type=int, metavar="N",
                    help="with --offload: saved tensors fetched ahead of use in backward (default 1; 0: none)")
    ap.add_argument("--offload-states", action="store_true", default=None,
                    help="FSDP2 CPU offload: fp32 parameter shards, gradients and AdamW's states in host memory")
    ap.add_argument("--offload-state-layers", type=int, metavar="N",
                    help="with --offload-states: only the root's and the first N decoder layers' states on the host")
    ap.add_argument("--offload-reserve-gib", type=float, metavar="GIB",
                    help="with --offload: keep what fits in the GPU's free memory less GIB on the GPU")
    ap.add_argument("--keep-attention", action="store_true", default=None,
                    help="checkpointed layers keep their attention output (the recompute skips attention)")
    ap.add_argument("--no-keep-attention", dest="keep_attention", action="store_false")
    ap.add_argument("--keep-attention-gib", type=gib_or_all, metavar="GIB",
                    help="with --keep-attention: GiB of kept outputs per forward (the rest recompute attention); "
                         "'all': every layer's")
    ap.add_argument("--warmup", action="store_true", default=None,
                    help="pin the offload buffers and allocate AdamW's states before the timed steps")
    ap.add_argument("--fit-probe", type=int, metavar="WINDOW",
                    help="attention over a sliding window instead of causal: a memory probe (no MFU)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--search", action="store_true", help="find the longest --seq-len that fits, from --seq-len up")
    ap.add_argument("--budget-s", type=float, default=600.0, help="--search: wall-clock budget in seconds")
    ap.add_argument("--search-max", type=tokens, help="--search: the longest sequence to try")
    ap.add_argument("--try", dest="one_try", action="store_true", help=argparse.SUPPRESS)   # a search's child
    args = ap.parse_args(argv)
    if args.plot_from:
        if not args.plot:
            ap.error("--plot-from needs --plot OUT.png")
        plot(args.plot_from, args.plot)
        return
    p = preset_from(args)
    if args.emulate and (args.world < 1 or args.spawn or args.check or "RANK" in os.environ):
        ap.error("--emulate needs --world W >= 1 and runs one process (no --spawn, torchrun or --check)")
    if args.world and not args.emulate:
        ap.error("--world is the emulated world size (with --emulate); start real ranks with torchrun or --spawn")
    if args.search and not args.one_try:
        if not args.emulate:
            ap.error("--search runs emulated tries (--world W --emulate)")
        search(p, list(sys.argv[1:] if argv is None else argv), args)
        return
    if args.out and os.path.exists(args.out):
        os.remove(args.out)
    if args.emulate:
        _emulated(p, args)
    elif args.spawn:
        fd, init_file = tempfile.mkstemp(prefix="seqpar_train_")
        os.close(fd)
        os.unlink(init_file)
        mp.spawn(_init_and_train, args=(args.spawn, init_file, p, args.out, args.check, args.json, args.peak_tflops),
                 nprocs=args.spawn)
    elif "RANK" in os.environ:
        backend = "gloo" if p.device == "cpu" else "nccl"
        if p.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            train(p, args.out, args.check, json_path=args.json, peak_tflops=args.peak_tflops)
            _quiesce()
        finally:
            dist.destroy_process_group()
    else:
        ap.error("run under torchrun (torchrun --nproc-per-node N examples/train_long_context.py ...), pass "
                 "--spawn N, or emulate rank 0 of W on one device (--world W --emulate)")
    if args.plot and args.out and (args.spawn or args.emulate or os.environ.get("RANK", "0") == "0"):
        plot([args.out], args.plot)


def tokens(text: str) -> int:
    """A token count: an int, or with a binary suffix (128K = 131072, 1M = 1048576, 1.5M)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"a token count like 131072, 512K or 1M, got {text!r}")
    n = float(m.group(1)) * 1024 ** " kmg".index(m.group(2).lower() or " ")
    if n != int(n) or n < 1:
        raise argparse.ArgumentTypeError(f"a positive whole number of tokens, got {text!r}")
    return int(n)


def gib_or_all(text: str) -> float:
    """A GiB budget, or 'all' (no limit: infinity)."""
    if text.strip().lower() == "all":
        return float("inf")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of GiB or 'all', got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"a non-negative number of GiB or 'all', got {text!r}")
    return value


def preset_from(args: argparse.Namespace) -> Preset:
    """The preset, then ``--model``'s shape (and its defaults), then every option given."""
    p = PRESETS[args.preset]
    if args.model:
        p = replace(p, model=args.model, **MODELS[args.model], **MODEL_DEFAULTS.get(args.model, {}))
    over = {k: v for k, v in vars(args).items() if k in Preset.__dataclass_fields__ and v is not None}
    return replace(p, **over)


def _emulated(p: Preset, args: argparse.Namespace) -> None:
    """Rank 0 of ``args.world`` on a fake group (Note [Rank 0 of W on one GPU]); an OOM before the first step
    (building the model) still leaves its record."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if p.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", rank=0, world_size=args.world, store=FakeStore())
    try:
        train(p, args.out, emulated=True, json_path=args.json, peak_tflops=args.peak_tflops)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not args.json or not _out_of_memory(e):
            raise
        device = torch.device("cuda", 0) if p.device == "cuda" else torch.device("cpu")
        head = {"device": torch.cuda.get_device_name() if p.device == "cuda" else platform.processor() or "cpu"}
        _emit(recipe_record(p, [head], world=args.world, emulated=True, peak_tflops=args.peak_tflops, device=device,
                            failure=e), args.json)
    finally:
        dist.destroy_process_group()


def search(p: Preset, argv: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The longest sequence that fits (Note [Rank 0 of W on one GPU]): doubling from ``p.seq_len``, then
    bisection, each try a fresh process running ``argv`` at one length; records appended to ``args.json``."""
    deadline = time.monotonic() + args.budget_s
    unit = 2 * (args.world // p.dp)
    quantum = max(unit, p.seq_len // 16 // unit * unit)
    lo = hi = None
    hi_bound, tries = None, []
    S = p.seq_len
    while True:
        left = deadline - time.monotonic()
        if left < 1 or left < 0.8 * _expected_wall(tries, S):
            break                                 # this try would not finish: the budget is the bound
        rec = _one_try(argv, S, left)
        tries.append(rec)
        _emit({**rec, "search_try": True}, args.json)
        if rec["fits"]:
            lo = S
        else:
            hi, hi_bound = S, rec.get("bound", "error")
        if hi is None:
            if args.search_max and S >= args.search_max:
                break
            S = min(2 * S, args.search_max) if args.search_max else 2 * S
        elif lo is None:
            S = S // 2 // unit * unit
            if S < unit:
                break
        elif hi - lo <= quantum:
            break
        else:
            S = (lo + hi) // 2 // unit * unit
    if hi is not None:
        bound = hi_bound
    elif args.search_max and lo is not None and lo >= args.search_max:
        bound = "search max"
    else:
        bound = "time"
    best = max((t for t in tries if t["fits"]), key=lambda t: t["seq_len"], default=None)
    summary = {**(best or {"model": p.model, "seq_len": None, "world": args.world, "emulated": True, "fits": False,
                           "peak_gib": None, "step_s": None, "mfu": None}),
               "search": True, "max_seq_len": lo, "bound": bound, "failed_seq_len": hi, "resolution": quantum,
               "tries": [{k: t.get(k) for k in ("seq_len", "fits", "peak_gib", "bound", "wall_s")} for t in tries],
               "budget_s": args.budget_s, "budget_model": budget_model(tries)}
    summary.pop("search_try", None)
    _emit(summary, args.json)
    return summary


def _expected_wall(tries: list[dict[str, Any]], seq_len: int) -> float:
    """A try's wall time at ``seq_len`` from the finished ones (linear in the length: start-up and the linear
    work dominate a probe; a lower bound for a full causal step)."""
    done = [t for t in tries if t.get("fits")]
    return max((t["wall_s"] * seq_len / t["seq_len"] for t in done), default=0.0)


def _one_try(argv: list[str], seq_len: int, timeout: float) -> dict[str, Any]:
    """Run this script at ``seq_len`` in a fresh process (argparse: the last --seq-len / --json win)."""
    fd, path = tempfile.mkstemp(prefix="seqpar_try_", suffix=".jsonl")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--try", "--seq-len", str(seq_len), "--json", path]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = None, (e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr) or ""
    wall = time.monotonic() - t0
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    os.unlink(path)
    base = {"seq_len": seq_len, "fits": False, "peak_gib": None, "step_s": None, "mfu": None, "wall_s": round(wall, 1)}
    if recs:
        return {**recs[-1], "wall_s": base["wall_s"]}
    if rc is None:
        return {**base, "bound": "time", "error": f"the try outlived the budget ({timeout:.0f} s left)"}
    if rc in (-9, 137):
        return {**base, "bound": "host memory", "error": "killed (SIGKILL: the kernel's OOM killer?)"}
    return {**base, "bound": "error", "error": f"exit code {rc}: {err.strip().splitlines()[-1] if err.strip() else ''}"}


def budget_model(tries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Peak GPU memory and offloaded host bytes of the fitting tries, linear in the sequence length (least
    squares over >= 2 lengths): the longest sequence each budget allows, here and on a 2 TB host."""
    fits = [t for t in tries if t.get("fits") and t.get("peak_gib") is not None]
    if len({t["seq_len"] for t in fits}) < 2:
        return None
    out: dict[str, Any] = {"from_seq_lens": sorted({t["seq_len"] for t in fits})}
    host = [((t.get("offload_stats") or {}).get("offloaded_bytes", 0) / 2**30) for t in fits]
    for name, ys, cap in (("gpu", [t["peak_gib"] for t in fits], fits[0].get("gpu_total_gib")),
                          ("host", host, fits[0].get("host_total_gib")), ("host_2tb", host, 2000 * 1e9 / 2**30)):
        a, b = _line([t["seq_len"] / 2**20 for t in fits], ys)
        out[f"{name}_gib_fixed"], out[f"{name}_gib_per_mtok"] = round(a, 3), round(b, 3)
        if cap and b > 0:
            out[f"{name}_max_seq_len"] = int(max(0.0, (0.95 * cap - a) / b) * 2**20)
    return out


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


if __name__ == "__main__":
    main()
