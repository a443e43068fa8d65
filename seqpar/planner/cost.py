"""The cost model: predicted forward and forward+backward time, bytes and peak memory of one method.

One function per method (``ring``, ``allgather``, ``ulysses``, ``usp``, ``tokenring``, ``tasp``,
``double_ring``), each ``(Problem, Candidate, Machine) -> Prediction``, following ALGORITHMS.md §12.2 step
by step: per schedule step, the critical rank's kernel call (``work.py``), the bytes it moves, the time
those bytes take on the machine's links (``topology.Network``), and whether the step hides them.

Note [Step time]
    On the device, an overlapped step (transfer posted before the compute it hides behind) lasts
    ``max(T_comp, T_comm) + δ·min(T_comp, T_comm)`` where δ is the profile's overlap loss for the
    pattern (NCCL kernels slow a concurrent attention kernel). A serial transfer (the schedule must wait
    for it) adds its whole time and counts as exposed; a transfer of few bytes costs the pattern's
    latency (Note [Link time]). ``T_comp`` is the kernel time ``FLOPs / rate(size)`` plus a launch, plus
    MERGE passes over the fp32 accumulator (``merge_passes`` x rows x heads x D x 4 bytes at HBM
    bandwidth). Summed over a pass, that is the pass's device time D.

    The fixed costs (Note [Fixed costs] in ``profile.py``) are host time. The call's ``call_us`` for the
    pass is serial - validation, the agreement round (which waits for the device) and setup come before
    the pass gives the device any work. The steps' costs H (the method's ``step_us`` α_m per step) are
    paid while the device works, so the two overlap: a pass lasts ``call + max(D, H) + κ·min(D, H)``
    with κ the profile's ``host_overlap_loss`` - 1 adds them (every fixed cost exposed), 0 hides the
    shorter completely. Large problems are device-bound (the step costs vanish behind the kernels),
    small ones host-bound.

Note [Modelled as implemented]
    The model follows the code where the code is written (``seqpar/methods/_passkv.py``) and the
    algorithm notes where it is not yet: pass-KV backward waits for the running dK/dV of a block before
    computing on it, so each dK/dV hop is exposed (``PASSKV_EXPOSED_DKV``); all-gather re-gathers K and V
    in backward (one chunk exposed, as in forward) and, on zigzag, permutes each gathered chunk into
    global order and each fp32 dK/dV chunk back (``index_select``); Ulysses packs q, k, v into one
    all-to-all and returns out and lse in two (the second, a few hundred KB, costs about the a2a
    latency); pass-Q partial outputs travel in the input dtype. Steps of pass-Q and TASP take the busiest rank's bytes
    (lock-step), so TokenRing's "halves after the wrap" lower its total bytes but not its step time.
    Change the constants below when the code changes; ``seqpar.planner.validate`` shows the effect.
    Ulysses and USP with ``head_chunks`` > 1 pipeline their all-to-alls over head groups (Note [Head-group
    pipeline] in ``seqpar.methods._ulysses``): ``_head_pipeline`` models that schedule.

Memory (``peak_mem_bytes``) counts what one rank holds at the peak of the pass: inputs, outputs, the
tensors autograd saves, and each method's buffers (ALGORITHMS.md §12.2 "Memory"); kernel workspaces and
the caching allocator's slack are not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .profile import Profile
from .topology import Group, Network
from .work import Block, gather_blocks, ring_steps, self_block

__all__ = ["MODELS", "Candidate", "Machine", "Prediction", "Problem", "auto_head_chunks", "ccr", "head_chunk_valid",
           "pass_bytes", "predict", "single_gpu_ms"]

#: pass-KV backward waits for the incoming dK/dV before the step's compute (``_passkv.backward``)
PASSKV_EXPOSED_DKV = True
#: bytes per element of a pass-Q partial output on the wire (None: the input dtype)
PASSQ_PARTIAL_BYTES: int | None = None
#: backward FLOPs per forward FLOP (five GEMMs against two)
BWD_FLOPS = 2.5


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One attention layer's shape, globally: S tokens over ``world`` ranks."""

    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    batch: int = 1
    world: int
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    dtype_bytes: int = 2
    grad_bytes: int = 4
    """Bytes per element of gradient partials on the wire (``grad_dtype``)."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "heads", "kv_heads", "head_dim", "batch", "world", "dtype_bytes", "grad_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads must be a multiple of kv_heads, got {self.heads} and {self.kv_heads}")

    @property
    def group_ratio(self) -> int:
        return self.heads // self.kv_heads

    def act(self, tokens: float, heads: float, nbytes: float | None = None) -> float:
        """Bytes of a ``(B, tokens, heads, D)`` tensor (input dtype unless ``nbytes``)."""
        return self.batch * tokens * heads * self.head_dim * (self.dtype_bytes if nbytes is None else nbytes)

    def rowstat(self, tokens: float, heads: float) -> float:
        """Bytes of a ``(B, heads, tokens)`` fp32 tensor (lse, Delta)."""
        return self.batch * tokens * heads * 4


@dataclass(frozen=True)
class Candidate:
    """A method configuration: what ``seqpar.attention`` would be called with."""

    method: str
    layout: str = "zigzag"
    ulysses: int = 1
    """USP's Ulysses degree (its ring degree is ``world // ulysses``); 1 for every other method."""
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def label(self, world: int) -> str:
        """The benchmark's name for it: "ring/zigzag", "usp/u2r2/zigzag", "tasp/direct/zigzag", "ulysses"."""
        parts = [self.method]
        if self.method == "usp":
            parts.append(f"u{self.ulysses}r{world // self.ulysses}")
        if self.method == "tasp":
            parts.append(str(self.option("schedule", "direct")))
        if self.method == "double_ring":
            parts.append(f"n{self.option('node_size')}")
        if self.method != "ulysses":
            parts.append(self.layout)
        if self.method == "allgather" and self.option("heads_k_stride") is not None:
            parts.append(f"stride{self.option('heads_k_stride')}")
        if self.method in ("ulysses", "usp") and self.option("head_chunks", 1) != 1:
            parts.append(f"head_chunks{self.option('head_chunks')}")
        return "/".join(parts)


