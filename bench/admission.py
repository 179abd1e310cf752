"""CPU cost of admission per request: API-key hash lookup + budget/residency + two token buckets.

    .venv/bin/python -m bench.admission [--tenants 5000] [--n 200000]

Baseline in the same run: ``parse_request`` of the same small chat body (already on the hot
path). Reported as process CPU µs per request (min of 5 repetitions) and as a ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import msgspec

from regions.edge.http.endpoints import CHAT
from regions.edge.http.parse import parse_request
from regions.edge.policy.admission import Admission
from regions.tables.schema import decode_table

BODY = b'{"model":"llama","messages":[{"role":"user","content":"Hello there, how are you?"}]}'


def _table(tenants: int) -> bytes:
    return msgspec.json.encode(
        {
            "schema_version": 1,
            "version": 1,
            "region": "eu-west",
            "generated_at": "2026-11-29T09:00:00Z",
            "tenants": [
                {
                    "tenant": f"t{i}",
                    "key_hashes": [hashlib.sha256(f"fi_key{i}".encode()).hexdigest()],
                    "key_valid_until": {
                        hashlib.sha256(f"fi_key{i}".encode()).hexdigest(): "2099-01-01T00:00:00Z"
                    },
                    "allowed_regions": ["eu-west"],
                    "requests_per_s": 1e9,
                    "tokens_per_s": 1e12,
                }
                for i in range(tenants)
            ],
        }
    )


def _cpu_us(fn: object, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        fn(n)  # type: ignore[operator]
        best = min(best, (time.process_time() - t0) / n * 1e6)
    return best


def main(argv: list[str]) -> None:
    """Time admission and ``parse_request`` in one process: the ratio is what the hot path pays."""
    p = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__)
    p.add_argument("--tenants", type=int, default=5000)
    p.add_argument("--n", type=int, default=200_000)
    opts = p.parse_args(argv)
    adm = Admission("eu-west")
    adm.load(decode_table(_table(opts.tenants)), time.monotonic())
    header = f"Bearer fi_key{opts.tenants // 2}".encode()

    def admit(n: int) -> None:
        for _ in range(n):
            tenant = adm.authenticate(header, time.time())
            adm.check(tenant, "llama", 12, time.monotonic())

    def parse(n: int) -> None:
        for _ in range(n):
            parse_request(BODY, endpoint=CHAT, bytes_per_token=4.0)

    a = _cpu_us(admit, opts.n)
    b = _cpu_us(parse, opts.n)
    print("| tenants | admission CPU µs/req | parse_request CPU µs/req | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    print(f"| {opts.tenants} | {a:.2f} | {b:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
