"""``python -m seqpar plan``: ask the planner what to use, or simulate a cluster.

    python -m seqpar plan --gpus 4 --seq-len 128k --heads 32 --kv-heads 8          # ranking + reason
    python -m seqpar plan --gpus 8,64,1024 --seq-len 1m --topology nvswitch --plot sim.png
    python -m seqpar plan --gpus 8 --seq-len 64k --topology mi300x --methods ring,tasp
    python -m seqpar plan --gpus 8 --seq-len 128k --kv-heads 8 --cached 120k --layers 32   # + prefill and decode

One GPU count and one length print the full ranking (every configuration, time, efficiency, memory,
exposed communication, and the reason for the choice; with ``--cached``, prefill of the uncached tokens and
decode too); several print the simulator's table (each method's best configuration per point) and, with
``--plot``, a figure. ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..cost.profile import builtin_profiles, load_profile
from ..cost.topology import PRESETS
from .search import plan
from .simulate import plot, simulate, table, to_records

__all__ = ["main", "parse_tokens"]


def parse_tokens(text: str) -> int:
    """"131072", "128k", "1m" -> tokens (k = 1024)."""
    t = text.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a length must look like 131072, 128k or 1m, got {text!r}") from None


def _ints(text: str) -> list[int]:
    return [parse_tokens(x) for x in text.split(",") if x]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m seqpar plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=_ints, default=[4], help="GPU counts (sequence-parallel degree), comma-separated")
    ap.add_argument("--seq-len", type=_ints, default=[131072], help="global lengths, comma-separated (128k, 1m)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--grad-dtype", default="float32")
    ap.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd+bwd")
    ap.add_argument("--profile", default="h200-nvswitch", help=f"built-in {builtin_profiles()} or a JSON path")
    ap.add_argument("--topology", default=None,
                    help=f"host (the profile's node) or one of {sorted(PRESETS)}; default: host when the GPUs fit "
                         "in one node, else nvswitch")
    ap.add_argument("--kernel", default=None, help="local kernel (default: the profile's default kernel)")
    ap.add_argument("--methods", default="all", help="all (every registered method with a cost model) or a comma list")
    ap.add_argument("--memory-gib", type=float, default=None, help="per-device memory limit (default: profile)")
    ap.add_argument("--top", type=int, default=None, help="ranking rows to print")
    ap.add_argument("--cached", type=parse_tokens, default=None,
                    help="tokens already in the KV cache (one GPU count and length): adds prefill and decode")
    ap.add_argument("--layers", type=int, default=1, help="layers of KV cache (with --cached)")
    ap.add_argument("--transports", default="nccl",
                    help="how the transfers of methods with a transport option may move, comma-separated: nccl, "
                         "copy_engine (one host; the ring's and USP's ring hops from the profile's p2p_copy; "
                         "Ulysses' not modelled); one --gpus count and one --seq-len")
    ap.add_argument("--mask", type=_mask, default=None,
                    help="a named mask, NAME:INTS: chunked:8192, sink_window:4095,4, prefix_lm:4096, block_causal:512, "
                         "shared_prefix:PROMPT,RESPONSE,... (one --gpus count and one --seq-len)")
    ap.add_argument("--plot", default=None, help="write a PNG (needs matplotlib)")
    ap.add_argument("--json", default=None, help="write the rows as JSON")
    return ap


_MASKS = ("chunked", "sink_window", "prefix_lm", "block_causal", "shared_prefix")


def _mask(text: str):
    """``NAME:INT,...`` as the named mask ``seqpar.masks.NAME(*ints)`` (shared_prefix: the prompt, then the
    responses)."""
    from .. import masks

    name, _, rest = text.partition(":")
    if name not in _MASKS:
        raise argparse.ArgumentTypeError(f"--mask must name one of {list(_MASKS)}, got {name!r}")
    try:
        ints = [int(x) for x in rest.split(",") if x.strip()]
        return masks.shared_prefix(ints[0], ints[1:]) if name == "shared_prefix" else getattr(masks, name)(*ints)
    except (ValueError, TypeError, IndexError) as e:
        raise argparse.ArgumentTypeError(f"--mask {text!r}: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m seqpar plan``; returns the exit status."""
    ap = _parser()
    args = ap.parse_args(list(argv) if argv is not None else None)
    prof = load_profile(args.profile)
    names: tuple[str, ...] | str = args.methods if args.methods in ("all", "available") else \
        tuple(m.strip() for m in args.methods.split(",") if m.strip())
    common = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, batch=args.batch,
                  causal=args.causal, window=tuple(args.window), dtype=args.dtype, grad_dtype=args.grad_dtype,
                  profile=prof, kernel=args.kernel, memory_gib=args.memory_gib)

    def topo(W: int) -> str | None:
        if args.topology is not None:
            return args.topology
        return None if W <= prof.gpus_per_node else "nvswitch"

    if args.mask is not None and args.json:
        ap.error("--json writes the simulator's rows, which plan no mask; drop --json or --mask")
    if len(args.gpus) == 1 and len(args.seq_len) == 1:
        W, S = args.gpus[0], args.seq_len[0]
        ranking = plan(seq_len=S, world=W, mode=args.mode, topology=topo(W), methods=names, pad=True,
                       cached=args.cached, layers=args.layers, transports=args.transports.split(","),
                       mask_mod=args.mask, **common)
        print(ranking.table(args.top))
        if args.json:
            rows = simulate(gpus=[W], seq_lens=[S], methods=names, mode=args.mode, topology=topo(W), **common)
            _write_json(args.json, rows)
        return 0
    for flag, given in (("--transports", args.transports != "nccl"), ("--cached", args.cached is not None),
                        ("--mask", args.mask is not None)):
        if given:
            ap.error(f"{flag} needs one --gpus count and one --seq-len, got {len(args.gpus)} and {len(args.seq_len)}")
    rows = []
    for W in args.gpus:
        rows += simulate(gpus=[W], seq_lens=args.seq_len, methods=names, mode=args.mode, topology=topo(W), **common)
    where = args.topology or f"host / nvswitch beyond {prof.gpus_per_node}"
    print(f"{args.mode}, profile {prof.name}, topology {where}, H={args.heads}/{args.kv_heads or args.heads} "
          f"D={args.head_dim} B={args.batch} {'causal' if args.causal else 'full'}")
    print(table(rows))
    if args.json:
        _write_json(args.json, rows)
    if args.plot:
        print(plot(rows, args.plot, title=f"{args.mode} on {where} ({prof.name})"))
    return 0


def _write_json(path: str, rows) -> None:
    with open(path, "w") as f:
        json.dump(to_records(rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
