"""Huawei Ascend NPUs through `npu-smi info` (no Python API ships with the driver).

`npu-smi info` prints one table; each device is two rows between `+===+` separators:

  | NPU   Name        | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
  | Chip              | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
  +===================+===============+====================================================+
  | 0     910B        | OK            | 70.0        34                0    / 0             |
  | 0                 | 0000:C1:00.0  | 0           1197 / 13553      1365 / 32768         |

The position of `Temp(C)` in the third header cell is read from the header (310/310P/910 tables
differ in width and in the second row), then the same token of each device's first row is the
temperature; `Power(W)` likewise (the reader's `telemetry()`, for joules per token). The
process table that follows is ignored. The command runs without a shell, with a timeout; argv
is configurable (container paths differ, tests use a fake script).
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


def _column_index(header: list[str], column: str) -> int:
    tokens = header[2].split() if len(header) >= 3 else []
    if column not in tokens:
        raise NpuSmiParseError(f"no {column} column in the npu-smi header: {header!r}")
    return tokens.index(column)


def _parse_device(first: list[str], second: list[str], at: int) -> tuple[str, float] | None:
    npu_name = first[0].split()
    metrics = first[2].split() if len(first) >= 3 else []
    if not npu_name or not npu_name[0].isdigit() or len(metrics) <= at:
        return None
    chip = second[0].split()[0] if second and second[0].split() else "0"
    try:
        value = float(metrics[at])
    except ValueError:  # "NA" while a chip resets, or for a power the card does not measure
        return None
    return f"npu{npu_name[0]}/chip{chip}", value


Rows = tuple[list[str], list[str]]  # one device's two rows, as cells


def _table(text: str) -> tuple[list[str], list[Rows]]:
    """The header's cells and each device's two rows (the process table is left out)."""
    lines = [ln for ln in text.splitlines() if ln.strip().startswith(("|", "+"))]
    header_at = next((i for i, ln in enumerate(lines) if "Temp(C)" in ln), None)
    if header_at is None:
        raise NpuSmiParseError("not npu-smi info output: no header with Temp(C)")
    devices: list[Rows] = []
    rows: list[list[str]] = []
    for line in lines[header_at + 1 :]:
        if line.strip().startswith("+"):
            if len(rows) >= 2:
                devices.append((rows[0], rows[1]))
            rows = []
            continue
        cells = _cells(line)
        if any(c.startswith("Process id") for c in cells):
            break  # the process table: no temperatures there
        rows.append(cells)
    return _cells(lines[header_at]), devices


def _column(text: str, column: str) -> dict[str, float]:
    """One metric of the third cell (`Power(W)`, `Temp(C)`) per device, `npu<id>/chip<chip>`."""
    header, devices = _table(text)
    at = _column_index(header, column)
    return {d[0]: d[1] for first, second in devices if (d := _parse_device(first, second, at))}


def parse_npu_smi_info(text: str) -> dict[str, float]:
    """Temperatures keyed `npu<id>/chip<chip>` from `npu-smi info` output."""
    return {k: v for k, v in _column(text, "Temp(C)").items() if plausible(v)}


def parse_npu_smi_power(text: str) -> dict[str, float]:
    """Power (W) keyed like the temperatures, from the same table; {} without a Power(W)
    column, and no entry where it says NA (310P cards)."""
    try:
        return {k: w for k, w in _column(text, "Power(W)").items() if w >= 0}
    except NpuSmiParseError:
        return {}


class NpuSmiReader:
    name = "npu-smi"

    def __init__(self, argv: Sequence[str] = DEFAULT_ARGV, timeout: float = 5.0) -> None:
        if not argv:
            raise ValueError("npu-smi argv must not be empty")
        self._argv = list(argv)
        self._timeout = timeout
        self._power: dict[str, float] = {}

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
            temps = parse_npu_smi_info(done.stdout)
        except NpuSmiParseError as exc:  # e.g. "dcmi module initialize failed" with status 0
            self._power = {}
            raise SensorUnavailableError(f"{self._argv[0]}: {exc}") from exc
        self._power = parse_npu_smi_power(done.stdout)
        return temps

    def telemetry(self) -> dict[str, dict[str, float]]:
        """The table's power per device (for joules per token: `sensors.power`), as of the last
        read: one run of the tool gives both, so energy costs no second ~1 s call."""
        return {key: {"power_watts": watts} for key, watts in self._power.items()}
