"""Admin endpoints for the operator's thermal loop: live batch size and runtime state."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from ember_runtime.server.errors import APIError
from ember_runtime.server.schemas import AdminState, BatchSizeRequest
from ember_runtime.server.state import AppState, get_state, require_api_key

router = APIRouter(prefix="/admin", dependencies=[Depends(require_api_key)])
StateDep = Annotated[AppState, Depends(get_state)]


def _snapshot(state: AppState) -> AdminState:
    s = state.engine.state()
    return AdminState(
        max_batch_size=s.max_batch_size,
        capacity=s.capacity,
        queue_depth=s.queued,
        active_sequences=s.active,
        last_step_sequences=s.last_step_sequences,
        steps=s.steps,
        temperatures=dict(state.temperatures),
        draining=state.draining,
    )


@router.get("/state", response_model_by_alias=True)
async def admin_state(state: StateDep) -> AdminState:
    return _snapshot(state)


@router.put("/batch", response_model_by_alias=True)
async def put_batch(body: BatchSizeRequest, state: StateDep) -> AdminState:
    try:
        state.engine.set_max_batch_size(body.max_batch_size)
    except ValueError as exc:
        raise APIError(400, str(exc), param="maxBatchSize", code="out_of_range") from exc
    return _snapshot(state)
