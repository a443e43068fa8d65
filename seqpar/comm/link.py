"""A modelled link for emulated worlds: each transfer holds a stream of its own for its modelled time.

    with modelled(Link("h200-nvswitch")):     # python -m seqpar.bench --emulate-world 8 --link h200-nvswitch
        seqpar.attention(...)                           # on a fake group: transfers now take time

Note [Modelled link]
    On torch's fake process group (Note [Emulated world] in ``seqpar.bench``) every transfer completes at once, so an
    emulated rank's time is its compute path alone: on four H200s it put seqpar's configurations a median 28%
    above their real efficiency (``benchmarks/results/2026-11-26-4xh200-real-run2/``). With a ``Link`` installed,
    the comm layer hands each posted transfer to ``delay``: on the link's own CUDA stream, once the posting stream
    has reached the post (the data is ready), a spin kernel (``torch.cuda._sleep``) holds the stream for the
    transfer's modelled time, and the transfer's ``wait()`` makes the waiting stream wait for it. Transfers queue
    one after another on that stream, as on one link, and a wait exposes what the kernels did not hide.

    The time is the planner's (``seqpar.cost.topology.Network.ms``: the profile's measured curve for the pattern,
    the bytes a rank moves, the group's size): P2P steps ("ring", the bytes received), all-to-all ("a2a", the bytes
    bound for other ranks), all-gather and reduce-scatter (the bytes from or to other ranks). Only seqpar's comm
    layer is modelled (the peers call torch.distributed themselves). Still unseen: NCCL's own SMs and memory
    traffic beside the kernels (the spin is one thread), contention with other ranks, stragglers. CUDA only.
    A captured graph records the spins with the kernels, so a plan graphed before the link was installed replays
    without it: install the link before a plan's first call (the bench installs it for the whole run).

Note [Fake groups copy]
    torch's fake process group "moves no data" but still fills its outputs (a C++ ``copy_`` on the calling stream,
    so that autograd sees defined values; ``FakeProcessGroup.hpp``): an all-gather writes the input into each of
    the W slots of its output, an all-to-all copies its whole input, a reduce-scatter one slot. On a GPU those
    copies are kernels in the emulated rank's own stream: on torch 2.11, at 2K tokens per rank over 8, MHA, 8
    copies of 32 MiB (190 us) in every all-gather of K and V, more than a third of the call's attention (the
    Ulysses all-to-alls' GPU time did not change with this, so that torch's all-to-all was not copying). A real
    backend writes from its own kernels on its own stream, which the emulation leaves out on purpose (what it
    cannot see: NCCL's SMs). So the comm layer hands a fake group empty views of its buffers (``wire``): the
    collective is still posted through torch.distributed (its host cost stays in the figure), and nothing is
    copied. Results on a fake group are undefined either way. Send and receive copy nothing on a fake group and
    are posted as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["EMULATED_PROFILE", "Link", "auto_profile", "cycles_per_ms", "delay", "installed", "modelled", "wire"]

_LINK: Link | None = None
_CYCLES_PER_MS: dict[torch.device, float] = {}


def cycles_per_ms(device: torch.device) -> float:
    """Spin-kernel (``torch.cuda._sleep``) cycles per millisecond on ``device``, measured once, outside any capture."""
    if device not in _CYCLES_PER_MS:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the spin kernel has not been timed on {device} yet, and a CUDA graph is being "
                               f"captured: time it (seqpar.comm.link.cycles_per_ms) while {device} is current")
        n = 20_000_000
        with torch.cuda.device(device):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(n)                      # warm-up
            a.record()
            torch.cuda._sleep(n)
            b.record()
            b.synchronize()
            _CYCLES_PER_MS[device] = n / a.elapsed_time(b)
    return _CYCLES_PER_MS[device]


class Link:
    """Transfer times from a planner profile (a built-in name, a JSON path or a ``Profile``) on its host topology."""

    def __init__(self, profile: Any):
        from ..cost.profile import load_profile
        from ..cost.topology import Network, get_topology

        prof = load_profile(profile)
        self.name, self.profile = prof.name, prof
        self.network = Network(get_topology(None, prof), prof)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        if torch.cuda.is_available():       # calibrate now: the first transfer may come inside a graph capture
            cycles_per_ms(torch.device("cuda", torch.cuda.current_device()))

    def ms(self, pattern: str, nbytes: float, size: int) -> float:
        """The modelled time of one ``pattern`` moving ``nbytes`` per rank in a group of ``size``."""
        from ..cost.topology import Group

        return self.network.ms(pattern, nbytes, Group(size))

    def occupy(self, pattern: str, nbytes: float, size: int, device: torch.device) -> torch.cuda.Event:
        """Hold the link's stream for the transfer's time after the current stream's work so far; the event."""
        cycles = int(self.ms(pattern, nbytes, size) * cycles_per_ms(device))
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        here = torch.cuda.current_stream(device)
        stream.wait_stream(here)
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            if cycles > 0:
                torch.cuda._sleep(cycles)
            done.record(stream)
        return done


