"""The arm64 images, proven without arm64 hardware: run under qemu-user-static (binfmt_misc).

    python -m tests.arm64.proof [--build] [--write-results]

- runtime: the server loads the Gemma model (the tests' own, `default_model_path()`, copied into
  the container: the image ships no model) and answers one `/v1/completions`;
  `prewarm diagnose --json` runs on that model;
- every image: its ENTRYPOINT starts and answers `--help`;
- every image: each compiled extension module in its venv is an aarch64 ELF and imports.

`--build` builds the images first (tests.arm64.build; cached layers make a rebuild seconds);
`--write-results` writes bench/results/arm64.{json,md}. Each step's wall time is recorded.
Emulation is what this proves: that the images are complete and correct for aarch64 with the
instruction set llama.cpp was compiled for. qemu's speed says nothing about a real board's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import yaml

from images.build import IMAGES, REPO, EmberImage
from tests.arm64.build import Timings, build_all, ref
from tests.cluster.images import buildah_images
from tests.support.model import (
    MODEL_FILENAME,
    MODEL_SHA256,
    MODEL_SIZE_BYTES,
    default_model_path,
)
from tests.support.net import free_port
from tests.support.waiting import wait_for

BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
RESULTS = REPO / "bench" / "results"
MODEL_DIR = "/tmp/models"  # in the runtime's container
MODEL_PATH = f"{MODEL_DIR}/{MODEL_FILENAME}"
SERVER_READY_S = 900.0
# Run inside an image: every compiled extension module of the venv (the ABI-tagged suffixes;
# plain .so files are libraries loaded by ctypes or the linker, checked for aarch64 only).
EXTENSIONS_PY = r"""
import importlib, importlib.machinery, json, pathlib, platform, sys, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
tagged = [s for s in importlib.machinery.EXTENSION_SUFFIXES if s != ".so"]
def machine(path):
    with open(path, "rb") as f:
        head = f.read(20)
    return int.from_bytes(head[18:20], "little") if head[:4] == b"\x7fELF" else -1
out = {"machine": platform.machine(), "python": sys.version.split()[0], "imported": [],
       "failed": {}, "not_aarch64": [], "libraries": 0}
