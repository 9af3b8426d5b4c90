"""Google ADK: a plugin gates every tool call; a hold is ADK's own tool confirmation
(`adk_request_confirmation`), answered by an estop operator.

    from estop.adapters import google_adk as eadk

    runner = Runner(app_name="ops", agent=agent, session_service=sessions,
                    plugins=[eadk.EstopPlugin(approval={"wire_money"})])
    events = await eadk.run(runner, gate=gate, run_id="order-42", user_id=u, session_id=s,
                            new_message=message)
    if eadk.holds(events):                           # the operator decides in estop
        answers = await eadk.resolve(events, gate=gate, run_id="order-42")
        events = await eadk.run(runner, gate=gate, run_id="order-42", user_id=u, session_id=s,
                                new_message=types.Content(role="user", parts=answers))

* `EstopPlugin` (ADK's public `BasePlugin` hooks, for every agent of the runner): before a tool
  runs it is admitted by estop (tool name → effect name, its arguments → digest; key: ADK's
  `function_call_id` + the digest) and started; after it, its result is recorded (`ok`, or
  `error` from `on_tool_error_callback`). A duplicate returns the recorded result without
  running the tool. A refusal is the tool's result (`{"error": ...}`, the model reads it); a
  stopped run or an interrupted invocation raises.
* A held call (an approval, its sibling, a paused run) calls `tool_context.request_confirmation`
  (estop's details in the payload): ADK's own pause, an `adk_request_confirmation` function call
  kept in the session's events. `resolve` waits for the operator (gate events) and returns the
  `FunctionResponse` parts to send back; the confirmed call asks the gate again, so the
  confirmation the agent process writes itself decides nothing (it is asked again).
* `run` runs `runner.run_async(...)` as an invocation of the estop run: a task cancel, a
  timeout or Ctrl-C interrupts the invocation and the run stays usable; `run.cancel()` or an
  operator stops it. (ADK has no "stop this run" API of its own.)
* A call cancelled mid-tool (ADK passes its `CancelledError` to `on_tool_error_callback`) is
  `unknown` at the gate, never `error`: its write may have landed. A call whose end no callback
  reported is settled `unknown` when `run`'s invocation ends. (A sync tool in ADK's thread pool
  runs on after the cancel; ADK's hooks do not see its end, so it stays `unknown` for an
  operator; the `@estop.effect`s in its body settle themselves.)
* The model turn's function calls (the session's latest model event) are all admitted before any
  of them starts, so an approval holds its parallel siblings whatever order ADK runs them in.
* `@estop.effect`s a gated tool's body calls are keyed from its call (step
  `call:<function_call_id>`), so the same charge in two turns is two charges and a retried call
  reads its own receipt. The model's retry of a call that raised (the same tool and arguments
  in the same run, a new call id: what ADK's `ReflectAndRetryToolPlugin` asks for) runs in the
  failed call's step: the effects its body already did read their receipts. List `EstopPlugin`
  before that plugin (ADK stops at the first error callback that answers).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Iterable

from ._common import missing_extra

try:
    from google.adk.plugins.base_plugin import BasePlugin
    from google.genai import types
except ImportError as e:
    raise missing_extra("google_adk", "Google ADK", "google-adk", e) from e

from ..effect import EffectCall, call_key, encode_result, gate_async, make_call, shielded
from ..errors import EstopError, HeldForApproval, InDoubt, Interrupted, Refused, RunStopped
from ..run import Estop, Invocation, Run, current_invocation, current_run, step
from ._common import STOP_ON, admit_turn, aguarded, await_released, hold_payload, resolve_run

__all__ = ["EstopPlugin", "CONFIRMATION", "holds", "resolve", "run"]

#: The function call ADK uses for a tool confirmation.
CONFIRMATION = "adk_request_confirmation"


def _as_result(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {"result": value}


class EstopPlugin(BasePlugin):  # type: ignore[misc]
    """Gates every tool call of the runner's agents through estop (see the module doc)."""

    def __init__(self, *, effects: dict[str, str] | None = None, approval: Iterable[str] = (), name: str = "estop") -> None:
        super().__init__(name=name)
        self.effects = dict(effects or {})
        self.approval = set(approval)
        self._started: dict[tuple[str, str], tuple[EffectCall, str, Any, Invocation | None]] = {}

    def _call(self, tool: Any, tool_args: dict[str, Any], tool_context: Any) -> tuple[EffectCall, str | None]:
        run = current_run()
        assert run is not None
        effect = self.effects.get(tool.name, tool.name)
        call_id = tool_context.function_call_id
        key = call_key(run, effect, call_id, tool_args) if call_id else None
        return make_call(run, effect, dict(tool_args), key=key, needs_approval=tool.name in self.approval), call_id

    async def _admit_turn(self, run: Run, tool_context: Any) -> None:
        """Whole-turn admission (`_common.admit_turn`): the function calls of the model event this
        call belongs to (the session's events) are all admitted before any starts."""
        call_id = tool_context.function_call_id
        for ev in reversed(list(getattr(tool_context.session, "events", None) or [])):
            calls = [p.function_call for p in (ev.content.parts or []) if p.function_call] if ev.content else []
            if not call_id or all(fc.id != call_id for fc in calls):
                continue
            mine = [fc for fc in calls if fc.id and fc.name and not fc.name.startswith("adk_")]

            def build() -> list[EffectCall]:
                out = []
                for fc in mine:
                    effect, args = self.effects.get(fc.name, fc.name), dict(fc.args or {})
                    out.append(make_call(run, effect, args, key=call_key(run, effect, fc.id, args), needs_approval=fc.name in self.approval))
                return out

            await admit_turn(run, tuple(fc.id for fc in calls), build)
            return

    async def before_tool_callback(self, *, tool: Any, tool_args: dict[str, Any], tool_context: Any) -> dict[str, Any] | None:
        call, call_id = self._call(tool, tool_args, tool_context)
        try:
            if tool_context.tool_confirmation is None:  # (a resumed call's turn was admitted before)
                await self._admit_turn(call.run, tool_context)
            g = await gate_async(call, on_hold="raise")
        except HeldForApproval as h:
            pay = hold_payload(h, call.args)
            tool_context.request_confirmation(hint=f"estop holds {h.tool} ({h.held.reason}): {pay['estop']['how']}", payload=pay)
            return {"error": f"held by estop ({h.held.reason}); an operator decides"}
        except (RunStopped, Interrupted):
            raise
        except Refused as e:
            return {"error": f"estop refused this call ({e.reason}); do not retry it"}
        except InDoubt as e:
            return {"error": f"estop: an earlier identical call may still have happened ({e.status}); do not retry it"}
        if g.duplicate is not None:
            return _as_result(g.duplicate.result)
        assert g.token is not None
        # `@estop.effect`s the tool body calls are keyed from this call (step `call:<id>`), not by
        # their order in a fresh invocation: ADK runs each call in a task of its own, in which
        # this callback, the tool and the after/error callback share one context. The model's
        # retry of a call that raised (the same tool and arguments, a new call id: what
        # `ReflectAndRetryToolPlugin` asks for) runs in the failed call's step, so the effects
        # its body already did present the same keys and read their receipts.
        name = _failed(call.run).pop((call.tool, call.digest), None) or (f"call:{call_id}" if call_id else None)
        scope = step(name) if name else None
        if scope is not None:
            scope.__enter__()
        self._started[(call.run.id, call.key)] = (call, g.token, scope, current_invocation())
        return None

    async def _complete(self, tool: Any, tool_args: dict[str, Any], tool_context: Any, outcome: str, **kw: Any) -> None:
        call, _ = self._call(tool, tool_args, tool_context)
        started = self._started.pop((call.run.id, call.key), None)
        if started is None:
            return
        call, token, scope, _ = started
        if scope is not None:
            with contextlib.suppress(ValueError):  # (left in another context: nothing to reset)
                scope.__exit__(None, None, None)
        with contextlib.suppress(EstopError):
            await shielded(call.run.gate.aclient.complete(call.run.id, call.key, token, outcome, **kw))

    async def after_tool_callback(self, *, tool: Any, tool_args: dict[str, Any], tool_context: Any, result: Any) -> dict[str, Any] | None:
        await self._complete(tool, tool_args, tool_context, "ok", result=encode_result(result))
        return None

    async def on_tool_error_callback(self, *, tool: Any, tool_args: dict[str, Any], tool_context: Any, error: BaseException) -> dict[str, Any] | None:
        if not isinstance(error, Exception):
            # ADK reports a call cancelled mid-tool here too (its `CancelledError`): the body may
            # have done its write, so the call is `unknown` (an operator or a lookup settles
            # it), never `error`, which would say it did not happen.
            await self._complete(tool, tool_args, tool_context, "unknown", error=f"cancelled mid-tool ({type(error).__name__})")
            return None
        call, _ = self._call(tool, tool_args, tool_context)
        started = self._started.get((call.run.id, call.key))
        if started is not None and started[2] is not None:
            _failed(call.run)[(call.tool, call.digest)] = started[2].step.name
        await self._complete(tool, tool_args, tool_context, "error", error=f"{type(error).__name__}: {error}"[:4000])
        return None

    async def settle_abandoned(self, invocation: Invocation, why: str) -> None:
        """Reports `unknown` for every call of `invocation` started by this plugin whose end no
        callback reported: what an invocation ended by a cancel, a timeout or Ctrl-C left in
        flight (`run` calls it as the invocation ends; another invocation's calls are not
        touched)."""
        mine = [k for k, v in self._started.items() if v[3] is invocation]
        for k in mine:
            call, token, _, _ = self._started.pop(k)
            with contextlib.suppress(EstopError):
                await shielded(call.run.gate.aclient.complete(call.run.id, call.key, token, "unknown", error=why))


