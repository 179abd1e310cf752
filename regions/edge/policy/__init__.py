"""The edge's pure rules: plain data in, a decision out, no I/O (admission, budgets, the
scheduler, sessions, speeds, spill-over and the demand split, the route header, the prefix
index, the KV-event wire format, signed hops and peer seals).

This package is also the edge's public face for what lies outside ``regions/``: the console's
"where would this request go" and its previews apply the same rules to a table, imported from
here (an import-linter contract keeps the control plane out of the edge's other modules)."""

from regions.edge.http.errors import EdgeError
from regions.edge.policy.admission import Admission, TenantState
from regions.edge.policy.spill import Remote, first_targets, ramp_point, refusal, spill_plan

__all__ = [
    "Admission",
    "EdgeError",
    "Remote",
    "TenantState",
    "first_targets",
    "ramp_point",
    "refusal",
    "spill_plan",
]
