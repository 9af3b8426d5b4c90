"""What every adapter shares: running a framework invocation inside an estop run, and telling an
interruption of that invocation from a stop of the run (seed 004: cancel, interrupt and pause are
different actions).

* Any exception out of the invocation (a generator closed early, a step timeout, Ctrl-C, a
  cancelled task, a client-side `EstopTimeout`, a crash) **interrupts** it: what it left running
  refuses new effects (`Interrupted`), locally; the gate is not told and the run stays usable.
* Only an explicit stop **cancels** the run at the gate: `run.cancel()`, an operator's cancel,
  an adapter's `cancel(...)` for the framework's own "stop this run" API, or an exception type
  the caller lists in `stop_on`."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, TypeVar

from ..run import Estop, Invocation, Run, current_run

T = TypeVar("T")

#: Exceptions that cancel the run by default: none. A local interruption is not a stop.
STOP_ON: tuple[type[BaseException], ...] = ()


def missing_extra(module: str, framework: str, extra: str, error: ImportError) -> ImportError:
    """The error an adapter raises when its framework is not installed: names the extra."""
    return ImportError(f"estop.adapters.{module} needs {framework} ({error}): pip install 'estop-agents[{extra}]'")


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


def _why(e: BaseException, reason: str | None) -> str:
    return reason or f"{type(e).__name__} in the agent process"


def _task() -> "asyncio.Task[Any] | None":
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


async def arun_guarded(run: Run, fn: Callable[[], Awaitable[T]], *, stop_on: tuple[type[BaseException], ...] = STOP_ON, reason: str | None = None) -> T:
    """Awaits `fn()` as one invocation of `run`; an exception out of it interrupts the invocation
    (and cancels the run at the gate only if it is one of `stop_on`)."""
    async with aguarded(run, stop_on=stop_on, reason=reason):
        return await fn()


def run_guarded(run: Run, fn: Callable[[], T], *, stop_on: tuple[type[BaseException], ...] = STOP_ON, reason: str | None = None) -> T:
    """The blocking form of `arun_guarded`."""
    with guarded(run, stop_on=stop_on, reason=reason):
        return fn()


@contextlib.contextmanager
def guarded(run: Run, *, stop_on: tuple[type[BaseException], ...] = STOP_ON, reason: str | None = None) -> Iterator[Invocation]:
    inv = Invocation(run, owner=_task())
    with run, inv:
        try:
            yield inv
        except BaseException as e:
            inv.interrupt(_why(e, reason))
            if stop_on and isinstance(e, stop_on):
                run.cancel(_why(e, reason))
            raise


@contextlib.asynccontextmanager
async def aguarded(run: Run, *, stop_on: tuple[type[BaseException], ...] = STOP_ON, reason: str | None = None) -> AsyncIterator[Invocation]:
    me = asyncio.current_task()
    inv = Invocation(run, owner=me)
    async with run:
        with inv:
            try:
                yield inv
            except BaseException as e:
                inv.interrupt(_why(e, reason), spare=me)
                if stop_on and isinstance(e, stop_on):
                    await asyncio.shield(run.acancel(_why(e, reason), spare=me))
                raise


def human_interrupt(h: Any, args: Any = None) -> dict[str, Any]:
    """A held effect as LangGraph's `HumanInterrupt` (what agent-inbox style UIs render:
    `action_request`, `config`, `description`), with estop's details under `estop`. Accept and
    ignore are the only answers, and they count only from an operator (`approver=`); the
    decision is estop's."""
    est = hold_payload(h, args)
    return {
        "action_request": {"action": h.tool, "args": args if isinstance(args, dict) else {"args": args}},
        "config": {"allow_ignore": True, "allow_respond": False, "allow_edit": False, "allow_accept": True},
        "description": (
            f"estop holds {h.tool} ({h.held.reason}) in run {h.run}. An operator decides: "
            f"estop approve {h.run} {h.key} (or reject), or the console; the agent cannot approve."
        ),
        **est,
    }


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


