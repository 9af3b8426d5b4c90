"""An upstream MCP server on the official Python SDK, for `estop mcp`'s tests: it appends one line
to $FIXTURE_LOG for every call it receives and every cancel it sees."""

from __future__ import annotations

import os

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("py-upstream")


def log(line: str) -> None:
    with open(os.environ["FIXTURE_LOG"], "a", encoding="utf-8") as f:
        f.write(line + "\n")


@server.tool(description="Adds two numbers.", annotations=ToolAnnotations(readOnlyHint=True))
def add(a: int, b: int) -> str:
    log(f"call add {a} {b}")
    return str(a + b)


@server.tool(description="Sends a payment.", annotations=ToolAnnotations(destructiveHint=True))
def pay(to: str, amount: int) -> str:
    log(f"call pay {to} {amount}")
    return f"paid {amount} to {to}"


@server.tool(description="Runs until cancelled.")
async def block() -> str:
    log("call block")
    try:
        await anyio.sleep_forever()
    except anyio.get_cancelled_exc_class():
        log("cancelled block")
        raise
    return "unreachable"


if __name__ == "__main__":
    server.run()
