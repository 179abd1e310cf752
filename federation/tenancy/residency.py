"""Data residency: which regions may serve a tenant's requests. Pure, no Django.

A policy names allowed jurisdictions and, optionally, allowed regions:

* no jurisdictions: any jurisdiction;
* no regions: every region of the allowed jurisdictions;
* both: only the listed regions, each of which must lie in an allowed jurisdiction.

The control plane validates policies here; the routing-table compiler and the edge use
``region_allowed`` / ``allowed_regions`` to decide where a request may go.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ResidencyPolicy:
    jurisdictions: frozenset[str] = frozenset()
    regions: frozenset[str] = frozenset()

    @classmethod
    def of(cls, jurisdictions: Iterable[str] = (), regions: Iterable[str] = ()) -> ResidencyPolicy:
        return cls(frozenset(jurisdictions), frozenset(regions))


@dataclass(frozen=True, slots=True)
class RegionRef:
    """The two facts about a region that residency needs."""

    code: str
    jurisdiction: str


def region_allowed(policy: ResidencyPolicy, region_code: str, jurisdiction: str) -> bool:
    """May a region with this code and jurisdiction serve the tenant?"""
    if policy.jurisdictions and jurisdiction not in policy.jurisdictions:
        return False
    return not policy.regions or region_code in policy.regions


def allowed_regions(policy: ResidencyPolicy, regions: Iterable[RegionRef]) -> list[RegionRef]:
    """The regions the policy allows, in the order given."""
    return [r for r in regions if region_allowed(policy, r.code, r.jurisdiction)]


def _listing(codes: Iterable[str]) -> str:
    return "[" + ", ".join(sorted(codes)) + "]"


def policy_errors(
    policy: ResidencyPolicy,
    *,
    known_jurisdictions: Collection[str],
    region_jurisdictions: Mapping[str, str],
) -> dict[str, list[str]]:
    """Why a policy is impossible, by field (``allowed_jurisdictions``, ``allowed_regions``).

    ``region_jurisdictions`` maps every region code the policy names to its jurisdiction.
    An empty result means the policy is valid.
    """
    errors: dict[str, list[str]] = {}
    unknown = sorted(policy.jurisdictions - set(known_jurisdictions))
    if unknown:
        errors["allowed_jurisdictions"] = [
            f"unknown jurisdiction {code!r}; known: {_listing(known_jurisdictions)}"
            for code in unknown
        ]
    region_messages: list[str] = []
    for code in sorted(policy.regions):
        jurisdiction = region_jurisdictions.get(code)
        if jurisdiction is None:
            region_messages.append(f"unknown region {code!r}")
        elif policy.jurisdictions and jurisdiction not in policy.jurisdictions:
            region_messages.append(
                f"region {code} is in {jurisdiction}, outside the allowed jurisdictions "
                f"{_listing(policy.jurisdictions)}"
            )
    if region_messages:
        errors["allowed_regions"] = region_messages
    return errors
