"""Pieces that need no model: text assembly, the thermal-zone reader, settings precedence,
logprobs arithmetic, the deprecated engine.args flags."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ember_runtime.contract.config import EngineSettings
from ember_runtime.engines import sampling
from ember_runtime.engines.text import TextAssembler
from ember_runtime.prewarm.manifest import resolve_model_path
from ember_runtime.sensors import TemperatureSource, ThermalZoneReader
from ember_runtime.server import __main__ as server_main
from ember_runtime.server.settings import load_settings


def feed(assembler: TextAssembler, pieces: list[bytes]) -> tuple[str, bool]:
    out = ""
    for piece in pieces:
        text, stopped = assembler.push(piece)
        out += text
        if stopped:
            return out, True
    return out + assembler.flush(), False


def test_stop_string_split_across_tokens_is_not_emitted() -> None:
    text, stopped = feed(TextAssembler(("END",)), [b"abc E", b"N", b"D more"])
    assert (text, stopped) == ("abc ", True)


def test_partial_stop_prefix_is_released_when_it_diverges() -> None:
    assembler = TextAssembler(("END",))
    assert assembler.push(b"x EN") == ("x ", False)  # "EN" held back
    assert assembler.push(b"ough") == ("ENough", False)


def test_earliest_stop_wins() -> None:
    assert feed(TextAssembler(("b", "a")), [b"xxab"]) == ("xx", True)


def test_utf8_split_across_tokens() -> None:
    euro = "€".encode()
    text, stopped = feed(TextAssembler(()), [euro[:1], euro[1:2], euro[2:] + b"!"])
    assert (text, stopped) == ("€!", False)
    assembler = TextAssembler(())
    assert assembler.push(euro[:2]) == ("", False)


def make_zone(root: Path, name: str, kind: str, millis: str) -> None:
    zone = root / "class" / "thermal" / name
    zone.mkdir(parents=True)
    (zone / "type").write_text(kind + "\n")
    (zone / "temp").write_text(millis + "\n")


def test_thermal_zones_in_celsius(tmp_path: Path) -> None:
    make_zone(tmp_path, "thermal_zone0", "cpu-thermal", "51000")
    make_zone(tmp_path, "thermal_zone1", "gpu-thermal", "43500")
    make_zone(tmp_path, "thermal_zone2", "cpu-thermal", "50000")
    make_zone(tmp_path, "thermal_zone3", "broken", "n/a")
    reader = ThermalZoneReader(tmp_path)
    assert isinstance(reader, TemperatureSource)
    assert reader.read() == {
        "cpu-thermal": 51.0,
        "gpu-thermal": 43.5,
        "cpu-thermal/thermal_zone2": 50.0,
    }


def test_no_thermal_zones_reads_empty(tmp_path: Path) -> None:
    (tmp_path / "class" / "thermal").mkdir(parents=True)  # sysfs there, no zone in it
    assert ThermalZoneReader(tmp_path).read() == {}


def test_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "modelName: m\nmodelDir: /models\nserver: {port: 9000, maxQueue: 5}\n"
        "engine: {threads: 1, maxBatchSize: 8}\n"
    )
    monkeypatch.setenv("EMBER_MAX_QUEUE", "7")
    monkeypatch.setenv("EMBER_PORT", "9100")
    settings = load_settings(["--config", str(config), "--port", "9200"])
    assert settings.config.server.port == 9200  # flag beats env beats file
    assert settings.config.server.max_queue == 7
    assert settings.config.engine.max_batch_size == 8


def test_bad_override_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("modelName: m\nmodelDir: /models\n")
    with pytest.raises(ValueError, match="maxBatchSize"):
        load_settings(["--config", str(config), "--max-batch-size", "0"])


def test_config_and_log_level_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The names the operator's pod spec and the README use: $EMBER_CONFIG (the mounted
    ConfigMap, reloaded for the thermal policy) and $EMBER_LOG_LEVEL; kebab-case flags."""
    config = tmp_path / "config.yaml"
    config.write_text("modelName: m\nmodelDir: /models\nserver: {maxBodyBytes: 4096}\n")
    monkeypatch.setenv("EMBER_CONFIG", str(config))
    monkeypatch.setenv("EMBER_LOG_LEVEL", "debug")
    settings = load_settings(["--api-key-file", "/k", "--engine", "llamacpp"])
    assert settings.config_path == config
    assert settings.config.server.max_body_bytes == 4096
    assert settings.config.server.api_key_file == "/k"
    assert settings.log_level == "debug"


def test_a_bad_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert server_main.main(["--port", "eighty"]) == 2
    err = capsys.readouterr().err
    assert "invalid runtime settings" in err and "port" in err


def test_model_path_falls_back_to_a_gguf_in_model_dir(tmp_path: Path) -> None:
    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "a.gguf").write_bytes(b"")
    config = tmp_path / "config.yaml"
    config.write_text(f"modelName: m\nmodelDir: {tmp_path}\n")
    settings = load_settings(["--config", str(config)])
    assert resolve_model_path(settings.config) == tmp_path / "a.gguf"


def test_jinja_chat_template_path() -> None:
    from ember_runtime.engines.base import ChatMessage
    from ember_runtime.engines.chat import render_template

    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    rendered = render_template(
        template, [ChatMessage("user", "hi")], bos_token="<s>", eos_token="</s>"
    )
    assert rendered == "<s><|user|>hi</s><|assistant|>"
    with pytest.raises(ValueError, match="no tools"):
        render_template(template, [ChatMessage("tool", "x")], bos_token="", eos_token="")


def test_logprobs_are_a_log_softmax_with_the_best_first() -> None:
    row = np.array([1.0, 3.0, 2.0, 3.0 - np.log(2.0)], dtype=np.float32)
    chosen, top = sampling.logprobs(row, 2, 2)
    total = np.log(np.exp(row.astype(np.float64)).sum())
    assert chosen == pytest.approx(2.0 - total, abs=1e-6)
    assert [t for t, _ in top] == [1, 3]
    assert top[0][1] - top[1][1] == pytest.approx(np.log(2.0), abs=1e-6)
    assert sampling.logprobs(row, 0, 0)[1] == []
    assert sampling.greedy(row) == 1


def test_legacy_engine_args_still_work_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    default = EngineSettings().llamacpp_modes()
    assert (default.deterministic, default.prefix_cache, default.repack) == (False, None, None)
    assert EngineSettings(deterministic=True).llamacpp_modes().deterministic
    old = EngineSettings(args={"exactBatching": "true", "prefixCache": "false"})
    modes = old.llamacpp_modes()
    assert modes.deterministic and modes.prefix_cache is False and modes.repack is None
    assert "engine.args.exactBatching is deprecated" in caplog.text
    assert "engine.args.prefixCache is deprecated" in caplog.text
    fast = EngineSettings(args={"exactBatching": "false", "repack": "true"}).llamacpp_modes()
    assert not fast.deterministic and fast.repack
