"""The HF integration's shape (issue 24): one job per module under ``seqpar.integrations.hf``, no import cycle
among the integration's modules, and ``seqpar.integrations.huggingface`` a thin module that re-exports the same
public names as before the split. AST scans, one process, no transformers needed for the scan."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

INTEGRATIONS = pathlib.Path(__file__).resolve().parents[1] / "seqpar" / "integrations"
HF_MODULES = ["huggingface", "hf_generate", "hf.attention", "hf.batch", "hf.layers", "hf.loss", "hf.grads"]
PUBLIC = ["Handle", "SPLoss", "SeqparCache", "all_reduce_gradients", "batch_layout", "enable", "generate", "prefill",
          "reduce_loss", "sequence_parallel_loss", "serving", "shard_batch", "token_loss_sum"]


def _path(module: str) -> pathlib.Path:
    return INTEGRATIONS.joinpath(*module.split(".")).with_suffix(".py")


def _imports(module: str) -> set[str]:
    """The integration modules ``module`` imports, anywhere in the file (function bodies included)."""
    pkg = ["seqpar", "integrations", *module.split(".")[:-1]]
    found = set()
    for node in ast.walk(ast.parse(_path(module).read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            short = name.removeprefix("seqpar.integrations.")
            if short != name and short in HF_MODULES and short != module:
                found.add(short)
    return found


def test_no_import_cycle_among_the_hf_modules():
    graph = {m: _imports(m) for m in HF_MODULES}
    for start in HF_MODULES:                    # depth-first from each module: it must never come back
        stack, seen = list(graph[start]), set()
        while stack:
            m = stack.pop()
            assert m != start, f"import cycle through seqpar.integrations.{start}: {graph}"
            if m not in seen:
                seen.add(m)
                stack.extend(graph[m])
    for m in HF_MODULES[1:]:
        assert "huggingface" not in graph[m], f"{m} imports the re-exporting module huggingface"


def test_huggingface_only_re_exports():
    """No function or class is defined in huggingface.py: each job has its own module."""
    tree = ast.parse(_path("huggingface").read_text())
    defined = [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    assert defined == [], defined


def test_public_names_are_unchanged():
    pytest.importorskip("transformers")
    sp_hf = importlib.import_module("seqpar.integrations.huggingface")
    for name in PUBLIC:
        assert name in sp_hf.__all__ and getattr(sp_hf, name) is not None, name
    assert sp_hf.shard_batch is importlib.import_module("seqpar.integrations.hf.batch").shard_batch
    assert sp_hf.enable is importlib.import_module("seqpar.integrations.hf.attention").enable
