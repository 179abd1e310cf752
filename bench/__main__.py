"""``python -m bench`` (``make bench``): every benchmark with its default settings.

    python -m bench                 overhead, then routing quality
    python -m bench overhead [...]  only the overhead benchmark (flags: python -m bench.overhead -h)
    python -m bench routing [...]   only routing quality (flags: python -m bench.routing_quality -h)
    python -m bench federation [...]  table propagation and evacuation on the real control plane
                                      (PostgreSQL + Redis; flags: python -m bench.federation -h)
    python -m bench metering [...]    usage ingestion rate and report time on PostgreSQL
                                      (flags: python -m bench.metering -h)
    python -m bench console [...]     the console's page times with 5,000 tenants on PostgreSQL
                                      (flags: python -m bench.console -h)
    python -m bench failover [...]    engine death -> out of every table, region loss, load step
                                      -> new instance, on the real control plane with the local
                                      provisioner (python -m bench.failover -h)
    python -m bench cold-start [...]  scale from zero: a cold model's first request to its first
                                      token, on the real control plane (-m bench.cold_start -h)
    python -m bench instructions [...]  metering's instructions per request at the edge, counted
                                      by callgrind (load-independent; -m bench.instructions -h)
    python -m bench fleet-day [...]   a simulated day of follow-the-sun traffic: GPU-hours and TTFT
                                      of static, reactive and fedinfer scaling (-m bench.fleet_day)
    python -m bench placement [...]   the placement planner's solve time on a synthetic fleet
                                      (-m bench.placement -h)
    python -m bench prefix-tokens [...]  what exact prefix matching costs per request: render,
                                      tokenize, hash, look up (-m bench.prefix_tokens -h)

Results are printed as Markdown tables and written as JSON under ``var/bench/``.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from bench import overhead, routing_quality

    if not argv or argv[0] == "all":
        overhead.main([])
        routing_quality.main([])
    elif argv[0] == "overhead":
        overhead.main(argv[1:])
    elif argv[0] in {"routing", "routing_quality"}:
        routing_quality.main(argv[1:])
    elif argv[0] == "federation":
        from bench import federation

        federation.main(argv[1:])
    elif argv[0] == "metering":
        from bench import metering

        metering.main(argv[1:])
    elif argv[0] == "console":
        from bench import console

        console.main(argv[1:])
    elif argv[0] == "failover":
        from bench import failover

        failover.main(argv[1:])
    elif argv[0] == "cold-start":
        from bench import cold_start

        cold_start.main(argv[1:])
    elif argv[0] == "placement":
        from bench import placement

        placement.main(argv[1:])
    elif argv[0] == "fleet-day":
        from bench import fleet_day

        fleet_day.main(argv[1:])
    elif argv[0] == "prefix-tokens":
        from bench import prefix_tokens

        prefix_tokens.main(argv[1:])
    elif argv[0] == "instructions":
        from bench import instructions

        instructions.main(argv[1:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
