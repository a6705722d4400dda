"""Build llama.cpp twice from the sources vendored in llama-cpp-python's sdist, with one set of
compiler flags: the Python bindings' wheel (the engine the venv runs) and llama.cpp's own
`llama-server` (the runtime's peer in tests and bench).

Same llama.cpp commit and flags for both, so the benchmark compares servers, not llama.cpp
builds. Both are cached under `${XDG_CACHE_HOME:-~/.cache}/ember/llama-server/`, keyed by the
version and the flags, so a change to either rebuilds.

    python images/llama_build.py           # prints llama-server's path
    python images/llama_build.py --wheel   # prints the wheel's path
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import tarfile
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


if __name__ == "__main__":
    print(ensure_wheel() if sys.argv[1:] == ["--wheel"] else ensure_llama_server())
