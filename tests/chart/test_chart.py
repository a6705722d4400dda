"""The Helm chart: lint, render over a table of value sets, and check what every user relies on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.build import ensure_binaries

CHART = Path(__file__).resolve().parents[2] / "charts" / "ember"
# `helm template` assumes Kubernetes 1.20 offline; render for the release we build and test.
KUBE = ("--kube-version", "1.36.3")
VALUE_SETS = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))


@pytest.fixture(scope="module")
def helm() -> str:
    return str(ensure_binaries() / "helm")


NAMESPACE = "ember-system"


def render(helm: str, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [helm, "template", "ember", str(CHART), "--namespace", NAMESPACE, *KUBE, *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", [None, *VALUE_SETS])
def test_lint(helm: str, values: str | None) -> None:
    args = ["-f", str(CHART / "ci" / values)] if values else []
    proc = subprocess.run(
        [helm, "lint", "--strict", str(CHART), *args], check=False, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("values", [None, *VALUE_SETS])
def test_every_container_is_locked_down(helm: str, values: str | None) -> None:
    docs = render(helm, *(["-f", str(CHART / "ci" / values)] if values else []))
    workloads = by_kind(docs, "Deployment") + by_kind(docs, "DaemonSet")
    assert workloads
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "add" not in sc["capabilities"]
            assert container["resources"]["limits"]["memory"]


def test_operator_runs_as_non_root_with_probes(helm: str) -> None:
    (operator,) = by_kind(render(helm), "Deployment")
    pod = operator["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["containers"][0]["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--standalone" in pod["containers"][0]["args"]
    # Service env links would clash with the EMBER_OPERATOR_* settings (metrics Service).
    assert pod["enableServiceLinks"] is False


def test_two_replicas_peer_instead_of_standalone(helm: str) -> None:
    (operator,) = by_kind(render(helm, "-f", str(CHART / "ci" / "ha-values.yaml")), "Deployment")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert operator["spec"]["replicas"] == 2
    assert "--standalone" not in args
    assert {"--namespace=edge-a", "--namespace=edge-b"} <= set(args)


def _roles(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"].removeprefix("ember-"): r for r in by_kind(docs, "ClusterRole")}


def test_rbac_has_no_wildcards_and_no_secrets(helm: str) -> None:
    docs = render(helm, "-f", str(CHART / "ci" / "ha-values.yaml"))
    roles = _roles(docs)
    assert sorted(roles) == ["nodeagent", "operator", "runtime"]
    for role in roles.values():
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], rule
            assert "secrets" not in rule["resources"]
    # The namespaced Roles, both the node agent's in the release's own namespace: origin
    # credentials read by name (no list, no watch) for spec.model.source.http.secretRef, and
    # the site's fetch Leases (read by name, created, renewed; never listed or deleted).
    roles_ns = {r["metadata"]["name"]: r for r in by_kind(docs, "Role")}
    assert sorted(roles_ns) == ["ember-nodeagent-leases", "ember-nodeagent-secrets"]
    assert all(r["metadata"]["namespace"] == NAMESPACE for r in roles_ns.values())
    assert roles_ns["ember-nodeagent-secrets"]["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}
    ]
    assert roles_ns["ember-nodeagent-leases"]["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update"],
        }
    ]
    for binding in by_kind(docs, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "ember-nodeagent", "namespace": NAMESPACE}
        ]


def _rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


# The operator's calls, one rule each (charts/ember/templates/rbac.yaml says which code makes
# them); tests/operator/test_rbac_cluster.py proves on the real API server that they suffice.
OPERATOR_RULES = [
    _rule("ember.dev", ["inferencedeployments"], ["list", "watch", "patch"]),
    _rule("ember.dev", ["inferencedeployments/status"], ["patch"]),
    _rule("apps", ["deployments"], ["list", "watch", "create", "patch", "delete"]),
    _rule("", ["configmaps"], ["list", "watch", "create", "patch", "delete"]),
    _rule("", ["services"], ["list", "watch", "create", "patch"]),
    _rule("policy", ["poddisruptionbudgets"], ["list", "watch", "create", "patch", "delete"]),
    _rule("", ["pods"], ["list", "watch"]),
    _rule("", ["serviceaccounts"], ["create", "patch"]),
    _rule("rbac.authorization.k8s.io", ["rolebindings"], ["create", "patch"]),
    {
        **_rule("rbac.authorization.k8s.io", ["clusterroles"], ["bind"]),
        "resourceNames": ["ember-runtime"],
    },
    _rule("", ["pods/eviction"], ["create"]),
    _rule("", ["nodes"], ["get", "list", "watch", "patch"]),
    _rule("", ["events"], ["list", "watch"]),
    _rule("", ["events"], ["create"]),
    _rule("apiextensions.k8s.io", ["customresourcedefinitions"], ["list", "watch"]),
]
NAMESPACES_RULE = _rule("", ["namespaces"], ["list", "watch"])


def _peering(plural: str) -> dict[str, Any]:
    return _rule("kopf.dev", [plural], ["list", "watch", "create", "patch"])


@pytest.mark.parametrize(
    ("values", "extra"),
    [
        # One replica, cluster-wide: --standalone (no peering), no namespace matching.
        ((), []),
        (("--set", "operator.replicas=2"), [_peering("clusterkopfpeerings")]),
        (("--set", "operator.watchNamespaces={a}"), [NAMESPACES_RULE]),
        (("-f", str(CHART / "ci" / "ha-values.yaml")), [NAMESPACES_RULE, _peering("kopfpeerings")]),
    ],
)
def test_operator_role_grants_exactly_what_the_code_calls(
    helm: str, values: tuple[str, ...], extra: list[dict[str, Any]]
) -> None:
    roles = _roles(render(helm, *values))
    assert roles["operator"]["rules"] == OPERATOR_RULES + extra
    verbs = {v for rule in roles["operator"]["rules"] for v in rule["verbs"]}
    assert "update" not in verbs  # every write is a PATCH (apply or merge patch) or a POST
    assert "deletecollection" not in verbs


def test_runtime_and_node_agent_may_patch_only_their_status(helm: str) -> None:
    docs = render(helm)
    roles = _roles(docs)
    assert roles["runtime"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]}
    ]
    assert roles["nodeagent"]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
        # The pods on its node (by field selector), for the http sources it fetches.
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        # What those pods' files are: their InferenceDeployment's spec, never the pod's word.
        {"apiGroups": ["ember.dev"], "resources": ["inferencedeployments"], "verbs": ["get"]},
        # Download progress on those pods: narrowed by the -own-pods policy.
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        # Its own Node's cache labels (and, site sharing, its site's Nodes and its own
        # annotations): narrowed by the -own-metadata policy below.
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
    ]
    # The operator binds exactly the runtime's role, and no other.
    binds = [r for r in roles["operator"]["rules"] if "bind" in r["verbs"]]
    assert binds == [
        {
            "apiGroups": ["rbac.authorization.k8s.io"],
            "resources": ["clusterroles"],
            "verbs": ["bind"],
            "resourceNames": ["ember-runtime"],
        }
    ]
    policies = {p["metadata"]["name"] for p in by_kind(docs, "ValidatingAdmissionPolicy")}
    bindings = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert policies == {
        "ember-runtime-own-pod",
        "ember-model-hostpath",
        "ember-nodeagent-own-pods",
        "ember-nodeagent-own-node",
        "ember-nodeagent-own-metadata",
        "ember-nodeagent-own-leases",
    }
    assert {b["spec"]["policyName"] for b in bindings} == policies
    assert all(b["spec"]["validationActions"] == ["Deny"] for b in bindings)


def test_device_plugin_daemonset_is_node_critical_and_scoped(helm: str) -> None:
    (ds,) = [
        d for d in by_kind(render(helm), "DaemonSet") if "deviceplugin" in d["metadata"]["name"]
    ]
    pod = ds["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] == {"ember.dev/npu": "true"}
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"]}
    assert host_paths == {
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
        "/dev",
        "/var/lib/ember/deviceplugin",
    }
    # Not over /dev: that would hide the kubelet's /dev/termination-log mount (runc refuses).
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["dev"]["mountPath"] == "/host/dev" and mounts["dev"]["readOnly"] is True
    # Only the kubelet's socket dir (its socket) and the checkpoint's dir are written.
    writable = {m["name"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"device-plugins", "state"}
    # uid 0 for the kubelet's root-owned sockets (docs/privileges.md), but no API token at all.
    assert pod["securityContext"]["runAsUser"] == 0
    assert pod["automountServiceAccountToken"] is False
    env = {e["name"]: e["value"] for e in container["env"]}
    assert (env["EMBER_DP_DEV_ROOT"], env["EMBER_DP_HOST_DEV_ROOT"]) == ("/host/dev", "/dev")


def test_optional_parts_follow_values(helm: str) -> None:
    minimal = render(helm, "-f", str(CHART / "ci" / "minimal-values.yaml"))
    assert not by_kind(minimal, "DaemonSet") and not by_kind(minimal, "Service")
    assert by_kind(render(helm, "-f", str(CHART / "ci" / "ha-values.yaml")), "ServiceMonitor")


def _operator_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (operator,) = by_kind(docs, "Deployment")
    container = operator["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_gpu_runtime_image_reaches_the_operator_only_when_set(helm: str) -> None:
    assert "EMBER_OPERATOR_RUNTIME_GPU_IMAGE" not in _operator_env(render(helm))
    docs = render(
        helm,
        "--set", "image.registry=example.test/ember",
        "--set", "image.tag=1.2",
        "--set", "operator.runtimeGpuImage=ember-runtime-cuda",
    )  # fmt: skip
    env = _operator_env(docs)
    assert env["EMBER_OPERATOR_RUNTIME_GPU_IMAGE"] == "example.test/ember/ember-runtime-cuda:1.2"
    assert env["EMBER_OPERATOR_RUNTIME_IMAGE"] == "example.test/ember/ember-runtime:1.2"


def test_crds_are_the_generated_ones() -> None:
    root = CHART.parents[1] / "crds"
    for crd in root.glob("*.yaml"):
        assert (CHART / "crds" / crd.name).read_text() == crd.read_text()


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("operator.replicas=-1", "minimum"),
        ("image.pullPolicy=Sometimes", "must be one of"),
        ("devicePlugin.contextsPerDevice=0", "minimum"),
        ("operator.typo=1", "additional properties"),
    ],
)
def test_schema_rejects_bad_values(helm: str, flag: str, message: str) -> None:
    proc = subprocess.run(
        [helm, "template", "ember", str(CHART), *KUBE, "--set", flag],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert message in proc.stderr.lower(), proc.stderr


def _images(pod: dict[str, Any]) -> set[str]:
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    return {c["image"] for c in containers}


def _pushed_refs(registry: str) -> set[str]:
    """What `make push REGISTRY=<registry>` pushes (its commands, printed, not run)."""
    out = subprocess.run(
        ["make", "-s", "push", f"REGISTRY={registry}", "DRY_RUN=1"],
        cwd=CHART.parents[1],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {word.removeprefix("docker://") for word in out.split() if word.startswith("docker://")}


def test_every_image_comes_from_the_registry_make_push_fills(helm: str) -> None:
    """The quick start on your own cluster: `make push REGISTRY=R` then `helm install --set
    image.registry=R`. Every image a pod pulls — the operator, the device plugin, the node
    agent, the site gateway, and the runtime + prewarm images the operator renders into
    InferenceDeployment pods — must be one that push put there (else ImagePullBackOff)."""
    from ember_operator import render as operator_render
    from ember_operator.api.models import parse_spec
    from ember_operator.settings import OperatorSettings

    from tests.operator.specs import manifest, rendered

    registry = "example.test/ember"
    pushed = _pushed_refs(registry)
    assert len(pushed) == 4 and all(ref.startswith(f"{registry}/ember-") for ref in pushed)

    docs = render(helm, "--set", f"image.registry={registry}", "--set", "gateway.enabled=true")
    workloads = by_kind(docs, "Deployment") + by_kind(docs, "DaemonSet")
    pulled = set().union(*(_images(w["spec"]["template"]["spec"]) for w in workloads))
    (operator,) = [
        d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "ember-operator"
    ]
    env = {
        e["name"]: e.get("value")
        for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    settings = OperatorSettings(runtime_image=env["EMBER_OPERATOR_RUNTIME_IMAGE"])
    spec = parse_spec(manifest()["spec"])
    owner = operator_render.Owner(name="demo", namespace="ns", uid="u-1")
    children = rendered(owner, spec, settings)
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert len(pod["initContainers"]) >= 1  # prewarm pulls the runtime image too
    pulled |= _images(pod)
    assert pulled <= pushed, f"pulled but never pushed: {sorted(pulled - pushed)}"
    assert pulled == pushed  # and every pushed image is used by the chart


def test_node_agent_cache_is_its_own_and_the_operator_mounts_the_same_path(helm: str) -> None:
    """The agent writes the cache hostPath; the operator renders prewarm's read-only mount of
    the same directory; the only root in the chart's agent is the init container that hands the
    directory to the agent's uid, with CHOWN and FOWNER and nothing else."""
    docs = render(helm, "--set", "nodeAgent.cacheRoot=/srv/ember-cache")
    (agent,) = [d for d in by_kind(docs, "DaemonSet") if "nodeagent" in d["metadata"]["name"]]
    pod = agent["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cache"]["hostPath"] == {"path": "/srv/ember-cache", "type": "DirectoryOrCreate"}
    (init,) = pod["initContainers"]
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert init["command"][-1] == str(pod["securityContext"]["runAsUser"])
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["EMBER_NODEAGENT_CACHE_ROOT"]["value"] == "/cache"
    assert env["EMBER_NODEAGENT_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.namespace"
    )
    (operator,) = by_kind(docs, "Deployment")
    op_env = {
        e["name"]: e.get("value")
        for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert op_env["EMBER_OPERATOR_NODE_CACHE_ROOT"] == "/srv/ember-cache"


def test_node_agent_metrics_port(helm: str) -> None:
    """The agent's /metrics (origin and peer bytes): a named containerPort and the setting that
    makes the agent serve it; 0 renders neither."""

    def agent_container(*args: str) -> dict[str, Any]:
        docs = render(helm, *args)
        (agent,) = [d for d in by_kind(docs, "DaemonSet") if "nodeagent" in d["metadata"]["name"]]
        (container,) = agent["spec"]["template"]["spec"]["containers"]
        return dict(container)

    container = agent_container("--set", "nodeAgent.metricsPort=9555")
    assert {"name": "metrics", "containerPort": 9555, "protocol": "TCP"} in container["ports"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["EMBER_NODEAGENT_METRICS_PORT"] == "9555"
    off = agent_container(
        "--set", "nodeAgent.metricsPort=0", "--set", "nodeAgent.siteSharing.enabled=false"
    )
    assert "ports" not in off
    assert "EMBER_NODEAGENT_METRICS_PORT" not in {e["name"] for e in off["env"]}


def test_site_sharing_renders_peer_port_and_limits(helm: str) -> None:
    """On by default: the agent on the host network with its peer port, the site settings and
    maxBandwidth as its environment, and no shared peer key anywhere (each agent makes its
    own); off, none of it (no hostNetwork, no Lease Role, no site Nodes: only its own cache
    labels)."""
    docs = render(
        helm,
        "--set",
        "nodeAgent.maxBandwidth=2500000",
        "--set-json",
        'nodeAgent.downloadWindows=["22:00-06:00"]',
    )
    (agent,) = [d for d in by_kind(docs, "DaemonSet") if "nodeagent" in d["metadata"]["name"]]
    pod = agent["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    (container,) = pod["containers"]
    assert container["ports"] == [
        {"name": "peer", "containerPort": 7431, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9403, "protocol": "TCP"},
    ]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["EMBER_NODEAGENT_SITE_SHARING"] == "true"
    assert env["EMBER_NODEAGENT_SITE_LABEL"] == "node-restriction.kubernetes.io/ember-site"
    assert env["EMBER_NODEAGENT_PEER_PORT"] == "7431"
    assert env["EMBER_NODEAGENT_ORIGIN_WAIT_SECONDS"] == "600"
    assert env["EMBER_NODEAGENT_ORIGIN_MAX_BYTES_PER_SECOND"] == "2500000"
    assert json.loads(env["EMBER_NODEAGENT_ORIGIN_WINDOWS"]) == ["22:00-06:00"]
    assert "EMBER_NODEAGENT_PEER_KEY_FILE" not in env
    assert by_kind(docs, "Secret") == []  # no fleet key: nothing that opens every node
    assert "peer-key" not in {v["name"] for v in pod["volumes"]}
    # The Lease policy's node -> site map, from nodeSites (and the nodes, at install).
    mapped = render(helm, "--set-json", 'nodeAgent.siteSharing.nodeSites={"n1":"Plant_7.North"}')
    (policy,) = [
        p
        for p in by_kind(mapped, "ValidatingAdmissionPolicy")
        if p["metadata"]["name"] == "ember-nodeagent-own-leases"
    ]
    (sites,) = [v for v in policy["spec"]["variables"] if v["name"] == "sites"]
    assert json.loads(sites["expression"]) == {"n1": "plant-7-north"}  # as lease_name spells it

    off = render(helm, "--set", "nodeAgent.siteSharing.enabled=false")
    (agent,) = [d for d in by_kind(off, "DaemonSet") if "nodeagent" in d["metadata"]["name"]]
    assert "hostNetwork" not in agent["spec"]["template"]["spec"]
    assert [r["metadata"]["name"] for r in by_kind(off, "Role")] == ["ember-nodeagent-secrets"]
    rules = _roles(off)["nodeagent"]["rules"]
    # Its own Node still: cache labels (get, patch) and the stage requests on it (a watch of
    # that one Node, by field selector; RBAC cannot narrow list/watch to a name it does not know).
    assert [r["verbs"] for r in rules if "nodes" in r["resources"]] == [
        ["get", "list", "watch", "patch"]
    ]
    policies = {p["metadata"]["name"] for p in by_kind(off, "ValidatingAdmissionPolicy")}
    assert policies == {
        "ember-runtime-own-pod",
        "ember-model-hostpath",
        "ember-nodeagent-own-pods",
        "ember-nodeagent-own-node",
        "ember-nodeagent-own-metadata",
    }


def test_node_agent_thermal_defaults_are_the_contracts(helm: str) -> None:
    """Ember has one set of thermal defaults (ember_runtime.contract.thermal.DEFAULTS); the CRD
    and the node agent read it, and the chart's values (which cannot import it) must agree, down
    to the env the agent's container gets."""
    from ember_runtime.contract.thermal import DEFAULTS

    values = yaml.safe_load((CHART / "values.yaml").read_text())["nodeAgent"]
    want = {
        "throttleCelsius": DEFAULTS.throttle_celsius,
        "criticalCelsius": DEFAULTS.critical_celsius,
        "hysteresisCelsius": DEFAULTS.hysteresis_celsius,
    }
    assert {k: float(values[k]) for k in want} == want
    agent = next(d for d in by_kind(render(helm), "DaemonSet") if "agent" in d["metadata"]["name"])
    env = {
        e["name"]: e.get("value") for e in agent["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    for key, value in want.items():
        name = "EMBER_NODEAGENT_" + "".join(f"_{c}" if c.isupper() else c.upper() for c in key)
        assert float(env[name]) == value, name
