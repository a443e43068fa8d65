"""The modelled link of emulated worlds (Note [Modelled link] in ``seqpar.comm.link``), on CPU; its effect on a
CUDA call is in ``tests/test_gpu_emulated.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.comm.link import Link, delay, installed, modelled
from seqpar.cost.profile import load_profile


def test_link_times_are_the_planners():
    link, prof = Link("h200-nvswitch"), load_profile("h200-nvswitch")
    for n in (4 << 20, 64 << 20, 512 << 20):
        assert link.ms("ring", n, 4) == pytest.approx(prof.link_ms("p2p", n))
    assert link.ms("a2a", 64 << 20, 4) > 0
    assert link.ms("ring", 0, 4) == 0 and link.ms("ring", 1 << 20, 1) == 0


def test_delay_leaves_other_transfers_alone():
    work, cuda = object(), torch.device("cuda", 0)
    assert installed() is None and delay(work, "ring", 1 << 20, 4, cuda) is work       # nothing installed
    with modelled(Link("h200-nvswitch")):
        assert installed().name == "h200-nvswitch"
        assert delay(work, "ring", 1 << 20, 4, torch.device("cpu")) is work            # CPU: gloo's own time
        assert delay(work, "a2a", 1 << 20, 1, cuda) is work                            # one rank moves nothing
        assert delay(work, "a2a", 0, 4, cuda) is work
        with modelled(None):
            assert installed() is None
        assert installed() is not None
    assert installed() is None


@pytest.mark.parametrize("method,layout", [("ring", "zigzag"), ("ulysses", None), ("allgather", "zigzag")])
def test_every_comm_path_runs_under_a_link_on_cpu(method, layout):
    """The comm layer's hooks (P2P, all-to-all, all-gather, reduce-scatter) run with a link installed: on CPU the
    transfers keep gloo's (here the fake group's) time."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        q, k, v = (torch.randn(1, 64, h, 16, requires_grad=True) for h in (4, 4, 4))
        with modelled(Link("h200-nvswitch")):
            out = seqpar.attention(q, k, v, method=method, layout=layout, check_ranks=False, kernel="reference")
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        dist.destroy_process_group()


def test_bench_link_needs_an_emulated_cuda_world_and_no_peers():
    from seqpar.bench.__main__ import main

    with pytest.raises(SystemExit, match="--link 'h200-nvswitch' models transfers of an emulated world on CUDA"):
        main(["--emulate-world", "2", "--link", "h200-nvswitch", "--device", "cpu", "--preset", "tiny-causal"])
    with pytest.raises(SystemExit, match="models seqpar's transfers only"):
        main(["--emulate-world", "2", "--link", "h200-nvswitch", "--device", "cuda", "--preset", "tiny-causal",
              "--peers"])


def test_report_reads_predicted_efficiency():
    from seqpar.bench.report import emulated_table

    rec = {"preset": "p", "method": "ring/zigzag", "mode": "fwd", "world_size": 4, "emulated_world": 4,
           "seq_len": 8192, "time_ms": 1.0, "efficiency": 0.5, "predicted_efficiency": 0.5, "link": "h200-nvswitch"}
    table = emulated_table([rec, dict(rec, method="ulysses", efficiency=0.6, predicted_efficiency=0.6)])
    assert "| p | 4 | 2K | fwd | 0.50 | - | 0.60 |" in table and "**0.60** (ulysses)" in table


def test_report_steady_table_reads_back_to_back_calls():
    """``--steady``: the efficiency of calls issued back to back, not the cold call's."""
    from seqpar.bench.report import emulated_table

    rec = {"preset": "p", "method": "ring/zigzag", "mode": "fwd", "world_size": 4, "emulated_world": 4,
           "seq_len": 8192, "time_ms": 1.0, "efficiency": 0.5, "compute_efficiency": 0.5,
           "steady_compute_efficiency": 0.8}
    assert "| p | 4 | 2K | fwd | 0.50 |" in emulated_table([rec])
    assert "| p | 4 | 2K | fwd | 0.80 |" in emulated_table([rec], steady=True)


def test_auto_plans_a_fake_group_on_cuda_with_free_links():
    """Note [Auto on an emulated world]: a fake group on CUDA plans with the emulated profile, or with the installed
    link's; a CPU fake group and a real group keep the device's built-in profile (None)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from seqpar.comm.link import EMULATED_PROFILE, auto_profile
    from seqpar.groups import SeqParallelGroups

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        groups = SeqParallelGroups.resolve(None, 1)
        assert auto_profile(groups, cuda) == EMULATED_PROFILE
        assert load_profile(EMULATED_PROFILE).link_ms("p2p", 1e9) < 1e-3
        assert auto_profile(groups, cpu) is None
        with modelled(Link("h200-nvswitch")):
            assert auto_profile(groups, cuda).name == "h200-nvswitch"
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        assert auto_profile(SeqParallelGroups.resolve(None, 1), cuda) is None
    finally:
        dist.destroy_process_group()


def test_probe_records_name_their_device_and_command(tmp_path):
    """``write_probe``: a header line (device, torch, argv, what the probe adds), then one line per row; no path,
    no file."""
    import json

    from seqpar.bench.report import load, write_probe

    path = tmp_path / "probe.jsonl"
    write_probe(path, [{"variant": "a", "ms": 1.5}, {"variant": "b", "ms": 2.0}], whole_row_ms={"fwd": 3.0})
    head, *rows = load([path])
    assert head["device"] and head["torch"] == torch.__version__ and isinstance(head["argv"], list)
    assert head["whole_row_ms"] == {"fwd": 3.0} and [r["variant"] for r in rows] == ["a", "b"]
    write_probe(None, [{"x": 1}])
    assert json.loads(path.read_text().splitlines()[1])["ms"] == 1.5 and len(list(tmp_path.iterdir())) == 1
