"""The difference between two versions of a region's routing table, section by section:
entries added, removed and changed (with the fields that changed). Pure, over the documents
as stored (``RoutingTableVersion.document``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: List sections of the document and the field that identifies an entry in each.
SECTIONS = {
    "instances": "id",
    "routes": "model",
    "remote_regions": "code",
    "residency_classes": "id",
    "tenants": "tenant",
}
#: Scalars compared as such (version and generated_at always differ).
SCALARS = ("schema_version", "ramp")


@dataclass(frozen=True, slots=True)
class Change:
    key: str
    fields: tuple[tuple[str, Any, Any], ...]


@dataclass(slots=True)
class SectionDiff:
    name: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


@dataclass(slots=True)
class TableDiff:
    scalars: list[tuple[str, Any, Any]]
    sections: list[SectionDiff]

    def __bool__(self) -> bool:
        return bool(self.scalars) or any(self.sections)


def _entries(document: Mapping[str, Any], section: str, key: str) -> dict[str, dict[str, Any]]:
    return {str(e[key]): e for e in document.get(section) or () if isinstance(e, dict)}


def _field_changes(
    old: Mapping[str, Any], new: Mapping[str, Any]
) -> tuple[tuple[str, Any, Any], ...]:
    return tuple(
        (name, old.get(name), new.get(name))
        for name in sorted(set(old) | set(new))
        if old.get(name) != new.get(name)
    )


def table_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> TableDiff:
    sections = []
    for name, key in SECTIONS.items():
        a, b = _entries(old, name, key), _entries(new, name, key)
        diff = SectionDiff(name, sorted(set(b) - set(a)), sorted(set(a) - set(b)))
        for k in sorted(set(a) & set(b)):
            changes = _field_changes(a[k], b[k])
            if changes:
                diff.changed.append(Change(k, changes))
        sections.append(diff)
    scalars = [(n, old.get(n), new.get(n)) for n in SCALARS if old.get(n) != new.get(n)]
    return TableDiff(scalars, sections)
