"""What every node-side process's `main` does first: read its pydantic-settings class from the
command line and `EMBER_*` environment, and set up logging in one format."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
S = TypeVar("S", bound=BaseSettings)


def read_settings(cls: type[S], argv: Sequence[str] | None, what: str) -> S | None:
    """`cls` from `argv` (default: the process's own) and the environment; None once the reason
    is on stderr, for `main` to exit with 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return CliApp.run(cls, cli_args=args)
    except ValidationError as exc:
        print(f"invalid {what} settings:\n{exc}", file=sys.stderr)
        return None


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
