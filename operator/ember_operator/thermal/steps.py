"""The thermal ladder's steps as Events on the InferenceDeployment: one per change of a
replica's own thermal reason (Normal → Throttled → Critical and back), read from its pod
condition in the operator's pod watch.

Changes only: the runtime writes its condition on change, and the policy's hysteresis keeps the
reason from flapping, so the Events follow the heat, not pods × seconds. An operator restart
forgets the last reasons; a replica first seen hot is told once more, a cool one not at all.
"""

from __future__ import annotations

import threading
from typing import Final

from ember_runtime.contract.thermal import (
    REASON_CRITICAL,
    REASON_NORMAL,
    REASON_THROTTLED,
    ThermalReading,
)
from kubernetes import client

from ember_operator.api import API_VERSION, KIND
from ember_operator.events import ObjectRef, record_event
from ember_operator.thermal.nodes import Replica

# reason → (Event reason, Event type)
STEP_EVENTS: Final = {
    REASON_THROTTLED: ("ReplicaThrottled", "Normal"),
    REASON_CRITICAL: ("ReplicaShedding", "Warning"),
    REASON_NORMAL: ("ReplicaCooled", "Normal"),
}
WHAT: Final = {
    REASON_THROTTLED: "batch lowered for heat",
    REASON_CRITICAL: "at its batch floor and still hot: new work goes to cooler peers",
    REASON_NORMAL: "cool again: full batch",
}


class LadderSteps:
    """The last reason per replica; `observe` posts an Event when it changes."""

    def __init__(self, core: client.CoreV1Api) -> None:
        self.core = core
        self._last: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def observe(self, replica: Replica, reading: ThermalReading | None) -> str | None:
        """The Event reason posted, if any."""
        reason = reading.reason if reading is not None else None
        if reading is None or reason not in STEP_EVENTS:
            return None
        key = (replica.namespace, replica.pod)
        with self._lock:
            before = self._last.get(key)
            self._last[key] = reason
        if before == reason or (before is None and reason == REASON_NORMAL):
            return None
        event, kind = STEP_EVENTS[reason]
        owner = ObjectRef(API_VERSION, KIND, replica.owner, replica.namespace)
        message = f"{replica.pod} on {replica.node}: {reading.message()}; {WHAT[reason]}"
        record_event(self.core, owner, event, message, kind)
        return event

    def forget(self, replica: Replica) -> None:
        with self._lock:
            self._last.pop((replica.namespace, replica.pod), None)
