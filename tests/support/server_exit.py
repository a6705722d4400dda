"""Start the runtime server as its own process on a config that must keep it from starting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ember_runtime.contract import reasons


def refused_start(config: Path, log: Path, env: dict[str, str]) -> tuple[str, str, str]:
    """Run `python -m ember_runtime.server --config config` (EMBER_CONFIG dropped from `env`);
    assert it exits 2, and return the `(reason, detail)` it wrote to the termination log and
    its stderr."""
    env = {k: v for k, v in env.items() if k != "EMBER_CONFIG"}
    done = subprocess.run(
        [sys.executable, "-m", "ember_runtime.server", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    parsed = reasons.parse_termination_message(log.read_text())
    assert parsed is not None, log.read_text()
    return parsed[0], parsed[1], done.stderr
