"""`@effect`: a side effect admitted by the gate first, for sync and async functions.

    @estop.effect(tool="refund")
    def refund(charge: str, amount: int) -> dict: ...

Each call: derive the key (run + step + tool + digest of the bound arguments) → `admit`
(two-phase) → while held, `wait` (cancellable; or raise HeldForApproval with on_hold="raise")
→ `start` (the commit point, re-checked at the instant of execution) → run → `complete`
ok / error (an exception) / unknown (a cancellation after start). A duplicate returns the recorded
result instead of running again; a refusal raises `Refused` (subclass by reason) and the function
never runs.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar, overload

from ._jcs import digest as _digest
from ._jcs import to_json_value
from .errors import EffectFailed, EstopError, EstopTimeout, HeldForApproval, InDoubt, Interrupted, refusal
from .keys import derive_key
from .run import Run, _cancelling, current_invocation, current_run, current_step
from .verdicts import Admitted, Duplicate, Go, Held, RefusedVerdict, Verdict

__all__ = ["effect", "Gated", "gate_sync", "gate_async", "EffectCall", "call_args", "call_key", "make_call"]

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("estop")

_RESULT_BYTES_MAX = 60_000
_ERROR_BYTES_MAX = 4000
_WAIT_CHUNK_MS = 2_000
_SKIP_PARAMS = frozenset({"self", "cls"})


@dataclass
class EffectCall:
    """One proposed effect: where, what, and its identity."""

    run: Run
    tool: str
    args: Any
    key: str
    needs_approval: bool = False
    #: How the call is undone (admit's `declare`): `compensate`, `compensate_args`, …
    declare: dict[str, str] | None = None

    @property
    def digest(self) -> str:
        return _digest(self.tool, self.args)


@dataclass
class Gated:
    """What the gate said: run it (`token`) or use the recorded result (`duplicate`)."""

    token: str | None
    duplicate: Duplicate | None = None


def call_args(fn: Callable[..., Any], a: tuple[Any, ...], kw: dict[str, Any], exclude: frozenset[str]) -> dict[str, Any]:
    """The bound arguments of a call as a JSON object (defaults applied), minus `exclude`."""
    try:
        sig = inspect.signature(fn)
        bound = sig.bind(*a, **kw)
        bound.apply_defaults()
        items = dict(bound.arguments)
        for name, p in sig.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD and name in items:
                items.update(items.pop(name))
    except (TypeError, ValueError):
        items = {f"arg{i}": v for i, v in enumerate(a)} | dict(kw)
    out: dict[str, Any] = {}
    for k, v in items.items():
        if k in exclude or k in _SKIP_PARAMS:
            continue
        try:
            out[k] = to_json_value(v)
        except TypeError as e:
            raise TypeError(
                f"argument {k!r} of {getattr(fn, '__name__', fn)!r} is not JSON ({e}); "
                f"pass exclude={{{k!r}}} to leave it out of the effect's identity"
            ) from None
    return out


def make_call(
    run: Run,
    tool: str,
    args: Any,
    *,
    step: str | None = None,
    key: str | None = None,
    needs_approval: bool = False,
    declare: dict[str, str] | None = None,
) -> EffectCall:
    if key is None:
        d = _digest(tool, args)
        st = current_step()
        if st is not None and (step is None or st.name == step):
            name, n = st.name, st.occurrence(tool, d)
        elif step is not None:
            # A named step outside a scope of that name: identical calls are still told apart
            # by their order within this run object (one invocation), as in an `estop.step`.
            name, n = step, _run_occurrence(run, step, tool, d)
        else:
            name, n = "run", _run_occurrence(run, "run", tool, d)
        key = derive_key(run.id, name, tool, d, n)
    return EffectCall(run=run, tool=tool, args=args, key=key, needs_approval=needs_approval, declare=declare)


def call_key(run: "Run | str", tool: str, call_id: str, args: Any) -> str:
    """The key of a tool call the framework names (LangGraph/PydanticAI `tool_call_id`, the Agents
    SDK's `call_id`, …): the same on resume and retry, whatever ran before it in the step, and
    distinct for two identical calls of one turn or of two turns. The digest stays in it, so an
    id a provider reuses with other arguments is another effect, not a `mismatch`."""
    return derive_key(run.id if isinstance(run, Run) else run, f"call:{call_id}", tool, _digest(tool, args), 1)


def _run_occurrence(run: Run, step: str, tool: str, d: str) -> int:
    """The n-th call of (step, tool, digest) through this Run object (one invocation)."""
    counts: dict[tuple[str, str, str], int] = run.__dict__.setdefault("_occurrences", {})
    with run._tasks_lock:
        n = counts.get((step, tool, d), 0) + 1
        counts[(step, tool, d)] = n
    return n


def encode_result(value: Any) -> Any:
    try:
        v = to_json_value(value)
    except TypeError:
        v = {"repr": repr(value)[:1000]}
    import json

    if len(json.dumps(v, ensure_ascii=False).encode()) > _RESULT_BYTES_MAX:
        return {"truncated": True, "repr": repr(value)[:1000]}
    return v


def _refuse(call: EffectCall, v: RefusedVerdict) -> Exception:
    return refusal(v.reason, run=call.run.id, key=call.key, tool=call.tool, message=v.message, rule=v.rule)


def _duplicate(call: EffectCall, v: Duplicate) -> Gated:
    if v.status == "completed":
        return Gated(token=None, duplicate=v)
    if v.status == "failed":
        raise EffectFailed(call.run.id, call.key, v.error)
    raise InDoubt(call.run.id, call.key, v.status)


def _check(call: EffectCall) -> None:
    """The local fences: the run stopped (RunStopped), or this invocation was interrupted
    (Interrupted). Both refuse without asking the gate."""
    call.run.check(call.tool, call.key)
    inv = current_invocation()
    if inv is not None:
        inv.check(call.tool, call.key)


async def _check_async(call: EffectCall) -> None:
    """`_check` in a coroutine: where the interruption is a cancel already requested of the
    task running this coroutine, the cancel is let in here (one yield to the loop delivers it,
    once, as asyncio would at the coroutine's next await), so `asyncio.wait_for`,
    `asyncio.timeout` and task groups see the cancel they asked for rather than an
    `Interrupted` in its place. Other tasks of the invocation get `Interrupted`."""
    try:
        _check(call)
    except Interrupted:
        if _cancelling(asyncio.current_task()):
            await asyncio.sleep(0)
        raise


def _first_admit_fields(call: EffectCall) -> dict[str, Any]:
    r = call.run
    return {
        "parent": r.parent_id,
        "labels": r.labels,
        "limits": r.limits,
        "needs_approval": call.needs_approval,
        "declare": call.declare,
    }


def gate_sync(call: EffectCall, *, on_hold: str = "wait", hold_timeout_s: float | None = None) -> Gated:
    """Asks the gate (blocking) until the effect may run now, is a duplicate, or is refused."""
    run = call.run
    _check(call)
    client = run.gate.client
    deadline = None if hold_timeout_s is None else time.monotonic() + hold_timeout_s
    v: Verdict = client.admit(run.id, call.key, call.tool, call.args, start=False, **_first_admit_fields(call))
    run._watch_sync()
    backoff = 0.02
    while True:
        if isinstance(v, Admitted):
            _check(call)
            s = client.start(run.id, call.key, v.token)
            if isinstance(s, Go):
                return Gated(token=v.token)
            if isinstance(s, Held):
                # `wait` answers at once for a prepared effect (docs: "call wait, then start
                # again"), so poll `start` with a bounded backoff instead of spinning.
                if on_hold == "raise":
                    raise HeldForApproval(run.id, call.key, call.tool, s)
                _check_deadline(deadline, call)
                time.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 0.5)
                continue
            v = s
            continue
        if isinstance(v, Held):
            if on_hold == "raise":
                raise HeldForApproval(run.id, call.key, call.tool, v)
            _check_deadline(deadline, call)
            _check(call)
            chunk = _WAIT_CHUNK_MS if deadline is None else max(1, min(_WAIT_CHUNK_MS, int((deadline - time.monotonic()) * 1000)))
            v = client.wait(run.id, call.key, chunk)
            continue
        if isinstance(v, RefusedVerdict):
            raise _refuse(call, v)
        if isinstance(v, Duplicate):
            return _duplicate(call, v)
        raise AssertionError(f"unexpected verdict {v!r}")


async def gate_async(call: EffectCall, *, on_hold: str = "wait", hold_timeout_s: float | None = None) -> Gated:
    """`gate_sync` for asyncio; cancelling the awaiting task abandons the hold."""
    run = call.run
    await _check_async(call)
    client = run.gate.aclient
    deadline = None if hold_timeout_s is None else time.monotonic() + hold_timeout_s
    v: Verdict = await client.admit(run.id, call.key, call.tool, call.args, start=False, **_first_admit_fields(call))
    await run._watch_async()
    backoff = 0.02
    while True:
        if isinstance(v, Admitted):
            await _check_async(call)
            s = await client.start(run.id, call.key, v.token)
            if isinstance(s, Go):
                return Gated(token=v.token)
            if isinstance(s, Held):
                if on_hold == "raise":
                    raise HeldForApproval(run.id, call.key, call.tool, s)
                _check_deadline(deadline, call)
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 0.5)
                continue
            v = s
            continue
        if isinstance(v, Held):
            if on_hold == "raise":
                raise HeldForApproval(run.id, call.key, call.tool, v)
            _check_deadline(deadline, call)
            await _check_async(call)
            chunk = _WAIT_CHUNK_MS if deadline is None else max(1, min(_WAIT_CHUNK_MS, int((deadline - time.monotonic()) * 1000)))
            v = await client.wait(run.id, call.key, chunk)
            continue
        if isinstance(v, RefusedVerdict):
            raise _refuse(call, v)
        if isinstance(v, Duplicate):
            return _duplicate(call, v)
        raise AssertionError(f"unexpected verdict {v!r}")


async def admit_prepared(call: EffectCall) -> Verdict:
    """What the gate says of `call` now, without waiting or starting: admitted (prepared: a
    repeat admit of the key returns the same token, so the effect's own `gate_async` goes on from
    there), held, refused or duplicate. Raises if the run is fenced or the invocation over."""
    await _check_async(call)
    run = call.run
    v = await run.gate.aclient.admit(run.id, call.key, call.tool, call.args, start=False, **_first_admit_fields(call))
    await run._watch_async()
    return v


def admit_prepared_sync(call: EffectCall) -> Verdict:
    """The blocking form of `admit_prepared`."""
    _check(call)
    run = call.run
    v = run.gate.client.admit(run.id, call.key, call.tool, call.args, start=False, **_first_admit_fields(call))
    run._watch_sync()
    return v


def _check_deadline(deadline: float | None, call: EffectCall) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise EstopTimeout(f"{call.tool} in run {call.run.id!r} still held after the hold timeout")


def run_sync(call: EffectCall, fn: Callable[[], Any], *, on_hold: str = "wait", hold_timeout_s: float | None = None, decode: Callable[[Any], Any] | None = None) -> Any:
    """Gate `fn` (a thunk that performs the effect) and report its outcome."""
    g = gate_sync(call, on_hold=on_hold, hold_timeout_s=hold_timeout_s)
    if g.duplicate is not None:
        r = g.duplicate.result
        return decode(r) if decode else r
    assert g.token is not None
    client = call.run.gate.client
    token = g.token

    def report(outcome: str, **kw: Any) -> None:
        try:
            client.complete(call.run.id, call.key, token, outcome, **kw)
        except EstopError:
            _report_lost(call, outcome)

    try:
        result = fn()
    except Exception as e:
        report("error", error=f"{type(e).__name__}: {e}"[:_ERROR_BYTES_MAX])
        raise
    except BaseException:
        report("unknown", error="interrupted after start")
        raise
    report("ok", result=encode_result(result))
    return result


def _report_lost(call: EffectCall, outcome: str) -> None:
    # The effect ran: its outcome must reach the caller even if the gate cannot be told now
    # (the gate shows it started, in flight, until a lookup of its key settles it).
    log.warning("estop: %s of run %r key %r ran (%s) but its completion could not be recorded", call.tool, call.run.id, call.key, outcome, exc_info=True)


async def run_async(call: EffectCall, fn: Callable[[], Awaitable[Any]], *, on_hold: str = "wait", hold_timeout_s: float | None = None, decode: Callable[[Any], Any] | None = None) -> Any:
    task = asyncio.current_task()
    run = call.run
    if task is not None:
        run.track(task)
    try:
        g = await gate_async(call, on_hold=on_hold, hold_timeout_s=hold_timeout_s)
        if g.duplicate is not None:
            r = g.duplicate.result
            return decode(r) if decode else r
        assert g.token is not None
        client = run.gate.aclient
        token = g.token

        async def report(outcome: str, **kw: Any) -> None:
            try:
                await shielded(client.complete(run.id, call.key, token, outcome, **kw))
            except EstopError:
                _report_lost(call, outcome)

        try:
            result = await fn()
        except asyncio.CancelledError:
            await report("unknown", error="cancelled after start")
            raise
        except Exception as e:
            await report("error", error=f"{type(e).__name__}: {e}"[:_ERROR_BYTES_MAX])
            raise
        await report("ok", result=encode_result(result))
        return result
    finally:
        if task is not None and task not in run._entered:
            run.untrack(task)


async def shielded(aw: Awaitable[Any]) -> Any:
    fut = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        # Cancelled again while reporting: let the report finish in the background.
        raise


@overload
def effect(fn: F) -> F: ...


@overload
def effect(
    fn: None = None,
    *,
    tool: str | None = None,
    step: str | None = None,
    needs_approval: bool = False,
    on_hold: str = "wait",
    hold_timeout_s: float | None = None,
    exclude: set[str] | frozenset[str] | None = None,
    decode: Callable[[Any], Any] | None = None,
    compensate: str | None = None,
    compensate_args: str | None = None,
) -> Callable[[F], F]: ...


def effect(
    fn: Any = None,
    *,
    tool: str | None = None,
    step: str | None = None,
    needs_approval: bool = False,
    on_hold: str = "wait",
    hold_timeout_s: float | None = None,
    exclude: set[str] | frozenset[str] | None = None,
    decode: Callable[[Any], Any] | None = None,
    compensate: str | None = None,
    compensate_args: str | None = None,
) -> Any:
    """Makes a function a gated side effect (see the module doc). Works on sync and async
    functions; the call must happen inside a run (`with gate.run(...)`, or ESTOP_RUN).

    `compensate` names the tool that undoes it after a cancel (the reverse saga; run by an
    `estop.CompensationWorker`), `compensate_args` the CEL map that builds that tool's arguments
    from this call's `args` and its recorded `result` (docs/POLICY.md). They are declared to the
    gate with each admission and may only add to what its policy says."""
    declare = {k: v for k, v in (("compensate", compensate), ("compensate_args", compensate_args)) if v is not None} or None

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        name: str = tool or str(getattr(f, "__name__", "effect"))
        skip = frozenset(exclude or ())
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def awrapper(*a: Any, **kw: Any) -> Any:
                run = current_run()
                assert run is not None
                call = make_call(run, name, call_args(f, a, kw, skip), step=step, needs_approval=needs_approval, declare=declare)
                return await run_async(call, lambda: f(*a, **kw), on_hold=on_hold, hold_timeout_s=hold_timeout_s, decode=decode)

            awrapper.__estop_tool__ = name  # type: ignore[attr-defined]
            return awrapper

        @functools.wraps(f)
        def wrapper(*a: Any, **kw: Any) -> Any:
            run = current_run()
            assert run is not None
            call = make_call(run, name, call_args(f, a, kw, skip), step=step, needs_approval=needs_approval, declare=declare)
            return run_sync(call, lambda: f(*a, **kw), on_hold=on_hold, hold_timeout_s=hold_timeout_s, decode=decode)

        wrapper.__estop_tool__ = name  # type: ignore[attr-defined]
        return wrapper

    if fn is not None and callable(fn):
        return wrap(fn)
    return wrap
