"""The test session's real gate: one `estop serve` on a temp dir, shared by every test."""

from __future__ import annotations

import uuid

import pytest

import estop
from estop.testing import Daemon

POLICY = """
[defaults]
unknown_tool = "allow"
approval_expiry = "10m"

[[rules]]
tool = "lookup*"
action = "allow"
class = "read"

[[rules]]
tool = "wire_money"
action = "approve"

[[rules]]
tool = "drop_*"
action = "deny"

# The reverse saga's lookup of an unknown outcome (test_compensation.py).
[[rules]]
tool = "saga_pay"
action = "allow"
compensate = "unpay"
compensate_args = '{"payment": result.id}'
lookup = "find_payment"
"""


@pytest.fixture(scope="session")
def daemon():
    d = Daemon(policy=POLICY, tcp=True)
    d.start()
    yield d
    d.cleanup()


@pytest.fixture
def gate(daemon):
    g = daemon.gate()
    yield g
    g.close()


@pytest.fixture
def operator(daemon):
    return daemon.operator


@pytest.fixture
def run_id(request):
    return f"{request.node.name[:60]}-{uuid.uuid4().hex[:8]}"
