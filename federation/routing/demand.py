"""Split expected demand across regions: a linear programme solved by HiGHS. Pure, no Django.

For every residency class ``c``, origin region ``o`` and served model ``m`` with expected demand
``d`` (tokens/s) choose the fractions ``x[c,o,m,s]`` sent to each serving region ``s`` that

    minimise    Σ d·x·(cost_per_mtok[s,m] + λ·rtt_ms[o,s])  +  Σ d·u·UNSERVED_PENALTY
    subject to  Σ_s x[c,o,m,s] + u[c,o,m] = 1                       (all demand goes somewhere)
                Σ_{c,o,m: base(m)=b} d·x[c,o,m,s] ≤ capacity[s,b]   (capacity at the target)
                x[c,o,m,s] = 0 unless s ∈ allowed(c)                 (residency, hard)
                x, u ≥ 0

``u`` is an explicit slack: demand that no allowed region can take within capacity. It is
priced far above any real cost so that the solver uses it only when nothing else is feasible,
and it is reported, never hidden. Residency is enforced by construction: a variable for a
region outside the class's allowed set does not exist. The objective, λ and the capacity
target are explained in ``docs/demand-split.md``.

Classes are merged before solving: for one ``(o, m)`` two classes whose allowed regions select
the same candidate targets are the same commodity, so the programme has at most a few
commodities per ``(o, m)`` however many tenants (and classes) there are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_matrix

#: Price of one million tokens nobody can serve, USD: orders of magnitude above any GPU price,
#: so the slack is used only when the hard constraints leave no other choice.
UNSERVED_PENALTY_USD_PER_MTOK = 1_000.0

#: λ: what one millisecond of round trip is worth, USD per million tokens. 75 ms (US-EU) then
#: weighs $0.015/Mtok, about a fifth of an 8B model's GPU cost on an H100: a region has to be
#: clearly cheaper before traffic crosses an ocean for it.
DEFAULT_LATENCY_PENALTY_USD_PER_MTOK_PER_MS = 0.0002

#: Fractions below this are solver noise, not decisions.
_EPS = 1e-9


class DemandSplitError(RuntimeError):
    """The solver failed on a programme that is feasible by construction (a bug, not input)."""


@dataclass(frozen=True, slots=True)
class Offer:
    """A serving region's terms for one model: price and which capacity it draws on."""

    cost_per_mtok: float
    #: Key of the capacity it consumes (the base model: an adapter shares its base's GPUs).
    capacity_key: str


@dataclass(frozen=True, slots=True)
class DemandSplit:
    """The solution. Keys of ``fractions`` and ``unserved`` are ``(class, origin, model)``."""

    #: Share of the demand sent to each serving region (origin included), zeros left out.
    fractions: dict[tuple[str, str, str], dict[str, float]]
    #: Demand no allowed region can take, tokens/s (only non-zero entries).
    unserved: dict[tuple[str, str, str], float]
    #: Expected load the split puts on each ``(region, capacity key)``, tokens/s.
    load: dict[tuple[str, str], float]
    #: Objective value, USD per second (cost + latency penalty + unserved penalty).
    objective: float
    variables: int


