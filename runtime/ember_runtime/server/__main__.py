"""`python -m ember_runtime.server [--config path] [--model path] [--port N] ...`

Before loading the model the runtime checks that the engine's memory (`ember_runtime.memory`,
the same rule the operator sizes the pod with) fits under the container's cgroup limit, and
exits 2 with a one-line `Reason: detail` (`ember_runtime.contract.reasons`) in the termination
log when it does not.

SIGTERM (the kubelet's stop signal) stops accepting connections, lets in-flight streams finish
(bounded by the request timeout), then stops the engine and exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import uvicorn

from ember_runtime import termination
from ember_runtime.cli import configure_logging
from ember_runtime.contract import reasons
from ember_runtime.contract.manifest import resolve_model_path
from ember_runtime.engines.base import EngineUnavailableError
from ember_runtime.heap import freeze_startup_heap
from ember_runtime.memory import MemoryLimitError
from ember_runtime.server.app import create_app
from ember_runtime.server.preflight import preflight
from ember_runtime.server.settings import load_settings
from ember_runtime.server.state import AppState

log = logging.getLogger("ember_runtime.server")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
CGROUP_ROOT_ENV = "EMBER_CGROUP_ROOT"  # tests point it at a fake cgroup; default /sys/fs/cgroup


class _DrainingServer(uvicorn.Server):
    """Marks the app as draining the moment the signal arrives, before uvicorn waits."""

    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self._state = state

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the captured signal after its graceful shutdown, which would end
        # the process as "killed by SIGTERM"; a completed drain is a clean exit (status 0).
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._state.draining = True
        log.info("signal %d: draining in-flight requests", sig)
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    # A bad flag, variable or config file (ValidationError is a ValueError), or nothing to serve.
    except (ValueError, OSError) as exc:
        print(f"invalid runtime settings:\n{exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    config = settings.config
    try:
        model = settings.model_path
        if config.engine.kind == "llamacpp":
            model = resolve_model_path(config, explicit=model)
            # Refuse now, with the reason in the termination message (the pod's Degraded
            # reason), rather than be OOM-killed once the KV cache fills up under load.
            preflight(config, model, Path(os.environ.get(CGROUP_ROOT_ENV, "/sys/fs/cgroup")))
        app = create_app(
            config,
            model_path=model,
            config_path=settings.config_path,
            health_window_seconds=settings.health_window_seconds,
        )
    except (OSError, ValueError, EngineUnavailableError, MemoryLimitError) as exc:
        log.error("cannot start: %s", exc)
        reason = (
            reasons.ENGINE_MEMORY_OVER_LIMIT
            if isinstance(exc, MemoryLimitError)
            else reasons.RUNTIME_START_FAILED
        )
        termination.report(config.termination_log, reason, str(exc), who="runtime")
        return 2
    uv_config = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=int(config.server.request_timeout_seconds) + 1,
        access_log=False,
        lifespan="on",
        # Admin writes trust a loopback peer only (server/admin.py): X-Forwarded-For is believed
        # from loopback alone (a proxy in the pod), never from the LAN, whatever
        # FORWARDED_ALLOW_IPS says, so no LAN client can claim to be 127.0.0.1.
        proxy_headers=True,
        forwarded_allow_ips="127.0.0.1,::1",
    )
    server = _DrainingServer(uv_config, app.state.ember)
    # Imports, the app and its schemas live as long as the process: out of the collector's
    # full passes, each of which walked them all (26-28 ms here; 3 ms once they are frozen)
    # and would stall whatever decode step it fell in.
    freeze_startup_heap()
    server.run()
    if not server.started:
        termination.report(
            config.termination_log,
            reasons.RUNTIME_START_FAILED,
            "the server did not start",
            who="runtime",
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
