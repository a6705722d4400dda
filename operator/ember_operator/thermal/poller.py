"""Report path: the operator polls each ready replica's `GET /admin/state` and pushes
`PUT /admin/batch` when the policy's value differs from the replica's current one.

Why polling (and not the runtime patching its pod's annotations):
- API-server load: zero writes per sample. Annotations at 1 sample/s would be 1,000 writes/s at
  1,000 pods (plus 1,000 watch events/s fanned out to every pod watcher, the operator included);
  a kube-apiserver on an edge control plane handles a few hundred writes/s in total.
- Latency: ≤ one poll period (1 s) from the runtime's sample to the operator's decision, and the
  push is in the same round trip; no watch propagation or status-patch conflicts in between.
- RBAC: none beyond what the operator has (pods list/watch for pod IPs). The runtime would
  otherwise need pods/patch on its own pod — a token in every serving pod that can patch pods.
- Cost: one small GET per replica per second; with 64 in flight and ~5 ms per request, 1,000
  replicas take ~80 ms of a 1 s period. The operator needs network reach to pod IPs (in-cluster,
  it has it; a NetworkPolicy must allow operator → runtime port).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from ember_operator.thermal.policy import ThermalLimits, max_batch

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 64
DEFAULT_TIMEOUT_SECONDS = 0.8  # below the 1 s period, so one slow replica never delays a tick


@dataclass(frozen=True)
class Replica:
    pod: str
    node: str | None
    url: str  # http://<pod IP>:<server port>
    api_key: str | None = None


@dataclass(frozen=True)
class Observation:
    pod: str
    node: str | None
    temperature_celsius: float | None  # the hottest sensor the runtime reports
    max_batch_size: int | None  # what the replica runs with after this tick
    changed_from: int | None = None  # the previous value when this tick pushed a new one
    error: str | None = None

    def as_status(self) -> dict[str, Any]:
        """The `replicaStatuses[]` fields this loop owns (whole degrees: fewer status writes)."""
        out: dict[str, Any] = {}
        if self.temperature_celsius is not None:
            out["temperatureCelsius"] = round(self.temperature_celsius)
        if self.max_batch_size is not None:
            out["maxBatchSize"] = self.max_batch_size
        return out


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def replicas_from_pods(
    pods: Iterable[Mapping[str, Any]], port: int, api_key: str | None = None
) -> list[Replica]:
    """Ready, not-terminating pods with an IP (raw pod dicts, as Kopf indexes hold them)."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip = status.get("podIP")
        if not ip or meta.get("deletionTimestamp") or not _ready(pod):
            continue
        host = f"[{ip}]" if ":" in ip else ip
        node = (pod.get("spec") or {}).get("nodeName")
        out.append(Replica(meta["name"], node, f"http://{host}:{port}", api_key))
    return sorted(out, key=lambda r: r.pod)


def hottest_of(state: Mapping[str, Any]) -> float | None:
    temps = state.get("temperatures") or {}
    values = [float(v) for v in temps.values() if isinstance(v, int | float)]
    return max(values) if values else None


class ReplicaPoller:
    """One aiohttp session, bounded concurrency; `poll()` runs one tick over many replicas."""

    def __init__(
        self,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self._limit = asyncio.Semaphore(concurrency)
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session = session
        self._owned = session is None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # A small pool per host is plenty: one request in flight per replica per tick.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=2)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> ReplicaPoller:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    @staticmethod
    def _headers(replica: Replica) -> dict[str, str]:
        return {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}

    async def _json(self, method: str, replica: Replica, path: str, body: Any = None) -> Any:
        async with self._http().request(
            method, replica.url + path, json=body, headers=self._headers(replica)
        ) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {text}")
            return await resp.json()

    async def _one(self, replica: Replica, limits: ThermalLimits) -> Observation:
        async with self._limit:
            try:
                state = await self._json("GET", replica, "/admin/state")
                temp, current = hottest_of(state), int(state["maxBatchSize"])
                wanted = max_batch(temp, limits, current)
                if wanted == current:
                    return Observation(replica.pod, replica.node, temp, current)
                body = {"maxBatchSize": wanted}
                after = await self._json("PUT", replica, "/admin/batch", body)
                applied = int(after["maxBatchSize"])
                log.info("%s: %.1f °C, batch %d -> %d", replica.pod, temp or 0.0, current, applied)
                return Observation(replica.pod, replica.node, temp, applied, changed_from=current)
            except (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError, ValueError) as exc:
                # An unreachable replica is not an error of the loop: report it, keep the others.
                detail = f"{type(exc).__name__}: {exc}"
                return Observation(replica.pod, replica.node, None, None, error=detail)

    async def poll(self, replicas: Sequence[Replica], limits: ThermalLimits) -> list[Observation]:
        """Read every replica and push the policy's batch size where it differs; never raises."""
        return list(await asyncio.gather(*(self._one(r, limits) for r in replicas)))
