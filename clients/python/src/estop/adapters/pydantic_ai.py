"""PydanticAI: every tool gated through a capability, approval tools decided in estop, a hold
as PydanticAI's own deferral; a cancel/timeout interrupts, `run.cancel()` stops.

    from estop.adapters import pydantic_ai as ep

    agent = Agent(model, tools=[wire_money, send_email], capabilities=[ep.EstopCapability()])
    result = await ep.run(agent, "refund order 42", gate=gate, run_id="order-42")

(`ep.EstopToolset(toolset)` gates one toolset; `ep.gate_agent(agent)` gates an agent built
elsewhere for the runs `ep.run` makes.)

* Every tool call is admitted by the gate first; the tool runs only on `admitted`; a duplicate
  (a replayed or retried run) returns the recorded result. The key is PydanticAI's
  `tool_call_id` (+ the digest); `@estop.effect`s the tool body calls are keyed from the call.
* Tools declared `requires_approval=True` (deferred approval tools) become estop approvals,
  decided by an operator. A hold (that approval, its siblings of the same turn, a pause) is
  PydanticAI's native deferral when the agent can return `DeferredToolRequests` (its
  `output_type` names it: `on_hold="auto"`, the default; `"defer"` always): `ApprovalRequired`,
  so the run ends with `DeferredToolRequests` (serialisable with the message history). An agent
  that cannot defer (PydanticAI would raise `UserError`) waits in the call instead (`"wait"`).
  `gate.await_decided(run, keys)` waits for the operator, then run it again with the message
  history and `deferred_tool_results` (the same call presents the same key). `run(...,
  approver=operator_client)` records the native answers (`approvals`: True / False /
  `ToolDenied`) as that operator's decision; without an operator credential they decide nothing.
* A refusal is returned to the model as the tool's output (`ModelRetry` would make it try again);
  a stopped run raises `RunStopped`. `run`/`run_sync` are invocations of the run: a task cancel,
  `timeout_s` or Ctrl-C interrupts the invocation (what it left running refuses new effects) and
  the run stays usable; `run.cancel()` or an operator's cancel stops it.
* `@estop.effect`s a gated tool's body calls are keyed from its call (step `call:<id>`). The
  model's retry of a call that raised (`ModelRetry`: the same tool and arguments in the run, a
  new call id) runs in the failed call's step, so what the failed call's body already did is
  read back, not done again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ._common import missing_extra

try:
    from pydantic_ai import DeferredToolRequests
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.exceptions import ApprovalRequired
    from pydantic_ai.toolsets import AbstractToolset, WrapperToolset
except ImportError as e:
    raise missing_extra("pydantic_ai", "PydanticAI", "pydantic-ai", e) from e

from ..effect import EffectCall, call_key, encode_result, gate_async, make_call, run_async, shielded
from ..client import Client
from ..errors import EstopError, HeldForApproval, InDoubt, Interrupted, NotFound, NotPending, Refused, RunStopped
from ..run import Estop, Run, current_run, step
from ._common import STOP_ON, admit_turn, arun_guarded, hold_payload, resolve_run, run_guarded

__all__ = ["EstopCapability", "EstopToolset", "gate_agent", "run", "run_sync"]

_ON_HOLD = ("auto", "defer", "wait")
_GATES_LEAVES = "__estop_gates_leaves__"


def _defers(on_hold: str, ctx: Any) -> bool:
    """Whether a hold becomes PydanticAI's deferral (`ApprovalRequired`). `auto`: when the run
    can end with `DeferredToolRequests` (the agent's output type names it), as a PydanticAI
    user who declared it expects; otherwise PydanticAI could not defer, and the call waits."""
    if on_hold != "auto":
        return on_hold == "defer"
    agent = getattr(ctx, "agent", None)
    return _names_deferred(getattr(agent, "output_type", None))


def _names_deferred(t: Any, depth: int = 0) -> bool:
    if t is DeferredToolRequests:
        return True
    if depth > 4 or t is None or isinstance(t, (str, bytes)):
        return False
    import typing

    parts: list[Any] = list(typing.get_args(t))
    if isinstance(t, (list, tuple, set, frozenset)):
        parts += list(t)
    inner = getattr(t, "output", None)  # ToolOutput / NativeOutput / … wrappers
    if inner is not None and inner is not t:
        parts.append(inner)
    return any(_names_deferred(p, depth + 1) for p in parts)


async def _gated_call(owner: Any, inner_call: Any, name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
    run = current_run()
    assert run is not None
    effect = owner.effects.get(name, name)
    call_id = getattr(ctx, "tool_call_id", None)
    key = call_key(run, effect, call_id, tool_args) if call_id else None
    call = make_call(run, effect, tool_args, key=key, needs_approval=name in owner._approval)
    # The model's retry of a call whose thread PydanticAI abandoned at its timeout is that same
    # call: it takes the abandoned call's key, so it reads that outcome instead of charging again.
    if (earlier := _abandoned(run).pop((effect, call.digest), None)) is not None:
        call.key = earlier.key
        await earlier.settled(getattr(tool.tool_def, "timeout", None))
    await _admit_turn(owner, run, ctx, skip_id=call_id if earlier is not None else None)
    hold = "raise" if _defers(owner.on_hold, ctx) else "wait"
    # Effects the body gates itself (`@estop.effect`) take their keys from this call — or, for the
    # model's retry of a call that raised (`ModelRetry`: the same tool and arguments, a new call
    # id), from the failed call, so what its body already did is read back, not done again.
    step_name = _failed(run).pop((effect, call.digest), None) or (f"call:{call_id}" if call_id else None)
    try:
        with step(step_name) if step_name else contextlib.nullcontext():
            try:
                if _is_thread_tool(tool):
                    return await _run_thread_tool(call, lambda: inner_call(name, tool_args, ctx, tool), on_hold=hold, hold_timeout_s=owner.hold_timeout_s)
                return await run_async(call, lambda: inner_call(name, tool_args, ctx, tool), on_hold=hold, hold_timeout_s=owner.hold_timeout_s)
            except Exception as e:
                if step_name and not isinstance(e, EstopError):
                    _failed(run)[(effect, call.digest)] = step_name
                raise
    except HeldForApproval as h:
        raise ApprovalRequired(metadata=hold_payload(h, tool_args)) from None
    except (RunStopped, Interrupted):
        raise
    except Refused as e:
        if not owner.refusal_as_output:
            raise
        return f"estop refused this call ({e.reason}); do not retry it"
    except InDoubt as e:
        return f"estop: an earlier identical call may still have happened ({e.status}); do not retry it"


async def _admit_turn(owner: Any, run: Run, ctx: Any, *, skip_id: str | None) -> None:
    """Whole-turn admission (see `_common.admit_turn`): the tool calls of the model response
    this call belongs to, those of this toolset's tools, all admitted before any starts."""
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    call_id = getattr(ctx, "tool_call_id", None)
    for m in reversed(getattr(ctx, "messages", None) or []):
        if not isinstance(m, ModelResponse):
            continue
        parts = [p for p in m.parts if isinstance(p, ToolCallPart)]
        if not call_id or all(p.tool_call_id != call_id for p in parts):
            continue
        # (A retry that takes an abandoned call's key is not admitted under its own.)
        mine = [p for p in parts if p.tool_name in owner._names and p.tool_call_id != skip_id]

        def calls() -> list[EffectCall]:
            out = []
            for p in mine:
                effect, args = owner.effects.get(p.tool_name, p.tool_name), p.args_as_dict()
                out.append(make_call(run, effect, args, key=call_key(run, effect, p.tool_call_id, args), needs_approval=p.tool_name in owner._approval))
            return out

        await admit_turn(run, (id(owner), tuple(p.tool_call_id for p in parts)), calls)
        return


async def _gated_tools(owner: Any, tools: dict[str, Any]) -> dict[str, Any]:
    owner._names.update(tools)
    out = {}
    for name, t in tools.items():
        if t.tool_def.kind == "unapproved":
            owner._approval.add(name)
            t = dataclasses.replace(t, tool_def=dataclasses.replace(t.tool_def, kind="function"))
        if _is_thread_tool(t):
            t = dataclasses.replace(t, call_func=_abandonable(t.call_func))
        out[name] = t
    return out


# -- sync tools past their timeout ------------------------------------------------------------
#
# PydanticAI runs a sync tool in a worker thread; at the tool's `timeout` it stops waiting
# (`abandon_threads_on_cancel`) and asks the model to retry, while the thread runs on and may
# still do the effect. So a timed-out call is `unknown` (never `error`), and the thread's own
# end settles it (`ok`/`error`, which the gate accepts after `unknown`).


@dataclass
class _Abandoned:
    """A started effect whose thread PydanticAI stopped waiting for."""

    key: str
    done: "asyncio.Future[Any]"

    async def settled(self, timeout_s: float | None) -> None:
        """Waits (at most the tool's timeout) for the thread's outcome to reach the gate."""
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(asyncio.shield(self.done), timeout_s)


@dataclass
class _Started:
    """Shared by `_run_thread_tool` and the tool's `call_func`: the effect and its token."""

    call: EffectCall
    token: str
    abandoned: bool = False


_STARTED: "contextvars.ContextVar[_Started | None]" = contextvars.ContextVar("estop_pyd_started", default=None)


def _failed(run: Run) -> dict[tuple[str, str], str]:
    """(effect, digest) → the step of the run's latest call of it that raised, for the model's
    retry of that call."""
    out: dict[tuple[str, str], str] = run.__dict__.setdefault("_pyd_failed", {})
    return out


def _abandoned(run: Run) -> dict[tuple[str, str], _Abandoned]:
    out: dict[tuple[str, str], _Abandoned] = run.__dict__.setdefault("_pyd_abandoned", {})
    return out


def _is_thread_tool(tool: Any) -> bool:
    return getattr(tool, "is_async", True) is False and callable(getattr(tool, "call_func", None))


def _abandonable(call_func: Any) -> Any:
    """`call_func` of a sync tool: the thread's work runs in its own task, so when PydanticAI
    gives up on it (timeout) the work goes on and its outcome is still reported."""

    async def gated_call_func(args: dict[str, Any], ctx: Any) -> Any:
        started = _STARTED.get()
        work = asyncio.ensure_future(call_func(args, ctx))
        if started is None:
            return await work
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            started.abandoned = True
            call = started.call
            done = asyncio.ensure_future(_settle_late(call, started.token, work))
            _abandoned(call.run)[(call.tool, call.digest)] = _Abandoned(call.key, done)
            raise

    return gated_call_func


async def _settle_late(call: EffectCall, token: str, work: "asyncio.Future[Any]") -> None:
    client = call.run.gate.aclient
    with contextlib.suppress(EstopError):
        await client.complete(call.run.id, call.key, token, "unknown", error="the tool timed out; its thread runs on")
    try:
        result = await work
    except Exception as e:
        outcome: dict[str, Any] = {"outcome": "error", "error": f"{type(e).__name__}: {e}"[:4000]}
    except BaseException:
        return  # cancelled with the loop: stays unknown
    else:
        outcome = {"outcome": "ok", "result": encode_result(result)}
    with contextlib.suppress(EstopError):
        await client.complete(call.run.id, call.key, token, **outcome)


async def _run_thread_tool(call: EffectCall, fn: Any, *, on_hold: str, hold_timeout_s: float | None) -> Any:
    """`run_async` for a sync tool: the same gate, but a call PydanticAI abandoned is reported by
    `_settle_late`, not here."""
    g = await gate_async(call, on_hold=on_hold, hold_timeout_s=hold_timeout_s)
    if g.duplicate is not None:
        return g.duplicate.result
    assert g.token is not None
    started = _Started(call, g.token)
    reset = _STARTED.set(started)
    client = call.run.gate.aclient
    try:
        result = await fn()
    except BaseException as e:
        if not started.abandoned:
            outcome = "error" if isinstance(e, Exception) else "unknown"
            await shielded(client.complete(call.run.id, call.key, g.token, outcome, error=f"{type(e).__name__}: {e}"[:4000]))
        raise
    finally:
        _STARTED.reset(reset)
    await shielded(client.complete(call.run.id, call.key, g.token, "ok", result=encode_result(result)))
    return result


@dataclass
class EstopToolset(WrapperToolset[Any]):
    """Wraps a toolset so that every call is admitted by estop first."""

    effects: dict[str, str] = field(default_factory=dict)
    on_hold: str = "auto"
    hold_timeout_s: float | None = None
    refusal_as_output: bool = True
    _approval: set[str] = field(default_factory=set)
    _names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.on_hold not in _ON_HOLD:
            raise ValueError(f"on_hold must be one of {_ON_HOLD}, not {self.on_hold!r}")

    async def get_tools(self, ctx: Any) -> dict[str, Any]:
        return await _gated_tools(self, await self.wrapped.get_tools(ctx))

    def visit_and_replace(self, visitor: Any) -> Any:
        # An `EstopCapability` gating the run's toolsets leaves this (already gated) one alone;
        # any other visitor (durable execution, …) reaches the leaves inside as usual.
        if getattr(visitor, _GATES_LEAVES, False):
            return self
        return super().visit_and_replace(visitor)

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
        return await _gated_call(self, self.wrapped.call_tool, name, tool_args, ctx, tool)


@dataclass
class EstopCapability(AbstractCapability[Any]):
    """Gates every tool the agent runs — its own (`@agent.tool`, `tools=[...]`), its toolsets',
    MCP servers' — through PydanticAI's public capability hook (`get_wrapper_toolset`: each leaf
    toolset of the run is wrapped in an `EstopToolset`, with `visit_and_replace`):

        agent = Agent(model, capabilities=[ep.EstopCapability()])
    """

    effects: dict[str, str] = field(default_factory=dict)
    on_hold: str = "auto"
    hold_timeout_s: float | None = None
    refusal_as_output: bool = True

    def __post_init__(self) -> None:
        if self.on_hold not in _ON_HOLD:
            raise ValueError(f"on_hold must be one of {_ON_HOLD}, not {self.on_hold!r}")

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        # Each leaf toolset (function tools, MCP servers, …) is wrapped, not the assembled one:
        # a leaf's own tools are what PydanticAI calls (a sync tool's thread, its timeout).
        def gate(leaf: AbstractToolset[Any]) -> AbstractToolset[Any]:
            return EstopToolset(leaf, effects=self.effects, on_hold=self.on_hold, hold_timeout_s=self.hold_timeout_s, refusal_as_output=self.refusal_as_output)

        setattr(gate, _GATES_LEAVES, True)
        return toolset.visit_and_replace(gate)


_CAPABILITY_ATTR = "__estop_capability__"


def gate_agent(agent: Any, *, effects: dict[str, str] | None = None, on_hold: str = "auto", hold_timeout_s: float | None = None, refusal_as_output: bool = True) -> Any:
    """Gates every tool of an agent built elsewhere, for the runs `ep.run`/`ep.run_sync` make:
    each gets an `EstopCapability` (passed as the run's `capabilities=`, PydanticAI's public
    per-run hook). Where you build the agent, `Agent(..., capabilities=[ep.EstopCapability()])`
    gates `agent.run` too."""
    cap = EstopCapability(effects=dict(effects or {}), on_hold=on_hold, hold_timeout_s=hold_timeout_s, refusal_as_output=refusal_as_output)
    object.__setattr__(agent, _CAPABILITY_ATTR, cap)  # estop's own attribute; nothing of PydanticAI's is touched
    return agent


def _with_gate(agent: Any, kw: dict[str, Any]) -> dict[str, Any]:
    cap = getattr(agent, _CAPABILITY_ATTR, None)
    if cap is None:
        return kw
    return {**kw, "capabilities": [cap, *(kw.get("capabilities") or [])]}


async def run(agent: Any, prompt: Any = None, *, gate: Estop | None = None, run_id: str | Run | None = None, timeout_s: float | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, approver: Client | None = None, effects: dict[str, str] | None = None, **kw: Any) -> Any:
    """`agent.run(...)` as an invocation of the estop run `run_id` (a cancel/timeout interrupts it).

    With `deferred_tool_results` (the answer to a run that ended with `DeferredToolRequests`)
    and an `approver` (an operator's client, e.g. held by your approval UI), each native
    approval becomes that operator's decision in estop — a deny (`False`, `ToolDenied`) a reject,
    sticky for the run (G2) — before the run goes on. Without an operator credential the native
    answer decides nothing at the gate: an approved call asks the gate and is deferred again
    while held, and a denied one stays pending in estop's inbox until an operator decides."""
    r = resolve_run(gate, run_id)
    results = kw.get("deferred_tool_results")
    if approver is not None and results is not None:
        await asyncio.to_thread(_decide_natively, approver, r.id, results, kw.get("message_history") or [], effects or {})

    run_kw = _with_gate(agent, kw)

    async def go() -> Any:
        coro = agent.run(prompt, **run_kw)
        return await (asyncio.wait_for(coro, timeout_s) if timeout_s else coro)

    return await arun_guarded(r, go, stop_on=stop_on)


def run_sync(agent: Any, prompt: Any = None, *, gate: Estop | None = None, run_id: str | Run | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, **kw: Any) -> Any:
    r = resolve_run(gate, run_id)
    return run_guarded(r, lambda: asyncio.run(run(agent, prompt, run_id=r, stop_on=stop_on, **kw)), stop_on=stop_on)


def _decide_natively(approver: Client, run_id: str, results: Any, history: list[Any], effects: dict[str, str]) -> None:
    """Records PydanticAI's approval answers as the operator's decisions (see `run`)."""
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    calls = {p.tool_call_id: p for m in history if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, ToolCallPart)}
    for call_id, answer in results.approvals.items():
        part = calls.get(call_id)
        if part is None:
            continue
        approved = answer is True or getattr(answer, "kind", None) == "tool-approved"
        denied = answer is False or getattr(answer, "kind", None) == "tool-denied"
        if not (approved or denied):
            continue
        effect = effects.get(part.tool_name, part.tool_name)
        key = call_key(run_id, effect, call_id, part.args_as_dict())
        try:
            approver.decide(run_id, key, "approve" if approved else "reject", getattr(answer, "message", None))
        except (NotPending, NotFound):
            pass  # decided already (the console), or never held
