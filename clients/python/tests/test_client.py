"""The clients against the real gate: auth, verdicts, out-of-order replies, reconnects, errors."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

import estop
from estop import Admitted, Duplicate, Go, Held, RefusedVerdict


def test_hello_and_roles(daemon):
    with daemon.client() as c:
        assert c.hello() == {"role": "agent", "principal": "agent"}
        assert c.ping()
    assert daemon.operator.hello()["role"] == "operator"


def test_bad_token_is_unauthenticated(daemon):
    c = estop.Client(socket=daemon.socket, token="nope", reconnect_attempts=1)
    with pytest.raises(estop.Unauthenticated):
        c.ping()
    c.close()


def test_config_from_env(daemon, monkeypatch):
    monkeypatch.setenv("ESTOP_ADDR", daemon.addr)
    monkeypatch.delenv("ESTOP_SOCKET", raising=False)
    monkeypatch.setenv("ESTOP_TOKEN", daemon.agent_token)
    monkeypatch.setenv("ESTOP_RUN", "env-run")
    cfg = estop.Config.from_env()
    assert cfg.addr is not None and cfg.run == "env-run"
    with estop.Client() as c:  # over TCP
        assert c.hello()["principal"] == "agent"


def test_verdicts_and_two_phase(daemon, run_id):
    with daemon.client() as c:
        v = c.admit(run_id, "a", "send_email", {"to": "x"}, start=False)
        assert isinstance(v, Admitted)
        assert c.admit(run_id, "a", "send_email", {"to": "x"}, start=False) == v  # lost reply costs nothing
        assert isinstance(c.start(run_id, "a", v.token), Go)
        c.complete(run_id, "a", v.token, "ok", result={"id": 7})
        d = c.admit(run_id, "a", "send_email", {"to": "x"})
        assert isinstance(d, Duplicate) and d.status == "completed" and d.result == {"id": 7}
        h = c.admit(run_id, "b", "wire_money", {"amount": 5})
        assert isinstance(h, Held) and h.reason == "approval"
        s = c.admit(run_id, "c", "send_email", {"to": "y"})
        assert isinstance(s, Held) and s.reason == "sibling"
        r = c.admit(run_id, "d", "drop_table", {})
        assert isinstance(r, RefusedVerdict) and r.reason == "denied"
        with pytest.raises(estop.Forbidden):
            c.approve(run_id, "b")
        with pytest.raises(estop.NotFound):
            c.status("no-such-run-" + run_id)


def test_out_of_order_replies(daemon, run_id):
    """A long wait does not hold up other requests on the same connection."""
    with daemon.client() as c:
        assert isinstance(c.admit(run_id, "held", "wire_money", {"amount": 1}), Held)
        out: list[object] = []
        t = threading.Thread(target=lambda: out.append(c.wait(run_id, "held", 3000)))
        t.start()
        time.sleep(0.05)
        t0 = time.monotonic()
        for _ in range(20):
            assert c.ping()
        assert time.monotonic() - t0 < 1.0
        daemon.operator.approve(run_id, "held")
        t.join(5)
        assert isinstance(out[0], Admitted)


async def test_async_out_of_order(daemon, run_id):
    async with estop.AsyncClient(socket=daemon.socket, token=daemon.agent_token) as c:
        assert isinstance(await c.admit(run_id, "held", "wire_money", {"amount": 1}), Held)
        waiter = asyncio.ensure_future(c.wait(run_id, "held", 5000))
        pings = await asyncio.gather(*(c.ping() for _ in range(20)))
        assert all(pings) and not waiter.done()
        daemon.operator.reject(run_id, "held")
        v = await asyncio.wait_for(waiter, 5)
        assert isinstance(v, RefusedVerdict) and v.reason == "rejected"


class _Proxy:
    """A TCP proxy to the gate that can drop every connection, to test reconnects."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.addr = self.lsock.getsockname()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.lsock.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            self.conns += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(x, y), daemon=True).start()

    @staticmethod
    def _pipe(x: socket.socket, y: socket.socket) -> None:
        try:
            while data := x.recv(65536):
                y.sendall(data)
        except OSError:
            pass
        for s in (x, y):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def drop_all(self) -> None:
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conns.clear()

    def close(self) -> None:
        self.drop_all()
        self.lsock.close()


def test_reconnect_after_drop(daemon, run_id):
    host, port = daemon.addr.rsplit(":", 1)
    p = _Proxy((host, int(port)))
    try:
        c = estop.Client(addr=p.addr, token=daemon.agent_token, backoff_initial_s=0.01)
        assert c.ping()
        p.drop_all()
        time.sleep(0.05)
        v = c.admit(run_id, "k", "send_email", {"to": "z"}, start=False)  # reconnects, re-hellos
        assert isinstance(v, Admitted)
        p.drop_all()
        assert c.admit(run_id, "k", "send_email", {"to": "z"}, start=False) == v
        c.close()
    finally:
        p.close()


