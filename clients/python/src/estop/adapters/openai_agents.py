"""OpenAI Agents SDK: gated function tools, `needs_approval` decided by an estop operator,
runner cancel/timeout → estop cancel.

    from estop.adapters import openai_agents as eo

    agent = Agent(name="ops", tools=eo.gate_tools([wire_money, send_email]))
    result = await eo.run(agent, "refund order 42", gate=gate, run_id="order-42")

* Every call of a gated tool is admitted by the gate first (tool name → effect name, the parsed
  arguments → its digest); the tool body runs only on `admitted`; its return value is the
  effect's recorded result, returned again (not re-run) when the same call comes back on a
  replay, a resumed `RunState` or a retried job. The key is the SDK's `call_id` (+ the digest),
  so it does not depend on what ran before it; `@estop.effect`s the body calls are keyed from
  the call too.
* A tool's `needs_approval` (bool or callable) no longer interrupts the SDK run: it becomes an
  estop approval (`needs_approval` on admit; the gate's policy may require one anyway), decided by
  an operator (`estop approve RUN KEY`, the console). The call waits for the decision, and so do
  its siblings of the same turn (a pause is a whole pause). A rejection or other refusal is
  returned to the model as the tool's output; a stopped run raises `RunStopped`.
* `run`/`run_sync`/`run_streamed` are invocations of the estop run: a cancel of the awaiting
  task, a timeout (`timeout_s`, a tool's `timeout_seconds` with `timeout_behavior=
  "raise_exception"`), breaking out of `stream_events()` or Ctrl-C *interrupts* the invocation —
  tool threads the SDK cannot stop refuse new effects — and the run stays usable for the next
  turn. The SDK's explicit stop, `streamed.cancel()`, cancels the run at the gate (`immediate`:
  at once; `after_turn`: when the turn has finished), as do `run.cancel()` and an operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
from typing import Any, Iterable

from agents import Runner
from agents.tool import FunctionTool

from ..effect import call_key, make_call, run_async
from ..errors import Interrupted, Refused, RunStopped
from ..run import Estop, Invocation, Run, current_run, step
from ._common import STOP_ON as _NO_STOP, arun_guarded, resolve_run, run_guarded

__all__ = ["EstopStreamedRun", "gate_tool", "gate_tools", "run", "run_streamed", "run_sync", "STOP_ON"]

#: Exceptions that cancel the run by default: none (a timeout, the SDK's `ToolTimeoutError`, a
#: task cancel or Ctrl-C interrupt the invocation; `EstopStreamedRun.cancel()` and
#: `run.cancel()` stop the run).
STOP_ON: tuple[type[BaseException], ...] = _NO_STOP


def gate_tool(tool: FunctionTool, *, effect: str | None = None, on_hold: str = "wait", hold_timeout_s: float | None = None, refusal_as_output: bool = True) -> FunctionTool:
    """A copy of `tool` whose every call is admitted by estop first. `effect` names the effect
    at the gate (default: the tool's name)."""
    if getattr(tool, "__estop_gated__", False):
        return tool
    name = effect or tool.name
    inner = tool.on_invoke_tool
    approval = tool.needs_approval

    async def on_invoke_tool(ctx: Any, arguments: str) -> Any:
        args = json.loads(arguments) if arguments else {}
        na: Any = bool(approval)
        if callable(approval):
            na = approval(ctx, args, getattr(ctx, "tool_call_id", ""))
            if inspect.isawaitable(na):
                na = await na
        run = current_run()
        assert run is not None
        call_id = getattr(ctx, "tool_call_id", None)
        key = call_key(run, name, call_id, args) if call_id else None
        call = make_call(run, name, args, key=key, needs_approval=bool(na))
        try:
            # Effects the body gates itself (`@estop.effect`) take their keys from this call.
            with step(f"call:{call_id}") if call_id else contextlib.nullcontext():
                return await run_async(call, lambda: inner(ctx, arguments), on_hold=on_hold, hold_timeout_s=hold_timeout_s)
        except (RunStopped, Interrupted):
            raise
        except Refused as e:
            if not refusal_as_output:
                raise
            return f"estop refused this call ({e.reason}); do not retry it"

    gated = dataclasses.replace(tool, on_invoke_tool=on_invoke_tool, needs_approval=False)
    object.__setattr__(gated, "__estop_gated__", True)
    return gated


def gate_tools(tools: Iterable[Any], *, effects: dict[str, str] | None = None, **kw: Any) -> list[Any]:
    """`gate_tool` for every FunctionTool in `tools` (others are passed through). `effects` maps
    a tool name to the effect it performs at the gate (e.g. two tools that move money)."""
    eff = effects or {}
    return [gate_tool(t, effect=eff.get(t.name), **kw) if isinstance(t, FunctionTool) else t for t in tools]


async def run(agent: Any, input: Any, *, gate: Estop | None = None, run_id: str | Run | None = None, parent: Run | str | None = None, timeout_s: float | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, **runner_kw: Any) -> Any:
    """`Runner.run` inside the estop run `run_id`."""
    r = resolve_run(gate, run_id, parent=parent) if parent else resolve_run(gate, run_id)

    async def go() -> Any:
        coro = Runner.run(agent, input, **runner_kw)
        return await (asyncio.wait_for(coro, timeout_s) if timeout_s else coro)

    return await arun_guarded(r, go, stop_on=stop_on)


def run_sync(agent: Any, input: Any, *, gate: Estop | None = None, run_id: str | Run | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, **runner_kw: Any) -> Any:
    """`Runner.run_sync` inside the estop run `run_id`."""
    r = resolve_run(gate, run_id)
    return run_guarded(r, lambda: asyncio.run(run(agent, input, run_id=r, stop_on=stop_on, **runner_kw)), stop_on=stop_on)


class EstopStreamedRun:
    """`Runner.run_streamed` as an estop run: `cancel()` fences the run at the gate first (every
    thread and task of it refuses from that instant), then cancels the SDK's stream."""

    def __init__(self, result: Any, run: Run, invocation: Invocation) -> None:
        self.result = result
        self.run = run
        self.invocation = invocation
        self._after_turn: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.result, name)

    async def stream_events(self) -> Any:
        async with self.run:
            try:
                async for ev in self.result.stream_events():
                    yield ev
            except BaseException as e:
                # Breaking out of the stream, a cancel, Ctrl-C: this invocation is over (the SDK's
                # background task and its tool threads start nothing more); the run is not.
                self.invocation.interrupt(f"{type(e).__name__} in the agent process", spare=asyncio.current_task())
                raise
        if self._after_turn is not None:
            # `cancel("after_turn")`: the turn has finished; now the run is stopped.
            await self.run.acancel(self._after_turn)

    def cancel(self, mode: str = "immediate", reason: str = "cancelled by the caller") -> None:
        """The SDK's explicit stop, and estop's: `immediate` fences the run at once (every thread
        and task of it refuses from this instant) and cancels it at the gate; `after_turn` lets
        the current turn finish (its tools run) and cancels the run when the stream ends."""
        if mode == "after_turn":
            self._after_turn = reason
            self.result.cancel(mode)
            return
        from ..run import FENCES

        FENCES.fence(self.run.id, "cancelled", spare=asyncio.current_task())
        loop = asyncio.get_running_loop()
        loop.create_task(self.run.acancel(reason))
        self.result.cancel(mode)


def run_streamed(agent: Any, input: Any, *, gate: Estop | None = None, run_id: str | Run | None = None, **runner_kw: Any) -> EstopStreamedRun:
    """`Runner.run_streamed` inside the estop run `run_id` (call it in a running loop)."""
    r = resolve_run(gate, run_id)
    inv = Invocation(r)
    with r, inv:  # the SDK's background task copies this context: its tools see run and invocation
        result = Runner.run_streamed(agent, input, **runner_kw)
    return EstopStreamedRun(result, r, inv)
