"""Microsoft Agent Framework: a function middleware that admits every tool call through estop,
tools with `approval_mode="always_require"` decided by an estop operator, run cancel/timeout →
estop cancel.

    from estop.adapters import agent_framework as eaf

    agent = Agent(client=chat_client, tools=eaf.gate_tools([wire_money, send_email]),
                  middleware=[eaf.EstopMiddleware()])
    response = await eaf.run(agent, "refund order 42", gate=gate, run_id="order-42")

* `EstopMiddleware` runs around each function invocation: admit (tool name → effect name, the
  normalized arguments → digest; key: the framework's `call_id` + the digest) → wait while held
  → the tool → complete. A duplicate returns the recorded result. A refusal becomes the tool's result (the model reads it); a stopped run raises
  `MiddlewareFailure`, which aborts the run fail-closed.
* `gate_tools` turns `approval_mode="always_require"` into an estop approval: the framework's
  function loop no longer stops with approval requests; the call (and its siblings, whole-run
  hold) waits for the operator's decision in estop (`estop approve RUN KEY`, the console).
* `run` runs the agent as an invocation of the estop run: a task cancel, `timeout_s` or Ctrl-C
  interrupts the invocation and the run stays usable; `run.cancel()` or an operator stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from typing import Any, Awaitable, Callable, Iterable

from ._common import missing_extra

try:
    from agent_framework import FunctionInvocationContext, FunctionMiddleware, MiddlewareFailure
except ImportError as e:
    raise missing_extra("agent_framework", "Microsoft Agent Framework", "agent-framework", e) from e

from ..effect import call_key, make_call, run_async
from ..errors import Interrupted, Refused, RunStopped
from ..run import Estop, Run, current_run, step
from ._common import STOP_ON, arun_guarded, resolve_run

__all__ = ["EstopMiddleware", "gate_tools", "run", "run_workflow", "APPROVAL_ATTR"]

APPROVAL_ATTR = "__estop_needs_approval__"


def gate_tools(tools: Iterable[Any]) -> list[Any]:
    """Copies of `tools` whose framework approval (`always_require`) becomes an estop approval."""
    out = []
    for t in tools:
        if getattr(t, "approval_mode", None) == "always_require":
            t = copy.copy(t)
            t.approval_mode = "never_require"
            setattr(t, APPROVAL_ATTR, True)
        out.append(t)
    return out


def _text(result: Any) -> Any:
    if isinstance(result, (str, int, float, bool)) or result is None:
        return result
    if isinstance(result, list):
        parts = [getattr(c, "text", None) for c in result]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)  # type: ignore[arg-type]
    return repr(result)


class EstopMiddleware(FunctionMiddleware):
    """Admits every function call through estop (see the module doc)."""

    def __init__(self, *, effects: dict[str, str] | None = None, approval: Iterable[str] = (), hold_timeout_s: float | None = None, refusal_as_output: bool = True) -> None:
        self.effects = dict(effects or {})
        self.approval = set(approval)
        self.hold_timeout_s = hold_timeout_s
        self.refusal_as_output = refusal_as_output

    async def process(self, context: FunctionInvocationContext, call_next: Callable[[], Awaitable[None]]) -> None:
        fn = context.function
        name = fn.name
        args = context.arguments
        if hasattr(args, "model_dump"):
            args = args.model_dump(mode="json")
        run = current_run()
        assert run is not None
        needs = bool(getattr(fn, APPROVAL_ATTR, False)) or name in self.approval
        effect, arguments = self.effects.get(name, name), dict(args or {})
        call_id = context.metadata.get("call_id")
        key = call_key(run, effect, call_id, arguments) if isinstance(call_id, str) and call_id else None
        call = make_call(run, effect, arguments, key=key, needs_approval=needs)

        async def invoke() -> Any:
            await call_next()
            return _text(context.result)

        try:
            # Effects the body gates itself (`@estop.effect`) take their keys from this call.
            with step(f"call:{call_id}") if key else contextlib.nullcontext():
                out = await run_async(call, invoke, hold_timeout_s=self.hold_timeout_s)
        except (RunStopped, Interrupted) as e:
            raise MiddlewareFailure(str(e)) from e
        except Refused as e:
            if not self.refusal_as_output:
                raise
            context.result = f"estop refused this call ({e.reason}); do not retry it"
            return
        context.result = out


async def run(agent: Any, messages: Any = None, *, gate: Estop | None = None, run_id: str | Run | None = None, timeout_s: float | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, **kw: Any) -> Any:
    """`agent.run(...)` as an invocation of the estop run `run_id` (a cancel/timeout interrupts it)."""
    r = resolve_run(gate, run_id)

    async def go() -> Any:
        coro = agent.run(messages, **kw)
        return await (asyncio.wait_for(coro, timeout_s) if timeout_s else coro)

    return await arun_guarded(r, go, stop_on=stop_on)


async def run_workflow(workflow: Any, message: Any = None, *, gate: Estop | None = None, run_id: str | Run | None = None, timeout_s: float | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, **kw: Any) -> Any:
    """`workflow.run(...)` (agents as executors, fan-out branches) inside one estop run: a hold in
    one branch holds the writes of every other branch (G1)."""
    r = resolve_run(gate, run_id)

    async def go() -> Any:
        coro = workflow.run(message, **kw)
        return await (asyncio.wait_for(coro, timeout_s) if timeout_s else coro)

    return await arun_guarded(r, go, stop_on=stop_on)
