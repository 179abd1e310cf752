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

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_matrix

from federation.core.metrics import DEMAND_SPLIT_SOLVE

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


Commodity = tuple[str, str, tuple[str, ...]]  # (origin, model, allowed reachable targets)


@dataclass(frozen=True, slots=True)
class DemandSplit:
    """The solution. Keys of ``fractions`` and ``unserved`` are ``(class, origin, model)``;
    the ``origin_*`` fields aggregate the classes of each ``(origin, model)``."""

    #: Share of the demand sent to each serving region (origin included), zeros left out.
    fractions: dict[tuple[str, str, str], dict[str, float]]
    #: Demand no allowed region can take, tokens/s (only non-zero entries).
    unserved: dict[tuple[str, str, str], float]
    #: Expected load the split puts on each ``(region, capacity key)``, tokens/s.
    load: dict[tuple[str, str], float]
    #: Objective value, USD/Mtok x tokens/s (cost + latency penalty + unserved penalty).
    objective: float
    variables: int
    #: ``(origin, model)`` -> serving region -> share of all its demand (classes together).
    origin_fractions: dict[tuple[str, str], dict[str, float]]
    #: ``(origin, model)`` -> tokens/s no allowed region can take (non-zero entries).
    origin_unserved: dict[tuple[str, str], float]


def _candidates(
    origin: str,
    model: str,
    offers: Mapping[str, Mapping[str, Offer]],
    rtt_ms: Mapping[tuple[str, str], float],
) -> frozenset[str]:
    return frozenset(s for s in offers.get(model, {}) if s == origin or (origin, s) in rtt_ms)


def split_demand(
    *,
    demand: Mapping[tuple[str, str, str], float],
    allowed: Mapping[str, frozenset[str]],
    offers: Mapping[str, Mapping[str, Offer]],
    capacity: Mapping[tuple[str, str], float],
    rtt_ms: Mapping[tuple[str, str], float],
    latency_penalty: float = DEFAULT_LATENCY_PENALTY_USD_PER_MTOK_PER_MS,
) -> DemandSplit:
    """Solve the split for demand given per residency class.

    ``demand``: ``(class, origin, model) -> tokens/s``; ``allowed``: class -> region codes it
    may be served in; ``offers``: model -> serving region -> :class:`Offer`; ``capacity``:
    ``(region, capacity key) -> tokens/s`` at the target utilisation; ``rtt_ms``: ``(origin,
    region)`` -> round trip, where a missing pair means *not reachable* (the origin itself is
    always reachable at 0 ms).
    """
    commodities: dict[Commodity, float] = {}
    members: dict[tuple[str, str, str], Commodity] = {}
    dropped: dict[tuple[str, str, str], float] = {}
    cands: dict[tuple[str, str], frozenset[str]] = {}
    for key in sorted(demand):
        tokens = float(demand[key])
        if tokens < 0:
            raise ValueError(f"negative demand {tokens} for {key}")
        if tokens == 0:
            continue
        cls, origin, model = key
        if cls not in allowed:
            raise KeyError(f"demand for unknown residency class {cls!r}")
        cand = cands.get((origin, model))
        if cand is None:
            cand = cands[(origin, model)] = _candidates(origin, model, offers, rtt_ms)
        targets = tuple(sorted(cand & allowed[cls]))
        if not targets:
            dropped[key] = tokens
            continue
        ckey = (origin, model, targets)
        commodities[ckey] = commodities.get(ckey, 0.0) + tokens
        members[key] = ckey
    solved = _solve(commodities, _Market(offers, capacity, rtt_ms, latency_penalty))
    fractions: dict[tuple[str, str, str], dict[str, float]] = {}
    unserved = dict(dropped)
    for key, ckey in members.items():
        fractions[key] = dict(solved.fractions[ckey])
        slack = solved.slack[ckey]
        if slack > _EPS:
            unserved[key] = slack * float(demand[key])
    origin_unserved: dict[tuple[str, str], float] = {}
    for (_, origin, model), tokens in unserved.items():
        origin_unserved[(origin, model)] = origin_unserved.get((origin, model), 0.0) + tokens
    totals: dict[tuple[str, str], float] = {}
    for (_, origin, model), tokens in demand.items():
        if tokens > 0:
            totals[(origin, model)] = totals.get((origin, model), 0.0) + float(tokens)
    return DemandSplit(
        fractions=fractions,
        unserved=unserved,
        load=solved.load,
        objective=solved.objective + sum(dropped.values()) * UNSERVED_PENALTY_USD_PER_MTOK,
        variables=solved.variables,
        origin_fractions=_origin_fractions(commodities, solved, totals),
        origin_unserved=origin_unserved,
    )


