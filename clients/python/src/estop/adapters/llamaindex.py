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
* `eli.effect(ctx=...)`-wrapped calls write an `EstopHeld` event (an `InputRequiredEvent`) to the
  workflow's stream when held, so the UI that used to answer `wait_for_event` approvals shows the
  estop approval instead; the decision is an operator's (`estop approve RUN KEY`), and the step
  waits for it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any, AsyncIterator, Callable, Generator

from ._common import missing_extra

try:
    from workflows.events import InputRequiredEvent
except ImportError as e:
    raise missing_extra("llamaindex", "LlamaIndex Workflows", "llamaindex", e) from e

from ..effect import call_args, make_call, run_async, run_sync
from ..errors import HeldForApproval
from ..run import Estop, Invocation, Run, current_run
from ._common import STOP_ON as _NO_STOP, hold_payload, resolve_run

__all__ = ["EstopHandler", "EstopHeld", "run", "effect", "STOP_ON"]

#: Exceptions that cancel the run by default: none. The workflow's `timeout`
#: (`WorkflowTimeoutError`), `cancel_run()` (`WorkflowCancelledByUser`), a task cancel or Ctrl-C
#: interrupt the invocation; `handler.stop()`, `run.cancel()` or an operator stop the run.
STOP_ON: tuple[type[BaseException], ...] = _NO_STOP


class EstopHeld(InputRequiredEvent):
    """Written to the stream when an effect of the run is held by estop (approval/sibling/paused)."""

    estop: dict[str, Any]


class EstopHandler:
    """A workflow handler whose run is an estop run."""

    def __init__(self, handler: Any, run: Run, stop_on: tuple[type[BaseException], ...], invocation: Invocation) -> None:
        self.handler = handler
        self.run = run
        self.stop_on = stop_on
        self.invocation = invocation

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
    inv = Invocation(r)
    with r, inv:
        handler = workflow.run(**start_kw)
    # The workflow's tasks copied the context above: their steps see `r` as the current run and
    # this invocation.
    return EstopHandler(handler, r, stop_on, inv)


def effect(fn: Any = None, *, tool: str | None = None, needs_approval: bool = False, ctx_arg: str = "ctx", exclude: set[str] | None = None, hold_timeout_s: float | None = None) -> Any:
    """`estop.effect` for workflow steps: pass the step's Context as `ctx=` (keyword) and a hold
    is also written to the workflow's event stream as `EstopHeld`."""

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        name = tool or f.__name__
        skip = frozenset(exclude or ()) | {ctx_arg}

        def announce(ctx: Any, call: Any, h: HeldForApproval) -> None:
            if ctx is not None:
                ctx.write_event_to_stream(EstopHeld(estop=hold_payload(h, call.args)["estop"]))

        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def awrapper(*a: Any, **kw: Any) -> Any:
                ctx = kw.get(ctx_arg)
                run = current_run()
                assert run is not None
                call = make_call(run, name, call_args(f, a, kw, skip), needs_approval=needs_approval)
                try:
                    return await run_async(call, lambda: f(*a, **kw), on_hold="raise")
                except HeldForApproval as h:
                    announce(ctx, call, h)
                    return await run_async(call, lambda: f(*a, **kw), hold_timeout_s=hold_timeout_s)

            return awrapper

        @functools.wraps(f)
        def wrapper(*a: Any, **kw: Any) -> Any:
            run = current_run()
            assert run is not None
            call = make_call(run, name, call_args(f, a, kw, skip), needs_approval=needs_approval)
            # (A step thread cannot write to the stream safely: a sync hold just waits.)
            return run_sync(call, lambda: f(*a, **kw), hold_timeout_s=hold_timeout_s)

        return wrapper

    if fn is not None and callable(fn):
        return wrap(fn)
    return wrap
