"""LiteLLM against Ember's runtime: the litellm cases of the matrix in
tests/conformance/cases.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conformance.cases import Case, cases_of


@pytest.mark.parametrize("case", cases_of("litellm"), ids=lambda case: case.name)
def test_litellm(case: Case, run_case: Callable[[Case], None]) -> None:
    run_case(case)
