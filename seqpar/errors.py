"""Errors seqpar raises for input it cannot serve.

Validation errors use the built-in types (``ValueError`` for bad values, ``TypeError`` for bad types,
``NotImplementedError`` for options we do not support) and the form "X must Y, got Z (rank r)".
``UnsupportedInputError`` is raised when no kernel (or the named one) can serve an input: it carries every
reason, per kernel tried.
"""

from __future__ import annotations

__all__ = ["UnsupportedInputError", "rank_suffix"]


class UnsupportedInputError(NotImplementedError):
    """No kernel serves this input. ``reasons`` maps each kernel tried to why it refused."""

    def __init__(self, what: str, reasons: dict[str, list[str]]):
        self.reasons = reasons
        lines = [what]
        for name, why in reasons.items():
            lines.append(f"  {name}: " + "; ".join(why))
        super().__init__("\n".join(lines))


def rank_suffix() -> str:
    """" (rank r of W)" when torch.distributed is initialised, else "" - appended to every error message.

    A read-only query, imported lazily so that importing errors (from any layer) never pulls in distributed.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return f" (rank {dist.get_rank()} of {dist.get_world_size()})"
    return ""
