"""Schemathesis hooks for tests/fuzz/run_schemathesis.sh.

* Credentials: the fuzzing admin's token, and the seeded edge's credential for the operations
  only an edge may call (its usage and heartbeats); both issued again whenever a 401 says they
  are gone (the fuzzer itself may log out through ``DELETE /auth/token/`` or rotate the edge's
  credential).
* Real objects: every path parameter (``{id}``, ``{code}``, ``{slug}``, ``{name}``,
  ``{region}``) is drawn mostly from the objects the run seeded
  (``tests/fuzz/seed.py``), listed through the API when the operation's strategy is built
  (DELETE spares one of each kind); random values alone only ever find 404s.
* Usage bodies: ``application/x-ndjson`` is serialized one JSON document a line, and the usage
  operation gets usage records (schema 3, ``regions/tables/usage.py``) for the seeded fleet
  with hostile numbers mixed in, besides the schema's arbitrary bytes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import requests
import schemathesis
from hypothesis import strategies as st

from regions.tables.usage import UsageRecord, encode_record

#: Operations only an edge may call, for itself: sent with the seeded edge's credential.
EDGE_OPERATIONS = frozenset({"edge_usage", "edge_heartbeat"})
USAGE_OPERATION = "edge_usage"
NDJSON = "application/x-ndjson"
#: ``/api/v1/edges/{name}/usage`` -> (``/api/v1/edges/``, ``name``): the list whose items carry
#: the parameter as a field of the same name.
PATH_PARAMETER = re.compile(r"^(?P<collection>.*?/)\{(?P<name>[^}/]+)\}")
LIST_TIMEOUT_SECONDS = 30


def issue_credentials() -> dict[str, str]:
    """``tests.fuzz.seed credentials`` in a subprocess: management code, not the API."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.seed", "credentials"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"could not issue fuzzing credentials: {result.stderr[-2000:]}")
    credentials: dict[str, str] = json.loads(result.stdout.strip().splitlines()[-1])
    return credentials


def operation_id(operation: Any) -> str:
    return str(operation.definition.raw.get("operationId", ""))


def base_url(operation: Any) -> str:
    return str(operation.base_url or operation.schema.get_base_url())


#: Credentials are fetched once and again only after a 401 (``retry_on``). Without a
#: ``refresh_interval`` schemathesis caches nothing and calls ``get`` (a subprocess of a few
#: seconds) for every case: that alone held the old run to ~250 cases in five minutes.
CREDENTIALS_LIFETIME_SECONDS = 3600


@schemathesis.auth(refresh_interval=CREDENTIALS_LIFETIME_SECONDS, retry_on=[401])
class FreshCredentials:
    def get(self, case: schemathesis.Case, context: schemathesis.AuthContext) -> dict[str, str]:
        credentials = issue_credentials()
        _remember(credentials)
        return credentials

    def set(
        self, case: schemathesis.Case, data: dict[str, str], context: schemathesis.AuthContext
    ) -> None:
        if operation_id(case.operation) in EDGE_OPERATIONS:
            authorization = f"Bearer {data['edge_credential']}"
        else:
            authorization = f"Token {data['token']}"
        case.headers["Authorization"] = authorization


# --- real objects for path parameters -------------------------------------------------------

_lock = threading.Lock()
_credentials: dict[str, str] = {}
_listed: dict[str, list[dict[str, Any]]] = {}


def _remember(credentials: dict[str, str]) -> None:
    with _lock:
        _credentials.update(credentials)


def _current_credentials() -> dict[str, str]:
    with _lock:
        if _credentials:
            return dict(_credentials)
    credentials = issue_credentials()
    _remember(credentials)
    return credentials


def path_parameter_source(path: str) -> tuple[str, str] | None:
    """The list operation's path and the field that hold values for the path's parameter."""
    match = PATH_PARAMETER.match(path)
    if match is None:
        return None
    return match["collection"], match["name"]


def values_of(items: list[dict[str, Any]], field: str) -> list[Any]:
    """The distinct values of ``field`` in the listed objects (a nested object's ``code``,
    ``name`` or ``id`` when the field is one), in order."""
    seen: list[Any] = []
    for item in items:
        value = item.get(field)
        if isinstance(value, dict):
            value = next((value[k] for k in ("code", "name", "id") if k in value), None)
        if isinstance(value, str | int) and not isinstance(value, bool) and value not in seen:
            seen.append(value)
    return seen


def _list(root: str, collection: str) -> list[dict[str, Any]]:
    """Every object of a collection the fuzzing admin sees (all pages), listed once a run
    (again while it is empty: the run may have created some since)."""
    with _lock:
        if _listed.get(collection):
            return _listed[collection]
    items: list[dict[str, Any]] = []
    url: str | None = root.rstrip("/") + collection
    token = _current_credentials()["token"]
    while url:
        response = requests.get(
            url, headers={"Authorization": f"Token {token}"}, timeout=LIST_TIMEOUT_SECONDS
        )
        if response.status_code == 401:
            # The fuzzer logged the admin out: log in again (once a page).
            credentials = issue_credentials()
            _remember(credentials)
            token = credentials["token"]
            response = requests.get(
                url, headers={"Authorization": f"Token {token}"}, timeout=LIST_TIMEOUT_SECONDS
            )
        response.raise_for_status()
        page = response.json()
        if isinstance(page, list):
            items.extend(page)
            break
        items.extend(page.get("results", []))
        url = page.get("next")
    with _lock:
        _listed[collection] = items
    return items


