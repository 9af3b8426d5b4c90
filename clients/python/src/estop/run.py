"""Runs in context: the gate handle, the current run (contextvars), steps, local fences, the watcher.

    gate = estop.Estop()                      # ESTOP_SOCKET / ESTOP_ADDR / ESTOP_TOKEN
    async with gate.run("order-42") as run:   # sets the current run; watches it once it exists
        await refund(charge="ch_1", amount=10)  # an @estop.effect: admitted by the gate first

The watcher subscribes to the run at its first admission. The moment the gate reports the run
stopped (cancelled, killed, closed, past its deadline or budget) it fences the run locally — every
later gate call of that run, from any thread, refuses at once without asking the gate — and
cancels the asyncio tasks that belong to the run (the task that entered the run, tasks added with
`run.track(task)`, and async effects in progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

from .aio import AsyncClient
from .client import Client
from .config import Config
from .errors import ConnectionLost, EstopTimeout, Interrupted, NoRun, NotFound, RunStopped

__all__ = [
    "Estop", "Invocation", "Run", "Step", "current_invocation", "current_run", "current_step", "step", "default", "configure",
]

log = logging.getLogger("estop")

_STOP_EVENTS = frozenset({"cancelled", "finalizing", "closed"})
#: How soon a decision wait looks again after its connection was lost (a closed client ends it).
_LOOK_AGAIN_S = 0.5

_current_run: contextvars.ContextVar["Run | None"] = contextvars.ContextVar("estop_run", default=None)
_current_step: contextvars.ContextVar["Step | None"] = contextvars.ContextVar("estop_step", default=None)
_current_invocation: contextvars.ContextVar["Invocation | None"] = contextvars.ContextVar("estop_invocation", default=None)


class _Fences:
    """Process-wide: which runs the gate said are stopped, and the live local Run objects."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopped: dict[str, str] = {}
        self.live: dict[str, "weakref.WeakSet[Run]"] = {}

    def register(self, run: "Run") -> None:
        with self.lock:
            self.live.setdefault(run.id, weakref.WeakSet()).add(run)

    def reason(self, run: "Run") -> str | None:
        with self.lock:
            r: Run | None = run
            while r is not None:
                why = self.stopped.get(r.id)
                if why is not None:
                    return why
                r = r.parent if isinstance(r.parent, Run) else None
        return None

    def fence(self, run_id: str, reason: str, spare: "asyncio.Task[Any] | None" = None) -> None:
        """Marks the run stopped and cancels the tasks of it and its local descendants (except
        `spare`: the task that is cancelling its own run keeps going to finish its cleanup).
        A second fence of the same run changes nothing."""
        with self.lock:
            if run_id in self.stopped:
                return
            self.stopped[run_id] = reason
            log.info("estop: run %r fenced locally (%s)", run_id, reason)
            victims = [r for runs in self.live.values() for r in list(runs) if r._descends_from(run_id)]
        for r in victims:
            r._cancel_tasks(spare)

    def unfence(self, run_id: str) -> None:
        with self.lock:
            self.stopped.pop(run_id, None)


FENCES = _Fences()


def _on_event(event: dict[str, Any]) -> None:
    """The watcher: a stop event fences that run (and its local descendants) in this process,
    and so does a `subscribed` replay of a run that stopped while the connection was down."""
    if not isinstance(event.get("run"), str):
        return
    if event.get("event") in _STOP_EVENTS:
        FENCES.fence(event["run"], "closed" if event["event"] == "closed" else "cancelled")
    elif _replayed_stop(event):
        FENCES.fence(event["run"], "closed" if event.get("cause") in ("closed", "failed") else "cancelled")


def _replayed_stop(event: dict[str, Any]) -> bool:
    """A `subscribed` line (a subscription said again after a reconnect) of a stopped run."""
    return event.get("event") == "subscribed" and event.get("cause") is not None


