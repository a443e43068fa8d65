"""Described machines: which links connect which GPUs, and how long a communication pattern takes on them.

A ``Topology`` is nodes of ``node_size`` GPUs joined inside a node by one of three fabrics and across
nodes by NICs on a (possibly oversubscribed) fat tree:

    switch  every GPU has one port into a switch (NVSwitch): one message or many, a GPU's egress is its
            port; with ``intra_link=None`` the profile's measured curves are used (the calibrated host)
    mesh    a direct link between every pair of GPUs (MI300X xGMI): one peer gets one link, all peers
            get n-1 links at once
    pcie    every GPU has its own PCIe link, and all of a node's traffic shares the host bridge

``Network(topology, profile).ms(pattern, nbytes, group)`` is the time of one collective or one schedule
step, per rank, for a group of ranks placed on the topology by ``Group(size, stride)`` (members are
global ranks ``0, stride, 2*stride, ...``; a method's sibling groups - the other Ulysses positions of a
USP ring, the other positions of a double ring's outer ring - run the same pattern at the same time and
share the NICs with it).

Note [Pattern times on a topology]
    For a group spanning ``n`` nodes with ``k`` members per node and ``f`` sibling groups per node:
    - ring (one direction, m bytes): the slower of an intra-node hop and a NIC hop; each crossing hop is
      one flow, ``f`` flows per node share ``nics_per_node`` NICs.
    - ring2 (both directions, m bytes in total): as ring with m/2 per direction and twice the flows; on a
      switch or PCIe both directions share the GPU's egress, on a mesh they use two links.
    - a2a / allpairs (m bytes to the other members, evenly): (k-1)/(size-1) of it stays in the node, the
      rest leaves through the node's NICs, shared by every sending GPU of the node.
    - cycles (TASP across nodes, ALGORITHMS.md §8.3): 1/k of the bytes cross, over each GPU's own path.
    - allgather / reduce_scatter (m bytes received per rank): all m pass through the intra-node fabric
      (remote shards are forwarded inside the node); every remote shard enters each node once, over all
      of the node's NICs (NCCL's rings use them all).
    Hockney ``alpha + m / bandwidth`` per link class; the measured host uses the profile's curves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .profile import Profile

__all__ = ["PRESETS", "Group", "Link", "Network", "Topology", "get_topology"]


@dataclass(frozen=True)
class Link:
    """One link class: per-direction bandwidth (GB/s, achievable) and per-message latency (us)."""

    gbps: float
    alpha_us: float = 5.0

    def ms(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.alpha_us * 1e-3 + nbytes / (self.gbps * 1e9) * 1e3


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Nodes of ``node_size`` GPUs; an intra-node fabric; NICs across nodes."""

    name: str
    node_size: int
    intra: str = "switch"
    """"switch", "mesh" or "pcie" (module docstring)."""
    intra_link: Link | None = None
    """The intra-node link class; None on a switch means the profile's measured curves."""
    host_gbps: float | None = None
    """PCIe: the host bridge's aggregate bandwidth shared by a node's transfers."""
    nic: Link | None = None
    nics_per_node: int = 0
    oversubscription: float = 1.0
    """Fabric oversubscription above the nodes (1 = full bisection fat tree)."""
    description: str = ""

    def __post_init__(self) -> None:
        if self.intra not in ("switch", "mesh", "pcie"):
            raise ValueError(f"intra must be 'switch', 'mesh' or 'pcie', got {self.intra!r}")
        if self.node_size < 1:
            raise ValueError(f"node_size must be >= 1, got {self.node_size}")
        if self.intra_link is None and self.intra != "switch":
            raise ValueError(f"a {self.intra!r} fabric needs intra_link (measured curves exist for switches only)")
        if (self.nic is None) != (self.nics_per_node == 0):
            raise ValueError("nic and nics_per_node must be given together")

    def check_world(self, world: int) -> None:
        if world > self.node_size and self.nic is None:
            raise ValueError(f"world must be at most {self.node_size} (one node) for topology {self.name!r}, which "
                             f"has no NICs, got {world}; pass a multi-node topology ({sorted(PRESETS)})")

    @staticmethod
    def host(profile: Profile) -> Topology:
        """One node of the profile's host, with its measured link curves."""
        return Topology(name=f"{profile.name} host", node_size=profile.gpus_per_node,
                        description=f"one {profile.interconnect} node of {profile.gpus_per_node} ({profile.gpu}), "
                                    "measured curves")


_NDR = Link(gbps=46.0, alpha_us=8.0)          # 400 Gb/s NIC (ConnectX-7 NDR), ~92% achievable

