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
