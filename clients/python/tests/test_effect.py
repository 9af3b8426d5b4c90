"""`@effect`, run context, keys and the watcher against the real gate."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import estop


def wait_pending(operator, run, tool=None, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            p = [x for x in operator.pending(run) if tool is None or x["tool"] == tool]
        except estop.NotFound:  # the run does not exist until its first admit
            p = []
        if p:
            return p[0]
        time.sleep(0.01)
    raise AssertionError(f"nothing pending in {run}")


def test_effect_runs_once_and_replays_receipt(gate, run_id):
    calls = []

    @estop.effect(tool="charge")
    def charge(customer: str, amount: int) -> dict:
        calls.append(amount)
        return {"charge": f"ch_{len(calls)}", "amount": amount}

    with gate.run(run_id):
        assert charge("c1", 10) == {"charge": "ch_1", "amount": 10}
        assert charge("c1", 20)["charge"] == "ch_2"  # other args: a new effect
    with gate.run(run_id):  # a replay: same run, same steps → the recorded results
        assert charge("c1", 10) == {"charge": "ch_1", "amount": 10}
        assert charge("c1", 20)["charge"] == "ch_2"
    assert calls == [10, 20]


def test_keys_are_stable_and_distinct():
    d = estop.digest("t", {"a": 1})
    k = estop.derive_key("r", "step", "t", d)
    assert k == estop.derive_key("r", "step", "t", estop.digest("t", {"a": 1.0}))
    assert k != estop.derive_key("r", "step", "t", d, 2)
    assert k != estop.derive_key("r2", "step", "t", d)
    assert len(estop.derive_key("r", "s" * 500, "t" * 500, d).encode()) <= 200


def test_steps_scope_occurrences(gate, run_id):
    n = []

    @estop.effect
    def ping_customer(who: str) -> int:
        n.append(who)
        return len(n)

    with gate.run(run_id):
        with estop.step("node-a@1"):
            assert ping_customer("x") == 1
            assert ping_customer("x") == 2  # the second identical call of the step is new
        with estop.step("node-a@1"):  # the step re-executed (resume): both are receipts
            assert ping_customer("x") == 1
            assert ping_customer("x") == 2
    assert n == ["x", "x"]


def test_exception_is_error_and_sticks(gate, run_id):
    @estop.effect
    def flaky(x: int) -> None:
        raise ValueError("boom")

    with gate.run(run_id):
        with pytest.raises(ValueError):
            flaky(1)
    with gate.run(run_id):
        with pytest.raises(estop.EffectFailed, match="boom"):
            flaky(1)


def test_hold_wait_approve_and_reject(gate, operator, run_id):
    done = []

    @estop.effect
    def wire_money(amount: int) -> str:
        done.append(amount)
        return "sent"

    def approve_later(decision):
        p = wait_pending(operator, run_id)
        operator.decide(run_id, p["key"], decision)

    with gate.run(run_id):
        t = threading.Thread(target=approve_later, args=("approve",))
        t.start()
        assert wire_money(100) == "sent"
        t.join()
        t = threading.Thread(target=approve_later, args=("reject",))
        t.start()
        with pytest.raises(estop.Rejected) as ei:
            wire_money(200)
        t.join()
        assert ei.value.reason == "rejected"
        # G2: the same call under a new key (another step) is refused too, without asking anyone
        with estop.step("retry"):
            with pytest.raises(estop.Rejected):
                wire_money(200)
    assert done == [100]


def test_on_hold_raise(gate, run_id):
    @estop.effect(on_hold="raise")
    def wire_money(amount: int) -> str:
        return "sent"

    with gate.run(run_id):
        with pytest.raises(estop.HeldForApproval) as ei:
            wire_money(5)
        assert ei.value.reason == "approval"


def test_denied_and_needs_approval(gate, operator, run_id):
    @estop.effect
    def drop_table(name: str) -> None:
        raise AssertionError("never runs")

    @estop.effect(needs_approval=True, on_hold="raise")
    def send_email(to: str) -> None:
        raise AssertionError("never runs")

    with gate.run(run_id):
        with pytest.raises(estop.Denied):
            drop_table("users")
        with pytest.raises(estop.HeldForApproval):
            send_email("a@b")


def test_sibling_waits_for_decision(gate, operator, run_id):
    log = []

    @estop.effect
    def wire_money(amount: int) -> None:
        log.append("wire")

    @estop.effect
    def send_email(to: str) -> None:
        log.append("email")

    with gate.run(run_id) as run:
        t1 = threading.Thread(target=lambda: _swallow(lambda: _in(run, wire_money, 500)))
        t1.start()
        p = wait_pending(operator, run_id)
        t2 = threading.Thread(target=lambda: _in(run, send_email, "x@y"))
        t2.start()
        time.sleep(0.3)
        assert log == []  # the sibling is held while the approval is pending (G1)
        operator.reject(run_id, p["key"])
        t1.join(5)
        t2.join(5)
    assert log == ["email"]


def _in(run, fn, *a):
    with run:
        return fn(*a)


def _swallow(fn):
    try:
        fn()
    except estop.Refused:
        pass


def test_cancel_fences_worker_threads(gate, daemon, run_id):
    """A thread tool that reaches its effect after the cancel refuses, locally and at the gate."""
    landed = []
    go = threading.Event()

    @estop.effect
    def charge(amount: int) -> None:
        landed.append(amount)

    errors = []

    def tool(run):
        with run:
            charge(1)  # before the cancel: runs
            go.wait()
            try:
                charge(2)
            except estop.RunStopped as e:
                errors.append(e)

    run = gate.run(run_id)
    t = threading.Thread(target=tool, args=(run,))
    t.start()
    time.sleep(0.2)
    daemon.operator.cancel(run_id, "operator pressed stop")  # from outside the process
    time.sleep(0.2)  # the watcher hears it
    assert run.stopped == "cancelled"
    go.set()
    t.join(5)
    assert landed == [1] and errors and errors[0].local


def test_cancel_of_unseen_run_is_local_fence(gate, run_id):
    @estop.effect
    def charge(amount: int) -> None:
        raise AssertionError("never runs")

    run = gate.run(run_id)
    gate.cancel(run, "stop before anything happened")
    with run:
        with pytest.raises(estop.RunStopped):
            charge(1)


async def test_watcher_cancels_tasks(gate, daemon, run_id):
    landed = []

    @estop.effect
    async def charge(amount: int) -> None:
        landed.append(amount)

    async def agent():
        async with gate.run(run_id):
            await charge(1)
            await asyncio.sleep(30)  # a long model call; the stop must reach it
            await charge(2)

    task = asyncio.ensure_future(agent())
    while not landed:
        await asyncio.sleep(0.01)
    await asyncio.to_thread(daemon.operator.cancel, run_id, "stop")
    with pytest.raises(estop.RunStopped):
        await asyncio.wait_for(task, 5)
    assert landed == [1]


async def test_async_cancel_after_start_is_unknown(gate, daemon, run_id):
    started = asyncio.Event()

    @estop.effect
    async def slow_charge(amount: int) -> None:
        started.set()
        await asyncio.sleep(30)

    async def agent():
        async with gate.run(run_id):
            await slow_charge(1)

    task = asyncio.ensure_future(agent())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    rep = daemon.operator.report(run_id)
    assert [e["key"] for e in rep["unknown"]], rep


async def test_child_runs_cascade(gate, daemon, run_id):
    @estop.effect
    async def charge(amount: int) -> None:
        pass

    async with gate.run(run_id) as parent:
        await charge(1)
        child = parent.child("sub")
        async with child:
            await charge(2)
        st = daemon.operator.status(child.id)
        assert st.get("parent") == run_id
        await parent.acancel("stop all")
        async with child:
            with pytest.raises(estop.RunStopped):
                await charge(3)


def test_named_step_counts_repeated_calls(gate, run_id):
    """Regression (issue 18): `@estop.effect(step=...)` forced occurrence 1, so three identical
    calls collapsed into one effect (the 2nd and 3rd returned the 1st's receipt). The README
    promises identical calls in one step are told apart by their order."""
    n = []

    @estop.effect(step="charge-card")
    def charge(amount: int) -> int:
        n.append(amount)
        return len(n)

    with gate.run(run_id):
        assert [charge(5), charge(5), charge(5)] == [1, 2, 3]
    with gate.run(run_id):  # the same invocation again (a replay): the three receipts
        assert [charge(5), charge(5), charge(5)] == [1, 2, 3]
    assert n == [5, 5, 5]


def test_a_failed_complete_does_not_lose_the_result(gate, run_id, caplog):
    """Regression (issue 18): a `complete` that failed after the effect ran (the gate went away
    for a moment) turned into the tool's failure and the result was lost. Now the result is
    returned and the lost report is logged (the gate shows the effect in flight)."""
    n = []

    @estop.effect
    def charge(amount: int) -> str:
        n.append(amount)
        return "ch_1"

    def lost(*a, **kw):
        raise estop.ConnectionLost("the gate went away")

    with gate.run(run_id):
        gate.client.complete = lost
        try:
            assert charge(3) == "ch_1"
        finally:
            del gate.client.complete
    assert n == [3]
    assert any("could not be recorded" in r.getMessage() for r in caplog.records)
