"""Routes from Kubernetes objects (pure), the static file, and the prompt text affinity hashes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
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
