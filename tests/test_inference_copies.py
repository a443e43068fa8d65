"""Host-to-device copies of the inference path: every host index reaches the device through one helper,
``seqpar.inference.cache.host_to_device`` (pinned memory and a non-blocking copy on CUDA, since a pageable
copy waits for the device queue to drain; unchanged on CPU). Single process, CPU: the CUDA branch is checked
on a stand-in tensor, the call sites by recording the helper's calls."""

from __future__ import annotations

import torch

from seqpar.inference import cache as cache_mod
from seqpar.inference import extend
from seqpar.inference.plans import RowGroup


class _HostTensor:
    """Stands in for a CPU tensor: records pin_memory() and the copy's arguments."""

    device = torch.device("cpu")

    def __init__(self):
        self.calls: list = []

    def pin_memory(self):
        self.calls.append("pin_memory")
        return self

    def to(self, device, non_blocking=False):
        self.calls.append(("to", torch.device(device), non_blocking))
        return self


def test_host_to_device_pins_and_does_not_block_for_cuda():
    x = _HostTensor()
    assert cache_mod.host_to_device(x, torch.device("cuda", 0)) is x
    assert x.calls == ["pin_memory", ("to", torch.device("cuda", 0), True)]
    y = _HostTensor()
    cache_mod.host_to_device(y, torch.device("cpu"))
    assert y.calls == [("to", torch.device("cpu"), False)]            # CPU: a plain .to, nothing pinned


def test_row_group_indices_go_through_the_helper(monkeypatch):
    """``Partials`` with two row groups (batch rows that start at different cache positions): the row indices
    of the selection (add_copy) and of the scatter back (result) are made on the host and handed to the helper;
    the result on CPU is what it was (one partial merged is itself)."""
    seen: list[tuple[torch.device, torch.device, list[int]]] = []

    def recording(x: torch.Tensor, device: torch.device) -> torch.Tensor:
        seen.append((x.device, device, x.tolist()))
        return cache_mod.host_to_device(x, device)

    monkeypatch.setattr(extend, "host_to_device", recording)
    g = torch.Generator().manual_seed(0)
    out_BSHD = torch.randn(3, 2, 2, 4, generator=g)
    lse_BHS = torch.randn(3, 2, 2, generator=g)
    groups = (RowGroup(0, (0, 2)), RowGroup(3, (1,)))
    acc = extend.Partials(extend.out_like(torch.empty(3, 2, 2, 4), 4), groups)
    acc.add_copy(out_BSHD, lse_BHS)
    out, lse = acc.result(torch.float32)
    assert torch.equal(out, out_BSHD) and torch.equal(lse, lse_BHS)
    assert seen and all(src.type == "cpu" and dst == out_BSHD.device for src, dst, _ in seen)
    assert sorted(rows for _, _, rows in seen) == [[0, 2], [0, 2], [0, 2], [1], [1], [1]]
