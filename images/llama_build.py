"""Build llama.cpp twice from the sources vendored in llama-cpp-python's sdist, with one set of
compiler flags: the Python bindings' wheel (the engine the venv runs) and llama.cpp's own
`llama-server` (the runtime's peer in tests and bench).

Same llama.cpp commit and flags for both, so the benchmark compares servers, not llama.cpp
builds. Both are cached under `${XDG_CACHE_HOME:-~/.cache}/ember/llama-server/`, keyed by the
version and the flags, so a change to either rebuilds.

    python images/llama_build.py           # prints llama-server's path
    python images/llama_build.py --wheel   # prints the wheel's path
    python images/llama_build.py --wheel --arch arm64   # cross-compiled (see ensure_cross_wheel)
"""

from __future__ import annotations

import base64
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

VERSION = "0.3.36"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build tries to download the web UI
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]
# Native builds, minus Intel AMX: llama.cpp 0.3.36's AMX kernels run tile instructions on
# threads that never asked the kernel for AMX state (and with a tile config the compiler may
# drop), so on an AMX CPU (Sapphire Rapids and later) the first wide batch dies of SIGILL in
# ggml_backend_amx_mul_mat (seen here; upstream: ggml-org/llama.cpp PR #26954, open).
ARCH_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine() == "x86_64" else ""
# Images for another architecture: llama.cpp without -march=native needs its instruction-set
# baseline (x86-64's default is in images/runtime.Dockerfile). arm64: Jetson Orin (Cortex-A78AE)
# and RK3588 (Cortex-A76) both have dotprod and fp16 arithmetic.
TARGET_CMAKE_ARGS = {
    "arm64": "-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16",
}
# Debian's cross toolchains (gcc-<triplet>, g++-<triplet>) and the wheel's platform tag.
CROSS = {"arm64": ("aarch64-linux-gnu", "aarch64", "linux_aarch64")}


def _run(argv: list[str], env: dict[str, str] | None = None) -> None:
    """A build step whose output goes to stderr: stdout carries only the path this prints (the
    Makefile reads it), and a fresh machine's pip and cmake say a lot."""
    subprocess.run(argv, check=True, env=env, stdout=sys.stderr)


def _build_key() -> str:
    flags = "\0".join([VERSION, ARCH_CFLAGS, *CMAKE_FLAGS])
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ember" / "llama-server"


def _sdist(root: Path) -> Path:
    sdist_dir = root / "sdist"
    archive = sdist_dir / f"llama_cpp_python-{VERSION}.tar.gz"
    if not archive.exists():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        _run([*pip, f"llama-cpp-python=={VERSION}", "-d", str(sdist_dir)])
    return archive


def _sources(root: Path) -> Path:
    src = root / f"llama_cpp_python-{VERSION}"
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(_sdist(root)) as tar:
            tar.extractall(root, filter="data")
    return src


def _env() -> dict[str, str]:
    """The compiler flags as CFLAGS/CXXFLAGS: CMake and scikit-build-core both read them."""
    return {**os.environ, "CFLAGS": ARCH_CFLAGS, "CXXFLAGS": ARCH_CFLAGS}


def ensure_wheel() -> Path:
    """The llama-cpp-python wheel built with ARCH_CFLAGS (the venv installs this file)."""
    wheels = cache_root() / f"wheel-{_build_key()}"
    pattern = f"llama_cpp_python-{VERSION}-*.whl"
    if not any(wheels.glob(pattern)):
        # pip's own wheel cache is keyed by the sdist, not the flags: build around it.
        pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w"]
        _run([*pip, str(wheels), str(_sdist(cache_root()))], env=_env())
    return next(wheels.glob(pattern))


def ensure_llama_server(jobs: int = 2) -> Path:
    root = cache_root()
    build = root / f"build-{_build_key()}"
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    llama_cpp = _sources(root) / "vendor" / "llama.cpp"
    cmake = ["cmake", "-S", str(llama_cpp), "-B", str(build), *CMAKE_FLAGS]
    _run(cmake, env=_env())
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)])
    if not binary.exists():
        raise FileNotFoundError(f"the build finished but {binary} is missing")
    return binary


def _cross_cmake_args(arch: str) -> str:
    triplet, processor, _ = CROSS[arch]
    for tool in (f"{triplet}-gcc", f"{triplet}-g++"):
        if shutil.which(tool) is None:
            pkgs = f"gcc-{triplet} g++-{triplet}"
            raise SystemExit(
                f"{tool} is required to cross-compile llama.cpp (apt-get install {pkgs})"
            )
    return " ".join(
        [
            "-DCMAKE_SYSTEM_NAME=Linux",
            f"-DCMAKE_SYSTEM_PROCESSOR={processor}",
            f"-DCMAKE_C_COMPILER={triplet}-gcc",
            f"-DCMAKE_CXX_COMPILER={triplet}-g++",
            TARGET_CMAKE_ARGS[arch],
        ]
    )


def _retag(wheel: Path, platform_tag: str) -> Path:
    """The same wheel under the target's platform tag. llama-cpp-python loads libllama with
    ctypes (no CPython extension), so only the tag names the architecture: pip on the host
    builds it as linux_x86_64."""
    host_tag = wheel.stem.rsplit("-", 1)[1]
    out = wheel.with_name(wheel.name.replace(host_tag, platform_tag))
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        wheel_name = record_name.replace("RECORD", "WHEEL")
        wheel_meta = src.read(wheel_name).decode().replace(host_tag, platform_tag).encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(wheel_meta).digest()).rstrip(b"=")
        records = [
            f"{wheel_name},sha256={digest.decode()},{len(wheel_meta)}"
            if line.startswith(f"{wheel_name},")
            else line
            for line in src.read(record_name).decode().splitlines()
        ]
        for info in src.infolist():
            if info.filename == wheel_name:
                dst.writestr(info, wheel_meta)
            elif info.filename == record_name:
                dst.writestr(info, "\n".join(records) + "\n")
            else:
                dst.writestr(info, src.read(info))
    wheel.unlink()
    return out


def ensure_cross_wheel(arch: str) -> Path:
    """llama-cpp-python for `arch` (PyPI has no wheel of it for any platform), compiled on this
    host by Debian's cross toolchain with TARGET_CMAKE_ARGS: minutes here instead of an hour or
    more under emulation. Cached by version and flags, like the native wheel."""
    cmake_args = _cross_cmake_args(arch)
    key = hashlib.sha256("\0".join([VERSION, cmake_args]).encode()).hexdigest()[:12]
    wheels = cache_root() / f"wheel-{arch}-{key}"
    pattern = f"llama_cpp_python-{VERSION}-*-{CROSS[arch][2]}.whl"
    if not any(wheels.glob(pattern)):
        shutil.rmtree(wheels, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w"]
        # No host CFLAGS (ARCH_CFLAGS are x86 options) reach the cross compiler.
        env = {**os.environ, "CMAKE_ARGS": cmake_args, "CFLAGS": "", "CXXFLAGS": ""}
        _run([*pip, str(wheels), str(_sdist(cache_root()))], env=env)
        _retag(next(wheels.glob(f"llama_cpp_python-{VERSION}-*.whl")), CROSS[arch][2])
    return next(wheels.glob(pattern))


def _main(argv: list[str]) -> Path:
    if argv[:1] != ["--wheel"]:
        return ensure_llama_server()
    if argv[1:2] == ["--arch"] and len(argv) == 3:
        return ensure_cross_wheel(argv[2])
    return ensure_wheel()


if __name__ == "__main__":
    print(_main(sys.argv[1:]))
