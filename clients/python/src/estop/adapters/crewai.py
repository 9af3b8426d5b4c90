"""CrewAI: CrewAI's public tool-call hooks gate every tool call of a crew; the crew's kickoff runs
as an invocation of an estop run.

    from estop.adapters import crewai as ecr

    hooks = ecr.EstopHooks(approval={"wire_money"})
    out = await ecr.kickoff(crew, gate=gate, run_id="order-42", hooks=hooks, inputs={...})

* `EstopHooks` is a pair of CrewAI `before_tool_call` / `after_tool_call` hooks (and a
  `before_llm_call` hook). Before a tool runs it is admitted by estop (tool name → effect name,
  its input → digest) and started; after it, its result is recorded (`ok`, or `error` for the
  exception CrewAI turned into "Error executing tool: …"). The key is the model's tool call id
  (CrewAI keeps the turn's assistant message in its executor's state) + the digest, so the same
  call has the same key when a job is redelivered; a call without an id (CrewAI's text-mode
  ReAct tools) is keyed by run + tool + digest + its occurrence in the invocation.
  `@estop.effect`s the tool body calls are keyed from the call too (step `call:<id>`).
* A duplicate, a refusal, a stopped run or an interrupted invocation block the call (a hook
  returning False, CrewAI's own veto) and the after hook puts estop's answer in the tool's
  result: the recorded result for a duplicate, the reason otherwise. CrewAI swallows a hook's
  exception and runs the tool anyway (fail-open), so these hooks never raise: anything
  unexpected blocks the call (fail-closed).
* A held call (an approval, its sibling, a paused run) waits in the hook, as CrewAI's own
  tool-level human-in-the-loop (`ToolCallHookContext.request_human_input`) waits in the hook for
  a console answer; here the answer is the operator's decision in estop (console, CLI, API),
  never the agent process's. `hold_timeout_s` bounds the wait (then the call is blocked and
  the approval stays pending).
* The model turn's tool calls (the assistant message) are all admitted before any starts, so an
  approval holds its parallel siblings whatever order CrewAI's thread pool runs them in.
* A task CrewAI runs again after it failed (the agent's `max_retry_limit`) asks the model afresh,
  whose calls have new ids: the k-th call of a tool with the same arguments in the retry is keyed
  as the k-th such call of the failed attempt (so it reads that receipt, and its body's
  `@estop.effect`s the failed attempt's), and any other call as its own. Only a retry of the same
  task by the same agent in the same invocation, after attempts that all failed, is linked; see
  `_link` below for how an attempt and CrewAI's report of its end are told, and ordered.
* A hold that survives a restart is a Flow's: `FlowApproval` is a CrewAI `HumanFeedbackProvider`
  for `@human_feedback`, CrewAI's public async pause. The reviewed method's output is the
  call's arguments; the provider asks estop for an approval and raises `HumanFeedbackPending`
  (CrewAI persists the flow; the estop key is in the context's `metadata["estop"]`). In any
  process, `Flow.from_pending(flow_id, persistence)` restores it and `await resume_flow(flow)`
  waits for the operator's decision (gate events) and resumes; the listener performs the call
  with `approval.perform(self, fn)`, which asks the gate again with the same key: approved, it
  runs once (a second resume of the same saved state reads the receipt); rejected, `Rejected`;
  still held (the application resumed with its own "approve"), `HeldForApproval` and nothing
  runs.
* `kickoff` / `kickoff_sync` run the crew as an invocation of the run, with the hooks scoped to
  it (CrewAI's `scoped_hooks`, carried into CrewAI's worker threads by `contextvars`): a
  timeout, a task cancel or Ctrl-C interrupts the invocation and the run stays usable; only
  `run.cancel()` or an operator's cancel stops it (CrewAI has no "stop this crew" API). After a
  stop or an interruption the `before_llm_call` hook blocks the crew's next model call, so the
  crew's worker thread ends instead of planning on; `kickoff` raises `RunStopped` when the run
  was stopped. `hooks.install()` registers the same hooks process-wide instead (every crew;
  a tool call outside any estop run is then blocked).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from ._common import missing_extra

try:
    from crewai.events import AgentExecutionCompletedEvent, AgentExecutionErrorEvent, crewai_event_bus
    from crewai.hooks.dispatch import InterceptionPoint, get_scoped_hooks, register, register_scoped, scoped_hooks, unregister
except ImportError as e:
    raise missing_extra("crewai", "CrewAI", "crewai", e) from e

from .._jcs import digest
from ..effect import EffectCall, admit_prepared_sync, call_key, encode_result, gate_sync, make_call, run_sync
from ..errors import EffectFailed, EstopError, EstopTimeout, HeldForApproval, InDoubt, Interrupted, Refused, RunStopped
from ..verdicts import Held, RefusedVerdict
from ..run import Estop, Run, current_invocation, current_run, step
from ._common import STOP_ON, admit_turn_sync, aguarded, await_released, guarded, hold_payload, resolve_run

__all__ = ["EstopHooks", "FlowApproval", "kickoff", "kickoff_sync", "resume_flow"]

log = logging.getLogger("estop.adapters.crewai")

#: How CrewAI reports a tool that raised (agent_executor / agent_utils): the result string.
_TOOL_ERROR = "Error executing tool: "


@dataclass
class _Pending:
    """What the before hook decided for one call, for the after hook of the same call (same
    thread, right after): run it and record its outcome, or replace CrewAI's block message."""

    tool: str
    call: EffectCall | None = None
    token: str | None = None
    answer: str | None = None
    scope: Any = None


