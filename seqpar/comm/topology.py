"""Link schedules for all-to-all style KV exchange on a full mesh: Hamiltonian cycles, paths, direct rounds.

Pure index math on ``n`` ranks (group ranks ``0 .. n-1``), no torch: ``tests/test_topology.py`` checks every
construction for every n from 2 to 64. ALGORITHMS.md §8 is the source; the names below follow it.

* ``hamiltonian_cycles(n)``: n-1 arc-disjoint directed Hamiltonian cycles covering every ordered pair of
  the complete digraph K*_n (Note [Hamiltonian decompositions]). Exists for every n except 4 and 6.
* ``hamiltonian_paths(n)``: n directed Hamiltonian paths covering every arc once (even n; construction 4),
  the building block of multi-node cycles (§8.3).
* ``direct_subchunk(o, p, t, n)``: the staggered direct all-to-all (§8.4), any n, including 4 and 6.
* ``routing_tables(cycles)``: ``out_map[r][p]`` / ``in_map[r][p]``, the cycle on which p follows / precedes r.

Note [Hamiltonian decompositions]
    1. Odd n = 2k+1 (Walecki, directed): vertices Z_2k plus a hub n-1; the zig-zag
       z = (0, 1, -1, 2, -2, ..., k) shifted by i = 0 .. 2k-1 gives the cycles (hub, z + i); cycle i + k is
       cycle i reversed, so together they use every arc once.
    2. Even n (n >= 8): take a Walecki decomposition of K*_{n-1} on {0 .. n-2} (n-2 cycles), and break ONE
       arc ``a_i -> b_i`` of every cycle i, inserting the new vertex n-1 there: ``(n-1, b_i, ..., a_i)``.
       If the broken arcs form a Hamiltonian path ``s -> ... -> e`` on {0 .. n-2}, then ``(n-1, s, ..., e)``
       is one more Hamiltonian cycle and the n-1 cycles decompose K*_n: the new vertex's out-arcs reach
       every ``b_i`` plus s (all vertices, since a path's heads are every vertex but its start), its
       in-arcs likewise. For n = 0 mod 4 TASP gives the broken arcs in closed form (rotations s_i;
       ``tasp_cycles``); for n = 2 mod 4 no closed form is known to us, so ``search_cycles`` picks the arcs
       by a randomized backtracking search (most-constrained cycle first) that finishes in milliseconds
       for every n up to 64. Its results for n = 10, 14, ..., 62 ship in ``tables/hamiltonian_cycles.json``
       (regenerate with ``python -m seqpar.comm.topology``) and are re-verified when loaded.
    3. n = 4 and n = 6 have no decomposition (classical; exhaustive search agrees): cycle-based
       schedules must refuse them and the direct schedule serves them.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path

__all__ = ["direct_schedule", "direct_subchunk", "hamiltonian_cycles", "hamiltonian_paths", "has_cycles",
           "routing_tables", "search_cycles", "tasp_cycles", "verify_cycles", "verify_paths", "walecki_cycles"]

Cycles = tuple[tuple[int, ...], ...]

TABLES = Path(__file__).with_name("tables") / "hamiltonian_cycles.json"
_TABLE_SEED = 0


def has_cycles(n: int) -> bool:
    """Whether K*_n decomposes into n-1 directed Hamiltonian cycles (every n >= 1 except 4 and 6)."""
    return n >= 1 and n not in (4, 6)


def walecki_cycles(n: int) -> Cycles:
    """Walecki's decomposition of K*_n for odd n >= 3 (Note [Hamiltonian decompositions], 1)."""
    if n < 3 or n % 2 == 0:
        raise ValueError(f"walecki_cycles needs an odd n >= 3, got {n}")
    k = (n - 1) // 2
    m = 2 * k
    z = [0]
    for i in range(1, k):
        z += [i, (-i) % m]
    z.append(k)
    return tuple((n - 1, *((x + i) % m for x in z)) for i in range(m))


def _close(n: int, base: Cycles, broken: Sequence[tuple[int, int]]) -> Cycles:
    """Insert vertex n-1 into every base cycle at its broken arc; the broken arcs' path closes the last cycle."""
    out = []
    for cyc, (_, b) in zip(base, broken):
        j = cyc.index(b)
        out.append((n - 1, *cyc[j:], *cyc[:j]))
    succ = dict(broken)
    start = (set(range(n - 1)) - set(succ.values())).pop()
    path = [start]
    while path[-1] in succ:
        path.append(succ[path[-1]])
    out.append((n - 1, *path))
    return tuple(out)