@dataclass(frozen=True)
class Prediction:
    """Predicted cost of one call on one rank (times in ms, sizes in bytes)."""

    fwd_ms: float
    fwd_bwd_ms: float
    peak_mem_bytes: int
    """Peak bytes held by the rank during forward+backward."""
    comm_bytes: int
    """Bytes the rank sends in forward+backward."""
    exposed_comm_ms: float
    """Forward+backward time spent waiting for transfers (not hidden behind compute)."""
    notes: tuple[str, ...] = ()
    fwd_peak_mem_bytes: int = 0
    fwd_comm_bytes: int = 0
    fwd_exposed_comm_ms: float = 0.0
    compute_ms: float = 0.0
    """Forward+backward kernel and merge time (the part no schedule can remove)."""

    def time_ms(self, mode: str) -> float:
        return self.fwd_ms if mode == "fwd" else self.fwd_bwd_ms

    def peak_mem(self, mode: str) -> int:
        return self.fwd_peak_mem_bytes if mode == "fwd" else self.peak_mem_bytes

    def exposed_ms(self, mode: str) -> float:
        return self.fwd_exposed_comm_ms if mode == "fwd" else self.exposed_comm_ms

    def bytes(self, mode: str) -> int:
        return self.fwd_comm_bytes if mode == "fwd" else self.comm_bytes


@dataclass(frozen=True)
class Machine:
    """The profile (kernels, HBM, α, δ), the network it runs on, and the local kernel the methods use."""

    profile: Profile
    network: Network
    kernel: str

    def step_ms(self, method: str, direction: str) -> float:
        """Fixed cost of one schedule step of ``method`` (Note [Step time])."""
        return self.profile.step_cost_us(method, direction) * 1e-3

    def call_ms(self, direction: str) -> float:
        """Fixed cost of one call's ``direction`` pass (Note [Step time])."""
        return self.profile.call_cost_us(direction) * 1e-3

    def kernel_ms(self, p: Problem, blk: Block | None, heads: float, direction: str = "fwd") -> float:
        """One call's time: FLOPs over the profile's rate at the call's size and mask, plus a launch."""
        if blk is None or blk.pairs == 0:
            return 0.0
        mask = "causal" if blk.masked else "full"
        rate = self.profile.rate_tflops(self.kernel, mask, direction, blk.tokens)
        flops = 4.0 * p.batch * blk.pairs * heads * p.head_dim * (BWD_FLOPS if direction == "bwd" else 1.0)
        return flops / (rate * 1e12) * 1e3 + self.profile.launch_us * 1e-3

    def hbm_ms(self, nbytes: float) -> float:
        return nbytes / (self.profile.hbm_gbps * 1e9) * 1e3

    def permute_ms(self, elements: float) -> float:
        """A row permute (``index_select``) of ``elements`` elements."""
        rate = self.profile.permute_gelems or self.profile.hbm_gbps / 4
        return elements / (rate * 1e9) * 1e3

    def merge_ms(self, p: Problem, rows: float, heads: float) -> float:
        """One MERGE of ``rows`` query rows into the fp32 accumulator (Note [Step time])."""
        return self.hbm_ms(self.profile.merge_passes * p.act(rows, heads, 4))

    def comm_ms(self, pattern: str, nbytes: float, group: Group) -> float:
        return self.network.ms(pattern, nbytes, group)

    def loss(self, pattern: str) -> float:
        name = {"ring": "p2p", "ring2": "p2p_bidir", "cycles": "allpairs"}.get(pattern, pattern)
        return self.profile.overlap(name)


