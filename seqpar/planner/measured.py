"""The measurements behind the built-in GPU profiles, and the script that turns them into JSON.

    python -m seqpar.planner.measured        # rewrites seqpar/cost/profiles/h200-nvswitch.json, h100-...

Sources (4x H200 NVSwitch host, NCCL 2.28.9, torch 2.11, bf16, B = 1, H = 32, D = 128):
ALGORITHMS.md §12.1 (link bandwidths, overlap loss) and §12.4 (single-GPU kernel times), PEERS.md §12
(more single-GPU cuDNN times). Kernel times become TFLOP/s with FLOPs = 4·S²·H·D (halved when causal);
backward rates use 2.5x the forward FLOPs over (fwd+bwd time - fwd time).

More measurements of the same host (``benchmarks/results/2026-11-21-4xh200*``):
- all-to-all: seqpar makes the equal-split ``all_to_all_single`` call; §12.1's 121-147 GB/s are the
  split-size call, its equal-split number is 298 GB/s (256 MB per peer). Below that, the fastest forward
  all-to-alls (kernel time of out + lse + q/k/v, bytes per rank) the profiler saw in the fit set's
  Ulysses rows (``A2A_PROFILED``): 282.6 GB/s at 63 MB, 281.5 at 101 MB.
- ``merge_passes``: Note [Merge share].
- ``permute_gelems``: all-gather's ``index_select`` into global order (zigzag), the median rate of the
  profiler's "other" kernels in the fit set's ``allgather/zigzag`` forward rows (``PERMUTE_PROFILED``).
- ``latency_us``: per pattern, the intercept at zero bytes of the calibrated 1 MiB and 4 MiB transfer
  times (``CALIBRATED_SMALL``, from ``profile_h200x4.json``; seqpar's own comm calls, host-timed).

Fitted (Note [Fixed-cost fit] in ``seqpar.planner.fit``; ``FIT_COMMAND`` reproduces them and a test
checks it): ``call_us``, ``step_us`` and κ (``host_overlap_loss``), on the real W = 4 run of 2026-11-26 on four
H100s (``FIT_PROFILE``; seqpar 650d1e1: all-gather by parts, so zigzag permutes nothing, Note [Gather by parts]):
its 4K-tokens-per-GPU presets (``FIT_PRESETS``) fit, its 2K one (gqa-causal-8k) checks
(``benchmarks/results/2026-11-26-4x-real-run3/planner_fit.md``; predicted vs measured and the planner's picks:
``planner_validation.md`` there): 34 of 40 fit rows within 15%, 11 of 20 check rows (refitted 2026-11-27 when the
pass-KV backward's model learnt the partials that go straight home: 35 and 10 before). The fixed costs are host
time of the same software, so the H200 profile takes the same ones. Earlier fits: 2026-11-21 (a runtime that
merged per step and launched every step from Python: 8 of 40 rows within 15%, no check row), then 2026-11-26 on
4x H200 at c2821ff (31 of 40 and 10 of 20; zigzag's all-gather still permuted its keys, which the model no longer
charges, so that run no longer fits the model as it stands).

What is not measured, and how it is filled (each says so in the profile's ``source``):
- all-gather below 256 MB: the P2P curve's shape scaled to the measured 295 GB/s at 256 MB.
- bidirectional P2P = P2P on the summed bytes (both directions share a GPU's NVSwitch egress, §12.2);
  all-pairs = the split-size all-to-all (the 3-peer numbers of §8.6 agree with it); reduce-scatter =
  all-gather.
- HBM: 80% of the datasheet bandwidth.
- ``alpha_us`` (60): the step cost of a method the fit has no rows for, and the latency of a pattern
  without one; fitted earlier to ALGORITHMS.md §12.4's 16K times.
- H100: the H200 kernel rates (same SMs and clocks: compute ~1.0x), HBM and memory scaled to the H100
  SXM datasheet (3.35 vs 4.8 TB/s, 80 vs 141 GB); links unchanged (both NVLink 4 / NVSwitch); the fitted
  fixed costs are its own (the 4x H100 run above), and the H200 profile shares them.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ..comm.link import EMULATED_PROFILE
from ..cost.profile import Curve, KernelRate, LinkRate, Profile

__all__ = ["EMULATED_FIT_COMMAND", "EMULATED_FIT_PRESETS", "FIT_COMMAND", "FIT_FILES", "FIT_PRESETS", "FIT_PROFILE",
           "H200_KERNEL_MS", "emulated_sources", "fit_sources", "h100_emulated_profile", "h100_profile", "h200_profile"]

MiB = 1 << 20

#: (kernel, causal) -> [(S, fwd ms, fwd+bwd ms)] at B=1, H=32, D=128, bf16 on one H200.
H200_KERNEL_MS: dict[tuple[str, bool], list[tuple[int, float, float]]] = {
    ("flash", True): [(4096, 0.530, 2.05), (16384, 6.46, 24.63), (32768, 25.5, 94.7), (131072, 435.5, 1525.1)],
    ("flash", False): [(4096, 0.812, 3.28), (32768, 49.9, 190.0)],
    ("cudnn", True): [(4096, 0.279, 1.16), (16384, 3.44, 13.64), (32768, 14.5, 56.7), (131072, 253.3, 919.1)],
    ("cudnn", False): [(4096, 0.433, 1.78), (16384, 6.43, 28.14), (32768, 28.9, 111.0), (65536, 112.4, 436.2)],
}

#: pattern -> [(bytes per rank, GB/s)] on the 4x H200 host (§12.1); "derived" patterns are built below.
H200_LINKS: dict[str, list[tuple[int, float]]] = {
    "p2p": [(8 * MiB, 66.0), (32 * MiB, 81.0), (64 * MiB, 130.0), (256 * MiB, 263.0), (512 * MiB, 303.0)],
}
H200_ALLGATHER_256MB = 295.0
#: a ring step on copy engines over symmetric memory (``symm_pull``: a peer-to-peer ``copy_`` between two barriers),
#: 4x H100 NV18, defaults (benchmarks/results/2026-11-27-4xh100-p2p-knobs/p2p.jsonl; NCCL's p2p there: 16.6, 65.7,
#: 111.0, 234.6): ``p2p_copy`` of the H100 and H200 profiles (Note [Copy-engine ring] in seqpar.comm.symmetric)
H100_COPY_ENGINE = [(4 * MiB, 58.1), (16 * MiB, 186.9), (64 * MiB, 299.6), (256 * MiB, 328.7)]
#: §12.1: the equal-split all-to-all (the call seqpar makes), 256 MB per peer = 768 MB per rank over 3 peers
H200_A2A_EQUAL_SPLIT = (768 * MiB, 298.0)
#: (bytes per rank, kernel ms): fastest Ulysses forward all-to-alls in the fit set's profiler traces
#: (probe run: gqa-causal-16k and mha-full-16k, out + lse + q/k/v)
A2A_PROFILED = ((63_307_776, 0.224), (101_056_512, 0.359))
#: (elements, ms): "other" kernel time (the index_select) of the fit set's allgather/zigzag forward rows: probe and
#: table mha-causal-16k, gqa-causal-16k; probe mha-causal-128k
PERMUTE_PROFILED = ((134_217_728, 0.471), (134_217_728, 0.489), (33_554_432, 0.123), (33_554_432, 0.127),
                    (1_073_741_824, 4.03))
#: pattern -> (ms at 1 MiB, ms at 4 MiB) per rank, seqpar's comm calls host-timed by python -m seqpar.calibrate
#: on the same host (benchmarks/results/2026-11-21-4xh200/profile_h200x4.json, its 1 and 4 MiB points)
CALIBRATED_SMALL: dict[str, tuple[float, float]] = {
    "p2p": (0.157446, 0.170063), "p2p_bidir": (0.097073, 0.104597), "a2a": (0.048581, 0.074494),
    "allgather": (0.069646, 0.098047), "reduce_scatter": (0.049041, 0.065882), "allpairs": (0.143938, 0.126369),
}

_HEADS, _HEAD_DIM = 32, 128
ALPHA_US = 60.0
LAUNCH_US = 10.0

# Note [Merge share]
#     A planned call merges its steps' partial outputs once, at its end (Note [One merge per call] in
#     seqpar.kernels.combine): one Triton pass that reads each bf16 partial and its lse once and writes the
#     output. The cost model charges each merged step (every step but the first) a share of it, in fp32
#     accumulator passes over the step's rows (Note [Step time] in seqpar.cost.model). Measured: the ``_combine``
#     kernel of a ring/zigzag forward, GQA 32/8, D 128, 2K tokens per rank (torch.profiler in
#     benchmarks/gpu/probe_host.py, emulated rank 0 on one H100, 2026-11-26,
#     benchmarks/results/2026-11-26-h100-graph-copies/run1-per-list/probe.tgz): 30.2 us for the 3 merged steps
#     of 2048 rows at W = 4, 53.0 us for the 7 at W = 8, i.e. 0.80 and 0.60 passes at 80% of the H100's HBM
#     bandwidth (MERGE_MEASURED); their mean is the profiles' figure. Before one merge per call every step merged
#     into fp32 accumulators with element-wise kernels: 9.5 passes (python -m seqpar.calibrate, 2026-11-21).
#: (merged steps, rows per step, kernel us): the combine kernels measured above (H 32, D 128, on an H100)
MERGE_MEASURED = ((3, 2048, 30.2), (7, 2048, 53.0))
#: the profiles' HBM rate: 80% of the datasheet bandwidth
_H100_HBM_GBPS, _H200_HBM_GBPS = 0.8 * 3350.0, 0.8 * 4800.0


def _merge_passes() -> float:
    per = [t * 1e-6 * _H100_HBM_GBPS * 1e9 / (n * rows * _HEADS * _HEAD_DIM * 4) for n, rows, t in MERGE_MEASURED]
    return round(statistics.fmean(per), 2)


MERGE_PASSES = _merge_passes()
OVERLAP = {"p2p": 0.2, "a2a": 0.2, "allgather": 0.15}

#: the split of Note [Fixed-cost fit]: every row of these files, and these presets of the others
FIT_FILES: tuple[str, ...] = ()
FIT_PRESETS = ("gqa-causal-16k", "mha-causal-16k")
#: the profile whose measured curves the fit keeps (the run's cards)
FIT_PROFILE = "h100-nvswitch"
_RESULTS = ("2026-11-26-4x-real-run3/real/vm-4xNVIDIA_H100_80GB_HBM3-20261126-0911-real-w4-short.jsonl",)
FIT_COMMAND = ("python -m seqpar.planner.fit " + " ".join(f"benchmarks/results/{r}" for r in _RESULTS)
               + "".join(f" --fit-file benchmarks/results/{r}" for r in _RESULTS if Path(r).name in FIT_FILES)
               + f" --fit-presets {','.join(FIT_PRESETS)} --profile {FIT_PROFILE}")
#: fitted by FIT_COMMAND (µs; κ dimensionless)
CALL_US: dict[str, float] = {
    "fwd": 6.8, "bwd": 130.5,
}
STEP_US: dict[str, float] = {
    "ring/fwd": 102.1, "ring/bwd": 30.0, "allgather/fwd": 474.2, "allgather/bwd": 901.0, "ulysses/fwd": 840.2,
    "ulysses/bwd": 12.8, "usp/fwd": 404.3, "usp/bwd": 150.8, "tokenring/fwd": 0.0, "tokenring/bwd": 0.5,
    "tasp/fwd": 285.6, "tasp/bwd": 682.5, "double_ring/fwd": 113.9, "double_ring/bwd": 0.0,
}
HOST_OVERLAP_LOSS = 0.55
#: µs per query tile and head of a packed call beyond its pairs (Note [Query tiles of packed calls] in
#: ``seqpar.cost.model``): chosen on a grid against the twentieth session's packed rows, emulated W = 8 (median |error|
#: 0.47 -> 0.33, largest 0.60 -> 0.47) and checked on four real H100s (0.40 -> 0.36, 0.52 -> 0.41);
#: ``benchmarks/results/2026-11-27-h100-twenty-first/tile-fit``
VARLEN_TILE_US: dict[str, float] = {"fwd": 0.09, "bwd": 0.2}
#: TFLOP/s of a windowed band on flex, the kernel ``auto`` runs wide bands on (sm90): a causal window of 4095 at 16K
#: and 128K, its training forward and its backward (forward+backward less forward), GQA 32/8, D 128, bf16, flex with
#: constant bounds called directly in interleaved bursts - the H200's run (bounds-tma-h200.log; the H100's bounds.log
#: within 3%) in ``benchmarks/results/2026-11-28-flex-bounds-tma``; Note [Band rates] in ``seqpar.cost.model``
BAND_TFLOPS: dict[str, tuple[tuple[float, float], ...]] = {
    "fwd": ((16384, 391.1), (131072, 393.1)), "bwd": ((16384, 351.6), (131072, 346.9)),
}


# The emulated profile (Note [Auto on an emulated world] in seqpar.comm.link): the H100 profile with free transfers,
# its fixed costs fitted to the back-to-back times of an emulated table (rank r of W = 4 and 8 on one H100).
_EMULATED_DIR = "2026-11-26-h100-emulated-final-fourteenth-b/emulated-final"
_EMULATED_RESULTS = (f"{_EMULATED_DIR}/vm-4xNVIDIA_H100_80GB_HBM3-20261126-1752-w4-final.jsonl",
                     f"{_EMULATED_DIR}/vm-8xNVIDIA_H100_80GB_HBM3-20261126-1752-w8-final.jsonl")
#: the emulated fit's presets; the table's mha-full-16k rows check it
EMULATED_FIT_PRESETS = ("gqa-causal-16k", "mha-causal-16k")
EMULATED_FIT_COMMAND = ("python -m seqpar.planner.fit " + " ".join(f"benchmarks/results/{r}" for r in _EMULATED_RESULTS)
                        + f" --steady --fit-presets {','.join(EMULATED_FIT_PRESETS)} --profile {EMULATED_PROFILE}")
#: fitted by EMULATED_FIT_COMMAND (µs; κ dimensionless)
EMULATED_CALL_US: dict[str, float] = {"fwd": 0.0, "bwd": 0.0}
EMULATED_STEP_US: dict[str, float] = {
    "ring/fwd": 0.0, "ring/bwd": 137.5, "allgather/fwd": 214.8, "allgather/bwd": 459.9, "ulysses/fwd": 321.8,
    "ulysses/bwd": 0.0, "usp/fwd": 45.6, "usp/bwd": 72.4, "tokenring/fwd": 23.7, "tokenring/bwd": 126.4,
    "tasp/fwd": 83.2, "tasp/bwd": 401.9, "double_ring/fwd": 1.7, "double_ring/bwd": 232.4,
}
EMULATED_HOST_OVERLAP_LOSS = 0.35
#: GB/s of every pattern on a fake group: a GB a nanosecond, so a transfer's time is nil
FREE_GBPS = 1e9
#: GPUs on the emulated profile's one node: any emulated world is one node of free links
EMULATED_GPUS = 1 << 16


def emulated_sources(root: str | Path = ".") -> list[Path]:
    """The emulated table the emulated profile's fixed costs are fitted to, under the repository ``root``."""
    return [Path(root) / "benchmarks" / "results" / r for r in _EMULATED_RESULTS]


