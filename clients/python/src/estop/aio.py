"""The asyncio client: same verbs as `estop.Client`, awaitable, for one event loop.

Replies are matched by id by a reader task, so a long `wait` never holds up other requests.
Cancelling an awaiting call drops its reply when it comes (the gate may still have applied it;
every agent verb is safe to repeat with the same key).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
from typing import Any, Callable

from . import _wire
from ._wire import _MISSING, REPORT_LISTS, merge_page
from .client import EventCallback
from .config import Config
from .errors import ConnectionLost, EstopError, EstopTimeout, GateError, Unauthenticated
from .verdicts import Verdict

log = logging.getLogger("estop")

__all__ = ["AsyncClient"]

_LIMIT_BYTES = 1 << 20  # a reply line can carry a 64 KiB result, well under this


class _AConn:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_event: EventCallback,
        on_close: "Callable[[_AConn], None] | None" = None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.futs: dict[int, asyncio.Future[dict[str, Any]]] = {}
        # What each request in flight is (op, line bytes): an `id: null` refusal is matched to
        # one of them (`_wire.unread_line_owner`).
        self.sent: dict[int, tuple[str, int]] = {}
        self.alive = True
        self.on_event = on_event
        self.on_close = on_close
        self.cancelled = False
        self.task = asyncio.get_running_loop().create_task(self._read(), name="estop-reader")

    async def _read(self) -> None:
        err: BaseException = ConnectionLost("the gate closed the connection")
        try:
            while True:
                line = await self.reader.readline()
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(msg, dict):
                    continue
                if "event" in msg and "id" not in msg:
                    try:
                        self.on_event(msg)
                    except Exception:
                        log.exception("estop: an event handler failed on %r", msg)
                    continue
                rid = msg.get("id")
                if rid is None:
                    rid = _wire.unread_line_owner(msg, self.sent)
                    if rid is None and msg.get("ok") is False:
                        err = ConnectionLost(f"the gate closed the connection: {_wire.error_text(msg)}")
                if not isinstance(rid, int):
                    continue
                self.sent.pop(rid, None)
                fut = self.futs.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            err = ConnectionLost(f"connection to the gate lost: {e}")
        except asyncio.CancelledError:
            # Cancelled: the client is closing, or its loop is ending; nothing to reconnect.
            self.cancelled = True
            err = ConnectionLost("client closed")
        finally:
            self.close(err)

    async def send(self, rid: int, line: bytes, op: str = "") -> asyncio.Future[dict[str, Any]]:
        if not self.alive:
            raise ConnectionLost("connection to the gate is closed")
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.futs[rid] = fut
        self.sent[rid] = (op, len(line))
        try:
            self.writer.write(line)
            await self.writer.drain()
        except (OSError, RuntimeError) as e:
            self.forget(rid)
            self.close(ConnectionLost(f"connection to the gate lost: {e}"))
            raise ConnectionLost(f"connection to the gate lost: {e}") from e
        return fut

    def forget(self, rid: int) -> None:
        self.futs.pop(rid, None)
        self.sent.pop(rid, None)

    def close(self, err: BaseException) -> None:
        if not self.alive:
            return
        self.alive = False
        futs = list(self.futs.values())
        self.futs.clear()
        self.sent.clear()
        for f in futs:
            if not f.done():
                f.set_exception(err)
        try:
            self.writer.close()
        except (OSError, RuntimeError):
            pass
        if self.on_close is not None:
            self.on_close(self)
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no running loop: the loop is gone and its tasks with it
            return
        if self.task is not current and not self.task.done():
            self.task.cancel()


class AsyncClient:
    """An asyncio protocol v1 client; see `estop.Client` for configuration and reconnects."""

    def __init__(
        self,
        socket: str | None = None,
        addr: str | tuple[str, int] | None = None,
        token: str | None = None,
        *,
        config: Config | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        reconnect_attempts: int = 6,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        line_bytes_max: int = _wire.LINE_BYTES_MAX,
    ) -> None:
        self.config = config or Config.from_env(socket=socket, addr=addr, token=token)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_attempts = reconnect_attempts
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.line_bytes_max = line_bytes_max
        self._ids = itertools.count(1)
        self._conn: _AConn | None = None
        self._lock: asyncio.Lock | None = None
        self._closed = False
        self._subs: dict[str, int] = {}
        # What this connection executes compensations of (`compensations`), said again after a
        # reconnect: `""` for every run the principal sees.
        self._executes: set[str] = set()
        self._keeper: asyncio.Task[None] | None = None
        self._reconnect = False
        self._listeners: list[EventCallback] = []
        self.role: str | None = None
        self.principal: str | None = None


    @property
    def closed(self) -> bool:
        """Whether `close` was called: nothing is sent or reconnected any more."""
        return self._closed

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.config.socket:
            coro = asyncio.open_unix_connection(self.config.socket, limit=_LIMIT_BYTES)
        else:
            assert self.config.addr is not None
            coro = asyncio.open_connection(self.config.addr[0], self.config.addr[1], limit=_LIMIT_BYTES)
        return await asyncio.wait_for(coro, self.connect_timeout_s)

    async def _connection(self, attempts: int | None = None) -> _AConn:
        """The live connection, opened (`attempts` tries, `reconnect_attempts` by default, with
        backoff and jitter) when there is none: `hello`, every subscription and the executor's
        registration again; the subscriptions' replies are handed to the listeners as
        `subscribed` lines once the connection is up."""
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        if self._lock is None:
            self._lock = asyncio.Lock()
        replays: list[dict[str, Any]] = []
        async with self._lock:
            conn = self._conn
            if conn is not None and conn.alive:
                return conn
            if self._closed:
                raise ConnectionLost("client is closed")
            delay = self.backoff_initial_s
            last: BaseException | None = None
            for attempt in range(max(1, self.reconnect_attempts if attempts is None else attempts)):
                if attempt:
                    await asyncio.sleep(delay * (0.5 + random.random() / 2))
                    delay = min(delay * 2, self.backoff_max_s)
                try:
                    reader, writer = await self._dial()
                except (OSError, asyncio.TimeoutError) as e:
                    last = e
                    continue
                conn = _AConn(reader, writer, self._dispatch, self._lost)
                try:
                    replays = await self._handshake(conn)
                except (ConnectionLost, EstopTimeout) as e:
                    conn.close(ConnectionLost("handshake failed"))
                    last = e
                    continue
                self._conn = conn
                break
            else:
                where = self.config.socket or f"{self.config.addr[0]}:{self.config.addr[1]}"  # type: ignore[index]
                raise ConnectionLost(f"cannot reach the gate at {where}: {last}")
        for ev in replays:
            self._dispatch(ev)
        return conn

    def _lost(self, conn: _AConn) -> None:
        """A connection ended. With runs watched or compensations registered, a keeper task
        reconnects at once: an idle watcher or executor has no call of its own that would."""
        if self._closed or conn is not self._conn:
            return
        if conn.cancelled:
            # The reader went with someone else's tasks (a framework cancelling the tasks of a
            # run it stops), or the loop is ending: no keeper is started. A decision wait is
            # told (a client-local `disconnected` line), so it looks again on a new connection.
            for run in list(self._subs):
                self._dispatch({"event": "disconnected", "run": run})
            return
        if not (self._subs or self._executes):
            return
        self._reconnect = True
        if self._keeper is not None and not self._keeper.done():
            return  # it looks at `_reconnect` again before it ends
        try:
            self._keeper = asyncio.get_running_loop().create_task(self._keep(), name="estop-reconnect")
        except RuntimeError:  # the loop is gone: so is everything that listened on it
            pass

    async def _keep(self) -> None:
        """Reconnects until the client is closed or nothing is watched or executed any more:
        backoff with jitter from `backoff_initial_s`, then every `backoff_max_s` for as long as
        it takes (an executor never gives up)."""
        while self._reconnect and not self._closed and (self._subs or self._executes):
            self._reconnect = False
            delay = self.backoff_initial_s
            failures = 0
            while not self._closed and (self._subs or self._executes):
                try:
                    await self._connection(attempts=1)
                    break
                except (EstopError, OSError) as e:
                    failures += 1
                    if failures in (1, 10) or failures % 100 == 0:
                        log.warning("estop: the gate is unreachable (%s); retrying every %.1fs at most", e, self.backoff_max_s)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, self.backoff_max_s)

    async def _roundtrip(self, conn: _AConn, op: str, fields: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        rid = next(self._ids)
        line = _wire.fit_line(op, _wire.request_line(rid, op, fields), self.line_bytes_max)
        fut = await conn.send(rid, line, op)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise EstopTimeout(f"no reply to {op} within {timeout_s:.1f}s") from None
        finally:
            conn.forget(rid)

    async def _handshake(self, conn: _AConn) -> list[dict[str, Any]]:
        """`hello`, every subscription and the executor's registration again; returns what the
        subscriptions' replies replay."""
        if self.config.token is None:
            raise Unauthenticated("unauthenticated", "no token: set ESTOP_TOKEN or pass token=")
        reply = _wire.check(await self._roundtrip(conn, "hello", {"token": self.config.token}, self.connect_timeout_s))
        self.role = reply.get("role")
        self.principal = reply.get("principal")
        replays: list[dict[str, Any]] = []
        for run in list(self._subs):
            try:
                sub = _wire.check(await self._roundtrip(conn, "subscribe", {"run": run}, self.connect_timeout_s))
            except GateError:
                log.warning("estop: the gate refused to subscribe to %r again", run)
                continue
            ev = _wire.replay_event(run, sub)
            if ev is not None:
                replays.append(ev)
        for run in list(self._executes):
            fields = {"run": run} if run else {}
            try:
                _wire.check(await self._roundtrip(conn, "compensations", fields, self.connect_timeout_s))
            except GateError:
                log.warning("estop: the gate refused this connection as an executor of %r again", run or "every run")
        return replays

    def _dispatch(self, event: dict[str, Any]) -> None:
        if _wire.is_terminal(event) and event.get("run") in self._subs:
            self._subs.pop(event["run"], None)  # terminal: no need to re-subscribe after a reconnect
        for cb in list(self._listeners):
            try:
                cb(event)
            except Exception:
                log.exception("estop: event listener %r failed on %r", cb, event)

    async def connect(self) -> "AsyncClient":
        await self._connection()
        return self

    async def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close(ConnectionLost("client closed"))
        if self._keeper is not None and not self._keeper.done() and self._keeper is not asyncio.current_task():
            self._keeper.cancel()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def call(self, op: str, *, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        retries = self.reconnect_attempts if op in _wire.IDEMPOTENT_OPS else 0
        attempt = 0
        while True:
            conn = await self._connection()
            try:
                return _wire.check(await self._roundtrip(conn, op, fields, timeout))
            except ConnectionLost:
                attempt += 1
                if attempt > retries or self._closed:
                    raise

    def add_listener(self, cb: EventCallback) -> None:
        """Calls `cb(event)` on the loop for every event line; keep it short."""
        self._listeners.append(cb)

    def remove_listener(self, cb: EventCallback) -> None:
        if cb in self._listeners:
            self._listeners.remove(cb)

    # -- agent verbs --------------------------------------------------------------------------

    async def hello(self) -> dict[str, Any]:
        await self._connection()
        return {"role": self.role, "principal": self.principal}

    async def ping(self) -> bool:
        return bool((await self.call("ping")).get("pong"))

    async def admit(
        self,
        run: str,
        key: str,
        tool: str,
        args: Any = None,
        *,
        digest: str | None = None,
        start: bool = True,
        parent: str | None = None,
        labels: dict[str, str] | None = None,
        needs_approval: bool | None = None,
        limits: dict[str, int] | None = None,
        declare: dict[str, str] | None = None,
        reserve: dict[str, int] | None = None,
    ) -> Verdict:
        """`declare`: how this call is undone, in the keys of a policy rule (`compensate`,
        `compensate_args`, `reversibility`); it may only add to what policy says. `reserve`:
        `{usd_micros?, tokens?}`, what this call may cost at worst, counted against the model
        budget (`limits` `max_spend`/`max_tokens`) of the run and every ancestor until `complete`
        settles it with its `cost` (docs/PROTOCOL.md, "Model budget")."""
        f = _wire.fit_admit(
            _wire.admit_fields(
                run, key, tool, args, digest, start, parent, labels, needs_approval, limits, declare, reserve
            ),
            self.line_bytes_max,
        )
        return _wire.verdict(await self.call("admit", **f))

    async def start(self, run: str, key: str, token: str) -> Verdict:
        return _wire.verdict(await self.call("start", run=run, key=key, token=token))

    async def complete(
        self,
        run: str,
        key: str,
        token: str,
        outcome: str,
        result: Any = _MISSING,
        error: str | None = None,
        cost: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """`cost`: as `Client.complete`."""
        return await self.call(
            "complete",
            run=run,
            key=key,
            token=token,
            outcome=outcome,
            result=result,
            error=error,
            cost=_wire.spend_fields("cost", cost),
        )

    async def wait(self, run: str, key: str, timeout_ms: int) -> Verdict:
        reply = await self.call(
            "wait", run=run, key=key, timeout_ms=int(timeout_ms), timeout_s=timeout_ms / 1000 + self.timeout_s
        )
        return _wire.verdict(reply)

    async def subscribe(self, run: str) -> dict[str, Any]:
        """As `Client.subscribe`: returns the reply (the run's state); after a reconnect each
        subscription's reply is handed to the listeners as a `subscribed` line."""
        reply = await self.call("subscribe", run=run)
        self._subs[run] = self._subs.get(run, 0) + 1
        return reply

    async def unsubscribe(self, run: str) -> None:
        n = self._subs.get(run, 0)
        if n <= 1:
            self._subs.pop(run, None)
            await self.call("unsubscribe", run=run)
        else:
            self._subs[run] = n - 1

    async def compensations(self, run: str | None = None) -> None:
        """Makes this connection an executor of the reverse saga's compensations (of `run`, or of
        every run the principal sees): `compensate` events reach the listeners; report each with
        `compensated`. Said again after a reconnect."""
        await self.call("compensations", run=run)
        self._executes.add(run or "")

    async def compensated(
        self, run: str, key: str, attempt: int, outcome: str, error: str | None = None
    ) -> dict[str, Any]:
        """Reports how attempt `attempt` of the compensation of `(run, key)` ended (`ok`, `error`,
        or `unknown`)."""
        return await self.call("compensated", run=run, key=key, attempt=attempt, outcome=outcome, error=error)

    async def status(self, run: str) -> dict[str, Any]:
        return await self.call("status", run=run)

    async def cancel(self, run: str, reason: str | None = None) -> dict[str, Any]:
        return await self.call("cancel", run=run, reason=reason)

    async def close_run(self, run: str, outcome: str | None = None) -> dict[str, Any]:
        return await self.call("close", run=run, outcome=outcome)

    async def _pages(self, op: str, lists: tuple[str, ...], limit: int | None = None, **fields: Any) -> dict[str, Any]:
        """Reads a listing page by page, following its cursor (docs/PROTOCOL.md, "Pages"): every
        item, or the first `limit` of `lists[0]`."""
        acc: dict[str, Any] | None = None
        cursor: str | None = None
        while True:
            left = None if limit is None else max(limit - (len(acc[lists[0]]) if acc else 0), 1)
            page = await self.call(op, limit=left, cursor=cursor, **fields)
            acc = merge_page(acc, page, lists)
            cursor = page.get("next")
            if not cursor or (limit is not None and len(acc[lists[0]]) >= limit):
                return acc

    async def runs(self, state: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Every run (of this agent, for an agent token), or the first `limit`, in id order."""
        return list((await self._pages("runs", ("runs",), limit, state=state)).get("runs", []))

    async def pending(self, run: str | None = None) -> list[dict[str, Any]]:
        """The whole approvals inbox, soonest to expire first."""
        return list((await self._pages("pending", ("pending",), run=run)).get("pending", []))

    async def report(self, run: str) -> dict[str, Any]:
        """The whole after-stop report of `run` (every page's lists together)."""
        return await self._pages("report", REPORT_LISTS, run=run)

    # -- operator verbs -----------------------------------------------------------------------

    async def decide(self, run: str, key: str, decision: str, reason: str | None = None) -> dict[str, Any]:
        return await self.call("decide", run=run, key=key, decision=decision, reason=reason)

    async def approve(self, run: str, key: str, reason: str | None = None) -> dict[str, Any]:
        return await self.decide(run, key, "approve", reason)

    async def reject(self, run: str, key: str, reason: str | None = None) -> dict[str, Any]:
        return await self.decide(run, key, "reject", reason)

    async def pause(self, run: str) -> dict[str, Any]:
        return await self.call("pause", run=run)

    async def resume(self, run: str) -> dict[str, Any]:
        return await self.call("resume", run=run)

    async def kill(self, run: str, reason: str | None = None) -> dict[str, Any]:
        return await self.call("kill", run=run, reason=reason)

    async def ledger(self, run: str | None = None, limit: int | None = None, after: int | None = None) -> dict[str, Any]:
        return await self.call("ledger", run=run, limit=limit, after=after)

    async def create_token(self, name: str, role: str, groups: list[str] | None = None) -> str:
        return str((await self.call("token", name=name, role=role, groups=groups))["token"])
