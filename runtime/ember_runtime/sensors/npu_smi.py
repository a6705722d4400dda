"""Huawei Ascend NPUs through `npu-smi info` (no Python API ships with the driver).

`npu-smi info` prints one table; each device is two rows between `+===+` separators:

  | NPU   Name        | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
  | Chip              | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
  +===================+===============+====================================================+
  | 0     910B        | OK            | 70.0        34                0    / 0             |
  | 0                 | 0000:C1:00.0  | 0           1197 / 13553      1365 / 32768         |

The position of `Temp(C)` in the third header cell is read from the header (310/310P/910 tables
differ in width and in the second row), then the same token of each device's first row is the
temperature. The process table that follows is ignored. The command runs without a shell, with a
timeout; argv is configurable (container paths differ, tests use a fake script).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from ember_runtime.sensors.base import SensorUnavailableError, plausible

DEFAULT_ARGV = ("npu-smi", "info")


class NpuSmiParseError(ValueError):
    pass


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _temp_index(header: list[str]) -> int:
    tokens = header[2].split() if len(header) >= 3 else []
    if "Temp(C)" not in tokens:
        raise NpuSmiParseError(f"no Temp(C) column in the npu-smi header: {header!r}")
    return tokens.index("Temp(C)")


def _parse_device(first: list[str], second: list[str], temp_at: int) -> tuple[str, float] | None:
    npu_name = first[0].split()
    metrics = first[2].split() if len(first) >= 3 else []
    if not npu_name or not npu_name[0].isdigit() or len(metrics) <= temp_at:
        return None
    chip = second[0].split()[0] if second and second[0].split() else "0"
    try:
        celsius = float(metrics[temp_at])
    except ValueError:  # "NA" while a chip resets
        return None
    return f"npu{npu_name[0]}/chip{chip}", celsius


def parse_npu_smi_info(text: str) -> dict[str, float]:
    """Temperatures keyed `npu<id>/chip<chip>` from `npu-smi info` output."""
    lines = [ln for ln in text.splitlines() if ln.strip().startswith(("|", "+"))]
    header_at = next((i for i, ln in enumerate(lines) if "Temp(C)" in ln), None)
    if header_at is None:
        raise NpuSmiParseError("not npu-smi info output: no header with Temp(C)")
    temp_at = _temp_index(_cells(lines[header_at]))
    temps: dict[str, float] = {}
    rows: list[list[str]] = []
    for line in lines[header_at + 1 :]:
        if line.strip().startswith("+"):
            if len(rows) >= 2:
                device = _parse_device(rows[0], rows[1], temp_at)
                if device and plausible(device[1]):
                    temps[device[0]] = device[1]
            rows = []
            continue
        cells = _cells(line)
        if any(c.startswith("Process id") for c in cells):
            break  # the process table: no temperatures there
        rows.append(cells)
    return temps


class NpuSmiReader:
    name = "npu-smi"

    def __init__(self, argv: Sequence[str] = DEFAULT_ARGV, timeout: float = 5.0) -> None:
        if not argv:
            raise ValueError("npu-smi argv must not be empty")
        self._argv = list(argv)
        self._timeout = timeout

    def read(self) -> dict[str, float]:
        try:
            done = subprocess.run(  # argv list, no shell: nothing here is interpreted
                self._argv, capture_output=True, text=True, timeout=self._timeout, check=False
            )
        except FileNotFoundError as exc:
            raise SensorUnavailableError(f"{self._argv[0]} not found (Ascend driver?)") from exc
        except OSError as exc:  # not executable, or the driver's tool dir half-mounted
            raise SensorUnavailableError(f"{self._argv[0]} cannot run: {exc}") from exc
        except subprocess.TimeoutExpired as exc:
            raise SensorUnavailableError(
                f"{self._argv[0]} timed out after {self._timeout}s"
            ) from exc
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()[:300]
            raise SensorUnavailableError(f"{self._argv[0]} exited {done.returncode}: {detail}")
        try:
            return parse_npu_smi_info(done.stdout)
        except NpuSmiParseError as exc:  # e.g. "dcmi module initialize failed" with status 0
            raise SensorUnavailableError(f"{self._argv[0]}: {exc}") from exc
