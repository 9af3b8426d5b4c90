"""PydanticAI: gated tools (a toolset wrapper), approval tools decided in estop, run cancel/timeout → estop cancel.

    from estop.adapters import pydantic_ai as ep

    agent = Agent(model, toolsets=[ep.EstopToolset(FunctionToolset([wire_money, send_email]))])
    ep.gate_agent(agent)     # or gate the tools registered with @agent.tool / @agent.tool_plain
    result = await ep.run(agent, "refund order 42", gate=gate, run_id="order-42")

* Every tool call is admitted by the gate first; the tool runs only on `admitted`; a duplicate
  (a replayed or retried run) returns the recorded result.
* Tools declared `requires_approval=True` (deferred approval tools) are no longer deferred by
  PydanticAI: the approval is an estop approval decided by an operator, and the call — with its
  siblings of the same turn — waits for it (`on_hold="wait"`, the default). With
  `on_hold="defer"` a hold raises PydanticAI's `ApprovalRequired` instead, so the run ends with
  `DeferredToolRequests`; run it again with the message history once the operator decided (the
  same call presents the same key).
* A refusal is returned to the model as the tool's output (`ModelRetry` would make it try again);
  a stopped run raises `RunStopped`. `run`/`run_sync` turn a cancel or timeout into an estop cancel.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.exceptions import ApprovalRequired
from pydantic_ai.toolsets import AbstractToolset, WrapperToolset

from ..effect import make_call, run_async
from ..errors import HeldForApproval, Refused, RunStopped
from ..run import Estop, Run, current_run
from ._common import STOP_SIGNALS, arun_guarded, hold_payload, resolve_run, run_guarded

__all__ = ["EstopToolset", "gate_agent", "run", "run_sync"]


async def _gated_call(owner: Any, inner_call: Any, name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
    run = current_run()
    assert run is not None
    call = make_call(run, owner.effects.get(name, name), tool_args, needs_approval=name in owner._approval)
    try:
        return await run_async(call, lambda: inner_call(name, tool_args, ctx, tool), on_hold="raise" if owner.on_hold == "defer" else "wait", hold_timeout_s=owner.hold_timeout_s)
    except HeldForApproval as h:
        raise ApprovalRequired(metadata=hold_payload(h, tool_args)) from None
    except RunStopped:
        raise
    except Refused as e:
        if not owner.refusal_as_output:
            raise
        return f"estop refused this call ({e.reason}); do not retry it"


async def _gated_tools(owner: Any, tools: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, t in tools.items():
        if t.tool_def.kind == "unapproved":
            owner._approval.add(name)
            t = dataclasses.replace(t, tool_def=dataclasses.replace(t.tool_def, kind="function"))
        out[name] = t
    return out


@dataclass
class EstopToolset(WrapperToolset[Any]):
    """Wraps a toolset so that every call is admitted by estop first."""

    effects: dict[str, str] = field(default_factory=dict)
    on_hold: str = "wait"
    hold_timeout_s: float | None = None
    refusal_as_output: bool = True
    _approval: set[str] = field(default_factory=set)

    async def get_tools(self, ctx: Any) -> dict[str, Any]:
        return await _gated_tools(self, await self.wrapped.get_tools(ctx))

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
        return await _gated_call(self, self.wrapped.call_tool, name, tool_args, ctx, tool)


@dataclass
class _Options:
    effects: dict[str, str] = field(default_factory=dict)
    on_hold: str = "wait"
    hold_timeout_s: float | None = None
    refusal_as_output: bool = True
    _approval: set[str] = field(default_factory=set)


def gate_agent(agent: Any, *, effects: dict[str, str] | None = None, on_hold: str = "wait", hold_timeout_s: float | None = None, refusal_as_output: bool = True) -> Any:
    """Gates the tools registered on the agent itself (`@agent.tool`, `tools=[...]`), in place.
    (PydanticAI has no public hook for that toolset; this wraps its two methods on the instance.)"""
    ts: AbstractToolset[Any] = agent._function_toolset
    if getattr(ts, "__estop_gated__", False):
        return agent
    opts = _Options(effects=dict(effects or {}), on_hold=on_hold, hold_timeout_s=hold_timeout_s, refusal_as_output=refusal_as_output)
    get_tools, call_tool = ts.get_tools, ts.call_tool

    async def gated_get_tools(ctx: Any) -> dict[str, Any]:
        return await _gated_tools(opts, await get_tools(ctx))

    async def gated_call_tool(name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
        return await _gated_call(opts, call_tool, name, tool_args, ctx, tool)

    object.__setattr__(ts, "get_tools", gated_get_tools)
    object.__setattr__(ts, "call_tool", gated_call_tool)
    object.__setattr__(ts, "__estop_gated__", True)
    return agent


async def run(agent: Any, prompt: Any = None, *, gate: Estop | None = None, run_id: str | Run | None = None, timeout_s: float | None = None, stop_on: tuple[type[BaseException], ...] = STOP_SIGNALS, **kw: Any) -> Any:
    """`agent.run(...)` inside the estop run `run_id`; a cancel/timeout cancels the run at the gate."""
    r = resolve_run(gate, run_id)

    async def go() -> Any:
        coro = agent.run(prompt, **kw)
        return await (asyncio.wait_for(coro, timeout_s) if timeout_s else coro)

    return await arun_guarded(r, go, stop_on=stop_on)


def run_sync(agent: Any, prompt: Any = None, *, gate: Estop | None = None, run_id: str | Run | None = None, stop_on: tuple[type[BaseException], ...] = STOP_SIGNALS, **kw: Any) -> Any:
    r = resolve_run(gate, run_id)
    return run_guarded(r, lambda: asyncio.run(run(agent, prompt, run_id=r, stop_on=stop_on, **kw)), stop_on=stop_on)
