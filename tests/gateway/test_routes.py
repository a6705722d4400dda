"""Routes from Kubernetes objects (pure), the static file, and the prompt text affinity hashes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.contract.thermal import DEFAULT_MAX_BATCH_SIZE
from ember_runtime.gateway.proxy import prefix_text
from ember_runtime.gateway.routes import (
    Backend,
    ModelRoute,
    build,
    dumps,
    load_static,
    loads,
    save_snapshot,
)


def deployment(name: str, model: str, created: str, **server: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
        "spec": {"model": {"name": model}, "server": server},
    }


def pod(name: str, instance: str, ip: str = "10.0.0.1", node: str = "n1", **kw: Any) -> Any:
    ready = kw.get("ready", True)
    meta: dict[str, Any] = {"name": name, "namespace": kw.get("ns", "ns")}
    meta["labels"] = {"ember.dev/instance": instance}
    if kw.get("deleting"):
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"nodeName": node},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_ready_replicas_of_the_site_with_the_deployments_port() -> None:
    pods = [
        pod("a-0", "a", "10.0.0.1"),
        pod("a-1", "a", "10.0.0.2", ready=False),
        pod("a-2", "a", "10.0.0.3", deleting=True),
        pod("a-3", "a", "10.0.0.4", node="elsewhere"),
        pod("a-4", "a", "fd00::5"),
        pod("x-0", "a", "10.0.0.6", ns="other"),  # same instance label, another namespace
    ]
    routes, conflicts = build([deployment("a", "m", "t1", port=9000)], pods, {}, frozenset({"n1"}))
    assert conflicts == []
    assert [b.url for b in routes["m"].backends] == [
        "http://10.0.0.1:9000",
        "http://[fd00::5]:9000",
    ]
    everywhere, _ = build([deployment("a", "m", "t1")], pods, {}, None)
    assert len(everywhere["m"].backends) == 3  # no site: a-3 too; default port 8080
    assert everywhere["m"].backends[0].url.endswith(":8080")


def test_the_older_deployment_keeps_a_shared_model_name() -> None:
    older, younger = (
        deployment("b", "m", "2026-01-01T00:00:01Z"),
        deployment("a", "m", "2026-01-01T00:00:02Z"),
    )
    routes, conflicts = build([younger, older], [], {})
    assert routes["m"].owner == "ns/b"
    assert [(c.model, c.kept, c.refused) for c in conflicts] == [("m", "ns/b", "ns/a")]


def test_a_model_whose_key_is_unread_is_not_served_open() -> None:
    keyed = deployment("a", "m", "t1", apiKeySecretRef={"name": "s", "key": "k"})
    assert build([keyed], [], {})[0] == {}
    routes, _ = build([keyed], [], {("ns", "s", "k"): "secret"})
    assert routes["m"].api_key == "secret"


def test_static_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k1\n")
    path = tmp_path / "routes.json"
    models = [{"name": "m", "apiKeyFile": str(key), "replicas": ["http://10.0.0.1:8080/"]}]
    path.write_text(json.dumps({"models": models}))
    route = load_static(path)["m"]
    assert route.api_key == "k1" and route.backends[0].url == "http://10.0.0.1:8080"
    path.write_text(json.dumps({"models": models * 2}))
    with pytest.raises(ValueError, match="listed twice"):
        load_static(path)


def test_prefix_text_of_each_request_kind() -> None:
    assert prefix_text({"prompt": "abc"}) == "abc"
    assert prefix_text({"prompt": ["first", "second"]}) == "first"
    assert prefix_text({"prompt": [1, 2, 3]}) == "1,2,3"
    assert prefix_text({"input": "embed me"}) == "embed me"
    chat = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "U"}]},
        ]
    }
    assert prefix_text(chat) == "system:S\nuser:U\n"
    assert prefix_text({"messages": "not a list"}) == ""
    assert prefix_text({"prompt": {"odd": 1}}) == ""


def test_a_snapshot_gives_back_the_routes_it_was_made_of(tmp_path: Path) -> None:
    routes = {
        "alpha": ModelRoute(
            "alpha", "ns/alpha", "k3y", (Backend("ns/a-0", "http://10.0.0.1:8080"),)
        ),
        "beta": ModelRoute("beta", "ns/beta", None, ()),
    }
    path = tmp_path / "routes.json"
    save_snapshot(path, dumps(routes))
    assert loads(path.read_bytes()) == routes
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="not a"):
        loads(b'{"version": "other", "models": []}')


def scaled(name: str, model: str, created: str, **spec: Any) -> dict[str, Any]:
    obj = deployment(name, model, created)
    obj["spec"].update(spec)
    return obj


def adapter(name: str) -> dict[str, Any]:
    return {"name": name, "path": f"{name}.gguf", "sha256": "0" * 64, "sizeBytes": 1}


def test_adapters_are_routed_to_their_bases_replicas() -> None:
    keyed = scaled("a", "base", "t1", adapters=[adapter("base-sql"), adapter("base-vision")])
    keyed["spec"]["server"] = {"apiKeySecretRef": {"name": "s", "key": "k"}}
    routes, conflicts = build([keyed], [pod("a-0", "a")], {("ns", "s", "k"): "secret"})
    assert conflicts == [] and sorted(routes) == ["base", "base-sql", "base-vision"]
    base = routes["base"]
    for name in ("base-sql", "base-vision"):
        assert routes[name].name == name
        assert (routes[name].owner, routes[name].api_key) == ("ns/a", "secret")
        assert routes[name].backends == base.backends and len(base.backends) == 1


def test_adapter_names_take_part_in_conflicts() -> None:
    older = scaled("b", "m", "2026-01-01T00:00:01Z", adapters=[adapter("shared")])
    younger = scaled("a", "shared", "2026-01-01T00:00:02Z", adapters=[adapter("m-lora")])
    routes, conflicts = build([younger, older], [], {})
    assert routes["shared"].owner == "ns/b"  # the older one's adapter keeps the name
    assert routes["m-lora"].owner == "ns/a"  # the younger one's other names are still served
    assert [(c.model, c.kept, c.refused) for c in conflicts] == [("shared", "ns/b", "ns/a")]


def test_scaling_and_what_the_scaler_reads_ride_on_the_route() -> None:
    pending = pod("z-0", "z", ip="")
    pending["status"] = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
    }
    objs = [
        scaled("z", "zeta", "t1", replicas=0, scaling={"maxReplicas": 3, "priority": 2}),
        scaled("y", "ypsilon", "t2", replicas=2, engine={"maxBatchSize": 6},
               scaling={"targetInFlight": 5}),
        scaled("p", "plain", "t3", engine={"maxBatchSize": 6}),
    ]  # fmt: skip
    routes, _ = build(objs, [pending], {})
    zeta, ypsilon, plain = routes["zeta"], routes["ypsilon"], routes["plain"]
    assert zeta.scaling is not None and zeta.scaling.max_replicas == 3
    assert (zeta.replicas, zeta.priority, zeta.backends, zeta.unschedulable) == (0, 2, (), True)
    # no targetInFlight: the engine's maxBatchSize, its default here
    assert zeta.target_in_flight == DEFAULT_MAX_BATCH_SIZE
    assert (ypsilon.replicas, ypsilon.target_in_flight, ypsilon.unschedulable) == (2, 5, False)
    assert plain.scaling is None and plain.target_in_flight == 6  # not scaled by the gateway
    # a pod merely Pending (pulling, prewarming) is not "does not fit"
    pending["status"]["conditions"][0]["reason"] = "SchedulerError"
    assert not build(objs, [pending], {})[0]["zeta"].unschedulable


def test_a_snapshot_keeps_scaling_but_not_live_pod_state(tmp_path: Path) -> None:
    pending = pod("z-0", "z", ip="")
    pending["status"] = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
    }
    objs = [scaled("z", "zeta", "t1", replicas=0, scaling={"idleSeconds": 60},
                   adapters=[adapter("zeta-a")])]  # fmt: skip
    routes, _ = build(objs, [pending], {})
    back = loads(dumps(routes))
    assert routes["zeta"].pods == 1
    assert back["zeta"] == dataclasses.replace(routes["zeta"], unschedulable=False, pods=0)
    assert back["zeta-a"].scaling is not None and back["zeta-a"].scaling.idle_seconds == 60
    assert json.loads(dumps(routes))["models"][1]["scaling"]["idleSeconds"] == 60  # readable


def test_a_scaled_models_running_replica_is_a_backend_before_it_is_ready() -> None:
    """A replica woken from zero: its runtime runs, the kubelet has not probed it Ready yet.
    For a scaled model it is a backend already (the gateway's own probe lets requests in once
    the runtime answers); for any other model, and once terminating, it is not."""

    def starting(name: str, instance: str, ip: str, **kw: Any) -> Any:
        p = pod(name, instance, ip, ready=False, **kw)
        p["status"]["containerStatuses"] = [
            {"name": "runtime", "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}
        ]
        return p

    lazy = scaled("z", "zeta", "t1", scaling={})
    plain = deployment("p", "plain", "t2")
    loading = pod("z-1", "z", "10.0.0.6", ready=False)  # its runtime not started yet
    pods = [starting("z-0", "z", "10.0.0.5"), loading, starting("p-0", "p", "10.0.0.7")]
    pods.append(starting("z-2", "z", "10.0.0.8", deleting=True))
    routes, _ = build([lazy, plain], pods, {})
    assert [b.key for b in routes["zeta"].backends] == ["ns/z-0"]
    assert routes["plain"].backends == ()
