"""LangChain (`langchain-openai`) against Ember's runtime: the langchain cases of the matrix in
tests/conformance/cases.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conformance.cases import Case, cases_of


@pytest.mark.parametrize("case", cases_of("langchain"), ids=lambda case: case.name)
def test_langchain(case: Case, run_case: Callable[[Case], None]) -> None:
    run_case(case)