@dataclass
class _Tally:
    """Accumulates one pass (forward or backward) step by step (Note [Step time])."""

    m: Machine
    alpha: float = 0.0
    """The per-step fixed cost in ms (α_m of Note [Step time])."""
    ms: float = 0.0
    """Device time D."""
    host: float = 0.0
    """Host time H: the steps' fixed costs."""
    exposed: float = 0.0
    sent: float = 0.0
    compute: float = 0.0

    def step(self, comp: float, comm: float = 0.0, pattern: str = "ring", nbytes: float = 0.0) -> float:
        """One step; returns its device time."""
        t = max(comp, comm) + self.m.loss(pattern) * min(comp, comm)
        self.ms += t
        self.host += self.alpha
        self.exposed += max(0.0, comm - comp)
        self.sent += nbytes
        self.compute += comp
        return t

    def wait(self, comm: float, nbytes: float = 0.0) -> None:
        """A transfer the schedule waits for with nothing to hide it."""
        self.ms += comm
        self.exposed += comm
        self.sent += nbytes

    def local(self, comp: float) -> None:
        """Compute outside any step (packing, conversions)."""
        self.ms += comp
        self.compute += comp

    def absorb(self, other: _Tally) -> None:
        """Another tally's steps run after this one's, in the same pass."""
        self.ms += other.ms
        self.host += other.host
        self.exposed += other.exposed
        self.sent += other.sent
        self.compute += other.compute

    def total(self, call: float) -> float:
        """The pass's time with ``call`` ms of per-call fixed cost: ``call + max(D, H) + κ min(D, H)``."""
        return call + max(self.ms, self.host) + self.m.profile.host_overlap_loss * min(self.ms, self.host)


def _tallies(m: Machine, method: str) -> tuple[_Tally, _Tally]:
    """Empty forward and backward tallies whose steps cost ``method``'s fixed step time."""
    return _Tally(m, m.step_ms(method, "fwd")), _Tally(m, m.step_ms(method, "bwd"))


@dataclass
class _Cost:
    fwd: _Tally
    bwd: _Tally
    fwd_mem: float
    bwd_mem: float
    notes: list[str] = field(default_factory=list)

    def prediction(self) -> Prediction:
        f, b = self.fwd, self.bwd
        t_f, t_b = f.total(f.m.call_ms("fwd")), b.total(b.m.call_ms("bwd"))
        return Prediction(fwd_ms=t_f, fwd_bwd_ms=t_f + t_b, peak_mem_bytes=int(max(self.fwd_mem, self.bwd_mem)),
                          comm_bytes=int(f.sent + b.sent), exposed_comm_ms=f.exposed + b.exposed,
                          notes=tuple(self.notes), fwd_peak_mem_bytes=int(self.fwd_mem),
                          fwd_comm_bytes=int(f.sent), fwd_exposed_comm_ms=f.exposed, compute_ms=f.compute + b.compute)


def _base_mem(p: Problem) -> tuple[float, float]:
    """(forward, forward+backward) bytes of the call's own tensors on one rank: inputs, outputs, grads."""
    L, H, Hkv = p.seq_len / p.world, p.heads, p.kv_heads
    qkvo = 2 * p.act(L, H) + 2 * p.act(L, Hkv) + p.rowstat(L, H)
    return qkvo, qkvo + p.act(L, H) + p.act(L, H) + 2 * p.act(L, Hkv)      # + dO, dq, dk, dv


def _temps(p: Problem, L: float, heads: float, kv_heads: float) -> float:
    """Backward temporaries every block schedule holds: one block's (dq, dk, dv) and Delta."""
    return p.act(L, heads) + p.act(L, 2 * kv_heads) + p.rowstat(L, heads)


