"""The engine's llama.cpp build: what `make install` compiled into the venv."""

from __future__ import annotations

import sys

import llama_cpp
import pytest

from images import llama_build


def test_engine_build_has_no_amx_kernels() -> None:
    # llama.cpp 0.3.36's AMX kernels die of SIGILL on AMX CPUs (images/llama_build.py
    # says why): the venv must run the wheel built without them, not pip's native build.
    info = llama_cpp.llama_print_system_info().decode()
    assert "AMX_INT8 = 1" not in info, info
    assert "CPU :" in info, info  # the report is the one this check reads


def test_build_steps_print_to_stderr_so_stdout_is_only_the_path(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # `make install` reads the wheel's path from the script's stdout; on a fresh machine pip's
    # own output went there too and the install failed ("looks like a filename, but the file
    # does not exist").
    llama_build._run([sys.executable, "-c", "print('Building wheel...')"])
    out, err = capfd.readouterr()
    assert (out, err) == ("", "Building wheel...\n")
