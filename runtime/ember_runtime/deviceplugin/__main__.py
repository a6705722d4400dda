"""Entry point: `python -m ember_runtime.deviceplugin [--flags]` (or `ember-deviceplugin`).

SIGTERM and SIGINT stop the plugin cleanly: streams end, the plugin socket is removed, and the
checkpoint stays, so the next start keeps every live context ID.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from pydantic import ValidationError
from pydantic_settings import CliApp

from ..cli import configure_logging
from ..heap import freeze_startup_heap
from .allocator import CheckpointError
from .config import PluginSettings


async def run(settings: PluginSettings) -> None:
    from .plugin import NpuDevicePlugin  # noqa: PLC0415 - needs the generated stubs

    plugin = NpuDevicePlugin(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await plugin.start()
    freeze_startup_heap()  # full GC passes then walk only what serving made
    try:
        await stop.wait()
        logging.getLogger(__name__).info("signal received; stopping")
    finally:
        await plugin.stop()


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = CliApp.run(PluginSettings, cli_args=args)
    except ValidationError as exc:
        sys.exit(f"invalid device plugin settings:\n{exc}")
    configure_logging(settings.log_level)
    try:
        asyncio.run(run(settings))
    except CheckpointError as exc:
        sys.exit(f"refusing to start: {exc} (move it aside only if no pod holds an NPU context)")


if __name__ == "__main__":
    main()
