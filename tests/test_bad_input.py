"""Bad input: a clear error naming the argument, the value and the rank, raised on every rank, no hang."""

import pytest

from seqpar.testing.errors import call_and_report

Q = (1, 8, 4, 16)
KV = (1, 8, 2, 16)
OK = {"q": Q, "k": KV, "v": KV}

CASES = [
    # (what, kwargs, shapes, dtypes, exception type, words the message must contain)
    ("dtype mismatch", {}, OK, {"k": "bfloat16"}, "TypeError", ["share a dtype", "bfloat16"]),
    ("non-floating", {}, OK, {"q": "int64", "k": "int64", "v": "int64"}, "TypeError", ["floating dtype", "int64"]),
    ("head dims", {}, {"q": Q, "k": (1, 8, 2, 8), "v": (1, 8, 2, 8)}, {}, "ValueError", ["head_dim", "16", "8"]),
    ("batch", {}, {"q": Q, "k": (2, 8, 2, 16), "v": (2, 8, 2, 16)}, {}, "ValueError", ["batch", "1", "2"]),
    ("kv heads", {}, {"q": (1, 8, 4, 16), "k": (1, 8, 3, 16), "v": (1, 8, 3, 16)}, {}, "ValueError",
     ["multiple of kv heads", "H=4", "Hkv=3"]),
    ("zigzag split", {"layout": "zigzag"}, {"q": (1, 7, 4, 16), "k": (1, 7, 2, 16), "v": (1, 7, 2, 16)}, {},
     "ValueError", ["multiple of 2", "zigzag", "got 7"]),
    ("3D tensor", {}, {"q": (8, 4, 16), "k": KV, "v": KV}, {}, "ValueError", ["4D", "(8, 4, 16)"]),
    ("k/v shapes", {}, {"q": Q, "k": KV, "v": (1, 8, 1, 16)}, {}, "ValueError",
     ["k and v must have the same (batch, seq_local, kv heads)", "(1, 8, 1, 16)"]),
    ("unknown method", {"method": "spiral"}, OK, {}, "ValueError", ["method must be one of", "spiral"]),
    ("unknown layout", {"layout": "diagonal"}, OK, {}, "ValueError", ["layout must be one of", "diagonal"]),
    ("unknown kernel", {"kernel": "fast"}, OK, {}, "ValueError", ["kernel must be one of", "fast"]),
    ("named kernel cannot serve", {"kernel": "cudnn"}, OK, {}, "UnsupportedInputError", ["cudnn", "CUDA"]),
    ("dropout", {"dropout_p": 0.1}, OK, {}, "NotImplementedError", ["dropout_p", "0.1"]),
    ("alibi", {"alibi_slopes": [1.0]}, OK, {}, "NotImplementedError", ["alibi_slopes"]),
    ("softcap", {"softcap": -1.0}, OK, {}, "ValueError", ["softcap must be a float >= 0", "-1.0"]),
    ("sinks shape", {"sinks_shape": (3,)}, OK, {}, "ValueError", ["sinks must be a floating tensor of shape (4,)",
                                                                   "(3,)"]),
    ("check_ranks", {"check_ranks": 0}, OK, {}, "TypeError", ["check_ranks must be True, False or a positive int"]),
    ("unknown option", {"heads_k_stride": 2}, OK, {}, "TypeError", ["takes options", "heads_k_stride"]),
    ("bad window", {"window_size": (-3, 0)}, OK, {}, "ValueError", ["window_size", "(-3, 0)"]),
    ("cu_seqlens end", {"cu_seqlens": [0, 3, 5]}, OK, {}, "ValueError", ["cu_seqlens must end", "got 5"]),
    ("2D mesh for ring", {"mesh_2d": 2}, OK, {}, "ValueError", ["1D mesh", "2D mesh"]),
    ("head_chunks", {"head_chunks": 3}, OK, {}, "ValueError", ["head_chunks", "kv heads (2)", "got 3"]),
    ("unknown transport", {"transport": "rdma"}, OK, {}, "ValueError", ["transport must be one of", "'rdma'"]),
    ("copy engines on CPU", {"transport": "copy_engine"}, OK, {}, "ValueError",
     ["transport='copy_engine' needs CUDA tensors on an NCCL group", "not on CUDA", "transport='nccl'"]),
    ("Ulysses' copy engines on CPU", {"method": "ulysses", "layout": "contiguous", "transport": "copy_engine"}, OK, {},
     "ValueError", ["transport='copy_engine' needs CUDA tensors on an NCCL group", "not on CUDA", "transport='nccl'"]),
    ("Ulysses' unknown transport", {"method": "ulysses", "layout": "contiguous", "transport": "nvshmem"}, OK, {},
     "ValueError", ["transport must be one of", "'nvshmem'"]),
    ("USP's copy engines on CPU", {"method": "usp", "mesh_2d": 2, "layout": "zigzag", "transport": "copy_engine"}, OK,
     {}, "ValueError", ["transport='copy_engine' needs CUDA tensors on an NCCL group", "not on CUDA"]),
    ("auto's copy engines on CPU", {"method": "auto", "transport": "copy_engine"}, OK, {}, "ValueError",
     ["transport='copy_engine' needs CUDA tensors on an NCCL group", "not on CUDA"]),
]


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_raises_the_same_clear_error_on_every_rank(pools, world):
    pool = pools(world)
    for what, kwargs, shapes, dtypes, exc, words in CASES:
        if what in ("2D mesh for ring", "USP's copy engines on CPU") and world != 4:
            continue
        reports = pool.run(call_and_report, "attention", kwargs, shapes, dtypes)
        for rank, rep in enumerate(reports):
            assert rep is not None, f"{what}: rank {rank} raised nothing"
            name, msg = rep
            assert name == exc, f"{what}: rank {rank} raised {name}: {msg}"
            for w in [*words, f"rank {rank} of {world}"]:
                assert w in msg, f"{what}: rank {rank} message lacks {w!r}: {msg}"


def test_shard_of_a_length_the_layout_cannot_split(pools):
    reports = pools(2).run(call_and_report, "shard", {"layout": "zigzag"}, {"x": (1, 10, 2, 4)}, {})
    for name, msg in reports:
        assert name == "ValueError" and "multiple of 4" in msg and "pad to 12" in msg