async def test_async_reconnect_after_drop(daemon, run_id):
    host, port = daemon.addr.rsplit(":", 1)
    p = _Proxy((host, int(port)))
    try:
        c = estop.AsyncClient(addr=p.addr, token=daemon.agent_token, backoff_initial_s=0.01)
        assert await c.ping()
        p.drop_all()
        await asyncio.sleep(0.05)
        assert isinstance(await c.admit(run_id, "k", "send_email", {"to": "z"}, start=False), Admitted)
        await c.close()
    finally:
        p.close()


def test_unreachable_gate_fails_fast():
    c = estop.Client(socket="/nonexistent/estop.sock", token="x", reconnect_attempts=2, backoff_initial_s=0.01)
    with pytest.raises(estop.ConnectionLost):
        c.ping()


def test_timeout(daemon, run_id):
    with estop.Client(socket=daemon.socket, token=daemon.agent_token, timeout_s=0.2) as c:
        c.admit(run_id, "h", "wire_money", {"amount": 3})
        with pytest.raises(estop.EstopTimeout):
            c.call("wait", run=run_id, key="h", timeout_ms=2000, timeout_s=0.2)
        assert c.ping()  # the connection is still usable; the late reply is dropped


def test_huge_args_go_as_digest(daemon, run_id):
    big = {"blob": "x" * 100_000}
    with daemon.client() as c:
        v = c.admit(run_id, "big", "upload", big, start=False)
        assert isinstance(v, Admitted)  # the line would be too long: the digest went instead
        assert c.admit(run_id, "big", "upload", digest=estop.digest("upload", big), start=False) == v
        with pytest.raises(estop.InvalidRequest):
            c.complete(run_id, "big", v.token, "ok", result={"blob": "y" * 100_000})
        assert c.ping()


def test_model_budget_reserve_and_cost(daemon, run_id):
    """`reserve` on admit and `cost` on complete count against the run's tree's model budget:
    a reservation past the parent's limit is refused `budget` naming it; the settled cost that
    reaches the limit fences the tree (cause `budget`); `status` shows the spend."""
    parent, a, b = run_id, f"{run_id}/a", f"{run_id}/b"
    with daemon.client() as c:
        first = c.admit(parent, "plan", "lookup_plan", {}, limits={"max_spend": 1000})
        assert isinstance(first, Admitted)
        va = c.admit(a, "m1", "model.call", {"n": 1}, start=False, parent=parent, reserve={"usd_micros": 600})
        assert isinstance(va, Admitted)
        vb = c.admit(b, "m1", "model.call", {"n": 2}, start=False, parent=parent, reserve={"usd_micros": 600})
        assert isinstance(vb, RefusedVerdict) and vb.reason == "budget", vb
        assert vb.budget == {"dimension": "model_usd", "run": parent, "limit": 1000, "used": 600}
        budget = {line["dimension"]: line for line in c.status(parent)["budget"]}
        assert budget["model_usd"] == {"dimension": "model_usd", "spent": 0, "reserved": 600, "limit": 1000}
        assert isinstance(c.start(a, "m1", va.token), Go)
        c.complete(a, "m1", va.token, "ok", result={}, cost={"usd_micros": 1000, "tokens": 42})
        s = c.status(parent)
        assert s["cause"] == "budget", s
        budget = {line["dimension"]: line for line in s["budget"]}
        assert budget["model_usd"]["spent"] == 1000 and budget["model_usd"]["reserved"] == 0
        assert budget["model_tokens"]["spent"] == 42
        # Bad spend never reaches the wire.
        for bad in ({"usd": 1}, {"tokens": -1}, {"tokens": 10**12 + 1}, {"tokens": True}, [1]):
            with pytest.raises(ValueError):
                c.admit(b, "m2", "model.call", {}, reserve=bad)  # type: ignore[arg-type]


async def test_async_reserve_and_cost(daemon, run_id):
    async with estop.AsyncClient(socket=daemon.socket, token=daemon.agent_token) as c:
        assert isinstance(await c.admit(run_id, "plan", "lookup_plan", {}, limits={"max_tokens": 100}), Admitted)
        x, y = f"{run_id}/x", f"{run_id}/y"
        v = await c.admit(x, "m1", "model.call", {}, start=False, parent=run_id, reserve={"tokens": 80})
        assert isinstance(v, Admitted)
        refused = await c.admit(y, "m1", "model.call", {}, parent=run_id, reserve={"tokens": 30})
        assert isinstance(refused, RefusedVerdict) and refused.budget is not None
        assert refused.budget["dimension"] == "model_tokens" and refused.budget["used"] == 80
        assert isinstance(await c.start(x, "m1", v.token), Go)
        await c.complete(x, "m1", v.token, "ok", result={}, cost={"tokens": 10})
        # The refusal stands for that effect (it is never admitted later); a new call fits now.
        again = await c.admit(y, "m1", "model.call", {}, parent=run_id, reserve={"tokens": 30})
        assert isinstance(again, RefusedVerdict) and again.reason == "budget"
        assert isinstance(await c.admit(y, "m2", "model.call", {}, parent=run_id, reserve={"tokens": 30}), Admitted)
