"""Session affinity: a request naming a session goes to the same instance at every edge.

A session's *home* is a pure function of its key and the instances that may take it
(rendezvous hashing, :func:`home`): every edge of a region computes the same home without
talking to the others, and when an instance leaves only the sessions homed on it move. The
scheduler keeps a session on its home unless load (or the cost of recomputing its prompt
there) says otherwise (``scheduler.py``, the affinity band). Where this edge sent a session
elsewhere (its home was overloaded or cold), :class:`SessionMap` remembers that instance and
keeps the session there; with peer sync the region's other edges hear of it too
(``peer_load.py``), else one that did not see that turn falls back to the home.

The key is fixed-size per (tenant, model, session id), so one tenant's session ids never pin
another tenant's requests and no client-sized string is kept; the map holds at most
``capacity`` keys, least recently used first out, whatever the clients send.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import xxhash

#: Longer session ids (``x-session-id`` or the body's ``user``) are refused: they are hashed to
#: a fixed-size key, but a bound keeps what a client may make the edge hash and forward small.
MAX_SESSION_ID_BYTES = 256


def session_key(tenant: str, model: str, session: bytes) -> int:
    """A fixed-size key per (tenant, model, session id)."""
    return xxhash.xxh3_64_intdigest(b"%b\0%b\0%b" % (tenant.encode(), model.encode(), session))


def home(key: int, instances: Iterable[str]) -> str | None:
    """The instance with the highest weight ``xxh3(instance id, seed=key)`` (rendezvous or
    highest-random-weight hashing): the same at every edge for the same instances, in any
    order; None when there are none. Removing an instance moves only its own sessions."""
    best: str | None = None
    top = -1
    for inst in instances:
        weight = xxhash.xxh3_64_intdigest(inst.encode(), seed=key)
        if weight > top or (weight == top and best is not None and inst < best):
            best, top = inst, weight
    return best


class SessionMap:
    """Session key → the instance that served it last, bounded by ``capacity``."""

    __slots__ = ("_instances", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._instances: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._instances)

    def __contains__(self, key: int) -> bool:
        return key in self._instances

    def get(self, key: int) -> str | None:
        return self._instances.get(key)

    def remember(self, key: int, instance: str) -> bool:
        """The session is on ``instance`` now; True when that is news (a new session here, or
        one that moved), which peer sync tells the region's other edges."""
        instances = self._instances
        moved = instances.get(key) != instance
        if moved:
            instances[key] = instance
        instances.move_to_end(key)
        if len(instances) > self.capacity:
            instances.popitem(last=False)
        return moved
