"""Shared by the examples: a gate to talk to, and an operator who decides held effects.

With ESTOP_SOCKET (or ESTOP_ADDR) and ESTOP_TOKEN set, the examples use your daemon and you
decide with `estop approve RUN KEY` / `estop reject RUN KEY` (pass --human). Otherwise they
start a throwaway `estop serve` (ESTOP_BIN, `estop` on PATH, or a cargo build in this repo)
and play the operator themselves, printing the command a person would type.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import estop  # noqa: E402
from estop.testing import DEFAULT_POLICY, Daemon  # noqa: E402

HUMAN = "--human" in sys.argv


def gate() -> tuple[estop.Estop, estop.Client | None]:
    """The agent's gate handle and, when we play the operator, an operator client."""
    if os.environ.get("ESTOP_SOCKET") or os.environ.get("ESTOP_ADDR"):
        data = os.environ.get("ESTOP_DATA")
        op = None
        if data and (Path(data) / "operator.token").exists() and not HUMAN:
            op = estop.Client(token=(Path(data) / "operator.token").read_text().strip())
        return estop.Estop(), op
    d = Daemon(policy=DEFAULT_POLICY).start()
    atexit.register(d.cleanup)
    print(f"(started a throwaway gate: estop serve --data {d.data})")
    return d.gate(), d.operator


def operator_decides(op: estop.Client | None, run: str, decision: str = "approve", after_s: float = 1.0) -> threading.Thread:
    """Waits for a pending approval in `run`, shows it, and decides it (or asks you to)."""

    def go() -> None:
        while True:
            try:
                pending = (op or estop.Client()).pending(run)
            except estop.NotFound:
                pending = []
            if pending:
                break
            time.sleep(0.05)
        p = pending[0]
        print(f"  [estop] held for approval: {p['tool']}({p.get('args')}) digest {p['digest'][:12]}…")
        print(f"  [estop] operator: estop {decision} {run} {p['key']}")
        if op is None:
            return  # --human: you type it
        time.sleep(after_s)
        op.decide(run, p["key"], decision)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th
