"""LangChain `create_agent`: one middleware gates every tool call; a hold is LangGraph's own
`interrupt()` (a `HumanInterrupt`), decided by an estop operator; the agent graph runs as an
estop run (run = thread id).

    from langchain.agents import create_agent
    from estop.adapters import langchain as elc

    agent = elc.EstopAgent(create_agent(model, tools=[wire_money, send_email],
                                        middleware=[elc.EstopMiddleware(approval={"wire_money"})],
                                        checkpointer=saver), gate)
    config = {"configurable": {"thread_id": "order-42"}}
    out = agent.invoke({"messages": [("user", "refund order 42")]}, config)
    if "__interrupt__" in out:                  # the operator decides in estop
        agent.wait_for_decision(config); out = agent.resume(config)

* `EstopMiddleware` is an `AgentMiddleware` whose `wrap_tool_call` / `awrap_tool_call` (the
  middleware's public tool hook) are LangGraph's ToolNode gate (`el.gate_tool_calls`): every
  call admitted by estop first, keyed by the model's `tool_call_id` (+ the digest), the model
  turn's calls all admitted before any starts, a hold raised as `interrupt()` with a
  `HumanInterrupt` payload (`on_hold="wait"`: blocks instead), a refusal returned to the model as
  the tool's error message, a stopped run raised.
* `EstopAgent` is `el.EstopGraph`: `invoke`/`ainvoke`/`stream`/`astream` are invocations of the
  run — a closed stream, a timeout, Ctrl-C or a task cancel interrupts the invocation and the
  thread goes on; `agent.cancel(config)` or an operator stops it. `wait_for_decision` /
  `await_decision` return when the operator decided (gate events), then `resume`.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Iterable

from ._common import missing_extra

try:
    from langchain.agents.middleware import AgentMiddleware
except ImportError as e:
    raise missing_extra("langchain", "LangChain (create_agent)", "langchain", e) from e

from ..client import Client
from .langgraph import EstopGraph, gate_tool_calls

__all__ = ["EstopAgent", "EstopMiddleware"]

#: The compiled `create_agent` graph as an estop run (see `el.EstopGraph`).
EstopAgent = EstopGraph


class EstopMiddleware(AgentMiddleware):  # type: ignore[misc]
    """Gates every tool call of a `create_agent` agent through estop (see the module doc)."""

    def __init__(self, *, effects: dict[str, str] | None = None, approval: Iterable[str] = (), skip: Iterable[str] = (), on_hold: str = "interrupt", hold_timeout_s: float | None = None, approver: Client | None = None) -> None:
        super().__init__()
        self._wrap, self._awrap = gate_tool_calls(effects=effects, approval=approval, skip=skip, on_hold=on_hold, hold_timeout_s=hold_timeout_s, approver=approver)

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        return self._wrap(request, handler)

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        return await self._awrap(request, handler)