def split_shared_demand(
    *,
    demand: Mapping[tuple[str, str], float],
    class_shares: Mapping[str, Mapping[str, float]],
    allowed: Mapping[str, frozenset[str]],
    offers: Mapping[str, Mapping[str, Offer]],
    capacity: Mapping[tuple[str, str], float],
    rtt_ms: Mapping[tuple[str, str], float],
    latency_penalty: float = DEFAULT_LATENCY_PENALTY_USD_PER_MTOK_PER_MS,
) -> DemandSplit:
    """The same programme when each origin's demand ``(origin, model) -> tokens/s`` is
    shared among classes in fixed proportions: ``class_shares[origin][class]`` (summing to 1
    per origin). Builds the commodities without materialising a demand entry per class, so
    thousands of tenants in hundreds of classes stay cheap; per-class ``fractions`` and
    ``unserved`` are left empty and the ``origin_*`` aggregates carry the answer."""
    commodities: dict[Commodity, float] = {}
    origin_unserved: dict[tuple[str, str], float] = {}
    totals: dict[tuple[str, str], float] = {}
    dropped = 0.0
    shares = {o: sorted(by_class.items()) for o, by_class in class_shares.items()}
    # Pairs of one origin with the same candidate targets group the classes the same way:
    # work the grouping out once per (origin, candidate set).
    grouping: dict[tuple[str, frozenset[str]], list[tuple[frozenset[str], float]]] = {}
    for (origin, model), tokens in sorted(demand.items()):
        if tokens < 0:
            raise ValueError(f"negative demand {tokens} for {(origin, model)}")
        if tokens == 0:
            continue
        totals[(origin, model)] = float(tokens)
        cand = _candidates(origin, model, offers, rtt_ms)
        groups = grouping.get((origin, cand))
        if groups is None:
            if origin not in shares:
                raise KeyError(f"no class shares for origin {origin!r}")
            acc: dict[frozenset[str], float] = {}
            for cls, share in shares[origin]:
                permitted = cand & allowed[cls]
                acc[permitted] = acc.get(permitted, 0.0) + share
            groups = grouping[(origin, cand)] = sorted(acc.items(), key=lambda g: sorted(g[0]))
        for permitted, share in groups:
            if not permitted:
                origin_unserved[(origin, model)] = tokens * share
                dropped += tokens * share
                continue
            ckey = (origin, model, tuple(sorted(permitted)))
            commodities[ckey] = commodities.get(ckey, 0.0) + tokens * share
    solved = _solve(commodities, _Market(offers, capacity, rtt_ms, latency_penalty))
    for ckey, slack in solved.slack.items():
        if slack > _EPS:
            key = (ckey[0], ckey[1])
            origin_unserved[key] = origin_unserved.get(key, 0.0) + slack * commodities[ckey]
    return DemandSplit(
        fractions={},
        unserved={},
        load=solved.load,
        objective=solved.objective + dropped * UNSERVED_PENALTY_USD_PER_MTOK,
        variables=solved.variables,
        origin_fractions=_origin_fractions(commodities, solved, totals),
        origin_unserved=origin_unserved,
    )


def _origin_fractions(
    commodities: Mapping[Commodity, float],
    solved: _Solved,
    totals: Mapping[tuple[str, str], float],
) -> dict[tuple[str, str], dict[str, float]]:
    out: dict[tuple[str, str], dict[str, float]] = {}
    for ckey, tokens in commodities.items():
        origin, model, _ = ckey
        share = tokens / totals[(origin, model)]
        acc = out.setdefault((origin, model), {})
        for s, x in solved.fractions[ckey].items():
            acc[s] = acc.get(s, 0.0) + x * share
    return out


@dataclass(frozen=True, slots=True)
class _Solved:
    fractions: dict[Commodity, dict[str, float]]
    slack: dict[Commodity, float]
    load: dict[tuple[str, str], float]
    objective: float
    variables: int


@dataclass(frozen=True, slots=True)
class _Market:
    """What the commodities are split over: the offers, their capacity, the round trips to
    them and what a millisecond of it costs (the arguments of ``split_*``)."""

    offers: Mapping[str, Mapping[str, Offer]]
    capacity: Mapping[tuple[str, str], float]
    rtt_ms: Mapping[tuple[str, str], float]
    latency_penalty: float


def _solve(commodities: Mapping[Commodity, float], market: _Market) -> _Solved:
    """The programme as independent blocks: commodities share a constraint only through the
    capacity of a base model, so the models drawing on one base (itself and its adapters)
    are one block, solved on its own. Each block's answer is remembered by its inputs
    (``_BLOCKS``): a change to one instance re-solves only its model's block, and the
    fleet-wide programme's cost no longer grows with every model in the fleet."""
    blocks: dict[str, dict[Commodity, float]] = {}
    root = _base_groups(commodities, market.offers)
    for ckey, tokens in commodities.items():
        blocks.setdefault(root[ckey[1]], {})[ckey] = tokens
    fractions: dict[Commodity, dict[str, float]] = {}
    slack: dict[Commodity, float] = {}
    load: dict[tuple[str, str], float] = {}
    objective, variables = 0.0, 0
    for name in sorted(blocks):
        block = blocks[name]
        inputs = _block_inputs(block, market)
        solved = _BLOCKS.get(inputs)
        if solved is None:
            solved = _solve_block(block, market)
            _BLOCKS.put(inputs, solved)
        fractions.update(solved.fractions)
        slack.update(solved.slack)
        load.update(solved.load)
        objective += solved.objective
        variables += solved.variables
    return _Solved(fractions, slack, load, objective, variables)


