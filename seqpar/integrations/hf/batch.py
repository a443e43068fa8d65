"""``shard_batch``: this rank's share of a global causal-LM batch (tokens, global positions, shifted labels and
loss weights, documents), and the per-batch layout the attention calls use (``batch_layout``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ... import methods
from ...api import placement, shard
from ...errors import rank_suffix
from ...layouts import DOCUMENT_LAYOUTS
from .loss import _check_weights

__all__ = ["batch_layout", "shard_batch"]

_SEQ_KEYS = ("input_ids", "inputs_embeds")
_KNOWN = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "shift_labels",
                    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "num_items_in_batch",
                    "loss_weights", "token_type_ids"})


def shard_batch(batch: Mapping[str, Any], mesh: Any = None, method: str = "usp", layout: str | None = None, *,
                pad: bool = False, pad_token_id: int = 0, ignore_index: int = -100,
                seq_keys: Iterable[str] = ()) -> dict[str, Any]:
    """This rank's share of a global causal-LM batch, ready for ``model(**batch)``.

    Every rank of the sequence-parallel group passes the same global batch (no communication happens).

    Note [Labels are shifted before sharding]: a causal LM predicts token t+1 at position t; after sharding,
    t and t+1 may live on different ranks (always, at a zigzag seam). So labels are shifted on the GLOBAL
    sequence (``shift_labels[t] = labels[t + 1]``, ``ignore_index`` at the end, exactly as transformers'
    loss does) and then sharded like the tokens; transformers' loss uses ``shift_labels`` when given.
    ``loss_weights`` (the weight of each token as a target, aligned with ``labels``) are shifted the same way
    (the weight at t is that of the token t+1 it predicts, 0 at the end) and sharded with the labels, so
    ``sequence_parallel_loss(..., weights=batch["loss_weights"])`` weighs each target by its own weight (Note
    [Weighted token loss]).

    Documents (Note [Documents, padding and positions]): boundaries come from, in any combination,
    ``cu_seq_lens_q`` (global, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` makes them),
    ``position_ids`` that restart (transformers' packed-sequence rule: a position that is not the previous
    plus one starts a document), and an ``attention_mask`` whose valid tokens form one run per row (left or
    right padding: the padding becomes its own document and its tokens and targets are ignored in the loss).
    Boundaries must be the same in every row (seqpar's documents are per call); a mask with holes, rows with
    different documents, or ``cu_seq_lens_q`` that disagrees with restarting ``position_ids`` raise.
    Positions: the given ``position_ids``; else positions restarting at each ``cu_seq_lens_q`` document; else
    ``0..S-1`` (transformers' default, padding included).

    Images (Gemma 3): ``token_type_ids`` ``(B, S)`` of the whole batch marks image tokens with 1; each run of 1s
    is one image, whose tokens attend to each other bidirectionally (transformers' gemma3). They become
    ``image_spans``, the global ``(start, end)`` of every run (over the packed row when it holds documents),
    which the attention function turns into each layer's mask (Note [Layer masks] in ``layers``); the model
    never gets ``token_type_ids`` (it would build its image blocks from this rank's shard). Every row must have
    the same images (seqpar's masks are per call). Give the model the merged embeddings: ``inputs_embeds``
    computed on the whole batch (the vision tower and the embedding merge), not ``input_ids`` with pixels. A
    ``token_type_ids`` that is a plain per-token input (BERT's segment ids) goes in ``seq_keys`` instead: it is
    then sharded as it is.

    Args:
        batch: global tensors ``(B, S)`` (``inputs_embeds``: ``(B, S, C)``) with keys among ``input_ids`` or
            ``inputs_embeds``, ``attention_mask``, ``position_ids``, ``labels``, ``shift_labels``,
            ``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``, ``num_items_in_batch``, ``loss_weights`` (a
            finite, non-negative float ``(B, S)`` per token, with ``labels`` or ``shift_labels``),
            ``token_type_ids`` (Gemma 3's image tokens, 1 = image), plus ``seq_keys``.
        mesh, method, layout: the placement (as in ``enable``; ``layout=None``: ``balanced`` when the batch has
            documents and the method accepts it, else the method's default, see ``batch_layout``).
        pad: end-pad a length the layout cannot split (with ``pad_token_id``, ignored labels, one more
            document) instead of raising.
        ignore_index: the label value that is not a target.
        seq_keys: other per-token ``(B, S, ...)`` keys to shard as they are.

    Returns:
        ``input_ids`` (or ``inputs_embeds``) and ``position_ids`` ``(B, L)``; with labels, ``labels`` and
        ``shift_labels`` (both the shifted, sharded targets) and ``num_items_in_batch`` (the global count of
        targets, so ``model(**batch).loss`` is this rank's share of the global mean); with documents,
        ``cu_seq_lens_q``/``_k`` (global boundaries, int32 on the CPU) and ``max_length_q``/``_k``; with
        ``loss_weights``, ``loss_weights`` ``(B, L)`` (shifted and sharded like ``shift_labels``) for
        ``sequence_parallel_loss(..., weights=)``: pop it before ``model(**batch)`` (transformers' loss has no
        per-token weights, and the attention function refuses the unknown key). ``num_items_in_batch`` stays
        the target count, not the weight sum. With image tokens, ``image_spans``: ``((start, end), ...)`` global
        positions, for the attention function (through the model's keyword arguments).
    """
    seq_keys = tuple(seq_keys)
    rs = rank_suffix()
    unknown = sorted(set(batch) - _KNOWN - set(seq_keys))
    if unknown:
        raise TypeError(f"batch keys must be among {sorted(_KNOWN)} (or named in seq_keys= to shard as they are), "
                        f"got {unknown}{rs}")
    given = [k for k in _SEQ_KEYS if batch.get(k) is not None]
    if len(given) != 1:
        raise ValueError(f"batch must have exactly one of input_ids, inputs_embeds, got {given or 'neither'}{rs}")
    x = batch[given[0]]
    if x.dim() != (2 if given[0] == "input_ids" else 3):
        raise ValueError(f"{given[0]} must be (batch, seq{'' if given[0] == 'input_ids' else ', hidden'}), got "
                         f"shape {tuple(x.shape)}{rs}")
    B, S = x.shape[:2]
    valid = _padding(batch.get("attention_mask"), B, S, x.device)
    pos = _positions_BS(batch.get("position_ids"), B, S, x.device)
    explicit = _explicit_docs(batch, S)
    bounds = set(explicit or ())
    if pos is not None:
        resets = _position_resets(pos)
        if explicit is not None and not resets <= set(explicit):
            raise ValueError(f"position_ids restart at {sorted(resets)[:8]} but cu_seq_lens_q has boundaries "
                             f"{list(explicit)[:8]}: they must describe the same documents{rs}")
        bounds |= resets
    if valid is not None:
        bounds |= _valid_run(valid)
    cu = tuple(sorted(bounds | {0, S})) if len(bounds - {0, S}) or explicit is not None else None
    if pos is None:
        pos = _doc_positions(explicit, S, x.device).expand(B, S) if explicit is not None else \
            torch.arange(S, device=x.device).expand(B, S)
    spans = _image_spans(batch.get("token_type_ids"), B, S) if "token_type_ids" not in seq_keys else ()
    targets = _shift_labels(batch, valid, ignore_index)
    weights = _shift_weights(batch.get("loss_weights"), targets, B, S)
    out: dict[str, Any] = {}
    items = batch.get("num_items_in_batch")
    if targets is not None and items is None:
        items = (targets != ignore_index).sum()
    requested, layout = layout, batch_layout(method, layout, cu)
    lay_div = _divisor(mesh, method, layout, cu)
    tensors = {given[0]: x, "position_ids": pos, **{k: batch[k] for k in seq_keys if batch.get(k) is not None}}
    if targets is not None:
        tensors["labels"] = targets
    if weights is not None:
        tensors["loss_weights"] = weights               # end padding: weight 0 (_pad_end)
    if S % lay_div:
        if not pad:
            need = -(-S // lay_div) * lay_div
            raise ValueError(f"sequence length must be a multiple of {lay_div} for the {layout} layout of method="
                             f"{method!r}, got {S} (pad to {need}, or pass pad=True){rs}")
        tensors, cu = _pad_end(tensors, cu, S, lay_div, pad_token_id, ignore_index, given[0])
        layout = batch_layout(method, requested, cu)   # the padding is a document now; its divisor divides lay_div
    where = {"mesh": mesh, "method": method, "layout": layout, "cu_seqlens": cu}
    for key, t in tensors.items():
        out[key] = shard(t.contiguous(), dim=1, **where)
    if targets is not None:
        out["shift_labels"] = out["labels"]
        out["num_items_in_batch"] = items
    if cu is not None:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        longest = max(b - a for a, b in itertools.pairwise(cu))
        out.update(cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t, max_length_q=longest, max_length_k=longest)
    if spans:
        out["image_spans"] = spans
    return out


def batch_layout(method: str, layout: str | None, cu: tuple[int, ...] | None) -> str | None:
    """The layout of one batch: ``layout`` when given; else, for a batch with documents, the method's
    ``document_layout`` (``balanced`` - packed rows keep equal work per rank - or all-gather's
    ``balanced_whole``), else None (the method's default)."""
    if layout is not None or cu is None or method == "auto":
        return layout
    return methods.get(method).document_layout()


def _divisor(mesh: Any, method: str, layout: str | None, cu: tuple[int, ...] | None) -> int:
    lay, _, _ = placement(mesh, method, layout, cu if layout in DOCUMENT_LAYOUTS else None)
    return lay.divisor


def _padding(mask: Any, B: int, S: int, device: torch.device) -> torch.Tensor | None:
    """A (B, S) bool of valid tokens, or None when there is no mask or no padding."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, S):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise NotImplementedError(f"attention_mask must be a (batch, seq) = ({B}, {S}) padding mask; custom masks "
                                  f"(4D or other) cannot be sharded, got {shape}{rank_suffix()}")
    valid = mask.to(device=device, dtype=torch.bool)
    return None if bool(valid.all()) else valid


def _valid_run(valid: torch.Tensor) -> set[int]:
    """Boundaries of the one run of valid tokens every row must share (padding before/after it)."""
    rs = rank_suffix()
    rows = valid.cpu()
    if not bool((rows == rows[0]).all()):
        raise NotImplementedError(
            "attention_mask rows must pad the same positions (seqpar's documents are shared by the batch); "
            f"got rows with different padding: give each sequence-parallel group one row, or pack the rows into "
            f"one with cu_seq_lens_q{rs}")
    row = rows[0]
    idx = row.nonzero().flatten()
    if idx.numel() == 0:
        raise ValueError(f"attention_mask must mark at least one valid token, got all zeros{rs}")
    a, b = int(idx[0]), int(idx[-1]) + 1
    if not bool(row[a:b].all()):
        raise NotImplementedError(
            f"attention_mask must have its valid tokens in one run per row (left or right padding), got padding "
            f"inside the run [{a}, {b}); such a mask cannot be expressed as documents{rs}")
    return {a, b}


def _image_spans(types: Any, B: int, S: int) -> tuple[tuple[int, int], ...]:
    """Gemma 3's images: the global ``(start, end)`` of every run of ``token_type_ids == 1`` (shared by the rows)."""
    rs = rank_suffix()
    if types is None:
        return ()
    if not isinstance(types, torch.Tensor) or types.is_floating_point() or tuple(types.shape) != (B, S):
        got = f"shape {tuple(types.shape)} {types.dtype}" if isinstance(types, torch.Tensor) else type(types).__name__
        raise TypeError(f"batch key ['token_type_ids'] must be a ({B}, {S}) integer tensor of token types (Gemma 3: "
                        f"1 = image token, each run of 1s one image), got {got}; a per-token model input to shard as "
                        f"it is (BERT's segment ids) goes in seq_keys{rs}")
    image = (types == 1).cpu()
    if not bool((image == image[0]).all()):
        raise NotImplementedError(
            "token_type_ids must mark the same image positions in every row (seqpar's masks are shared by the "
            f"batch), got rows that differ: give each sequence-parallel group one row, or pack the rows into one"
            f"{rs}")
    row = torch.cat([torch.zeros(1, dtype=torch.int8), image[0].to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = (row[1:] - row[:-1]).nonzero().flatten().tolist()
    return tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]))


def _positions_BS(pos: Any, B: int, S: int, device: torch.device) -> torch.Tensor | None:
    if pos is None:
        return None
    if not isinstance(pos, torch.Tensor) or pos.shape[-1] != S or pos.dim() > 2:
        raise ValueError(f"position_ids must be (batch, seq), (1, seq) or (seq,) with seq={S}, got "
                         f"{tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__}{rank_suffix()}")
    pos = pos.to(device)
    return (pos[None] if pos.dim() == 1 else pos).expand(B, S)


def _position_resets(pos: torch.Tensor) -> set[int]:
    """transformers' packed-sequence rule: t > 0 starts a document when ``pos[t] != pos[t - 1] + 1``."""
    resets = (pos[:, 1:] != pos[:, :-1] + 1).cpu()
    if not bool((resets == resets[0]).all()):
        raise NotImplementedError(f"position_ids must restart at the same positions in every row (seqpar's "
                                  f"documents are shared by the batch), got rows that differ{rank_suffix()}")
    return {int(t) + 1 for t in resets[0].nonzero().flatten()}


def _explicit_docs(batch: Mapping[str, Any], S: int) -> tuple[int, ...] | None:
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    if cu_q is None:
        if cu_k is not None:
            raise ValueError(f"cu_seq_lens_k must come with cu_seq_lens_q, got only cu_seq_lens_k{rank_suffix()}")
        return None
    cu = _as_tuple(cu_q)
    if cu_k is not None and _as_tuple(cu_k) != cu:
        raise NotImplementedError(f"cu_seq_lens_k must equal cu_seq_lens_q (self-attention), got {_as_tuple(cu_k)[:8]}"
                                  f" and {cu[:8]}{rank_suffix()}")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != S or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seq_lens_q must rise from 0 to the sequence length {S}, got {list(cu)[:12]}"
                         f"{rank_suffix()}")
    return cu


def _doc_positions(cu: tuple[int, ...], S: int, device: torch.device) -> torch.Tensor:
    """Positions restarting at every document: ``t - start(doc(t))``, ``(S,)``."""
    pos = torch.arange(S, device=device)
    bounds = torch.tensor(cu, dtype=torch.long, device=device)
    starts = bounds[torch.searchsorted(bounds[1:], pos, right=True).clamp_(max=len(cu) - 2)]
    return pos - starts


def _shift_labels(batch: Mapping[str, Any], valid: torch.Tensor | None, ignore: int) -> torch.Tensor | None:
    """Global targets: ``labels[t + 1]`` at t (or ``shift_labels`` as given); padding never a query or target."""
    shifted = batch.get("shift_labels")
    labels = batch.get("labels")
    if shifted is None and labels is None:
        return None
    if shifted is None:
        if valid is not None:
            labels = labels.masked_fill(~valid, ignore)
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore)], 1)
    if valid is not None:
        shifted = shifted.masked_fill(~valid, ignore)
        shifted[:, :-1].masked_fill_(~valid[:, 1:], ignore)
    return shifted


def _shift_weights(weights: Any, targets: torch.Tensor | None, B: int, S: int) -> torch.Tensor | None:
    """Global per-target weights: ``loss_weights[t + 1]`` at t (the predicted token's), 0 at the end."""
    if weights is None:
        return None
    if targets is None:
        raise ValueError(f"loss_weights must come with labels or shift_labels (they weigh the targets), got "
                         f"loss_weights alone{rank_suffix()}")
    _check_weights(weights, (B, S), "loss_weights", "labels")
    return torch.cat([weights[:, 1:], weights.new_zeros((B, 1))], 1)


def _pad_end(tensors: dict[str, torch.Tensor], cu: tuple[int, ...] | None, S: int, div: int, pad_id: int,
             ignore: int, token_key: str) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """End-pad to a multiple of ``div``: the padding is one more document, never a target."""
    S_pad = -(-S // div) * div
    extra = S_pad - S
    out = {}
    for key, t in tensors.items():
        shape = list(t.shape)
        shape[1] = extra
        if key == "position_ids":            # global positions: the padding document's RoPE is irrelevant
            tail = torch.arange(S, S_pad, device=t.device, dtype=t.dtype).expand(t.shape[0], extra)
        elif key == "labels":
            tail = t.new_full(shape, ignore)
        elif key == token_key == "input_ids":
            tail = t.new_full(shape, pad_id)
        else:
            tail = t.new_zeros(shape)
        out[key] = torch.cat([t, tail], 1)
    return out, tuple(sorted(set(cu or (0, S)) | {S, S_pad}))


def _as_tuple(cu: Any) -> tuple[int, ...]:
    if isinstance(cu, torch.Tensor):
        _check_boundary_tensor(cu)
        return tuple(int(x) for x in cu.tolist())
    return tuple(int(x) for x in cu)


def _check_boundary_tensor(cu: torch.Tensor) -> None:
    if cu.dim() != 1 or cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
        raise TypeError(f"cu_seq_lens_q must be a 1D integer tensor, got {cu.dtype} of shape {tuple(cu.shape)}"
                        f"{rank_suffix()}")
