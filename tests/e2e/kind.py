"""`make e2e-kind`: the same flow as `make e2e`, on a kind cluster (needs Docker and kind).

Only what differs lives here: images are built with `docker build` and loaded with
`kind load`, and the model is copied into the kind node's filesystem. It cannot run on the
project's own CI machine (no Docker engine there); every other step is tests/e2e/flow.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from images.build import IMAGES, REGISTRY, TAG
from tests.e2e.flow import MODEL_FILE, REPO, SITE, SYSTEM_NS, Flow, Gateway, step, timed

CLUSTER = "ember-e2e"
NODE = f"{CLUSTER}-control-plane"


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


class KindTarget:
    def __init__(self) -> None:
        self.kubeconfig = Path(tempfile.mkdtemp()) / "kubeconfig"

    def create(self) -> None:
        config = REPO / "tests" / "e2e" / "kind-config.yaml"
        _run(
            "kind",
            "create",
            "cluster",
            "--name",
            CLUSTER,
            "--config",
            str(config),
            "--kubeconfig",
            str(self.kubeconfig),
            "--wait",
            "120s",
        )

    def load_images(self) -> dict[str, str]:
        for image in IMAGES:
            _run("docker", "build", "-f", str(REPO / image.dockerfile), "-t", image.ref, str(REPO))
            _run("kind", "load", "docker-image", image.ref, "--name", CLUSTER)
        return {"image.registry": REGISTRY, "image.tag": TAG, "image.pullPolicy": "Never"}

    def place_model(self, src: Path, dest_dir: Path) -> None:
        _run("docker", "exec", NODE, "mkdir", "-p", str(dest_dir))
        _run("docker", "cp", str(src), f"{NODE}:{dest_dir / MODEL_FILE}")
        _run("docker", "exec", NODE, "chmod", "-R", "a+rX", str(dest_dir))

    def helm_values(self) -> list[str]:
        return []

    def node_name(self) -> str:
        return NODE

    def node_run(self, argv: list[str]) -> int:
        return subprocess.run(["docker", "exec", NODE, *argv], check=False).returncode


def main() -> int:
    for tool in ("docker", "kind", "helm", "kubectl"):
        if shutil.which(tool) is None:
            print(f"make e2e-kind needs {tool} on PATH", file=sys.stderr)
            return 2
    target = KindTarget()
    with timed(f"kind create cluster {CLUSTER}"):
        target.create()
    flow = Flow(target, helm="helm", kubectl="kubectl")
    try:
        flow.prepare_node()
        gateway = Gateway("default", SITE)
        flow.install(flow.fake_node_values(), gateway)
        flow.wait_npu_capacity()
        flow.apply(flow.model_manifest("gemma", "default", npu=True))
        flow.wait_ready("gemma", "default")
        with flow.port_forward(gateway.service, SYSTEM_NS, 8080) as port:
            flow.wait_gateway(port, "gemma-3-270m")
            text = flow.chat(port, "Name one primary colour.", lambda t: None)
        assert text.strip(), "empty completion"
        flow.heat_and_cool("gemma", "default")
        flow.uninstall()
        step("e2e-kind passed")
        return 0
    except Exception:
        print(flow.dump("default"), file=sys.stderr)
        raise
    finally:
        _run("kind", "delete", "cluster", "--name", CLUSTER)


if __name__ == "__main__":
    sys.exit(main())
