"""Masks on one GPU: seqpar against flex_attention called directly, softcap, the shared-prefix RL row, and the
named masks' compute-path efficiency at an emulated W = 8 (fake group, communication free).

    python3 benchmarks/gpu/masks_1gpu.py --out DIR [--sections w1,softcap,rl,emulated,profile] [--sizes 16384,131072]
        [--profile-cases sink_window:131072:ulysses/contiguous:fb,...]
        [--large-masks sink_window,chunked,window]

Every record is one JSON line in DIR/masks.jsonl, labelled "W = 1" or "emulated W = 8 (rank r of 8, fake
group)". GQA 32/8, D 128, bf16 unless said; medians of ``--iters`` after ``--warmup``. flex is
``torch.compile(flex_attention)`` (one compiled function for every case) with the block mask
``create_block_mask`` gives for the same mask, built outside the timed region (seqpar builds its own once per
planned call, also outside): evaluated a slab of query rows at a time, so neither a compile of
``create_block_mask`` per mask nor an S x S mask is needed, and checked equal to ``create_block_mask``'s at 16K.

The w1 section: every named mask, a generic ``mask_mod`` and a plain ``window_size=(4095, 0)`` call at 16K; at
larger sizes the masks in ``--large-masks`` (first word of the case name). Each case times the forward without grad,
the forward of a training step (inputs that require grad: seqpar's training plan, where Note [Bands on flex] puts
windowed bands on flex on sm90) and forward+backward, flex and seqpar side by side in interleaved bursts
(``burst_ms``; separate medians moved the training forward's ratio by up to 0.1 between runs). The window row also
times seqpar on FA2 (``kernel="flash"``), ``auto``'s choice before that Note; at 16K, a case whose training plan ran
a band on flex also times its no-grad forward with ``kernel="flex"`` (what ``auto`` declines without a backward).
Each record names the kernels seqpar chose (mask kind: kernel); the section ends with a table, printed after each
length.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar import masks
from seqpar.bench.timing import burst_ms, time_ms
from seqpar.kernels import select
from seqpar.layouts import make_layout
from seqpar.layouts.blocks import Rule
from seqpar.layouts.work import work

dev = torch.device("cuda")
OUT: Path
torch._dynamo.config.recompile_limit = 256           # one flex variant per mask and shape; never run eager flex
torch._dynamo.config.fail_on_recompile_limit_hit = True
FLEX = torch.compile(flex_attention, dynamic=False)
W1: dict[tuple[int, str], tuple[float, float]] = {}      # seqpar at W = 1: (length, mask) -> (fwd, fwd+bwd) ms
H, HKV, D = 32, 8, 128


def emit(**rec) -> None:
    print(json.dumps(rec), flush=True)
    with (OUT / "masks.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")


def group(world: int, rank: int = 0) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def named(S: int) -> dict[str, tuple[bool, object]]:
    """The named masks at length S, each with the ``causal`` flag it is used with."""
    img = S // 16
    return {
        "chunked": (True, masks.chunked(8192)),
        "spans (16 images)": (False, masks.spans([(i * img + 64, i * img + 64 + 256) for i in range(16)])),
        "prefix_lm": (False, masks.prefix_lm(S // 4)),
        "block_causal": (False, masks.block_causal(S // 32)),
        "shared_prefix": (False, masks.shared_prefix(S // 2, [S // 16] * 8)),
        "sink_window": (False, masks.sink_window(4095, 4)),
    }


def inputs(S: int, d: int = D, heads: int = H, kv: int = HKV, batch: int = 1):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(batch, S, heads, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(batch, S, kv, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(batch, S, kv, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(batch, S, heads, d, device=dev, dtype=torch.bfloat16, generator=g)
    return q, k, v, do


def flex_fn(mask, causal: bool, S: int, window: tuple[int, int] = (-1, -1)):
    """The case as one flex ``mask_mod`` on global positions: the mask, causal, a left window."""
    fn = mask.mod(dev, S) if hasattr(mask, "mod") else mask
    left = window[0]
    if fn is None:
        return lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= left)
    if not causal:
        return fn
    return lambda b, h, qi, ki: fn(b, h, qi, ki) & (ki <= qi)


def block_mask(fn, S: int, check: bool) -> BlockMask:
    """``create_block_mask(fn, None, None, S, S)``'s block mask, ``fn`` evaluated on a slab of query rows at a time
    (no S x S mask, no compile per mask); with ``check``, compared with ``create_block_mask``'s own (eager)."""
    T = 128
    assert S % T == 0, S
    rows = max(T, (1 << 26) // S // T * T)
    kv = torch.arange(S, device=dev)
    zero = torch.zeros((), dtype=torch.long, device=dev)
    partial, full = [], []
    for a in range(0, S, rows):
        qi = torch.arange(a, min(a + rows, S), device=dev)
        seen = fn(zero, zero, qi[:, None], kv[None, :]).expand(qi.shape[0], S)
        seen = seen.reshape(-1, T, S // T, T).sum((1, 3))
        full.append(seen == T * T)
        partial.append((seen > 0) & (seen < T * T))

    def ordered(tiles):
        num = tiles.sum(-1, dtype=torch.int32)[None, None]
        idx = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num, idx[None, None].contiguous()
    bm = BlockMask.from_kv_blocks(*ordered(torch.cat(partial)), *ordered(torch.cat(full)), BLOCK_SIZE=T,
                                  mask_mod=fn, seq_lengths=(S, S))
    if check:
        ref = create_block_mask(fn, None, None, S, S, device=dev)
        for f in ("kv_num_blocks", "full_kv_num_blocks"):
            assert torch.equal(getattr(bm, f), getattr(ref, f)), f
        assert torch.equal(bm.to_dense(), ref.to_dense())
    return bm


class Chosen(logging.Handler):
    """The kernels seqpar chose (``seqpar.kernels``' INFO line per new signature) as "mask kind: kernel", marked
    "(train)" in a training call's plan and "[name]" when a kernel was named."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("kernel=%s -> %s for %s"):
            name, kern, call = record.args
            tag = f"{call.mask}: {kern}" + (" (train)" if call.training else "")
            tag += "" if name == "auto" else f" [{name}]"
            if tag not in self.seen:
                self.seen.append(tag)


CHOSEN = Chosen()
logging.getLogger("seqpar.kernels").addHandler(CHOSEN)
logging.getLogger("seqpar.kernels").setLevel(logging.INFO)
ROWS: list[dict] = []


def timed(call, t, args) -> tuple[float, float]:
    """Median ms of ``call(q, k, v)`` forward, and forward+backward, on the tensors ``t = (q, k, v, do)``."""
    q, k, v, do = t

    def fwd():
        with torch.no_grad():
            call(q, k, v)

    def fb():
        call(q, k, v).backward(do)
    return (time_ms(fwd, dev, warmup=args.warmup, iters=args.iters),
            time_ms(fb, dev, warmup=args.warmup, iters=args.iters))


def flex_call(bm, score_mod=None):
    def call(q, k, v):
        o = FLEX(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, score_mod=score_mod,
                 enable_gqa=True)
        return o.transpose(1, 2)
    return call


def ours_call(**kw):
    return lambda q, k, v: seqpar.attention(q, k, v, **kw)


def side_by_side(flex, ours, t, S: int) -> dict[str, float]:
    """Median ms of flex and seqpar in each mode - no-grad forward, a training step's forward (inputs that
    require grad, no backward), forward+backward - as interleaved bursts of back-to-back calls (``burst_ms``: the
    six functions take turns round by round, so a clock that drifts moves them alike; at 128K bursts of 2)."""
    q, k, v, do = t

    def modes(call):
        def fwd():
            with torch.no_grad():
                call(q, k, v)

        def fb():
            call(q, k, v).backward(do)
        return {"fwd": fwd, "train_fwd": lambda: call(q, k, v), "fb": fb}
    fns = {f"{who}_{mode}": fn for who, call in (("flex", flex), ("seqpar", ours)) for mode, fn in modes(call).items()}
    return burst_ms(fns, dev, burst=10 if S <= 16384 else 2, rounds=7 if S <= 16384 else 3, warmup=2)


def max_diff(a, b, t) -> float:
    return (a(*t[:3]).float() - b(*t[:3]).float()).abs().max().item()


WINDOW = (4095, 0)


def w1_cases(S: int, large: list[str]) -> list[tuple[str, bool, object, tuple[int, int]]]:
    """(name, causal, mask_mod, window) of the w1 section at length S."""
    cases = [(name, causal, m, (-1, -1)) for name, (causal, m) in named(S).items()]
    causal, sp = named(S)["shared_prefix"]
    cases.append(("generic mask_mod (shared prefix as a function)", causal, sp.mod(dev, S), (-1, -1)))
    cases.append((f"window {WINDOW[0]} (window_size=)", True, None, WINDOW))
    if S > 16384:
        cases = [c for c in cases if c[0].split()[0] in large]
    return cases


def w1(args) -> None:
    """seqpar (W = 1) against flex directly, per named mask and length, a generic mask_mod and a plain window."""
    group(1)
    for S in args.sizes:
        t = inputs(S)
        for name, causal, m, window in w1_cases(S, args.large_masks):
            t0 = time.perf_counter()
            try:
                fn = flex_fn(m, causal, S, window)
                flex = flex_call(block_mask(fn, S, check=S <= 16384))
                ours = ours_call(causal=causal, mask_mod=m, window_size=window, layout="contiguous")
                select.cache_clear()            # every case logs the kernels it chose
                CHOSEN.seen.clear()
                err = max_diff(ours, flex, t) if S <= 16384 else None
                ms = side_by_side(flex, ours, t, S)
                f_fwd, f_tr, f_fb = ms["flex_fwd"], ms["flex_train_fwd"], ms["flex_fb"]
                o_fwd, o_tr, o_fb = ms["seqpar_fwd"], ms["seqpar_train_fwd"], ms["seqpar_fb"]
                rec = dict(section="w1", label="W = 1", timing="interleaved bursts", mask=name, seq_len=S,
                           causal=causal, window=window,
                           flex_fwd_ms=f_fwd, flex_fb_ms=f_fb, seqpar_fwd_ms=o_fwd, seqpar_fb_ms=o_fb,
                           ratio_fwd=o_fwd / f_fwd, ratio_fb=o_fb / f_fb, flex_train_fwd_ms=f_tr,
                           seqpar_train_fwd_ms=o_tr, ratio_train_fwd=o_tr / f_tr, seqpar_kernels=list(CHOSEN.seen),
                           max_abs_diff_vs_flex=err)
                if m is None:                   # the same call on FA2: auto's choice before Note [Bands on flex]
                    fa2 = timed(ours_call(causal=causal, window_size=window, layout="contiguous", kernel="flash"),
                                t, args)
                    rec.update(seqpar_fa2_fwd_ms=fa2[0], seqpar_fa2_fb_ms=fa2[1])
                if S <= 16384 and any(x in CHOSEN.seen for x in ("band: flex (train)", "joined: flex (train)")):
                    named_flex = ours_call(causal=causal, mask_mod=m, window_size=window, layout="contiguous",
                                           kernel="flex")      # a no-grad forward on flex: what auto declines
                    rec.update(seqpar_flex_fwd_ms=timed(named_flex, t, args)[0])
                W1[(S, name)] = (o_fwd, o_fb)
                ROWS.append(rec)
                emit(**rec, wall_s=time.perf_counter() - t0)
            except Exception as e:          # a record of the failure, then the next case
                emit(section="w1", label="W = 1", mask=name, seq_len=S, error=f"{type(e).__name__}: {e}"[:400])
        del t
        torch.cuda.empty_cache()
        table()


def table() -> None:
    """The w1 rows so far as a markdown table (printed after each length, so a run cut short keeps its rows): ms
    of the forward (no grad), the forward of a training step, and forward+backward."""
    print("\n| mask | length | flex fwd / train fwd / fwd+bwd | seqpar | seqpar / flex | seqpar's kernels (auto) |",
          flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    for r in ROWS:
        ours = f"{r['seqpar_fwd_ms']:.2f} / {r['seqpar_train_fwd_ms']:.2f} / {r['seqpar_fb_ms']:.2f}"
        if "seqpar_fa2_fwd_ms" in r:
            ours += f" (FA2: {r['seqpar_fa2_fwd_ms']:.2f} / - / {r['seqpar_fa2_fb_ms']:.2f})"
        if "seqpar_flex_fwd_ms" in r:
            ours += f" (kernel='flex' fwd: {r['seqpar_flex_fwd_ms']:.2f})"
        flex = f"{r['flex_fwd_ms']:.2f} / {r['flex_train_fwd_ms']:.2f} / {r['flex_fb_ms']:.2f}"
        ratio = f"**{r['ratio_fwd']:.2f} / {r['ratio_train_fwd']:.2f} / {r['ratio_fb']:.2f}**"
        kernels = ", ".join(r["seqpar_kernels"])
        print(f"| {r['mask']} | {r['seq_len'] // 1024}K | {flex} | {ours} | {ratio} | {kernels} |", flush=True)


def _capped(cap: torch.Tensor):
    def score_mod(score, b, h, qi, ki):
        return cap * torch.tanh(score / cap)
    return score_mod


def softcap(args) -> None:
    """seqpar's softcap (W = 1, causal) against flex with the same causal block mask and score_mod."""
    group(1)
    S = 16384
    for d in (128, 256):
        t = inputs(S, d)
        bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, S, S, device=dev)
        flex = flex_call(bm, _capped(torch.tensor(30.0, device=dev)))
        ours = ours_call(causal=True, softcap=30.0, layout="contiguous")
        err = max_diff(ours, flex, t)
        f_fwd, f_fb = timed(flex, t, args)
        o_fwd, o_fb = timed(ours, t, args)
        emit(section="softcap", label="W = 1", seq_len=S, head_dim=d, flex_fwd_ms=f_fwd, flex_fb_ms=f_fb,
             seqpar_fwd_ms=o_fwd, seqpar_fb_ms=o_fb, ratio_fwd=o_fwd / f_fwd, ratio_fb=o_fb / f_fb,
             max_abs_diff_vs_flex=err)
        del t
        torch.cuda.empty_cache()