def _flops(S: int, causal: bool) -> float:
    return 4.0 * S * S * _HEADS * _HEAD_DIM * (0.5 if causal else 1.0)


def _kernel_rates() -> tuple[KernelRate, ...]:
    rates = []
    for (kernel, causal), rows in sorted(H200_KERNEL_MS.items()):
        mask = "causal" if causal else "full"
        fwd = [(S, _flops(S, causal) / (f * 1e-3) / 1e12) for S, f, _ in rows]
        bwd = [(S, 2.5 * _flops(S, causal) / ((fb - f) * 1e-3) / 1e12) for S, f, fb in rows]
        rates.append(KernelRate(kernel, mask, "fwd", Curve.of([(S, round(t, 1)) for S, t in fwd])))
        rates.append(KernelRate(kernel, mask, "bwd", Curve.of([(S, round(t, 1)) for S, t in bwd])))
    return tuple(rates)


def fit_sources(root: str | Path = ".") -> list[Path]:
    """The benchmark files the fit reads, under the repository ``root``."""
    return [Path(root) / "benchmarks" / "results" / r for r in _RESULTS]


def _links() -> tuple[LinkRate, ...]:
    p2p = H200_LINKS["p2p"]
    at256 = dict(p2p)[256 * MiB]
    ag = [(m, round(b * H200_ALLGATHER_256MB / at256, 1)) for m, b in p2p]
    a2a = [(m, round(m / (t * 1e-3) / 1e9, 1)) for m, t in A2A_PROFILED] + [H200_A2A_EQUAL_SPLIT]
    return (LinkRate("p2p", Curve.of(p2p)), LinkRate("a2a", Curve.of(a2a)), LinkRate("allgather", Curve.of(ag)),
            LinkRate("p2p_copy", Curve.of(H100_COPY_ENGINE)))


