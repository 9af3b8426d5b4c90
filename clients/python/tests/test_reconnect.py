"""The clients survive the gate (issue 28): a closed connection — the gate killed with -9 and
restarted, an idle close, a dropped network — is reopened in the background with backoff and
jitter, says `hello` again, subscribes to every watched run again and registers the executor
of compensations again; the subscription's reply replays what happened while it was down. A line
the gate cannot read fails its request with a typed error; a gate that answers late is waited
for, and nothing runs twice. Each against a real daemon of its own (they are killed), some
through a small proxy that can cut, hold and delay the connection."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import threading
import time
from typing import Any, Callable

import pytest

import estop
from estop import Admitted, Held, RunStopped
from estop.testing import Daemon

POLICY = """
[defaults]
unknown_tool = "allow"
approval_expiry = "10m"

[[rules]]
tool = "wire_money"
action = "approve"

[[rules]]
tool = "charge"
action = "allow"
compensate = "uncharge"
compensate_args = '{"charge": result.id}'
"""

FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.5}


class _Proxy:
    """A Unix-socket proxy to the gate, on a thread of its own: `cut()` closes every connection,
    `hold()` keeps new ones waiting (accepted, not yet passed on) until `release()`, and `delay_s`
    holds back every line from the gate that long. `sent` is every line clients sent."""

    def __init__(self, target: str, delay_s: float = 0.0) -> None:
        self.target = target
        self.delay_s = delay_s
        self.path = os.path.join(tempfile.mkdtemp(prefix="estop-proxy-"), "p.sock")
        self.sent: list[bytes] = []
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._open.set()
            self._server = self._loop.run_until_complete(asyncio.start_unix_server(self._serve, self.path))
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self._writers.append(cw)
        await self._open.wait()
        try:
            gr, gw = await asyncio.open_unix_connection(self.target, limit=1 << 22)
        except OSError:
            cw.close()
            return
        self._writers.append(gw)

        async def up() -> None:
            while line := await cr.readline():
                self.sent.append(line)
                gw.write(line)
                await gw.drain()

        async def down() -> None:
            while line := await gr.readline():
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                cw.write(line)
                await cw.drain()

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except Exception:
            pass
        for t in tasks:
            t.cancel()
        for w in (cw, gw):
            w.close()

    def _call(self, fn: Callable[[], Any]) -> None:
        done = threading.Event()

        def go() -> None:
            fn()
            done.set()

        self._loop.call_soon_threadsafe(go)
        done.wait(10)

    def cut(self) -> None:
        def close_all() -> None:
            for w in self._writers:
                w.close()
            self._writers.clear()

        self._call(close_all)

    def hold(self) -> None:
        self._call(self._open.clear)

    def release(self) -> None:
        self._call(self._open.set)

    def saw(self, fragment: bytes) -> bool:
        return any(fragment in line for line in list(self.sent))

    def close(self) -> None:
        self.cut()

        def stop() -> None:
            for t in asyncio.all_tasks(self._loop):
                t.cancel()
            self._server.close()
            self._loop.call_later(0.05, self._loop.stop)

        self._loop.call_soon_threadsafe(stop)


def _until(look: Callable[[], bool], within_s: float = 30.0) -> None:
    """Polls what the test can see, bounded (never a bare sleep)."""
    deadline = time.monotonic() + within_s
    while not look():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


async def _auntil(look: Callable[[], bool], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not look():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.02)


def _charged(d: Daemon, run: str, key: str = "c1") -> None:
    """An effect of `run` done and compensable: a cancel asks for its `uncharge`."""
    with d.client() as c:
        v = c.admit(run, key, "charge", {"amount": 5})
        assert isinstance(v, Admitted), v
        c.complete(run, key, v.token, "ok", result={"id": f"ch_{key}"})


def _idle_closed(d: Daemon) -> None:
    """Blocks until a connection that only said `hello` is closed as idle: the idle time passed."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(d.socket)
    s.sendall(b'{"id":1,"op":"hello","token":"' + d.agent_token.encode() + b'"}\n')
    s.settimeout(30)
    got = b""
    while chunk := s.recv(4096):
        got += chunk
    s.close()
    assert b"idle" in got, got


