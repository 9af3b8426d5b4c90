"""pytest fixtures for your own agent's tests: a throwaway estop gate per test session.

Installed with the package (entry point `pytest11`), so the fixtures are there in any project
that has estop-agents installed:

    def test_refund_needs_approval(estop_gate, estop_operator):
        with estop_gate.run("t-1"):
            ...                                    # your agent, gated
        assert estop_operator.pending("t-1")

* `estop_daemon` (session): `estop serve` on a temporary data directory, from `$ESTOP_BIN` or
  `estop` on PATH, waited for by its ready line; stopped and removed after the session.
* `estop_policy` (session): the policy TOML it starts with — override the fixture in your
  conftest.py; the default is `estop.testing.DEFAULT_POLICY` (`wire_money` needs approval).
* `estop_gate`: an agent-token `estop.Estop` handle; `estop_operator`: an operator-token
  `estop.Client` (approve, reject, cancel, report); `estop_run_id`: a fresh run id per test.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

from .client import Client
from .run import Estop
from .testing import DEFAULT_POLICY, Daemon


@pytest.fixture(scope="session")
def estop_policy() -> str:
    return DEFAULT_POLICY


@pytest.fixture(scope="session")
def estop_daemon(estop_policy: str) -> Iterator[Daemon]:
    try:
        d = Daemon(policy=estop_policy)
    except FileNotFoundError as e:
        pytest.fail(f"estop fixtures need the estop binary: {e}", pytrace=False)
    d.start()
    yield d
    d.cleanup()


@pytest.fixture
def estop_gate(estop_daemon: Daemon) -> Iterator[Estop]:
    g = estop_daemon.gate()
    yield g
    g.close()


@pytest.fixture
def estop_operator(estop_daemon: Daemon) -> Client:
    return estop_daemon.operator


@pytest.fixture
def estop_run_id(request: Any) -> str:
    return f"{request.node.name[:60]}-{uuid.uuid4().hex[:8]}"