def _answer_of(e: BaseException) -> str:
    if isinstance(e, EstopTimeout):
        return "estop: held for an operator's decision, not decided within hold_timeout_s; it did not run (the approval stays pending)"
    if isinstance(e, RunStopped):
        return f"estop: the run is stopped ({e.reason}); stop working on it"
    if isinstance(e, Interrupted):
        return "estop: this invocation was interrupted; do not continue"
    if isinstance(e, Refused):
        return f"estop refused this call ({e.reason}); do not retry it"
    if isinstance(e, InDoubt):
        return f"estop: an earlier identical call may still have happened ({e.status}); do not retry it"
    if isinstance(e, EffectFailed):
        return f"estop: this call failed before and is not retried: {e}"
    return f"estop could not admit this call ({type(e).__name__}: {e}); it did not run"


def _result_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _turn_calls(ctx: Any) -> list[dict[str, Any]]:
    """The tool calls of the model turn this call belongs to: the latest assistant message with
    `tool_calls` in the agent executor's conversation (CrewAI appends it before running them)."""
    ex = getattr(getattr(ctx, "agent", None), "agent_executor", None)
    state = getattr(ex, "state", None)
    msgs = getattr(state, "messages", None) or getattr(ex, "messages", None) or []
    for m in reversed(list(msgs)):
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls"):
            return [c for c in m["tool_calls"] if isinstance(c, dict) and c.get("id")]
    return []


def _parsed(c: dict[str, Any]) -> tuple[str, Any]:
    fn = c.get("function") or {}
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else (args or {})
    except ValueError:
        pass
    return str(fn.get("name")), args if args is not None else {}


# -- a task CrewAI runs again: its calls take the keys of the attempt that failed ------------------
#
# When a task fails, CrewAI runs it again (the agent's `max_retry_limit`: `Agent.execute_task`
# catches the error, emits `AgentExecutionErrorEvent` and calls itself). The retry asks the model
# afresh, and the model's calls have new ids: keyed by call id, a charge the failed attempt made
# would be made again. So within one invocation (one `kickoff`) the adapter follows each task of
# each agent (its `_Execution`): an attempt starts at the agent's first model call of a fresh
# conversation (the `before_llm_call` hook sees `iterations == 0` and a new first message: CrewAI's
# executor starts every `execute_task` that way), and CrewAI reports how each attempt ended
# (`AgentExecutionErrorEvent` / `AgentExecutionCompletedEvent`, whose handlers CrewAI runs in a
# thread pool without waiting). At the start of a second attempt the hook waits for those handlers
# (`crewai_event_bus.flush`), so the report of the attempt before it is in before the new attempt
# makes any call. A call of the new attempt is then keyed as the k-th call of the same tool with
# the same arguments (the same digest) in the attempts it retries — the attempts right before it,
# each of which ended in failure — and as its own call otherwise. Nothing else is linked: another
# task, another agent, another tool, other arguments, a call beyond the failed attempts' count, an
# execution after one that completed, another invocation, or an attempt whose predecessor's report
# did not come within `retry_link_timeout_s`.