def _worker(d: Daemon, run: str, undone: list[tuple[Any, str]], socket_path: str | None = None) -> estop.CompensationWorker:
    async def uncharge(args: Any, idempotency_key: str) -> None:
        undone.append((args, idempotency_key))

    return estop.CompensationWorker(
        {"uncharge": uncharge}, run=run, socket=socket_path or d.socket, token=d.agent_token, **FAST
    )


async def _serve_until_cancelled(d: Daemon, worker: estop.CompensationWorker, run: str, task: "asyncio.Task[None]") -> None:
    """Until the run is `cancelled` (its saga settled) and the worker has heard its report
    answered; then the worker stops."""
    await _auntil(lambda: d.operator.status(run)["state"] == "cancelled" and bool(worker.reported))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_the_worker_survives_a_kill_9_and_runs_a_compensation_cancelled_after_the_restart(run_id):
    with Daemon(policy=POLICY) as d:
        _charged(d, run_id)
        undone: list[tuple[Any, str]] = []

        async def main() -> None:
            worker = _worker(d, run_id, undone)
            task = asyncio.create_task(worker.serve())
            await _auntil(lambda: bool(worker.client._executes) and worker.client._conn is not None)
            d.kill9()
            d.start()
            # Nothing of the worker's asks the gate anything: only its own reconnect can bring
            # it back as an executor.
            d.operator.cancel(run_id, reason="after the restart")
            await _serve_until_cancelled(d, worker, run_id, task)
            assert worker.reported == [(run_id, "c1", 1, "ok")]

        asyncio.run(main())
        assert undone == [({"charge": "ch_c1"}, "c1/undo")]


def test_the_worker_survives_the_idle_timeout(run_id):
    with Daemon(policy=POLICY, args=("--idle-timeout", "1s")) as d:
        _charged(d, run_id)
        undone: list[tuple[Any, str]] = []

        async def main() -> None:
            worker = _worker(d, run_id, undone)
            task = asyncio.create_task(worker.serve())
            await _auntil(lambda: bool(worker.client._executes))
            await asyncio.to_thread(_idle_closed, d)  # the idle time has passed
            d.operator.cancel(run_id)
            await _serve_until_cancelled(d, worker, run_id, task)

        asyncio.run(main())
        assert undone == [({"charge": "ch_c1"}, "c1/undo")]


def test_a_run_is_fenced_by_a_cancel_made_while_its_watcher_was_away(run_id):
    with Daemon(policy=POLICY) as d:
        p = _Proxy(d.socket)
        gate = estop.Estop(socket=p.path, token=d.agent_token, **FAST)
        try:
            n: list[int] = []

            @estop.effect
            def pay(amount: int) -> str:
                n.append(amount)
                return "ok"

            run = gate.run(run_id)
            with run:
                assert pay(1) == "ok"  # the run is watched from its first admission
            assert run.stopped is None
            # The watcher's connection is cut and held; the gate is killed and restarts; the run
            # is cancelled while the watcher cannot hear it.
            p.hold()
            p.cut()
            d.kill9()
            d.start()
            d.operator.cancel(run_id, reason="while you were away")
            assert run.stopped is None
            p.release()
            _until(lambda: run.stopped is not None)
            assert run.stopped == "cancelled"
            with pytest.raises(RunStopped):
                with run:
                    pay(2)
            assert n == [1]
        finally:
            gate.close()
            p.close()


def test_wait_decided_hears_a_decision_made_while_disconnected(run_id):
    with Daemon(policy=POLICY) as d:
        p = _Proxy(d.socket)
        gate = estop.Estop(socket=p.path, token=d.agent_token, **FAST)
        try:
            assert isinstance(gate.client.admit(run_id, "k", "wire_money", {"amount": 1}), Held)
            out: dict[str, Any] = {}
            t = threading.Thread(target=lambda: out.update(gate.wait_decided(run_id, ["k"], timeout_s=30)))
            t.start()
            _until(lambda: p.saw(b'"op":"wait"'))  # subscribed, and looked once
            p.hold()
            p.cut()
            d.operator.approve(run_id, "k")
            p.release()
            t.join(30)
            assert out == {"k": "approve"}
        finally:
            gate.close()
            p.close()