def _permute_gelems() -> float:
    return round(statistics.median(n / (t * 1e-3) / 1e9 for n, t in PERMUTE_PROFILED), 1)


def _latency_us() -> dict[str, float]:
    """Zero-byte intercept of the line through the 1 MiB and 4 MiB times (the smaller time if it falls)."""
    out = {}
    for pattern, (t1, t4) in CALIBRATED_SMALL.items():
        slope = (t4 - t1) / 3.0                                          # ms per MiB
        out[pattern] = round(1e3 * (t1 - slope if slope > 0 else min(t1, t4)), 1)
    return out


_SOURCE = ("kernels and links measured on a 4x H200 NVSwitch host (ALGORITHMS.md §12.1, §12.4; PEERS.md §12); "
           "a2a: the equal-split call (§12.1, 298 GB/s at 768 MB per rank) and the fastest profiled Ulysses "
           "all-to-alls of the probe run (63 and 101 MB); permute_gelems: the profiled index_select of the fit "
           "set's allgather/zigzag rows; merge_passes: the one-pass merge's profiled kernel (MERGE_MEASURED); "
           "latency_us measured by python -m "
           "seqpar.calibrate on the host (benchmarks/results/2026-11-21-4xh200/profile_h200x4.json); "
           "p2p_copy (a ring step on copy engines over symmetric memory) measured on a 4x H100 NV18 host "
           "(benchmarks/results/2026-11-27-4xh100-p2p-knobs; the same NVLink 4, so both profiles carry it); "
           "derived: allgather below 256 MB (p2p shape), p2p_bidir=p2p, allpairs=a2a, reduce_scatter=allgather; "
           "fitted: call_us, step_us and host_overlap_loss by " + FIT_COMMAND + " (fit: the real W = 4 run's "
           f"{', '.join(FIT_PRESETS)} on four H100s; check: its gqa-causal-8k; "
           "benchmarks/results/2026-11-26-4x-real-run3/planner_fit.md); alpha_us=60 for methods the fit lacks; "
           f"assumed: hbm 80% of datasheet, launch_us={LAUNCH_US}; varlen_tile_us chosen on a grid against the "
           "packed rows of benchmarks/results/2026-11-27-h100-twentieth (emulated W = 8; checked on four real H100s): "
           "benchmarks/results/2026-11-27-h100-twenty-first/tile-fit; band_tflops: flex on a causal window of 4095 "
           "(benchmarks/results/2026-11-28-flex-bounds-tma)")