def split_demand(
    *,
    demand: Mapping[tuple[str, str, str], float],
    allowed: Mapping[str, frozenset[str]],
    offers: Mapping[str, Mapping[str, Offer]],
    capacity: Mapping[tuple[str, str], float],
    rtt_ms: Mapping[tuple[str, str], float],
    latency_penalty: float = DEFAULT_LATENCY_PENALTY_USD_PER_MTOK_PER_MS,
) -> DemandSplit:
    """Solve the split.

    ``demand``: ``(class, origin, model) -> tokens/s``; ``allowed``: class -> region codes it
    may be served in; ``offers``: model -> serving region -> :class:`Offer`; ``capacity``:
    ``(region, capacity key) -> tokens/s`` at the target utilisation; ``rtt_ms``: ``(origin,
    region)`` -> round trip, where a missing pair means *not reachable* (the origin itself is
    always reachable at 0 ms).
    """
    # 1. Merge classes into commodities: (origin, model, candidate targets) -> demand.
    commodities: dict[tuple[str, str, tuple[str, ...]], float] = {}
    members: list[tuple[tuple[str, str, str], tuple[str, str, tuple[str, ...]]]] = []
    unserved: dict[tuple[str, str, str], float] = {}
    for key in sorted(demand):
        tokens = float(demand[key])
        if tokens < 0:
            raise ValueError(f"negative demand {tokens} for {key}")
        if tokens == 0:
            continue
        cls, origin, model = key
        if cls not in allowed:
            raise KeyError(f"demand for unknown residency class {cls!r}")
        permitted = allowed[cls]
        targets = tuple(
            s
            for s in sorted(offers.get(model, {}))
            if s in permitted and (s == origin or (origin, s) in rtt_ms)
        )
        if not targets:
            unserved[key] = tokens
            continue
        ckey = (origin, model, targets)
        commodities[ckey] = commodities.get(ckey, 0.0) + tokens
        members.append((key, ckey))

    # 2. Columns: one x per (commodity, target), then one slack per commodity.
    order = sorted(commodities)
    index = {c: i for i, c in enumerate(order)}
    cap_rows: dict[tuple[str, str], int] = {}
    x_cost: list[float] = []
    x_row: list[int] = []  # commodity of each x
    x_cap: list[int] = []  # capacity row of each x
    x_meta: list[tuple[int, str]] = []
    for i, (origin, model, targets) in enumerate(order):
        for s in targets:
            offer = offers[model][s]
            rtt = 0.0 if s == origin else rtt_ms[(origin, s)]
            x_cost.append(offer.cost_per_mtok + latency_penalty * rtt)
            x_row.append(i)
            cap_rows.setdefault((s, offer.capacity_key), len(cap_rows))
            x_cap.append(cap_rows[(s, offer.capacity_key)])
            x_meta.append((i, s))
    n_x, n_c = len(x_cost), len(order)
    fractions: dict[tuple[str, str, str], dict[str, float]] = {}
    load: dict[tuple[str, str], float] = {}
    if n_c == 0:
        return DemandSplit(fractions, unserved, load, _unserved_cost(unserved), 0)

    d = np.array([commodities[c] for c in order])
    xr = np.array(x_row, dtype=np.int64)
    # Scale every column by its commodity's demand: the objective is in USD/Mtok·tokens/s.
    c_vec = np.concatenate([np.array(x_cost) * d[xr], d * UNSERVED_PENALTY_USD_PER_MTOK])
    a_eq = csr_matrix(
        (np.ones(n_x + n_c), (np.concatenate([xr, np.arange(n_c)]), np.arange(n_x + n_c))),
        shape=(n_c, n_x + n_c),
    )
    caps = sorted(cap_rows, key=cap_rows.__getitem__)
    a_ub = csr_matrix(
        (d[xr], (np.array(x_cap, dtype=np.int64), np.arange(n_x))),
        shape=(len(caps), n_x + n_c),
    )
    b_ub = np.array([max(0.0, float(capacity.get(k, 0.0))) for k in caps])
    result = linprog(
        c_vec,
        A_ub=a_ub,
        b_ub=b_ub,
        A_eq=a_eq,
        b_eq=np.ones(n_c),
        bounds=(0.0, 1.0),
        method="highs",
    )
    if result.status != 0:
        raise DemandSplitError(f"HiGHS did not solve the demand split: {result.message}")
    sol = result.x

    # 3. Expand commodities back to the classes that make them up.
    per_commodity: list[dict[str, float]] = [{} for _ in order]
    for j, (i, s) in enumerate(x_meta):
        if sol[j] > _EPS:
            per_commodity[i][s] = float(sol[j])
            cap_key = caps[x_cap[j]]
            load[cap_key] = load.get(cap_key, 0.0) + float(sol[j] * d[i])
    for key, ckey in members:
        i = index[ckey]
        fractions[key] = dict(per_commodity[i])
        slack = float(sol[n_x + i])
        if slack > _EPS:
            unserved[key] = slack * float(demand[key])
    return DemandSplit(
        fractions=fractions,
        unserved=unserved,
        load=load,
        objective=float(result.fun) + _unserved_cost(unserved, only_unmodelled=members),
        variables=n_x + n_c,
    )


def _unserved_cost(
    unserved: Mapping[tuple[str, str, str], float],
    only_unmodelled: list[tuple[tuple[str, str, str], tuple[str, str, tuple[str, ...]]]]
    | None = None,
) -> float:
    """Penalty of demand that never entered the programme (no allowed region serves it)."""
    modelled = {k for k, _ in only_unmodelled or ()}
    return sum(v for k, v in unserved.items() if k not in modelled) * UNSERVED_PENALTY_USD_PER_MTOK
