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

``--check`` (CPU) trains the same model on one process (transformers' "sdpa" attention on the whole batch)
next to the sequence-parallel run and records, per step, both losses and the largest normalised error over
every parameter gradient; ``tests/test_train_example.py`` asserts on them.

Data (Note [Synthetic retrieval data]): filler tokens from a small alphabet, with (KEY, k, v) triples placed in
the first tenth of the sequence and (QUERY, k, v) triples at its end: predicting v after QUERY k needs the
token v seen ~S tokens earlier, so the answer tokens need the whole context. The loss counts every token
(filler is learnable to its alphabet's entropy quickly, which makes the curve visible in a few steps).

Memory (Note [Activation memory]): ``activation_checkpointing_enable`` keeps one ``(L, hidden)`` input per
decoder layer and recomputes the layer, seqpar's attention included, in backward (the recompute repeats the
attention's communication; every rank recomputes in the same order, so collectives match). The tiled loss
keeps one chunk of logits at a time. FSDP2 shards parameters, gradients and AdamW states over all ranks.

One JSON object per line in ``--out``: a header (config, versions, devices, command), one line per step (loss,
step time, tokens/s, peak memory of every rank), and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
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
from seqpar.integrations import huggingface as sp_hf
from seqpar.testing import rel_error

__all__ = ["PRESETS", "Preset", "main", "make_batch", "train"]


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


PRESETS = {
    "gpu-128k": Preset(seq_len=131072, steps=20),
    "gpu-1m": Preset(seq_len=1048576, steps=5),
    "cpu-tiny": Preset(vocab=96, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, head_dim=8, seq_len=128,
                       steps=3, lr=1e-2, dtype="float64", device="cpu", loss_chunk=24, pairs=3),
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


def checkpoint_layers(model: nn.Module) -> None:
    """Activation checkpointing of every decoder layer (transformers >= 5.2x renamed the method)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def train(p: Preset, out_path: str | None = None, check: bool = False) -> list[dict[str, Any]]:
    """Run ``p.steps`` optimizer steps on an initialised process group; returns (and writes) the JSON records."""
    device = torch.device(p.device, torch.cuda.current_device()) if p.device == "cuda" else torch.device("cpu")
    sp_mesh, fsdp_mesh, dp_index = meshes(p, device)
    if not p.fsdp and p.dp != 1:
        raise ValueError(f"fsdp=False supports dp=1 only (gradients are summed over the sequence group), got {p.dp}")
    handle = sp_hf.enable(sp_mesh, method=p.method, layout=p.layout, kernel=p.kernel, name="seqpar")
    lm = build_model(p, handle.name, device)
    if p.checkpointing:
        checkpoint_layers(lm)
    if p.compile:
        for layer in lm.model.layers:
            layer.compile()
    model = TiledLossLM(lm, sp_mesh, p.loss_chunk, "mean" if p.fsdp else "sum")
    if p.fsdp:
        _fully_shard(model, fsdp_mesh, p)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=0.0)
    ref = _Reference(p, device) if check else None
    records = [_header(p, check)]
    _emit(records[-1], out_path)
    for step in range(p.steps):
        batch = make_batch(p, seed=1000 * step + dp_index)
        local = handle.shard_batch(batch)
        local = {k: v.to(device) if isinstance(v, torch.Tensor) and not k.startswith("cu_seq_lens") else v
                 for k, v in local.items() if k != "labels"}       # document boundaries stay on the host
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        share, value, _ = model(**local)
        share.backward()
        if not p.fsdp:
            sp_hf.all_reduce_gradients(model.parameters(), sp_mesh)
        rec = {"step": step, "loss": _dp_mean(value, p)}
        if ref is not None:
            rec.update(ref.step(step, model))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rec.update(step_time_s=dt, tokens_per_s=p.seq_len * p.batch * p.dp / dt, peak_mem_gib=_peak_memory(device))
        records.append(rec)
        _emit(rec, out_path)
    steady = [r["tokens_per_s"] for r in records[2:]] or [records[-1]["tokens_per_s"]]
    summary = {"summary": True, "tokens_per_s_median": sorted(steady)[len(steady) // 2],
               "peak_mem_gib_max": max(max(r["peak_mem_gib"]) for r in records[1:]),
               "final_loss": records[-1]["loss"]}
    records.append(summary)
    _emit(summary, out_path)
    handle.disable()
    return records


def _fully_shard(model: TiledLossLM, mesh: Any, p: Preset) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = None
    if p.dtype in ("bfloat16", "float16"):
        low = getattr(torch, p.dtype)
        mp_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    kw = {"mesh": mesh} | ({"mp_policy": mp_policy} if mp_policy is not None else {})
    for layer in model.lm.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)          # root: embeddings, final norm, LM head (kept unsharded through backward)


def _dp_mean(value: torch.Tensor, p: Preset) -> float:
    """The loss averaged over data-parallel replicas (each replica's value is its sequence group's mean)."""
    v = value.detach().double().clone()
    dist.all_reduce(v)                # every rank of a replica holds the same value: divide by the world
    return float(v) / dist.get_world_size()


def _peak_memory(device: torch.device) -> list[float]:
    """Peak memory of every rank in GiB (CUDA: max allocated; CPU: max RSS)."""
    if device.type == "cuda":
        mine = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
    else:
        mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20])
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
    if dist.get_rank() != 0:
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


def _init_and_train(rank: int, world: int, init_file: str, p: Preset, out: str | None, check: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if p.device == "cpu" else "nccl", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    try:
        if p.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        train(p, out, check)
        _quiesce()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    ap.add_argument("--out", help="append JSON lines here (rank 0)")
    ap.add_argument("--plot", help="draw the loss curve(s) into this PNG after the run (or of --plot-from files)")
    ap.add_argument("--plot-from", nargs="+", help="only plot these JSON-lines files (no training)")
    ap.add_argument("--spawn", type=int, default=0, help="start N local ranks (file:// rendezvous) instead of torchrun")
    ap.add_argument("--check", action="store_true", help="also train on one process and record loss/gradient errors")
    for field in ("steps", "seq_len", "layers", "dp", "ulysses", "loss_chunk", "batch"):
        ap.add_argument("--" + field.replace("_", "-"), type=int)
    for field in ("method", "layout", "kernel", "dtype"):
        ap.add_argument("--" + field)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false", default=None)
    ap.add_argument("--no-fsdp", dest="fsdp", action="store_false", default=None)
    ap.add_argument("--compile", action="store_true", default=None)
    args = ap.parse_args(argv)
    if args.plot_from:
        if not args.plot:
            ap.error("--plot-from needs --plot OUT.png")
        plot(args.plot_from, args.plot)
        return
    over = {k: v for k, v in vars(args).items() if k in Preset.__dataclass_fields__ and v is not None}
    p = replace(PRESETS[args.preset], **over)
    if args.out and os.path.exists(args.out):
        os.remove(args.out)
    if args.spawn:
        fd, init_file = tempfile.mkstemp(prefix="seqpar_train_")
        os.close(fd)
        os.unlink(init_file)
        mp.spawn(_init_and_train, args=(args.spawn, init_file, p, args.out, args.check), nprocs=args.spawn)
    elif "RANK" in os.environ:
        backend = "gloo" if p.device == "cpu" else "nccl"
        if p.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            train(p, args.out, args.check)
            _quiesce()
        finally:
            dist.destroy_process_group()
    else:
        ap.error("run under torchrun (torchrun --nproc-per-node N examples/train_long_context.py ...) or pass "
                 "--spawn N")
    if args.plot and args.out and (args.spawn or os.environ.get("RANK", "0") == "0"):
        plot([args.out], args.plot)


if __name__ == "__main__":
    main()