#: Tasks (agent × task pairs) followed per invocation, and attempts per task; past these bounds a
#: new one is not followed (its calls are keyed as their own, as without this linking; logged).
_EXECUTIONS_MAX = 1024
_ATTEMPTS_MAX = 64
#: Turns remembered per task (a turn's calls resolve their keys once, in the turn's order).
_TURNS_MAX = 4096


@dataclass
class _Attempt:
    """One run of a task by its agent: from its first model call to CrewAI's report of its end."""

    first: Any  # the first message of its conversation: CrewAI builds a new one for every attempt
    reports_before: int  # reports in when it started (all of the earlier attempts', or `sure` is False)
    sure: bool
    used: dict[tuple[str, str, str], list[str]]  # (kind, tool, digest) → the ids its calls were keyed as, in order
    chain: int | None = None  # the first attempt it retries (itself if none), once computed


class _Execution:
    """One task of one agent within an invocation: its attempts and CrewAI's reports of their ends
    (True: failed, in the order the handlers ran)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: list[_Attempt] = []
        self.reports: list[bool] = []
        self.turns: dict[tuple[str, ...], dict[str, str]] = {}
        self.overflow = False  # more attempts than _ATTEMPTS_MAX: no call of it is linked any more


_executions_lock = threading.Lock()


def _execution(agent: Any, task: Any, *, create: bool) -> _Execution | None:
    """The `_Execution` of (agent, task) in this context's invocation (else its run), or None."""
    run = current_run(required=False)
    if run is None or agent is None or task is None:
        return None
    holder: Any = current_invocation() or run
    with _executions_lock:
        table: dict[tuple[str, str], _Execution] = holder.__dict__.setdefault("_crewai_executions", {})
        key = (str(getattr(agent, "id", id(agent))), str(getattr(task, "id", id(task))))
        ex = table.get(key)
        if ex is None and create:
            if len(table) >= _EXECUTIONS_MAX:
                log.warning("estop: more than %d CrewAI tasks in one invocation of run %r: a retry of the next is keyed as new calls", _EXECUTIONS_MAX, run.id)
                return None
            ex = table[key] = _Execution()
        return ex


def _on_report(source: Any, event: Any) -> None:
    """CrewAI's report of how an attempt ended (the handler CrewAI runs in its thread pool, in a
    copy of the context that emitted it, so of the same run and invocation)."""
    _note_report(event)


def _note_report(event: Any) -> None:
    ex = _execution(getattr(event, "agent", None), getattr(event, "task", None), create=False)
    if ex is not None:
        with ex.lock:
            if not ex.overflow:  # (past the attempts bound nothing reads them)
                ex.reports.append(isinstance(event, AgentExecutionErrorEvent))


_listening = False


def _listen() -> None:
    global _listening
    with _executions_lock:
        if not _listening:
            crewai_event_bus.on(AgentExecutionErrorEvent)(_on_report)
            crewai_event_bus.on(AgentExecutionCompletedEvent)(_on_report)
            _listening = True


def _chain(ex: _Execution, n: int) -> int:
    """The first attempt that attempt n retries: walking back while each earlier attempt's
    reports (its own and those of attempts that failed before a model call) are all failures."""
    a = ex.attempts[n]
    if a.chain is None:
        m = n
        for j in range(n - 1, -1, -1):
            if not ex.attempts[j + 1].sure:
                break
            got = ex.reports[ex.attempts[j].reports_before : ex.attempts[j + 1].reports_before]
            if not got or not all(got):
                break
            m = j
        a.chain = m
    return a.chain