def h200_profile() -> Profile:
    """The built-in H200 NVSwitch profile, from the measurements above."""
    return Profile(
        name="h200-nvswitch", device="cuda", gpu="NVIDIA H200", gpus_per_node=8, interconnect="NVSwitch (NVLink 4)",
        dtype="bfloat16", head_dim=_HEAD_DIM, default_kernel="cudnn", kernels=_kernel_rates(), links=_links(),
        alpha_us=ALPHA_US, launch_us=LAUNCH_US, hbm_gbps=_H200_HBM_GBPS, merge_passes=MERGE_PASSES,
        overlap_loss=tuple(sorted(OVERLAP.items())), memory_gib=141.0, call_us=tuple(sorted(CALL_US.items())),
        step_us=tuple(sorted(STEP_US.items())), latency_us=tuple(sorted(_latency_us().items())),
        permute_gelems=_permute_gelems(), varlen_tile_us=tuple(sorted(VARLEN_TILE_US.items())),
        band_tflops=tuple(sorted((d, Curve.of(pts)) for d, pts in BAND_TFLOPS.items())),
        host_overlap_loss=HOST_OVERLAP_LOSS, source=_SOURCE,
        meta=(("host", "4x H200 NVSwitch"), ("nccl", "2.28.9"), ("torch", "2.11"),
              ("command", "python -m seqpar.planner.measured")))


