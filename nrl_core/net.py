"""A free TCP port, for the rendezvous stores process groups meet at (written once; the worker
hosts, the refit's broadcast group, the test harnesses and the GPU check all need one)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` ("" for every interface) that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
