"""LangGraph: gated tools and nodes, estop holds as `interrupt()`s, graph cancel/timeout → estop cancel.

    from estop.adapters import langgraph as el

    @el.effect(tool="refund")                 # in a node or a @tool body
    def refund(charge: str, amount: int): ...

    graph = el.EstopGraph(builder.compile(checkpointer=saver), gate)
    graph.invoke(inputs, {"configurable": {"thread_id": "order-42"}})   # run = thread id

* The run is the thread id (`configurable.thread_id`), or `run_id=` given to EstopGraph.
* An effect's logical step is its node, superstep and task path (`langgraph_node`,
  `langgraph_step`, `checkpoint_ns`), so a node re-executed on resume (LangGraph re-runs the whole
  node) or replayed from a checkpoint presents the same keys: the gate answers `duplicate` and
  the recorded result is returned instead of doing it again.
* A held effect (approval, or a sibling of one: a pause is a whole pause) raises LangGraph's own
  `interrupt()` with a `HumanInterrupt` (`action_request`, `config`, `description`, and the
  hold's details under `estop`) — what agent-inbox style UIs render (`on_hold="interrupt"`, the
  default inside a graph) — or blocks until decided (`on_hold="wait"`). The decision is made in
  estop by an operator (`estop approve RUN KEY`, the console) — never by the agent.
  `graph.wait_for_decision(config)` blocks until it is made (the gate's events, no polling);
  then `graph.resume(config)`. An `approver` (an operator Client held by your approval UI) lets a
  HumanResponse (`{"type": "accept"|"ignore"}`) or `{"decision": "approve"|"reject"}` resume
  value be recorded as that operator's decision.
* `invoke`/`ainvoke`/`stream`/`astream` are invocations of the run: breaking out of a stream, a
  task cancel, a timeout (including the graph's own `step_timeout`) or Ctrl-C *interrupts* the
  invocation — tool threads LangGraph cannot stop refuse new effects (`Interrupted`) — and the
  thread stays usable for the next turn. `graph.cancel(config)` (or an operator's cancel) stops
  the run for good.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, cast

from ._common import missing_extra

try:
    from langgraph.config import get_config
    from langgraph.runtime import get_runtime
    from langgraph.types import Command, interrupt
except ImportError as e:
    raise missing_extra("langgraph", "LangGraph", "langgraph", e) from e

from .._jcs import digest, to_json_value
from ..client import Client
from ..keys import derive_key
from ..effect import EffectCall, call_args, call_key, encode_result, make_call, run_async, run_sync
from ..errors import HeldForApproval, Interrupted, Refused, RunStopped
from ..run import Estop, Run, Step, current_run, current_step, step
from ._common import STOP_ON, admit_turn, admit_turn_sync, aguarded, guarded, human_interrupt

__all__ = ["EstopGraph", "effect", "step_of", "thread_run_id", "tool_node", "gate_tool_calls"]

_STEP_KEY = "__estop_step__"


def thread_run_id(config: dict[str, Any] | None) -> str | None:
    return ((config or {}).get("configurable") or {}).get("thread_id")


def step_of(config: dict[str, Any] | None) -> Step | None:
    """The logical step of the node execution that `config` belongs to (one Step per execution:
    LangGraph hands each task execution its own config)."""
    if not config:
        return None
    conf = config.setdefault("configurable", {})
    attempt = _attempt(conf)
    cached = conf.get(_STEP_KEY)
    # A RetryPolicy re-runs the node with (a copy of) the same configurable: the cached Step's
    # counts belong to the failed attempt, so each attempt starts a fresh count and the retry
    # presents the same keys as the first attempt (its effects read their receipts).
    if cached is None or cached[0] != attempt:
        md = config.get("metadata") or {}
        name = f"{md.get('langgraph_node', '?')}@{md.get('langgraph_step', '?')}:{conf.get('checkpoint_ns', '')}"
        cached = (attempt, Step(name))
        conf[_STEP_KEY] = cached
    return cast(Step, cached[1])


def _attempt(conf: dict[str, Any]) -> int:
    """The node's attempt number (1-based): `Runtime.execution_info.node_attempt`
    (`get_runtime()`, public; the config's runtime entry when called outside the node's
    context)."""
    try:
        runtime: Any = get_runtime()
    except RuntimeError:
        runtime = conf.get("__pregel_runtime")
    info = getattr(runtime, "execution_info", None)
    return int(getattr(info, "node_attempt", 1) or 1)


def _config() -> dict[str, Any] | None:
    try:
        return cast("dict[str, Any]", get_config())
    except RuntimeError:
        return None


def _call_for(tool: str, args: Any, needs_approval: bool) -> tuple[EffectCall, bool]:
    cfg = _config()
    run = current_run(required=False)
    if run is None:
        rid = thread_run_id(cfg)
        if rid is None:
            current_run()  # raises NoRun with the explanation
        from ..run import default

        run = default().run(rid)
    if current_step() is not None:
        # Inside a gated tool call (`tool_node`): keys come from the call's id.
        return make_call(run, tool, args, needs_approval=needs_approval), True
    st = step_of(cfg)
    if st is not None:
        d = digest(tool, args)
        key = derive_key(run.id, st.name, tool, d, st.occurrence(tool, d))
        return make_call(run, tool, args, key=key, needs_approval=needs_approval), True
    return make_call(run, tool, args, needs_approval=needs_approval), False


def effect(
    fn: Any = None,
    *,
    tool: str | None = None,
    needs_approval: bool = False,
    on_hold: str | None = None,
    hold_timeout_s: float | None = None,
    exclude: set[str] | None = None,
    approver: Client | None = None,
) -> Any:
    """`estop.effect` for LangGraph: keys from the node's step, holds as `interrupt()`."""

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        name = tool or f.__name__
        skip = frozenset(exclude or ()) | {"config", "runtime", "state"}

        def mode(in_graph: bool) -> str:
            return on_hold or ("interrupt" if in_graph else "wait")

        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def awrapper(*a: Any, **kw: Any) -> Any:
                call, in_graph = _call_for(name, call_args(f, a, kw, skip), needs_approval)
                m = mode(in_graph)
                while True:
                    try:
                        return await run_async(call, lambda: f(*a, **kw), on_hold="raise" if m == "interrupt" else "wait", hold_timeout_s=hold_timeout_s)
                    except HeldForApproval as h:
                        _interrupt(h, call, approver)

            return awrapper

        @functools.wraps(f)
        def wrapper(*a: Any, **kw: Any) -> Any:
            call, in_graph = _call_for(name, call_args(f, a, kw, skip), needs_approval)
            m = mode(in_graph)
            while True:
                try:
                    return run_sync(call, lambda: f(*a, **kw), on_hold="raise" if m == "interrupt" else "wait", hold_timeout_s=hold_timeout_s)
                except HeldForApproval as h:
                    _interrupt(h, call, approver)

        return wrapper

    if fn is not None and callable(fn):
        return wrap(fn)
    return wrap


