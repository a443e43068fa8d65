"""The one-way import rule, enforced by an AST scan (docs/DESIGN.md, "Layers")."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "seqpar"

# package -> packages it must not import (directly or by relative import)
FORBIDDEN = {
    "kernels": {"methods", "comm", "api", "modules", "integrations", "bench", "planner", "groups", "torch.distributed",
                "runtime"},
    "comm": {"methods", "kernels", "api", "modules", "integrations", "bench", "planner", "runtime"},
    "layouts": {"methods", "kernels", "comm", "api", "modules", "integrations", "bench", "planner", "groups",
                "torch.distributed", "runtime"},
    "methods": {"api", "modules", "integrations", "bench", "planner", "runtime", "verification", "testing"},
    "inference": {"methods", "modules", "integrations", "bench", "planner"},   # attention through api only
    # the planned call: below the API, above the methods; reaches the planner and verify only through hooks
    "runtime": {"api", "modules", "integrations", "bench", "planner", "verification", "testing", "compat",
                "inference"},
    "cost": {"methods", "api", "modules", "integrations", "bench", "planner", "runtime", "kernels", "comm",
             "testing"},
    "planner": {"api", "modules", "integrations", "bench", "runtime", "verification", "testing", "compat"},
    "verification": {"testing", "integrations", "bench", "compat", "planner"},
    "compat": {"bench", "planner", "testing"},
    "integrations": {"bench", "compat", "planner", "testing"},
}
# modules below the methods inside a package the methods may import only in part
BELOW_METHODS = {"comm.loop": {"methods", "api", "planner", "runtime"}}
# methods use the one loop (comm.loop), never the planned call built on top of them
METHODS_MUST_NOT = {"seqpar.runtime.call", "seqpar.runtime.op"}
BASE = {"types", "errors", "masks", "config", "numerics"}


def _imports(path: pathlib.Path) -> set[str]:
    """Absolute module names imported by ``path`` (relative imports resolved inside seqpar)."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    pkg = list(rel.parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names.add(mod)
                names |= {f"{mod}.{a.name}" for a in node.names}
            else:
                names.add(node.module or "")
    return names