def h100_profile() -> Profile:
    """H100 SXM NVSwitch: derived from the H200 profile (compute 1.0x; HBM and memory scaled)."""
    h200 = h200_profile()
    return h200.replace(
        name="h100-nvswitch", gpu="NVIDIA H100 80GB HBM3", hbm_gbps=_H100_HBM_GBPS, memory_gib=80.0,
        derived_from="h200-nvswitch",
        source="derived from h200-nvswitch: kernel rates x1.0 (same SM count and clocks), links unchanged "
               "(NVLink 4 / NVSwitch), HBM 3.35 TB/s and 80 GB (datasheet); call_us, step_us and "
               "host_overlap_loss fitted on a 4x H100 host (below; the H200 profile shares them); " + _SOURCE)


def h100_emulated_profile() -> Profile:
    """An emulated world on one H100 (torch's fake group): the H100 profile with transfers that take no time, one
    node of any size, and fixed costs fitted to an emulated table (Note [Auto on an emulated world] in
    ``seqpar.comm.link``)."""
    from ..cost.profile import PATTERNS

    free = Curve.of([(1.0, FREE_GBPS)])
    return h100_profile().replace(
        name=EMULATED_PROFILE, gpus_per_node=EMULATED_GPUS, interconnect="none: torch's fake process group",
        links=tuple(LinkRate(p, free) for p in PATTERNS), latency_us=tuple((p, 0.0) for p in PATTERNS),
        overlap_loss=tuple((k, 0.0) for k in sorted(OVERLAP)), call_us=tuple(sorted(EMULATED_CALL_US.items())),
        step_us=tuple(sorted(EMULATED_STEP_US.items())), host_overlap_loss=EMULATED_HOST_OVERLAP_LOSS,
        derived_from="h100-nvswitch",
        source="derived from h100-nvswitch: kernel rates, HBM and merge passes kept; every transfer free (torch's "
               f"fake process group; {FREE_GBPS:g} GB/s, no latency, no overlap loss); call_us, step_us and "
               f"host_overlap_loss fitted by {EMULATED_FIT_COMMAND} (fit: {', '.join(EMULATED_FIT_PRESETS)} at "
               "W = 4 and 8, back to back; check: mha-full-16k)")


def write_builtin(root: Path | None = None) -> list[Path]:
    """Write the built-in GPU profiles as JSON (the files shipped in ``seqpar/cost/profiles``)."""
    root = root or Path(__file__).parents[1] / "cost" / "profiles"
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for prof in (h200_profile(), h100_profile(), h100_emulated_profile()):
        path = root / f"{prof.name}.json"
        prof.save(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_builtin():
        print(f"wrote {p}")