def _link(ex: _Execution, kind: str, tool: str, args: Any, own: str) -> str:
    """The id the latest attempt's next call of `tool` with `args` is keyed as (under ex.lock)."""
    try:
        d = digest(tool, args)
    except (TypeError, ValueError):
        return own
    if ex.overflow:
        return own
    n = len(ex.attempts) - 1
    cur = ex.attempts[n]
    mine = cur.used.setdefault((kind, tool, d), [])
    k = len(mine)
    picked = own
    if n > 0 and any(len(a.used.get((kind, tool, d), ())) > k for a in ex.attempts[:n]):
        for a in ex.attempts[_chain(ex, n) : n]:
            earlier = a.used.get((kind, tool, d), [])
            if len(earlier) > k:
                picked = earlier[k]
                break
    mine.append(picked)
    return picked


class EstopHooks:
    """CrewAI tool-call hooks that admit every tool call through estop (see the module doc)."""

    def __init__(self, *, effects: dict[str, str] | None = None, approval: Iterable[str] = (), hold_timeout_s: float | None = None, retry_link_timeout_s: float = 10.0) -> None:
        self.effects = dict(effects or {})
        self.approval = set(approval)
        self.hold_timeout_s = hold_timeout_s
        self.retry_link_timeout_s = retry_link_timeout_s
        self._local = threading.local()
        _listen()

    def _stack(self) -> list[_Pending]:
        st: list[_Pending] | None = getattr(self._local, "stack", None)
        if st is None:
            st = self._local.stack = []
        return st

    def _build(self, run: Run, name: str, args: Any, call_id: str | None, key: str | None = None) -> EffectCall:
        effect = self.effects.get(name, name)
        if call_id:
            key = call_key(run, effect, call_id, args)
        return make_call(run, effect, args, key=key, needs_approval=name in self.approval)

    def _call_id(self, run: Run, name: str, args: Any, turn: list[dict[str, Any]]) -> str | None:
        """The model's id of this call: the turn's call with this name and input; identical
        calls of one turn are taken in order (they are interchangeable)."""
        ids = [c["id"] for c in turn if _parsed(c) == (name, args)]
        if not ids:
            return None
        taken: dict[tuple[str, ...], set[str]] = run.__dict__.setdefault("_crewai_taken", {})
        with run._tasks_lock:
            used = taken.setdefault(tuple(c["id"] for c in turn), set())
            free = [i for i in ids if i not in used] or ids
            used.add(free[0])
            return free[0]

    def _admit_turn(self, run: Run, turn: list[dict[str, Any]], ids: dict[str, str]) -> None:
        def build() -> list[EffectCall]:
            return [self._build(run, *_parsed(c), ids.get(c["id"], c["id"])) for c in turn]

        admit_turn_sync(run, ("crewai",) + tuple(c["id"] for c in turn), build)

    def before_tool_call(self, ctx: Any) -> bool | None:
        """CrewAI's `before_tool_call` hook: None lets the call run, False blocks it."""
        name = str(ctx.tool_name)
        pending = _Pending(tool=name)
        self._stack().append(pending)
        try:
            run = current_run(required=False)
            if run is None:
                pending.answer = "estop: no estop run; run the crew through estop (ecr.kickoff) — the call did not run"
                return False
            args = dict(ctx.tool_input or {})
            turn = _turn_calls(ctx)
            call_id = self._call_id(run, name, args, turn)
            ex = _execution(getattr(ctx, "agent", None), getattr(ctx, "task", None), create=False)
            if call_id is not None:
                # A call of a task CrewAI runs again is keyed as the failed attempt's (see _link).
                ids = self._turn_ids(ex, turn)
                call_id = ids.get(call_id, call_id)
                call = self._build(run, name, args, call_id)
                self._admit_turn(run, turn, ids)
            else:
                call = self._build(run, name, args, None)
                if ex is not None:
                    call = self._build(run, name, args, None, key=self._text_key(ex, name, args, call.key))
            g = gate_sync(call, on_hold="wait", hold_timeout_s=self.hold_timeout_s)
        except BaseException as e:  # noqa: BLE001 — CrewAI would run the tool on any exception
            pending.answer = _answer_of(e)
            log.info("estop: crewai call %s blocked: %s", name, pending.answer)
            return False
        if g.duplicate is not None:
            pending.answer = _result_text(g.duplicate.result)
            return False
        pending.call, pending.token = call, g.token
        if call_id is not None:
            # `@estop.effect`s the tool body calls are keyed from this call (step `call:<id>`), not
            # by their order in a fresh kickoff; CrewAI runs the body right after, in this thread.
            pending.scope = step(f"call:{call_id}")
            pending.scope.__enter__()
        return None

    def after_tool_call(self, ctx: Any) -> str | None:
        """CrewAI's `after_tool_call` hook: records the outcome of a call that ran, or puts
        estop's answer in place of CrewAI's block message."""
        stack = self._stack()
        pending = next((p for p in reversed(stack) if p.tool == str(ctx.tool_name)), None)
        if pending is None:
            return None  # not a call these hooks saw (installed mid-call)
        stack.remove(pending)
        if pending.scope is not None:
            with contextlib.suppress(ValueError):  # (left in another context: nothing to reset)
                pending.scope.__exit__(None, None, None)
        if pending.call is None:
            return pending.answer
        assert pending.token is not None
        raw = ctx.raw_tool_result
        c = pending.call
        try:
            # CrewAI catches the tool's exception and passes its message as both results.
            if isinstance(raw, str) and raw is ctx.tool_result and raw.startswith(_TOOL_ERROR):
                c.run.gate.client.complete(c.run.id, c.key, pending.token, "error", error=raw[len(_TOOL_ERROR):][:4000])
            else:
                c.run.gate.client.complete(c.run.id, c.key, pending.token, "ok", result=encode_result(raw))
        except EstopError:
            log.warning("estop: %s of run %r key %r ran but its completion could not be recorded", c.tool, c.run.id, c.key, exc_info=True)
        return None

    def before_llm_call(self, ctx: Any) -> bool | None:
        """CrewAI's `before_llm_call` hook: after the run was stopped or this invocation was
        interrupted, the crew's next model call is blocked, so its worker thread ends instead of
        planning (and asking for) more calls. The first model call of an attempt at a task starts
        that attempt (see `_link`)."""
        run = current_run(required=False)
        inv = current_invocation()
        if run is not None and (run.stopped or (inv is not None and inv.interrupted)):
            return False
        if run is not None:
            try:
                self._note_attempt(ctx)
            except Exception:  # noqa: BLE001 — a hook that raises would fail the model call
                log.warning("estop: could not follow CrewAI's attempts at a task; a retry of it is keyed as new calls", exc_info=True)
        return None

    def _note_attempt(self, ctx: Any) -> None:
        """Starts a new attempt when this is the first model call of a fresh conversation of the
        (agent, task): CrewAI's executor resets its iterations and builds new messages for every
        `execute_task`. At a second attempt, CrewAI's event handlers are waited for, so the report
        of how the attempt before it ended is in before any call of this one is keyed."""
        msgs = getattr(ctx, "messages", None)
        if getattr(ctx, "iterations", None) != 0 or not msgs:
            return
        ex = _execution(getattr(ctx, "agent", None), getattr(ctx, "task", None), create=True)
        if ex is None:
            return
        with ex.lock:
            if ex.attempts and ex.attempts[-1].first is msgs[0]:
                return  # another model call before the attempt's first answer
            if len(ex.attempts) >= _ATTEMPTS_MAX:
                if not ex.overflow:
                    log.warning("estop: more than %d attempts at one CrewAI task: its calls are keyed as their own from now on", _ATTEMPTS_MAX)
                ex.overflow = True
                return
            again = bool(ex.attempts)
        sure = True
        if again:
            sure = crewai_event_bus.flush(timeout=self.retry_link_timeout_s)
            if not sure:
                log.warning("estop: CrewAI's event handlers did not finish within %s s: this attempt at the task is keyed as new calls", self.retry_link_timeout_s)
        with ex.lock:
            ex.attempts.append(_Attempt(first=msgs[0], reports_before=len(ex.reports), sure=sure, used={}))

    def _turn_ids(self, ex: _Execution | None, turn: list[dict[str, Any]]) -> dict[str, str]:
        """Each call id of the turn → the id its key is made from (resolved once per turn, in the
        turn's order, so identical calls of one turn take the failed attempt's in order)."""
        if ex is None or not turn:
            return {}
        t = tuple(c["id"] for c in turn)
        with ex.lock:
            if not ex.attempts:
                return {}
            ids = ex.turns.get(t)
            if ids is None:
                if len(ex.turns) >= _TURNS_MAX:
                    log.warning("estop: more than %d model turns in one CrewAI task: its calls are keyed as their own", _TURNS_MAX)
                    return {}
                ids = ex.turns[t] = {c["id"]: _link(ex, "id", *_parsed(c), c["id"]) for c in turn}
            return ids

    def _text_key(self, ex: _Execution, name: str, args: Any, own: str) -> str:
        """The key of a text-mode (ReAct) call without an id: its own, or the failed attempt's."""
        with ex.lock:
            return _link(ex, "key", name, args, own) if ex.attempts else own

    def _points(self) -> list[tuple[Any, Any]]:
        return [
            (InterceptionPoint.PRE_TOOL_CALL, self.before_tool_call),
            (InterceptionPoint.POST_TOOL_CALL, self.after_tool_call),
            (InterceptionPoint.PRE_MODEL_CALL, self.before_llm_call),
        ]

    @contextlib.contextmanager
    def scoped(self) -> Iterator["EstopHooks"]:
        """The hooks for what runs in this context (CrewAI's `scoped_hooks`; its worker threads
        copy the context, so they carry them). Hooks the caller scoped around it stay, first."""
        with scoped_hooks({p: get_scoped_hooks(p) for p in InterceptionPoint}):
            for point, fn in self._points():
                register_scoped(point, fn)
            yield self

    def install(self) -> "EstopHooks":
        """Registers the hooks process-wide (every crew; a call outside any estop run is blocked)."""
        for point, fn in self._points():
            register(point, fn)
        return self

    def uninstall(self) -> None:
        for point, fn in self._points():
            unregister(point, fn)


