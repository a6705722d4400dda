"""`GET /admin/state`: a replica's live state, as the runtime serves it and the gateway reads it.

The runtime encodes through `AdminState` (its route returns one; camelCase on the wire) and a
site gateway decodes its probes through `read_admin_state`. The reader is tolerant: a field it
does not know is ignored and the fields routing does not need have defaults, so a runtime and a
gateway of neighbouring versions still understand each other during an upgrade. The four the
gateway routes on (batch limit, capacity, active, queued) are required.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

STATE_PATH = "/admin/state"


class AdminState(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    max_batch_size: int = Field(ge=0, description="The batch limit now (thermal, or an override).")
    capacity: int = Field(ge=0, description="Sequences the engine allocated for.")
    queue_depth: int = Field(ge=0)
    active_sequences: int = Field(ge=0)
    last_step_sequences: int = 0
    steps: int = 0
    temperatures: dict[str, float] = Field(default_factory=dict)
    draining: bool = False
    thermal_reason: str = ""
    sensor_problem: str | None = Field(
        default=None,
        description="Why a configured sensor gives no reading (e.g. NVML without a driver).",
    )
    override_expires_in_seconds: float | None = None
    adapters: list[str] = Field(
        default_factory=list, description="LoRA adapters served, each its own model id."
    )
    refused_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="engine.adapters entries not served, with why (wrong sha256, other base).",
    )


def read_admin_state(body: bytes) -> AdminState:
    """A probe's reply, typed; raises ValueError (pydantic's) on one the runtime did not write."""
    return AdminState.model_validate_json(body)
