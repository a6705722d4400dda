"""Prewarm failures. Each message is the one line written to the termination log."""

from __future__ import annotations


class PrewarmError(Exception):
    """A failure with a one-line, operator-facing reason (`str(err)`)."""


class ChecksumMismatch(PrewarmError):
    def __init__(self, path: str, expected: str, got: str) -> None:
        super().__init__(f"checksum mismatch: {path} expected {expected[:12]}… got {got[:12]}…")


class SizeMismatch(PrewarmError):
    def __init__(self, path: str, expected: int, got: int) -> None:
        super().__init__(f"size mismatch: {path} expected {expected} bytes got {got}")


class Interrupted(PrewarmError):
    def __init__(self, what: str = "prewarm interrupted by SIGTERM") -> None:
        super().__init__(what)