async def await_released(gate: Estop, run_id: str, keys: list[str], timeout_s: float | None = None) -> dict[str, str]:
    """Waits until estop lets each held key of `run_id` go or refuses it, and returns key →
    `approve` (it may run now) or the refusal (`reject`, `expired`, `cancelled`). An approval is
    an operator's decision (the gate's events, `await_decided`); a call held as the sibling of
    another's approval or by a pause has none of its own, so it is released when the gate would
    start it (the gate's blocking `wait`, not a poll). Keys not settled within `timeout_s` are
    left out."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    decided = await gate.await_decided(run_id, keys, timeout_s)
    for k, d in list(decided.items()):
        if d in ("sibling", "paused"):
            left = None if deadline is None else max(0.0, deadline - loop.time())
            got = await _released(gate, run_id, k, left)
            if got is None:
                del decided[k]
            else:
                decided[k] = got
    return decided


async def _released(gate: Estop, run_id: str, key: str, timeout_s: float | None) -> str | None:
    from ..verdicts import Admitted, Duplicate, Go, Held, RefusedVerdict

    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while True:
        left = 2000 if deadline is None else int(max(1.0, min(2000.0, (deadline - loop.time()) * 1000)))
        v = await gate.aclient.wait(run_id, key, left)
        if isinstance(v, (Admitted, Go, Duplicate)):
            return "approve"
        if isinstance(v, RefusedVerdict):
            return {"rejected": "reject"}.get(v.reason, v.reason)
        assert isinstance(v, Held), v
        if deadline is not None and loop.time() >= deadline:
            return None


# -- whole-turn admission -----------------------------------------------------------------------
#
# A model turn asks for several calls at once and the framework runs them in parallel. If one
# call is admitted and started before another call's approval is asked, it is not held by that
# approval. So the first call of a turn to reach its gate admits the whole turn (prepared:
# admitted, not started; approval calls first) before it goes on, and the others wait for that:
# every `start` of the turn then comes after every admission, and a pending approval holds its
# siblings whatever order the framework starts them in.

_TURNS_KEPT = 256


class _Admitted:
    """Set once a turn is admitted; waited on by threads (`wait`) and tasks (`await_set`)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._waiters: "list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]" = []

    def set(self) -> None:
        with self._lock:
            self._done.set()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)

    def wait(self) -> None:
        self._done.wait()

    async def await_set(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._done.is_set():
                return
            fut: "asyncio.Future[None]" = loop.create_future()
            self._waiters.append((loop, fut))
        await fut


def _resolve(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


def _turn_slot(run: Run, turn: Any) -> tuple[bool, _Admitted]:
    turns: "OrderedDict[Any, _Admitted]" = run.__dict__.setdefault("_turns_admitted", OrderedDict())
    with run._tasks_lock:
        ev = turns.get(turn)
        if ev is not None:
            return False, ev
        ev = turns[turn] = _Admitted()
        while len(turns) > _TURNS_KEPT:
            turns.popitem(last=False)
        return True, ev


def _ordered(calls: Iterable[Any]) -> list[Any]:
    return sorted(calls, key=lambda c: not c.needs_approval)


def admit_turn_sync(run: Run, turn: Any, calls: Callable[[], Iterable[Any]]) -> None:
    """Admits the calls of `turn` (built by `calls()`) once per run object; see above."""
    from ..effect import admit_prepared_sync
    from ..errors import EstopError, Interrupted, RunStopped

    first, ev = _turn_slot(run, turn)
    if not first:
        ev.wait()
        return
    try:
        for c in _ordered(calls()):
            try:
                admit_prepared_sync(c)
            except (RunStopped, Interrupted):
                raise
            except EstopError:
                pass  # the call itself meets the refusal when it is gated
    finally:
        ev.set()


async def admit_turn(run: Run, turn: Any, calls: Callable[[], Iterable[Any]]) -> None:
    """`admit_turn_sync` for asyncio."""
    from ..effect import admit_prepared
    from ..errors import EstopError, Interrupted, RunStopped

    first, ev = _turn_slot(run, turn)
    if not first:
        await ev.await_set()
        return
    try:
        for c in _ordered(calls()):
            try:
                await admit_prepared(c)
            except (RunStopped, Interrupted):
                raise
            except EstopError:
                pass
    finally:
        ev.set()