class _Delayed:
    """A transfer's work whose ``wait()`` also waits for its modelled time."""

    def __init__(self, work: Any, done: torch.cuda.Event):
        self._work, self._done = work, done

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
        torch.cuda.current_stream().wait_event(self._done)
        return True


def installed() -> Link | None:
    """The link in use, or None (transfers take the time the process group gives them)."""
    return _LINK


@contextlib.contextmanager
def modelled(link: Link | None) -> Iterator[None]:
    """Model ``link`` for the transfers posted inside (None: none)."""
    global _LINK
    before, _LINK = _LINK, link
    try:
        yield
    finally:
        _LINK = before


def delay(work: Any, pattern: str, nbytes: float, size: int, device: torch.device) -> Any:
    """``work`` as it is, or - with a link installed and a CUDA transfer - one whose ``wait()`` also waits for the
    transfer's modelled time (Note [Modelled link])."""
    if _LINK is None or device.type != "cuda" or size <= 1 or nbytes <= 0:
        return work
    return _Delayed(work, _LINK.occupy(pattern, nbytes, size, device))


def _fake(group: Any) -> bool:
    """Whether ``group`` (None: the default group) is torch's fake process group (every transfer completes at once,
    moving nothing)."""
    return dist.is_initialized() and dist.get_backend(group) == "fake"


def wire(group: Any, *buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The buffers a collective over ``group`` is given: as they are, or on torch's fake process group empty
    views, so the collective is posted but copies nothing (Note [Fake groups copy])."""
    return tuple(b[:0] for b in buffers) if _fake(group) else buffers


EMULATED_PROFILE = "h100-emulated"
"""The built-in profile ``method="auto"`` plans an emulated world with (Note [Auto on an emulated world])."""


def auto_profile(groups: Any, device: torch.device) -> Any:
    """The profile ``method="auto"`` plans with when the caller names none: None (the device's built-in) on a real
    group; on torch's fake group on CUDA, the installed ``Link``'s profile, else ``EMULATED_PROFILE``.

    Note [Auto on an emulated world]
        A fake group's transfers are free, so the best method of an emulated rank is the one with the leanest
        compute path, where the built-in profiles rank methods by their real links' times (at 2K tokens per rank
        over 8, auto's forward picks were Ulysses, TASP, USP or the ring where all-gather ran fastest). The
        "h100-emulated" profile (``seqpar.planner.measured``) is the H100 profile with transfers that take no
        time and fixed costs fitted to an emulated table's back-to-back times (rank r of W on one H100): what
        the issue calls calibrating the planner in the same mode. Under a modelled link (Note [Modelled link])
        the transfers take that link's time again, so auto plans with that link's profile. A ``profile=`` the
        caller passes wins either way. CPU fake groups keep the CPU profile (nothing was fitted there).
    """
    if device.type != "cuda":
        return None
    group = groups.group if groups.group is not None else groups.ring
    if not _fake(group):
        return None
    return _LINK.profile if _LINK is not None else EMULATED_PROFILE
