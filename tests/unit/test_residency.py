"""Residency policy: which regions may serve a tenant, and which policies are impossible."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from federation.tenancy.residency import (
    RegionRef,
    ResidencyPolicy,
    allowed_regions,
    policy_errors,
    region_allowed,
)

KNOWN = ["US", "EU", "UK", "APAC"]
FLEET = [
    RegionRef("us-east", "US"),
    RegionRef("us-west", "US"),
    RegionRef("eu-west", "EU"),
    RegionRef("eu-central", "EU"),
    RegionRef("ap-southeast", "APAC"),
]
BY_CODE = {r.code: r.jurisdiction for r in FLEET}


def codes(regions: list[RegionRef]) -> list[str]:
    return [r.code for r in regions]


def test_empty_policy_allows_every_region() -> None:
    assert codes(allowed_regions(ResidencyPolicy(), FLEET)) == codes(FLEET)


def test_jurisdictions_only_allow_every_region_inside_them() -> None:
    policy = ResidencyPolicy.of(["EU"])
    assert codes(allowed_regions(policy, FLEET)) == ["eu-west", "eu-central"]
    assert region_allowed(policy, "eu-west", "EU")
    assert not region_allowed(policy, "us-east", "US")


def test_explicit_regions_narrow_the_jurisdictions() -> None:
    policy = ResidencyPolicy.of(["EU"], ["eu-central"])
    assert codes(allowed_regions(policy, FLEET)) == ["eu-central"]


def test_regions_without_jurisdictions_allow_exactly_those_regions() -> None:
    policy = ResidencyPolicy.of([], ["us-west", "ap-southeast"])
    assert codes(allowed_regions(policy, FLEET)) == ["us-west", "ap-southeast"]


def test_valid_policy_has_no_errors() -> None:
    policy = ResidencyPolicy.of(["EU", "UK"], ["eu-west"])
    assert policy_errors(policy, known_jurisdictions=KNOWN, region_jurisdictions=BY_CODE) == {}


def test_region_outside_the_allowed_jurisdictions_is_named() -> None:
    policy = ResidencyPolicy.of(["EU"], ["us-east", "eu-west"])
    errors = policy_errors(policy, known_jurisdictions=KNOWN, region_jurisdictions=BY_CODE)
    assert errors == {
        "allowed_regions": ["region us-east is in US, outside the allowed jurisdictions [EU]"]
    }


def test_unknown_jurisdiction_and_region_are_refused() -> None:
    policy = ResidencyPolicy.of(["EU", "eu", "MARS"], ["nowhere-1"])
    errors = policy_errors(policy, known_jurisdictions=KNOWN, region_jurisdictions=BY_CODE)
    assert [m.split(";")[0] for m in errors["allowed_jurisdictions"]] == [
        "unknown jurisdiction 'MARS'",
        "unknown jurisdiction 'eu'",
    ]
    assert errors["allowed_regions"] == ["unknown region 'nowhere-1'"]


fleets = st.lists(
    st.builds(
        RegionRef,
        code=st.text("abcdefgh-", min_size=1, max_size=6),
        jurisdiction=st.sampled_from(KNOWN),
    ),
    max_size=12,
    unique_by=lambda r: r.code,
)
jurisdiction_sets = st.frozensets(st.sampled_from(KNOWN))


@given(fleet=fleets, jurisdictions=jurisdiction_sets, data=st.data())
def test_allowed_regions_is_the_filter_of_region_allowed(
    fleet: list[RegionRef], jurisdictions: frozenset[str], data: st.DataObject
) -> None:
    picked = data.draw(st.frozensets(st.sampled_from([r.code for r in fleet]))) if fleet else set()
    policy = ResidencyPolicy(jurisdictions, frozenset(picked))
    result = allowed_regions(policy, fleet)
    assert result == [r for r in fleet if region_allowed(policy, r.code, r.jurisdiction)]
    for region in result:
        assert not jurisdictions or region.jurisdiction in jurisdictions
        assert not picked or region.code in picked


@given(
    fleet=fleets,
    jurisdictions=st.frozensets(st.sampled_from(KNOWN), min_size=1),
    extra=st.sampled_from(KNOWN),
)
def test_allowing_one_more_jurisdiction_never_removes_a_region(
    fleet: list[RegionRef], jurisdictions: frozenset[str], extra: str
) -> None:
    # (Only for non-empty sets: the empty set means "any", the widest policy of all.)
    narrow = ResidencyPolicy(jurisdictions)
    wide = ResidencyPolicy(jurisdictions | {extra})
    assert set(codes(allowed_regions(narrow, fleet))) <= set(codes(allowed_regions(wide, fleet)))


@given(fleet=fleets, jurisdictions=jurisdiction_sets, data=st.data())
def test_a_policy_is_valid_exactly_when_its_regions_lie_in_its_jurisdictions(
    fleet: list[RegionRef], jurisdictions: frozenset[str], data: st.DataObject
) -> None:
    picked = data.draw(st.frozensets(st.sampled_from([r.code for r in fleet]))) if fleet else set()
    policy = ResidencyPolicy(jurisdictions, frozenset(picked))
    by_code = {r.code: r.jurisdiction for r in fleet}
    errors = policy_errors(policy, known_jurisdictions=KNOWN, region_jurisdictions=by_code)
    consistent = not jurisdictions or all(by_code[c] in jurisdictions for c in picked)
    assert (errors == {}) == consistent
    if errors == {} and picked:
        # A valid policy with explicit regions is served by exactly those regions.
        assert set(codes(allowed_regions(policy, fleet))) == picked