def tasp_cycles(n: int) -> Cycles:
    """TASP's closed-form decomposition for n = 0 mod 4, n >= 8 (ALGORITHMS.md §8.1, construction 2)."""
    if n < 8 or n % 4:
        raise ValueError(f"tasp_cycles needs n = 0 mod 4 and n >= 8, got {n}")
    p, k = n - 2, n // 4 - 1
    base = walecki_cycles(p + 1)
    shift = dict.fromkeys(range(p), 2 * k)
    shift.update({0: 1, k + 1: 4 * k + 2, 2 * k + 2: 3, 3 * k + 2: 4 * k})
    rotated = [c[shift[i]:] + c[:shift[i]] for i, c in enumerate(base)]
    return _close(n, base, [(r[-1], r[0]) for r in rotated])


def search_cycles(n: int, seed: int = 0, node_limit: int = 100_000) -> Cycles:
    """A decomposition of K*_n for even n >= 8 by search (Note [Hamiltonian decompositions], 2).

    Picks one arc of every Walecki cycle of K*_{n-1} so the picked arcs form a Hamiltonian path:
    depth-first, always branching on the cycle with the fewest admissible arcs (tail and head unused, no
    closed loop), in an order shuffled by ``seed``; restarts with a fresh shuffle after ``node_limit``
    nodes. Deterministic for a given seed.
    """
    if n < 8 or n % 2:
        raise ValueError(f"search_cycles needs an even n >= 8, got {n}")
    V = n - 1
    base = walecki_cycles(V)
    arcs = [[(c[j], c[(j + 1) % V]) for j in range(V)] for c in base]
    rng = random.Random(seed)
    while True:
        picked = _pick_path_arcs(arcs, V, rng, node_limit)
        if picked is not None:
            return _close(n, base, picked)


def _pick_path_arcs(arcs: list[list[tuple[int, int]]], V: int, rng: random.Random,
                    node_limit: int) -> list[tuple[int, int]] | None:
    """One arc per list forming a Hamiltonian path on V vertices, or None when the node budget runs out."""
    used_tail, used_head = [False] * V, [False] * V
    start_of, end_of = list(range(V)), list(range(V))   # path fragments: start of the fragment ending at v
    picked: list[tuple[int, int] | None] = [None] * len(arcs)
    budget = [node_limit]

    def admissible(i: int) -> list[tuple[int, int]]:
        return [(x, y) for x, y in arcs[i] if not used_tail[x] and not used_head[y] and start_of[x] != y]

    def descend() -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return False
        best: tuple[int, list[tuple[int, int]]] | None = None
        for i in range(len(arcs)):
            if picked[i] is None:
                opts = admissible(i)
                if not opts:
                    return False
                if best is None or len(opts) < len(best[1]):
                    best = (i, opts)
        if best is None:
            return True
        i, opts = best
        rng.shuffle(opts)
        for x, y in opts:
            s, e = start_of[x], end_of[y]
            saved = (start_of[e], end_of[s])
            used_tail[x] = used_head[y] = True
            picked[i] = (x, y)
            start_of[e], end_of[s] = s, e
            if descend():
                return True
            start_of[e], end_of[s] = saved
            used_tail[x] = used_head[y] = False
            picked[i] = None
        return False

    return [a for a in picked if a is not None] if descend() else None


def verify_cycles(cycles: Sequence[Sequence[int]], n: int) -> None:
    """Raise ValueError unless ``cycles`` are n-1 directed Hamiltonian cycles using every arc of K*_n once."""
    if len(cycles) != max(n - 1, 0):
        raise ValueError(f"a decomposition of K*_{n} must have {n - 1} cycles, got {len(cycles)}")
    seen: set[tuple[int, int]] = set()
    for c in cycles:
        if sorted(c) != list(range(n)):
            raise ValueError(f"cycle {list(c)} is not Hamiltonian on {n} vertices")
        for a, b in zip(c, (*c[1:], c[0])):
            if (a, b) in seen:
                raise ValueError(f"arc {a}->{b} is used twice")
            seen.add((a, b))
    if n > 1 and len(seen) != n * (n - 1):
        raise ValueError(f"the cycles cover {len(seen)} of the {n * (n - 1)} arcs of K*_{n}")


@functools.lru_cache(maxsize=1)
def _shipped() -> dict[int, Cycles]:
    if not TABLES.exists():
        return {}
    data = json.loads(TABLES.read_text())
    return {int(n): tuple(tuple(c) for c in cyc) for n, cyc in data["cycles"].items()}


