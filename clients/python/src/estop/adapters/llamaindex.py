"""LlamaIndex Workflows: gated effects in steps, holds shown on the event stream; the workflow's
timeout and `cancel_run` interrupt the invocation, `handler.stop()` stops the run.

    from estop.adapters import llamaindex as eli

    handler = eli.run(MyWorkflow(timeout=60), gate=gate, run_id="order-42", user_msg="...")
    async for ev in handler.stream_events(): ...
    result = await handler           # WorkflowTimeoutError / cancel_run → this invocation is interrupted
    await handler.stop()             # the gate first (nothing new of the run starts), then the workflow

* Steps run inside the estop run (workflow tasks and step threads inherit it), so every
  `estop.effect` they call — and `eli.effect` — is admitted by the gate first, with the
  sibling hold, reject stickiness and duplicate receipts of the gate.
* A held `eli.effect(..., ctx=ctx)` call is LlamaIndex's own pause: the step waits with
  `ctx.wait_for_event(EstopDecided, waiter_event=EstopHeld(...))` — it does not block: the
  workflow is idle, `EstopHeld` (an `InputRequiredEvent`) is on the stream, and the context can be
  saved (`ctx.to_dict()`), the handler dropped and the workflow restored later. The release is
  estop's: when an operator decides (`estop approve RUN KEY`, the console) the handler sends the
  step an `EstopDecided` (a `HumanResponseEvent`), and the step, replayed as LlamaIndex does,
  asks the gate again: approved → the effect runs once; rejected → `Rejected`. A response the
  application sends itself decides nothing (the replayed step asks the gate, and waits there for
  the operator).
* A step's `retry_policy` runs the step again after a failure: `eli.run` wraps the workflow's
  steps so that the effects of a retry take the keys of the attempt it retries (the k-th call
  of a tool with the same arguments in the retry is the k-th one of the failed attempt, whose
  receipt it reads). The attempts are linked by LlamaIndex's own `ctx.retry_info()`: a retry's
  `last_exception` is the very exception the failed attempt raised.
* A step that waits (`ctx.wait_for_event`) is run again from its start when the awaited event
  arrives: that replay is the same execution, so the effects it calls again before the wait —
  plain `estop.effect` ones too — take the keys of the attempt that waited and read its
  receipts (no second charge). The replay is linked by the event LlamaIndex re-delivers to the
  step: the very event object the waiting attempt was run with. Anything else — another
  execution of the step, even with an identical event — keys its effects by their order in the
  run, as before (so keys across a resume are unchanged; a replay in a restored workflow, a new
  `eli.run`, is keyed by that order too).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import types
from typing import Any, AsyncIterator, Callable, Generator

from ._common import missing_extra

try:
    from workflows.events import HumanResponseEvent, InputRequiredEvent
except ImportError as e:
    raise missing_extra("llamaindex", "LlamaIndex Workflows", "llamaindex", e) from e

from ..effect import call_args, make_call, run_async, run_sync
from ..errors import HeldForApproval
from ..effect import _run_occurrence
from ..run import Estop, Invocation, Run, Step, _current_step, current_run
from ._common import STOP_ON as _NO_STOP, await_released, hold_payload, resolve_run

__all__ = ["EstopHandler", "EstopHeld", "EstopDecided", "run", "effect", "STOP_ON"]

log = logging.getLogger("estop")

#: Where a held step records its call (key, tool, digest) in the workflow's state store
#: (`ctx.store`): a handler restored from a saved context knows which decisions to wait for, and
#: the replayed step presents the same key.
HELD_STORE_KEY = "estop_held"

#: Exceptions that cancel the run by default: none. The workflow's `timeout`
#: (`WorkflowTimeoutError`), `cancel_run()` (`WorkflowCancelledByUser`), a task cancel or Ctrl-C
#: interrupt the invocation; `handler.stop()`, `run.cancel()` or an operator stop the run.
STOP_ON: tuple[type[BaseException], ...] = _NO_STOP


class EstopHeld(InputRequiredEvent):
    """Written to the stream when an effect of the run is held by estop (approval/sibling/paused)."""

    estop: dict[str, Any]


class EstopDecided(HumanResponseEvent):
    """Sent to a held step by its handler when estop lets the effect go or refuses it. It only
    wakes the step: the replayed step asks the gate, whose answer is what counts."""

    key: str
    decision: str
    response: str = ""


_RELEASER: "contextvars.ContextVar[_Releaser | None]" = contextvars.ContextVar("estop_li_releaser", default=None)


class _Releaser:
    """Waits for estop to settle each held key of the run, then sends the step its
    `EstopDecided` through the handler's context."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.handler: Any = None
        self.watching: dict[str, asyncio.Task[None]] = {}

    def watch(self, key: str) -> None:
        if key not in self.watching:
            self.watching[key] = asyncio.get_running_loop().create_task(self._release(key))

    async def _release(self, key: str) -> None:
        decided = await await_released(self.run.gate, self.run.id, [key])
        if key in decided and self.handler is not None:
            self.handler.ctx.send_event(EstopDecided(key=key, decision=decided[key], response=decided[key]))

    async def serve(self) -> None:
        """Stops watching when the workflow ends. (A restored context needs nothing more: the
        runtime runs a waiting step again from its start, which asks the gate, and a call still
        held pauses again and is watched from here.)"""
        try:
            with contextlib.suppress(Exception):
                await self.handler.stop_event_result()
        finally:
            self.stop()

    def stop(self) -> None:
        for t in self.watching.values():
            t.cancel()


