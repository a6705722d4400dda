"""The engine's llama.cpp build: what `make install` compiled into the venv."""

from __future__ import annotations

import llama_cpp


def test_engine_build_has_no_amx_kernels() -> None:
    # llama.cpp 0.3.36's AMX kernels die of SIGILL on AMX CPUs (bench/llama_server_build.py
    # says why): the venv must run the wheel built without them, not pip's native build.
    info = llama_cpp.llama_print_system_info().decode()
    assert "AMX_INT8 = 1" not in info, info
    assert "CPU :" in info, info  # the report is the one this check reads