class Invocation:
    """One call into the agent within a run (an `invoke`, a `stream`, one `Runner.run`).

    A local interruption — a stream closed early, a step timeout, Ctrl-C, a cancelled task, a
    client-side timeout — ends the invocation, not the run (seed 004: interrupt is not cancel).
    The gate is not told; what this invocation left behind (a worker thread still inside a
    tool, a shielded write, a task the framework forgot) refuses any new effect with
    `Interrupted`, and the next invocation of the same run goes on. Threads and tasks inherit
    the invocation through `contextvars`, as they inherit the run."""

    def __init__(self, run: "Run", owner: "asyncio.Task[Any] | None" = None) -> None:
        self.run = run
        self.owner = owner
        # Cancel requests the task already had (one swallowed without `uncancel()`) are not ours.
        self._cancelling_base = _cancelling(owner)
        self._why: str | None = None
        self._tasks: "weakref.WeakSet[asyncio.Task[Any]]" = weakref.WeakSet()
        self._lock = threading.Lock()

    @property
    def interrupted(self) -> str | None:
        """Why this invocation is over, else None. A cancel of the task that runs it counts from
        the instant it is requested (`cancelling()`), before the framework lets it out."""
        if self._why is not None:
            return self._why
        o = self.owner
        if o is not None and not o.done() and _cancelling(o) > self._cancelling_base:
            return "the invocation's task is being cancelled"
        return None

    def check(self, tool: str | None = None, key: str | None = None) -> None:
        why = self.interrupted
        if why is not None:
            raise Interrupted(why, run=self.run.id, tool=tool, key=key)

    def track(self, task: "asyncio.Task[Any]") -> None:
        with self._lock:
            self._tasks.add(task)

    def interrupt(self, reason: str, spare: "asyncio.Task[Any] | None" = None) -> None:
        """Ends the invocation locally: its tracked tasks are cancelled (except `spare`) and
        every later effect of it refuses. The run, and the gate, are untouched."""
        with self._lock:
            if self._why is not None:
                return
            self._why = reason
            tasks = list(self._tasks)
        log.info("estop: an invocation of run %r interrupted (%s); the run goes on", self.run.id, reason)
        for t in tasks:
            if not t.done() and t is not spare:
                try:
                    t.get_loop().call_soon_threadsafe(t.cancel)
                except RuntimeError:
                    pass  # its loop is closed

    def __enter__(self) -> "Invocation":
        self._tok = _current_invocation.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            _current_invocation.reset(self._tok)
        except ValueError:
            # Left from another context (a generator closed by the garbage collector).
            _current_invocation.set(None)


def _cancelling(task: "asyncio.Task[Any] | None") -> int:
    """How many cancel requests `task` has pending (0 before Python 3.11, which cannot tell)."""
    return int(getattr(task, "cancelling", lambda: 0)()) if task is not None else 0


def current_invocation() -> Invocation | None:
    """The invocation of this context (set by the adapters), else None."""
    return _current_invocation.get()


