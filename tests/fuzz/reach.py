"""Did the fuzzer reach every operation? ``python -m tests.fuzz.reach SCHEMA_URL HAR_FILE``.

Reads the run's HAR (every request schemathesis recorded) and the schema, and counts for each
operation the answers it got. An operation is *reached* when at least one answer is neither
401 nor 404 nor 405: the request got past authentication and found its object, so the
operation's own logic ran (a 2xx, a 400 that names a field, a 409 that names a rule...). Prints
the counts; exits 1 when an operation was never reached, so a fuzzer left without ids or
credentials fails the run instead of passing on 404s.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import requests

METHODS = ("get", "put", "post", "patch", "delete")
#: Answers that say the operation's own logic never ran.
NOT_REACHED = frozenset({401, 404, 405})


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    pattern: re.Pattern[str]
    #: Characters outside ``{parameters}``: the most literal template wins a URL both match.
    literal: int

    @property
    def label(self) -> str:
        return f"{self.method.upper()} {self.path}"


@dataclass(slots=True)
class Reach:
    statuses: dict[str, list[int]] = field(default_factory=dict)

    def reached(self) -> list[str]:
        return [op for op, codes in self.statuses.items() if set(codes) - NOT_REACHED]

    def answered_beyond_404(self) -> list[str]:
        """Operations with a 2xx or 4xx other than 404 (401 included)."""
        return [
            op
            for op, codes in self.statuses.items()
            if any(200 <= c < 300 or (400 <= c < 500 and c != 404) for c in codes)
        ]

    def with_2xx(self) -> list[str]:
        return [op for op, codes in self.statuses.items() if any(200 <= c < 300 for c in codes)]

    def server_errors(self) -> list[str]:
        return [op for op, codes in self.statuses.items() if any(c >= 500 for c in codes)]

    def unreached(self) -> list[str]:
        reached = set(self.reached())
        return [op for op in self.statuses if op not in reached]


def operations(schema: Mapping[str, object]) -> list[Operation]:
    """Every operation of an OpenAPI document, with a pattern matching its concrete paths."""
    found: list[Operation] = []
    paths = schema.get("paths", {})
    assert isinstance(paths, dict)
    for path, item in paths.items():
        pattern = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path)) + "$")
        literal = len(re.sub(r"\{[^}]+\}", "", path))
        found.extend(Operation(m, path, pattern, literal) for m in METHODS if m in item)
    return found


def match(ops: Iterable[Operation], method: str, url: str) -> Operation | None:
    path = urlsplit(url).path
    candidates = [
        op for op in ops if op.method == method.lower() and op.pattern.fullmatch(path) is not None
    ]
    return max(candidates, key=lambda op: op.literal, default=None)


def reach(ops: list[Operation], exchanges: Iterable[tuple[str, str, int]]) -> Reach:
    """Each operation's answers, from (method, URL, status) triples."""
    statuses: dict[str, list[int]] = defaultdict(list)
    for op in ops:
        statuses[op.label] = []
    for method, url, status in exchanges:
        matched = match(ops, method, url)
        if matched is not None:
            statuses[matched.label].append(status)
    return Reach(dict(statuses))


def har_exchanges(har: Mapping[str, object]) -> list[tuple[str, str, int]]:
    log = har.get("log", {})
    assert isinstance(log, dict)
    return [
        (e["request"]["method"], e["request"]["url"], int(e["response"]["status"]))
        for e in log.get("entries", [])
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.fuzz.reach SCHEMA_URL HAR_FILE", file=sys.stderr)
        return 2
    schema_url, har_file = argv
    schema = requests.get(schema_url, params={"format": "json"}, timeout=60).json()
    ops = operations(schema)
    result = reach(ops, har_exchanges(json.loads(Path(har_file).read_text())))
    total = len(ops)
    print(
        f"fuzzer reach: {len(result.reached())}/{total} operations reached (an answer not "
        f"401/404/405), {len(result.answered_beyond_404())}/{total} with a 2xx or a 4xx other "
        f"than 404, {len(result.with_2xx())}/{total} with a 2xx"
    )
    for label in result.server_errors():
        print(f"  5xx: {label}")
    for label in result.unreached():
        print(f"  never reached: {label} {sorted(set(result.statuses[label]))}")
    return 1 if result.unreached() else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