for path in sorted(site.rglob("*.so")):
    if machine(path) != 183:  # EM_AARCH64
        out["not_aarch64"].append(str(path.relative_to(site)))
    suffix = next((s for s in tagged if path.name.endswith(s)), None)
    if suffix is None:
        out["libraries"] += 1
        continue
    rel = path.relative_to(site)
    name = ".".join([*rel.parts[:-1], rel.name[: -len(suffix)]])
    try:
        importlib.import_module(name)
        out["imported"].append(name)
    except Exception as exc:
        out["failed"][name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

# The CPU the image runs on, as the kernel (here qemu) reports it to the process: AT_HWCAP bits
# of arm64's uapi hwcap.h, and whether /proc/cpuinfo describes an arm64 CPU at all.
CPU_PY = r"""
import ctypes, json
hwcap = ctypes.CDLL(None).getauxval(16)  # AT_HWCAP
bits = {"fp": 0, "asimd": 1, "fphp": 9, "asimdhp": 10, "asimddp": 20}
cpuinfo = open("/proc/cpuinfo").read().splitlines()
print(json.dumps({
    "hwcap": sorted(name for name, bit in bits.items() if hwcap >> bit & 1),
    "cpuinfo_is_arm64": any(line.startswith("Features") for line in cpuinfo),
    "cpuinfo_model": next((l.split(":", 1)[1].strip() for l in cpuinfo
                           if l.startswith("model name")), ""),
}))
"""


def missing_emulation() -> str | None:
    """Why arm64 images cannot run here, or None when qemu's aarch64 handler is usable."""
    if not BINFMT.exists():
        return (
            f"no qemu-aarch64 binfmt_misc handler ({BINFMT} is missing): apt-get install "
            "qemu-user-static binfmt-support (and mount binfmt_misc on /proc/sys/fs/binfmt_misc "
            "if that folder is empty)"
        )
    lines = BINFMT.read_text().splitlines()
    if "enabled" not in lines:
        return f"{BINFMT} is disabled: update-binfmts --enable qemu-aarch64"
    flags = next((line.split(":", 1)[1] for line in lines if line.startswith("flags:")), "")
    if "F" not in flags:
        # Without F the kernel opens the interpreter inside the container, where it is absent.
        return f"{BINFMT} lacks the F (fix binary) flag: containers cannot reach qemu"
    if shutil.which("buildah") is None:
        return "buildah is missing (apt-get install buildah)"
    return None


def missing_images() -> list[str]:
    present = buildah_images()
    return [ref(i) for i in IMAGES if ref(i) not in present]


@contextmanager
def container(image: EmberImage) -> Iterator[str]:
    """A buildah working container of the image (its own USER and ENV), removed afterwards."""
    name = subprocess.run(
        ["buildah", "from", "--quiet", ref(image)], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True, check=False)


def run_argv(name: str, *argv: str) -> list[str]:
    return ["buildah", "run", "--network", "host", name, "--", *argv]


def run_in(name: str, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        run_argv(name, *argv), capture_output=True, text=True, timeout=timeout, check=False
    )


def _entrypoint(image: EmberImage) -> list[str]:
    found = subprocess.run(
        ["buildah", "inspect", "--type", "image", ref(image)],
        capture_output=True,
        text=True,
        check=True,
    )
    entrypoint: list[str] = json.loads(found.stdout)["OCIv1"]["config"]["Entrypoint"]
    return entrypoint


def prove_help(name: str, image: EmberImage) -> dict[str, Any]:
    """The image's own ENTRYPOINT starts and answers `--help`."""
    done = run_in(name, *_entrypoint(image), "--help")
    if done.returncode != 0 or "usage" not in done.stdout.lower():
        raise AssertionError(f"{image.name} --help: rc={done.returncode}\n{done.stderr[-2000:]}")
    return {"entrypoint": _entrypoint(image), "first_line": done.stdout.splitlines()[0]}


def prove_extensions(name: str, image: EmberImage) -> dict[str, Any]:
    done = run_in(name, "python3", "-c", EXTENSIONS_PY)
    if done.returncode != 0:
        raise AssertionError(f"{image.name}: extension check crashed\n{done.stderr[-2000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if found["machine"] != "aarch64" or found["failed"] or found["not_aarch64"]:
        raise AssertionError(f"{image.name}: {json.dumps(found, indent=1)}")
    if not found["imported"]:
        raise AssertionError(f"{image.name}: no compiled extension found to import")
    return found


def _wait_ready(url: str, server: subprocess.Popen[bytes]) -> None:
    def ready() -> bool:
        if server.poll() is not None:
            raise AssertionError(f"the server exited ({server.returncode}) before it was ready")
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200

    wait_for("the server's /readyz", ready, SERVER_READY_S, 1.0, tolerate=(httpx.TransportError,))


def _complete(url: str) -> dict[str, Any]:
    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16}
    reply = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=900)
    reply.raise_for_status()
    answer: dict[str, Any] = reply.json()
    if not answer["choices"][0]["text"].strip() or answer["usage"]["completion_tokens"] < 1:
        raise AssertionError(f"an empty completion: {answer}")
    return {"model": model, "prompt": body["prompt"], **answer}


def prove_server(name: str, timings: Timings) -> dict[str, Any]:
    """Start the runtime's server on the test model, time its load and one completion."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["python3", "-m", "ember_runtime.server", "--model", MODEL_PATH]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    argv += ["--threads", "2", "--context-length", "512", "--max-batch-size", "1"]
    with tempfile.TemporaryFile("w+") as log:
        return _serve_and_ask(name, argv, url, log, timings)


def _serve_and_ask(
    name: str, argv: list[str], url: str, log: IO[str], timings: Timings
) -> dict[str, Any]:
    server = subprocess.Popen(run_argv(name, *argv), stdout=log, stderr=subprocess.STDOUT)
    try:
        timings.time("runtime: server start + model load (qemu)", _wait_ready, url, server)
        answer = timings.time("runtime: one completion, 16 tokens (qemu)", _complete, url)
    except Exception:
        log.seek(0)
        print(log.read()[-4000:], flush=True)
        raise
    finally:
        server.terminate()  # buildah run passes SIGTERM on: the server drains and exits
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    return answer


def copy_model(name: str) -> None:
    """The tests' model into the runtime's container, readable by the image's user."""
    subprocess.run(
        ["buildah", "copy", "--chmod", "0644", name, str(default_model_path()), MODEL_PATH],
        check=True,
        capture_output=True,
    )


