"""Region processes: ``fedinfer engine-sim`` and ``fedinfer edge``. No Django here."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = args[0], args[1:]
    if command == "engine-sim":
        from regions.engines.simulator.cli import main as sim_main

        sim_main(rest)
    elif command == "edge":
        from regions.edge.cli import main as edge_main

        edge_main(rest)
    else:
        raise SystemExit(f"unknown region command {command!r}")
