"""LlamaIndex Workflows: the five failure classes, without estop and through
estop.adapters.llamaindex. Workflows have no model of their own; the steps are the script."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

from workflows import Context, Workflow, step
from workflows.errors import WorkflowTimeoutError
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

import estop
from estop.adapters import llamaindex as eli

from .common import DECIDE_AFTER_S, NEXT_TURN_AMOUNT, SIBLING_WORK_S, TOOL_DELAY_S, Trial, aswallow_refusal, effects, interrupt_then_continue, leaks_after, stop_mid_tool, swallow_refusal


class WireEv(Event):
    amount: int


class EmailEv(Event):
    to: str


class PayEv(Event):
    amount: int


class DoneEv(Event):
    what: str


def _start(t: Trial, guarded: bool, wf: Workflow) -> Any:
    return eli.run(wf, gate=t.gate, run_id=t.run_id) if guarded else wf.run()


def sibling(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)

    class W(Workflow):
        @step
        async def plan(self, ctx: Context, ev: StartEvent) -> WireEv | EmailEv | None:
            ctx.send_event(WireEv(amount=100))
            ctx.send_event(EmailEv(to="ops@example.com"))
            return None

        @step
        async def wire(self, ctx: Context, ev: WireEv) -> DoneEv:
            if guarded:
                await aswallow_refusal(fx["awire"], "acct-9", ev.amount)  # held in estop
            else:
                r = await ctx.wait_for_event(HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="approve wire?"), waiter_id="wire")
                if r.response == "yes":
                    t.world.do("wire", ev.amount)
            return DoneEv(what="wire")

        @step
        def email(self, ev: EmailEv) -> DoneEv:
            time.sleep(SIBLING_WORK_S)
            swallow_refusal(fx["send_email"], ev.to)
            return DoneEv(what="email")

        @step
        async def join(self, ctx: Context, ev: DoneEv) -> StopEvent | None:
            if ctx.collect_events(ev, [DoneEv, DoneEv]) is None:
                return None
            return StopEvent(result="ok")

    async def awire(to: str, amount: int) -> str:
        t.world.do("wire", amount)
        return "wired"

    fx["awire"] = estop.effect(tool="wire_money")(awire) if guarded else awire

    async def main() -> None:
        h = _start(t, guarded, W(timeout=10))
        if guarded:
            th = t.decide_later("reject", tool="wire_money")
            await h
            th.join()
            assert t.world.count("email") == 1, "the sibling proceeds once the decision is made"
            return
        async for ev in h.stream_events():
            if isinstance(ev, InputRequiredEvent):
                await asyncio.sleep(DECIDE_AFTER_S)
                t.world.mark("decided")
                h.ctx.send_event(HumanResponseEvent(response="no"))
        await h

    asyncio.run(main())
    return t.world.count("email", before=t.world.marks["decided"])


def reject(t: Trial, guarded: bool) -> int:
    async def transfer(to: str, amount: int) -> str:
        t.world.do("wire", amount)
        return "wired"

    gated = estop.effect(tool="wire_money")(transfer) if guarded else transfer

    class W(Workflow):
        @step
        async def wire(self, ctx: Context, ev: StartEvent) -> PayEv:
            if guarded:
                await aswallow_refusal(gated, "acct-9", 100)
            else:
                r = await ctx.wait_for_event(HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="approve wire?"), waiter_id="wire")
                if r.response == "yes":
                    await gated("acct-9", 100)
            # The agent re-plans: pay the invoice instead — the same transfer, another step.
            return PayEv(amount=100)

        @step
        async def pay(self, ev: PayEv) -> StopEvent:
            return StopEvent(result=await aswallow_refusal(gated, "acct-9", ev.amount))

    async def main() -> None:
        h = _start(t, guarded, W(timeout=10))
        if guarded:
            p = await asyncio.to_thread(t.pending, "wire_money")
            t.world.mark("rejected")
            await asyncio.to_thread(t.operator.reject, t.run_id, p["key"])
            await h
            return
        async for ev in h.stream_events():
            if isinstance(ev, InputRequiredEvent):
                t.world.mark("rejected")
                h.ctx.send_event(HumanResponseEvent(response="no"))
        await h

    asyncio.run(main())
    return leaks_after(t.world, "wire", "rejected")


def replay(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)

    class W(Workflow):
        def __init__(self, crash: bool, **kw: Any) -> None:
            super().__init__(**kw)
            self.crash = crash

        @step
        async def charge(self, ev: StartEvent) -> DoneEv:
            await fx["acharge"](42)
            return DoneEv(what="charged")

        @step
        async def ship(self, ev: DoneEv) -> StopEvent:
            if self.crash:
                raise ConnectionError("worker lost")  # dies after the charge
            return StopEvent(result="shipped")

    async def attempt(crash: bool) -> None:
        try:
            await _start(t, guarded, W(crash, timeout=10))
        except Exception:
            pass

    asyncio.run(attempt(True))
    asyncio.run(attempt(False))  # the job is redelivered
    return t.world.count("charge") - 1


def restart_pause(t: Trial, guarded: bool) -> int:
    """A restart during the pause (see common.EXTRA_CLASSES): the approval is LlamaIndex's own
    pause, `ctx.wait_for_event` (with estop: estop's hold, the same `wait_for_event` through
    `eli.effect(..., ctx=ctx)`), its context saved (`ctx.to_dict()`, the durable store) and the
    workflow cancelled. After the approval worker A restores the saved context, the replayed step
    transfers and the worker dies right after (nothing after is saved); the job is redelivered and
    worker B restores the same saved context (and, without estop, sends the approval again)."""

    async def transfer(to: str, amount: int, ctx: Context | None = None) -> str:
        t.world.do("wire", amount)
        return "wired"

    wire = eli.effect(tool="wire_money")(transfer)

    class W(Workflow):
        def __init__(self, crash: bool = False, **kw: Any) -> None:
            super().__init__(**kw)
            self.crash = crash

        @step
        async def pay(self, ctx: Context, ev: StartEvent) -> StopEvent:
            if guarded:
                receipt = await wire("acct-9", 100, ctx=ctx)  # held by estop's policy: the pause
            else:
                r = await ctx.wait_for_event(HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="approve wire?"), waiter_id="wire")
                receipt = await transfer("acct-9", 100) if r.response == "yes" else "rejected"
            if self.crash:
                raise ConnectionError("worker lost")  # worker A dies right after the transfer
            return StopEvent(result=receipt)

    async def pause() -> dict[str, Any]:
        h = _start(t, guarded, W(timeout=10))
        async for ev in h.stream_events():
            if isinstance(ev, InputRequiredEvent):
                break
        waiter = "estop:" if guarded else "wire"
        for _ in range(500):  # until the step's waiter is registered: the context holds the pause
            saved = h.ctx.to_dict()
            if any(str(w.get("waiter_id")).startswith(waiter) for wk in saved["workers"].values() for w in wk.get("collected_waiters", [])):
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the step never paused")
        assert t.world.count("wire") == 0
        await h.cancel_run()
        with contextlib.suppress(Exception):
            await h
        return saved

    async def resume(saved: dict[str, Any], crash: bool) -> None:
        wf = W(crash, timeout=10)
        ctx = Context.from_dict(wf, saved)
        h = eli.run(wf, gate=t.gate, run_id=t.run_id, ctx=ctx) if guarded else wf.run(ctx=ctx)
        if not guarded:
            h.ctx.send_event(HumanResponseEvent(response="yes"))  # the approval (redelivered)
        with contextlib.suppress(ConnectionError):
            await h

    saved = asyncio.run(pause())
    if guarded:
        t.operator.approve(t.run_id, t.pending("wire_money")["key"])
    asyncio.run(resume(saved, True))  # worker A: transfers, dies
    asyncio.run(resume(saved, False))  # worker B: the job redelivered, from the saved pause
    return t.world.count("wire") - 1


def retry_policy(t: Trial, guarded: bool) -> int:
    """The workflow's own retry policy (`@step(retry_policy=...)`) re-runs a step that charged,
    then failed (the shipping API flaked after the charge)."""
    from workflows.retry_policy import retry_policy as policy, stop_after_attempt, wait_fixed

    fx = effects(t, guarded)
    attempts: list[str] = []

    class W(Workflow):
        @step(retry_policy=policy(wait=wait_fixed(0.01), stop=stop_after_attempt(3)))
        async def checkout(self, ev: StartEvent) -> StopEvent:
            receipt = await fx["acharge"](42)
            attempts.append(receipt)
            if len(attempts) == 1:
                raise ConnectionError("the shipping API flaked after the charge")
            return StopEvent(result=receipt)

    async def main() -> None:
        await _start(t, guarded, W(timeout=10))

    asyncio.run(main())
    assert len(attempts) == 2, f"expected the policy to run the step again, got {len(attempts)} runs"
    return t.world.count("charge") - 1


def cancel_thread(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)
    done = threading.Event()

    class W(Workflow):
        @step
        def refund(self, ev: StartEvent) -> StopEvent:
            try:
                time.sleep(TOOL_DELAY_S)
                swallow_refusal(fx["charge"], -42)
            finally:
                done.set()
            return StopEvent(result="refunded")

    async def main() -> None:
        try:
            await _start(t, guarded, W(timeout=TOOL_DELAY_S / 3))  # the workflow's own timeout
            raise AssertionError("expected the workflow timeout")
        except WorkflowTimeoutError:
            t.world.mark("stopped")

    asyncio.run(main())
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def _slow_refund(t: Trial, guarded: bool) -> tuple[Any, threading.Event, threading.Event]:
    """A workflow whose sync step (run in a worker thread) refunds through a slow API."""
    fx = effects(t, guarded)
    started, done = threading.Event(), threading.Event()

    class W(Workflow):
        @step
        def refund(self, ev: StartEvent) -> StopEvent:
            started.set()
            try:
                time.sleep(TOOL_DELAY_S)
                swallow_refusal(fx["charge"], -42)
            finally:
                done.set()
            return StopEvent(result="refunded")

    return W(timeout=10), started, done


def operator_cancel(t: Trial, guarded: bool) -> int:
    wf, started, done = _slow_refund(t, guarded)

    async def run() -> Any:
        return await _start(t, guarded, wf)

    asyncio.run(stop_mid_tool(t, guarded, started, run()))
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def framework_cancel(t: Trial, guarded: bool) -> int:
    """The workflow's own stop, `handler.cancel_run()`, while the step's thread is mid-work."""
    wf, started, done = _slow_refund(t, guarded)

    async def main() -> None:
        handler = _start(t, guarded, wf)
        while not started.is_set():
            await asyncio.sleep(0.005)
        await handler.cancel_run()
        t.world.mark("stopped")
        with contextlib.suppress(Exception):
            await handler

    asyncio.run(main())
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def cancel_async(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)
    started = threading.Event()
    finished = threading.Event()

    async def write() -> None:
        try:
            await asyncio.sleep(TOOL_DELAY_S)
            await aswallow_refusal(fx["acharge"], -42)
        finally:
            finished.set()

    class W(Workflow):
        @step
        async def refund(self, ev: StartEvent) -> StopEvent:
            started.set()
            await asyncio.shield(asyncio.ensure_future(write()))
            return StopEvent(result="refunded")

    async def main() -> None:
        h = _start(t, guarded, W(timeout=10))
        while not started.is_set():
            await asyncio.sleep(0.005)
        await h.cancel_run()  # the framework's own cancel
        t.world.mark("stopped")
        try:
            await h
        except Exception:
            pass
        while not finished.is_set():
            await asyncio.sleep(0.005)

    asyncio.run(main())
    return leaks_after(t.world, "charge", "stopped")


def next_turn(t: Trial, guarded: bool) -> None:
    """The next run of a workflow for the same run id: a step that charges."""
    fx = effects(t, guarded)

    class W(Workflow):
        @step
        def pay(self, ev: StartEvent) -> StopEvent:
            return StopEvent(result=fx["charge"](NEXT_TURN_AMOUNT))

    async def main() -> None:
        await _start(t, guarded, W(timeout=10))

    asyncio.run(main())


def interrupt_continue(t: Trial, guarded: bool) -> int:
    return interrupt_then_continue(t, guarded, cancel_thread, next_turn)


SCENARIOS = {"retry_policy": retry_policy, "restart_pause": restart_pause, "operator_cancel": operator_cancel, "framework_cancel": framework_cancel, "sibling": sibling, "reject": reject, "replay": replay, "cancel_thread": cancel_thread, "cancel_async": cancel_async, "interrupt_continue": interrupt_continue}