# --- pass-KV ring (ring, usp) ------------------------------------------------------------------------
def _passkv(p: Problem, m: Machine, layout: str, R: int, heads: float, kv_heads: float, group: Group,
            method: str) -> _Cost:
    """Pass-KV ring of R ranks over S tokens with ``heads`` / ``kv_heads`` per rank (ALGORITHMS.md §3);
    its steps cost ``method``'s fixed step time."""
    S, L = p.seq_len, p.seq_len / R
    steps = ring_steps(layout, R, S, p.causal, p.window)
    n = len(steps)
    kv, dkv = p.act(L, 2 * kv_heads), p.act(L, 2 * kv_heads, p.grad_bytes)
    t_kv, t_dkv = m.comm_ms("ring", kv, group), m.comm_ms("ring", dkv, group)
    f, b = _tallies(m, method)
    for s, blk in enumerate(steps):
        more = s + 1 < n
        merge = m.merge_ms(p, blk.rows, heads) if (s and blk is not None) else 0.0
        f.step(m.kernel_ms(p, blk, heads) + merge, t_kv if more else 0.0, "ring", kv if more else 0.0)
    f.local(m.hbm_ms(p.act(L, heads, 4 + p.dtype_bytes)))                 # fp32 accumulator -> output dtype
    b.local(m.hbm_ms(p.act(L, heads, 2 * p.dtype_bytes)))                 # Delta = rowsum(dO * O)
    for s, blk in enumerate(steps):
        more = s + 1 < n
        if s and PASSKV_EXPOSED_DKV:
            b.wait(t_dkv)
        acc = 0.0 if blk is None else m.hbm_ms(p.act(blk.rows, heads, 10) + p.act(blk.cols, 2 * kv_heads, 10))
        comm = (t_kv if more else 0.0) + (0.0 if PASSKV_EXPOSED_DKV or not s else t_dkv)
        b.step(m.kernel_ms(p, blk, heads, "bwd") + acc, comm, "ring", (kv + dkv) if more else 0.0)
    if n > 1:
        b.wait(t_dkv, dkv)                                                # the last dK/dV hop home
    fwd_base, bwd_base = _base_mem(p)
    acc_f = p.act(L, heads, 4) + p.rowstat(L, heads)
    fwd_mem = 2 * kv + acc_f + p.act(L, heads)                            # stacked KV + next, accumulator, block out
    bwd_mem = p.act(L, heads, 4) + 2 * kv + 2 * p.act(L, 2 * kv_heads, max(4, p.grad_bytes)) \
        + _temps(p, L, heads, kv_heads)
    c = _Cost(f, b, fwd_base + fwd_mem, bwd_base + bwd_mem)
    if n < R:
        c.notes.append(f"window truncates the ring to {n} of {R} steps")
    if p.causal and layout == "contiguous" and p.window == (-1, -1) and R > 1:
        c.notes.append(f"contiguous causal: the last rank does {2 * R - 1} of {R} average units "
                       f"(bound {R / (2 * R - 1):.0%})")
    return c


def ring(p: Problem, c: Candidate, m: Machine) -> Prediction:
    """Pass-KV ring over all W ranks, any layout (ALGORITHMS.md §3, §12.2)."""
    cost = _passkv(p, m, c.layout, p.world, p.heads, p.kv_heads, Group(p.world), "ring")
    return _note_ccr(cost, p, m, p.world).prediction()


def _note_ccr(cost: _Cost, p: Problem, m: Machine, R: int) -> _Cost:
    if R > 1:
        r = ccr(p, m, R=R)
        cost.notes.append(f"CCR {r:.2f} per zigzag step" + (" (communication-bound)" if r < 1 else ""))
    return cost


# --- Ulysses (ulysses, usp) ---------------------------------------------------------------------------
def kv_wire_heads(kv_heads: int, U: int) -> int:
    """KV heads a rank sends in the Ulysses all-to-all (ALGORITHMS.md §5.2): Hkv, or U when Hkv | U < ..."""
    return kv_heads if kv_heads % U == 0 else U


@dataclass(frozen=True)
class _A2A:
    """One head group's Ulysses all-to-alls: bytes a rank sends per collective, and its packing traffic."""

    fwd_in: tuple[float, ...]
    """q/k/v packed in one collective."""
    fwd_out: tuple[float, ...]
    """out, then lse (two collectives)."""
    bwd_in: tuple[float, ...]
    """dO."""
    bwd_out: tuple[float, ...]
    """dq/dk/dv packed in one collective."""
    pack: float

    def ms(self, m: Machine, U: int, sizes: tuple[float, ...]) -> float:
        """The collectives one after another (one stream)."""
        return sum(m.comm_ms("a2a", x, Group(U)) for x in sizes)


