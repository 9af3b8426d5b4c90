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
    from agent_framework import ChatContext, ChatMiddleware, Content, FunctionInvocationContext, FunctionMiddleware, MiddlewareFailure, UserInputRequiredException
except ImportError as e:
    raise missing_extra("agent_framework", "Microsoft Agent Framework", "agent-framework", e) from e

from ..effect import call_key, make_call, run_async
from ..errors import HeldForApproval, Interrupted, Refused, RunStopped
from ..run import Estop, Run, current_run, step
from ._common import STOP_ON, admit_turn, arun_guarded, await_released, hold_payload, resolve_run

__all__ = ["EstopMiddleware", "EstopTurnMiddleware", "middleware", "holds", "resolve", "gate_tools", "run", "run_workflow", "APPROVAL_ATTR"]

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


class _Options:
    """What the turn and call middlewares share: effect names and which tools need approval."""

    def __init__(self, effects: dict[str, str] | None, approval: Iterable[str]) -> None:
        self.effects = dict(effects or {})
        self.approval = set(approval)

    def call(self, run: Run, fn: Any, name: str, call_id: Any, arguments: dict[str, Any]) -> tuple[Any, str | None]:
        needs = bool(getattr(fn, APPROVAL_ATTR, False)) or name in self.approval
        effect = self.effects.get(name, name)
        key = call_key(run, effect, call_id, arguments) if isinstance(call_id, str) and call_id else None
        return make_call(run, effect, arguments, key=key, needs_approval=needs), key


def _approval_request(context: FunctionInvocationContext, h: HeldForApproval, arguments: dict[str, Any]) -> Any:
    """The held call as the framework's own pause: a `function_approval_request` (a
    `user_input_request` of the response, kept with the session, serialisable), with estop's
    details under `additional_properties["estop"]`."""
    call_id = str(context.metadata.get("call_id") or "")
    occurrence = str(context.metadata.get("function_call_occurrence_id") or call_id)
    fc = Content.from_function_call(call_id=call_id, name=context.function.name, arguments=arguments, id=occurrence)
    return Content.from_function_approval_request(id=occurrence, function_call=fc, additional_properties=hold_payload(h, arguments))


class EstopMiddleware(FunctionMiddleware):
    """Admits every function call through estop (see the module doc)."""

    def __init__(self, *, effects: dict[str, str] | None = None, approval: Iterable[str] = (), on_hold: str = "pause", hold_timeout_s: float | None = None, refusal_as_output: bool = True) -> None:
        if on_hold not in ("pause", "wait"):
            raise ValueError(f"on_hold must be 'pause' or 'wait', not {on_hold!r}")
        self.opts = _Options(effects, approval)
        self.on_hold = on_hold
        self.hold_timeout_s = hold_timeout_s
        self.refusal_as_output = refusal_as_output

    async def process(self, context: FunctionInvocationContext, call_next: Callable[[], Awaitable[None]]) -> None:
        fn = context.function
        args = context.arguments
        if hasattr(args, "model_dump"):
            args = args.model_dump(mode="json")
        run = current_run()
        assert run is not None
        call_id = context.metadata.get("call_id")
        arguments = dict(args or {})
        call, key = self.opts.call(run, fn, fn.name, call_id, arguments)

        async def invoke() -> Any:
            await call_next()
            return _text(context.result)

        try:
            # Effects the body gates itself (`@estop.effect`) take their keys from this call.
            with step(f"call:{call_id}") if key else contextlib.nullcontext():
                on_hold = "raise" if self.on_hold == "pause" else "wait"
                out = await run_async(call, invoke, on_hold=on_hold, hold_timeout_s=self.hold_timeout_s)
        except HeldForApproval as h:
            raise UserInputRequiredException(contents=[_approval_request(context, h, arguments)]) from None
        except (RunStopped, Interrupted) as e:
            raise MiddlewareFailure(str(e)) from e
        except Refused as e:
            if not self.refusal_as_output:
                raise
            context.result = f"estop refused this call ({e.reason}); do not retry it"
            return
        context.result = out


class EstopTurnMiddleware(ChatMiddleware):
    """Admits all the function calls of a model turn before any of them starts (prepared:
    admitted, not started; approval calls first), so an approval asked by one call holds its
    parallel siblings at the gate whatever order the framework starts them in. Calls to tools it
    cannot see are left to `EstopMiddleware`, which admits every call anyway."""

    def __init__(self, opts: _Options) -> None:
        self.opts = opts

    async def process(self, context: ChatContext, call_next: Callable[[], Awaitable[None]]) -> None:
        await call_next()
        result: Any = context.result
        run = current_run(required=False)
        if context.stream or run is None or not hasattr(result, "messages"):
            return
        tools = {getattr(t, "name", None): t for t in (context.options or {}).get("tools") or []}
        found = [c for m in result.messages for c in m.contents if c.type == "function_call" and not c.hosted and c.call_id and c.name]
        mine = [c for c in found if c.name in tools]

        def calls() -> list[Any]:
            return [self.opts.call(run, tools[c.name], c.name, c.call_id, dict(c.parse_arguments() or {}))[0] for c in mine]

        if mine:
            await admit_turn(run, tuple(c.call_id for c in found), calls)


def middleware(*, effects: dict[str, str] | None = None, approval: Iterable[str] = (), on_hold: str = "pause", hold_timeout_s: float | None = None, refusal_as_output: bool = True) -> list[Any]:
    """The agent's estop middleware: `[EstopTurnMiddleware, EstopMiddleware]` sharing one
    configuration (whole-turn admission, then each call gated)."""
    calls = EstopMiddleware(effects=effects, approval=approval, on_hold=on_hold, hold_timeout_s=hold_timeout_s, refusal_as_output=refusal_as_output)
    return [EstopTurnMiddleware(calls.opts), calls]


def holds(requests: Iterable[Any]) -> list[str]:
    """The estop keys of a response's `user_input_requests` that estop raised (works on
    requests loaded with `Content.from_dict` in another process)."""
    keys = []
    for r in requests:
        est = (getattr(r, "additional_properties", None) or {}).get("estop")
        if getattr(r, "type", None) == "function_approval_request" and isinstance(est, dict) and est.get("key"):
            keys.append(str(est["key"]))
    return keys


async def resolve(requests: Iterable[Any], *, gate: Estop | None = None, run_id: str | Run, timeout_s: float | None = None) -> list[Any]:
    """Waits for the operator's decisions on estop's approval requests (woken by the gate's
    events, no polling; a call held as the sibling of another's approval or by a pause waits
    until the gate lets it go) and returns the `function_approval_response`s to send back
    (`Message(role="user", contents=responses)` with the same session). The responses only
    mirror the gate: the resumed call still asks it, so an approval the agent writes itself
    counts for nothing (G7). Requests estop did not raise are left out."""
    reqs = [r for r in requests if holds([r])]
    rid = run_id.id if isinstance(run_id, Run) else run_id
    if gate is None:
        from ..run import default

        gate = default()
    decided = await await_released(gate, rid, holds(reqs), timeout_s)
    return [r.to_function_approval_response(decided[k] == "approve") for r, k in zip(reqs, holds(reqs)) if k in decided]


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
