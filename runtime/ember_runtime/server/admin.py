"""Admin endpoints: live runtime state, and a manual override of the thermal governor.

The runtime governs its own batch limit from its sensors (`ember_runtime.thermal.governor`);
nothing calls these endpoints in normal operation. `GET /admin/state` is read-only (behind the
API key when one is set): a site gateway routes on it, so its body is the contract's
(`contract.admin.AdminState`). `PUT /admin/batch` lowers the limit for `expiresInSeconds`
(default 600) — to shed load by hand — never above what the thermal policy allows at the
current temperature; `DELETE /admin/batch` ends the override at once.

The writes are taken only from inside the pod: a loopback peer (`kubectl port-forward`, which
needs the pods/portforward permission, or `kubectl exec`). A client on the site's LAN, or
behind a proxy that says whom it forwards for (uvicorn reads X-Forwarded-For from a loopback
proxy), gets a 403 whatever key it holds (docs/threat-model.md, hole 4 of issue 34).
"""

from __future__ import annotations

import ipaddress
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from ember_runtime.contract.admin import STATE_PATH, AdminState
from ember_runtime.server.errors import APIError
from ember_runtime.server.schemas import BatchSizeRequest
from ember_runtime.server.state import AppState, get_state, require_api_key

router = APIRouter(prefix="/admin", dependencies=[Depends(require_api_key)])
StateDep = Annotated[AppState, Depends(get_state)]


def require_in_pod(request: Request) -> None:
    """403 unless the peer is a loopback address: only the pod itself may change the limit."""
    host = request.client.host if request.client is not None else ""
    try:
        inside = ipaddress.ip_address(host).is_loopback
    except ValueError:  # no address (a Unix socket has none): not provably inside
        inside = False
    if not inside:
        raise APIError(
            403,
            "admin writes are taken only from inside the pod (kubectl port-forward or exec)",
            code="admin_from_outside",
        )


InPod = Depends(require_in_pod)


def _snapshot(state: AppState) -> AdminState:
    s = state.engine.state()
    governed = state.governor.state() if state.governor else None
    override = governed.override if governed else None
    return AdminState(
        max_batch_size=s.max_batch_size,
        capacity=s.capacity,
        queue_depth=s.queued,
        active_sequences=s.active,
        last_step_sequences=s.last_step_sequences,
        steps=s.steps,
        temperatures=dict(state.temperatures),
        draining=state.draining,
        thermal_reason=governed.reason if governed else "",
        sensor_problem=governed.sensor_problem if governed else None,
        override_expires_in_seconds=None
        if override is None
        else round(max(0.0, override.until - time.monotonic()), 1),
        adapters=list(state.engine.info.adapters),
        refused_adapters=dict(state.engine.info.refused_adapters),
    )


@router.get(STATE_PATH.removeprefix("/admin"), response_model_by_alias=True)
async def admin_state(state: StateDep) -> AdminState:
    return _snapshot(state)


@router.put("/batch", response_model_by_alias=True, dependencies=[InPod])
async def put_batch(body: BatchSizeRequest, state: StateDep) -> AdminState:
    try:
        if state.governor is not None:
            state.governor.set_override(body.max_batch_size, body.expires_in_seconds)
        else:
            state.engine.set_max_batch_size(body.max_batch_size)
    except ValueError as exc:
        raise APIError(400, str(exc), param="maxBatchSize", code="out_of_range") from exc
    return _snapshot(state)


@router.delete("/batch", response_model_by_alias=True, dependencies=[InPod])
async def delete_batch(state: StateDep) -> AdminState:
    if state.governor is not None:
        state.governor.clear_override()
    return _snapshot(state)