def _a2a_bytes(p: Problem, U: int, L: float, chunks: int = 1) -> _A2A:
    """Per head group, what a rank sends in each all-to-all and its packing traffic."""
    H, hw = p.heads / chunks, kv_wire_heads(p.kv_heads // chunks, U)
    frac = (U - 1) / U
    repl = hw > p.kv_heads // chunks
    grads = frac * (p.act(L, H) + p.act(L, 2 * hw, p.grad_bytes if repl else p.dtype_bytes))
    return _A2A(fwd_in=(frac * p.act(L, H + 2 * hw),), fwd_out=(frac * p.act(L, H), frac * p.rowstat(L, H)),
                bwd_in=(frac * p.act(L, H),), bwd_out=(grads,),
                pack=2 * (p.act(L, H + 2 * hw) + p.act(L, H)))           # pack + unpack, both directions


def _a2a_in(p: Problem, m: Machine, U: int, L: float, f: _Tally, b: _Tally) -> None:
    """Ulysses' sequence <-> head all-to-alls on one rank holding L tokens, forward and backward."""
    a = _a2a_bytes(p, U, L)
    for tally, first, last in ((f, a.fwd_in, a.fwd_out), (b, a.bwd_in, a.bwd_out)):
        tally.local(m.hbm_ms(a.pack))
        tally.wait(a.ms(m, U, first), sum(first))
        tally.wait(a.ms(m, U, last), sum(last))


# [head-group pipeline] ------------------------------------------------------------------------------
def head_chunk_valid(heads: int, kv_heads: int, U: int, c: int) -> bool:
    """c head groups each keep the slot rules over U (mirrors ``_ulysses.head_chunk_counts``)."""
    if c < 1 or heads % c or kv_heads % c:
        return False
    h, hk = heads // c, kv_heads // c
    return h % U == 0 and (hk % U == 0 or U % hk == 0)


def auto_head_chunks(heads: int, kv_heads: int, U: int) -> int:
    """``head_chunks="auto"``, as ``seqpar.methods._ulysses.auto_head_chunks`` decides it (a test keeps the two
    equal; the planner never imports a method's internals): the largest c <= 4 with every group free of KV
    replication and at least 2 query heads per rank, 1 when U == 1."""
    if U == 1:
        return 1
    for c in range(4, 1, -1):
        if heads % c == 0 and kv_heads % c == 0 and (kv_heads // c) % U == 0 and heads // (c * U) >= 2:
            return c
    return 1


def head_chunks(p: Problem, c: Candidate, U: int) -> int:
    """The candidate's ``head_chunks`` as a group count (1 when absent)."""
    v = c.option("head_chunks", 1)
    return auto_head_chunks(p.heads, p.kv_heads, U) if v == "auto" else int(v)


def _head_pipeline(p: Problem, m: Machine, U: int, L: float, chunks: int, eng_f: _Tally, eng_b: _Tally
                   ) -> tuple[_Tally, _Tally]:
    """Forward and backward of ``chunks`` head groups, ``eng_f`` / ``eng_b`` being ONE group's engine.

    Group 0's inputs and the last group's outputs are exposed; the others move beside a group's engine
    (group i+1's inputs and group i-1's outputs behind group i): ``max(T_eng, T_a2a) + δ min``, the
    engine's own steps carrying their fixed costs.
    """
    a = _a2a_bytes(p, U, L, chunks)
    f, b = _Tally(m), _Tally(m)
    for tally, eng, first, last in ((f, eng_f, a.fwd_in, a.fwd_out), (b, eng_b, a.bwd_in, a.bwd_out)):
        t_in, t_out = a.ms(m, U, first), a.ms(m, U, last)
        tally.local(m.hbm_ms(chunks * a.pack))
        tally.wait(t_in, sum(first))
        for i in range(chunks):
            moved = (sum(first) if i + 1 < chunks else 0.0) + (sum(last) if i else 0.0)
            comm = (t_in if i + 1 < chunks else 0.0) + (t_out if i else 0.0)
            tally.ms += max(eng.ms, comm) + m.loss("a2a") * min(eng.compute, comm)
            tally.host += eng.host
            tally.exposed += eng.exposed + max(0.0, comm - eng.ms)
            tally.sent += eng.sent + moved
            tally.compute += eng.compute
        tally.wait(t_out, sum(last))
    return f, b


def _ulysses_mem(p: Problem, U: int, L: float) -> tuple[float, float]:
    H, hw = p.heads, kv_wire_heads(p.kv_heads, U)
    t = p.act(L, H + 2 * hw)                                              # q, k, v in either sharding
    saved = t + p.act(L, H) + p.rowstat(L, H)                             # head-sharded q, k, v, out, lse
    return 2 * t + 2 * p.act(L, H), saved + 2 * p.act(L, H) + 2 * t


def ulysses(p: Problem, c: Candidate, m: Machine) -> Prediction:
    """All-to-all to head-sharded full sequences, one local call, all-to-all back (ALGORITHMS.md §5)."""
    U, S, L = p.world, p.seq_len, p.seq_len / p.world
    chunks = head_chunks(p, c, U)
    blk = self_block(S, p.causal, p.window)
    if chunks == 1:
        f, b = _tallies(m, "ulysses")
        _a2a_in(p, m, U, L, f, b)
        f.step(m.kernel_ms(p, blk, p.heads / U))
        b.step(m.kernel_ms(p, blk, p.heads / U, "bwd"))
    else:                                                                 # [head-group pipeline]
        eng_f, eng_b = _tallies(m, "ulysses")
        eng_f.step(m.kernel_ms(p, blk, p.heads / (U * chunks)))
        eng_b.step(m.kernel_ms(p, blk, p.heads / (U * chunks), "bwd"))
        f, b = _head_pipeline(p, m, U, L, chunks, eng_f, eng_b)
    fb, bb = _base_mem(p)
    fm, bm = _ulysses_mem(p, U, L)
    cost = _Cost(f, b, fb + fm, bb + bm)
    if p.kv_heads % U:
        cost.notes.append(f"kv_heads={p.kv_heads} < degree {U}: each KV head goes to {U // p.kv_heads} ranks "
                          f"(on the wire only)")
    if chunks == 1:
        cost.notes.append("no overlap: both all-to-alls are exposed; bytes shrink as 1/W")
    else:
        cost.notes.append(f"{chunks} head groups pipelined: 1/{chunks} of each all-to-all direction exposed")
    return cost.prediction()


def usp(p: Problem, c: Candidate, m: Machine) -> Prediction:
    """Ulysses over U (inside a node) x pass-KV ring over R = W/U (ALGORITHMS.md §6)."""
    U, R = c.ulysses, p.world // c.ulysses
    L = p.seq_len / p.world
    hw = kv_wire_heads(p.kv_heads, U)
    chunks = head_chunks(p, c, U)
    if chunks > 1:                      # [head-group pipeline]: the ring runs per group, a2a's beside it
        hwc = kv_wire_heads(p.kv_heads // chunks, U)
        cost = _passkv(p, m, c.layout, R, p.heads / (U * chunks), hwc / U, Group(R, U), "usp")
        cost.fwd, cost.bwd = _head_pipeline(p, m, U, L, chunks, cost.fwd, cost.bwd)
        cost.notes.append(f"{chunks} head groups pipelined: the ring of one group hides the next group's "
                          f"all-to-all")
    else:
        cost = _passkv(p, m, c.layout, R, p.heads / U, hw / U, Group(R, U), "usp")
        pre_f, pre_b = _Tally(m), _Tally(m)
        _a2a_in(p, m, U, L, pre_f, pre_b)
        cost.fwd.absorb(pre_f)
        cost.bwd.absorb(pre_b)
    fm, bm = _ulysses_mem(p, U, L)
    cost.fwd_mem += fm
    cost.bwd_mem += bm
    if hw > p.kv_heads:
        cost.notes.append(f"KV replicated {U // p.kv_heads}x for Ulysses also travels the ring")
    return _note_ccr(cost, p, m, R).prediction()


# --- all-gather KV ------------------------------------------------------------------------------------
def allgather(p: Problem, c: Candidate, m: Machine) -> Prediction:
    """All-gather K, V per head chunk; reduce-scatter dK, dV (ALGORITHMS.md §4)."""
    W, S, L = p.world, p.seq_len, p.seq_len / p.world
    stride = c.option("heads_k_stride") or p.kv_heads
    nc = p.kv_heads // stride
    heads = stride * p.group_ratio
    blocks = gather_blocks(c.layout, W, S, p.causal, p.window)
    perm = m.permute_ms(p.batch * S * 2 * stride * p.head_dim) if c.layout == "zigzag" and W > 1 else 0.0
    cf = sum(m.kernel_ms(p, blk, heads) for blk in blocks) + perm
    cb = sum(m.kernel_ms(p, blk, heads, "bwd") for blk in blocks) + 2 * perm \
        + m.hbm_ms(sum(p.act(blk.cols, 2 * stride, 8) for blk in blocks))           # KV into order, dK/dV back
    g_bytes = (W - 1) * p.act(L, 2 * stride)
    r_bytes = (W - 1) * p.act(L, 2 * stride, p.grad_bytes)
    grp = Group(W)
    t_ag, t_rs = m.comm_ms("allgather", g_bytes, grp), m.comm_ms("reduce_scatter", r_bytes, grp)
    f, b = _tallies(m, "allgather")
    f.wait(t_ag, g_bytes)                                                 # the first chunk's gather
    for i in range(nc):
        more = i + 1 < nc
        f.step(cf, t_ag if more else 0.0, "allgather", g_bytes if more else 0.0)
    b.wait(t_ag, g_bytes)                                                 # backward re-gathers
    for i in range(nc):
        comm = (t_ag if i + 1 < nc else 0.0) + (t_rs if i else 0.0)
        b.step(cb, comm, "allgather", (g_bytes if i + 1 < nc else 0.0) + (r_bytes if i else 0.0))
    b.wait(t_rs, r_bytes)
    bufs = 2 if nc > 1 else 1
    gathered = bufs * p.act(S, 2 * stride)
    fb, bb = _base_mem(p)
    cost = _Cost(f, b, fb + gathered + p.act(L, p.heads),
                 bb + gathered + bufs * p.act(S, 2 * stride, 4) + p.act(L, p.heads, 4))
    if nc == 1:
        cost.notes.append("one round: the gather is exposed; the whole sequence's KV is held")
    else:
        cost.notes.append(f"{nc} head chunks pipelined (heads_k_stride={stride})")
    if p.causal and c.layout == "contiguous" and W > 1:
        cost.notes.append(f"contiguous causal: the last rank does {2 * W - 1} of {W} average units")
    return cost.prediction()


# --- pass-Q (tokenring) -------------------------------------------------------------------------------
def tokenring(p: Problem, c: Candidate, m: Machine) -> Prediction:
    """Q travels; partial outputs return directly to their owner (ALGORITHMS.md §7.2, §7.4)."""
    W, S, L, H = p.world, p.seq_len, p.seq_len / p.world, p.heads
    layout = "zigzag" if p.causal else c.layout
    steps = ring_steps(layout, W, S, p.causal, p.window)
    n = len(steps)
    q = p.act(L, H)
    o = p.act(L, H, PASSQ_PARTIAL_BYTES) + p.rowstat(L, H)
    bundle = 2 * p.act(L, H) + 2 * p.rowstat(L, H)                        # Q, dO, lse, Delta
    dq = p.act(L, H, p.grad_bytes)
    share = 0.75 if p.causal else 1.0                                     # halves travel after the wrap
    f, b = _tallies(m, "tokenring")
    for s, blk in enumerate(steps):
        link = (q if s + 1 < n else 0.0) + (o if s >= 2 else 0.0)
        merge = m.merge_ms(p, L, H) if s >= 2 else 0.0
        f.step(m.kernel_ms(p, blk, H) + merge, m.comm_ms("ring2", link, Group(W)), "ring2", share * link)
    if n > 1:
        f.wait(m.comm_ms("ring", o, Group(W)), share * o)
        f.local(m.merge_ms(p, L, H))
    for s, blk in enumerate(steps):
        link = (bundle if s + 1 < n else 0.0) + (dq if s >= 2 else 0.0)
        acc = 0.0 if blk is None else m.hbm_ms(p.act(blk.rows, H, 10) + p.act(blk.cols, 2 * p.kv_heads, 10))
        b.step(m.kernel_ms(p, blk, H, "bwd") + acc, m.comm_ms("ring2", link, Group(W)), "ring2", share * link)
    if n > 1:
        b.wait(m.comm_ms("ring", dq, Group(W)), share * dq)
    fb, bb = _base_mem(p)
    fwd_mem = 2 * q + 2 * o + p.act(L, H, 4) + p.rowstat(L, H) + p.act(L, H)
    bwd_mem = 2 * bundle + 2 * dq + p.act(L, H, 4) + p.act(L, 2 * p.kv_heads, 4) + _temps(p, L, H, p.kv_heads)
    cost = _Cost(f, b, fb + fwd_mem, bb + bwd_mem)
    ratio = pass_bytes(p, "q", "fwd") / pass_bytes(p, "kv", "fwd")
    cost.notes.append(f"pass-Q moves {ratio:.2f}x pass-KV's bytes per step (g={p.group_ratio})")
    return cost.prediction()


# --- TASP ---------------------------------------------------------------------------------------------
def tasp(p: Problem, c: Candidate, m: Machine) -> Prediction:
    """KV in W-1 sub-chunks over all W-1 links per round (ALGORITHMS.md §8.2-8.5)."""
    W, S, L = p.world, p.seq_len, p.seq_len / p.world
    schedule = c.option("schedule", "direct")
    pattern = "cycles" if schedule == "cycles" else "allpairs"
    layout = "zigzag" if p.causal else c.layout
    steps = ring_steps(layout, W, S, p.causal, p.window)
    n = len(steps)
    kv, dkv = p.act(L, 2 * p.kv_heads), p.act(L, 2 * p.kv_heads, p.grad_bytes)
    grp = Group(W)
    t_kv, t_kvd, t_dkv = (m.comm_ms(pattern, x, grp) for x in (kv, kv + dkv, dkv))
    extra_launch = m.profile.launch_us * 1e-3 if p.causal else 0.0       # M and P sub-chunks: two calls
    f, b = _tallies(m, "tasp")
    for s, blk in enumerate(steps):
        more = s + 1 < n
        comp = m.kernel_ms(p, blk, p.heads) + (m.merge_ms(p, blk.rows, p.heads) + extra_launch if s and blk else 0.0)
        f.step(comp, t_kv if more else 0.0, pattern, kv if more else 0.0)
    for s, blk in enumerate(steps):
        more = s + 1 < n
        back = s >= 2                                                     # partials of round s-1 go home
        comm = t_kvd if (more and back) else (t_kv if more else (t_dkv if back else 0.0))
        sent = (kv if more else 0.0) + (dkv if back else 0.0)
        b.step(m.kernel_ms(p, blk, p.heads, "bwd") + (extra_launch if s else 0.0), comm, pattern, sent)
    if n > 1:
        b.wait(t_dkv, dkv)
    fb, bb = _base_mem(p)
    acc = p.act(L, p.heads, 4) + p.rowstat(L, p.heads)
    dkv32 = p.act(L, 2 * p.kv_heads, 4)
    cost = _Cost(f, b, fb + 3 * kv + acc + p.act(L, p.heads),                # own KV + two receive buffers
                 bb + 3 * kv + 3 * dkv32 + p.act(L, p.heads, 4) + _temps(p, L, p.heads, p.kv_heads))
    cost.notes.append(f"{schedule}: every round uses all {W - 1} links of each rank")
    return cost.prediction()


# --- double ring --------------------------------------------------------------------------------------
def double_ring(p: Problem, c: Candidate, m: Machine) -> Prediction:
    """Inner ring in a node, outer ring across nodes, hidden behind a whole inner pass (ALGORITHMS.md §9)."""
    W, S, L = p.world, p.seq_len, p.seq_len / p.world
    w = int(c.option("node_size"))
    Wo = W // w
    steps = list(ring_steps("zigzag", W, S, p.causal, p.window))
    steps += [None] * (W - len(steps))
    kv, dkv = p.act(L, 2 * p.kv_heads), p.act(L, 2 * p.kv_heads, p.grad_bytes)
    inner, outer = Group(w), Group(Wo, w)
    f, b = _tallies(m, "double_ring")
    for tally, direction in ((f, "fwd"), (b, "bwd")):
        pay = kv if direction == "fwd" else kv + dkv
        t_in, t_out = m.comm_ms("ring", pay, inner), m.comm_ms("ring", pay, outer)
        last_pass = 0.0
        for j in range(Wo):
            if j:
                tally.wait(max(0.0, t_out - last_pass), pay)
            last_pass = 0.0
            for s in range(w):
                blk = steps[j * w + s]
                comp = m.kernel_ms(p, blk, p.heads, direction)
                if direction == "fwd" and (j or s) and blk is not None:
                    comp += m.merge_ms(p, blk.rows, p.heads)
                more = s + 1 < w
                last_pass += tally.step(comp, t_in if more else 0.0, "ring", pay if more else 0.0)
            if direction == "bwd" and w > 1:
                tally.wait(m.comm_ms("ring", dkv, inner), dkv)            # dK/dV back to the pass's first rank
        if direction == "bwd" and Wo > 1:
            tally.wait(m.comm_ms("ring", dkv, outer), dkv)                # the last outer hop home
    fb, bb = _base_mem(p)
    acc = p.act(L, p.heads, 4) + p.rowstat(L, p.heads)
    dkv32 = p.act(L, 2 * p.kv_heads, 4)
    cost = _Cost(f, b, fb + 4 * kv + acc + p.act(L, p.heads),                # current, inner next, outer x2
                 bb + 4 * kv + 4 * dkv32 + p.act(L, p.heads, 4) + _temps(p, L, p.heads, p.kv_heads))
    t_hide = m.comm_ms("ring", kv, outer)
    cost.notes.append(f"outer hop {t_hide:.2f} ms hides behind {w} inner steps")
    return cost.prediction()


MODELS: dict[str, Callable[[Problem, Candidate, Machine], Prediction]] = {
    "ring": ring, "allgather": allgather, "ulysses": ulysses, "usp": usp, "tokenring": tokenring, "tasp": tasp,
    "double_ring": double_ring,
}


def predict(p: Problem, c: Candidate, m: Machine) -> Prediction:
    """The prediction of ``c`` (any method in ``MODELS``) on ``p`` and ``m``, per-call fixed costs included."""
    if c.method not in MODELS:
        raise ValueError(f"method must be one of {sorted(MODELS)}, got {c.method!r}")
    return MODELS[c.method](p, c, m)


def single_gpu_ms(p: Problem, m: Machine, mode: str) -> float:
    """The yardstick: one GPU's kernel time on the whole problem, divided by W (efficiency = this / time)."""
    blk = self_block(p.seq_len, p.causal, p.window)
    t = m.kernel_ms(p, blk, p.heads)
    if mode != "fwd":
        t += m.kernel_ms(p, blk, p.heads, "bwd")
    return t / p.world


def pass_bytes(p: Problem, which: str, direction: str) -> float:
    """Bytes per rank per step of pass-KV ("kv") or pass-Q ("q") with L_q = L_kv (ALGORITHMS.md §7.1)."""
    L, H, Hkv, D, e, eg = p.seq_len / p.world, p.heads, p.kv_heads, p.head_dim, p.dtype_bytes, p.grad_bytes
    B = p.batch
    if which == "kv":
        return 2 * B * L * Hkv * D * (e if direction == "fwd" else e + eg)
    if which == "q":
        return B * L * H * (2 * D * e + 4) if direction == "fwd" else B * L * H * (2 * D * e + 8 + D * eg)
    raise ValueError(f"which must be 'kv' or 'q', got {which!r}")


def ccr(p: Problem, m: Machine | None = None, *, R: int | None = None, tflops: float | None = None,
        gbps: float | None = None, causal: bool | None = None) -> float:
    """Compute-to-communication ratio of one pass-KV step (ALGORITHMS.md §12.3).

    ``T_comp / T_comm`` for an L x L step (L = S/R; halved compute when causal, zigzag) against one
    ``‖KV‖`` transfer. Rates come from ``m`` (its kernel at size L, P2P at ‖KV‖) unless given.
    """
    R = R or p.world
    L = p.seq_len / R
    causal = p.causal if causal is None else causal
    flops = 4.0 * p.batch * L * L * p.heads * p.head_dim * (0.5 if causal else 1.0)
    kv = p.act(L, 2 * p.kv_heads)
    if tflops is None:
        assert m is not None
        tflops = m.profile.rate_tflops(m.kernel, "full", "fwd", L / (2 ** 0.5 if causal else 1.0))
    t_comm = kv / (gbps * 1e9) if gbps is not None else (m.comm_ms("ring", kv, Group(R)) * 1e-3 if m else 0.0)
    return (flops / (tflops * 1e12)) / t_comm