@functools.lru_cache(maxsize=128)
def hamiltonian_cycles(n: int) -> Cycles:
    """n-1 arc-disjoint directed Hamiltonian cycles of K*_n (every arc once); ValueError for n = 4, 6.

    n = 1: none; n = 2: the single cycle (0, 1); odd n: Walecki; n = 0 mod 4: TASP's construction;
    n = 2 mod 4: the shipped table (re-verified here) or, beyond it, ``search_cycles(n)``.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not has_cycles(n):
        raise ValueError(f"K*_{n} has no decomposition into directed Hamiltonian cycles (none exists for n = 4 "
                         f"or 6); use the direct schedule (direct_subchunk), got n={n}")
    if n == 1:
        cycles: Cycles = ()
    elif n == 2:
        cycles = ((0, 1),)
    elif n % 2:
        cycles = walecki_cycles(n)
    elif n % 4 == 0:
        cycles = tasp_cycles(n)
    else:
        cycles = _shipped().get(n) or search_cycles(n, _TABLE_SEED)
    verify_cycles(cycles, n)
    return cycles


def routing_tables(cycles: Cycles) -> tuple[tuple[dict[int, int], ...], tuple[dict[int, int], ...]]:
    """``(out_map, in_map)``: ``out_map[r][p]`` is the cycle on which p follows r, ``in_map[r][p]`` the one
    on which p precedes r. In a decomposition every ordered pair has exactly one such cycle."""
    n = len(cycles[0]) if cycles else 1
    out_map: list[dict[int, int]] = [{} for _ in range(n)]
    in_map: list[dict[int, int]] = [{} for _ in range(n)]
    for g, c in enumerate(cycles):
        for a, b in zip(c, (*c[1:], c[0])):
            out_map[a][b] = g
            in_map[b][a] = g
    return tuple(out_map), tuple(in_map)


def hamiltonian_paths(n: int) -> Cycles:
    """n directed Hamiltonian paths covering every arc of K*_n once, for even n (§8.1, construction 4).

    ``P_i = (i, i+1, i-1, i+2, i-2, ..., i+n/2) mod n``: P_i starts at i and ends at ``i + n/2``.
    """
    if n < 2 or n % 2:
        raise ValueError(f"hamiltonian_paths needs an even n >= 2, got {n}")
    steps = [0]
    for d in range(1, n // 2):
        steps += [d, -d]
    steps.append(n // 2)
    return tuple(tuple((i + d) % n for d in steps) for i in range(n))


def verify_paths(paths: Sequence[Sequence[int]], n: int) -> None:
    """Raise ValueError unless ``paths`` are Hamiltonian paths that use every arc of K*_n exactly once."""
    seen: set[tuple[int, int]] = set()
    for p in paths:
        if sorted(p) != list(range(n)):
            raise ValueError(f"path {list(p)} is not Hamiltonian on {n} vertices")
        for a, b in itertools.pairwise(p):
            if (a, b) in seen:
                raise ValueError(f"arc {a}->{b} is used twice")
            seen.add((a, b))
    if len(seen) != n * (n - 1):
        raise ValueError(f"the paths cover {len(seen)} of the {n * (n - 1)} arcs of K*_{n}")


def direct_subchunk(o: int, p: int, t: int, n: int) -> int:
    """The sub-chunk origin ``o`` sends peer ``p`` in round ``t`` (1 .. n-1) of the staggered all-to-all.

    ``c(o, p, t) = (t - 1 + d(o, p)) mod (n - 1)`` with ``d(o, p) = (p - o - 1) mod n`` (ALGORITHMS.md §8.4):
    over the n-1 rounds every ordered pair carries every sub-chunk index once, and in every round each
    receiver gets n-1 distinct indices, one from each origin.
    """
    return (t - 1 + (p - o - 1) % n) % (n - 1)


def direct_schedule(n: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``table[t - 1][o][p] = direct_subchunk(o, p, t, n)`` (-1 on the diagonal) for rounds 1 .. n-1."""
    return tuple(tuple(tuple(-1 if o == p else direct_subchunk(o, p, t, n) for p in range(n)) for o in range(n))
                 for t in range(1, n))


def _write_tables(path: Path = TABLES, limit: int = 64) -> None:
    """Regenerate the shipped table: ``search_cycles(n, seed=0)`` for n = 10, 14, ... up to ``limit``."""
    cycles = {}
    for n in range(10, limit + 1, 4):
        found = search_cycles(n, _TABLE_SEED)
        verify_cycles(found, n)
        cycles[str(n)] = [list(c) for c in found]
    doc = {"about": "Directed Hamiltonian decompositions of K*_n for n = 2 mod 4 (seqpar.comm.topology."
                    "search_cycles, seed 0); verified on load. Regenerate: python -m seqpar.comm.topology",
           "cycles": cycles}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    _write_tables()
    print(f"wrote {TABLES}")
