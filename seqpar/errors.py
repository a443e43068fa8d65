"""Errors seqpar raises for input it cannot serve.

Validation errors use the built-in types (``ValueError`` for bad values, ``TypeError`` for bad types,
``NotImplementedError`` for options we do not support) and the form "X must Y, got Z (rank r)".
``UnsupportedInputError`` is raised when no kernel (or the named one) can serve an input: it carries every
reason, per kernel tried. ``RankDisagreementError`` is raised on every rank when the ranks of a group make
different calls (``seqpar.agreement``); ``VerificationError`` when verify mode measures an error above the
tolerance (``seqpar.verification``).
"""

from __future__ import annotations

__all__ = ["RankDisagreementError", "UnsupportedInputError", "VerificationError", "rank_suffix"]


class UnsupportedInputError(NotImplementedError):
    """No kernel serves this input. ``reasons`` maps each kernel tried to why it refused."""

    def __init__(self, what: str, reasons: dict[str, list[str]]):
        self.reasons = reasons
        lines = [what]
        for name, why in reasons.items():
            lines.append(f"  {name}: " + "; ".join(why))
        super().__init__("\n".join(lines))


class RankDisagreementError(ValueError):
    """The ranks of one sequence-parallel group made different calls (or some rejected the call).

    Raised with the same message on every rank that accepted the call; it names the ranks that differ and
    how (``"rank 2 has k shape (1, 8, 2, 16) where ranks 0-1, 3 have (1, 8, 4, 16)"``).
    """


class VerificationError(RuntimeError):
    """Verify mode measured an error above the tolerance; raised on every rank with the measured errors."""


def rank_suffix() -> str:
    """" (rank r of W)" when torch.distributed is initialised, else "" - appended to every error message.

    A read-only query, imported lazily so that importing errors (from any layer) never pulls in distributed.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return f" (rank {dist.get_rank()} of {dist.get_world_size()})"
    return ""