def _base_groups(
    commodities: Mapping[Commodity, float], offers: Mapping[str, Mapping[str, Offer]]
) -> dict[str, str]:
    """Served name -> its block's name: the smallest base model joined to it through shared
    capacity (an adapter served on different bases in different regions joins them)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    models = sorted({model for _, model, _ in commodities})
    for model in models:
        for offer in offers[model].values():
            a, b = find("m:" + model), find("b:" + offer.capacity_key)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return {model: find("m:" + model) for model in models}


def _block_inputs(block: Mapping[Commodity, float], market: _Market) -> tuple[object, ...]:
    """Everything a block's solution depends on, as a hashable key."""
    terms = []
    keys = set()
    for ckey in sorted(block):
        origin, model, targets = ckey
        for s in targets:
            offer = market.offers[model][s]
            keys.add((s, offer.capacity_key))
            rtt = 0.0 if s == origin else market.rtt_ms[(origin, s)]
            terms.append((s, offer.cost_per_mtok, offer.capacity_key, rtt))
    caps = tuple((k, market.capacity.get(k, 0.0)) for k in sorted(keys))
    return (market.latency_penalty, tuple(sorted(block.items())), tuple(terms), caps)


class _BlockMemo:
    """The last solutions by their inputs, at most ``size`` (least recently used go first)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[tuple[object, ...], _Solved] = OrderedDict()
        self.lock = threading.Lock()  # the web process compiles previews on several threads

    def get(self, inputs: tuple[object, ...]) -> _Solved | None:
        with self.lock:
            solved = self.entries.get(inputs)
            if solved is not None:
                self.entries.move_to_end(inputs)
            return solved

    def put(self, inputs: tuple[object, ...], solved: _Solved) -> None:
        with self.lock:
            self.entries[inputs] = solved
            if len(self.entries) > self.size:
                self.entries.popitem(last=False)


#: Room for every block of a few fleets (a base model's block per compile; the console's
#: previews compile variants of the fleet).
_BLOCKS = _BlockMemo(4096)


def _solve_block(commodities: Mapping[Commodity, float], market: _Market) -> _Solved:
    """One LP over the commodities: a column per (commodity, target) plus a slack each."""
    order = sorted(commodities)
    cap_rows: dict[tuple[str, str], int] = {}
    x_cost: list[float] = []
    x_row: list[int] = []  # commodity of each x
    x_cap: list[int] = []  # capacity row of each x
    x_target: list[str] = []
    for i, (origin, model, targets) in enumerate(order):
        model_offers = market.offers[model]
        for s in targets:
            offer = model_offers[s]
            rtt = 0.0 if s == origin else market.rtt_ms[(origin, s)]
            x_cost.append(offer.cost_per_mtok + market.latency_penalty * rtt)
            x_row.append(i)
            row = cap_rows.get((s, offer.capacity_key))
            if row is None:
                row = cap_rows[(s, offer.capacity_key)] = len(cap_rows)
            x_cap.append(row)
            x_target.append(s)
    n_x, n_c = len(x_cost), len(order)
    if n_c == 0:
        return _Solved({}, {}, {}, 0.0, 0)
    d = np.array([commodities[c] for c in order])
    xr = np.array(x_row, dtype=np.int64)
    # Scale every column by its commodity's demand: the objective is in USD/Mtok x tokens/s.
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
    b_ub = np.array([max(0.0, float(market.capacity.get(k, 0.0))) for k in caps])
    with DEMAND_SPLIT_SOLVE.time():
        result = linprog(
            c_vec,
            A_ub=a_ub,
            b_ub=b_ub,
            A_eq=a_eq,
            b_eq=np.ones(n_c),
            bounds=(0.0, None),  # x <= 1 follows from the equality rows
            method="highs",
        )
    if result.status != 0:
        raise DemandSplitError(f"HiGHS did not solve the demand split: {result.message}")
    sol = result.x
    fractions: dict[Commodity, dict[str, float]] = {c: {} for c in order}
    load: dict[tuple[str, str], float] = {}
    for j in np.flatnonzero(sol[:n_x] > _EPS).tolist():
        i = x_row[j]
        fractions[order[i]][x_target[j]] = float(sol[j])
        cap_key = caps[x_cap[j]]
        load[cap_key] = load.get(cap_key, 0.0) + float(sol[j] * d[i])
    slack = {c: float(sol[n_x + i]) for i, c in enumerate(order)}
    return _Solved(fractions, slack, load, float(result.fun), n_x + n_c)
