"""Linux thermal zones: `<sysfs_root>/class/thermal/thermal_zone*/{type,temp}`.

`temp` is in millidegrees Celsius. The root is configurable so tests (and containers that mount
the host's /sys elsewhere) point it at another tree; the reading code path is the same.
`types` (fnmatch patterns on the zone's `type`, e.g. `x86_pkg_temp`, `soc*`, `gpu*`) selects
the zones relevant to the accelerator: a battery or a chassis zone must not throttle serving.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence
from pathlib import Path

from ember_runtime.sensors.base import SensorUnavailableError, plausible

log = logging.getLogger(__name__)


class ThermalZoneReader:
    name = "thermal-zones"

    def __init__(self, sysfs_root: str | Path = "/sys", types: Sequence[str] = ()) -> None:
        self._base = Path(sysfs_root) / "class" / "thermal"
        self._types = tuple(types)

    def _wanted(self, kind: str) -> bool:
        return not self._types or any(fnmatch.fnmatchcase(kind, p) for p in self._types)

    def read(self) -> dict[str, float]:
        if not self._base.is_dir():  # sysfs not mounted there (a wrong sysfsRoot, a VM)
            raise SensorUnavailableError(f"no thermal zones: {self._base} does not exist")
        temps: dict[str, float] = {}
        for zone in sorted(self._base.glob("thermal_zone*")):
            try:
                kind = (zone / "type").read_text().strip() or zone.name
                millis = int((zone / "temp").read_text().strip())
            except (OSError, ValueError) as exc:
                # A zone may vanish or refuse reads (e.g. a sleeping device): skip it, keep others.
                log.debug("skipping %s: %s", zone, exc)
                continue
            celsius = millis / 1000.0
            if not self._wanted(kind) or not plausible(celsius):
                continue
            name = kind if kind not in temps else f"{kind}/{zone.name}"
            temps[name] = celsius
        return temps
