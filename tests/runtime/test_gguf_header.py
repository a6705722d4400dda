"""The streaming GGUF header reader against gguf-py's reader, on the real Gemma 3 270M file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from ember_runtime.gguf_header import GGUFHeaderError, LongArray, read_header


def test_every_field_agrees_with_gguf_py(model_path: Path) -> None:
    from gguf import GGUFReader

    ours = read_header(model_path)
    theirs = {
        k: f for k, f in GGUFReader(model_path, "r").fields.items() if not k.startswith("GGUF.")
    }
    assert set(ours) == set(theirs)
    for key, field in theirs.items():
        value, expected = ours[key], field.contents()
        if isinstance(value, LongArray):
            assert value.length == len(field.data), key
        elif isinstance(value, float):
            assert value == pytest.approx(expected), key
        else:
            assert value == expected, key
    vocab = ours["tokenizer.ggml.tokens"]
    assert isinstance(vocab, LongArray) and vocab.length == 262_144


def test_reading_the_header_needs_no_vocabulary_sized_memory(model_path: Path) -> None:
    """The runtime checks its memory before loading the model: reading the header must not
    itself cost what gguf-py's reader did (~700 MiB peak for this file: an OOM kill at a
    limit sized for the engine, found by tests/operator/test_sizing_node.py)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ember_runtime.memory import read_gguf_shape\n"
        "read_gguf_shape(Path(sys.argv[1]))\n"
        # VmHWM: this process image's peak (ru_maxrss would carry the parent's across exec)
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print(int(hwm.split()[1]) // 1024)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(model_path)], check=True, capture_output=True, text=True
    )
    peak_mib = int(out.stdout.split()[-1])
    assert peak_mib < 100, f"reading the header peaked at {peak_mib} MiB"


def test_bad_files_are_refused(tmp_path: Path, model_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(GGUFHeaderError, match="not a GGUF file"):
        read_header(text)
    truncated = tmp_path / "truncated.gguf"
    with model_path.open("rb") as f:
        truncated.write_bytes(f.read(4096))  # cut inside the vocabulary
    with pytest.raises(GGUFHeaderError, match="truncated"):
        read_header(truncated)
