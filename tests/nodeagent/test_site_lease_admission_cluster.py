"""Issue 34, hole 5, on the real API server: a node agent writes only its own site's fetch
Leases. The chart's policy reads which site each node is in from its node -> site map (kept
by the chart or an operator from a node-restriction.kubernetes.io/ label, which no kubelet
can set on itself); tokens are made exactly as the agents' are (bound to a pod on the node),
no agent runs."""

from __future__ import annotations

import itertools
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.nodeagent.site import lease_name

from tests.conftest import Kube
from tests.nodeagent.site_support import SiteWorld
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

SHA = "ab" * 32


@pytest.fixture
def world(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[SiteWorld]:
    with SiteWorld(kube, namespace, tmp_path) as world:
        yield world


def _client(world: SiteWorld, kube: Kube, node: str) -> httpx.Client:
    sa = world._token(node)
    return httpx.Client(
        base_url=str(kube.api.configuration.host),
        verify=ssl.create_default_context(cafile=str(sa / "ca.crt")),
        headers={"Authorization": f"Bearer {(sa / 'token').read_text()}"},
        timeout=10,
    )


def _lease(name: str, holder: str, old: dict[str, Any] | None = None) -> dict[str, Any]:
    body = old or {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name},
    }
    body["spec"] = {"holderIdentity": holder, "leaseDurationSeconds": 5}
    return body


def test_an_agent_of_one_site_cannot_take_or_fail_another_sites_lease(
    world: SiteWorld, kube: Kube
) -> None:
    """Site B's name extends site A's (`<A>-b`): a prefix check alone would hand B's Leases
    to A's nodes."""
    site_a, site_b = world.site, f"{world.site}-b"
    a0, a1 = world.add_nodes(["127.0.0.1"] * 2, site_a)
    (b0,) = world.add_nodes(["127.0.0.1"], site_b)[2:]
    world.want(None)  # a pod per node: what each agent's token is bound to
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{world.namespace}/leases"
    theirs, ours = lease_name(site_b, SHA), lease_name(site_a, SHA)
    with (
        _client(world, kube, a0) as agent_a0,
        _client(world, kube, a1) as agent_a1,
        _client(world, kube, b0) as agent_b0,
    ):
        # Site B's agent starts its download under B's Lease (once the policy with the map
        # naming every node has loaded: until then it is refused).
        _wait_for_policy(agent_b0, leases, b0)
        created = poll(
            lambda: agent_b0.post(leases, json=_lease(theirs, b0)),
            30,
            0.5,
            until=lambda resp: resp.status_code == 201,
        )
        assert created.status_code == 201, created.text
        held = agent_a0.get(f"{leases}/{theirs}").json()

        # A's agent takes it over (as if expired), or marks it failed: both refused.
        took = agent_a0.put(f"{leases}/{theirs}", json=_lease(theirs, a0, dict(held)))
        assert took.status_code == 403 and "own site" in took.text, took.text
        failed = dict(held)
        failed["metadata"] = {
            **held["metadata"],
            "annotations": {"ember.dev/failed": "ChecksumMismatch: x"},
        }
        assert agent_a0.put(f"{leases}/{theirs}", json=failed).status_code == 403
        # Nor can it create B's Lease for another file first (and so block B's download).
        other = lease_name(site_b, "cd" * 32)
        assert agent_a0.post(leases, json=_lease(other, a0)).status_code == 403
        # Nor a name of its own site's form with anything but a short digest after it.
        bogus = agent_a0.post(leases, json=_lease(f"{ours}-x", a0))
        assert bogus.status_code == 403
        after = agent_b0.get(f"{leases}/{theirs}").json()
        assert after["spec"]["holderIdentity"] == b0
        assert "ember.dev/failed" not in (after["metadata"].get("annotations") or {})

        # Its own site's Lease works: created by a0, taken over by a1 (same site).
        assert agent_a0.post(leases, json=_lease(ours, a0)).status_code == 201
        mine = agent_a1.get(f"{leases}/{ours}").json()
        assert agent_a1.put(f"{leases}/{ours}", json=_lease(ours, a1, mine)).status_code == 200


def _wait_for_policy(http: httpx.Client, leases: str, node: str) -> None:
    """A fresh policy takes a moment to load: wait until it refuses a Lease in another
    node's name (which the policy refuses whatever the map says)."""
    probes = itertools.count()  # a new Lease each time

    def probe() -> httpx.Response:
        return http.post(
            leases, json=_lease(f"ember-fetch-probe-{next(probes):016x}", f"not-{node}")
        )

    refused = poll(probe, 30, 0.5, until=lambda resp: resp.status_code == 403)
    assert refused.status_code == 403, (
        f"the Lease policy never applied: {refused.status_code} {refused.text}"
    )


def test_a_node_missing_from_the_map_gets_no_lease(world: SiteWorld, kube: Kube) -> None:
    """A node the map does not name (added after the last upgrade, say) is refused, not
    let through: it fetches as a partitioned node does until the map names it."""
    (a0,) = world.add_nodes(["127.0.0.1"], map_sites=False)
    world.map_sites({f"{a0}-twin": world.site})  # the map names another node, not a0
    world.want(None)
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{world.namespace}/leases"
    with _client(world, kube, a0) as agent:
        _wait_for_policy(agent, leases, a0)
        refused = agent.post(leases, json=_lease(lease_name(world.site, SHA), a0))
        assert refused.status_code == 403 and "own site" in refused.text, refused.text
