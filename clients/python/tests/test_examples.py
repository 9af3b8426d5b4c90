"""The examples run as a new user would run them (each starts its own throwaway gate)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*_example.py")))
def test_example_runs(name, daemon):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESTOP_") or k == "ESTOP_BIN"}
    env.setdefault("ESTOP_BIN", daemon.binary)
    p = subprocess.run([sys.executable, name], cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
