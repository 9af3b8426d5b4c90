"""Every framework × failure class: the leak happens without estop and not with the adapter."""

from __future__ import annotations

import importlib

import pytest

from .scenarios.common import CLASSES, EXTRA_CLASSES, new_trial

FRAMEWORKS = {
    "langgraph": "tests.scenarios.lg",
    "openai-agents": "tests.scenarios.oai",
    "pydantic-ai": "tests.scenarios.pyd",
    "llamaindex-workflows": "tests.scenarios.lli",
    "agent-framework": "tests.scenarios.maf",
    "langchain": "tests.scenarios.lc",
    "google-adk": "tests.scenarios.adk",
}


def _scenario(framework: str, klass: str):
    mod = importlib.import_module(FRAMEWORKS[framework])
    return mod.SCENARIOS[klass]


def _cells() -> list[tuple[str, str]]:
    """Every framework × every shared class, and the framework-specific classes it has."""
    return [(fw, k) for fw in FRAMEWORKS for k in CLASSES + EXTRA_CLASSES if k in importlib.import_module(FRAMEWORKS[fw]).SCENARIOS]


@pytest.mark.parametrize(("framework", "klass"), _cells())
def test_leaks_without_estop(daemon, framework, klass):
    """The scenarios reach the leaky window by construction; a loaded machine gets 3 tries."""
    fn = _scenario(framework, klass)
    leaks = [fn(new_trial(daemon, framework, klass), False) for _ in range(1)]
    while not any(leaks) and len(leaks) < 3:
        leaks.append(fn(new_trial(daemon, framework, klass), False))
    assert any(leaks), "expected the framework alone to leak"


@pytest.mark.parametrize(("framework", "klass"), _cells())
def test_no_leak_with_estop(daemon, framework, klass):
    fn = _scenario(framework, klass)
    assert fn(new_trial(daemon, framework, klass), True) == 0
