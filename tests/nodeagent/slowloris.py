"""Slow connections against the peer port while a real peer transfers a file (issue 34, hole 6).

Three processes, real sockets: the peer server (`serve`: a PeerServer over a cache holding one
file, as the agent runs it), the attacker (`attack`: keeps `n` connections open that send
nothing or dribble a header byte a second, reconnecting whenever the server drops one), and
the measuring side (`measure`), which times signed transfers of the file unloaded and under
attack and reads the server's RSS and counters. The test runs it small; the benchmark
(bench/peer_slowloris.py) at 1 GiB.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from ember_runtime.nodeagent import peerauth

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Figures:
    size_bytes: int
    connections: int
    unloaded_s: list[float] = field(default_factory=list)
    loaded_s: list[float] = field(default_factory=list)
    rss_before_kib: int = 0
    rss_under_attack_kib: int = 0
    rss_peak_kib: int = 0
    threads_under_attack: int = 0
    attacker: dict[str, int] = field(default_factory=dict)
    server: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return statistics.median(self.loaded_s) / statistics.median(self.unloaded_s)

    def report(self) -> dict[str, object]:
        return {**asdict(self), "ratio_of_medians": round(self.ratio, 3)}


# --- the server process ----------------------------------------------------------------------


def serve(root: Path, asker_key: str) -> None:
    """A PeerServer over `root`; prints `port public-key`, then serves until SIGTERM, then
    prints its counters as JSON."""
    from ember_runtime.nodeagent.cache import ContentCache
    from ember_runtime.nodeagent.peerserver import PeerServer

    me = peerauth.Identity("holder")
    server = PeerServer(ContentCache(root), me, {"asker": asker_key}.get, "127.0.0.1", 0)
    server.start()
    print(server.port, me.public, flush=True)
    done = False

    def stop(*_: object) -> None:
        nonlocal done
        done = True

    signal.signal(signal.SIGTERM, stop)
    while not done:
        time.sleep(0.1)
    stats = asdict(server.stats)
    server.close()
    print(json.dumps(stats), flush=True)


# --- the attacker process --------------------------------------------------------------------


class _Attacker:
    """`n` slow connections: half send nothing, half dribble a header byte a second."""

    DRIBBLE = b"GET /sha256/" + b"0" * 64 + b" HTTP/1.1\r\nX-Slow: "

    def __init__(self, port: int) -> None:
        self.port = port
        self.sel = selectors.DefaultSelector()
        self.socks: dict[socket.socket, int] = {}  # → head bytes sent (-1: sends nothing)
        self.counts = {"opened": 0, "dropped_by_server": 0, "connect_failed": 0}

    def open_one(self, silent: bool) -> None:
        s = socket.socket()
        s.setblocking(False)
        if s.connect_ex(("127.0.0.1", self.port)) not in (0, errno.EINPROGRESS):
            self.counts["connect_failed"] += 1
            s.close()
            return
        self.counts["opened"] += 1
        self.socks[s] = -1 if silent else 0
        self.sel.register(s, selectors.EVENT_READ)

    def reap(self, timeout: float) -> None:
        """Connections the server closed come back at once, as an attacker's would."""
        for key, _ in self.sel.select(timeout):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                if s.recv(4096):
                    continue
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass
            self.sel.unregister(s)
            silent = self.socks.pop(s) < 0
            s.close()
            self.counts["dropped_by_server"] += 1
            self.open_one(silent)

    def dribble(self) -> None:
        for s, sent in list(self.socks.items()):
            if sent >= 0:
                i = sent % len(self.DRIBBLE)
                with contextlib.suppress(OSError):
                    s.send(self.DRIBBLE[i : i + 1])
                    self.socks[s] = sent + 1


def attack(port: int, n: int) -> None:
    """Keep `n` slow connections open until SIGTERM; then print counts as JSON."""
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    attacker = _Attacker(port)
    for i in range(n):
        attacker.open_one(silent=i % 2 == 0)
    last = time.monotonic()
    while not done.is_set():
        attacker.reap(0.2)
        if time.monotonic() - last >= 1.0:
            last = time.monotonic()
            attacker.dribble()
    print(json.dumps({**attacker.counts, "open_at_end": len(attacker.socks)}), flush=True)


# --- the measuring side ----------------------------------------------------------------------


def _rss_kib(pid: int, field_name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return 0


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _transfer(port: int, sha: str, me: peerauth.Identity, server_key: str) -> float:
    path = f"/sha256/{sha}"
    headers = peerauth.sign_request(me, "GET", path, "holder")
    started = time.monotonic()
    got = 0
    with httpx.stream("GET", f"http://127.0.0.1:{port}{path}", headers=headers, timeout=60) as r:
        problem = peerauth.verify_response(
            server_key, "holder", r.status_code, path, request=headers, headers=r.headers
        )
        assert problem is None and r.status_code == 200, (problem, r.status_code)
        for chunk in r.iter_raw(1 << 20):
            got += len(chunk)
    elapsed = time.monotonic() - started
    assert got == int(r.headers["content-length"])
    return elapsed


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.nodeagent.slowloris", *args]


def measure(
    root: Path, sha: str, size: int, connections: int, *, rounds: int = 5, settle: float = 6.0
) -> Figures:
    """Transfers unloaded, then under `connections` slow connections (after `settle` s: past
    the server's 5 s header timeout, so its drops and the attacker's reconnects are going on
    too); the server's figures."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}/runtime:{ROOT}"}
    me = peerauth.Identity("asker")
    figures = Figures(size, connections)
    server = subprocess.Popen(
        _python("serve", str(root), me.public), env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port_text, server_key = server.stdout.readline().split()
        port = int(port_text)
        _transfer(port, sha, me, server_key)  # warm the page cache
        figures.rss_before_kib = _rss_kib(server.pid)
        figures.unloaded_s = [_transfer(port, sha, me, server_key) for _ in range(rounds)]
        attacker = subprocess.Popen(
            _python("attack", str(port), str(connections)),
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(settle)
            figures.rss_under_attack_kib = _rss_kib(server.pid)
            figures.threads_under_attack = _threads(server.pid)
            figures.loaded_s = [_transfer(port, sha, me, server_key) for _ in range(rounds)]
        finally:
            attacker.send_signal(signal.SIGTERM)
            out, _ = attacker.communicate(timeout=30)
            figures.attacker = json.loads(out.strip().splitlines()[-1])
        figures.rss_peak_kib = _rss_kib(server.pid, "VmHWM")
    finally:
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=30)
    figures.server = json.loads(out.strip().splitlines()[-1])
    return figures


def main(argv: list[str]) -> None:
    if argv[0] == "serve":
        serve(Path(argv[1]), argv[2])
    elif argv[0] == "attack":
        attack(int(argv[1]), int(argv[2]))
    else:
        raise SystemExit(f"unknown command {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
