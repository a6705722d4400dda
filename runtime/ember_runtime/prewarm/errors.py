"""Prewarm failures. Each carries a reason from the shared vocabulary
(`ember_runtime.contract.reasons`) and a one-line detail; `termination_message()` is the line
written to the termination log."""

from __future__ import annotations

from ember_runtime.contract import reasons


class PrewarmError(Exception):
    """A failure with an operator-facing reason and a one-line detail (`str(err)`)."""

    def __init__(self, detail: str, reason: str = reasons.PREWARM_FAILED) -> None:
        super().__init__(detail)
        self.reason = reason

    def termination_message(self) -> str:
        return reasons.termination_message(self.reason, str(self))


class ChecksumMismatch(PrewarmError):
    def __init__(self, path: str, expected: str, got: str) -> None:
        detail = f"{path} expected {expected[:12]}… got {got[:12]}…"
        super().__init__(detail, reasons.CHECKSUM_MISMATCH)


class SizeMismatch(PrewarmError):
    def __init__(self, path: str, expected: int, got: int) -> None:
        super().__init__(f"{path} expected {expected} bytes got {got}", reasons.SIZE_MISMATCH)


class Interrupted(PrewarmError):
    def __init__(self, what: str = "prewarm interrupted by SIGTERM") -> None:
        super().__init__(what, reasons.PREWARM_INTERRUPTED)