def _interrupt(h: HeldForApproval, call: EffectCall, approver: Client | None) -> None:
    """Surfaces the hold as LangGraph's interrupt (a `HumanInterrupt`); returns when the graph is
    resumed. The resume value counts only through `approver` (an operator's client): an agent
    cannot approve (G7), so without it the hold simply asks the gate again."""
    value = interrupt(human_interrupt(h, call.args))
    decision = _decision_of(value)
    if approver is not None and decision is not None and h.reason == "approval":
        from ..errors import NotPending

        try:
            approver.decide(call.run.id, call.key, decision, value.get("reason") if isinstance(value, dict) else None)
        except NotPending:
            pass  # decided already (e.g. in the console)


def _decision_of(value: Any) -> str | None:
    """`{"decision": "approve"|"reject"}`, or a HumanResponse (`{"type": "accept"|"ignore"}`)."""
    if isinstance(value, list) and value:
        value = value[0]  # agent-inbox resumes with a list of HumanResponses
    if not isinstance(value, dict):
        return None
    if value.get("decision") in ("approve", "reject"):
        return str(value["decision"])
    return {"accept": "approve", "ignore": "reject"}.get(str(value.get("type")))


class EstopGraph:
    """A compiled graph whose invocations are estop runs (run = thread id)."""

    def __init__(self, graph: Any, gate: Estop, *, run_id: str | None = None, parent: Run | str | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON) -> None:
        self.graph = graph
        self.gate = gate
        self.run_id = run_id
        self.parent = parent
        self.stop_on = stop_on

    def __getattr__(self, name: str) -> Any:
        return getattr(self.graph, name)

    def run_for(self, config: dict[str, Any] | None) -> Run:
        rid = self.run_id or thread_run_id(config)
        if rid is None:
            raise ValueError("EstopGraph needs a run: pass run_id= or configurable.thread_id")
        return self.gate.run(rid, parent=self.parent)

    def invoke(self, input: Any, config: dict[str, Any] | None = None, **kw: Any) -> Any:
        with guarded(self.run_for(config), stop_on=self.stop_on):
            return self.graph.invoke(input, config, **kw)

    async def ainvoke(self, input: Any, config: dict[str, Any] | None = None, **kw: Any) -> Any:
        async with aguarded(self.run_for(config), stop_on=self.stop_on):
            return await self.graph.ainvoke(input, config, **kw)

    def stream(self, input: Any, config: dict[str, Any] | None = None, **kw: Any) -> Iterator[Any]:
        with guarded(self.run_for(config), stop_on=self.stop_on):
            yield from self.graph.stream(input, config, **kw)

    async def astream(self, input: Any, config: dict[str, Any] | None = None, **kw: Any) -> AsyncIterator[Any]:
        async with aguarded(self.run_for(config), stop_on=self.stop_on):
            async for chunk in self.graph.astream(input, config, **kw):
                yield chunk

    def cancel(self, config: dict[str, Any] | None = None, reason: str = "cancelled by the caller") -> None:
        """Stops the run (the thread) at the gate: the explicit stop. Every thread and task of it,
        in this process and wherever it runs, refuses new effects; later invocations of the
        thread are refused `cancelled`. (Breaking out of a stream, a step timeout or Ctrl-C only
        interrupt the invocation.)"""
        self.run_for(config).cancel(reason)

    async def acancel(self, config: dict[str, Any] | None = None, reason: str = "cancelled by the caller") -> None:
        await self.run_for(config).acancel(reason)

    def pending_interrupts(self, config: dict[str, Any]) -> list[Any]:
        snap = self.graph.get_state(config)
        return [i for t in snap.tasks for i in t.interrupts]

    def pending_holds(self, config: dict[str, Any]) -> list[dict[str, Any]]:
        """The estop holds among the pending interrupts (their `estop` part: run, key, reason…)."""
        return [i.value["estop"] for i in self.pending_interrupts(config) if isinstance(i.value, dict) and "estop" in i.value]

    def wait_for_decision(self, config: dict[str, Any], timeout_s: float | None = None) -> dict[str, str]:
        """Blocks until the operator decided the thread's pending approvals (woken by the gate's
        events, not by polling); returns key → `approve` | `reject` | `expired` | `cancelled`.
        Then `resume(config)`: the held calls ask the gate again and go, or are refused."""
        keys = [h["key"] for h in self.pending_holds(config) if h.get("reason") == "approval"]
        if not keys:
            return {}
        return self.gate.wait_decided(self.run_for(config).id, keys, timeout_s)

    async def await_decision(self, config: dict[str, Any], timeout_s: float | None = None) -> dict[str, str]:
        """`wait_for_decision` for asyncio."""
        snap = await self.graph.aget_state(config)
        keys = [i.value["estop"]["key"] for t in snap.tasks for i in t.interrupts if isinstance(i.value, dict) and i.value.get("estop", {}).get("reason") == "approval"]
        if not keys:
            return {}
        return await self.gate.await_decided(self.run_for(config).id, keys, timeout_s)

    def resume_command(self, config: dict[str, Any], value: Any = None) -> Command:
        """A Command resuming every pending interrupt with `value` (holds re-ask the gate)."""
        return Command(resume={i.id: value for i in self.pending_interrupts(config)})

    def resume(self, config: dict[str, Any], value: Any = None, **kw: Any) -> Any:
        return self.invoke(self.resume_command(config, value), config, **kw)

    async def aresume(self, config: dict[str, Any], value: Any = None, **kw: Any) -> Any:
        return await self.ainvoke(self.resume_command(config, value), config, **kw)


