"""Session affinity: a request naming a session goes back to the instance that served it.

The key is fixed-size per (tenant, model, session id), so one tenant's session ids never pin
another tenant's requests and no client-sized string is kept; the map holds at most
``capacity`` keys, least recently used first out, whatever the clients send.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

#: Longer session ids (``x-session-id`` or the body's ``user``) are refused: they are hashed to
#: a fixed-size key, but a bound keeps what a client may make the edge hash and forward small.
MAX_SESSION_ID_BYTES = 256


def session_key(tenant: str, model: str, session: bytes) -> int:
    """A fixed-size key per (tenant, model, session id)."""
    return xxhash.xxh3_64_intdigest(b"%b\0%b\0%b" % (tenant.encode(), model.encode(), session))


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

    def remember(self, key: int, instance: str) -> None:
        instances = self._instances
        if instances.get(key) != instance:
            instances[key] = instance
        instances.move_to_end(key)
        if len(instances) > self.capacity:
            instances.popitem(last=False)
