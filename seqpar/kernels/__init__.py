"""Local attention on ONE rank: ``(q, k, v, mask) -> AttnOutput``. Never imports torch.distributed.

Kernels: ``reference`` (pure torch, any device), ``cudnn``, ``flash`` (FA2), ``efficient`` (PyTorch's fused
kernels; ``sdpa`` names the family), ``flex`` (FlexAttention), ``flash_attn`` (FlashAttention-2, if
installed) and ``flash_attn3`` (FlashAttention-3, if installed; named, never auto).
``select(name, KernelCall.of(q, k, mask))`` picks one or raises with every reason; ``kernel="auto"`` ranks
cudnn > flash_attn > flash > flex > efficient on CUDA (never the reference there) and uses the reference on
CPU. ``merge`` holds MERGE and the fp32 accumulator.
"""

from __future__ import annotations

from . import cpu, flash_attn, flex, reference, sdpa  # noqa: F401  (registers the kernels)
from .base import KERNELS, Kernel, KernelCall, available_kernels, mask_kind, select
from .merge import Accumulator, merge_
from .reference import attention_reference

__all__ = ["KERNELS", "Accumulator", "Kernel", "KernelCall", "attention_reference", "available_kernels",
           "mask_kind", "merge_", "select"]