class Step:
    """A logical step (a graph node at a superstep, a workflow step, a tool call): keys of
    effects inside it are derived from its name and their order within it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def occurrence(self, tool: str, digest: str) -> int:
        with self._lock:
            n = self._counts.get((tool, digest), 0) + 1
            self._counts[(tool, digest)] = n
            return n


class _StepScope:
    def __init__(self, name: str) -> None:
        self.step = Step(name)
        self._tok: contextvars.Token[Step | None] | None = None

    def __enter__(self) -> Step:
        self._tok = _current_step.set(self.step)
        return self.step

    def __exit__(self, *exc: Any) -> None:
        assert self._tok is not None
        _current_step.reset(self._tok)

    async def __aenter__(self) -> Step:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)


def step(name: str) -> _StepScope:
    """`with estop.step("node:charge@3"):` — effects inside get keys from this step."""
    return _StepScope(name)


def current_step() -> Step | None:
    return _current_step.get()


class Estop:
    """The gate handle: configuration, one shared blocking client, one asyncio client per loop."""

    def __init__(
        self,
        socket: str | None = None,
        addr: str | tuple[str, int] | None = None,
        token: str | None = None,
        *,
        config: Config | None = None,
        **client_options: Any,
    ) -> None:
        self.config = config or Config.from_env(socket=socket, addr=addr, token=token)
        self.client_options = client_options
        self._client: Client | None = None
        self._aclients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncClient]" = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    @property
    def client(self) -> Client:
        """The shared blocking client (thread-safe)."""
        with self._lock:
            if self._client is None:
                self._client = Client(config=self.config, **self.client_options)
                self._client.add_listener(_on_event)
            return self._client

    @property
    def aclient(self) -> AsyncClient:
        """The asyncio client of the running loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            c = self._aclients.get(loop)
            if c is None:
                c = AsyncClient(config=self.config, **self.client_options)
                c.add_listener(_on_event)
                self._aclients[loop] = c
            return c

    def run(
        self,
        run_id: str | None = None,
        *,
        parent: "Run | str | None" = None,
        labels: dict[str, str] | None = None,
        limits: dict[str, int] | None = None,
    ) -> "Run":
        """A run to enter with `with` / `async with` (or pass around). `run_id` defaults to
        ESTOP_RUN, else a fresh id; `parent` defaults to the current run (a sub-agent)."""
        if parent is None:
            parent = _current_run.get()
        rid = run_id or (self.config.run if parent is None else None) or f"run-{uuid.uuid4().hex[:12]}"
        return Run(self, rid, parent=parent, labels=labels, limits=limits)

    # Stop from the agent side. The local fence is raised first so that nothing of the run
    # starts in this process while the cancel travels (an agent may always stop itself).
    def cancel(self, run: "Run | str", reason: str | None = None) -> dict[str, Any] | None:
        rid = run.id if isinstance(run, Run) else run
        FENCES.fence(rid, "cancelled")
        return _ignore_unknown_run(lambda: self.client.cancel(rid, reason))

    async def acancel(
        self, run: "Run | str", reason: str | None = None, *, spare: "asyncio.Task[Any] | None" = None
    ) -> dict[str, Any] | None:
        """Cancels the run at the gate. Its local tasks are cancelled too, except `spare`
        (default: the calling task, which is usually cleaning up after a stop)."""
        rid = run.id if isinstance(run, Run) else run
        FENCES.fence(rid, "cancelled", spare=spare or asyncio.current_task())
        try:
            return await self.aclient.cancel(rid, reason)
        except NotFound:
            return None

    def wait_decided(self, run: "Run | str", keys: "list[str] | set[str] | tuple[str, ...]", timeout_s: float | None = None) -> dict[str, str]:
        """Blocks until each held effect in `keys` of `run` is decided by an operator, and
        returns key → `approve` | `reject` | `expired` | `cancelled` (the run stopped) for those
        decided in time. A key held as the sibling of an approval, or by a pause, has no decision
        of its own: it is answered `sibling` / `paused` at once (it goes when that is lifted).
        Woken by the gate's events (`subscribe`: `decided`, `expired`,
        `cancelled`, `closed`), never by polling; one `wait` of 0 ms per key after subscribing
        covers a decision made before it, and again after a reconnect (the subscription's replay
        says what was decided while the connection was down)."""
        rid = run.id if isinstance(run, Run) else run
        d = _Decisions(rid, keys)
        cv = threading.Condition()

        def on_event(ev: dict[str, Any]) -> None:
            with cv:
                if d.hear(ev):
                    cv.notify_all()

        client = self.client
        client.add_listener(on_event)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            client.subscribe(rid)
            while True:
                with cv:
                    d.recheck = False
                    open_keys = d.open()
                lost = False
                try:
                    for k in open_keys:
                        v = client.wait(rid, k, 0)
                        with cv:
                            d.settle(k, v)
                except (ConnectionLost, EstopTimeout):
                    if client.closed:
                        raise
                    lost = True  # look again soon (or when the reconnect's replay asks)
                with cv:
                    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                    nap = left if not lost else _LOOK_AGAIN_S if left is None else min(left, _LOOK_AGAIN_S)
                    cv.wait_for(lambda: d.done() or d.recheck, nap)
                    past = deadline is not None and time.monotonic() >= deadline
                    if d.done() or past or not (d.recheck or lost):
                        return dict(d.got)
        finally:
            client.remove_listener(on_event)

    async def await_decided(self, run: "Run | str", keys: "list[str] | set[str] | tuple[str, ...]", timeout_s: float | None = None) -> dict[str, str]:
        """`wait_decided` for asyncio (the running loop's client and its events)."""
        rid = run.id if isinstance(run, Run) else run
        d = _Decisions(rid, keys)
        changed = asyncio.Event()

        def on_event(ev: dict[str, Any]) -> None:
            if d.hear(ev):
                changed.set()

        client = self.aclient
        client.add_listener(on_event)

        async def all_in() -> None:
            while True:
                d.recheck = False
                try:
                    for k in d.open():
                        d.settle(k, await client.wait(rid, k, 0))
                except (ConnectionLost, EstopTimeout):
                    if client.closed:
                        raise
                    # Look again soon, or when the reconnect's replay asks.
                    changed.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(changed.wait(), _LOOK_AGAIN_S)
                    continue
                while not d.done() and not d.recheck:
                    changed.clear()
                    await changed.wait()
                if d.done():
                    return

        try:
            await client.subscribe(rid)
            try:
                await asyncio.wait_for(all_in(), timeout_s)
            except asyncio.TimeoutError:
                pass
            return dict(d.got)
        finally:
            client.remove_listener(on_event)

    def close(self) -> None:
        """Closes the blocking client (asyncio clients: `aclose` on their loop)."""
        if self._client is not None:
            self._client.close()

    async def aclose(self) -> None:
        """Closes the running loop's asyncio client."""
        loop = asyncio.get_running_loop()
        with self._lock:
            c = self._aclients.pop(loop, None)
        if c is not None:
            await c.close()


