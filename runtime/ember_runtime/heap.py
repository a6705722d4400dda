"""Keep the garbage collector's full passes off the request path of long-running processes.

CPython's oldest generation holds everything a process imported and built at start-up (modules,
pydantic models, the gRPC server). Each full collection walks all of it: in the device plugin
that was a 16-19 ms pause, about one per second at 32 concurrent Allocate callers, stalling
every call in flight. Objects made before serving starts live as long as the process, so moving
them to the permanent generation (`gc.freeze`) loses nothing and makes a full pass walk only
what serving itself made (0.2 ms measured in the same run).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then exempt every surviving object from future collections.

    Call it once, when start-up is done; logs and returns how many objects were frozen.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects", frozen)
    return frozen
