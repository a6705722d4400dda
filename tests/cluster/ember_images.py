"""Ember's images for the local cluster: built by the one build path (`images.build`) on the
Debian base the harness makes, tagged `ember.local/<name>:dev`, exported as docker-archives for
the node's containerd.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from images.build import REPO, EmberImage, bud_argv, need_buildah
from tests.cluster.build import log
from tests.cluster.images import ensure_base_in_buildah, images_dir


def _image_id(ref: str) -> str:
    """The image `ref` names in buildah's store, or "" when there is none."""
    found = subprocess.run(
        ["buildah", "images", "--quiet", "--no-trunc", ref],
        capture_output=True,
        text=True,
        check=False,
    )
    return found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout else ""


def _drop_replaced(previous: str, current: str) -> None:
    """Remove the image a rebuild untagged. Every test session rebuilds from a changed tree,
    and each replaced image kept its own layers: 138 of them once filled 58 GB of this disk.
    Layers the new image or the build cache still use stay (buildah removes only the rest)."""
    if previous and previous != current:
        subprocess.run(["buildah", "rmi", previous], capture_output=True, check=False)


def build_image(image: EmberImage) -> Path:
    """Build one image for the local cluster (cached layers); export it as a docker-archive."""
    need_buildah()
    base = ensure_base_in_buildah()
    start = time.monotonic()
    slow = " (its first build compiles llama.cpp: minutes)" if image.name == "ember-runtime" else ""
    log(f"building {image.ref} from {image.dockerfile}{slow}")
    previous = _image_id(image.ref)
    subprocess.run(
        bud_argv(image, image.ref, base, None), cwd=REPO, check=True, stdout=subprocess.DEVNULL
    )
    _drop_replaced(previous, _image_id(image.ref))
    out = images_dir() / f"{image.name}.tar"
    out.unlink(missing_ok=True)
    subprocess.run(
        ["buildah", "push", "-q", image.ref, f"docker-archive:{out}:{image.ref}"],
        check=True,
        capture_output=True,
    )
    log(f"built {image.ref} in {time.monotonic() - start:.0f}s")
    return out
