"""The measurements behind the built-in GPU profiles, and the script that turns them into JSON.

    python -m seqpar.planner.measured        # rewrites seqpar/planner/profiles/h200-nvswitch.json, h100-...

Sources (4x H200 NVSwitch host, NCCL 2.28.9, torch 2.11, bf16, B = 1, H = 32, D = 128):
ALGORITHMS.md §12.1 (link bandwidths, overlap loss) and §12.4 (single-GPU kernel times), PEERS.md §12
(more single-GPU cuDNN times). Kernel times become TFLOP/s with FLOPs = 4·S²·H·D (halved when causal);
backward rates use 2.5x the forward FLOPs over (fwd+bwd time - fwd time).

What is not measured, and how it is filled (each says so in the profile's ``source``):
- ``alpha_us`` (per-step fixed cost) was not isolated; it is fitted to the small-S end-to-end times of
  ALGORITHMS.md §12.4 and PEERS.md §12 (16K: ring zigzag 2.9-3.4 ms fwd, 10.7 ms fwd+bwd).
- all-gather below 256 MB: the P2P curve's shape scaled to the measured 295 GB/s at 256 MB.
- bidirectional P2P = P2P on the summed bytes (both directions share a GPU's NVSwitch egress, §12.2);
  all-pairs = the split-size all-to-all (the 3-peer numbers of §8.6 agree with it); reduce-scatter =
  all-gather.
- HBM: 80% of the datasheet bandwidth; merge passes: our unfused MERGE reads and writes the fp32
  accumulator about 5 times.
- H100: the H200 kernel rates (same SMs and clocks: compute ~1.0x), HBM and memory scaled to the H100
  SXM datasheet (3.35 vs 4.8 TB/s, 80 vs 141 GB); links unchanged (both NVLink 4 / NVSwitch).
"""

from __future__ import annotations

from pathlib import Path

from .profile import Curve, KernelRate, LinkRate, Profile

__all__ = ["H200_KERNEL_MS", "h100_profile", "h200_profile"]

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
    "a2a": [(64 * MiB, 121.0), (256 * MiB, 139.0), (512 * MiB, 147.0)],
}
H200_ALLGATHER_256MB = 295.0

_HEADS, _HEAD_DIM = 32, 128
#: fitted, see the module docstring
ALPHA_US = 60.0
LAUNCH_US = 10.0
MERGE_PASSES = 5.0
OVERLAP = {"p2p": 0.2, "a2a": 0.2, "allgather": 0.15}


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


def _links() -> tuple[LinkRate, ...]:
    p2p = H200_LINKS["p2p"]
    at256 = dict(p2p)[256 * MiB]
    ag = [(m, round(b * H200_ALLGATHER_256MB / at256, 1)) for m, b in p2p]
    return (LinkRate("p2p", Curve.of(p2p)), LinkRate("a2a", Curve.of(H200_LINKS["a2a"])),
            LinkRate("allgather", Curve.of(ag)))


_SOURCE = ("kernels and links measured on a 4x H200 NVSwitch host (ALGORITHMS.md §12.1, §12.4; PEERS.md §12); "
           "derived: allgather below 256 MB (p2p shape), p2p_bidir=p2p, allpairs=a2a, reduce_scatter=allgather; "
           f"fitted: alpha_us={ALPHA_US} to the 16K end-to-end times; assumed: hbm 80% of datasheet, "
           f"merge_passes={MERGE_PASSES}, launch_us={LAUNCH_US}")


def h200_profile() -> Profile:
    """The built-in H200 NVSwitch profile, from the measurements above."""
    return Profile(
        name="h200-nvswitch", device="cuda", gpu="NVIDIA H200", gpus_per_node=8, interconnect="NVSwitch (NVLink 4)",
        dtype="bfloat16", head_dim=_HEAD_DIM, default_kernel="cudnn", kernels=_kernel_rates(), links=_links(),
        alpha_us=ALPHA_US, launch_us=LAUNCH_US, hbm_gbps=0.8 * 4800.0, merge_passes=MERGE_PASSES,
        overlap_loss=tuple(sorted(OVERLAP.items())), memory_gib=141.0, source=_SOURCE,
        meta=(("host", "4x H200 NVSwitch"), ("nccl", "2.28.9"), ("torch", "2.11"),
              ("command", "python -m seqpar.planner.measured")))


def h100_profile() -> Profile:
    """H100 SXM NVSwitch: derived from the H200 profile (compute 1.0x; HBM and memory scaled)."""
    h200 = h200_profile()
    return h200.replace(
        name="h100-nvswitch", gpu="NVIDIA H100 80GB HBM3", hbm_gbps=0.8 * 3350.0, memory_gib=80.0,
        derived_from="h200-nvswitch",
        source="derived from h200-nvswitch: kernel rates x1.0 (same SM count and clocks), links unchanged "
               "(NVLink 4 / NVSwitch), HBM 3.35 TB/s and 80 GB (datasheet); " + _SOURCE)


def write_builtin(root: Path | None = None) -> list[Path]:
    """Write the built-in GPU profiles as JSON (the files shipped in ``seqpar/planner/profiles``)."""
    root = root or Path(__file__).parent / "profiles"
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for prof in (h200_profile(), h100_profile()):
        path = root / f"{prof.name}.json"
        prof.save(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_builtin():
        print(f"wrote {p}")
