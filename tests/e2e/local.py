"""The e2e target for the project's own local cluster (tests/cluster)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from images.build import IMAGES, REGISTRY, TAG
from tests.cluster.cluster import Cluster
from tests.cluster.control_plane import HOST_IP, NODE_NAME
from tests.cluster.ember_images import build_image
from tests.cluster.paths import bin_dir
from tests.e2e.flow import Flow, copy_model


class LocalTarget:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.kubeconfig = cluster.kubeconfig

    def load_images(self) -> dict[str, str]:
        for image in IMAGES:
            self.cluster.node.import_image(build_image(image))
        return {"image.registry": REGISTRY, "image.tag": TAG, "image.pullPolicy": "Never"}

    def place_model(self, src: Path, dest_dir: Path) -> None:
        copy_model(src, dest_dir)

    def helm_values(self) -> list[str]:
        # No kube-proxy here: pods reach the API server directly on the node's address.
        return [
            f"operator.apiServerOverride.host={HOST_IP}",
            f"operator.apiServerOverride.port={self.cluster.cp.eps.apiserver}",
        ]

    def node_name(self) -> str:
        return NODE_NAME

    def node_run(self, argv: list[str]) -> int:
        return subprocess.run(argv, check=False).returncode  # the node is this machine


def local_flow(cluster: Cluster) -> Flow:
    bins = bin_dir()
    return Flow(LocalTarget(cluster), helm=str(bins / "helm"), kubectl=str(bins / "kubectl"))