def _layer(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "seqpar" and len(parts) > 1:
        return parts[1]
    if name.startswith("torch.distributed"):
        return "torch.distributed"
    return None


def test_imports_run_one_way():
    bad = []
    for path in ROOT.rglob("*.py"):
        layer = path.relative_to(ROOT).parts[0]
        forbidden = FORBIDDEN.get(layer)
        if forbidden is None:
            continue
        for name in _imports(path):
            target = _layer(name)
            if target in forbidden:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_methods_below_the_planned_call():
    bad = []
    for path in (ROOT / "methods").glob("*.py"):
        bad += [f"methods/{path.name} imports {n}" for n in _imports(path) if n.split(".")[:3] and
                ".".join(n.split(".")[:3]) in METHODS_MUST_NOT]
    for mod, forbidden in BELOW_METHODS.items():
        path = ROOT / (mod.replace(".", "/") + ".py")
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "seqpar" and (parts[1] in forbidden or ".".join(parts[1:3]) in forbidden):
                bad.append(f"{mod} imports {name}")
    assert not bad, "\n".join(bad)


def test_methods_never_import_each_other():
    from seqpar.methods.base import BUILTIN

    methods = set(BUILTIN)
    bad = []
    for path in (ROOT / "methods").glob("*.py"):
        for name in _imports(path):
            parts = name.split(".")
            if parts[:2] == ["seqpar", "methods"] and len(parts) > 2 and parts[2] in methods and parts[2] != path.stem:
                bad.append(f"methods/{path.name} imports {name}")
    assert not bad, "\n".join(bad)


def _base_files(stem: str) -> list[pathlib.Path]:
    """A base module's file, or every file of a base package (``masks``)."""
    return sorted((ROOT / stem).glob("*.py")) if (ROOT / stem).is_dir() else [ROOT / f"{stem}.py"]


def test_base_modules_import_nothing_above_them():
    for stem in BASE:
        for name in (n for path in _base_files(stem) for n in _imports(path)):
            target = _layer(name)
            lazy = (target, stem) == ("torch.distributed", "errors")
            allowed = target is None or target in BASE | {"layouts"} or lazy
            assert allowed, f"{stem}.py imports {name}"


# the cost model (seqpar.cost) sits below the methods; the planner above them reaches them through the registry
NOT_BELOW_THE_MODEL = ("seqpar.methods", "seqpar.planner", "seqpar.runtime", "seqpar.api")


def _file(name: str) -> pathlib.Path | None:
    """The source file of module ``name``, or of its parent when ``name`` is a name imported from it."""
    for mod in (name, name.rpartition(".")[0]):
        base = ROOT.parent / mod.replace(".", "/")
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
    return None


def _closure(name: str) -> set[str]:
    """Every seqpar module ``name`` imports, directly or through the modules it imports."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        path = _file(todo.pop())
        if path is None or str(path) in seen:
            continue
        seen.add(str(path))
        todo += [n for n in _imports(path) if n.startswith("seqpar.")]
    return {str(pathlib.Path(p).relative_to(ROOT.parent).with_suffix("")).replace("/", ".").removesuffix(".__init__")
            for p in seen}


def test_methods_import_the_cost_model_never_the_planner():
    bad = []
    for path in (ROOT / "methods").glob("*.py"):
        bad += [f"methods/{path.name} imports {n}" for n in _imports(path) if _layer(n) == "planner"]
    assert not bad, "\n".join(bad)
    below = _closure("seqpar.cost.model") | _closure("seqpar.cost")
    assert not [m for m in below if m.startswith(NOT_BELOW_THE_MODEL)], sorted(below)


def test_planner_reads_methods_through_the_registry():
    import seqpar.methods

    registry = {"seqpar.methods", *(f"seqpar.methods.{n}" for n in seqpar.methods.__all__)}
    bad = []
    for path in (ROOT / "planner").glob("*.py"):
        bad += [f"planner/{path.name} imports {n}" for n in _imports(path)
                if _layer(n) == "methods" and n not in registry]
    assert not bad, "\n".join(bad)


def test_import_seqpar_leaves_the_planner_unloaded():
    """``import seqpar`` (and loading a method) imports no planner search; ``seqpar.plan`` loads it on first use."""
    code = ("import sys, seqpar; assert not [m for m in sys.modules if m.startswith('seqpar.planner')], 'import'; "
            "seqpar.methods.get('ring'); assert 'seqpar.planner.search' not in sys.modules, 'method'; "
            "from seqpar.planner.search import plan; assert seqpar.plan is plan")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_import_seqpar_is_the_core():
    """The top level is the core API (issue 24): ``import seqpar`` loads no compat, inference, integration or
    planner module, ``__all__`` holds no peer's names, and the old top-level ring-flash-attn names, the cache and
    the subpackages still resolve on first use."""
    code = ("import sys, seqpar; heavy = ('compat', 'inference', 'integrations', 'planner', 'flash_api'); "
            "bad = [m for m in sys.modules if any(m.startswith('seqpar.' + h) for h in heavy)]; assert not bad, bad; "
            "assert not [n for n in seqpar.__all__ if 'flash_attn' in n], seqpar.__all__; "
            "assert len(seqpar.__all__) <= 24, len(seqpar.__all__); "
            "from seqpar.compat import ring_flash_attn as rfa; "
            "assert seqpar.zigzag_ring_flash_attn_func is rfa.zigzag_ring_flash_attn_func; "
            "assert seqpar.substitute_hf_flash_attn is rfa.substitute_hf_flash_attn; "
            "from seqpar.inference import ShardedKVCache; assert seqpar.ShardedKVCache is ShardedKVCache; "
            "assert seqpar.inference.attend is not None; "
            "assert not hasattr(seqpar, 'no_such_name')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_no_package_cycles():
    """No two packages (or top-level modules) of seqpar import each other, lazily or not (issue 24); the package
    root, which re-exports the API, is the one exception."""
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        src = rel[0].removesuffix(".py")
        if src == "__init__":
            continue
        for name in _imports(path):
            dst = _layer(name)
            if dst and dst != src and ((ROOT / dst).is_dir() or (ROOT / f"{dst}.py").is_file()):
                edges.setdefault(src, set()).add(dst)
    cycles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a < b and a in edges.get(b, ()))
    assert not cycles, cycles


def test_methods_and_inference_run_on_the_one_loop():
    """Every transfer of a method or of inference is posted through ``comm.loop`` (``Loop.post`` / ``run_steps``),
    which completes what a rank posted when a step raises (Note [Faults in a schedule]): none commits its own."""
    bad = []
    for pkg in ("methods", "inference"):
        for path in (ROOT / pkg).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "commit":
                    bad.append(f"{pkg}/{path.name}:{node.lineno}")
    assert not bad, bad
