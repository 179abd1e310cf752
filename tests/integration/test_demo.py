"""``fedinfer demo`` runs the federation for real: control plane, worker, engines, one edge per
region fed by the control plane, and a traffic generator — all processes on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from regions.supervisor import Process, StartupError, Supervisor, free_port, wait_until
from workers.provisioners.local import LocalProvisioner

ROOT = Path(__file__).resolve().parents[2]
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"

Summary = tuple[dict[str, int], dict[str, dict[str, int]]]
# How long a request to the embedded control plane (SQLite, one web process) may take: not a
# latency target. It answers in ~0.1 s on a quiet machine and up to 2.2 s with three busy
# loops on the two cores; a CI run that shared the machine with a second suite (real vLLM on
# the CPU) timed out at 5 s.
CONTROL_PLANE_S = 30.0


def _route(headers: Any) -> dict[str, str]:
    raw = headers.get("x-fedinfer-route", "")
    return dict(part.split("=", 1) for part in raw.split(";") if "=" in part)


def _summaries(log: Path) -> list[Summary]:
    """The traffic generator's summary lines: ``traffic 6 req (3 streamed) in 1.0s | 200=5
    503=1 | globex-eu eu-west=1,eu-west:503=1 | initech eu-west>us-east=1,us-east=1``."""
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        if not line.startswith("traffic ") or " | " not in line:
            continue
        _head, statuses, *tenants = line.split(" | ")
        counts = {s: int(n) for s, n in (item.split("=") for item in statuses.split())}
        served = {}
        for entry in tenants:
            tenant, paths = entry.split(" ", 1)
            served[tenant] = {p: int(n) for p, n in (i.split("=") for i in paths.split(","))}
        out.append((counts, served))
    return out


def _admin_auth(api: str) -> dict[str, str]:
    """The headers of the demo's admin for the control plane's API at ``api``."""
    token = httpx.post(
        f"{api}/auth/token/",
        json={"username": "admin", "password": "fedinfer-demo"},
        timeout=CONTROL_PLANE_S,
    ).json()["token"]
    return {"Authorization": f"Token {token}"}


def _demo_env(var_dir: Path) -> dict[str, str]:
    """The demo's embedded defaults (SQLite under var/, filesystem broker), not the test's."""
    env = {**os.environ, "FEDINFER_VAR_DIR": str(var_dir), "FEDINFER_MODE": "embedded"}
    for name in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"):
        env.pop(name, None)
    env["DJANGO_SETTINGS_MODULE"] = "federation.settings"
    return env


@pytest.fixture
def start_demo(tmp_path: Path) -> Iterator[Callable[..., tuple[Process, Any]]]:
    # Its log is demo.log; a stop gets 30 s before SIGKILL.
    procs = Supervisor(tmp_path, cwd=ROOT, grace_s=30.0)

    def start(*extra: str) -> tuple[Process, Any]:
        # Free ports from the OS: fixed ones may be taken on a busy test machine.
        argv = ["demo", "--port", str(free_port()), "--edge-base-port", "0"]
        proc = procs.start(
            "demo",
            [sys.executable, "-m", "federation.cli", *argv, "--exit-after", "300", *extra],
            env=_demo_env(tmp_path),
        )
        endpoints = tmp_path / "demo" / "endpoints.json"
        # ~25 s on a quiet 2-core machine; over 90 s seen while other test runs shared it.
        wait_until(endpoints.exists, what="the demo's endpoints.json", timeout=180, watch=proc)
        return proc, json.loads(endpoints.read_text())

    yield start
    for proc in list(procs.processes):
        killed = procs.stop(proc) == -signal.SIGKILL
        assert not killed, "the demo did not stop within 30 s of SIGTERM"


@pytest.mark.slow
def test_demo_federates_three_regions_with_traffic_and_an_evacuation(
    start_demo: Callable[..., tuple[Process, Any]], tmp_path: Path
) -> None:
    # A flat rate (no daily pattern): the evacuation's effect is read from the summaries.
    proc, endpoints = start_demo(
        "--traffic-rps", "6", "--traffic-summary-every", "6", "--day-minutes", "0"
    )
    demo_dir = tmp_path / "demo"
    assert set(endpoints["edges"]) == {"us-east", "eu-west", "ap-southeast"}
    assert len(endpoints["instances"]) == 10
    assert set(endpoints["api_keys"]) == {"acme-us", "globex-eu", "umbrella-sg", "initech"}
    assert endpoints["tenants"]["globex-eu"] == {"regions": ["eu-west"]}
    assert stat.S_IMODE((demo_dir / "endpoints.json").stat().st_mode) == 0o600
    for code in endpoints["edges"]:
        credential = demo_dir / "credentials" / f"demo-{code}"
        assert stat.S_IMODE(credential.stat().st_mode) == 0o600
        assert credential.read_text().startswith("fe_")

    # One request per region through the openai SDK, served where it arrived.
    key = endpoints["api_keys"]["initech"]  # the tenant allowed everywhere
    for region, edge_url in endpoints["edges"].items():
        client = openai.OpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=LLAMA,
            messages=[{"role": "user", "content": f"Hello from the {region} test"}],
            max_tokens=8,
        )
        assert raw.parse().choices[0].message.content
        route = _route(raw.headers)
        # The worker's local provisioner names its engines <region>-<pool>-…
        assert route["region"] == region and route["instance"].startswith(f"{region}-")

    # The web console is served, and the summary says where and how to log in.
    login = httpx.get(f"{endpoints['control_plane']}/console/login/", timeout=CONTROL_PLANE_S)
    assert login.status_code == 200 and "Log in" in login.text
    printed = f"{endpoints['control_plane']}/console/  (log in as operator"
    wait_until(lambda: printed in proc.output(), what="the console in the summary", timeout=10)

    # The edges run on the control plane's signed tables and report back by heartbeat.
    api = f"{endpoints['control_plane']}/api/v1"
    assert httpx.get(f"{api}/regions/", timeout=CONTROL_PLANE_S).status_code in (401, 403)
    auth = _admin_auth(api)

    def tables() -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = httpx.get(
            f"{api}/routing-tables/", headers=auth, timeout=CONTROL_PLANE_S
        ).json()["results"]
        return rows

    # The demo's traffic spends budgets, and their leases are recompiled every few seconds:
    # a newer table may be out before the last one's heartbeat (CI, 2026-12-03: versions 56-60
    # in 12 s). Each edge must report a table at least as new as the latest when this starts.
    wait_until(
        lambda: all(row["latest_version"] is not None for row in tables()),
        timeout=15,
        what="a table for every region",
    )
    floor = {row["region"]: row["latest_version"] for row in tables()}
    assert len(floor) == 3

    def on_a_recent_version() -> bool:
        for row in tables():
            (edge,) = row["edges"]
            ops = endpoints["operators"][row["region"]]
            health = httpx.get(f"{ops}/healthz", timeout=5).json()
            assert health["table_source"] == "control-plane"
            assert edge["name"] == f"demo-{row['region']}"
            applied = edge["applied_table_version"]
            if applied is None or not floor[row["region"]] <= applied <= row["latest_version"]:
                return False
            if not applied <= health["table_version"] <= row["latest_version"]:
                return False
        return True

    wait_until(on_a_recent_version, timeout=15, what="every edge's heartbeat on a recent table")

    # The traffic generator's requests succeed, each tenant served where it may be.
    traffic_log = demo_dir / "logs" / "traffic.log"
    wait_until(lambda: len(_summaries(traffic_log)) >= 2, timeout=20, what="two traffic summaries")
    before = _summaries(traffic_log)
    for statuses, served in before:
        assert set(statuses) == {"200"}, statuses
        assert set(served.get("globex-eu", {})) <= {"eu-west"}, served
        assert set(served.get("acme-us", {})) <= {"us-east"}, served
    assert sum(sum(s.get("globex-eu", {}).values()) for _, s in before) > 0

    # Every edge meters what it serves and the control plane (no Redis here) accepts it.
    def metric(ops: str, name: str) -> float:
        text = httpx.get(f"{ops}/metrics", timeout=5).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    for ops in endpoints["operators"].values():
        wait_until(
            lambda ops=ops: metric(ops, "fedinfer_edge_usage_shipped_total") > 0,
            timeout=15,
            what="usage records accepted by the control plane",
        )
        assert metric(ops, "fedinfer_edge_usage_ship_failures_total") == 0

    # Evacuating eu-west through the API: the worker recompiles, the edge long-polls the new
    # table, the unrestricted tenant's eu-west traffic is served elsewhere within seconds.
    r = httpx.post(f"{api}/regions/eu-west/evacuate/", headers=auth, timeout=CONTROL_PLANE_S)
    assert r.status_code == 200, r.text
    eu = openai.OpenAI(base_url=f"{endpoints['edges']['eu-west']}/v1", api_key=key, max_retries=0)

    def moved() -> bool:
        raw = eu.chat.completions.with_raw_response.create(
            model=LLAMA, messages=[{"role": "user", "content": "still here?"}], max_tokens=4
        )
        route = _route(raw.headers)
        return route["region"] != "eu-west" and route.get("remote_from") == "eu-west"

    shift_s = wait_until(moved, timeout=15, what="eu-west traffic to move")
    print(f"evacuation -> traffic moved in {shift_s:.2f}s")
    assert shift_s < 10, shift_s
    seen = len(_summaries(traffic_log))

    def generator_moved() -> bool:
        return any(
            any(p.startswith("eu-west>") for p in served.get("initech", {}))
            for _, served in _summaries(traffic_log)[seen:]
        )

    wait_until(generator_moved, timeout=20, what="the traffic generator's eu-west traffic to move")

    # The EU-only tenant has nowhere else to go: refused in eu-west, never served elsewhere. (The
    # first summary after the call may also hold its requests served before the evacuation.)
    def refused_in_eu() -> bool:
        after = _summaries(traffic_log)[seen:]
        return any(p.startswith("eu-west:") for _, s in after for p in s.get("globex-eu", {}))

    wait_until(refused_in_eu, timeout=20, what="the EU-only tenant refused in eu-west")
    for _, served in _summaries(traffic_log)[seen:]:
        assert {p.split(":")[0] for p in served.get("globex-eu", {})} <= {"eu-west"}, served
    eu_only = openai.OpenAI(
        base_url=f"{endpoints['edges']['eu-west']}/v1",
        api_key=endpoints["api_keys"]["globex-eu"],
        max_retries=0,
    )
    with pytest.raises(openai.APIStatusError) as refused:
        eu_only.chat.completions.create(
            model=LLAMA, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert refused.value.status_code in (403, 503)
    assert _route(refused.value.response.headers)["region"] == "eu-west"

    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    for _name, url in endpoints["instances"]:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=1)


def _children(pid: int) -> dict[int, str]:
    """Direct children of ``pid``: their command lines."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid:
            out[int(entry.name)] = cmdline
    return out


