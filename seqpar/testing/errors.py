"""Bad-input checks run on every rank: each rank reports the error it raised (or that it raised none)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["call_and_report"]


def call_and_report(kind: str, kwargs: dict[str, Any], shapes: dict[str, tuple], dtypes: dict[str, str],
                    per_rank: dict[int, dict[str, Any]] | None = None) -> tuple[str, str] | None:
    """Build q, k, v from ``shapes``/``dtypes`` and call ``seqpar.<kind>``; return ``(ExcType, message)``.

    ``per_rank`` overrides keyword arguments on some ranks (inputs that disagree across ranks).
    """
    import torch.distributed as dist

    import seqpar

    kw = dict(kwargs)
    kw.update((per_rank or {}).get(dist.get_rank(), {}))
    mesh = kw.pop("mesh_2d", None)
    if mesh is not None:
        kw["mesh"] = seqpar.make_mesh(ulysses=mesh, device_type="cpu")
    sinks = kw.pop("sinks_shape", None)
    if sinks is not None:
        kw["sinks"] = torch.zeros(sinks)
    tensors = {n: torch.zeros(*s, dtype=getattr(torch, dtypes.get(n, "float32"))) for n, s in shapes.items()}
    try:
        if kind == "attention":
            seqpar.attention(tensors.pop("q"), tensors.pop("k"), tensors.pop("v"), **kw)
        else:
            getattr(seqpar, kind)(*tensors.values(), **kw)
    except Exception as e:   # the test inspects the type and message of whatever was raised
        return type(e).__name__, str(e)
    return None
