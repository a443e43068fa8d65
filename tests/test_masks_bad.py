"""Bad masks: a clear error naming the argument and the rank, raised on every rank before any method collective."""

import _workers_masks as bad
import pytest
from conftest import assert_same_error_on_every_rank

from seqpar import masks
from seqpar.testing.cases import HashMask
from seqpar.testing.errors import call_and_report

Q, KV = (1, 8, 4, 16), (1, 8, 2, 16)
OK = {"q": Q, "k": KV, "v": KV}

CASES = [
    # (what, kwargs, exception type, words, per-rank overrides)
    ("not callable", {"mask_mod": 3}, "TypeError", ["mask_mod must be a callable", "got 3"], None),
    ("wrong dtype", {"mask_mod": bad.returns_int}, "TypeError", ["mask_mod must return a bool tensor", "int32"], None),
    ("wrong shape", {"mask_mod": bad.wrong_shape}, "ValueError", ["mask_mod must return the broadcast shape",
                                                                  "(3, 3, 3)"], None),
    ("raises", {"mask_mod": bad.raises}, "ValueError", ["mask_mod raised RuntimeError", "boom in the mask"], None),
    ("out of range", {"mask_mod": bad.out_of_range}, "ValueError", ["mask_mod raised IndexError"], None),
    ("reads the head", {"mask_mod": bad.reads_head}, "NotImplementedError",
     ["must not depend on the batch or head index", "reading h"], None),
    ("differs across ranks", {"check_ranks": 1}, "RankDisagreementError", ["rank 1 has mask_mod"],
     {0: {"mask_mod": HashMask(1)}, 1: {"mask_mod": HashMask(2)}}),
    ("named masks differ", {"check_ranks": 1}, "RankDisagreementError", ["rank 1 has mask_mod", "chunked"],
     {0: {"mask_mod": masks.chunked(4)}, 1: {"mask_mod": masks.chunked(8)}}),
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["ring", "ulysses", "allgather"])
def test_bad_masks_raise_the_same_clear_error_on_every_rank(pools, world, method):
    pool = pools(world)
    for what, kwargs, exc, words, per_rank in CASES:
        reports = pool.run(call_and_report, "attention", {**kwargs, "method": method}, OK, {}, per_rank)
        try:
            assert_same_error_on_every_rank(reports, exc, words)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None


def test_named_mask_arguments_are_checked():
    for make, args, words in ((masks.chunked, (0,), "size must be an int >= 1"),
                              (masks.spans, ([(4, 2)],), "spans must be sorted"),
                              (masks.tree, ((0, 4, 3), (-1, 0)), "cuts must be increasing"),
                              (masks.tree, ((0, 4, 6), (-1, 1)), "parents must give"),
                              (masks.sink_window, (4, 0), "sinks must be an int >= 1"),
                              (masks.prefix_lm, (-1,), "prefix must be an int >= 1")):
        with pytest.raises(ValueError, match=words):
            make(*args)


@pytest.mark.parametrize("world", [1, 2])
def test_a_mask_tensor_refilled_in_place_is_planned_again(pools, world):
    """A mask_mod closing over a tensor refilled in place between calls (the same function object) gives each
    call's own answer: the plan is keyed on the captured tensor's version, not on the function alone."""
    for rank, errors in enumerate(pools(world).run(bad.refilled_table, world)):
        assert max(errors) < 1e-10, (rank, errors)
