"""``platform/observability/``: the alerting rules pass ``promtool check rules`` and their unit
tests (``promtool test rules``); the dashboards are Grafana JSON whose queries parse as PromQL;
every ``fedinfer_*`` name in either is one the code exports. promtool is the Debian package
``prometheus`` (``.ci/run`` installs it): missing, these tests fail rather than skip."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "platform" / "observability"
PROMTOOL = Path("/usr/bin/promtool")
RULES = sorted((OBSERVABILITY / "rules").glob("*.yaml"))
RULE_TESTS = sorted((OBSERVABILITY / "tests").glob("*.yaml"))
DASHBOARDS = sorted((OBSERVABILITY / "dashboards").glob("*.json"))
#: Where the code names its metric families (the edge, the control plane, the worker).
SOURCES = ("regions/edge/**/*.py", "federation/**/*.py", "workers/**/*.py")
#: Sample suffixes Prometheus adds to a family's name (counters, histograms).
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")
NAME = re.compile(r"\bfedinfer_[a-z0-9_]+")


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    if not PROMTOOL.exists():
        pytest.fail(f"{PROMTOOL} is missing: apt-get install prometheus (.ci/run does)")
    return subprocess.run(
        [str(PROMTOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def defined_names() -> set[str]:
    """Every quoted ``fedinfer_*`` string in the code that exports metrics."""
    quoted = re.compile(r"[\"'](fedinfer_[a-z0-9_]+)[\"']")
    names: set[str] = set()
    for pattern in SOURCES:
        for path in ROOT.glob(pattern):
            names.update(quoted.findall(path.read_text()))
    return names


def undefined(used: set[str], defined: set[str]) -> set[str]:
    """Names in ``used`` that are no family in ``defined``, with or without a sample suffix."""
    missing = set()
    for name in used:
        base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), name)
        if name not in defined and base not in defined:
            missing.add(name)
    return missing


def dashboard_queries() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        out[path.name] = [t["expr"] for p in board["panels"] for t in p["targets"]]
    return out


def test_there_are_rules_tests_and_three_dashboards() -> None:
    assert RULES and RULE_TESTS
    assert [p.name for p in DASHBOARDS] == [
        "edge.json",
        "fleet-overview.json",
        "tenants-usage.json",
    ]


def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", *map(str, RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    result = promtool("test", "rules", *map(str, RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "FAILED" not in result.stdout


def test_promtool_fails_a_rule_test_whose_expectation_is_wrong(tmp_path: Path) -> None:
    """The unit tests can fail: an alert expected where the rule says none fires."""
    wrong = tmp_path / "wrong_test.yaml"
    wrong.write_text(
        f"rule_files: [{RULES[0]}]\n"
        "tests:\n"
        "  - interval: 1m\n"
        "    input_series:\n"
        "      - series: 'fedinfer_cp_tenant_budget_used_ratio{tenant=\"acme\"}'\n"
        "        values: '0.5x5'\n"
        "    alert_rule_test:\n"
        "      - eval_time: 3m\n"
        "        alertname: FedinferTenantBudgetExhausted\n"
        "        exp_alerts: [{exp_labels: {severity: info, tenant: acme}}]\n"
    )
    result = promtool("test", "rules", str(wrong))
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    """Each query becomes a recording rule for ``promtool check rules`` to parse (Grafana's
    ``$region`` variable replaced by a regex that matches everything)."""
    rules = [
        {"record": f"dashboard:{i}", "expr": expr.replace("$region", ".*")}
        for i, expr in enumerate(q for qs in dashboard_queries().values() for q in qs)
    ]
    assert len(rules) > 25
    path = tmp_path / "dashboards.rules.json"  # JSON is YAML
    path.write_text(json.dumps({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboards_are_grafana_json_on_a_prometheus_datasource_variable() -> None:
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"].startswith("fedinfer-") and board["schemaVersion"] >= 36
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])


def test_every_metric_name_in_rules_and_dashboards_is_exported_by_the_code() -> None:
    defined = defined_names()
    # The extractor itself: families of the three processes are found, a made-up name is not.
    assert {"fedinfer_edge_ttft_seconds", "fedinfer_cp_instances", "fedinfer_worker_tasks"} <= (
        defined
    )
    assert undefined({"fedinfer_cp_instances", "fedinfer_edge_requests_total"}, defined) == set()
    assert undefined({"fedinfer_cp_made_up_total"}, defined) == {"fedinfer_cp_made_up_total"}

    used: dict[str, set[str]] = {}
    for path in RULES + RULE_TESTS:
        used[path.name] = set(NAME.findall(path.read_text()))
    for name, queries in dashboard_queries().items():
        used[name] = {n for q in queries for n in NAME.findall(q)}
    assert all(used.values())
    missing = {source: undefined(names, defined) for source, names in used.items()}
    assert not any(missing.values()), missing


def test_the_demo_scrape_configuration_passes_promtool(tmp_path: Path) -> None:
    """What ``fedinfer demo --prometheus`` writes (and platform/observability/README.md
    shows): every process's job, the token file, the edge relabelling, the rules."""
    from federation.demo import prometheus

    token = tmp_path / "token"
    token.write_text("t")
    targets = prometheus.ScrapeTargets(
        control_plane="http://127.0.0.1:8000",
        token_file=token,
        worker="127.0.0.1:9101",
        edges={"eu-west": "http://127.0.0.1:9201", "us-east": "http://127.0.0.1:9202"},
        engines=[("eu-west", "http://127.0.0.1:8301"), ("us-east", "http://127.0.0.1:8302")],
    )
    config = prometheus.scrape_config(targets, rule_files=prometheus.rule_files(ROOT))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert list(jobs) == [
        "fedinfer-control-plane",
        "fedinfer-worker",
        "fedinfer-edge",
        "fedinfer-engine",
    ]
    assert jobs["fedinfer-control-plane"]["authorization"]["credentials_file"] == str(token)
    edges = jobs["fedinfer-edge"]["static_configs"]
    assert [e["labels"]["region"] for e in edges] == ["eu-west", "us-east"]
    path = prometheus.write_config(tmp_path / "prometheus.yml", config)
    result = promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = sum(path.read_text().count("- alert: ") for path in RULES)
    assert alerts == 15 and f"SUCCESS: {alerts} rules found" in result.stdout
