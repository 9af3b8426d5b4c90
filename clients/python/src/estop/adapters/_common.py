"""What every adapter shares: running a framework invocation inside an estop run, and turning
the framework's stop signals (task cancel, timeout, Ctrl-C) into a gate cancel."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, TypeVar

from ..run import Estop, Run, current_run

T = TypeVar("T")

#: Exceptions that mean "the caller stopped this run" (not a crash, which a resume continues).
STOP_SIGNALS: tuple[type[BaseException], ...] = (asyncio.CancelledError, TimeoutError, asyncio.TimeoutError, KeyboardInterrupt)


def resolve_run(gate: Estop | None, run: Run | str | None, **kw: Any) -> Run:
    """A Run for `run` (an id or a Run); with neither, the current run (or a fresh one)."""
    if isinstance(run, Run):
        return run
    if gate is None:
        from ..run import default

        gate = default()
    if run is None:
        cur = current_run(required=False)
        if cur is not None and not kw:
            return cur
    return gate.run(run, **kw)


async def arun_guarded(run: Run, fn: Callable[[], Awaitable[T]], *, stop_on: tuple[type[BaseException], ...] = STOP_SIGNALS, reason: str | None = None) -> T:
    """Awaits `fn()` as the current run; a cancel/timeout of it cancels the run at the gate
    (the local fence first, so no worker thread of this run starts an effect meanwhile)."""
    async with run:
        try:
            return await fn()
        except stop_on as e:
            why = reason or f"{type(e).__name__} in the agent process"
            await asyncio.shield(run.acancel(why, spare=asyncio.current_task()))
            raise


def run_guarded(run: Run, fn: Callable[[], T], *, stop_on: tuple[type[BaseException], ...] = STOP_SIGNALS, reason: str | None = None) -> T:
    """The blocking form of `arun_guarded`."""
    with run:
        try:
            return fn()
        except stop_on as e:
            run.cancel(reason or f"{type(e).__name__} in the agent process")
            raise


@contextlib.contextmanager
def guarded(run: Run, *, stop_on: tuple[type[BaseException], ...] = STOP_SIGNALS, reason: str | None = None) -> Iterator[Run]:
    with run:
        try:
            yield run
        except stop_on as e:
            run.cancel(reason or f"{type(e).__name__} in the agent process")
            raise


@contextlib.asynccontextmanager
async def aguarded(run: Run, *, stop_on: tuple[type[BaseException], ...] = STOP_SIGNALS, reason: str | None = None) -> AsyncIterator[Run]:
    async with run:
        try:
            yield run
        except stop_on as e:
            await asyncio.shield(run.acancel(reason or f"{type(e).__name__} in the agent process", spare=asyncio.current_task()))
            raise


def hold_payload(h: Any, args: Any = None) -> dict[str, Any]:
    """What an adapter shows the framework's human-in-the-loop UI for a held effect."""
    return {
        "estop": {
            "run": h.run,
            "key": h.key,
            "tool": h.tool,
            "args": args,
            "reason": h.held.reason,
            "approval": h.held.approval,
            "expires_at": h.held.expires_at,
            "how": f"estop approve {h.run} {h.key}  (or reject); an agent cannot approve",
        }
    }