def _stopped(run: Run, e: BaseException | None) -> None:
    why = run.stopped
    if why is not None and not isinstance(e, RunStopped):
        raise RunStopped(why, run=run.id, local=True) from e


async def kickoff(crew: Any, *, gate: Estop | None = None, run_id: str | Run | None = None, hooks: EstopHooks | None = None, timeout_s: float | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, **kw: Any) -> Any:
    """`await crew.kickoff_async(**kw)` as an invocation of the estop run `run_id`, its tool calls
    gated by `hooks` (default: `EstopHooks()`); returns the crew's output."""
    r = resolve_run(gate, run_id)
    h = hooks or EstopHooks()
    try:
        async with aguarded(r, stop_on=stop_on):
            with h.scoped():
                aw = crew.kickoff_async(**kw)
                out = await (asyncio.wait_for(aw, timeout_s) if timeout_s else aw)
    except BaseException as e:
        _stopped(r, e)
        raise
    _stopped(r, None)
    return out


def kickoff_sync(crew: Any, *, gate: Estop | None = None, run_id: str | Run | None = None, hooks: EstopHooks | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, **kw: Any) -> Any:
    """The blocking form of `kickoff` (`crew.kickoff(**kw)`; Ctrl-C interrupts the invocation)."""
    r = resolve_run(gate, run_id)
    h = hooks or EstopHooks()
    try:
        with guarded(r, stop_on=stop_on), h.scoped():
            out = crew.kickoff(**kw)
    except BaseException as e:
        _stopped(r, e)
        raise
    _stopped(r, None)
    return out


