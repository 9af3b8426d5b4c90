"""The blocking client: one connection, a reader thread, replies matched by id, reconnects.

Thread-safe: any number of threads may share one `Client`; their requests are pipelined on the
connection and a long `wait` does not block the others (docs/PROTOCOL.md, "Replies").
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import socket as _socket
import threading
import time
from typing import Any, Callable

from . import _wire
from ._wire import _MISSING, REPORT_LISTS, merge_page
from .config import Config
from .errors import ConnectionLost, EstopError, EstopTimeout, GateError, Unauthenticated
from .verdicts import Verdict

log = logging.getLogger("estop")

__all__ = ["Client", "EventCallback"]

EventCallback = Callable[[dict[str, Any]], None]


class _Slot:
    __slots__ = ("done", "reply", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: dict[str, Any] | None = None
        self.error: BaseException | None = None


class _Conn:
    """One live socket and its reader thread."""

    def __init__(
        self,
        sock: _socket.socket,
        on_event: Callable[[dict[str, Any]], None],
        on_close: "Callable[[_Conn], None] | None" = None,
    ) -> None:
        self.sock = sock
        self.rfile = sock.makefile("rb")
        self.wlock = threading.Lock()
        self.slots: dict[int, _Slot] = {}
        # What each request in flight is (op, line bytes): an `id: null` refusal is matched to
        # one of them (`_wire.unread_line_owner`).
        self.sent: dict[int, tuple[str, int]] = {}
        self.slots_lock = threading.Lock()
        self.alive = True
        self.on_event = on_event
        self.on_close = on_close
        self.thread = threading.Thread(target=self._read, name="estop-reader", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        err: BaseException = ConnectionLost("the gate closed the connection")
        try:
            for line in self.rfile:
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
                    except Exception:  # a callback's bug must not kill the connection
                        log.exception("estop: an event handler failed on %r", msg)
                    continue
                rid = msg.get("id")
                with self.slots_lock:
                    if rid is None:
                        rid = _wire.unread_line_owner(msg, self.sent)
                        if rid is None and msg.get("ok") is False:
                            err = ConnectionLost(f"the gate closed the connection: {_wire.error_text(msg)}")
                    slot = None
                    if isinstance(rid, int):
                        self.sent.pop(rid, None)
                        slot = self.slots.pop(rid, None)
                if slot is not None:
                    slot.reply = msg
                    slot.done.set()
        except (OSError, ValueError) as e:
            err = ConnectionLost(f"connection to the gate lost: {e}")
        finally:
            self.close(err)

    def send(self, rid: int, line: bytes, op: str = "") -> _Slot:
        slot = _Slot()
        with self.slots_lock:
            if not self.alive:
                raise ConnectionLost("connection to the gate is closed")
            self.slots[rid] = slot
            self.sent[rid] = (op, len(line))
        try:
            with self.wlock:
                self.sock.sendall(line)
        except OSError as e:
            self.forget(rid)
            self.close(ConnectionLost(f"connection to the gate lost: {e}"))
            raise ConnectionLost(f"connection to the gate lost: {e}") from e
        return slot

    def forget(self, rid: int) -> None:
        with self.slots_lock:
            self.slots.pop(rid, None)
            self.sent.pop(rid, None)

    def close(self, err: BaseException) -> None:
        with self.slots_lock:
            if not self.alive:
                return
            self.alive = False
            slots = list(self.slots.values())
            self.slots.clear()
            self.sent.clear()
        for s in slots:
            s.error = err
            s.done.set()
        try:
            self.sock.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        if self.on_close is not None:
            self.on_close(self)


class Client:
    """A blocking protocol v1 client.

    `Client()` reads ESTOP_SOCKET / ESTOP_ADDR / ESTOP_TOKEN (see `estop.config`). The connection
    is opened on first use and re-opened after a loss with exponential backoff
    (`reconnect_attempts`, `backoff_initial_s` .. `backoff_max_s`); requests whose reply was lost
    are sent again when the gate answers repeats from its state (every agent verb).
    """

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
        self._conn: _Conn | None = None
        self._conn_lock = threading.Lock()
        self._closed = False
        self._subs: dict[str, int] = {}
        self._keeper: threading.Thread | None = None
        self._keeper_lock = threading.Lock()
        self._reconnect = False
        self._listeners: list[EventCallback] = []
        self._listeners_lock = threading.Lock()
        self.role: str | None = None
        self.principal: str | None = None

    # -- connection ---------------------------------------------------------------------------


    @property
    def closed(self) -> bool:
        """Whether `close` was called: nothing is sent or reconnected any more."""
        return self._closed

    def _dial(self) -> _socket.socket:
        if self.config.socket:
            s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            target: Any = self.config.socket
        else:
            assert self.config.addr is not None
            s = _socket.socket(_socket.AF_INET6 if ":" in self.config.addr[0] else _socket.AF_INET)
            target = self.config.addr
        s.settimeout(self.connect_timeout_s)
        try:
            s.connect(target)
        except OSError:
            s.close()
            raise
        s.settimeout(None)
        if not self.config.socket:
            s.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
        return s

    def _connection(self, attempts: int | None = None) -> _Conn:
        """The live connection, opened (`attempts` tries, `reconnect_attempts` by default, with
        backoff and jitter) when there is none: `hello`, then every subscription again, whose
        replies are handed to the listeners as `subscribed` lines once the connection is up."""
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        replays: list[dict[str, Any]] = []
        with self._conn_lock:
            conn = self._conn
            if conn is not None and conn.alive:
                return conn
            if self._closed:
                raise ConnectionLost("client is closed")
            delay = self.backoff_initial_s
            last: Exception | None = None
            for attempt in range(max(1, self.reconnect_attempts if attempts is None else attempts)):
                if attempt:
                    time.sleep(delay * (0.5 + random.random() / 2))
                    delay = min(delay * 2, self.backoff_max_s)
                try:
                    sock = self._dial()
                except OSError as e:
                    last = e
                    continue
                conn = _Conn(sock, self._dispatch, self._lost)
                try:
                    replays = self._handshake(conn)
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

    def _lost(self, conn: _Conn) -> None:
        """A connection ended. With runs watched, a keeper reconnects at once, in the background:
        an idle watcher has no call of its own that would."""
        if self._closed or conn is not self._conn or not self._subs:
            return
        with self._keeper_lock:
            self._reconnect = True
            if self._keeper is not None:
                return  # it looks at `_reconnect` again before it ends
            self._keeper = threading.Thread(target=self._keep, name="estop-reconnect", daemon=True)
            self._keeper.start()

    def _keep(self) -> None:
        """Reconnects until the client is closed or nothing is watched any more: backoff with
        jitter from `backoff_initial_s`, then every `backoff_max_s` for as long as it takes."""
        while True:
            with self._keeper_lock:
                if not self._reconnect or self._closed or not self._subs:
                    self._keeper = None
                    return
                self._reconnect = False
            delay = self.backoff_initial_s
            failures = 0
            while not self._closed and self._subs:
                try:
                    self._connection(attempts=1)
                    break
                except (EstopError, OSError) as e:
                    failures += 1
                    if failures in (1, 10) or failures % 100 == 0:
                        log.warning("estop: the gate is unreachable (%s); retrying every %.1fs at most", e, self.backoff_max_s)
                time.sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, self.backoff_max_s)

    def _roundtrip(self, conn: _Conn, op: str, fields: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        rid = next(self._ids)
        line = _wire.fit_line(op, _wire.request_line(rid, op, fields), self.line_bytes_max)
        slot = conn.send(rid, line, op)
        if not slot.done.wait(timeout_s):
            conn.forget(rid)
            raise EstopTimeout(f"no reply to {op} within {timeout_s:.1f}s")
        if slot.error is not None:
            raise slot.error
        assert slot.reply is not None
        return slot.reply

    def _handshake(self, conn: _Conn) -> list[dict[str, Any]]:
        """`hello`, then every subscription again; returns what their replies replay."""
        if self.config.token is None:
            raise Unauthenticated("unauthenticated", "no token: set ESTOP_TOKEN or pass token=")
        reply = _wire.check(
            self._roundtrip(conn, "hello", {"token": self.config.token}, self.connect_timeout_s)
        )
        self.role = reply.get("role")
        self.principal = reply.get("principal")
        replays: list[dict[str, Any]] = []
        for run in list(self._subs):
            try:
                sub = _wire.check(self._roundtrip(conn, "subscribe", {"run": run}, self.connect_timeout_s))
            except GateError:
                log.warning("estop: the gate refused to subscribe to %r again", run)
                continue
            ev = _wire.replay_event(run, sub)
            if ev is not None:
                replays.append(ev)
        return replays

    def _dispatch(self, event: dict[str, Any]) -> None:
        if _wire.is_terminal(event) and event.get("run") in self._subs:
            self._subs.pop(event["run"], None)  # terminal: no need to re-subscribe after a reconnect
        with self._listeners_lock:
            listeners = list(self._listeners)
        for cb in listeners:
            try:
                cb(event)
            except Exception:
                log.exception("estop: event listener %r failed on %r", cb, event)

    def connect(self) -> "Client":
        """Opens the connection now (otherwise the first call does)."""
        self._connection()
        return self

    def close(self) -> None:
        self._closed = True
        conn = self._conn
        if conn is not None:
            conn.close(ConnectionLost("client closed"))

    def __enter__(self) -> "Client":
        return self.connect()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def call(self, op: str, *, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """Sends one request and returns its (successful) reply; `GateError` otherwise."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        retries = self.reconnect_attempts if op in _wire.IDEMPOTENT_OPS else 0
        attempt = 0
        while True:
            conn = self._connection()
            try:
                return _wire.check(self._roundtrip(conn, op, fields, timeout))
            except ConnectionLost:
                attempt += 1
                if attempt > retries or self._closed:
                    raise

    # -- events -------------------------------------------------------------------------------

    def add_listener(self, cb: EventCallback) -> None:
        """Calls `cb(event)` (on the reader thread; keep it short) for every event line."""
        with self._listeners_lock:
            self._listeners.append(cb)

    def remove_listener(self, cb: EventCallback) -> None:
        with self._listeners_lock:
            if cb in self._listeners:
                self._listeners.remove(cb)

    # -- agent verbs --------------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        self._connection()
        return {"role": self.role, "principal": self.principal}

    def ping(self) -> bool:
        return bool(self.call("ping").get("pong"))

    def admit(
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
        return _wire.verdict(self.call("admit", **f))

    def start(self, run: str, key: str, token: str) -> Verdict:
        return _wire.verdict(self.call("start", run=run, key=key, token=token))

    def complete(
        self,
        run: str,
        key: str,
        token: str,
        outcome: str,
        result: Any = _MISSING,
        error: str | None = None,
        cost: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """`cost`: `{usd_micros?, tokens?}`, what the call cost; it releases the admission's
        `reserve` and is charged once on the run and every ancestor."""
        return self.call(
            "complete",
            run=run,
            key=key,
            token=token,
            outcome=outcome,
            result=result,
            error=error,
            cost=_wire.spend_fields("cost", cost),
        )

    def wait(self, run: str, key: str, timeout_ms: int) -> Verdict:
        reply = self.call(
            "wait", run=run, key=key, timeout_ms=int(timeout_ms), timeout_s=timeout_ms / 1000 + self.timeout_s
        )
        return _wire.verdict(reply)

    def subscribe(self, run: str) -> dict[str, Any]:
        """Event lines of `run` reach the listeners from now on, and again after a reconnect.
        Returns the reply, which replays the run's state (docs/PROTOCOL.md, "subscribe"); the
        reply of each subscription said again after a reconnect is handed to the listeners as a
        `subscribed` line, so a stop or decision made while the connection was down is heard."""
        reply = self.call("subscribe", run=run)
        self._subs[run] = self._subs.get(run, 0) + 1
        return reply

    def unsubscribe(self, run: str) -> None:
        n = self._subs.get(run, 0)
        if n <= 1:
            self._subs.pop(run, None)
            self.call("unsubscribe", run=run)
        else:
            self._subs[run] = n - 1

    def status(self, run: str) -> dict[str, Any]:
        return self.call("status", run=run)

    def cancel(self, run: str, reason: str | None = None) -> dict[str, Any]:
        return self.call("cancel", run=run, reason=reason)

    def close_run(self, run: str, outcome: str | None = None) -> dict[str, Any]:
        return self.call("close", run=run, outcome=outcome)

    def _pages(self, op: str, lists: tuple[str, ...], limit: int | None = None, **fields: Any) -> dict[str, Any]:
        """Reads a listing page by page, following its cursor (docs/PROTOCOL.md, "Pages"): every
        item, or the first `limit` of `lists[0]`."""
        acc: dict[str, Any] | None = None
        cursor: str | None = None
        while True:
            left = None if limit is None else max(limit - (len(acc[lists[0]]) if acc else 0), 1)
            page = self.call(op, limit=left, cursor=cursor, **fields)
            acc = merge_page(acc, page, lists)
            cursor = page.get("next")
            if not cursor or (limit is not None and len(acc[lists[0]]) >= limit):
                return acc

    def runs(self, state: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Every run (of this agent, for an agent token), or the first `limit`, in id order."""
        return list((self._pages("runs", ("runs",), limit, state=state)).get("runs", []))

    def pending(self, run: str | None = None) -> list[dict[str, Any]]:
        """The whole approvals inbox, soonest to expire first."""
        return list((self._pages("pending", ("pending",), run=run)).get("pending", []))

    def report(self, run: str) -> dict[str, Any]:
        """The whole after-stop report of `run` (every page's lists together)."""
        return self._pages("report", REPORT_LISTS, run=run)

    # -- operator verbs -----------------------------------------------------------------------

    def decide(self, run: str, key: str, decision: str, reason: str | None = None) -> dict[str, Any]:
        return self.call("decide", run=run, key=key, decision=decision, reason=reason)

    def approve(self, run: str, key: str, reason: str | None = None) -> dict[str, Any]:
        return self.decide(run, key, "approve", reason)

    def reject(self, run: str, key: str, reason: str | None = None) -> dict[str, Any]:
        return self.decide(run, key, "reject", reason)

    def pause(self, run: str) -> dict[str, Any]:
        return self.call("pause", run=run)

    def resume(self, run: str) -> dict[str, Any]:
        return self.call("resume", run=run)

    def kill(self, run: str, reason: str | None = None) -> dict[str, Any]:
        return self.call("kill", run=run, reason=reason)

    def ledger(self, run: str | None = None, limit: int | None = None, after: int | None = None) -> dict[str, Any]:
        return self.call("ledger", run=run, limit=limit, after=after)

    def create_token(self, name: str, role: str, groups: list[str] | None = None) -> str:
        return str(self.call("token", name=name, role=role, groups=groups)["token"])
