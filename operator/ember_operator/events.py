"""Core/v1 Events about any object (an InferenceDeployment, a Node): the operator's one writer.

Synchronous (the `kubernetes` client): call it from a thread (`asyncio.to_thread`) inside Kopf
handlers. RBAC: `events: create`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from kubernetes import client

COMPONENT = "ember-operator"


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    name: str
    namespace: str | None = None
    uid: str | None = None


def record_event(
    core: client.CoreV1Api, ref: ObjectRef, reason: str, message: str, kind: str = "Normal"
) -> None:
    """A core/v1 Event; cluster-scoped objects (nodes) get theirs in `default`, as kubelet does."""
    now = datetime.now(UTC)
    namespace = ref.namespace or "default"
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name=f"{ref.name}.", namespace=namespace),
        involved_object=client.V1ObjectReference(
            api_version=ref.api_version,
            kind=ref.kind,
            name=ref.name,
            namespace=ref.namespace,
            uid=ref.uid,
        ),
        reason=reason,
        message=message[:1024],
        type=kind,
        first_timestamp=now,
        last_timestamp=now,
        count=1,
        source=client.V1EventSource(component=COMPONENT),
        reporting_component=COMPONENT,
        reporting_instance=COMPONENT,
    )
    core.create_namespaced_event(namespace, event)
