"""Where the gate is and who we are, from arguments or the environment.

ESTOP_SOCKET (Unix socket path) or ESTOP_ADDR (host:port, protocol v1 over TCP), ESTOP_TOKEN (the
token's secret, or ESTOP_TOKEN_FILE naming a file holding it), ESTOP_RUN (the default run id),
ESTOP_DATA (a data directory: its estop.sock and agent.token are used when nothing else is given).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    socket: str | None = None
    addr: tuple[str, int] | None = None
    token: str | None = None
    run: str | None = None

    @staticmethod
    def from_env(
        socket: str | None = None,
        addr: str | tuple[str, int] | None = None,
        token: str | None = None,
        run: str | None = None,
        env: dict[str, str] | None = None,
    ) -> "Config":
        e = os.environ if env is None else env
        data = e.get("ESTOP_DATA")
        if socket is None and addr is None:
            socket = e.get("ESTOP_SOCKET") or None
            addr = e.get("ESTOP_ADDR") or None
            if socket is None and addr is None and data:
                socket = str(Path(data) / "estop.sock")
        if token is None:
            token = e.get("ESTOP_TOKEN") or None
            if token is None and e.get("ESTOP_TOKEN_FILE"):
                token = Path(e["ESTOP_TOKEN_FILE"]).read_text().strip()
            if token is None and data and (Path(data) / "agent.token").exists():
                token = (Path(data) / "agent.token").read_text().strip()
        if run is None:
            run = e.get("ESTOP_RUN") or None
        parsed: tuple[str, int] | None = None
        if isinstance(addr, str):
            host, _, port = addr.rpartition(":")
            parsed = (host.strip("[]") or "127.0.0.1", int(port))
        elif addr is not None:
            parsed = (addr[0], int(addr[1]))
        if socket is None and parsed is None:
            raise ValueError(
                "no gate address: set ESTOP_SOCKET (Unix socket) or ESTOP_ADDR (host:port), "
                "or ESTOP_DATA (the daemon's data directory)"
            )
        return Config(socket=socket, addr=parsed, token=token, run=run)