def rl(args) -> None:
    """One 16K prompt and 8 responses of 2K: the tree mask on 32K tokens against 8 prompt copies (144K tokens
    as 8 causal documents), attention forward+backward at W = 1."""
    group(1)
    P, R, N = 16384, 2048, 8
    tree = masks.shared_prefix(P, [R] * N)
    S_tree, S_dup = P + N * R, N * (P + R)
    pairs_tree = P * (P + 1) // 2 + N * (R * P + R * (R + 1) // 2)
    pairs_dup = N * ((P + R) * (P + R + 1) // 2)
    t_fwd, t_fb = timed(ours_call(causal=False, mask_mod=tree, layout="contiguous"), inputs(S_tree), args)
    cu = tuple(i * (P + R) for i in range(N + 1))
    d_fwd, d_fb = timed(ours_call(causal=True, cu_seqlens=cu, layout="contiguous"), inputs(S_dup), args)
    emit(section="rl", label="W = 1", prompt=P, responses=N, response_len=R, tokens_tree=S_tree,
         tokens_duplicated=S_dup, pairs_tree=pairs_tree, pairs_duplicated=pairs_dup,
         flops_saved=pairs_dup / pairs_tree, tree_fwd_ms=t_fwd, tree_fb_ms=t_fb, dup_fwd_ms=d_fwd, dup_fb_ms=d_fb,
         speedup_fb=d_fb / t_fb)
    torch.cuda.empty_cache()


def emulated_rank(method: str, layout: str, S: int, causal: bool, m, W: int):
    """``(cu_seqlens, rank, per-rank work)`` of a configuration emulated as its busiest rank of W: balanced places
    the mask's work over one document ``(0, S)``; Ulysses gives every rank the same work (rank 0)."""
    docs = (0, S) if layout == "balanced" else None
    lay = make_layout(layout, W, docs, Rule(causal, mask=m) if docs and m is not None else None)
    per = work(lay, S, Rule(causal, mask=m), docs)
    return docs, 0 if method == "ulysses" else max(range(W), key=lambda r: (per[r], -r)), per


def emulated(args) -> None:
    """Compute-path efficiency of the busiest of 8 ranks per named mask (and causal), against seqpar W = 1 on
    the whole sequence: efficiency = T(W = 1) / 8 / T(busiest rank)."""
    W = 8
    for S in args.sizes:
        cases = {"causal": (True, None), **named(S)}
        if args.emulated_masks:
            cases = {n: c for n, c in cases.items() if n.split()[0] in args.emulated_masks}
        for method, layout in args.emulated_methods:
            for name, (causal, m) in cases.items():
                try:
                    if (S, name) not in W1:
                        group(1)
                        W1[(S, name)] = timed(ours_call(causal=causal, mask_mod=m, layout="contiguous"), inputs(S),
                                              args)
                    base = W1[(S, name)]
                    docs, rank, per = emulated_rank(method, layout, S, causal, m, W)
                    group(W, rank)
                    ours = timed(ours_call(causal=causal, mask_mod=m, method=method, layout=layout, cu_seqlens=docs,
                                           check_ranks=False), inputs(S // W), args)
                    emit(section="emulated", label=f"emulated W = 8 (rank {rank} of 8, fake group)", mask=name,
                         method=method, layout=layout, seq_len=S, tokens_per_rank=S // W, emulated_world=W,
                         emulated_rank=rank, w1_fwd_ms=base[0], w1_fb_ms=base[1], rank_fwd_ms=ours[0],
                         rank_fb_ms=ours[1], compute_efficiency_fwd=base[0] / W / ours[0],
                         compute_efficiency_fb=base[1] / W / ours[1], busiest_over_mean=max(per) / (sum(per) / W))
                except Exception as e:
                    emit(section="emulated", mask=name, method=method, seq_len=S,
                         error=f"{type(e).__name__}: {e}"[:400])
                torch.cuda.empty_cache()


def profile(args) -> None:
    """Where seqpar's time goes, per ``--profile-cases`` entry ``mask:S:where:mode``: ``where`` is ``w1`` (one
    process, the whole sequence) or ``method/layout`` (the busiest of 8 ranks on a fake group, as in the emulated
    section); ``mode`` is ``fwd`` (no grad) or ``fb`` (forward+backward). torch.profiler's CUDA kernels, most time
    first, and the kernel count."""
    for case in args.profile_cases:
        name, size, where, mode = case.split(":")
        S = int(size)
        causal, m = (True, None) if name == "causal" else named(S)[name]
        if where == "w1":
            group(1)
            kw, n = {"layout": "contiguous"}, S
        else:
            method, layout = where.split("/")
            docs, rank, _ = emulated_rank(method, layout, S, causal, m, 8)
            group(8, rank)
            kw, n = {"method": method, "layout": layout, "check_ranks": False, "cu_seqlens": docs}, S // 8
        _profile_one(case, ours_call(causal=causal, mask_mod=m, **kw), inputs(n), mode == "fwd")
        torch.cuda.empty_cache()


def _profile_one(case: str, ours, t, no_grad: bool) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    q, k, v, do = t

    def call():
        if no_grad:
            with torch.no_grad():
                ours(q, k, v)
        else:
            ours(q, k, v).backward(do)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    print(f"== profile {case}: {len(kernels)} kernels, "
          f"{sum(e.device_time for e in kernels) / 1e3:.2f} ms of kernel time", flush=True)
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=90), flush=True)


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="w1,softcap,rl,emulated")
    ap.add_argument("--emulated-methods", default="ring/zigzag,ulysses/contiguous",
                    type=lambda t: [tuple(x.split("/")) for x in t.split(",")],
                    help="method/layout pairs of the emulated section (ring/balanced: the mask's work balanced)")
    ap.add_argument("--emulated-masks", default=None, type=lambda t: t.split(","),
                    help="the emulated section's cases by first word (causal, sink_window, ...); default all")
    ap.add_argument("--sizes", default="16384,131072")
    ap.add_argument("--large-masks", default="sink_window,chunked,window", type=lambda t: t.split(","),
                    help="w1 cases (first word of the name) timed at sizes above 16K")
    ap.add_argument("--profile-cases", default="sink_window:16384:w1:fwd,chunked:131072:w1:fwd",
                    type=lambda t: t.split(","), help="the profile section's cases, mask:S:where:mode (see profile)")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    emit(section="env", torch=torch.__version__, gpu=torch.cuda.get_device_name(), seqpar=seqpar.__version__,
         command=" ".join(["masks_1gpu.py", *[f"--{k}={v}" for k, v in vars(args).items() if k != "out"]]))
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        {"w1": w1, "softcap": softcap, "rl": rl, "emulated": emulated, "profile": profile}[name](args)
        emit(section="timing", part=name, wall_s=time.perf_counter() - t0)


if __name__ == "__main__":
    main()
