"""Fake `tensorrt_llm._tensorrt_engine`: the LLM class for prebuilt TensorRT engines."""

from __future__ import annotations

from .. import LLM as _TorchLLM


class LLM(_TorchLLM):
    backend = "tensorrt"


__all__ = ["LLM"]
