"""Flex's backward kernel on a block's FINAL rows, with no recomputed forward (CUDA).

Note [Flex backward from the final rows]
    A block of a merged call (a ring's step, a joined band with its neighbours' keys) needs its share of the
    gradient from the FINAL rows: with ``P = exp(S - lse)`` on the final lse, ``dV = P^T dO``,
    ``dS = P (dO V^T - Delta)``, ``Delta = rowsum(dO O) - dlse`` - what cuDNN's and FA2's backward compute when
    given the final out and lse. Flex's public API has only autograd: its backward runs after its own forward, so
    seqpar recomputed every block's forward (with its partial lse) and fed autograd the block's merge weights
    ``w = exp(l_b - lse)`` - a forward kernel and five fp32 passes over the output rows per block. On an H100 the
    sink window's busiest rank over 8 spent 2.94 of its 16.5 ms backward on that forward
    (``benchmarks/results/2026-11-26-h100-sink-profile``).

    Flex's backward kernel is a higher-order op, ``flex_attention_backward(q, k, v, out, lse, dO, dlse, ...)``,
    that takes out and lse like those kernels (its lse in base 2). Dynamo does not trace a direct call to it, so
    this module traces one call with ``make_fx`` - the block mask's tensors, the mask's and the score function's
    closed-over tensors as inputs (``_lift``), so one compile serves every mask of a family and shape, as the
    forward's compile does - and hands the graph to inductor (``torch._inductor.compile``), which lowers it to the
    same Triton backward kernel flex's autograd runs. Given the folded rows ``(dO', O')`` (Note [Folding the lse
    gradient] in ``seqpar.numerics``) and no lse gradient, its Delta is ``rowsum(dO' O')``, as the other kernels'.

    What it relies on is private to PyTorch (the op, ``create_fw_bw_graph``, the block mask's tuple form, kernel
    option defaults), so the first build of each variant is checked: if tracing or compiling raises, that variant
    warns once and keeps the recomputing backward (``FlexKernel.backward``), which is correct on every torch.
    Variants are kept per (mask family, score function, shapes, strides, dtypes, scale, options), at most
    ``VARIANTS``; calls whose shapes vary batch to batch keep the recompute (``FlexKernel.dynamic``). Every tensor
    a function reads through its closure, its defaults or the globals its code names is an input of the graph, read
    at each call (a batch's document ids refilled or replaced are seen, and no variant holds them); values it closes
    over key the variant by value or, held weakly, by identity (``seqpar.memo.Same``). A function that reads a
    tensor some other way - a callable object's attribute, a module's attribute, a tensor it builds from a literal
    - would be traced in as a constant, so such a call keeps the recompute too (``_Untracked``).
"""

from __future__ import annotations

import math
import threading
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..memo import Same

__all__ = ["VARIANTS", "final_rows_backward", "variants"]

VARIANTS = 128
"""Compiled backward variants kept (one per mask family, score function and block shape)."""

_LOG2E = 1.0 / math.log(2.0)
_VARIANTS: OrderedDict[tuple, tuple | None] = OrderedDict()    # key -> (compiled graph, order), None: build failed
_LOCK = threading.Lock()


class _Untracked(Exception):
    """A mask or score function reads a tensor this module cannot hand the graph at each call."""


def _part(x: Any) -> Any:
    """A value a traced function closes over, as a key part: a plain value as itself, an object with equality of
    its own (a frozen dataclass ``mask_mod``) by value, anything else by identity (``Same``: an ``id`` reused after
    the object is gone never matches)."""
    if isinstance(x, (int, float, bool, str, type(None))):
        return x
    if not isinstance(x, torch.Tensor) and type(x).__eq__ is not object.__eq__:
        try:
            hash(x)
            return x
        except TypeError:
            pass
    return Same(x)