def _engine_info(name: str) -> str:
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    return run_in(name, "python3", "-c", code).stdout.strip()


def _cpu(name: str) -> dict[str, Any]:
    cpu: dict[str, Any] = json.loads(run_in(name, "python3", "-c", CPU_PY).stdout)
    return cpu


def prove_diagnose(name: str) -> dict[str, Any]:
    """`prewarm diagnose --json` on the model the server loaded, with a real config file."""
    config = {
        "modelName": "gemma-3-270m",
        "modelDir": MODEL_DIR,
        "files": [{"path": MODEL_FILENAME, "sha256": MODEL_SHA256, "sizeBytes": MODEL_SIZE_BYTES}],
        "prewarmDir": "/tmp/prewarm",
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(config, f)
        f.flush()
        subprocess.run(
            ["buildah", "copy", "--chmod", "0644", name, f.name, "/tmp/config.yaml"],
            check=True,
            capture_output=True,
        )
    argv = ["python3", "-m", "ember_runtime.prewarm", "diagnose", "--json"]
    done = run_in(name, *argv, "--config", "/tmp/config.yaml")
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise AssertionError(f"diagnose: rc={done.returncode}\n{done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    failed = {c["name"] for c in report["checks"] if c["status"] == "fail"}
    cpu = _cpu(name)
    # qemu-user 7.2 passes the host's /proc/cpuinfo through (x86 flags, no `asimd`), so the
    # cpu-features check fails under emulation; the emulated CPU's HWCAP has what it looks for.
    excused = {"cpu features"} if not cpu["cpuinfo_is_arm64"] and "asimd" in cpu["hwcap"] else set()
    if failed - excused:
        raise AssertionError(f"diagnose failed {sorted(failed - excused)}: {report}")
    return {"rc": done.returncode, "cpu": cpu, "excused": sorted(failed & excused), **report}


def _prove_image(image: EmberImage, timings: Timings) -> dict[str, Any]:
    short = image.name.removeprefix("ember-")
    with container(image) as name:
        entry: dict[str, Any] = {
            "help": timings.time(f"{short}: --help (qemu)", prove_help, name, image),
            "extensions": timings.time(
                f"{short}: import every compiled extension (qemu)", prove_extensions, name, image
            ),
        }
        if image.name == "ember-runtime":
            entry["engine"] = _engine_info(name)
            copy_model(name)
            entry["completion"] = prove_server(name, timings)
            entry["diagnose"] = timings.time(
                "runtime: prewarm diagnose (qemu)", prove_diagnose, name
            )
    return entry


def prove_all(timings: Timings) -> dict[str, Any]:
    """Every image's checks (the runtime's server and diagnose too); raises on the first
    failure."""
    return {image.name: _prove_image(image, timings) for image in IMAGES}


def _host() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    version = ["qemu-aarch64-static", "--version"]
    qemu = subprocess.run(version, capture_output=True, text=True, check=False)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "qemu": qemu.stdout.splitlines()[0] if qemu.returncode == 0 else "?",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    steps: list[dict[str, Any]] = result["steps"]
    builds = sum(float(s["seconds"]) for s in steps if str(s["step"]).startswith("image "))
    return {
        "date": result["host"]["date"],
        "total_seconds": result.get("total_seconds") or sum(float(s["seconds"]) for s in steps),
        "image_build_seconds": round(builds, 1),
    }


def _history() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first (cold) build's timings and earlier runs' totals, kept across runs: a run
    finds the caches warm (or rebuilds only what a source change touched)."""
    path = RESULTS / "arm64.json"
    if not path.exists():
        return [], []
    old: dict[str, Any] = json.loads(path.read_text())
    runs: list[dict[str, Any]] = old.get("previous_runs", [])
    if "steps" in old:
        runs = [*runs, _summary(old)][-5:]
    return old.get("cold_build", []), runs


def render_markdown(result: dict[str, Any]) -> str:
    host, found = result["host"], result["proof"]
    runtime = found["ember-runtime"]
    rows = [f"| {s['step']} | {s['seconds']} |" for s in result["steps"]]
    runs = [
        f"| {r['date']} | {r['total_seconds']:.0f} | {r['image_build_seconds']:.0f} |"
        for r in [*result["previous_runs"], _summary(result)]
    ]
    cold = [f"| {s['step']} | {s['seconds']} | {s.get('note', '')} |" for s in result["cold_build"]]
    exts = [
        f"| {name} | {len(v['extensions']['imported'])} | {v['extensions']['libraries']} | "
        f"{v['help']['first_line']} |"
        for name, v in found.items()
    ]
    diag = runtime["diagnose"]
    lines = [
        "# arm64 images under emulation (qemu-user-static, no arm64 hardware)",
        "",
        "Written by `make arm64-proof` (`python -m tests.arm64.proof --build --write-results`).",
        f"Host: {host['cpu']}, {host['cores']} cores shared with other jobs (load average "
        f"{', '.join(f'{x:.1f}' for x in host['load_average_at_start'])} at the start), "
        f"{host['qemu']}, {host['date']}.",
        "",
        "Built here for linux/arm64: the base by `debootstrap --arch arm64`, the runtime's "
        "llama.cpp cross-compiled by Debian's aarch64-linux-gnu gcc/g++ with "
        "`-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16`, every other package an aarch64 wheel "
        "from PyPI installed by the image's pip under qemu. qemu's speed is no measure of a real "
        "board's: these times say what the proof costs here.",
        "",
        "## First (cold) build",
        "",
        "| step | seconds | note |",
        "|---|---|---|",
        *cold,
        "",
        "## This run",
        "",
        "An image row of a few seconds is buildah's layer cache; a change under operator/, "
        "runtime/, pyproject.toml or README.md re-runs that image's pip install under qemu.",
        "",
        "| step | seconds |",
        "|---|---|",
        *rows,
        "",
        "## Runs (this one last)",
        "",
        "| date | total seconds | of which image builds |",
        "|---|---|---|",
        *runs,
        "",
        "## What ran",
        "",
        "| image | extension modules imported | other shared libraries (aarch64) "
        "| ENTRYPOINT `--help` |",
        "|---|---|---|---|",
        *exts,
        "",
        f"Completion (`{runtime['completion']['model']}`, temperature 0): "
        f"`{runtime['completion']['prompt']}` → `{runtime['completion']['choices'][0]['text']}` "
        f"({runtime['completion']['usage']['completion_tokens']} tokens).",
        "",
        f"llama.cpp's system info in the image: `{runtime['engine']}`",
        "",
        f"`prewarm diagnose` (exit {diag['rc']}): "
        + ", ".join(f"{c['name']} {c['status']}" for c in diag["checks"])
        + ".",
        "",
        f"The emulated CPU (AT_HWCAP): {', '.join(diag['cpu']['hwcap'])}; /proc/cpuinfo under "
        f"qemu-user: {'arm64' if diag['cpu']['cpuinfo_is_arm64'] else 'the host' + chr(39) + 's'}"
        f" ({diag['cpu']['cpuinfo_model'] or 'no model name'})."
        + (
            f" Excused for that reason: {', '.join(diag['excused'])} (it reads /proc/cpuinfo;"
            " on arm64 hardware that file lists the CPU's Features)."
            if diag["excused"]
            else ""
        ),
        "",
    ]
    return "\n".join(lines)


def write_results(result: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "arm64.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "arm64.md").write_text(render_markdown(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.arm64.proof")
    parser.add_argument("--build", action="store_true", help="build the arm64 images first")
    parser.add_argument("--write-results", action="store_true", help="bench/results/arm64.*")
    args = parser.parse_args(argv)
    reason = missing_emulation()
    if reason:
        raise SystemExit(f"cannot run arm64 images here: {reason}")
    host, timings, start = _host(), Timings(), time.monotonic()
    if args.build:
        build_all(timings)
    missing = missing_images()
    if missing:
        raise SystemExit(f"not built: {missing} (python -m tests.arm64.proof --build)")
    found = prove_all(timings)
    cold, runs = _history()
    result: dict[str, Any] = {"host": host, "cold_build": cold, "previous_runs": runs}
    result["steps"] = timings.steps
    result["total_seconds"] = round(time.monotonic() - start, 1)
    result["proof"] = found
    if args.write_results:
        write_results(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
