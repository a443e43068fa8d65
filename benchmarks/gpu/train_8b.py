"""Llama-3-8B training at a million tokens, rank 0 of 8 emulated on one GPU (issue 26), in one bounded run.

    python benchmarks/gpu/train_8b.py --out $OUT/train8b.jsonl --budget-s 300

Phases, each in a fresh process (its log next to ``--out``), every record a JSON line in ``--out``:
  selfcheck  on this GPU, a small Llama: plain vs ``ActivationOffload`` (every saved tensor through the CUDA
             path: pinned buffers, side streams, prefetch; verify=True compares every restored tensor with the
             saved one) - as is, and with the GPU held ~30 ms behind the CPU before forward and backward (the
             regime where stream-order races show) - vs ``tile_mlp`` + offload: loss and every gradient
             (offload alone must be bitwise: ``ok``), then step time and peak memory of the three on a 32K-token model
             (is the offload's copy hidden behind compute?); plain checkpointing vs ``keep_attention`` on
             seqpar's attention (one process, W = 1: cuDNN / FA2 through the direct path, whose kernels save their
             own outputs and RNG state): loss and gradients against plain run twice. Seconds.
  step       examples/train_long_context.py: llama3-8b, 1M tokens, ``--world 8 --emulate``, one full step
             (forward, backward, AdamW) with tiled MLP and norms, offload, checkpointing, the tiled loss and (the
             8B's default) 28 GiB of kept attention outputs (``--extra "--keep-attention-gib all"``: every layer's,
             which fits with tiled norms), after ``--warmup`` (the offload's pinned buffers and
             AdamW's states made before the timed step: a steady-state step, Note [Steady-state step]): peak
             memory, step time, MFU. By FLOPs a few minutes (attention at 1M is ~95% of the step's model FLOPs);
             expected ~350 s of wall time (setup ~15 s, warm-up ~85 s, the step ~240 s).
  search     the same recipe's ``--search`` from 2M with ``--fit-probe 4096`` (a sliding window instead of
             causal: the same tensors, linear attention work) within ``--budget-s``: max_seq_len, bound. Without
             kept attention outputs (the longest fit is the memory-lean recipe's), with ``--warmup`` (the peak
             includes AdamW's states).

``--extra`` reaches both: ``--extra "--no-keep-attention"`` is the step before selective recompute (the
baseline), ``--extra "--keep-attention-gib all"`` keeps every layer's output, ``--extra "--offload-states
--offload-prefetch 0"`` puts the fp32 states on the host (Note [States on the host] in the example).
Nothing is taken from outside the repository (no flash-attn): PyTorch's kernels through seqpar.

``--deadline-s`` bounds the whole script (default 560 s: inside a 10-minute device call); a phase that would
outlive it is cut (its record says so) and the search gets what is left, at most ``--budget-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_long_context.py"
RECIPE = ["--preset", "gpu-1m", "--world", "8", "--emulate", "--tile-mlp", "--tile-norms", "--offload", "--steps", "1",
          "--warmup"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="append JSON lines here")
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget of the search")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="wall-clock bound of the whole script")
    ap.add_argument("--phases", default="selfcheck,step,search")
    ap.add_argument("--seq-len", default="1M", help="the full step's length")
    ap.add_argument("--search-from", default="2M")
    ap.add_argument("--fit-probe", type=int, default=4096)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--model", default="llama3-8b", help="the recipe's --model")
    ap.add_argument("--extra", default="", help="more arguments for the recipe (a CPU smoke test: "
                    "--model tiny --extra '--device cpu --dtype float64')")
    ap.add_argument("--device", default="cuda", help="the selfcheck's device (cpu: a smoke test of this script)")
    ap.add_argument("--selfcheck-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.selfcheck_child:
        selfcheck(args.out, args.device)
        return
    t0 = time.monotonic()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
           "PYTHONUNBUFFERED": "1"}
    _append(out, _environment(args))
    phases = args.phases.split(",")
    recipe = [*RECIPE, "--model", args.model]
    left = lambda: args.deadline_s - (time.monotonic() - t0)   # noqa: E731
    if "selfcheck" in phases:
        _run("selfcheck", [sys.executable, __file__, "--out", str(out), "--selfcheck-child", "--device", args.device],
             out, env, min(150.0, left() - 60))
    if "step" in phases:
        _run("step", [sys.executable, str(EXAMPLE), *recipe, "--seq-len", args.seq_len, *args.extra.split(),
                      "--json", str(out), "--peak-tflops", str(args.peak_tflops)], out, env, left() - 20)
    if "search" in phases and left() > 60:
        budget = min(args.budget_s, left() - 20)
        _run("search", [sys.executable, str(EXAMPLE), *recipe, "--no-keep-attention", *args.extra.split(),
                        "--seq-len", args.search_from, "--search", "--budget-s", str(budget), "--fit-probe",
                        str(args.fit_probe), "--json", str(out)], out, env, budget + 30)
    elif "search" in phases:
        _append(out, {"phase": "search", "skipped": f"{left():.0f} s left of --deadline-s {args.deadline_s:.0f}"})
    _append(out, {"phase": "done", "wall_s": round(time.monotonic() - t0, 1)})


def _run(phase: str, cmd: list[str], out: Path, env: dict, timeout: float) -> None:
    """One phase in a fresh process, its output in ``<out>-<phase>.log``; a record of how it ended."""
    log = out.with_name(f"{out.stem}-{phase}.log")
    t0 = time.monotonic()
    print(f"== {phase}: {' '.join(cmd[1:])} (timeout {timeout:.0f} s)", flush=True)
    if timeout < 10:
        _append(out, {"phase": phase, "skipped": f"{timeout:.0f} s left"})
        return
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)          # the phase and any try it started
            proc.wait()
            rc = "timeout"
    tail = log.read_text().strip().splitlines()[-3:]
    _append(out, {"phase": phase, "rc": rc, "wall_s": round(time.monotonic() - t0, 1), "log": log.name,
                  "log_tail": [line[-300:] for line in tail]})
    print(f"== {phase}: rc={rc} in {time.monotonic() - t0:.0f} s", flush=True)


def _append(path: Path, record: dict) -> None:
    line = json.dumps(record)
    print(line[:2000], flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def _environment(args: argparse.Namespace) -> dict:
    import torch

    rec = {"phase": "environment", "host": platform.node(), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "command": " ".join(sys.argv),
           "host_mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    try:
        import transformers

        rec["transformers"] = transformers.__version__
    except ImportError:
        rec["transformers"] = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        rec["gpu"] = out
    except (OSError, subprocess.TimeoutExpired):
        rec["gpu"] = None
    rec["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip() or None
    return rec


# --------------------------------------------------------------------------------------------------------------
# selfcheck (a child process)


def selfcheck(out: str, device: str) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for dtype in (torch.float32, torch.bfloat16):
        _append(Path(out), {"phase": "selfcheck", "device": device, **_exactness(dtype, device)})
    for variant in ("plain", "offload", "tile_mlp+offload"):
        _append(Path(out), {"phase": "selfcheck", "device": device, **_overhead(variant, device)})
    for dtype in (torch.float32, torch.bfloat16):
        _append(Path(out), {"phase": "selfcheck", "device": device, **_keep_exactness(dtype, device)})


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, dtype, seq: int, device: str,
           attn: str = "sdpa", checkpoint_kwargs: dict | None = None):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                      max_position_embeddings=max(seq, 4096), use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    model = model.to(dtype)
    kwargs = checkpoint_kwargs or {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def _exactness(dtype, device: str) -> dict:
    """Plain (twice: the GPU's own run-to-run difference) vs offload (every saved tensor, min_bytes=0) vs
    tile_mlp + offload: one forward and backward each, deterministic algorithms where torch has them."""
    import torch

    from seqpar.integrations import hf_memory

    torch.use_deterministic_algorithms(True, warn_only=True)
    plain = _llama(256, 1024, 4, 8, 2, 1024, dtype, 4096, device)
    models = {"plain": plain, "plain again": copy.deepcopy(plain), "offload": copy.deepcopy(plain),
              "offload, gpu behind": copy.deepcopy(plain), "tile_mlp+offload": copy.deepcopy(plain)}
    hf_memory.tile_mlp(models["tile_mlp+offload"], chunk_tokens=1024)
    ids = torch.randint(0, 1024, (1, 4096), device=device, generator=torch.Generator(device).manual_seed(1))
    losses, stats, restored = {}, {}, {}
    behind = lambda: torch.cuda._sleep(50_000_000) if device == "cuda" else None   # noqa: E731 (~30 ms spin)
    for name, m in models.items():
        # verify: every restored tensor compared bitwise with a device copy of the saved one (after the wait)
        off = hf_memory.ActivationOffload(min_bytes=0, verify=True) if "offload" in name else None
        if "behind" in name:          # the GPU far behind the CPU: queued kernels still use freed blocks
            behind()
        with off if off is not None else contextlib.nullcontext():
            loss = m(input_ids=ids, labels=ids).loss
        if "behind" in name:
            behind()
        loss.backward()
        _sync(device)
        losses[name] = loss.detach()
        if off is not None:
            stats[name] = off.stats.as_dict()
            restored[name] = off.verify()
            off.close()
    rec = {"check": "exactness", "dtype": str(dtype).replace("torch.", "")}
    ref = dict(plain.named_parameters())
    for name in ("plain again", "offload", "offload, gpu behind", "tile_mlp+offload"):
        errs, nonfinite = {}, []
        for n, p in models[name].named_parameters():
            a, b = p.grad.double(), ref[n].grad.double()
            errs[n] = 0.0 if torch.equal(p.grad, ref[n].grad) else float((a - b).abs().max() / b.abs().max())
            if not bool(torch.isfinite(p.grad).all()):
                nonfinite.append(n)
                errs[n] = float("inf")          # max() and the worst name stay meaningful (nan never wins)
        r = {"loss_bitwise": bool(torch.equal(losses[name], losses["plain"])),
             "loss_error": abs(float(losses[name]) - float(losses["plain"])) / abs(float(losses["plain"])),
             "grads_bitwise": sum(v == 0.0 for v in errs.values()), "grads": len(errs),
             "grad_error_max": max(errs.values()), "worst": max(errs, key=errs.get),
             "grads_nonfinite": len(nonfinite), "first_nonfinite": nonfinite[:4],
             "restored": restored.get(name), "offload_stats": stats.get(name)}
        if name in ("offload", "offload, gpu behind"):   # offload alone changes no value: all of it bitwise
            r["ok"] = (r["loss_bitwise"] and r["grads_bitwise"] == r["grads"]
                       and r["restored"]["mismatched"] == 0 and r["offload_stats"]["offloaded_tensors"] > 0)
        rec[name] = r
    torch.use_deterministic_algorithms(False)
    return rec


def _keep_exactness(dtype, device: str) -> dict:
    """Plain checkpointing (twice: the GPU's own run-to-run difference) vs ``keep_attention`` on seqpar's attention
    at W = 1 (a one-rank gloo group; the call is the kernel's direct path), one forward and backward each, with
    the attention forwards each ran counted: ``ok`` when keep runs half as many and its loss is bitwise plain's
    and its gradients differ from plain's no more than plain's own rerun does."""
    import torch
    import torch.distributed as dist

    from seqpar.integrations import hf_memory
    from seqpar.integrations import huggingface as sp_hf
    from seqpar.integrations.hf import attention as hf_attention

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    handle = sp_hf.enable(None, method="ring", name="seqpar_selfcheck")
    keep = hf_memory.keep_attention(handle)
    calls = [0]
    inner = hf_attention.attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    hf_attention.attention = counted
    try:
        make = lambda kw: _llama(256, 1024, 4, 8, 2, 1024, dtype, 4096, device, handle.name, kw)   # noqa: E731
        models = {"plain": make(None), "plain again": make(None), "keep": make(keep.checkpoint_kwargs())}
        ids = torch.randint(0, 1024, (1, 4096), device=device, generator=torch.Generator(device).manual_seed(1))
        losses, counts = {}, {}
        for name, m in models.items():
            calls[0] = 0
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            _sync(device)
            losses[name], counts[name] = loss.detach(), calls[0]
        rec = {"check": "keep_attention", "dtype": str(dtype).replace("torch.", ""), "attention_forwards": counts,
               "keep_stats": keep.stats.as_dict()}
        ref = dict(models["plain"].named_parameters())
        for name in ("plain again", "keep"):
            errs = {n: 0.0 if torch.equal(p.grad, ref[n].grad) else
                    float((p.grad.double() - ref[n].grad.double()).abs().max() / ref[n].grad.double().abs().max())
                    for n, p in models[name].named_parameters()}
            rec[name] = {"loss_bitwise": bool(torch.equal(losses[name], losses["plain"])),
                         "grads_bitwise": sum(v == 0.0 for v in errs.values()), "grads": len(errs),
                         "grad_error_max": max(errs.values()), "worst": max(errs, key=errs.get)}
        rec["ok"] = (counts["keep"] * 2 == counts["plain"] and rec["keep"]["loss_bitwise"]
                     and rec["keep"]["grad_error_max"] <= rec["plain again"]["grad_error_max"])
        return rec
    finally:
        hf_attention.attention = inner
        keep.remove()
        handle.disable()
        torch.use_deterministic_algorithms(False)


def _overhead(variant: str, device: str) -> dict:
    """Forward + backward time and peak of a 32K-token bf16 Llama (8 layers, hidden 2048, checkpointing, the
    loss in 4K-token chunks as the recipe computes it) per variant."""
    import torch

    from seqpar.integrations import hf_memory
    from seqpar.integrations.huggingface import token_loss_sum

    cuda = device == "cuda"
    tokens = 32768 if cuda else 2048
    if cuda:
        torch.cuda.empty_cache()
    model = _llama(2048, 8192, 8, 16, 4, 32000, torch.bfloat16, tokens, device) if cuda else \
        _llama(256, 1024, 2, 8, 2, 1024, torch.float32, tokens, device)
    if "tile_mlp" in variant:
        hf_memory.tile_mlp(model, chunk_tokens=8192)
    off = hf_memory.ActivationOffload() if "offload" in variant else None
    ids = torch.randint(0, 1024, (1, tokens), device=device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    times = []
    for i in range(5):
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with off if off is not None else contextlib.nullcontext():
            hidden = model.model(input_ids=ids).last_hidden_state
            total, count = token_loss_sum(hidden, model.lm_head.weight, labels, chunk_size=4096)
        (total / count).backward()
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    rec = {"check": "overhead", "variant": variant, "tokens": tokens, "step_ms": round(1e3 * sorted(times)[1], 1),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None}
    if off is not None:
        rec["offload_stats"] = off.stats.as_dict()
        off.close()
    del model
    return rec


if __name__ == "__main__":
    main()