def _lift(fn: Callable, tensors: list[torch.Tensor]) -> tuple[Callable[[tuple], Callable], tuple]:
    """``(rebuild, key)``: ``fn`` with every tensor it reads - through its closure, its defaults and the globals its
    code names, and through the plain functions among them - appended to ``tensors``; ``rebuild(ts)`` is ``fn``
    reading ``ts[i]`` instead of each, so the graph gets them as inputs at every call. ``key`` names the structure
    (code, values, tensor shapes and dtypes). A callable object is kept as it is (``_part``); one holding tensors
    raises ``_Untracked``.
    """
    if not isinstance(fn, types.FunctionType):
        if any(isinstance(x, torch.Tensor) for x in getattr(fn, "__dict__", {}).values()):
            raise _Untracked(f"{type(fn).__name__} holds tensors")
        return (lambda ts: fn), ("obj", _part(fn))
    try:
        cells = [c.cell_contents for c in fn.__closure__ or ()]
    except ValueError:                                    # an empty cell (a function still being defined)
        return (lambda ts: fn), ("fn", Same(fn))
    names = [n for n in fn.__code__.co_names if isinstance(fn.__globals__.get(n), torch.Tensor)]

    def take(x: Any) -> tuple[Callable[[tuple], Any], Any]:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            i = len(tensors) - 1
            return (lambda ts: ts[i]), ("t", tuple(x.shape), x.dtype, x.device)
        if isinstance(x, types.FunctionType):
            return _lift(x, tensors)
        return (lambda ts: x), ("c", _part(x))
    cell_parts = [take(x) for x in cells]
    global_parts = [take(fn.__globals__[n]) for n in names]
    default_parts = [take(x) for x in fn.__defaults__ or ()]

    def rebuild(ts: tuple) -> Callable:
        glob = {**fn.__globals__, **{n: p(ts) for n, (p, _) in zip(names, global_parts)}} if names else fn.__globals__
        out = types.FunctionType(fn.__code__, glob, fn.__name__,
                                 tuple(p(ts) for p, _ in default_parts) if fn.__defaults__ is not None else None,
                                 tuple(types.CellType(p(ts)) for p, _ in cell_parts) if fn.__closure__ else None)
        out.__kwdefaults__ = fn.__kwdefaults__
        return out
    return rebuild, (fn.__code__, *(tuple(k for _, k in ps) for ps in (cell_parts, global_parts, default_parts)),
                     tuple(names))


def _identity(score, b, h, m, n):
    return score


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _build(q, k, v, out, lse2, do, block_mask, score_mod, scale: float, options: dict) -> tuple[tuple, Callable, list]:
    """``(key, make, inputs)``: the variant's key, a function building ``(compiled graph, order)``, and the call's
    inputs; ``order(inputs)`` are the graph's (the functions' constants placed)."""
    from torch._higher_order_ops.flex_attention import flex_attention_backward

    layout = block_mask.as_tuple()
    mask_bufs: list[torch.Tensor] = []
    rebuild_mask, mask_key = _lift(layout[-1], mask_bufs)
    score_bufs: list[torch.Tensor] = []
    rebuild_score, score_key = _lift(score_mod or _identity, score_bufs)
    block_tensors = [x for x in layout[:-1] if isinstance(x, torch.Tensor)]
    inputs = [q, k, v, out, lse2, do, *block_tensors, *mask_bufs, *score_bufs]
    key = (mask_key, score_key, tuple(x if not isinstance(x, torch.Tensor) else None for x in layout[:-1]),
           tuple(_meta(t) for t in inputs), scale, tuple(sorted(options.items())))
    n_block, n_mask = len(block_tensors), len(mask_bufs)

    def make() -> Callable:
        from torch.fx.experimental.proxy_tensor import make_fx

        mask_graph, mask_consts, fw_graph, joint_graph, score_consts = _subgraphs(
            q, rebuild_mask, mask_bufs, rebuild_score, score_bufs)
        if any(c.dim() for c in (*mask_consts, *score_consts)):    # read another way (a module's attribute)
            raise _Untracked("a tensor read otherwise than through its closure, defaults or globals")
        n_mask_all = n_mask + len(mask_consts)

        def grads(q, k, v, out, lse2, do, *rest):
            blocks = iter(rest[:n_block])
            mask_args, score_args = rest[n_block:n_block + n_mask_all], rest[n_block + n_mask_all:]
            tup = (*(next(blocks) if isinstance(x, torch.Tensor) else x for x in layout[:-1]), mask_graph)
            dq, dk, dv, _ = flex_attention_backward(q, k, v, out, lse2, do, None, fw_graph, joint_graph, tup, scale,
                                                    options, tuple(score_args), tuple(mask_args))
            return dq, dk, dv

        # constants go after their own function's tensors: (block, mask's, mask constants, score's, score constants)
        def order(xs: list) -> list:
            return [*xs[:6 + n_block + n_mask], *mask_consts, *xs[6 + n_block + n_mask:], *score_consts]
        full = order(inputs)
        gm = make_fx(grads, tracing_mode="fake")(*full)        # fake: the op's eager form is dense
        if q.device.type == "cuda":
            from torch._inductor import compile as compile_graph

            gm = compile_graph(gm, full)
        return gm, order                                   # on CPU the op's eager (dense) form: the tests' path
    return key, make, inputs


