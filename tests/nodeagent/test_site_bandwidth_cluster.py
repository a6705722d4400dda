"""maxBandwidth is the site's WAN use, on the real API server: two agents of one site, each
wanting a different file, download from the origin one at a time (the site's origin slot), so
the site's origin traffic stays at maxBandwidth instead of maxBandwidth per node."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Kube
from tests.nodeagent.origin import serve
from tests.nodeagent.site_support import (
    SiteWorld,
    claim_metadata,
    fetch_pod,
    model_spec,
    put_inference_deployment,
)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

SIZE = 4 << 20
FILES = [os.urandom(SIZE) for _ in range(2)]
RATE = 1_000_000  # bytes/s; each agent's bucket also allows a 1 MiB burst


@pytest.fixture
def world(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[SiteWorld]:
    with SiteWorld(kube, namespace, tmp_path) as world:
        world.add_nodes(["127.0.0.1"] * 2)
        yield world


def test_two_files_at_once_share_the_sites_bandwidth(world: SiteWorld, kube: Kube) -> None:
    shas = [hashlib.sha256(f).hexdigest() for f in FILES]
    with serve({"a.gguf": FILES[0], "b.gguf": FILES[1]}) as (base, origin):
        for node, name, sha in zip(world.nodes, ("a.gguf", "b.gguf"), shas, strict=True):
            # Each node's pod belongs to an InferenceDeployment of its own, wanting one file.
            model = model_spec([{"url": f"{base}/{name}", "sha256": sha, "sizeBytes": SIZE}])
            owner = f"bw-{name.removesuffix('.gguf')}"
            put_inference_deployment(kube, world.namespace, owner, model)
            pod: Any = fetch_pod(f"{node}-{uuid.uuid4().hex[:4]}", node, None)
            pod["metadata"].update(claim_metadata(owner, model))
            kube.core.create_namespaced_pod(world.namespace, pod)
            world.pods.append(pod["metadata"]["name"])
        world.start(
            str(kube.api.configuration.host),
            extra=["--lease_seconds=3", f"--origin_max_bytes_per_second={RATE}"],
        )
        world.wait(lambda: origin.bytes_sent > 0, 60, "the first origin bytes")
        first = time.monotonic()
        done = [a.cache for a in world.agents]
        world.wait(
            lambda: all(c.has(sha, SIZE) for c, sha in zip(done, shas, strict=True)),
            120,
            "both files",
        )
        took = time.monotonic() - first
        assert origin.bytes_sent == 2 * SIZE, world.logs()
    # One node at a time at RATE (after each node's 1 MiB burst). Two at once, each at RATE,
    # would take about half: (SIZE - burst) / RATE, about 3.1 s.
    floor = (2 * SIZE - 2 * (1 << 20)) / RATE
    assert took >= 0.95 * floor, (took, floor, world.logs())
