"""The demo's fleet line: autoscaled deployments one by one, the fixed ones summed up."""

from __future__ import annotations

from collections import Counter

from federation.demo.fleet_view import DeploymentRow, fleet_line


def test_autoscaled_deployments_are_listed_with_their_states_in_lifecycle_order() -> None:
    rows = [
        DeploymentRow("ap/h100/8B", True, 2, Counter({"ready": 1, "loading": 1})),
        DeploymentRow("eu/a100/8B", True, 1, Counter({"ready": 1, "draining": 1})),
        DeploymentRow("eu/a100/32B", False, 1, Counter({"ready": 1})),
        DeploymentRow("us/h100/70B/decode", False, 1, Counter({"warming": 1})),
    ]
    assert fleet_line(rows) == (
        "fleet | ap/h100/8B want 2: loading 1, ready 1 | eu/a100/8B want 1: ready 1, "
        "draining 1 | 2 fixed deployments want 2: warming 1, ready 1"
    )


def test_a_deployment_without_live_instances_says_none() -> None:
    assert fleet_line([DeploymentRow("ap/h100/8B", True, 0, Counter())]) == (
        "fleet | ap/h100/8B want 0: none"
    )