def _subgraphs(q: torch.Tensor, rebuild_mask, mask_bufs: list, rebuild_score, score_bufs: list) -> tuple:
    """``(mask graph, its constants, fw graph, joint graph, the score graph's constants)``: aten graphs of the mask and
    score functions with every tensor they use an input (``_as_inputs``) - traced inside the op's own trace, their
    indexing left constants the compile could not take - and the score function's joint."""
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph

    idx = tuple(q.new_zeros((), dtype=torch.int) for _ in range(4))

    def score_fn(score, b, h, m, n, *bufs):
        return rebuild_score(bufs)(score, b, h, m, n)

    def mask_fn(b, h, m, n, *bufs):
        return rebuild_mask(bufs)(b, h, m, n)

    score_graph, score_consts = _as_inputs(_traced(score_fn, q.new_zeros((), dtype=torch.float32), *idx, *score_bufs))
    mask_graph, mask_consts = _as_inputs(_traced(mask_fn, *idx, *mask_bufs))
    with torch.enable_grad():              # built inside an autograd backward: the joint needs the score's grad
        fw_graph, joint_graph = create_fw_bw_graph(
            score_graph, (q.new_zeros((), dtype=torch.float32, requires_grad=True), *idx), (*score_bufs, *score_consts))
    return mask_graph, mask_consts, fw_graph, joint_graph, score_consts


def _traced(fn: Callable, *args: torch.Tensor):
    """``fn``'s aten graph, tensor indexing as flex traces it (a 0-d index tensor reads an element)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.fx.experimental.proxy_tensor import make_fx

    with TransformGetItemToIndex():
        return make_fx(fn)(*args)


def _as_inputs(gm) -> tuple[Any, list[torch.Tensor]]:
    """``gm`` with each tensor constant (an integer index made a tensor while tracing) an input after the others:
    ``(graph, constants)``."""
    graph = gm.graph
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    consts: list[torch.Tensor] = []
    for node in list(graph.nodes):
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.Tensor):
            with graph.inserting_after(last):
                last = graph.placeholder(f"constant_{len(consts)}")
            consts.append(getattr(gm, node.target))
            node.replace_all_uses_with(last)
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.lift_fresh_copy.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    gm.recompile()
    return gm, consts


def _kernel_options(q, k, v, options: dict) -> dict:
    """Flex's defaults for ``options`` as its public call fills them in (``_apply_kernel_options``)."""
    from torch.nn.attention.flex_attention import _apply_kernel_options

    return dict(_apply_kernel_options(q, k, v, True, dict(options)))


def final_rows_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, block_mask, score_mod, scale: float, options: dict
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A block's ``(dq, dk, dv)`` ``(B, S, H, D)`` from the final rows ``do``, ``out`` ``(B, Sq, H, Dv)`` (folded:
    Delta is ``rowsum(do out)``) and ``lse`` ``(B, H, Sq)`` natural log, by flex's backward kernel alone (Note
    [Flex backward from the final rows]); None where this variant could not be built (it then warned once) or a
    function reads a tensor the graph could not take at each call (``_Untracked``): the caller recomputes."""
    q_BHSD, k_BHSD, v_BHSD, out_BHSD, do_BHSD = (x.transpose(1, 2) for x in (q, k, v, out, do))
    opts = _kernel_options(q_BHSD, k_BHSD, v_BHSD, options)
    lse2_BHS = (lse.float() * _LOG2E).nan_to_num_(nan=0.0, neginf=0.0)   # a row seeing no key: all masked
    try:
        key, make, inputs = _build(q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse2_BHS, do_BHSD, block_mask, score_mod, scale,
                                   opts)
    except _Untracked:
        return None
    with _LOCK:
        known = key in _VARIANTS
        fn = _VARIANTS.get(key)
        if known:
            _VARIANTS.move_to_end(key)
    if not known:
        try:
            fn = make()
        except _Untracked:
            fn = None
        except Exception as e:                              # a torch whose private pieces differ: keep the recompute
            warnings.warn(f"seqpar: flex's backward from the final rows could not be built on torch "
                          f"{torch.__version__} ({type(e).__name__}: {str(e)[:200]}); this block shape recomputes "
                          f"its forward in the backward instead", RuntimeWarning, stacklevel=3)
            fn = None
        with _LOCK:
            _VARIANTS[key] = fn
            while len(_VARIANTS) > VARIANTS:
                _VARIANTS.popitem(last=False)
    if fn is None:
        return None
    fn, order = fn
    args = order(inputs)
    dq_BHSD, dk_BHSD, dv_BHSD = fn(*args)
    return dq_BHSD.transpose(1, 2), dk_BHSD.transpose(1, 2), dv_BHSD.transpose(1, 2)


def variants() -> dict[tuple, Any]:
    """The kept variants (tests)."""
    with _LOCK:
        return dict(_VARIANTS)