def seeded_path_parameters(operation: Any) -> dict[str, list[Any]]:
    """Real values for the operation's path parameters (empty when it has none or none
    exist)."""
    source = path_parameter_source(operation.path)
    if source is None:
        return {}
    collection, field = source
    if operation_id(operation) in EDGE_OPERATIONS:
        return {field: [_current_credentials()["edge"]]}
    values = values_of(_list(base_url(operation), collection), field)
    if operation.method.upper() == "DELETE" and len(values) > 1:
        # Spare one object of each kind, so the operations fuzzed after this one still find
        # something real.
        values = values[1:]
    return {field: values} if values else {}


@schemathesis.hook
def before_generate_path_parameters(
    context: schemathesis.HookContext, strategy: st.SearchStrategy
) -> st.SearchStrategy:
    if context.operation is None:
        return strategy
    seeded = seeded_path_parameters(context.operation)
    if not seeded:
        return strategy
    real = st.fixed_dictionaries({name: st.sampled_from(vs) for name, vs in seeded.items()})
    # Real values first: Hypothesis favours the first branch (and small integers, so
    # ``integers().flatmap`` would not do), which matters for operations that get few cases.
    return st.one_of(real, strategy)


# --- usage records --------------------------------------------------------------------------

#: Numbers a hostile or broken edge might send: out of range for a time, a column, a float.
HOSTILE_FLOATS = st.sampled_from([1e18, -1e18, 1e308, 2.0**63, -1.0, 0.0])
HOSTILE_INTS = st.sampled_from([2**31, 2**63 - 1, 2**63, -1])


def now_and_then(
    usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    """``odd`` one time in eight, else ``usual``: most records of a batch are plausible, so
    the good ones of a batch with a bad one are there to be billed."""
    # Hypothesis favours small integers: the odd value goes on the largest.
    return st.integers(0, 7).flatmap(lambda n: odd if n == 7 else usual)


@dataclass(frozen=True, slots=True)
class UsageSender:
    """The seeded edge that posts usage, and what its region serves (what a record of it
    may name and be billed)."""

    edge: str
    region: str
    instances: list[str]
    models: list[str]
    tenants: list[str]


def usage_records(sender: UsageSender, now: float) -> st.SearchStrategy[bytes]:
    """Batches of schema-4 usage records as ``sender`` writes them (its region, instances,
    models and tenants; the last day), with now and then a time, a count or a name no column,
    clock or region can hold: the good records of a batch must be billed, the others
    refused alone."""
    names = st.text(min_size=1, max_size=40)
    record = st.builds(
        UsageRecord,
        request_id=st.from_regex(r"[0-9a-f]{12}-[0-9a-f]{1,6}", fullmatch=True),
        started_at=now_and_then(st.floats(now - 86_400, now - 60), HOSTILE_FLOATS),
        region=now_and_then(st.just(sender.region), names),
        entry_region=now_and_then(st.just(sender.region), names),
        instance=now_and_then(st.sampled_from(sender.instances or ["i-0"]), names),
        model=now_and_then(st.sampled_from(sender.models or ["m"]), names),
        tenant=now_and_then(st.sampled_from(sender.tenants or ["t"]), st.one_of(st.none(), names)),
        prompt_tokens=now_and_then(st.integers(100, 100_000), HOSTILE_INTS),
        cached_tokens=st.integers(0, 100),
        completion_tokens=now_and_then(st.integers(0, 100_000), HOSTILE_INTS),
        duration_ms=now_and_then(st.floats(0, 600_000), HOSTILE_FLOATS),
        status=st.sampled_from([200, 400, 429, 500]),
        edge=now_and_then(st.just(sender.edge), st.one_of(st.none(), names)),
    )
    return st.lists(record.map(encode_record), min_size=1, max_size=8).map(b"\n".join)


def usage_sender(root: str) -> UsageSender:
    """The seeded edge and what the seeded fleet serves in its region, listed through the
    API."""
    credentials = _current_credentials()
    region = credentials["region"]

    def in_region(collection: str, field: str) -> list[str]:
        items = [i for i in _list(root, collection) if i.get("region") == region]
        return [str(v) for v in values_of(items, field)]

    return UsageSender(
        edge=credentials["edge"],
        region=region,
        instances=in_region("/api/v1/instances/", "name"),
        models=in_region("/api/v1/deployments/", "model_name"),
        tenants=[
            str(t["slug"])
            for t in _list(root, "/api/v1/tenants/")
            if region in t.get("permitted_regions", [])
        ],
    )


@schemathesis.hook
def before_generate_body(
    context: schemathesis.HookContext, strategy: st.SearchStrategy
) -> st.SearchStrategy:
    operation = context.operation
    if operation is None or operation_id(operation) != USAGE_OPERATION:
        return strategy
    return st.one_of(usage_records(usage_sender(base_url(operation)), time.time()), strategy)


def ndjson_lines(value: Any) -> bytes | None:
    """A generated body as newline-delimited JSON: bytes (and the schema's binary strings) as
    they are, a list one document a line, anything else one document."""
    data = getattr(value, "data", value)
    if data is None:
        return None
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    items = data if isinstance(data, list) else [data]
    return b"\n".join(json.dumps(item).encode() for item in items)


def ndjson_serializer(context: schemathesis.SerializationContext, value: Any) -> bytes | None:
    return ndjson_lines(value)


schemathesis.serializer(NDJSON)(ndjson_serializer)