def _failed(run: Run) -> dict[tuple[str, str], str]:
    """(effect, digest) → the step of the run's latest call of it that raised, for the model's
    retry of that call."""
    out: dict[tuple[str, str], str] = run.__dict__.setdefault("_adk_failed", {})
    return out


def _confirmations(events: Iterable[Any]) -> list[Any]:
    """The `adk_request_confirmation` function calls estop asked for, in `events`."""
    out = []
    for ev in events:
        for p in (ev.content.parts or []) if getattr(ev, "content", None) else []:
            fc = p.function_call
            if fc is not None and fc.name == CONFIRMATION:
                payload = ((fc.args or {}).get("toolConfirmation") or {}).get("payload") or {}
                if isinstance(payload, dict) and isinstance(payload.get("estop"), dict):
                    out.append(fc)
    return out


def holds(events: Iterable[Any]) -> list[str]:
    """The estop keys of the confirmations estop asked for in `events` (a run's result, or the
    session's events loaded in another process)."""
    return [fc.args["toolConfirmation"]["payload"]["estop"]["key"] for fc in _confirmations(events)]


async def resolve(events: Iterable[Any], *, gate: Estop | None = None, run_id: str | Run, timeout_s: float | None = None) -> list[Any]:
    """Waits for the operator's decisions on estop's confirmations in `events` (gate events, no
    polling; a sibling or paused call until the gate would start it) and returns the
    `FunctionResponse` parts that answer them (`confirmed`: the operator approved). The answer
    only mirrors the gate: the confirmed call asks it again."""
    confs = _confirmations(events)
    rid = run_id.id if isinstance(run_id, Run) else run_id
    if gate is None:
        from ..run import default

        gate = default()
    keys = [fc.args["toolConfirmation"]["payload"]["estop"]["key"] for fc in confs]
    decided = await await_released(gate, rid, keys, timeout_s)
    return [
        types.Part(function_response=types.FunctionResponse(name=CONFIRMATION, id=fc.id, response={"confirmed": decided[k] == "approve"}))
        for fc, k in zip(confs, keys)
        if k in decided
    ]


async def run(runner: Any, *, gate: Estop | None = None, run_id: str | Run | None = None, timeout_s: float | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, **kw: Any) -> list[Any]:
    """`runner.run_async(**kw)` as an invocation of the estop run `run_id`; returns its events."""
    r = resolve_run(gate, run_id)

    async def collect() -> list[Any]:
        return [ev async for ev in runner.run_async(**kw)]

    plugins = [p for p in getattr(getattr(runner, "plugin_manager", None), "plugins", None) or [] if isinstance(p, EstopPlugin)]
    ended: list[Invocation] = []
    try:
        async with aguarded(r, stop_on=stop_on) as inv:
            ended.append(inv)
            return await (asyncio.wait_for(collect(), timeout_s) if timeout_s else collect())
    except BaseException as e:
        # A call whose end no callback reported (cancelled where ADK does not tell its plugins)
        # is settled `unknown` with the invocation; the run goes on.
        for p in plugins:
            for inv in ended:
                await p.settle_abandoned(inv, f"the invocation ended ({type(e).__name__}) while the call was in flight")
        raise
