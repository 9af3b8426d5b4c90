"""OpenAI Agents SDK: gated function tools; a hold is the SDK's own interruption (RunState),
decided by an estop operator; a timeout interrupts, `streamed.cancel()` stops.

    from estop.adapters import openai_agents as eo

    agent = Agent(name="ops", tools=eo.gate_tools([wire_money, send_email]))
    result = await eo.run(agent, "refund order 42", gate=gate, run_id="order-42")
    if result.interruptions:                       # held: save result.to_state().to_string()
        state = result.to_state()                  # (or RunState.from_string in a new process)
        await eo.resolve(agent, state, gate=gate, run_id="order-42")   # the operator decides
        result = await eo.run(agent, state, gate=gate, run_id="order-42")

* Every call of a gated tool is admitted by the gate first (tool name → effect name, the parsed
  arguments → its digest); the tool body runs only on `admitted`; its return value is the
  effect's recorded result, returned again (not re-run) when the same call comes back on a
  replay, a resumed `RunState` or a retried job. The key is the SDK's `call_id` (+ the digest),
  so it does not depend on what ran before it; `@estop.effect`s the body calls are keyed from
  the call too.
* A tool's `needs_approval` (bool or callable) becomes an estop approval (`needs_approval` on
  admit; the gate's policy may require one anyway), decided by an operator (`estop approve RUN
  KEY`, the console). Before the SDK runs a call, its `needs_approval` hook asks the gate; a held
  call (an approval, its siblings of the same turn, a paused run) is the SDK's own interruption
  (`result.interruptions`, a serialisable `RunState`) — the pause survives a restart. `resolve`
  waits for the decision (gate events) and writes it into the state; the resumed call still asks
  the gate, so only the operator's decision counts. (`on_hold="wait"`: the call blocks instead.)
  A rejection or other refusal is returned to the model as the tool's output; a stopped run
  raises `RunStopped`.
* Whole-turn admission: the run's hooks (`EstopRunHooks`, installed by `run`/`run_streamed`)
  admit every gated call of a model response in `on_llm_end`, before any of them starts, so a
  pending approval holds its parallel siblings whatever order the SDK runs them in.
* `run`/`run_sync`/`run_streamed` are invocations of the estop run: a cancel of the awaiting
  task, a timeout (`timeout_s`, a tool's `timeout_seconds` with `timeout_behavior=
  "raise_exception"`), breaking out of `stream_events()` or Ctrl-C *interrupts* the invocation —
  tool threads the SDK cannot stop refuse new effects — and the run stays usable for the next
  turn. The SDK's explicit stop, `streamed.cancel()`, cancels the run at the gate (`immediate`:
  at once; `after_turn`: when the turn has finished), as do `run.cancel()` and an operator.
* A call cancelled mid-body — the SDK's own tool timeout (`@function_tool(timeout=...)`, whose
  default `error_as_result` tells the model to try again), or a cancel of the invocation — is
  `unknown` at the gate, never `error`: a thread the tool started (`asyncio.to_thread`) runs on
  and may still do the effect. The model's retry of the same tool with the same arguments (a new
  call id) takes that call's key, so it is not a new effect: while the outcome is in doubt its
  output is a refusal the model can read; once an operator settles the call (`estop compensate
  settle RUN KEY --outcome ok --result ...`), the settled result (`error`: the retry runs anew).
  Remembered per run id in this process (`Estop` handle); other arguments are a new call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import re
import threading
from collections import OrderedDict
from typing import Any, Iterable

from ._common import missing_extra

try:
    from agents import Handoff, Runner
    from agents.lifecycle import RunHooksBase
    from agents.exceptions import AgentsException
    from agents.tool import FunctionTool
except ImportError as e:
    raise missing_extra("openai_agents", "the OpenAI Agents SDK", "openai-agents", e) from e

from ..effect import EffectCall, admit_prepared, call_key, make_call, run_async
from ..errors import EffectFailed, EstopError, InDoubt, Interrupted, Refused, RunStopped
from ..verdicts import Held
from ..run import Estop, Invocation, Run, current_run, step
from ._common import STOP_ON as _NO_STOP, admit_turn, arun_guarded, resolve_run, run_guarded

__all__ = ["EstopRunHooks", "EstopStreamedRun", "agent_tool", "gate_agent", "gate_tool", "gate_tools", "holds", "run", "run_streamed", "run_sync", "resolve", "STOP_ON"]

#: Exceptions that cancel the run by default: none (a timeout, the SDK's `ToolTimeoutError`, a
#: task cancel or Ctrl-C interrupt the invocation; `EstopStreamedRun.cancel()` and
#: `run.cancel()` stop the run).
STOP_ON: tuple[type[BaseException], ...] = _NO_STOP


def _scoped(run: Run, scope: str | None) -> Run:
    """The run a tool of a handed-off agent acts in: the child `RUN.scope` (one Run object per
    parent, so its watcher and fence are shared by the agent's calls)."""
    if scope is None:
        return run
    kids: dict[str, Run] = run.__dict__.setdefault("_eo_children", {})
    with run._tasks_lock:
        if scope not in kids:
            kids[scope] = run.child(scope)
        return kids[scope]


def _scope_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-") or "agent"


def gate_tool(tool: FunctionTool, *, effect: str | None = None, on_hold: str = "interrupt", hold_timeout_s: float | None = None, refusal_as_output: bool = True, scope: str | None = None) -> FunctionTool:
    """A copy of `tool` whose every call is admitted by estop first. `effect` names the effect
    at the gate (default: the tool's name). `on_hold="interrupt"` (default): before the SDK runs
    a call it asks estop (the tool's `needs_approval` hook), and a held call becomes the SDK's
    own interruption (`result.interruptions`, a `RunState` to save); `on_hold="wait"`: the call
    waits for the decision inside the tool. `scope`: the call acts in the child run
    `RUN.scope` (a handed-off agent's, see `gate_agent`)."""
    if getattr(tool, "__estop_gated__", False):
        return tool
    name = effect or tool.name
    inner = tool.on_invoke_tool
    approval = tool.needs_approval

    async def wants_approval(ctx: Any, args: Any, call_id: str) -> bool:
        na: Any = approval
        if callable(approval):
            na = approval(ctx, args, call_id)
            if inspect.isawaitable(na):
                na = await na
        return bool(na)

    def call_for(args: Any, call_id: str | None, na: bool) -> EffectCall:
        run = current_run()
        assert run is not None
        run = _scoped(run, scope)
        key = call_key(run, name, call_id, args) if call_id else None
        call = make_call(run, name, args, key=key, needs_approval=na)
        # The model's retry of a call abandoned mid-body (the SDK's tool timeout) is that same
        # call: it takes the abandoned call's key, so it reads that outcome instead of running.
        earlier = _abandoned(run).get((run.id, name, call.digest))
        if earlier is not None:
            call.key = earlier
        return call

    async def prepare(ctx: Any, args: Any, call_id: str) -> EffectCall:
        return call_for(args, call_id, await wants_approval(ctx, args, call_id))

    async def needs_approval(ctx: Any, params: Any, call_id: str) -> bool:
        """The SDK's question "interrupt for approval?", answered by the gate: held → yes."""
        call = await prepare(ctx, params, call_id)
        try:
            return isinstance(await admit_prepared(call), Held)
        except (RunStopped, Interrupted):
            raise
        except EstopError:
            return False  # the call itself meets the refusal (as its output)

    async def on_invoke_tool(ctx: Any, arguments: str) -> Any:
        args = json.loads(arguments) if arguments else {}
        call_id = getattr(ctx, "tool_call_id", None)
        call = call_for(args, call_id, await wants_approval(ctx, args, call_id or ""))
        began = False

        def body() -> Any:
            nonlocal began
            began = True  # admitted and started: from here the effect may happen
            return inner(ctx, arguments)

        try:
            # Effects the body gates itself (`@estop.effect`) take their keys from this call.
            with step(f"call:{call_id}") if call_id else contextlib.nullcontext():
                out = await run_async(call, body, on_hold="wait", hold_timeout_s=hold_timeout_s)
        except asyncio.CancelledError:
            if began:
                # Cancelled mid-body (the SDK's tool timeout, or the invocation's cancel): a
                # thread the tool started runs on, so the call is `unknown` at the gate
                # (`run_async` reported it) and a retry of it must read that, not run again.
                _abandon(call)
            raise
        except (RunStopped, Interrupted):
            raise
        except InDoubt as e:
            # Still in doubt (an abandoned call nobody settled yet): kept, so every retry of it
            # reads the same answer until its outcome is known.
            return f"estop: an earlier identical call may still have happened ({e.status}); do not retry it"
        except Refused as e:
            if not refusal_as_output:
                raise
            return f"estop refused this call ({e.reason}); do not retry it"
        except EffectFailed:
            _forget(call)  # settled `error`: it did not happen; a retry is new
            raise
        _forget(call)  # settled `ok`: this was its recorded result
        return out

    gated = dataclasses.replace(tool, on_invoke_tool=on_invoke_tool, needs_approval=needs_approval if on_hold == "interrupt" else False)
    object.__setattr__(gated, "__estop_gated__", True)
    object.__setattr__(gated, "__estop_effect__", name)
    object.__setattr__(gated, "__estop_scope__", scope)
    object.__setattr__(gated, "__estop_prepare__", prepare)
    return gated


# -- calls abandoned mid-body ------------------------------------------------------------------
#
# The SDK's tool timeout (`@function_tool(timeout=...)`, async tools) cancels the tool's
# coroutine and, by default (`error_as_result`), tells the model the tool timed out; the model
# retries with a new call id. What the tool started in a thread (`asyncio.to_thread`) runs on,
# inside the application's tool where the adapter cannot wait for it: the call is `unknown` at the
# gate, and a retry with the same arguments takes its key — refused in doubt (a tool output the
# model reads) until an operator settles it, then given the settled result. Remembered per run id
# on the gate handle (so the next `eo.run` of the run, in this process, remembers it too).

_ABANDONED_KEPT = 1024
_ABANDONED_LOCK = threading.Lock()


def _abandoned(run: Run) -> "OrderedDict[tuple[str, str, str], str]":
    """(run id, effect, argument digest) → the key of a call of that run abandoned mid-body."""
    out: "OrderedDict[tuple[str, str, str], str]" = run.gate.__dict__.setdefault("_eo_abandoned", OrderedDict())
    return out


def _abandon(call: EffectCall) -> None:
    calls = _abandoned(call.run)
    with _ABANDONED_LOCK:
        calls[(call.run.id, call.tool, call.digest)] = call.key
        while len(calls) > _ABANDONED_KEPT:
            calls.popitem(last=False)


def _forget(call: EffectCall) -> None:
    """The abandoned call's outcome is known now (an operator settled it): a later identical
    call is a new one."""
    calls = _abandoned(call.run)
    with _ABANDONED_LOCK:
        if calls.get((call.run.id, call.tool, call.digest)) == call.key:
            del calls[(call.run.id, call.tool, call.digest)]


class EstopRunHooks(RunHooksBase[Any, Any]):  # type: ignore[misc]
    """Whole-turn admission (`_common.admit_turn`) through the SDK's public run hooks: the SDK
    awaits `on_llm_end` after the model responds and before any tool of the response runs, so
    every gated function call of the response is admitted there (prepared: admitted, not
    started; approval calls first). Each call's own task then asks the gate (`needs_approval`,
    the tool) after every admission of its turn, so a pending approval holds its parallel
    siblings whatever order the SDK runs them in. `eo.run` / `run_sync` / `run_streamed` install
    it; `inner` is the application's own `RunHooks` (`hooks=`), called as before. Pass
    `hooks=eo.EstopRunHooks(your_hooks)` to `Runner.run` when calling it directly."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner

    async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
        await _admit_response(context, agent, response)
        if self.inner is not None:
            await self.inner.on_llm_end(context, agent, response)


def _delegate(name: str) -> Any:
    async def hook(self: EstopRunHooks, *args: Any, **kw: Any) -> None:
        if self.inner is not None:
            await getattr(self.inner, name)(*args, **kw)

    hook.__name__ = name
    return hook


for _name in [n for n in vars(RunHooksBase) if n.startswith("on_") and n != "on_llm_end"]:
    setattr(EstopRunHooks, _name, _delegate(_name))


def _with_turn_hooks(runner_kw: dict[str, Any]) -> dict[str, Any]:
    hooks = runner_kw.get("hooks")
    return runner_kw if isinstance(hooks, EstopRunHooks) else {**runner_kw, "hooks": EstopRunHooks(hooks)}


async def _admit_response(context: Any, agent: Any, response: Any) -> None:
    """Admits the gated function calls of a model response, per run they act in (a handed-off
    agent's: its child run), before any of them starts."""
    if current_run(required=False) is None:
        return
    tools = {t.name: t for t in getattr(agent, "tools", None) or [] if getattr(t, "__estop_prepare__", None)}
    calls: list[EffectCall] = []
    for item in getattr(response, "output", None) or []:
        tool = tools.get(getattr(item, "name", None)) if getattr(item, "type", None) == "function_call" else None
        if tool is None or not item.call_id:
            continue
        try:
            args = json.loads(item.arguments) if item.arguments else {}
        except ValueError:
            continue  # the SDK tells the model about malformed arguments itself; nothing runs
        calls.append(await tool.__estop_prepare__(context, args, item.call_id))
    runs: dict[str, list[EffectCall]] = {}
    for c in calls:
        runs.setdefault(c.run.id, []).append(c)
    for mine in runs.values():
        await admit_turn(mine[0].run, tuple(c.key for c in mine), functools.partial(list, mine))


def _held(agent: Any, interruptions: Iterable[Any], run_id: str) -> list[tuple[str, str, Any]]:
    """(run id, key, item) of each interruption of a gated tool; a handed-off agent's tools act
    in its child run."""
    out = []
    for item in interruptions:
        tools = list(getattr(getattr(item, "agent", None), "tools", None) or []) + list(getattr(agent, "tools", []))
        raw = item.raw_item
        get = raw.get if isinstance(raw, dict) else lambda k, d=None: getattr(raw, k, d)
        name = item.tool_name or get("name")
        tool = next((t for t in tools if getattr(t, "name", None) == name and getattr(t, "__estop_effect__", None)), None)
        call_id, arguments = get("call_id"), get("arguments")
        if tool is not None and call_id:
            scope = getattr(tool, "__estop_scope__", None)
            rid = f"{run_id}.{scope}" if scope else run_id
            out.append((rid, call_key(rid, tool.__estop_effect__, call_id, json.loads(arguments) if arguments else {}), item))
    return out


def holds(agent: Any, interruptions: Iterable[Any], run_id: str | Run) -> list[str]:
    """The estop keys of the SDK interruptions (`result.interruptions`,
    `state.get_interruptions()`) of gated tools: what the operator decides. Works in a new
    process from a loaded RunState (the key is the call id + tool + arguments)."""
    return [k for _, k, _ in _held(agent, interruptions, run_id.id if isinstance(run_id, Run) else run_id)]


async def resolve(agent: Any, state: Any, *, gate: Estop | None = None, run_id: str | Run, timeout_s: float | None = None) -> dict[str, str]:
    """Waits for the operator's decisions on the interruptions of a `RunState` (woken by the
    gate's events, no polling), then writes them into the state — `approve` (and `sibling` /
    `paused`: held by another call's approval or a pause, they wait at the gate) →
    `state.approve`, anything else → `state.reject` — and returns key → decision. Then resume with `eo.run(agent, state, ...)`. The state only mirrors the gate:
    an approved call still asks the gate when it runs, so an approval written into the state by
    the agent process counts for nothing (G7)."""
    rid = run_id.id if isinstance(run_id, Run) else run_id
    held = _held(agent, list(state.get_interruptions()), rid)
    if not held:
        return {}
    if gate is None:
        from ..run import default

        gate = default()
    decided: dict[str, str] = {}
    for sub in dict.fromkeys(r for r, _, _ in held):
        decided |= await gate.await_decided(sub, [k for r, k, _ in held if r == sub], timeout_s)
    for _, key, item in held:
        decision = decided.get(key)
        # A sibling of an approval (or a paused call) has no decision of its own: let it run,
        # and it waits at the gate until what holds it is lifted.
        if decision in ("approve", "sibling", "paused"):
            state.approve(item)
        elif decision is not None:
            state.reject(item, rejection_message=f"estop refused this call ({_REFUSED.get(decision, decision)}); do not retry it")
    return decided


def gate_agent(agent: Any, *, effects: dict[str, str] | None = None, **kw: Any) -> Any:
    """A copy of `agent` with every FunctionTool gated, and so for each agent it can hand off to
    (recursively, cycles kept): a handed-off agent's calls act in the child run `RUN.<its
    name>` (parent link sent on its first admission, so a cancel of the run reaches it at the
    gate). `Handoff` objects hand off to the gated copy of what they return. Sub-agents used as
    tools: `agent_tool`."""
    return _gate_tree(agent, None, dict(effects or {}), kw, {})


def _gate_tree(agent: Any, scope: str | None, effects: dict[str, str], kw: dict[str, Any], seen: dict[int, Any]) -> Any:
    if id(agent) in seen:
        return seen[id(agent)]
    tools = [gate_tool(t, effect=effects.get(t.name), scope=scope, **kw) if isinstance(t, FunctionTool) else t for t in agent.tools]
    gated = agent.clone(tools=tools, handoffs=[])
    seen[id(agent)] = gated
    out: list[Any] = []
    for h in agent.handoffs:
        if isinstance(h, Handoff):
            out.append(_gate_handoff(h, effects, kw, seen))
        else:
            out.append(_gate_tree(h, _scope_name(h.name), effects, kw, seen))
    gated.handoffs = out
    return gated


def _gate_handoff(h: Any, effects: dict[str, str], kw: dict[str, Any], seen: dict[int, Any]) -> Any:
    inner = h.on_invoke_handoff

    async def on_invoke_handoff(ctx: Any, input_json: str) -> Any:
        return _gate_tree(await inner(ctx, input_json), _scope_name(h.agent_name), effects, kw, seen)

    return dataclasses.replace(h, on_invoke_handoff=on_invoke_handoff)


def agent_tool(agent: Any, tool_name: str | None = None, tool_description: str | None = None, *, effects: dict[str, str] | None = None, gate_kw: dict[str, Any] | None = None, **as_tool_kw: Any) -> FunctionTool:
    """`agent.as_tool(...)` whose every invocation is a child run of the calling run —
    `RUN.<tool name>-<call id>`, the parent link sent on its first admission, so a cancel of the
    parent reaches the sub-agent at the gate — with the sub-agent's tools gated (`gate_agent`)."""
    sub = gate_agent(agent, effects=effects, **(gate_kw or {}))
    t = sub.as_tool(tool_name, tool_description, **as_tool_kw)
    inner = t.on_invoke_tool

    async def on_invoke_tool(ctx: Any, arguments: str) -> Any:
        parent = current_run()
        assert parent is not None
        call_id = getattr(ctx, "tool_call_id", None) or "call"
        async with parent.child(_scope_name(f"{t.name}-{call_id}")):
            return await inner(ctx, arguments)

    gated = dataclasses.replace(t, on_invoke_tool=on_invoke_tool)
    object.__setattr__(gated, "__estop_gated__", True)
    return gated


def _estop_stop(e: BaseException) -> BaseException | None:
    seen: BaseException | None = e
    for _ in range(8):  # a short chain: the SDK wraps once or twice
        seen = seen.__cause__ or seen.__context__ if seen is not None else None
        if isinstance(seen, (RunStopped, Interrupted)):
            return seen
    return None


_REFUSED = {"reject": "rejected", "expired": "expired", "cancelled": "cancelled"}


def gate_tools(tools: Iterable[Any], *, effects: dict[str, str] | None = None, **kw: Any) -> list[Any]:
    """`gate_tool` for every FunctionTool in `tools` (others are passed through). `effects` maps
    a tool name to the effect it performs at the gate (e.g. two tools that move money)."""
    eff = effects or {}
    return [gate_tool(t, effect=eff.get(t.name), **kw) if isinstance(t, FunctionTool) else t for t in tools]


async def run(agent: Any, input: Any, *, gate: Estop | None = None, run_id: str | Run | None = None, parent: Run | str | None = None, timeout_s: float | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, **runner_kw: Any) -> Any:
    """`Runner.run` inside the estop run `run_id`."""
    r = resolve_run(gate, run_id, parent=parent) if parent else resolve_run(gate, run_id)

    async def go() -> Any:
        coro = Runner.run(agent, input, **_with_turn_hooks(runner_kw))
        try:
            return await (asyncio.wait_for(coro, timeout_s) if timeout_s else coro)
        except AgentsException as e:
            # The SDK wraps what a tool raised ("Error running tool …"): a stopped run or an
            # interrupted invocation is estop's, and surfaces as itself.
            stop = _estop_stop(e)
            if stop is not None:
                raise stop from e
            raise

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
                stop = _estop_stop(e) if isinstance(e, AgentsException) else None
                if stop is not None:
                    raise stop from e
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
        result = Runner.run_streamed(agent, input, **_with_turn_hooks(runner_kw))
    return EstopStreamedRun(result, r, inv)
