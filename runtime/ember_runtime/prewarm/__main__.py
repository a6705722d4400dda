"""`python -m ember_runtime.prewarm {prewarm,diagnose}`: the init container and node preflight.

prewarm   preflight → copy+hash every file into the target → verify → rename → manifest.
          Exit 0 when the target holds the verified model (copied now or reused); otherwise
          one `Reason: detail` line to the termination log (`ember_runtime.contract.reasons`; the
          operator shows it as the Degraded reason) and exit 1,
          or 143 after SIGTERM.
diagnose  the same checks as a ✅/⚠️/❌ table (or `--json`); exit 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError

from ember_runtime import termination
from ember_runtime.contract import reasons
from ember_runtime.contract.config import CONFIG_ENV, RuntimeConfig, load_config
from ember_runtime.prewarm.checks import (
    DEFAULT_MARGIN_BYTES,
    Host,
    NvidiaSmiProbe,
    Preflight,
    failures,
    run_checks,
)
from ember_runtime.prewarm.copy import DEFAULT_PARALLEL, CopyOptions
from ember_runtime.prewarm.errors import Interrupted, PrewarmError
from ember_runtime.prewarm.report import render_table, to_json
from ember_runtime.prewarm.run import prewarm

EXIT_FAILED = 1
EXIT_SIGTERM = 128 + signal.SIGTERM


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        help=f"config YAML (default: ${CONFIG_ENV}, then /etc/ember/config.yaml)",
    )
    p.add_argument("--model-dir", help="override config modelDir (the source)")
    p.add_argument("--prewarm-dir", help="override config prewarmDir (the shm target)")
    p.add_argument("--termination-log", type=Path, help="override config terminationLog")
    p.add_argument(
        "--shm-limit-bytes",
        type=_positive,
        help="size limit of the target volume (an emptyDir sizeLimit is invisible to statvfs)",
    )
    p.add_argument(
        "--margin-bytes",
        type=_non_negative,
        default=DEFAULT_MARGIN_BYTES,
        help="free space to keep beyond the model (default %(default)s)",
    )
    p.add_argument("--proc-root", type=Path, default=Path("/proc"))
    p.add_argument("--dev-root", type=Path, default=Path("/dev"))
    p.add_argument("--cgroup-root", type=Path, default=Path("/sys/fs/cgroup"))
    p.add_argument("--nvidia-smi", default="nvidia-smi", help="nvidia-smi binary to probe GPUs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ember_runtime.prewarm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    pw = sub.add_parser("prewarm", help="verify and copy the model into shared memory")
    _common(pw)
    pw.add_argument(
        "--parallel",
        type=_positive,
        default=DEFAULT_PARALLEL,
        help="files copied at once (default %(default)s)",
    )
    pw.add_argument("--buffer-mib", type=_positive, default=1, help="read size (default 1 MiB)")
    pw.add_argument("--progress-interval", type=float, default=1.0, help=argparse.SUPPRESS)
    dg = sub.add_parser("diagnose", help="print the node preflight checks")
    _common(dg)
    dg.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _config(args: argparse.Namespace) -> RuntimeConfig:
    config = load_config(args.config)
    update: dict[str, Any] = {}
    if args.model_dir is not None:
        update["model_dir"] = args.model_dir
    if args.prewarm_dir is not None:
        update["prewarm_dir"] = args.prewarm_dir
    if args.termination_log is not None:
        update["termination_log"] = str(args.termination_log)
    return config.model_copy(update=update)


def _preflight(args: argparse.Namespace, config: RuntimeConfig) -> Preflight:
    host = Host(
        proc=args.proc_root,
        dev=args.dev_root,
        cgroup=args.cgroup_root,
        gpu=NvidiaSmiProbe(args.nvidia_smi),
    )
    return Preflight(
        config, host, shm_limit_bytes=args.shm_limit_bytes, margin_bytes=args.margin_bytes
    )


def _config_error(err: Exception) -> str:
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        return f"{where}: {first['msg']}"
    if isinstance(err, OSError):
        return f"{err.filename}: {err.strerror}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _on_sigterm(stop: threading.Event) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()  # copy threads drop their temp files at the next buffer
        raise Interrupted()

    signal.signal(signal.SIGTERM, handler)


def cmd_prewarm(args: argparse.Namespace) -> int:
    stop = threading.Event()
    _on_sigterm(stop)
    log = args.termination_log or Path("/dev/termination-log")
    try:
        config = _config(args)
        log = Path(config.termination_log)
    except (OSError, ValueError, ValidationError) as err:
        termination.report(log, reasons.CONFIG_INVALID, _config_error(err), who="prewarm")
        return EXIT_FAILED
    options = CopyOptions(buffer_bytes=args.buffer_mib << 20, parallel=args.parallel)
    try:
        prewarm(_preflight(args, config), options, sys.stdout, stop, args.progress_interval)
    except PrewarmError as err:
        termination.report(log, err.reason, str(err), who="prewarm")
        return EXIT_SIGTERM if isinstance(err, Interrupted) else EXIT_FAILED
    except OSError as err:
        detail = f"{err.filename or ''}: {err.strerror}"
        termination.report(log, reasons.MODEL_READ_ERROR, detail, who="prewarm")
        return EXIT_FAILED
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    try:
        config = _config(args)
    except (OSError, ValueError, ValidationError) as err:
        print(f"config error: {_config_error(err)}", file=sys.stderr)
        return EXIT_FAILED
    results = run_checks(_preflight(args, config))
    if args.json:
        print(json.dumps(to_json(results), indent=2, ensure_ascii=False))
    else:
        print(render_table(results))
    return EXIT_FAILED if failures(results) else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "prewarm":
        return cmd_prewarm(args)
    return cmd_diagnose(args)


if __name__ == "__main__":
    sys.exit(main())
