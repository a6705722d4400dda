"""`make e2e-kind`: the same flow as `make e2e`, on a two-node kind cluster.

Only what differs lives here; every step of the flow is tests/e2e/flow.py's. Everything kind
needs is made here with no registry (tests/e2e/kind_node.py): kind from the Go module proxy,
the node image, the control-plane images. Ember's images are the local cluster's (buildah on
the local Debian base, docker-archives) loaded with `kind load image-archive`; the model is
copied into the worker's filesystem. Where no Docker engine answers, Debian's dockerd is
started (tests/e2e/docker_host.py, with the capability shim on hosts that need it).

The kind cluster runs under /tmp/ember-cluster.lock, like the local cluster's tests: one
cluster test at a time on a shared machine.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from images.build import IMAGES, REGISTRY, TAG
from tests.cluster.ember_images import build_image
from tests.cluster.paths import bin_dir
from tests.e2e.docker_host import ensure_engine
from tests.e2e.flow import MODEL_FILE, REPO, SITE, SYSTEM_NS, Flow, Gateway, step, timed
from tests.e2e.kind_node import ensure_node_image, kind_binary

CLUSTER = "ember-e2e"
WORKER = f"{CLUSTER}-worker"
LOCK = Path("/tmp/ember-cluster.lock")


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


class KindTarget:
    def __init__(self, kind: Path, image: str) -> None:
        self.kind = str(kind)
        self.image = image
        self.kubeconfig = Path(tempfile.mkdtemp()) / "kubeconfig"

    def create(self) -> None:
        config = REPO / "tests" / "e2e" / "kind-config.yaml"
        self.delete()  # a cluster left by an interrupted run
        kubeconfig = str(self.kubeconfig)
        _run(self.kind, "create", "cluster", "--name", CLUSTER, "--image", self.image,
             "--config", str(config), "--kubeconfig", kubeconfig, "--wait", "180s")  # fmt: skip

    def delete(self) -> None:
        _run(self.kind, "delete", "cluster", "--name", CLUSTER)

    def load_images(self) -> dict[str, str]:
        for image in IMAGES:
            archive = build_image(image)
            # Ember runs on the worker only (the control plane keeps its NoSchedule taint): half
            # the copying of loading ~2 GB of archives into both nodes.
            with timed(f"kind load image-archive {archive.name} --nodes {WORKER}"):
                _run(self.kind, "load", "image-archive", str(archive), "--name", CLUSTER,
                     "--nodes", WORKER)  # fmt: skip
        return {"image.registry": REGISTRY, "image.tag": TAG, "image.pullPolicy": "Never"}

    def place_model(self, src: Path, dest_dir: Path) -> None:
        _run("docker", "exec", WORKER, "mkdir", "-p", str(dest_dir))
        _run("docker", "cp", str(src), f"{WORKER}:{dest_dir / MODEL_FILE}")
        _run("docker", "exec", WORKER, "chmod", "-R", "a+rX", str(dest_dir))

    def helm_values(self) -> list[str]:
        return []  # kube-proxy serves the API server's Service address in kind

    def node_name(self) -> str:
        return WORKER

    def node_run(self, argv: list[str]) -> int:
        return subprocess.run(["docker", "exec", WORKER, *argv], check=False).returncode


@contextmanager
def cluster_lock() -> Iterator[None]:
    if os.environ.get("EMBER_CLUSTER_LOCK_HELD") == "1":
        yield  # the caller (tests/e2e/test_kind_node.py under `flock`) serializes already
        return
    with LOCK.open("a") as lock:
        step(f"waiting for {LOCK} (one cluster test at a time)")
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run_flow(target: KindTarget) -> None:
    bins = bin_dir()
    flow = Flow(target, helm=str(bins / "helm"), kubectl=str(bins / "kubectl"))
    try:
        flow.prepare_node()
        gateway = Gateway("default", SITE)
        flow.install(flow.fake_node_values(), gateway)
        flow.wait_npu_capacity()
        flow.apply(flow.model_manifest("gemma", "default", npu=True))
        flow.wait_ready("gemma", "default")
        tokens: list[str] = []
        with flow.port_forward(gateway.service, SYSTEM_NS, 8080) as port:
            flow.wait_gateway(port, "gemma-3-270m")
            text = flow.chat(port, "Name one primary colour.", tokens.append)
        assert len([t for t in tokens if t]) > 3, f"not streamed: {tokens}"
        assert text.strip(), "empty completion"
        hot, cool = flow.heat_and_cool("gemma", "default")
        assert hot["BATCH"] == "4" and cool["BATCH"] == "8", (hot, cool)
        refused = flow.refused_calls()
        assert not refused, f"the chart's RBAC refused the operator: {refused}"
        pods = [f"pod/{p}" for p in flow.pods("gemma", "default")]
        flow.run_kubectl("delete", "infd", "gemma", "-n", "default", "--wait=true")
        flow.run_kubectl(
            "wait", "--for=delete", "-n", "default", *pods, "--timeout=120s", timeout=150
        )
        flow.uninstall()
        left = flow.leftovers(served=[gateway.namespace])
        assert not left, f"left after helm uninstall: {left}"
        step("e2e-kind passed")
    except Exception:
        print(flow.dump("default"), file=sys.stderr)
        raise


def main() -> int:
    with timed("Docker engine"):
        ensure_engine()
    with timed("kind, its node image and the control-plane images (cached)"):
        target = KindTarget(kind_binary(), ensure_node_image())
    with cluster_lock():
        with timed(f"kind create cluster {CLUSTER} (control plane + worker)"):
            target.create()
        try:
            run_flow(target)
        finally:
            if os.environ.get("EMBER_KIND_KEEP") != "1":
                with timed(f"kind delete cluster {CLUSTER}"):
                    target.delete()
    return 0


if __name__ == "__main__":
    sys.exit(main())
