"""yunchang's ``AttnType`` and what each member means on seqpar (``seqpar.compat.yunchang.kernels``).

``from yunchang.kernels import AttnType`` becomes ``from seqpar.compat.yunchang.kernels import AttnType``; the
members and their string values are yunchang 0.6.4's. Each member either names the seqpar kernel that serves
it or raises, with the reason, when the layer or function using it is built or called:

    AttnType.FA               "auto": exact attention, fp32 lse, by seqpar's fastest kernel for each block (the
                              flash-attn package, PyTorch's FA2 or cuDNN on GPU; the reference on CPU), logged on
                              "seqpar.kernels" (yunchang's default, which needs flash-attn)
    AttnType.TORCH_MATH       "reference": the pure-torch kernel (yunchang's returns lse = 0 there, PEERS.md §2)
    AttnType.TORCH_FLASH      "flash": PyTorch's FlashAttention-2 (CUDA)
    AttnType.TORCH_EFFICIENT  "efficient": PyTorch's memory-efficient kernel (CUDA)
    AttnType.TORCH_CUDNN      "cudnn": PyTorch's cuDNN kernel (CUDA)
    FA3, FLASHINFER, AITER, NPU, SAGE_*, SPARSE_SAGE: raise (no such kernel in seqpar; the SAGE family is
                              quantized or sparse, i.e. approximate, attention)
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from ...errors import rank_suffix

__all__ = ["AttnType", "seqpar_kernel"]


class AttnType(Enum):
    """yunchang 0.6.4's kernel choices (same members and values)."""

    AITER = "aiter"
    FA = "fa"
    FA3 = "fa3"
    FLASHINFER = "flashinfer"
    TORCH_MATH = "torch_math"
    TORCH_FLASH = "torch_flash"
    TORCH_EFFICIENT = "torch_efficient"
    TORCH_CUDNN = "torch_cudnn"
    SAGE_AUTO = "sage_auto"
    SAGE_FP16 = "sage_fp16"
    SAGE_FP16_TRITON = "sage_fp16_triton"
    SAGE_FP8 = "sage_fp8"
    SAGE_FP8_SM90 = "sage_fp8_sm90"
    SPARSE_SAGE = "sparse_sage"
    NPU = "npu"

    @classmethod
    def from_string(cls, s: str) -> AttnType:
        for member in cls:
            if member.value == s:
                return member
        raise ValueError(f"'{s}' is not a valid {cls.__name__}")


_KERNELS = {AttnType.FA: "auto", AttnType.TORCH_MATH: "reference", AttnType.TORCH_FLASH: "flash",
            AttnType.TORCH_EFFICIENT: "efficient", AttnType.TORCH_CUDNN: "cudnn"}
_SAGE = "SageAttention's quantized (approximate) attention"
_NO_KERNEL = {
    AttnType.FA3: "FlashAttention-3 (seqpar has no FA3 kernel; AttnType.FA runs its fastest exact kernel)",
    AttnType.FLASHINFER: "FlashInfer (seqpar has no FlashInfer kernel; AttnType.FA runs its fastest exact kernel)",
    AttnType.AITER: "AMD's AITER kernels (seqpar has no AITER kernel)",
    AttnType.NPU: "Ascend NPU fused attention (seqpar has no NPU kernel)",
    AttnType.SAGE_AUTO: _SAGE, AttnType.SAGE_FP16: _SAGE, AttnType.SAGE_FP16_TRITON: _SAGE,
    AttnType.SAGE_FP8: _SAGE, AttnType.SAGE_FP8_SM90: _SAGE,
    AttnType.SPARSE_SAGE: "SpargeAttn's sparse (approximate) attention",
}


def seqpar_kernel(attn_type: Any, attn_processor: Any = None) -> str:
    """The seqpar kernel name serving ``attn_type`` (an ``AttnType`` or its string value); raises otherwise."""
    if isinstance(attn_type, str):
        attn_type = AttnType.from_string(attn_type)
    if not isinstance(attn_type, AttnType):
        raise TypeError(f"attn_type must be a seqpar.compat.yunchang.AttnType (or its string value), got "
                        f"{attn_type!r}{rank_suffix()}")
    if attn_processor is not None:
        raise NotImplementedError(f"attn_processor must be None: seqpar runs its own kernels and cannot call a "
                                  f"custom attention processor, got {type(attn_processor).__name__}{rank_suffix()}")
    if attn_type in _NO_KERNEL:
        raise NotImplementedError(f"attn_type={attn_type} is not supported: {_NO_KERNEL[attn_type]}{rank_suffix()}")
    return _KERNELS[attn_type]