class EstopHandler:
    """A workflow handler whose run is an estop run."""

    def __init__(self, handler: Any, run: Run, stop_on: tuple[type[BaseException], ...], invocation: Invocation, releaser: _Releaser) -> None:
        self.handler = handler
        self.run = run
        self.stop_on = stop_on
        self.invocation = invocation
        self.releaser = releaser
        releaser.handler = handler
        self._releasing = asyncio.get_running_loop().create_task(releaser.serve())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handler, name)

    @property
    def ctx(self) -> Any:
        return self.handler.ctx

    def stream_events(self, *a: Any, **kw: Any) -> AsyncIterator[Any]:
        return self.handler.stream_events(*a, **kw)

    async def result(self) -> Any:
        try:
            return await self.handler
        except BaseException as e:
            # The workflow's timeout, cancel_run(), a crash: this invocation is over (its step
            # threads and tasks start nothing more). The run stops only for `stop_on`.
            self.invocation.interrupt(f"workflow ended: {type(e).__name__}", spare=asyncio.current_task())
            if self.stop_on and isinstance(e, self.stop_on):
                await asyncio.shield(self.run.acancel(f"workflow stopped: {type(e).__name__}", spare=asyncio.current_task()))
            raise

    def __await__(self) -> Generator[Any, None, Any]:
        return self.result().__await__()

    async def cancel_run(self, reason: str = "cancel_run") -> None:
        """LlamaIndex's `cancel_run()`, which its docs also use to pause (`ctx.to_dict()`, cancel,
        restore later): interrupts this invocation (nothing of it starts a new effect from now
        on) and cancels the workflow; the run and its pending approvals stay, so a restored
        workflow goes on. `stop()` is the stop."""
        self.invocation.interrupt(reason, spare=asyncio.current_task())
        await self.handler.cancel_run()

    async def stop(self, reason: str = "stopped by the caller") -> None:
        """Stops the run at the gate first (nothing new of it starts anywhere), then cancels the
        workflow."""
        await self.run.acancel(reason)
        await self.handler.cancel_run()


def run(workflow: Any, *, gate: Estop | None = None, run_id: str | Run | None = None, stop_on: tuple[type[BaseException], ...] = STOP_ON, **start_kw: Any) -> EstopHandler:
    """`workflow.run(**start_kw)` as the estop run `run_id` (call it inside a running loop)."""
    r = resolve_run(gate, run_id)
    _wrap_steps(workflow)
    inv = Invocation(r)
    releaser = _Releaser(r)
    reset = _RELEASER.set(releaser)
    try:
        with r, inv:
            handler = workflow.run(**start_kw)
    finally:
        _RELEASER.reset(reset)
    # The workflow's tasks copied the context above: their steps see `r` as the current run, this
    # invocation and the releaser. (A saved context: `run(workflow, ctx=Context.from_dict(...))`.)
    return EstopHandler(handler, r, stop_on, inv, releaser)