PRESETS: dict[str, Topology] = {
    "nvswitch": Topology(
        name="nvswitch", node_size=8, nic=_NDR, nics_per_node=8,
        description="NVSwitch nodes of 8 GPUs (measured curves), one 400 Gb/s NIC per GPU, full fat tree"),
    "nvswitch-2to1": Topology(
        name="nvswitch-2to1", node_size=8, nic=_NDR, nics_per_node=8, oversubscription=2.0,
        description="NVSwitch nodes of 8, one 400 Gb/s NIC per GPU, fat tree oversubscribed 2:1"),
    "pcie": Topology(
        name="pcie", node_size=8, intra="pcie", intra_link=Link(gbps=22.0, alpha_us=10.0), host_gbps=80.0,
        nic=Link(gbps=23.0, alpha_us=10.0), nics_per_node=2,
        description="PCIe Gen4 hosts of 8 GPUs (22 GB/s each, 80 GB/s through the host bridge), "
                    "2x 200 Gb/s NICs per host"),
    "mi300x": Topology(
        name="mi300x", node_size=8, intra="mesh", intra_link=Link(gbps=48.0, alpha_us=6.0), nic=_NDR,
        nics_per_node=8,
        description="MI300X-style nodes of 8: a direct xGMI link between every pair (64 GB/s, ~48 achievable "
                    "per direction), one 400 Gb/s NIC per GPU"),
}


def get_topology(topology: Topology | str | None, profile: Profile) -> Topology:
    """A Topology from itself, a preset name, or None (the profile's own host)."""
    if topology is None or topology == "host":
        return Topology.host(profile)
    if isinstance(topology, Topology):
        return topology
    if topology not in PRESETS:
        raise ValueError(f"topology must be one of {['host', *sorted(PRESETS)]}, got {topology!r}")
    return PRESETS[topology]


@dataclass(frozen=True)
class Group:
    """A process group's placement: ``size`` members at global ranks ``0, stride, 2*stride, ...``."""

    size: int
    stride: int = 1


_PROFILE_PATTERN = {"ring": "p2p", "ring2": "p2p_bidir", "a2a": "a2a", "allpairs": "allpairs",
                    "cycles": "allpairs", "allgather": "allgather", "reduce_scatter": "reduce_scatter",
                    "ring_copy": "p2p_copy"}


@dataclass(frozen=True)
class Network:
    """Pattern times on a topology (Note [Pattern times on a topology])."""

    topology: Topology
    profile: Profile

    def ms(self, pattern: str, nbytes: float, group: Group) -> float:
        """Time of one ``pattern`` moving ``nbytes`` per rank among ``group``."""
        if pattern not in _PROFILE_PATTERN:
            raise ValueError(f"pattern must be one of {sorted(_PROFILE_PATTERN)}, got {pattern!r}")
        if nbytes <= 0 or group.size <= 1:
            return 0.0
        topo = self.topology
        k = min(group.size, max(1, topo.node_size // group.stride))      # members per node
        nodes = math.ceil(group.size / k)
        sib = min(group.stride, topo.node_size) if group.stride > 1 else max(1, topo.node_size // group.size)
        sending = min(topo.node_size, k * sib)                           # GPUs of a node in this pattern
        if pattern == "cycles" and nodes == 1:
            pattern = "allpairs"
        intra, inter = 0.0, 0.0
        if pattern == "ring_copy":                  # copy engines reach the GPUs of one host only
            return self._intra(pattern, nbytes, k, sending) if nodes == 1 else math.inf
        if pattern in ("ring", "ring2"):
            if k > 1:
                intra = self._intra(pattern, nbytes, k, sending)
            if nodes > 1:
                per = nbytes / 2 if pattern == "ring2" else nbytes
                inter = self._nic(per, flows=sib * (2 if pattern == "ring2" else 1))
        elif pattern in ("a2a", "allpairs"):
            if k > 1:
                intra = self._intra(pattern, nbytes * (k - 1) / (group.size - 1), k, sending)
            if nodes > 1:
                inter = self._node_egress(nbytes * (group.size - k) / (group.size - 1) * sending)
        elif pattern == "cycles":
            intra = self._intra("allpairs", nbytes * (k - 1) / k, k, sending)
            inter = self._nic(nbytes / k, flows=sending)
        else:                                                            # allgather / reduce_scatter
            shard = nbytes / (group.size - 1)
            intra = self._intra(pattern, nbytes, k, sending) if k > 1 else 0.0
            if nodes > 1:
                inter = self._node_egress(shard * (group.size - k) * sib)
        return max(intra, inter)

    def _intra(self, pattern: str, nbytes: float, k: int, sending: int) -> float:
        topo = self.topology
        if topo.intra_link is None:
            return self.profile.link_ms(_PROFILE_PATTERN[pattern], nbytes)
        link = topo.intra_link
        if topo.intra == "switch":
            return link.ms(nbytes)
        if topo.intra == "mesh":
            spread = {"ring": 1, "ring2": 2}.get(pattern, max(1, k - 1))
            return link.ms(nbytes / spread)
        share = link.gbps if topo.host_gbps is None else min(link.gbps, topo.host_gbps / max(1, sending))
        return Link(share, link.alpha_us).ms(nbytes)

    def _nic(self, nbytes: float, flows: int) -> float:
        topo = self.topology
        assert topo.nic is not None
        share = min(1.0, topo.nics_per_node / max(1, flows)) / topo.oversubscription
        return Link(topo.nic.gbps * share, topo.nic.alpha_us).ms(nbytes)

    def _node_egress(self, node_bytes: float) -> float:
        topo = self.topology
        assert topo.nic is not None
        return Link(topo.nic.gbps * topo.nics_per_node / topo.oversubscription, topo.nic.alpha_us).ms(node_bytes)