class _Decisions:
    """What `wait_decided` has heard of the keys it awaits: from events, from `wait`s of 0 ms,
    and from a subscription's replay (on subscribing, and after every reconnect)."""

    def __init__(self, run: str, keys: "list[str] | set[str] | tuple[str, ...]") -> None:
        self.run = run
        self.want = set(keys)
        self.got: dict[str, str] = {}
        #: A replay said something was decided while we were away: look again (`wait` 0 ms).
        self.recheck = False

    def open(self) -> list[str]:
        return sorted(self.want - self.got.keys())

    def done(self) -> bool:
        return self.want <= self.got.keys()

    def hear(self, ev: dict[str, Any]) -> bool:
        """Records what an event line says about the keys awaited; True if it changed anything."""
        kind, key = ev.get("event"), ev.get("key")
        if ev.get("run") != self.run:
            return False
        if kind == "decided" and key in self.want:
            self.got.setdefault(key, "approve" if ev.get("decision") in ("approve", "approved") else "reject")
            return True
        if kind == "expired" and key in self.want:
            self.got.setdefault(key, "expired")
            return True
        if kind in _STOP_EVENTS or _replayed_stop(ev):  # (an ancestor's cancel reaches the run too)
            for k in self.want:
                self.got.setdefault(k, "cancelled")
            return True
        if kind == "subscribed":
            return self._replay(ev)
        if kind == "disconnected":  # client-local: the connection went and no reconnect follows
            self.recheck = True
            return True
        return False

    def _replay(self, ev: dict[str, Any]) -> bool:
        """A replay of the live run: an awaited key no longer `held` was decided while the
        connection was down; a `wait` of 0 ms says how (`approved` ones are known already)."""
        held = set()
        for a in ev.get("awaiting") or []:
            if not isinstance(a, dict):
                continue
            if a.get("status") == "approved" and a.get("key") in self.want:
                self.got.setdefault(a["key"], "approve")
            elif a.get("status") == "held":
                held.add(a.get("key"))
        missed = [k for k in self.open() if k not in held]
        if missed or ev.get("more"):
            self.recheck = True
        return True

    def settle(self, key: str, v: Any) -> None:
        """A `wait` answered at once: held (still pending), or what the decision made of it. A
        key held as the sibling of an approval (or by a pause) is answered with that reason."""
        from .verdicts import Admitted, Duplicate, Held, RefusedVerdict

        if isinstance(v, Held):
            if v.reason != "approval":
                self.want.discard(key)
                self.got.setdefault(key, str(v.reason))
            return
        if isinstance(v, (Admitted, Duplicate)):
            what = "approve"
        elif isinstance(v, RefusedVerdict):
            what = {"rejected": "reject", "expired": "expired"}.get(v.reason, "cancelled")
        else:
            return
        self.got.setdefault(key, what)


