"""``python -m bench`` (``make bench``): run benchmarks by name from the register.

    python -m bench                 overhead, then routing quality, with their defaults
    python -m bench NAME [flags]    one benchmark (its flags: python -m bench NAME -h)
    python -m bench list            the register: name, make target, what it measures

The names, their modules and where their targets are stated: ``bench/registry.py``. Results
are printed as Markdown tables and written as JSON under ``var/bench/``; targets and the latest
judged results are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import sys

from bench.registry import DEFAULT, find, render


def main(argv: list[str]) -> None:
    """Dispatch through the register; an unknown name prints it and exits 2 (a usage error)."""
    if not argv or argv[0] == "all":
        for name in DEFAULT:
            bench = find(name)
            assert bench is not None, name
            bench.run([])
        return
    if argv[0] in {"list", "help", "-h", "--help"}:
        print(__doc__.strip() + "\n\n" + render() if argv[0] != "list" else render())
        return
    bench = find(argv[0])
    if bench is None:
        print(f"unknown benchmark {argv[0]!r}\n\n{render()}", file=sys.stderr)
        raise SystemExit(2)
    bench.run(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
