"""Build Ember's own images from images/*.Dockerfile and load them into the local node.

There is no Docker engine here, so the Dockerfiles are built with buildah (daemonless, from
Debian), on the Debian base image this package makes (`BASE_IMAGE` build arg), then exported as
docker-archives and imported into the node's containerd. buildah's layer cache keeps the slow
llama.cpp compile to the first build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.build import log
from tests.cluster.images import BASE_IMAGE, build_base, images_dir

REPO = Path(__file__).resolve().parents[2]
REGISTRY = "ember.local"
TAG = "dev"


@dataclass(frozen=True)
class EmberImage:
    name: str
    dockerfile: str

    @property
    def ref(self) -> str:
        return f"{REGISTRY}/{self.name}:{TAG}"


IMAGES = (
    EmberImage("ember-operator", "images/operator.Dockerfile"),
    EmberImage("ember-runtime", "images/runtime.Dockerfile"),
    EmberImage("ember-deviceplugin", "images/deviceplugin.Dockerfile"),
)


def _buildah(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", *args], check=True, capture_output=True, text=True)


def _ensure_base_in_buildah() -> None:
    present = subprocess.run(
        ["buildah", "images", "--format", "{{.Name}}:{{.Tag}}"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    if BASE_IMAGE not in present and f"localhost/{BASE_IMAGE}" not in present:
        _buildah("pull", "-q", f"docker-archive:{build_base()}")


def _ca_secret() -> list[str]:
    """This machine reaches PyPI through a TLS-intercepting proxy: hand pip its CA bundle."""
    bundle = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    return ["--secret", f"id=pip-ca,src={bundle}"] if bundle and Path(bundle).is_file() else []


def build_image(image: EmberImage) -> Path:
    """Build one image (cached layers) and export it as a docker-archive tarball."""
    if shutil.which("buildah") is None:
        raise SystemExit("buildah is required to build Ember's images (apt-get install buildah)")
    _ensure_base_in_buildah()
    start = time.monotonic()
    slow = " (its first build compiles llama.cpp: minutes)" if image.name == "ember-runtime" else ""
    log(f"building {image.ref} from {image.dockerfile}{slow}")
    subprocess.run(
        [
            "buildah",
            "bud",
            "--quiet",
            "--layers",
            "--network",
            "host",
            "--build-arg",
            f"BASE_IMAGE={BASE_IMAGE}",
            *_ca_secret(),
            "-f",
            image.dockerfile,
            "-t",
            image.ref,
            ".",
        ],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    out = images_dir() / f"{image.name}.tar"
    out.unlink(missing_ok=True)
    _buildah("push", "-q", image.ref, f"docker-archive:{out}:{image.ref}")
    log(f"built {image.ref} in {time.monotonic() - start:.0f}s")
    return out


def build_all() -> dict[str, Path]:
    return {image.ref: build_image(image) for image in IMAGES}
