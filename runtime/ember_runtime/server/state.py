"""What the routes share, kept on `app.state.ember` (no module globals)."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field

from fastapi import Request

from ember_runtime.engines.base import Engine
from ember_runtime.server.errors import APIError
from ember_runtime.server.metrics import Metrics
from ember_runtime.thermal.governor import Governor


@dataclass
class AppState:
    engine: Engine
    metrics: Metrics
    request_timeout: float
    api_key: str | None = None
    ready: bool = False
    draining: bool = False
    temperatures: dict[str, float] = field(default_factory=dict)
    governor: Governor | None = None
    # `spec.sampling`: what a request's left-out sampling fields mean here (request names).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    started: int = field(default_factory=lambda: int(time.time()))


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.ember
    return state


def require_api_key(request: Request) -> None:
    """Bearer-token check, active only when an API key is configured."""
    key = get_state(request).api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(
            401,
            "missing or invalid API key",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
