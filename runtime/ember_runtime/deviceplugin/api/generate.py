"""Generate the kubelet API stubs: `python -m ember_runtime.deviceplugin.api.generate`.

protoc runs with the `runtime/` directory as its include root, so each `.proto` is named
`ember_runtime/deviceplugin/api/<file>.proto` and the generated `import` lines are absolute
package imports (`from ember_runtime.deviceplugin.api import api_pb2`) that work in place.
The proto *packages* (`v1beta1`, `v1`) are what the kubelet sees on the wire; the file names
are ours.
"""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

PROTOS = ("api.proto", "podresources.proto")
API_DIR = Path(__file__).resolve().parent
INCLUDE_ROOT = API_DIR.parents[2]  # .../runtime: the directory holding ember_runtime/
REL_DIR = API_DIR.relative_to(INCLUDE_ROOT)


def _mypy_plugins() -> list[str]:
    """mypy-protobuf's protoc plugins, when installed next to this interpreter."""
    bindir = Path(sys.executable).parent
    found = []
    for name, out in (("protoc-gen-mypy", "mypy_out"), ("protoc-gen-mypy_grpc", "mypy_grpc_out")):
        exe = bindir / name if (bindir / name).exists() else shutil.which(name)
        if exe is None:
            return []
        found += [f"--plugin={name}={exe}", f"--{out}={INCLUDE_ROOT}"]
    return found


def protoc_args(with_types: bool = True) -> list[str]:
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{INCLUDE_ROOT}",
        f"-I{well_known}",
        f"--python_out={INCLUDE_ROOT}",
        f"--grpc_python_out={INCLUDE_ROOT}",
    ]
    if with_types:
        args += _mypy_plugins()
    return args + [str(REL_DIR / name) for name in PROTOS]


def generate() -> None:
    """Run protoc in-process; raise RuntimeError with protoc's exit code on failure."""
    from grpc_tools import protoc  # noqa: PLC0415 - a dev-only dependency, needed only here

    code = protoc.main(protoc_args())
    if code != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {code}")


def main() -> None:
    try:
        generate()
    except (ImportError, RuntimeError) as exc:
        sys.exit(f"generating kubelet API stubs failed: {exc}")
    print(f"generated stubs for {', '.join(PROTOS)} in {API_DIR}")


if __name__ == "__main__":
    main()