# -- a hold that survives a restart: CrewAI Flow's `@human_feedback` pause -----------------------


class FlowApproval:
    """A CrewAI `HumanFeedbackProvider` that makes an estop approval the `@human_feedback`
    pause of a Flow (see the module doc). `effect`: the effect at the gate; the reviewed
    method's output is its arguments (JSON). `run_id`: the estop run (default: the flow's id).
    Use it as `@human_feedback(message=..., provider=approval)` on the method that proposes the
    call, and call `approval.perform(self, fn)` in the listener that does it.
    """

    def __init__(self, *, effect: str, gate: Estop | None = None, run_id: str | None = None) -> None:
        self.effect = effect
        self.gate = gate
        self.run_id = run_id

    def _call(self, flow_id: str, method: str, args: Any) -> EffectCall:
        gate = self.gate
        if gate is None:
            from ..run import default

            gate = default()
        rid = self.run_id or flow_id
        return make_call(gate.run(rid), self.effect, args, key=call_key(rid, self.effect, f"flow:{method}", args), needs_approval=True)

    def request_feedback(self, context: Any, flow: Any) -> str:
        """CrewAI's question to the reviewer, answered by the gate: held → the flow pauses
        (`HumanFeedbackPending`, persisted by CrewAI); decided before (a re-run of the same flow)
        → the decision."""
        call = self._call(context.flow_id, context.method_name, context.method_output)
        v = admit_prepared_sync(call)
        if isinstance(v, Held):
            _pause(context, HeldForApproval(call.run.id, call.key, call.tool, v), call.args)
        if isinstance(v, RefusedVerdict):
            return {"rejected": "reject"}.get(v.reason, v.reason)
        return "approve"

    def perform(self, flow: Any, fn: Any) -> Any:
        """Runs `fn(args)` (the reviewed output) as the approved call, in a listener of the
        `@human_feedback` method: the gate decides, whatever feedback the flow was resumed
        with. Approved: runs once, its result recorded (a repeat returns it); rejected:
        `Rejected`; still held (the flow was resumed with an answer the operator did not give):
        `HeldForApproval`, nothing runs and the estop approval stays pending."""
        review = flow.last_human_feedback
        if review is None:
            raise ValueError("FlowApproval.perform runs in a listener of the @human_feedback method it reviews")
        call = self._call(flow.flow_id, review.method_name, review.output)
        return run_sync(call, lambda: fn(review.output), on_hold="raise")


