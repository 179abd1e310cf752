"""The difference between two versions of a region's routing table, section by section:
entries added, removed and changed (with the fields that changed). Pure.

Two ways in, one answer: :func:`table_diff` over two whole documents, and
:func:`diff_from_changes` over just the entries that differ — what PostgreSQL picks out of the
stored documents (``distribution.routing_table_changes``), so that the console does not decode
two tables of thousands of tenants to show the few that changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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

#: (section, key, old entry or None if added, new entry or None if removed).
EntryChange = tuple[str, str, Mapping[str, Any] | None, Mapping[str, Any] | None]


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


def _entries(document: Mapping[str, Any], section: str, key: str) -> dict[str, Mapping[str, Any]]:
    """Entries by key: objects whose key is a string (the last of duplicate keys wins), as
    ``distribution.routing_table_changes`` reads them."""
    found = document.get(section)
    if not isinstance(found, list):
        return {}
    return {e[key]: e for e in found if isinstance(e, dict) and isinstance(e.get(key), str)}


def _field_changes(
    old: Mapping[str, Any], new: Mapping[str, Any]
) -> tuple[tuple[str, Any, Any], ...]:
    return tuple(
        (name, old.get(name), new.get(name))
        for name in sorted(set(old) | set(new))
        if old.get(name) != new.get(name)
    )


def entry_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[EntryChange]:
    """Every entry of the list sections that is not the same in both documents."""
    changes: list[EntryChange] = []
    for name, key in SECTIONS.items():
        a, b = _entries(old, name, key), _entries(new, name, key)
        changes.extend(
            (name, k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
        )
    return changes


def diff_from_changes(
    scalars: Iterable[tuple[str, Any, Any]], changes: Iterable[EntryChange]
) -> TableDiff:
    """The diff from the scalars of both documents and the entries that differ."""
    by_name = {name: SectionDiff(name) for name in SECTIONS}
    for section, key, old, new in sorted(changes, key=lambda c: (c[0], c[1])):
        diff = by_name[section]
        if old is None:
            diff.added.append(key)
        elif new is None:
            diff.removed.append(key)
        else:
            fields = _field_changes(old, new)
            if fields:
                diff.changed.append(Change(key, fields))
    return TableDiff(
        [(n, a, b) for n, a, b in scalars if a != b], [by_name[name] for name in SECTIONS]
    )


def table_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> TableDiff:
    scalars = [(n, old.get(n), new.get(n)) for n in SCALARS]
    return diff_from_changes(scalars, entry_changes(old, new))