# -- ToolNode: every tool call gated, keyed by its tool_call_id ----------------------------------


def gate_tool_calls(*, effects: dict[str, str] | None = None, approval: Iterable[str] = (), skip: Iterable[str] = (), on_hold: str = "interrupt", hold_timeout_s: float | None = None, approver: Client | None = None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`(wrap_tool_call, awrap_tool_call)` for LangGraph's `ToolNode` (the public interception
    hook): each tool call is admitted by estop first, keyed by the model's `tool_call_id` (+ the
    digest), so a resumed or retried tools node reads receipts instead of calling again. The
    first call of a model turn to arrive admits all the turn's calls before any starts (so an
    approval holds its parallel siblings whatever order ToolNode runs them in). Tools
    named in `approval` ask for an estop approval; a hold is an `interrupt()` (`on_hold="wait"`
    blocks instead). A refusal becomes the tool's error message; a stopped or interrupted run
    raises. Tools in `skip` are not gated as a whole (a read, or a tool that calls `interrupt()`
    itself: a tool call is one effect, started before its body runs); `el.effect`s inside any
    tool are keyed from its call id."""
    eff = dict(effects or {})
    ask = frozenset(approval)
    skipped = frozenset(skip)
    mode = "raise" if on_hold == "interrupt" else "wait"

    def call_for(run: Run, tc: Any) -> EffectCall:
        name, call_id = str(tc["name"]), str(tc.get("id") or "")
        args = to_json_value(tc.get("args") or {})
        effect = eff.get(name, name)
        key = call_key(run, effect, call_id, args) if call_id else None
        return make_call(run, effect, args, key=key, needs_approval=name in ask)

    def prepare(request: Any) -> tuple[EffectCall, str, str, Any]:
        tc = request.tool_call
        cfg = getattr(getattr(request, "runtime", None), "config", None) or _config()
        run = current_run(required=False) or _thread_run(cfg)
        turn = _turn(request.state, tc, skipped)
        admit = (run, turn[0], lambda: [call_for(run, t) for t in turn[1]]) if turn else None
        return call_for(run, tc), str(tc["name"]), str(tc.get("id") or ""), admit

    def wrap(request: Any, execute: Callable[[Any], Any]) -> Any:
        call, name, call_id, turn = prepare(request)
        with step(f"call:{call_id}") if call_id else contextlib.nullcontext():
            if name in skipped:
                return execute(request)
            if turn:
                admit_turn_sync(*turn)
            while True:
                try:
                    req = _each_run_a_step(request, call_id)
                    return _message(run_sync(call, lambda: _content(execute(req)), on_hold=mode, hold_timeout_s=hold_timeout_s), name, call_id)
                except HeldForApproval as h:
                    _interrupt(h, call, approver)
                except (RunStopped, Interrupted):
                    raise
                except Refused as e:
                    return _refused(e, name, call_id)

    async def awrap(request: Any, execute: Callable[[Any], Any]) -> Any:
        call, name, call_id, turn = prepare(request)
        with step(f"call:{call_id}") if call_id else contextlib.nullcontext():
            if name in skipped:
                return await execute(request)
            if turn:
                await admit_turn(*turn)
            while True:
                try:
                    req = _each_run_a_step(request, call_id)

                    async def go() -> Any:
                        return _content(await execute(req))

                    return _message(await run_async(call, go, on_hold=mode, hold_timeout_s=hold_timeout_s), name, call_id)
                except HeldForApproval as h:
                    _interrupt(h, call, approver)
                except (RunStopped, Interrupted):
                    raise
                except Refused as e:
                    return _refused(e, name, call_id)

    return wrap, awrap


class _StepPerRun:
    """The request's tool, each run of it in a fresh step `call:{id}`. A retry inside estop's
    gated call (LangChain's `ToolRetryMiddleware` listed after `EstopMiddleware`: it calls
    ToolNode's execute again with the same request) runs the tool again; with one step for both
    runs, its `estop.effect`s would count as second occurrences (new keys, a second charge).
    A fresh step per run presents the first run's keys: the effects read their receipts."""

    def __init__(self, tool: Any, name: str) -> None:
        self._tool = tool
        self._step = name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tool, name)

    def invoke(self, *a: Any, **kw: Any) -> Any:
        with step(self._step):
            return self._tool.invoke(*a, **kw)

    async def ainvoke(self, *a: Any, **kw: Any) -> Any:
        with step(self._step):
            return await self._tool.ainvoke(*a, **kw)


