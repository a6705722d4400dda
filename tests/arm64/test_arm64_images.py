"""The arm64 images, built here and run under qemu-user-static (tests.arm64.proof).

The proof is opt-in, `EMBER_ARM64_PROOF=1` (or `make arm64-proof`, which also writes
bench/results/arm64.*): it rebuilds the images from the current tree with buildah's layer cache
and runs them, 1 min here when nothing changed and 9 min after a change to Ember's code (each
image's pip install reruns under qemu), too slow for every `make test`.
Without qemu's aarch64 binfmt handler it skips and says what is missing. The build-path tests
below need no emulation and always run.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from images import llama_build
from images.build import HOST_ARCH, IMAGES, bud_argv
from tests.arm64 import proof
from tests.arm64.build import PLATFORM, Timings, build_all, ref
from tests.arm64.proof import missing_emulation, prove_all

OPT_IN = "EMBER_ARM64_PROOF"
RUNTIME = next(i for i in IMAGES if i.name == "ember-runtime")


def _build_args(argv: list[str]) -> dict[str, str]:
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--build-arg"]
    return dict(p.split("=", 1) for p in pairs)


@pytest.mark.skipif(HOST_ARCH != "amd64", reason="the cross path is for an x86-64 build host")
def test_arm64_runtime_takes_the_cross_built_wheel_and_no_compiler() -> None:
    args = _build_args(bud_argv(RUNTIME, ref(RUNTIME), None, PLATFORM))
    assert args["LLAMA_WHEELS"] == "images/wheels/arm64"
    # pip may not fall back to compiling llama.cpp under emulation, and has no compiler to.
    assert args["LLAMA_PIP_ARGS"] == "--only-binary=:all:"
    assert args["BUILD_PACKAGES"] == ""
    native = _build_args(bud_argv(RUNTIME, "x", None, None))
    assert "LLAMA_WHEELS" not in native and "BUILD_PACKAGES" not in native


def test_retag_names_the_target_and_keeps_the_record_true(tmp_path: Path) -> None:
    wheel = tmp_path / "demo-1.0-py3-none-linux_x86_64.whl"
    meta = b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: py3-none-linux_x86_64\n"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo/lib/libdemo.so", b"\x7fELF")
        z.writestr("demo-1.0.dist-info/WHEEL", meta)
        z.writestr("demo-1.0.dist-info/RECORD", "demo-1.0.dist-info/WHEEL,sha256=old,1\n")
    out = llama_build._retag(wheel, "linux_aarch64")
    assert out.name == "demo-1.0-py3-none-linux_aarch64.whl" and not wheel.exists()
    with zipfile.ZipFile(out) as z:
        new_meta = z.read("demo-1.0.dist-info/WHEEL")
        record = z.read("demo-1.0.dist-info/RECORD").decode()
        assert z.read("demo/lib/libdemo.so") == b"\x7fELF"
    assert b"Tag: py3-none-linux_aarch64" in new_meta
    digest = base64.urlsafe_b64encode(hashlib.sha256(new_meta).digest()).rstrip(b"=").decode()
    assert record == f"demo-1.0.dist-info/WHEEL,sha256={digest},{len(new_meta)}\n"


@pytest.mark.parametrize(
    ("handler", "says"),
    [
        (None, "apt-get install qemu-user-static binfmt-support"),
        (
            "disabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\nflags: PF\n",
            "update-binfmts",
        ),
        ("enabled\ninterpreter /usr/bin/qemu-aarch64-static\nflags: \n", "F (fix binary)"),
    ],
)
def test_missing_emulation_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handler: str | None, says: str
) -> None:
    path = tmp_path / "qemu-aarch64"
    if handler is not None:
        path.write_text(handler)
    monkeypatch.setattr(proof, "BINFMT", path)
    reason = missing_emulation()
    assert reason is not None and says in reason, reason


def test_arm64_images_serve_under_qemu() -> None:
    reason = missing_emulation()
    if reason:
        pytest.skip(f"cannot run arm64 images here: {reason}")
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"opt-in, minutes under qemu: {OPT_IN}=1 or `make arm64-proof`")
    timings = Timings()
    build_all(timings)
    found = prove_all(timings)
    runtime = found["ember-runtime"]
    assert runtime["completion"]["usage"]["completion_tokens"] >= 1
    # The instruction set llama.cpp was cross-compiled for is the one it runs with.
    assert "DOTPROD = 1" in runtime["engine"], runtime["engine"]
    assert {c["name"] for c in runtime["diagnose"]["checks"]}, runtime["diagnose"]
    for name, entry in found.items():
        assert entry["extensions"]["imported"], name
        assert entry["extensions"]["machine"] == "aarch64", name
