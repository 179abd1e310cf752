"""Listening ports for local processes: outside the ephemeral range, never handed out twice."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from regions.supervisor import free_port, free_ports


def _pick(count: int) -> list[int]:
    return [free_port() for _ in range(count)]


def test_ports_come_from_below_the_ephemeral_range() -> None:
    first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)] + free_ports(5)
    assert all(10_000 <= port < first for port in ports)
    assert ports[-5:] == list(range(ports[-5], ports[-5] + 5))


def test_processes_picking_at_once_never_get_the_same_port() -> None:
    with multiprocessing.get_context("fork").Pool(4) as pool:
        picked = [port for ports in pool.map(_pick, [40] * 4) for port in ports]
    assert len(picked) == len(set(picked)) == 160