def _each_run_a_step(request: Any, call_id: str) -> Any:
    """`request` whose tool runs each time in a fresh step (see `_StepPerRun`; the request's
    public `override`)."""
    if not call_id or getattr(request, "tool", None) is None or not hasattr(request, "override"):
        return request
    return request.override(tool=_StepPerRun(request.tool, f"call:{call_id}"))


def _turn(state: Any, tc: Any, skipped: frozenset[str]) -> tuple[tuple[str, ...], list[Any]] | None:
    """The model turn `tc` belongs to — the tool calls of the AI message that asked for it, as
    (their ids, the gated ones) — for whole-turn admission; None without call ids."""
    messages = state.get("messages") if isinstance(state, dict) else getattr(state, "messages", state)
    if not tc.get("id") or not isinstance(messages, list):
        return None
    for m in reversed(messages):
        calls = getattr(m, "tool_calls", None) or []
        if any(c.get("id") == tc["id"] for c in calls):
            if not all(c.get("id") for c in calls):
                return None
            return tuple(str(c["id"]) for c in calls), [c for c in calls if c["name"] not in skipped]
    return None


def tool_node(tools: Any, **kw: Any) -> Any:
    """`langgraph.prebuilt.ToolNode(tools)` with every call gated (`gate_tool_calls(**estop_kw)`);
    other keyword arguments go to ToolNode."""
    from langgraph.prebuilt import ToolNode

    mine = {k: kw.pop(k) for k in ("effects", "approval", "skip", "on_hold", "hold_timeout_s", "approver") if k in kw}
    wrap, awrap = gate_tool_calls(**mine)
    return ToolNode(tools, wrap_tool_call=wrap, awrap_tool_call=awrap, **kw)


def _thread_run(cfg: dict[str, Any] | None) -> Run:
    rid = thread_run_id(cfg)
    if rid is None:
        current_run()  # raises NoRun with the explanation
    from ..run import default

    return default().run(rid)


# What is recorded for a tool call is the ToolMessage's content and status (JSON); a receipt is
# turned back into the ToolMessage the model would have seen.
def _content(out: Any) -> Any:
    from langchain_core.messages import ToolMessage

    if isinstance(out, ToolMessage):
        return {"content": out.content, "status": out.status}
    return {"content": encode_result(out), "status": "success"}


def _message(recorded: Any, name: str, call_id: str) -> Any:
    from langchain_core.messages import ToolMessage

    r = recorded if isinstance(recorded, dict) else {"content": recorded}
    content = r.get("content")
    if not isinstance(content, (str, list)):
        content = json.dumps(content)
    return ToolMessage(content=content, name=name, tool_call_id=call_id, status=r.get("status", "success"))


def _refused(e: Refused, name: str, call_id: str) -> Any:
    from langchain_core.messages import ToolMessage

    return ToolMessage(content=f"estop refused this call ({e.reason}); do not retry it", name=name, tool_call_id=call_id, status="error")
