"""``python -m seqpar <command>``: ``demo`` (every method vs the dense oracle) and ``plan`` (the planner)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": "seqpar.demo", "plan": "seqpar.planner.cli"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m seqpar {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
