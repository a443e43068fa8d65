"""Every shell command in README.md runs: each is found, then run or skipped with its reason.

Commands are the lines of ``bash``/``sh`` blocks, ``# torchrun ...``-style first lines of Python blocks, and
inline code spans in the prose that start with a command (``python``, ``torchrun``, ``pip``, ...); ``a && b``
is two commands. Each runs from a scratch directory (files it writes land there; paths of the repository are
made absolute) with this interpreter, and must exit 0. What cannot run here is skipped by the rule in
``SKIP`` that names why; commands that would take minutes run on a smaller problem (``REDUCED``) or show
their ``--help`` (``HELP_ONLY``). Together about 40 s on 2 cores.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMAND = r"(?:python|torchrun|pip|bash|pytest|ruff)\b"

#: command prefix -> why it does not run here
SKIP = {
    "pip install": "installs packages: changes the environment and needs the network",
    "torchrun": "needs torchrun on GPUs (NCCL); the CPU paths of the same code run in the test suite",
    "python -m pytest": "the whole test suite: minutes, and this test is part of it",
}
#: the same command on a smaller problem, and why
REDUCED = {
    "python -m seqpar demo": ("python -m seqpar demo --world 2 --seq-len 128",
                              "every method vs the oracle on 2 processes and 128 tokens: seconds, not a minute"),
    "python -m seqpar.bench --emulate-world W": (
        "python -m seqpar.bench --emulate-world 4 --preset tiny-causal --device cpu --methods ulysses --warmup 0 "
        "--iters 1", "rank r of 4 emulated on CPU at the smoke preset: the GPU run takes minutes"),
    "python -m seqpar.bench --preset masks": (
        "python -m seqpar.bench --emulate-world 4 --preset tiny-mask --device cpu --methods ulysses --modes fwd "
        "--warmup 0 --iters 1", "the mask presets are GPU sizes: the CPU smoke mask preset, rank r of 4 emulated"),
    "python benchmarks/train_table.py --svg docs/train_memory.svg": (
        "python benchmarks/train_table.py --svg train_memory.svg",
        "the same plot into the scratch directory: the repository's own docs/train_memory.svg stays as committed"),
    "python -m seqpar.bench.inference --entry generate --baseline": (
        "python -m seqpar.bench.inference --entry generate --baseline --device cpu --preset tiny --contexts 96 "
        "--repeats 1 --check", "the small model at 32K-128K on a GPU: the tiny model on CPU, one repeat"),
}
#: commands shown as a name whose real run needs inputs and minutes: their ``--help`` must work
HELP_ONLY = {
    "python -m seqpar.planner.fit": "fits the benchmark result files (benchmarks/results/...) in ~5 minutes",
    "python benchmarks/bench_call_cost.py": "a benchmark: a minute of timing, meaningless on a busy machine",
    "python benchmarks/gpu/train_8b.py --out r8b.jsonl --phases step": "Llama-3-8B at 1M tokens: minutes of an H100",
    "python -m seqpar.bench --emulate-world 4 --link h200-nvswitch": "the modelled link holds CUDA streams: a GPU "
                                                                     "only (tests/test_link.py: its CPU side)",
}


def readme_commands(text: str | None = None) -> list[str]:
    """The shell commands of README.md, in order, duplicates once."""
    text = (ROOT / "README.md").read_text() if text is None else text
    found: list[str] = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        for line in body.splitlines():
            line = line.strip()
            if lang in ("bash", "sh", "shell", "console") and line and not line.startswith("#"):
                found.append(re.sub(r"\s+#.*$", "", line))
            elif re.match(r"#\s*" + COMMAND, line):                  # "# torchrun --nproc-per-node 4 train.py"
                found.append(re.sub(r"\s{2,}.*$", "", line.lstrip("#").strip()))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)
              if re.match(COMMAND, " ".join(span.split()))]
    commands = [part.strip() for cmd in found for part in cmd.split("&&")]
    return list(dict.fromkeys(commands))


def _why_skipped(command: str) -> str | None:
    return next((why for prefix, why in SKIP.items() if command.startswith(prefix)), None)


def _argv(command: str) -> list[str]:
    """``command`` as argv: this interpreter for ``python``, repository paths made absolute."""
    words = shlex.split(command)
    if words[0] == "python":
        words[0] = sys.executable
    return [str(ROOT / w) if not w.startswith("-") and "/" in w and (ROOT / w).exists() else w for w in words]


def test_the_readme_commands_are_found():
    """The extraction sees the commands the README is about (an extractor that finds nothing passes nothing)."""
    commands = readme_commands()
    for want in ("python -m seqpar demo", "python -m seqpar plan", "python -m pytest"):
        assert any(c.startswith(want) for c in commands), commands
    assert readme_commands("x\n```bash\na --b  # c\npython -m d && pip install e\n```\nsee `python f`, `g`\n") == \
        ["a --b", "python -m d", "pip install e", "python f"]


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, tmp_path):
    why = _why_skipped(command)
    if why is not None:
        pytest.skip(why)
    run = REDUCED.get(command, (command, ""))[0]
    if command in HELP_ONLY:
        run = f"{command} --help"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(_argv(run), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{run!r} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
