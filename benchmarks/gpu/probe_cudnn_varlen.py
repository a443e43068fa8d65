"""Does PyTorch's cuDNN attention serve packed documents from Python, and how fast is it against FA2's varlen call?

    python3 benchmarks/gpu/probe_cudnn_varlen.py [--rows 32768,131072] [--heads 4/1,32/8]

For each packed row (``seqpar.layouts.packing.packed_row``, lognormal, seed 7) and head count (query/KV heads: 4/1 is
Ulysses' share of GQA 32/8 over 8 ranks): ``aten._cudnn_attention_forward`` / ``_backward`` with ``cum_seq_q/k``
(the nested-tensor path, THD layout) against ``aten._flash_attention_forward`` / ``_backward`` with the same
``cu_seqlens``, causal: the largest differences of out, lse and the gradients, and ms per call (CUDA events,
median of 20 after 5). Prints the ops' schemas first.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from seqpar.bench.timing import rank_median_ms
from seqpar.layouts.packing import packed_row

aten = torch.ops.aten


def ms(fn) -> float:
    return rank_median_ms(fn, torch.device("cuda"), warmup=5, iters=20)


def probe(T: int, H: int, Hkv: int) -> None:
    dev, D = torch.device("cuda"), 128
    s = D ** -0.5
    cu_list = packed_row(T, "lognormal", 7)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    mx = max(b - a for a, b in itertools.pairwise(cu_list))
    torch.manual_seed(0)
    q, do = (torch.randn(T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(T, Hkv, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    tag = f"T={T} docs={len(cu_list) - 1} max={mx} H={H}/{Hkv}"

    def fa_fwd():
        return aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=s)

    o_f, lse_f, seed, off, _ = fa_fwd()

    def fa_bwd():
        return aten._flash_attention_backward(do, q, k, v, o_f, lse_f, cu, cu, mx, mx, 0.0, True, seed, off, scale=s)

    def cd_fwd():
        return aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, True, 0.0, True, False, scale=s)

    try:
        res = cd_fwd()
    except Exception as err:                       # the answer may be "no": print it
        print(f"{tag}: cuDNN nested forward failed: {type(err).__name__}: {str(err)[:400]}", flush=True)
        return
    o_c, lse_c = res[0], res[1]
    print(f"{tag}: cuDNN out {tuple(o_c.shape)} {o_c.stride()}, lse {tuple(lse_c.shape)} {lse_c.stride()} "
          f"{lse_c.dtype}; FA2 lse {tuple(lse_f.shape)}", flush=True)
    same = lse_c.numel() == lse_f.numel()
    print(f"  out max diff {float((o_c.float() - o_f.float()).abs().max()):.3e}; lse max diff as FA2's shape "
          f"{float((lse_c.reshape(lse_f.shape) - lse_f).abs().max()) if same else float('nan'):.3e}, transposed "
          f"{float((lse_c.reshape(lse_f.shape[::-1]).t() - lse_f).abs().max()) if same else float('nan'):.3e}",
          flush=True)

    def cd_bwd():
        return aten._cudnn_attention_backward(do, q, k, v, o_c, lse_c, res[6], res[7], None, cu, cu, mx, mx, 0.0,
                                              True, scale=s)
    try:
        g_c = cd_bwd()
    except Exception as err:
        print(f"{tag}: cuDNN nested backward failed: {type(err).__name__}: {str(err)[:400]}", flush=True)
        g_c = None
    if g_c is not None:
        for name, a, b in zip(("dq", "dk", "dv"), g_c, fa_bwd()):
            ref = float(b.float().abs().max())
            print(f"  {name} max diff {float((a.float() - b.float()).abs().max()):.3e} (|FA2| max {ref:.3e})")
    f_fa, f_cd = ms(fa_fwd), ms(cd_fwd)
    line = f"  ms fwd FA2 {f_fa:.3f} cuDNN {f_cd:.3f} ({f_fa / f_cd:.2f}x)"
    if g_c is not None:
        b_fa, b_cd = ms(fa_bwd), ms(cd_bwd)
        line += f"; bwd FA2 {b_fa:.3f} cuDNN {b_cd:.3f} ({b_fa / b_cd:.2f}x)"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32768,131072")
    ap.add_argument("--heads", default="4/1,32/8")
    args = ap.parse_args()
    print(aten._cudnn_attention_forward.default._schema)
    print(aten._cudnn_attention_backward.default._schema)
    for T in map(int, args.rows.split(",")):
        for hh in args.heads.split(","):
            probe(T, *map(int, hh.split("/")))


if __name__ == "__main__":
    main()