#: A fleet line's autoscaled deployment: ``us-east/h100-nvlink/Llama-3.1-8B-Instruct want 2:
#: ready 1, loading 1``.
FLEET_ENTRY = re.compile(r"^(\S+) want (\d+): (.*)$")


def _fleet_lines(output: str) -> list[dict[str, tuple[int, dict[str, int]]]]:
    """The demo's fleet lines: autoscaled deployment -> (desired, live instances by state)."""
    out = []
    for line in output.splitlines():
        if not line.startswith("fleet | "):
            continue
        entries = {}
        for part in line.split(" | ")[1:]:
            match = FLEET_ENTRY.match(part)
            if match and "fixed deployments" not in part:
                states = {}
                for item in match[3].split(", "):
                    if item != "none":
                        state, count = item.rsplit(" ", 1)
                        states[state] = int(count)
                entries[match[1]] = (int(match[2]), states)
        out.append(entries)
    return out


@pytest.mark.slow
def test_demo_fleet_follows_the_day_and_heals_without_a_command(
    start_demo: Callable[..., tuple[Process, Any]], tmp_path: Path
) -> None:
    # An earlier run left eu-west evacuated and a pool cordoned: this run starts in service.
    earlier = (
        "import django; django.setup()\n"
        "from django.core.management import call_command\n"
        "from federation.inventory import services\n"
        "from federation.inventory.models import GPUPool, Region\n"
        "call_command('migrate', verbosity=0); call_command('loaddemo', verbosity=0)\n"
        "services.region_evacuate(actor=None, region=Region.objects.get(code='eu-west'))\n"
        "services.pool_cordon(actor=None, pool=GPUPool.objects.get(name='l4-spot'))\n"
    )
    subprocess.run(
        [sys.executable, "-c", earlier], cwd=ROOT, env=_demo_env(tmp_path), check=True, timeout=120
    )
    # A day in two minutes from 04:00 UTC: ap-southeast's afternoon comes first (~15 s in),
    # eu-west's and us-east's later; each passes within the run.
    proc, endpoints = start_demo(
        "--day-minutes",
        "2",
        "--day-start-hour",
        "4",
        "--traffic-summary-every",
        "10",
        "--exit-after",
        "600",
    )
    out = (tmp_path / "demo.log").read_text()
    assert "demo: region eu-west was evacuated; restored" in out
    assert "demo: pool us-east/l4-spot was cordoned; uncordoned" in out
    assert len(endpoints["instances"]) == 10
    engines = LocalProvisioner(tmp_path / "demo" / "engines")
    assert set(engines.running()) == {name for name, _url in endpoints["instances"]}
    api = f"{endpoints['control_plane']}/api/v1"
    auth = _admin_auth(api)

    # An engine dies: the worker fails its instance and starts a replacement; no command.
    rows = httpx.get(f"{api}/deployments/", headers=auth, timeout=CONTROL_PLANE_S).json()
    fixed = [d for d in rows["results"] if not d["autoscale"]]
    deployment = fixed[0]["id"]

    def instances() -> dict[str, str]:
        rows = httpx.get(
            f"{api}/instances/",
            params={"deployment": deployment},
            headers=auth,
            timeout=CONTROL_PLANE_S,
        ).json()["results"]
        return {r["name"]: r["state"] for r in rows}

    (victim,) = instances()
    os.killpg(int(engines.running()[victim].detail["pid"]), signal.SIGKILL)

    # An edge dies: the demo starts it again; it serves from its last good table and re-syncs.
    children = _children(proc.pid)
    (edge_pid,) = [p for p, cmd in children.items() if " edge --region eu-west " in cmd]
    os.killpg(edge_pid, signal.SIGKILL)

    def replaced() -> bool:
        states = instances()
        return states[victim] == "failed" and any(
            state == "ready" for name, state in states.items() if name != victim
        )

    replaced_s = wait_until(replaced, timeout=60, what="a ready replacement of the killed engine")
    print(f"engine killed -> replacement ready in {replaced_s:.1f}s")
    wait_until(
        lambda: "demo: edge-eu-west exited (code -9); started again" in proc.output(),
        timeout=10,
        what="the demo to restart the edge",
    )
    eu = openai.OpenAI(
        base_url=f"{endpoints['edges']['eu-west']}/v1",
        api_key=endpoints["api_keys"]["globex-eu"],
        max_retries=0,
    )

    refusals: list[str] = []

    def edge_serves() -> bool:
        try:
            raw = eu.chat.completions.with_raw_response.create(
                model=LLAMA, messages=[{"role": "user", "content": "back?"}], max_tokens=4
            )
        except openai.APIConnectionError:
            return False  # not listening yet
        except openai.APIStatusError as exc:
            # Answering, but refusing: a 429 of the tenant's rate limit, which the traffic
            # generator shares, clears within a second; anything else would not.
            refusals.append(f"{exc.status_code} {exc.body}")
            return False
        return _route(raw.headers)["region"] == "eu-west"

    try:
        edge_s = wait_until(edge_serves, timeout=30, what="the restarted edge serving")
    except StartupError as exc:
        raise AssertionError(f"{exc}; its last refusals: {refusals[-3:]}") from exc
    print(f"edge killed -> serving again in {edge_s:.1f}s")

    # The day's peaks: an autoscaled deployment goes up, then back to one replica once its
    # region's afternoon has passed (drained, its engine stopped).
    def scaled(up: bool) -> str | None:
        lines = _fleet_lines(proc.output())
        peaks = {
            dep
            for entries in lines
            for dep, (want, states) in entries.items()
            if want >= 2 and states.get("ready", 0) >= 2
        }
        if up or not peaks:
            return min(peaks) if peaks else None
        last = lines[-1]
        for dep in sorted(peaks):
            want, states = last.get(dep, (0, {}))
            if want == 1 and states == {"ready": 1}:
                return dep
        return None

    up_s = wait_until(lambda: scaled(up=True), timeout=120, what="a deployment scaled up")
    down_s = wait_until(lambda: scaled(up=False), timeout=180, what="a deployment scaled down")
    print(f"scaled up after {up_s:.0f}s, back down {down_s:.0f}s later: {scaled(up=False)}")

    # A process that keeps dying is not restarted for ever: the demo stops, naming it, and
    # takes the worker's engines down with it. (The kill above may be out of the window by now.)
    def eu_edge() -> int | None:
        found = [p for p, cmd in _children(proc.pid).items() if " edge --region eu-west " in cmd]
        return found[0] if found else None

    for _ in range(3):
        wait_until(
            lambda: proc.poll() is not None or eu_edge() is not None,
            timeout=15,
            what="the eu-west edge started again",
        )
        pid = eu_edge()
        if proc.poll() is not None or pid is None:
            break
        os.killpg(pid, signal.SIGKILL)
        time.sleep(1.0)
    assert proc.wait(timeout=60) != 0
    out = (tmp_path / "demo.log").read_text()
    assert "demo process(es) exited: edge-eu-west (code -9), 3 times in 60 s" in out, out[-2000:]
    assert engines.running() == {}
    for url in endpoints["operators"].values():
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/healthz", timeout=1)