def _ignore_unknown_run(fn: Any) -> Any:
    try:
        return fn()
    except NotFound:
        # The gate never saw an effect of this run; the local fence still holds it.
        return None


@dataclass(eq=False)
class Run:
    """One agent trajectory. Enter it with `with` / `async with` to make it the current run."""

    gate: Estop
    id: str
    parent: "Run | str | None" = None
    labels: dict[str, str] | None = None
    limits: dict[str, int] | None = None
    _tasks: "dict[asyncio.Task[Any], asyncio.AbstractEventLoop]" = field(default_factory=dict, repr=False)
    _tasks_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _watched: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet, repr=False)
    _created: bool = field(default=False, repr=False)
    _prev: "dict[tuple[int, int], list[Run | None]]" = field(default_factory=dict, repr=False)
    _entered: "list[asyncio.Task[Any]]" = field(default_factory=list, repr=False)
    _cancelled: "weakref.WeakSet[asyncio.Task[Any]]" = field(default_factory=weakref.WeakSet, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.parent, str):
            self.parent = Run(self.gate, self.parent)
        FENCES.register(self)

    # -- identity -------------------------------------------------------------------------

    @property
    def parent_id(self) -> str | None:
        return self.parent.id if isinstance(self.parent, Run) else None

    def _descends_from(self, run_id: str) -> bool:
        r: Run | None = self
        while r is not None:
            if r.id == run_id:
                return True
            r = r.parent if isinstance(r.parent, Run) else None
        return False

    def child(self, name: str, **kw: Any) -> "Run":
        """A sub-agent's run: id `PARENT.name`; a cancel of this run reaches it (the gate cascades)."""
        return Run(self.gate, f"{self.id}.{name}", parent=self, **kw)

    @property
    def stopped(self) -> str | None:
        """Why the run is fenced locally (the gate said so, or we cancelled it), else None."""
        return FENCES.reason(self)

    def check(self, tool: str | None = None, key: str | None = None) -> None:
        """Raises RunStopped if the run is fenced locally."""
        why = self.stopped
        if why is not None:
            raise RunStopped(why, run=self.id, tool=tool, key=key, local=True)

    # -- context ----------------------------------------------------------------------------

    # A Run may be entered from several threads and tasks at once (worker-thread tools), so the
    # previous current run is kept per (thread, task), not in one stack.
    @staticmethod
    def _where() -> tuple[int, int]:
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        return (threading.get_ident(), id(task) if task is not None else 0)

    def _push(self) -> None:
        self._prev.setdefault(self._where(), []).append(_current_run.get())
        _current_run.set(self)

    def _pop(self) -> None:
        w = self._where()
        stack = self._prev.get(w)
        prev = stack.pop() if stack else None
        if stack == []:
            self._prev.pop(w, None)
        _current_run.set(prev)

    def __enter__(self) -> "Run":
        self._push()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pop()

    async def __aenter__(self) -> "Run":
        self._push()
        task = asyncio.current_task()
        if task is not None:
            self._entered.append(task)
            self.track(task)
        return self

    async def __aexit__(self, et: Any, ev: Any, tb: Any) -> None:
        task = asyncio.current_task()
        self._pop()
        if task is not None and task in self._entered:
            self._entered.remove(task)
            self.untrack(task)
        if et is asyncio.CancelledError and task is not None and task in self._cancelled:
            # The watcher cancelled us because the gate stopped the run: say so, as a refusal.
            # (Python < 3.11 has no cancel count to consult; the request was consumed already.)
            if not hasattr(task, "uncancel") or task.uncancel() == 0:
                raise RunStopped(self.stopped or "cancelled", run=self.id) from ev

    # -- tasks --------------------------------------------------------------------------------

    def track(self, task: "asyncio.Task[Any]") -> None:
        """Cancel `task` when the gate says the run stopped."""
        with self._tasks_lock:
            self._tasks[task] = task.get_loop()
        if self.stopped is not None:
            self._cancel_tasks()

    def untrack(self, task: "asyncio.Task[Any]") -> None:
        with self._tasks_lock:
            self._tasks.pop(task, None)

    def _cancel_tasks(self, spare: "asyncio.Task[Any] | None" = None) -> None:
        with self._tasks_lock:
            tasks = list(self._tasks.items())
        for task, loop in tasks:
            if task.done() or task is spare:
                continue
            self._cancelled.add(task)
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                pass  # its loop is closed

    # -- watching -----------------------------------------------------------------------------

    # One subscription per (run, client): the blocking client and each loop's asyncio client
    # (a loop that ends takes its subscription with it; the next loop subscribes again).
    def _watch_sync(self) -> None:
        c = self.gate.client
        if c in self._watched:
            return
        self._watched.add(c)
        try:
            c.subscribe(self.id)
        except Exception:
            log.warning("estop: could not watch run %r (stops reach it at its next gate call)", self.id, exc_info=True)
            self._watched.discard(c)

    async def _watch_async(self) -> None:
        c = self.gate.aclient
        if c in self._watched:
            return
        self._watched.add(c)
        try:
            await c.subscribe(self.id)
        except Exception:
            log.warning("estop: could not watch run %r (stops reach it at its next gate call)", self.id, exc_info=True)
            self._watched.discard(c)

    # -- stopping -----------------------------------------------------------------------------

    def cancel(self, reason: str | None = None) -> None:
        self.gate.cancel(self, reason)

    async def acancel(self, reason: str | None = None, *, spare: "asyncio.Task[Any] | None" = None) -> None:
        await self.gate.acancel(self, reason, spare=spare)


def current_run(required: bool = True) -> Run | None:
    """The run of this context; with `required`, NoRun when there is none (and no ESTOP_RUN)."""
    r = _current_run.get()
    if r is None and _default is not None and _default.config.run:
        r = _default_run()
    if r is None and required:
        raise NoRun("no current run: wrap the agent in `with gate.run(...)` / `async with gate.run(...)`, or set ESTOP_RUN")
    return r


_default: Estop | None = None
_default_runs: dict[str, Run] = {}


def _default_run() -> Run:
    assert _default is not None and _default.config.run
    rid = _default.config.run
    if rid not in _default_runs:
        _default_runs[rid] = Run(_default, rid)
    return _default_runs[rid]


def default() -> Estop:
    """The process-wide gate handle, configured from the environment on first use."""
    global _default
    if _default is None:
        _default = Estop()
    return _default


def configure(**kw: Any) -> Estop:
    """Sets the process-wide gate handle (same arguments as `Estop`)."""
    global _default
    _default = Estop(**kw)
    _default_runs.clear()
    return _default


def iter_runs(run: Run) -> Iterator[Run]:
    r: Run | None = run
    while r is not None:
        yield r
        r = r.parent if isinstance(r.parent, Run) else None
