"""Drill 3's parts: the runtime server as its own process on the packaged Gemma model, and a
crowd of streaming clients that keeps it over its queue bound and hangs up mid-stream."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.net import free_port
from tests.support.waiting import wait_for

PROMPTS = (
    "Once upon a time",
    "The capital of France is",
    "Write a haiku about the sea:",
    "List three prime numbers:",
    "Explain what a kernel does in one sentence.",
)
METRIC_RE = re.compile(r"^(ember_[a-z_]+)(?:\{([^}]*)\})? (\S+)$", re.M)


@dataclass
class Server:
    """`python -m ember_runtime.server` with a small batch and queue, logging to a file."""

    model: Path
    workdir: Path
    max_batch: int
    max_queue: int
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / "server.log"

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "ember_runtime.server",
            "--model", str(self.model),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--threads", "1",
            "--max-batch-size", str(self.max_batch),
            "--max-queue", str(self.max_queue),
            "--context-length", "256",
            "--sysfs-root", str(self.workdir),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "EMBER_CONFIG"}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

        def ready() -> bool:
            if self._ready():
                return True
            assert self.alive(), self.log.read_text()  # exited: fail now, with its log
            return False

        wait_for("the server to be ready", ready, 120, 0.2)

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int:
        assert self.proc is not None
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))
        return int(kib) * 1024

    def metrics(self) -> dict[str, float]:
        """`name{labels}` -> value for Ember's own series."""
        text = httpx.get(self.url + "/metrics").text
        return {f"{n}{{{labels}}}": float(v) for n, labels, v in METRIC_RE.findall(text)}

    def stop(self) -> int:
        """SIGTERM (drain, then exit 0); SIGKILL only if it hangs."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def series_sum(metrics: dict[str, float], name: str, labels: str = "") -> float:
    return sum(v for k, v in metrics.items() if k.startswith(name + "{") and labels in k)


@dataclass
class Tally:
    """What the clients saw."""

    admitted: int = 0  # 200 OK: the server took the request
    completed: int = 0  # streamed to `data: [DONE]`
    hung_up: int = 0  # the client closed the stream on purpose, mid-way
    cut_off: int = 0  # the stream ended without [DONE] while the client still listened
    stream_errors: int = 0  # an error event inside a 200 stream
    rejected: int = 0  # 429
    without_retry_after: int = 0  # 429s lacking a positive integer Retry-After
    reject_seconds: list[float] = field(default_factory=list)
    other_status: Counter[int] = field(default_factory=Counter)
    transport_errors: Counter[str] = field(default_factory=Counter)
    admitted_at: list[float] = field(default_factory=list)


async def _one(http: httpx.AsyncClient, rng: random.Random, tally: Tally, hang_up: float) -> None:
    body = {
        "prompt": rng.choice(PROMPTS),
        "max_tokens": rng.randint(8, 48),
        "temperature": 0.8,
        "seed": rng.randrange(1 << 30),
        "stream": True,
    }
    drop_after = rng.randint(1, 8) if rng.random() < hang_up else None
    started = time.monotonic()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code == 429:
            tally.rejected += 1
            tally.reject_seconds.append(time.monotonic() - started)
            retry = response.headers.get("retry-after", "")
            tally.without_retry_after += not (retry.isdigit() and int(retry) >= 1)
            await response.aread()
            return
        if response.status_code != 200:
            tally.other_status[response.status_code] += 1
            await response.aread()
            return
        tally.admitted += 1
        tally.admitted_at.append(time.monotonic())
        chunks = 0
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                tally.completed += 1
                return
            if not line.startswith("data: "):
                continue
            chunks += 1
            tally.stream_errors += line.startswith('data: {"error"')
            if drop_after is not None and chunks >= drop_after:
                tally.hung_up += 1
                return  # leaving the block closes the connection mid-stream
        tally.cut_off += 1


async def _client(url: str, seed: int, deadline: float, tally: Tally, hang_up: float) -> None:
    rng = random.Random(seed)
    timeout = httpx.Timeout(120.0, connect=10.0)
    # One connection a client: a hang-up closes it, as a real client going away would.
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
        while time.monotonic() < deadline:
            try:
                await _one(http, rng, tally, hang_up)
            except httpx.TransportError as err:
                tally.transport_errors[type(err).__name__] += 1
            # A short pause, not Retry-After: the drill keeps the server over its bound.
            await asyncio.sleep(rng.uniform(0.02, 0.2))


async def crowd(url: str, clients: int, seconds: float, hang_up: float, seed: int) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    await asyncio.gather(
        *(_client(url, seed + i, deadline, tally, hang_up) for i in range(clients))
    )
    return tally


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
