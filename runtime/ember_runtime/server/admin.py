"""Admin endpoints: live runtime state, and a manual override of the thermal governor.

The runtime governs its own batch limit from its sensors (`ember_runtime.thermal.governor`);
nothing calls these endpoints in normal operation. `PUT /admin/batch` pins a limit for
`expiresInSeconds` (default 600) — e.g. to shed load by hand — after which the policy takes over
again; `DELETE /admin/batch` ends the override at once.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends

from ember_runtime.server.errors import APIError
from ember_runtime.server.schemas import AdminState, BatchSizeRequest
from ember_runtime.server.state import AppState, get_state, require_api_key

router = APIRouter(prefix="/admin", dependencies=[Depends(require_api_key)])
StateDep = Annotated[AppState, Depends(get_state)]


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
    )


@router.get("/state", response_model_by_alias=True)
async def admin_state(state: StateDep) -> AdminState:
    return _snapshot(state)


@router.put("/batch", response_model_by_alias=True)
async def put_batch(body: BatchSizeRequest, state: StateDep) -> AdminState:
    try:
        if state.governor is not None:
            state.governor.set_override(body.max_batch_size, body.expires_in_seconds)
        else:
            state.engine.set_max_batch_size(body.max_batch_size)
    except ValueError as exc:
        raise APIError(400, str(exc), param="maxBatchSize", code="out_of_range") from exc
    return _snapshot(state)


@router.delete("/batch", response_model_by_alias=True)
async def delete_batch(state: StateDep) -> AdminState:
    if state.governor is not None:
        state.governor.clear_override()
    return _snapshot(state)