def effect(fn: Any = None, *, tool: str | None = None, needs_approval: bool = False, ctx_arg: str = "ctx", exclude: set[str] | None = None, hold_timeout_s: float | None = None) -> Any:
    """`estop.effect` for workflow steps. Pass the step's Context as `ctx=` (keyword): a hold is
    then LlamaIndex's own pause (`wait_for_event`, `EstopHeld` on the stream; see the module
    doc), released by estop. Without `ctx` (or in a sync step) a hold waits in the call."""

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        name = tool or f.__name__
        skip = frozenset(exclude or ()) | {ctx_arg}

        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def awrapper(*a: Any, **kw: Any) -> Any:
                ctx = kw.get(ctx_arg)
                run = current_run()
                assert run is not None
                call = make_call(run, name, call_args(f, a, kw, skip), needs_approval=needs_approval)
                if ctx is None:
                    return await run_async(call, lambda: f(*a, **kw), hold_timeout_s=hold_timeout_s)
                # A step replayed after its pause presents the call it held, whatever the
                # occurrence count says now.
                call.key = await _held_key(ctx, call) or call.key
                try:
                    return await run_async(call, lambda: f(*a, **kw), on_hold="raise")
                except HeldForApproval as h:
                    await _pause(ctx, call, h)
                # Woken by an EstopDecided (the step was replayed up to here): the gate's answer
                # counts. One the application sent itself while estop still holds the call waits.
                return await run_async(call, lambda: f(*a, **kw), hold_timeout_s=hold_timeout_s)

            return awrapper

        @functools.wraps(f)
        def wrapper(*a: Any, **kw: Any) -> Any:
            run = current_run()
            assert run is not None
            call = make_call(run, name, call_args(f, a, kw, skip), needs_approval=needs_approval)
            # (A step thread cannot pause the workflow safely: a sync hold just waits.)
            return run_sync(call, lambda: f(*a, **kw), hold_timeout_s=hold_timeout_s)

        return wrapper

    if fn is not None and callable(fn):
        return wrap(fn)
    return wrap


async def _pause(ctx: Any, call: Any, h: HeldForApproval) -> None:
    """Parks the step until estop settles `h.key` (LlamaIndex's `wait_for_event`: raises its
    control-flow exception the first time, returns the `EstopDecided` on the replay)."""
    held = await ctx.store.get(HELD_STORE_KEY, default=[])
    if all(e["key"] != h.key for e in held):
        await ctx.store.set(HELD_STORE_KEY, [*held, {"key": h.key, "tool": call.tool, "digest": call.digest}])
    releaser = _RELEASER.get()
    if releaser is not None:
        releaser.watch(h.key)
    else:
        log.warning("estop: %s of run %r is held outside eli.run: nothing will wake the step", call.tool, call.run.id)
    await ctx.wait_for_event(EstopDecided, waiter_event=EstopHeld(estop=hold_payload(h, call.args)["estop"]), waiter_id=f"estop:{h.key}", requirements={"key": h.key}, timeout=None)
    held = await ctx.store.get(HELD_STORE_KEY, default=[])
    await ctx.store.set(HELD_STORE_KEY, [e for e in held if e["key"] != h.key])


async def _held_key(ctx: Any, call: Any) -> str | None:
    """The key of the same call (tool + digest) that a step of this workflow holds."""
    for e in await ctx.store.get(HELD_STORE_KEY, default=[]):
        if e.get("tool") == call.tool and e.get("digest") == call.digest:
            return str(e["key"])
    return None


class _Execution:
    """One execution of a step across its attempts: the occurrence in the run (the key) that its
    attempts' k-th call of (tool, digest) takes."""

    def __init__(self) -> None:
        self.taken: dict[tuple[str, str, int], int] = {}
        self.lock = threading.Lock()


class _Attempt(Step):
    """One attempt of a step execution. Its effects are keyed as any effect of the run is
    ("run", the n-th call of (tool, digest) in this run object), except that a retry's k-th call
    of (tool, digest) takes the occurrence the failed attempt's k-th one took."""

    def __init__(self, run: Run, execution: _Execution) -> None:
        super().__init__("run")
        self.run = run
        self.execution = execution

    def occurrence(self, tool: str, digest: str) -> int:
        k = super().occurrence(tool, digest)
        with self.execution.lock:
            n = self.execution.taken.get((tool, digest, k))
            if n is None:
                n = self.execution.taken[(tool, digest, k)] = _run_occurrence(self.run, "run", tool, digest)
            return n


#: A run object's failed attempts, by the id of the exception each raised (kept alive with it:
#: exceptions take no weak references). Bounded: an attempt nothing retries drops out.
_FAILED_MAX = 256


def _is_waiting(exc: BaseException) -> bool:
    """LlamaIndex's control-flow exception of `ctx.wait_for_event` (the step is replayed later)."""
    return _WaitingForEvent is not None and isinstance(exc, _WaitingForEvent)


try:
    from workflows.runtime.types.results import WaitingForEvent as _WaitingForEvent
except ImportError:  # pragma: no cover - another layout of the workflows package
    _WaitingForEvent = None  # type: ignore[assignment,misc]
    # Said once, loudly: without it a plain `@estop.effect` before `ctx.wait_for_event` is keyed
    # by its order in the run again, and the step's replay after the wait is a second effect.
    log.warning(
        "estop: this llama-index-workflows has no workflows.runtime.types.results.WaitingForEvent; "
        "an @estop.effect called before ctx.wait_for_event in a step is repeated by the step's replay "
        "(use eli.effect(..., ctx=ctx) there, or the version estop pins)"
    )