def _pause(context: Any, h: HeldForApproval, args: Any) -> None:
    from crewai.flow import HumanFeedbackPending

    context.metadata = {**(context.metadata or {}), **hold_payload(h, args)}
    raise HumanFeedbackPending(context=context, callback_info=dict(context.metadata["estop"]))


async def resume_flow(flow: Any, *, gate: Estop | None = None, timeout_s: float | None = None) -> Any:
    """Waits for the operator's decision on the estop hold a restored flow is paused at
    (`Flow.from_pending(...)`; gate events, no polling), then `flow.resume_async(decision)`
    and returns what it returns (its result, or `HumanFeedbackPending` at the next pause).
    `EstopTimeout` if undecided within `timeout_s` (the flow stays pending)."""
    context = flow.pending_feedback
    held = (getattr(context, "metadata", None) or {}).get("estop") if context is not None else None
    if not isinstance(held, dict):
        raise ValueError("this flow is not paused at an estop hold (restore it with Flow.from_pending)")
    if gate is None:
        from ..run import default

        gate = default()
    decided = await await_released(gate, held["run"], [held["key"]], timeout_s)
    if held["key"] not in decided:
        raise EstopTimeout(f"{held['tool']} in run {held['run']!r} still held after {timeout_s} s")
    return await flow.resume_async(decided[held["key"]])
