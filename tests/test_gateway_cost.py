"""The gateway's own work per request stays within the instruction budget kept in loadtest/gateway_budget.json.

Counted in instructions (valgrind's callgrind, only the measured requests instrumented) for a fixed mix of chat requests
through the in-process app: the same count on a loaded machine as on a quiet one, so a slowdown fails here wherever it
runs. The budget is raised only in a commit that says why, with BENCHMARKS' figures (python -m loadtest.gateway_cost --record)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from loadtest import gateway_cost

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="callgrind counts on Linux")


@pytest.fixture(scope="module")
def measured() -> dict[str, float]:
    assert shutil.which("valgrind"), "valgrind is missing: `make setup` installs it (apt package valgrind)"
    return gateway_cost.count_instructions(100, planted=True)


def budget() -> dict:
    return json.loads(gateway_cost.BUDGET.read_text())


def test_the_gateway_stays_within_its_instruction_budget(measured):
    assert gateway_cost.check(measured, budget()) == [], (
        "the gateway's work per request grew past its budget: find the cause (python -m loadtest.gateway_cost --profile), "
        f"or raise the budget in a commit that says why; measured {measured}")


def test_a_planted_slowdown_fails_the_budget(measured):
    """The same mix with about a quarter more work planted in the gateway's bounds check: the check names the configuration."""
    with_plant = {"open": measured["open"], "keys": measured["planted"]}
    over = gateway_cost.check(with_plant, budget())
    assert len(over) == 1 and over[0].startswith("keys:"), over
    assert measured["planted"] > 1.15 * measured["keys"]  # the plant is big enough to be caught at any budget in reach