class _AttemptScope:
    """Around one attempt of a step (see `_wrap_steps`): a retry (`retry_policy`) or the replay
    after a `ctx.wait_for_event` takes the execution of the attempt it repeats."""

    def __init__(self, step_name: str, event: Any = None) -> None:
        self.step_name = step_name
        self.event = event
        self.run: Run | None = None
        self.execution: _Execution | None = None
        self.tok: Any = None

    def __enter__(self) -> None:
        self.run = current_run()
        if self.run is None:
            return
        from workflows import Context

        failed = self._failed()
        execution = None
        info = Context.get_step_context().retry_info()
        if info.retry_number > 0 and info.last_exception is not None:
            # (Executions of this step that raised the same exception object — one the
            # application keeps and raises again — are told apart by nothing: each retry takes
            # one of them, never two retries the same one, and only calls identical to one of
            # its own match, as identical calls of the run already do.)
            execution = self._take(failed, info.last_exception)
        if execution is None and self.event is not None:
            # The replay after a wait: LlamaIndex re-delivers the event object the attempt that
            # waited ran with (one execution per waiting attempt, as for retries above).
            execution = self._take(self._store("_li_waiting_attempts"), self.event)
        self.execution = execution or _Execution()
        self.tok = _current_step.set(_Attempt(self.run, self.execution))

    def _take(
        self, store: dict[int, list[tuple[Any, str, _Execution]]], obj: Any
    ) -> _Execution | None:
        """Takes (and removes) the first execution this step recorded under `obj` (that very
        object, not an equal one), or None."""
        assert self.run is not None
        found: _Execution | None = None
        with self.run._tasks_lock:
            entries = store.get(id(obj), [])
            for i, (o, name, ex) in enumerate(entries):
                if o is obj and name == self.step_name:
                    found = ex
                    del entries[i]
                    break
            if not entries:
                store.pop(id(obj), None)
        return found

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> None:
        if self.tok is None:
            return
        _current_step.reset(self.tok)
        if not isinstance(exc, Exception) or self.run is None or self.execution is None:
            return
        if _is_waiting(exc):
            if self.event is None:
                return
            table, ident, entry = self._store("_li_waiting_attempts"), id(self.event), (self.event, self.step_name, self.execution)
        else:
            table, ident, entry = self._failed(), id(exc), (exc, self.step_name, self.execution)
        with self.run._tasks_lock:
            table.setdefault(ident, []).append(entry)
            while len(table) > _FAILED_MAX:
                del table[next(iter(table))]

    def _failed(self) -> dict[int, list[tuple[BaseException, str, _Execution]]]:
        return self._store("_li_failed_attempts")

    def _store(self, name: str) -> dict[int, list[tuple[Any, str, _Execution]]]:
        assert self.run is not None
        with self.run._tasks_lock:
            return self.run.__dict__.setdefault(name, {})  # type: ignore[no-any-return]


def _wrap_steps(workflow: Any) -> None:
    """Wraps the async steps (they can wait) and the steps that have a `retry_policy` on this
    workflow object (once), so that a retry of a step's execution, or its replay after a wait,
    keys its effects as the attempt it repeats (see the module doc). A fresh execution keys them
    as an unwrapped step does."""
    if workflow.__dict__.get("_estop_steps_wrapped"):
        return
    for name, fn in workflow._get_steps().items():
        config = getattr(fn, "_step_config", None)
        if config is None:
            continue
        if getattr(config, "retry_policy", None) is None and not inspect.iscoroutinefunction(fn):
            continue
        bound = inspect.ismethod(fn) and fn.__self__ is workflow
        f = fn.__func__ if bound else fn
        setattr(workflow, name, types.MethodType(_wrap_step(name, f), workflow) if bound else _wrap_step(name, f))
    workflow.__dict__["_estop_steps_wrapped"] = True


def _wrap_step(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(f):

        @functools.wraps(f)
        async def astep(*a: Any, **kw: Any) -> Any:
            with _AttemptScope(name, _step_event(a, kw)):
                return await f(*a, **kw)

        return astep

    @functools.wraps(f)
    def step(*a: Any, **kw: Any) -> Any:
        with _AttemptScope(name, _step_event(a, kw)):
            return f(*a, **kw)

    return step


def _step_event(a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """The event a step is run with (the first `Event` argument)."""
    from workflows.events import Event

    return next((v for v in (*a, *kw.values()) if isinstance(v, Event)), None)
