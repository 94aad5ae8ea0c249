"""Ports for test servers and multi-process worlds: distinct, free, and out of the kernel's
ephemeral range (where an outgoing connection could take one before it is bound)."""

from __future__ import annotations

import random
import socket

from hicache_async.testing._servers import _ephemeral_low, free_port, free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(20000 <= port < _ephemeral_low() for port in ports)
    for port in [*ports, free_port()]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_seeding_random_does_not_repeat_the_ports() -> None:
    picks = []
    for _ in range(2):
        random.seed(1234)  # as test tools do in every process
        picks.append(free_ports(3))
    assert picks[0] != picks[1]
