"""Local ports for servers a test or benchmark starts."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick; racy only against other binders)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False
