"""Real runtimes (the real engine on the real Gemma model) behind the real gateway, on real
sockets: `alpha` is served by two replicas with key ALPHA_KEY, `beta` by one with BETA_KEY.
Capacities are small (4 sequences, a short context) so the 2-core machine holds them all."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from ember_runtime.gateway.app import create_app
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.metrics import GatewayMetrics
from ember_runtime.gateway.policy import Policy
from ember_runtime.gateway.routes import Backend, ModelRoute
from ember_runtime.server.app import create_app as runtime_app

from tests.runtime.conftest import LiveServer, make_config, start_live
from tests.support.waiting import wait_for

ALPHA_KEY = "alpha-key-0123456789"
BETA_KEY = "beta-key-9876543210"
POLICY = Policy(prefix_chars=64, min_prefix=48, load_factor=1.25)


def start_replica(
    tmp: Path, model: str, key: str, listen: int = 0, min_batch: int | None = None, **server: object
) -> LiveServer:
    """`min_batch`: the thermal policy's floor (its default is the test capacity, 4: heat would
    change nothing)."""
    tmp.mkdir(parents=True, exist_ok=True)
    key_file = tmp / "api-key"
    key_file.write_text(key + "\n")
    config = make_config(tmp / "sysfs", None, apiKeyFile=str(key_file), **server)
    config = config.model_copy(update={"model_name": model})
    if min_batch is not None:
        thermal = config.thermal.model_copy(update={"min_batch_size": min_batch})
        config = config.model_copy(update={"thermal": thermal})
    return start_live(runtime_app(config), port=listen)


def route(name: str, key: str | None, *replicas: str) -> ModelRoute:
    return ModelRoute(name, f"test/{name}", key, tuple(Backend(u, u) for u in replicas))


@dataclass
class Gateway:
    live: LiveServer
    fleet: Fleet
    routes: dict[str, ModelRoute] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.live.url

    @property
    def metrics(self) -> GatewayMetrics:
        metrics: GatewayMetrics = self.live.app.state.gateway.metrics
        return metrics

    def counter(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(f"{name}_total", labels)
        return value or 0.0

    def wait_probed(self, check: Callable[[Fleet], bool], timeout: float = 10.0) -> None:

        def seen() -> str:
            views = [(r.backend.key, r.view()) for m in self.routes for r in self.fleet.replicas(m)]
            return f"the replicas as probed: {views}"

        what = "the gateway's probes to show the expected state"
        wait_for(what, lambda: check(self.fleet), timeout, 0.05, on_fail=seen)

    def stop(self) -> None:
        self.live.stop()


def start_gateway(routes: dict[str, ModelRoute], interval: float = 0.2) -> Gateway:
    fleet = Fleet(POLICY, interval=interval, timeout=0.5)

    async def discover(fleet: Fleet, metrics: GatewayMetrics) -> None:
        fleet.update(routes)

    gateway = Gateway(start_live(create_app(fleet, discover, read_timeout=60.0)), fleet, routes)
    everyone = [b.key for r in routes.values() for b in r.backends]
    gateway.wait_probed(
        lambda f: all(r.healthy for m in routes for r in f.replicas(m)) or not everyone
    )
    return gateway


@pytest.fixture(scope="session")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LiveServer]]:
    tmp = tmp_path_factory.mktemp("replicas")
    live = [
        start_replica(tmp / "a0", "alpha", ALPHA_KEY, maxQueue=8),
        start_replica(tmp / "a1", "alpha", ALPHA_KEY, maxQueue=8),
        start_replica(tmp / "b0", "beta", BETA_KEY, maxQueue=8),
    ]
    yield live
    for server in live:
        server.stop()


@pytest.fixture(scope="session")
def gateway(replicas: list[LiveServer]) -> Iterator[Gateway]:
    a0, a1, b0 = replicas
    gw = start_gateway(
        {
            "alpha": route("alpha", ALPHA_KEY, a0.url, a1.url),
            "beta": route("beta", BETA_KEY, b0.url),
        }
    )
    yield gw
    gw.stop()


def served_by(response: httpx.Response) -> str:
    return response.headers["x-ember-replica"]


def host(server: LiveServer) -> str:
    return server.url.removeprefix("http://")


class CutRelay:
    """A TCP relay in front of a replica that the test can sever (real sockets both ways):
    `cut_before_reply` resets a connection when a POST arrives, before any reply byte (the
    probes' GETs pass, so the gateway believes the replica healthy);
    `cut()` resets every open connection at once."""

    def __init__(self, target: str, cut_before_reply: bool = False) -> None:
        self.target_host, port = target.rsplit(":", 1)
        self.target_port, self.cut_before_reply = int(port), cut_before_reply
        self.replied = threading.Event()  # a reply byte went through
        self._loop = asyncio.new_event_loop()
        self._writers: list[asyncio.StreamWriter] = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0)
        )
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        ready.set()
        self._loop.run_forever()

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, reply: bool
    ) -> None:
        while chunk := await src.read(65536):
            if not reply and self.cut_before_reply and chunk.startswith(b"POST "):
                raise ConnectionResetError("cut before the reply")  # probes (GET) pass
            dst.write(chunk)
            await dst.drain()
            if reply:
                self.replied.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        self._writers.append(up_writer)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, False), self._pipe(up_reader, writer, True)
            )
        except (ConnectionError, OSError):
            for w in (writer, up_writer):
                _reset(w)
        finally:
            for w in (writer, up_writer):
                w.close()

    def cut(self) -> None:
        def reset_all() -> None:
            for w in self._writers:
                _reset(w)

        self._loop.call_soon_threadsafe(reset_all)

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            here = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not here]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a crashed peer's kernel does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.close()


def generations(server: LiveServer) -> float:
    """Generation requests a runtime has answered (its own counter; probes not included)."""
    total = 0.0
    for metric in server.state.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "ember_requests_total" and sample.labels.get("endpoint") in (
                "/v1/completions",
                "/v1/chat/completions",
            ):
                total += sample.value
    return total


def prompt_preferring(keys: list[str], want: str, tail: str = "", chat: bool = False) -> str:
    """A prompt (longer than min_prefix) whose prefix hashes to `want` first on the ring; with
    `chat`, as the one user message of a chat request (the gateway's prefix is then the
    rendered messages)."""
    from ember_runtime.gateway.policy import ring_order
    from ember_runtime.gateway.proxy import prefix_text

    for i in range(10_000):
        prompt = f"Case {i}. You are a careful assistant who answers in one short line. {tail}"
        text = prefix_text({"messages": [{"role": "user", "content": prompt}]}) if chat else prompt
        if ring_order(keys, text[: POLICY.prefix_chars])[0] == want:
            return prompt
    raise AssertionError("no prompt found")
