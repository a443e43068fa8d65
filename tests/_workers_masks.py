"""Bad ``mask_mod`` functions for tests/test_masks_bad.py (module level, so pool workers unpickle them)."""

import torch


def returns_int(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx).int()


def wrong_shape(b, h, q_idx, kv_idx):
    return torch.ones(3, 3, 3, dtype=torch.bool)


def raises(b, h, q_idx, kv_idx):
    raise RuntimeError("boom in the mask")


def reads_head(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (h == 0)


def out_of_range(b, h, q_idx, kv_idx):
    table = torch.ones(8, dtype=torch.bool)      # shorter than the sequence: its last positions index past it
    return table[q_idx] & (kv_idx <= q_idx)


def refilled_table(world: int) -> list[float]:
    """A mask_mod reading a visibility table through its closure, refilled in place between two calls: each call
    must match the dense oracle of the table as it is then (errors of out and dq, per call)."""
    import seqpar
    from seqpar.testing.oracle import dense_attention

    S = 8 * world
    table = torch.ones(S, S, dtype=torch.bool)

    def mod(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, S, n, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2, 4))
    errors = []
    for refill in (None, lambda t: t[:, : S // 2].fill_(False), lambda t: t.fill_(True)):
        if refill is not None:
            refill(table)                            # in place: the same function object, the same tensor
        ql, kl, vl = (seqpar.shard(x, layout="contiguous").requires_grad_() for x in (q, k, v))
        out = seqpar.attention(ql, kl, vl, causal=True, layout="contiguous", mask_mod=mod)
        out.backward(seqpar.shard(do, layout="contiguous"))
        ref = dense_attention(q, k, v, do, causal=True, mask_mod=mod)
        got_out = seqpar.unshard(out.detach(), layout="contiguous")
        got_dq = seqpar.unshard(ql.grad, layout="contiguous")
        errors.append(max((got_out - ref["out"]).abs().max().item(), (got_dq - ref["dq"]).abs().max().item()))
    return errors
