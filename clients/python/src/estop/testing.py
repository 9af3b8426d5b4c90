"""Start a real `estop serve` on a temporary data directory (tests, examples, demos).

    with estop.testing.Daemon(policy=POLICY_TOML) as d:
        gate = d.gate()                 # an agent-token Estop handle
        d.operator.approve(run, key)    # an operator-token Client

The binary is $ESTOP_BIN, else `estop` on PATH, else it is built with `cargo build -p estop`
at the repository root (target/debug/estop). Readiness is the daemon's `estop ready …` line,
never a sleep.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from .client import Client
from .run import Estop

__all__ = ["Daemon", "find_binary", "DEFAULT_POLICY"]

_REPO = Path(__file__).resolve().parents[4]

#: Approval-needing tools for demos and tests: anything named like a money movement.
DEFAULT_POLICY = """
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
"""


def find_binary() -> str:
    """$ESTOP_BIN, else (in a checkout of the estop repository) `cargo build -p estop`, else
    `estop` on PATH."""
    env = os.environ.get("ESTOP_BIN")
    if env:
        return env
    built = _REPO / "target" / "debug" / "estop"
    if (_REPO / "Cargo.toml").exists() and (_REPO / "crates" / "cli").is_dir():
        subprocess.run(["cargo", "build", "-q", "-p", "estop"], cwd=_REPO, check=True)
        return str(built)
    found = shutil.which("estop")
    if found:
        return found
    raise FileNotFoundError("no estop binary: set ESTOP_BIN or put estop on PATH")


class Daemon:
    def __init__(self, policy: str | None = DEFAULT_POLICY, *, data: str | None = None, binary: str | None = None, tcp: bool = False, ready_timeout_s: float = 60.0, args: tuple[str, ...] = ()) -> None:
        self._tmp = None if data else tempfile.TemporaryDirectory(prefix="estop-")
        self.data = Path(data or self._tmp.name)  # type: ignore[union-attr]
        self.binary = binary or find_binary()
        self.policy = policy
        self.tcp = tcp
        self.ready_timeout_s = ready_timeout_s
        #: More `estop serve` options (e.g. `("--page-bytes-max", "600")`).
        self.args = tuple(args)
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, str] = {}
        self._operator: Client | None = None

    def start(self) -> "Daemon":
        cmd = [self.binary, "serve", "--data", str(self.data)]
        if self.policy is not None:
            pf = self.data / "policy.toml"
            pf.write_text(self.policy)
            cmd += ["--policy", str(pf)]
        if self.tcp:
            cmd += ["--listen", "127.0.0.1:0"]
        cmd += list(self.args)
        # The child holds its own copy of the descriptor: ours is closed at once.
        with open(self.data / "daemon.log", "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        line_box: list[str] = []

        def read_ready() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            line_box.append(self.proc.stdout.readline())

        t = threading.Thread(target=read_ready, daemon=True)
        t.start()
        t.join(self.ready_timeout_s)
        line = line_box[0] if line_box else ""
        if not line.startswith("estop ready"):
            self.stop()
            raise RuntimeError(f"estop serve did not get ready: {line!r}; see {self.data / 'daemon.log'}")
        self.ready = dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
        return self

    @property
    def socket(self) -> str:
        return self.ready["socket"]

    @property
    def addr(self) -> str | None:
        t = self.ready.get("tcp")
        return None if t in (None, "-") else t

    @property
    def agent_token(self) -> str:
        return (self.data / "agent.token").read_text().strip()

    @property
    def operator_token(self) -> str:
        return (self.data / "operator.token").read_text().strip()

    def gate(self, **kw: Any) -> Estop:
        return Estop(socket=self.socket, token=self.agent_token, **kw)

    def client(self, **kw: Any) -> Client:
        return Client(socket=self.socket, token=self.agent_token, **kw)

    @property
    def operator(self) -> Client:
        if self._operator is None:
            self._operator = Client(socket=self.socket, token=self.operator_token)
        return self._operator

    def env(self) -> dict[str, str]:
        return {"ESTOP_SOCKET": self.socket, "ESTOP_TOKEN": self.agent_token}

    def stop(self) -> None:
        if self._operator is not None:
            self._operator.close()
            self._operator = None
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None

    def kill9(self) -> None:
        """kill -9 (crash tests); `start()` again recovers from the same data directory."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()
