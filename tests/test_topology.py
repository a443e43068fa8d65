"""Link schedules (seqpar.comm.topology) for every W from 2 to 64: cycles, paths, direct rounds, routing."""

from __future__ import annotations

import json

import pytest

from seqpar.comm import topology as tp

WORLDS = list(range(2, 65))


def _arcs(cycle):
    return list(zip(cycle, (*cycle[1:], cycle[0])))


@pytest.mark.parametrize("n", WORLDS)
def test_cycles_decompose_the_complete_digraph(n):
    if n in (4, 6):
        assert not tp.has_cycles(n)
        with pytest.raises(ValueError, match="no decomposition"):
            tp.hamiltonian_cycles(n)
        return
    cycles = tp.hamiltonian_cycles(n)
    assert len(cycles) == n - 1
    for c in cycles:                                        # every cycle Hamiltonian
        assert sorted(c) == list(range(n))
    arcs = [a for c in cycles for a in _arcs(c)]
    assert len(arcs) == len(set(arcs)) == n * (n - 1)       # every arc exactly once
    assert all(a != b for a, b in arcs)


@pytest.mark.parametrize("n", WORLDS)
def test_routing_tables(n):
    if not tp.has_cycles(n):
        return
    cycles = tp.hamiltonian_cycles(n)
    out_map, in_map = tp.routing_tables(cycles)
    for r in range(n):
        assert sorted(out_map[r]) == sorted(in_map[r]) == [p for p in range(n) if p != r]
        assert sorted(out_map[r].values()) == sorted(in_map[r].values()) == list(range(n - 1))
        for p, g in out_map[r].items():
            c = cycles[g]
            assert c[(c.index(r) + 1) % n] == p
            assert in_map[p][r] == g


@pytest.mark.parametrize("n", [n for n in WORLDS if n % 2 == 0])
def test_hamiltonian_paths(n):
    paths = tp.hamiltonian_paths(n)
    tp.verify_paths(paths, n)
    for i, p in enumerate(paths):
        assert p[0] == i and p[-1] == (i + n // 2) % n
    if n == 8:
        assert paths[0] == (0, 1, 7, 2, 6, 3, 5, 4)


@pytest.mark.parametrize("n", WORLDS)
def test_direct_schedule_coverage_and_distinctness(n):
    table = tp.direct_schedule(n)
    assert len(table) == n - 1
    for o in range(n):                     # each ordered pair carries every sub-chunk index exactly once
        for p in range(n):
            if o != p:
                assert sorted(table[t][o][p] for t in range(n - 1)) == list(range(n - 1))
    for t in range(n - 1):                 # each round: every receiver gets n-1 distinct indices
        for p in range(n):
            got = [table[t][o][p] for o in range(n) if o != p]
            assert len(set(got)) == n - 1
        for o in range(n):                 # ... and every origin sends n-1 distinct indices
            sent = [table[t][o][p] for p in range(n) if p != o]
            assert len(set(sent)) == n - 1


def test_constructions_directly():
    for n in range(3, 40, 2):
        tp.verify_cycles(tp.walecki_cycles(n), n)
    for n in range(8, 80, 4):
        tp.verify_cycles(tp.tasp_cycles(n), n)
    for n in (8, 10, 30, 66):
        tp.verify_cycles(tp.search_cycles(n, seed=3), n)
    with pytest.raises(ValueError):
        tp.walecki_cycles(6)
    with pytest.raises(ValueError):
        tp.tasp_cycles(10)


def test_verify_rejects_bad_cycles():
    good = [list(c) for c in tp.hamiltonian_cycles(5)]
    with pytest.raises(ValueError, match="twice"):
        tp.verify_cycles([good[0], good[0], good[1], good[2]], 5)
    with pytest.raises(ValueError, match="Hamiltonian"):
        tp.verify_cycles([[0, 1, 2, 3, 3], *good[1:]], 5)
    with pytest.raises(ValueError, match="cycles"):
        tp.verify_cycles(good[:3], 5)


def test_shipped_tables_are_complete_and_valid():
    data = json.loads(tp.TABLES.read_text())
    assert sorted(int(n) for n in data["cycles"]) == list(range(10, 65, 4))
    for n, cycles in data["cycles"].items():
        tp.verify_cycles(cycles, int(n))
        assert tp.hamiltonian_cycles(int(n)) == tuple(tuple(c) for c in cycles)