async def test_await_decided_hears_a_decision_made_while_the_gate_restarted(run_id):
    with Daemon(policy=POLICY) as d:
        p = _Proxy(d.socket)
        gate = estop.Estop(socket=p.path, token=d.agent_token, **FAST)
        try:
            assert isinstance(await gate.aclient.admit(run_id, "k", "wire_money", {"amount": 1}), Held)
            task = asyncio.create_task(gate.await_decided(run_id, ["k"], timeout_s=30))
            await _auntil(lambda: p.saw(b'"op":"wait"'))
            p.hold()
            d.kill9()
            d.start()
            await asyncio.to_thread(d.operator.reject, run_id, "k")
            p.release()
            assert await task == {"k": "reject"}
        finally:
            await gate.aclose()
            p.close()


async def test_a_line_over_the_gates_bound_fails_its_request_and_nothing_else(run_id):
    """The gate reads at most 4096 bytes a line here; the client thinks 65536. The gate answers
    the long line with `id: null`: that request fails with `LineTooLong` at once (it used to
    wait for ever), the wait parked on the same connection does not, and the connection goes on."""
    with Daemon(policy=POLICY, args=("--line-bytes-max", "4096")) as d:
        async with estop.AsyncClient(socket=d.socket, token=d.agent_token, timeout_s=20) as c:
            assert isinstance(await c.admit(run_id, "h", "wire_money", {"amount": 1}), Held)
            waiter = asyncio.ensure_future(c.wait(run_id, "h", 20_000))
            started = time.monotonic()
            with pytest.raises(estop.LineTooLong):
                await c.admit(run_id, "big", "upload", {"blob": "x" * 10_000})
            assert time.monotonic() - started < 5
            assert not waiter.done()
            assert await c.ping()
            await asyncio.to_thread(d.operator.approve, run_id, "h")
            assert isinstance(await asyncio.wait_for(waiter, 10), Admitted)
        # And a line over the client's own bound never leaves it.
        with d.client(line_bytes_max=4096) as c:
            with pytest.raises(estop.LineTooLong):
                c.call("status", run="r" * 5000)
            assert c.ping()


def test_a_gate_that_answers_two_seconds_late_is_waited_for_and_nothing_runs_twice(run_id):
    with Daemon(policy=POLICY) as d:
        _charged(d, run_id)
        p = _Proxy(d.socket, delay_s=2.0)
        undone: list[tuple[Any, str]] = []
        try:

            async def main() -> None:
                late = estop.AsyncClient(socket=p.path, token=d.agent_token, **FAST)
                started = time.monotonic()
                v = await late.admit(run_id + "-b", "k", "pay", {"amount": 1})
                assert isinstance(v, Admitted) and time.monotonic() - started >= 2
                await late.close()
                worker = _worker(d, run_id, undone, socket_path=p.path)
                task = asyncio.create_task(worker.serve())
                await _auntil(lambda: bool(worker.client._executes))
                d.operator.cancel(run_id)
                await _serve_until_cancelled(d, worker, run_id, task)
                assert worker.reported == [(run_id, "c1", 1, "ok")]

            asyncio.run(main())
            assert undone == [({"charge": "ch_c1"}, "c1/undo")]
            report = d.operator.report(run_id)
            undo = [e for e in report["done"] if e.get("compensate") == "uncharge"]
            assert undo and undo[0]["status"] == "compensated" and undo[0]["attempts"] == 1, report
            ledger = d.operator.ledger(run_id + "-b")["entries"]
            assert [e["kind"] for e in ledger].count("admit") == 1, ledger
        finally:
            p.close()


async def test_await_decided_goes_on_when_its_connections_reader_was_cancelled(run_id):
    """A framework that cancels the tasks of a run it stops (LlamaIndex's `cancel_run`) can
    cancel the client's reader with them: the connection ends as if the client were closed, and
    no reconnect is started for it. A decision wait that lost its connection that way looks
    again soon, on a new connection, instead of waiting for a replay that never comes."""
    with Daemon(policy=POLICY) as d:
        gate = estop.Estop(socket=d.socket, token=d.agent_token, **FAST)
        try:
            assert isinstance(await gate.aclient.admit(run_id, "k", "wire_money", {"amount": 1}), Held)
            task = asyncio.create_task(gate.await_decided(run_id, ["k"], timeout_s=30))
            await asyncio.sleep(0.3)
            conn = gate.aclient._conn
            assert conn is not None
            conn.task.cancel()  # the reader goes with the framework's tasks
            await asyncio.sleep(0.1)
            await asyncio.to_thread(d.operator.approve, run_id, "k")
            assert await asyncio.wait_for(task, 10) == {"k": "approve"}
        finally:
            await gate.aclose()
