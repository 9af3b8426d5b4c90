"""The package as a user installs it: the pytest fixtures, a missing framework's error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points


def test_pytest_fixtures_start_a_throwaway_gate(tmp_path, daemon):
    (tmp_path / "test_mine.py").write_text(textwrap.dedent('''
        import estop

        def test_held(estop_gate, estop_operator, estop_run_id):
            @estop.effect(on_hold="raise")
            def wire_money(amount: int) -> str:
                return "wired"

            with estop_gate.run(estop_run_id):
                try:
                    wire_money(5)
                except estop.HeldForApproval:
                    pass
            assert [p["tool"] for p in estop_operator.pending(estop_run_id)] == ["wire_money"]
    '''))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESTOP_")}
    env["ESTOP_BIN"] = daemon.binary
    # Installed, the plugin loads by its entry point (pytest11); from a bare source tree, by name.
    installed = any(ep.value == "estop.pytest_plugin" for ep in entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "estop.pytest_plugin"]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", *plugin, "-p", "no:cacheprovider", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed" in p.stdout


def test_a_missing_framework_names_the_extra():
    code = textwrap.dedent('''
        import sys
        sys.modules["langgraph"] = None  # as if LangGraph were not installed
        try:
            import estop.adapters.langgraph
        except ImportError as e:
            print(e)
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "pip install 'estop-agents[langgraph]'" in out, out


def test_a_missing_crewai_names_its_extra():
    """CrewAI is not in the main venv (nor in `[all]`): its adapter says which extra to install."""
    code = textwrap.dedent('''
        import sys
        sys.modules["crewai"] = None  # as if CrewAI were not installed
        try:
            import estop.adapters.crewai
        except ImportError as e:
            print(e)
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "pip install 'estop-agents[crewai]'" in out, out
