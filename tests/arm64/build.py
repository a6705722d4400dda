"""Ember's images for linux/arm64, built on this x86 host without compiling under emulation.

- the base: `debootstrap --arch arm64` (tests.cluster.images), no registry;
- the runtime's llama.cpp: cross-compiled by Debian's aarch64 toolchain (images/llama_build.py);
- everything else: aarch64 wheels from PyPI, installed by the image's own pip under
  qemu-user-static (binfmt), through the one build path `images.build.bud_argv`.

Tagged `ember.local/ember-<name>:dev-arm64`; buildah's layer cache makes a rebuild of an
unchanged tree take seconds.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

from images.build import IMAGES, REGISTRY, REPO, EmberImage, bud_argv, stage_cross_wheel
from tests.cluster.images import base_tar, ensure_base_in_buildah

ARCH = "arm64"
PLATFORM = f"linux/{ARCH}"
TAG = f"dev-{ARCH}"
T = TypeVar("T")
P = ParamSpec("P")


@dataclass
class Timings:
    """Each step's wall time in seconds and a note on what it did, in order."""

    steps: list[dict[str, object]] = field(default_factory=list)

    def time(self, name: str, step: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        start = time.monotonic()
        result = step(*args, **kwargs)
        seconds = round(time.monotonic() - start, 1)
        self.steps.append({"step": name, "seconds": seconds})
        print(f"[arm64] {name}: {seconds}s", flush=True)
        return result


def ref(image: EmberImage) -> str:
    return image.ref_in(REGISTRY, TAG)


def _bud(image: EmberImage, base: str) -> None:
    argv = bud_argv(image, ref(image), base, PLATFORM)
    subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def build_all(timings: Timings) -> None:
    """The base, the cross-built llama.cpp and the four images, each timed."""
    cached = " (cached)" if base_tar(ARCH).exists() else ""
    base = timings.time("base: debootstrap --arch arm64" + cached, ensure_base_in_buildah, ARCH)
    wheel: Path = timings.time(
        "llama.cpp cross-compiled (aarch64-linux-gnu, armv8.2-a+dotprod+fp16)",
        stage_cross_wheel,
        ARCH,
    )
    print(f"[arm64] {wheel.name}", flush=True)
    for image in IMAGES:
        timings.time(f"image {ref(image)}", _bud, image, base)


if __name__ == "__main__":
    build_all(Timings())
