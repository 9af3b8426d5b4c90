"""`estop mcp` between the official Python MCP SDK's client and an upstream on the same SDK
(tests/mcp/upstream.py): the binary on stdio, the daemon real, the upstream's log the proof of
what reached it."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from estop.testing import Daemon, find_binary

POLICY = """
[defaults]
unknown_tool = "deny"

[[rules]]
tool = "py__add"
action = "allow"
class = "read"

[[rules]]
tool = "py__pay"
when = "args.amount > 100"
action = "approve"

[[rules]]
tool = "py__pay"
action = "allow"

[[rules]]
tool = "py__block"
action = "allow"
"""

UPSTREAM = Path(__file__).parent / "mcp" / "upstream.py"


@pytest.fixture(scope="module")
def mcp_daemon():
    d = Daemon(policy=POLICY)
    d.start()
    yield d
    d.cleanup()


class Gateway:
    def __init__(self, daemon: Daemon, tmp: Path, hold_ms: int = 100) -> None:
        self.daemon = daemon
        self.run = f"py-mcp-{uuid.uuid4().hex[:8]}"
        self.log = tmp / "upstream.log"
        self.log.touch()
        config = tmp / "mcp.toml"
        config.write_text(
            f"[gateway]\nhold_ms = {hold_ms}\n\n[[server]]\nname = \"py\"\n"
            f"command = {sys.executable!r}\nargs = [{str(UPSTREAM)!r}]\n"
            f"trusted = true\nenv = {{ FIXTURE_LOG = {str(self.log)!r} }}\n"
        )
        self.params = StdioServerParameters(
            command=find_binary(),
            args=["mcp", "--config", str(config), "--data", str(daemon.data), "--run", self.run],
        )

    def upstream(self) -> list[str]:
        return self.log.read_text().splitlines()

    async def upstream_logged(self, line: str) -> None:
        deadline = time.monotonic() + 30
        while line not in self.upstream():
            assert time.monotonic() < deadline, f"the upstream never logged {line!r}: {self.upstream()}"
            await anyio.sleep(0.01)


def text(result: Any) -> str:
    return "".join(c.text for c in result.content if getattr(c, "type", "") == "text")


def session(gw: Gateway) -> Any:
    """Runs `body(session)` with a Python SDK client session on `estop mcp`."""

    async def go(body: Any) -> Any:
        async with stdio_client(gw.params) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                return await body(s)

    return go


def test_python_client_and_upstream_allowed_replayed_held_and_approved(mcp_daemon, tmp_path):
    gw = Gateway(mcp_daemon, tmp_path)

    async def body(s: Any) -> None:
        tools = await s.list_tools()
        assert sorted(t.name for t in tools.tools) == ["py__add", "py__block", "py__pay"]
        r = await s.call_tool("py__add", {"a": 2, "b": 3})
        assert (text(r), r.is_error) == ("5", False)
        r = await s.call_tool("py__pay", {"to": "ann", "amount": 5})
        assert text(r) == "paid 5 to ann"
        r = await s.call_tool("py__pay", {"to": "ann", "amount": 5})
        assert text(r) == "paid 5 to ann"
        assert gw.upstream() == ["call add 2 3", "call pay ann 5"], "the repeat was replayed"
        r = await s.call_tool("py__pay", {"to": "bob", "amount": 500})
        assert r.is_error and text(r).startswith("HELD, not run"), text(r)
        [pending] = mcp_daemon.operator.pending(run=gw.run)
        assert f"estop approve {gw.run} {pending['key']}" in text(r)
        mcp_daemon.operator.approve(gw.run, pending["key"])
        r = await s.call_tool("py__pay", {"to": "bob", "amount": 500})
        assert text(r) == "paid 500 to bob"
        assert gw.upstream() == ["call add 2 3", "call pay ann 5", "call pay bob 500"]

    anyio.run(session(gw), body)


def test_python_client_cancel_reaches_the_python_upstream(mcp_daemon, tmp_path):
    gw = Gateway(mcp_daemon, tmp_path)

    async def body(s: Any) -> None:
        async with anyio.create_task_group() as tg:

            async def blocked() -> None:
                await s.call_tool("py__block", {})

            tg.start_soon(blocked)
            await gw.upstream_logged("call block")
            tg.cancel_scope.cancel()
        await gw.upstream_logged("cancelled block")
        deadline = time.monotonic() + 30
        while not mcp_daemon.operator.report(gw.run).get("unknown"):
            assert time.monotonic() < deadline, "the cancel was never recorded"
            await anyio.sleep(0.01)

    anyio.run(session(gw), body)


def test_an_estop_cancel_cuts_the_python_upstream_call(mcp_daemon, tmp_path):
    gw = Gateway(mcp_daemon, tmp_path)

    async def body(s: Any) -> None:
        result: dict[str, Any] = {}

        async def blocked() -> None:
            result["r"] = await s.call_tool("py__block", {})

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked)
            await gw.upstream_logged("call block")
            mcp_daemon.operator.cancel(gw.run, reason="enough")
        r = result["r"]
        assert r.is_error and "the run was stopped" in text(r), text(r)
        await gw.upstream_logged("cancelled block")
        r = await s.call_tool("py__add", {"a": 1, "b": 1})
        assert r.is_error and text(r).startswith("REFUSED, not run"), text(r)

    anyio.run(session(gw), body)
