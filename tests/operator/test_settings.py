"""Operator settings from the environment, written the way the README and the chart write them."""

from __future__ import annotations

from pathlib import Path

import pytest
from ember_operator.settings import OperatorSettings


def test_namespaces_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_OPERATOR_NAMESPACES", "a, b,,c")
    assert OperatorSettings().namespaces == ["a", "b", "c"]


def test_no_namespaces_means_the_whole_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_OPERATOR_NAMESPACES", "")
    assert OperatorSettings().namespaces == []


def test_model_roots_are_comma_separated_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_OPERATOR_MODEL_ROOTS", "/models,/var/lib/ember/models")
    assert OperatorSettings().model_roots == [Path("/models"), Path("/var/lib/ember/models")]


def test_scalars_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_OPERATOR_METRICS_PORT", "70000")
    with pytest.raises(ValueError, match="metrics_port"):
        OperatorSettings()
