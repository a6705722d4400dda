"""Real model, real engine, real HTTP: one in-process server per session (the model loads once).

`server` serves the Gemma GGUF with continuous batching (capacity 4, 512 tokens per sequence);
`guarded` is a second instance with an API key, a tiny admission queue,
for the auth, overload and timeout cases. Both listen on port 0 (the OS picks a free
port) so parallel sessions never collide.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.server.app import create_app
from ember_runtime.server.state import AppState
from starlette.applications import Starlette

from tests.support.model import default_model_path
from tests.support.waiting import wait_for

CAPACITY = 4
CONTEXT = 512
API_KEY = "s3cret-test-key"


@dataclass
class LiveServer:
    app: Starlette  # the runtime's FastAPI app, or the gateway's
    server: uvicorn.Server
    thread: threading.Thread
    url: str

    @property
    def state(self) -> AppState:
        state: AppState = self.app.state.ember
        return state

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def start_live(app: Starlette, port: int = 0) -> LiveServer:
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()

    def started() -> bool:
        if not server.started and not thread.is_alive():
            raise RuntimeError("the test server's thread ended before it started")
        return bool(server.started)

    wait_for("the test server to start", started, 120, 0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return LiveServer(app, server, thread, f"http://127.0.0.1:{port}")


def make_config(
    tmp: Path, engine_args: dict[str, str] | None = None, **server: object
) -> RuntimeConfig:
    model = default_model_path()
    thermal = tmp / "class" / "thermal" / "thermal_zone0"
    thermal.mkdir(parents=True)
    (thermal / "type").write_text("cpu-thermal\n")
    (thermal / "temp").write_text("47250\n")
    return RuntimeConfig.model_validate(
        {
            "modelName": "gemma-3-270m",
            "modelDir": str(model.parent),
            "engine": {
                "maxBatchSize": CAPACITY,
                "contextLength": CONTEXT,
                "threads": 1,
                "args": engine_args or {},
            },
            "server": {"port": 8080, **server},
            "sensors": {"sysfsRoot": str(tmp), "intervalSeconds": 0.2},
        }
    )


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[LiveServer]:
    config = make_config(tmp_path_factory.mktemp("sysfs"), maxQueue=16)
    live = start_live(create_app(config, model_path=model_path))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def guarded(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("guarded")
    key_file = tmp / "api-key"
    key_file.write_text(API_KEY + "\n")
    config = make_config(
        tmp / "sysfs",
        apiKeyFile=str(key_file),
        maxQueue=2,
        requestTimeoutSeconds=120.0,
    )
    live = start_live(create_app(config, model_path=model_path))
    yield live
    live.stop()
