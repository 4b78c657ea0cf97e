"""Command line: ``python -m lightning_autopipe {profile,plan} ...``."""

from __future__ import annotations

import sys

__all__ = ["main"]

_COMMANDS = {
    "profile": ("lightning_autopipe.graph.cli", "profile_main"),
    "plan": ("lightning_autopipe.planner.cli", "plan_main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        names = ", ".join(_COMMANDS)
        usage = f"usage: python -m lightning_autopipe {{{names}}} [--help] ..."
        if argv and argv[0] in ("-h", "--help"):
            print(usage)  # asked for: standard output, exit 0
            return 0
        problem = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"{usage}\nerror: {problem}; choose one of {names}", file=sys.stderr)
        return 2
    module_name, func_name = _COMMANDS[argv[0]]
    import importlib

    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
