"""CrewAI: the failure classes, without estop (CrewAI's own tool-level human-in-the-loop: a
`before_tool_call` hook that waits for a human and vetoes) and through estop.adapters.crewai,
driven by a scripted OpenAI-compatible model (crew_support)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from crewai.hooks.dispatch import InterceptionPoint, register_scoped, scoped_hooks
from crewai.tools import tool

import estop
from estop.adapters import crewai as ecr

from .common import DECIDE_AFTER_S, NEXT_TURN_AMOUNT, SIBLING_WORK_S, TOOL_DELAY_S, Trial, effects, interrupt_then_continue, leaks_after, stop_mid_tool, swallow_refusal
from .crew_support import ScriptedModel, call, crew


def _human_rejects(t: Trial, needs: set[str]) -> Any:
    """CrewAI's approval without estop: a before_tool_call hook asks a human (who answers
    DECIDE_AFTER_S later: reject) and vetoes the call; only that call waits."""

    def hook(ctx: Any) -> bool | None:
        if ctx.tool_name in needs:
            time.sleep(DECIDE_AFTER_S)
            t.world.mark("decided")
            t.world.mark("rejected")
            return False
        return None

    return hook


async def _kick(t: Trial, guarded: bool, c: Any, *, hooks: ecr.EstopHooks | None = None, human: Any = None, timeout_s: float | None = None) -> Any:
    if guarded:
        return await ecr.kickoff(c, gate=t.gate, run_id=t.run_id, hooks=hooks, timeout_s=timeout_s)
    with scoped_hooks():
        if human is not None:
            register_scoped(InterceptionPoint.PRE_TOOL_CALL, human)
        aw = c.kickoff_async()
        return await (asyncio.wait_for(aw, timeout_s) if timeout_s else aw)


def _run(t: Trial, steps: list[Any], tools: list[Any], coro: Any) -> None:
    model = ScriptedModel(steps)
    try:
        asyncio.run(coro(crew(model, tools)))
    finally:
        model.close()


def sibling(t: Trial, guarded: bool) -> int:
    """One turn: a transfer that needs approval and an email (50 ms of work first). CrewAI's
    hook pauses the transfer's thread only; the email's thread sends at once."""
    fx = effects(t, guarded)

    @tool("wire_money")
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        t.world.do("wire", amount)
        return "wired"

    @tool("notify")
    def notify(to: str) -> str:
        """Tell someone."""
        time.sleep(SIBLING_WORK_S)
        return str(swallow_refusal(fx["send_email"], to))

    turn = [call("wire_money", "w1", to="acct-9", amount=100), call("notify", "n1", to="ops@example.com")]

    async def main(c: Any) -> None:
        if guarded:
            th = t.decide_later("reject", tool="wire_money")
            await _kick(t, True, c, hooks=ecr.EstopHooks(approval={"wire_money"}))
            th.join()
        else:
            await _kick(t, False, c, human=_human_rejects(t, {"wire_money"}))

    _run(t, [turn], [wire_money, notify], main)
    return t.world.count("email", before=t.world.marks["decided"])


def reject(t: Trial, guarded: bool) -> int:
    """The human rejects the transfer; the model re-plans and pays the invoice instead."""

    def transfer(amount: int) -> str:
        t.world.do("wire", amount)
        return "wired"

    @tool("wire_money")
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        return transfer(amount)

    @tool("pay_invoice")
    def pay_invoice(to: str, amount: int) -> str:
        """Pay an invoice (moves money too)."""
        return transfer(amount)

    steps = [[call("wire_money", "w1", to="acct-9", amount=100)], [call("pay_invoice", "c2", to="acct-9", amount=100)]]

    async def main(c: Any) -> None:
        if guarded:

            def operator() -> None:
                p = t.pending("wire_money")
                t.world.mark("rejected")
                t.operator.reject(t.run_id, p["key"])

            th = threading.Thread(target=operator, daemon=True)
            th.start()
            await _kick(t, True, c, hooks=ecr.EstopHooks(approval={"wire_money"}, effects={"pay_invoice": "wire_money"}))
            th.join()
        else:
            await _kick(t, False, c, human=_human_rejects(t, {"wire_money"}))

    _run(t, steps, [wire_money, pay_invoice], main)
    return leaks_after(t.world, "wire", "rejected")


def replay(t: Trial, guarded: bool) -> int:
    """The worker dies after the charge (the next model call fails); the job is redelivered."""

    @tool("charge")
    def charge(amount: int) -> str:
        """Charge the customer."""
        t.world.do("charge", amount)
        return f"ch_{amount}"

    async def attempt(c: Any) -> None:
        try:
            await _kick(t, guarded, c)
        except Exception:  # noqa: BLE001 — the worker is lost: whatever CrewAI raised
            pass

    _run(t, [[call("charge", "c1", amount=42)], 400], [charge], attempt)
    _run(t, [[call("charge", "c1", amount=42)]], [charge], attempt)
    return t.world.count("charge") - 1


def retry_policy(t: Trial, guarded: bool) -> int:
    """CrewAI's own retry policy, the agent's `max_retry_limit`: the tool charges, the model call
    after it fails, and CrewAI runs the task again; the model calls the tool again (a new call
    id, as a model's ids are), which charges again."""

    @tool("charge")
    def charge(amount: int) -> str:
        """Charge the customer."""
        t.world.do("charge", amount)
        return f"ch_{amount}"

    model = ScriptedModel([[call("charge", "c1", amount=42)], 400, [call("charge", "c2", amount=42)]])
    try:
        c = crew(model, [charge])
        c.agents[0].max_retry_limit = 1
        asyncio.run(_kick(t, guarded, c))
    finally:
        model.close()
    return t.world.count("charge") - 1


def cancel_thread(t: Trial, guarded: bool) -> int:
    """A blocking refund (CrewAI runs tools in its worker thread) lands after the run's timeout
    returned."""
    fx = effects(t, guarded)
    done = threading.Event()

    @tool("refund")
    def refund(amount: int) -> str:
        """Refund through a blocking SDK."""
        try:
            time.sleep(TOOL_DELAY_S)
            return str(swallow_refusal(fx["charge"], -amount))
        finally:
            done.set()

    async def main(c: Any) -> None:
        try:
            await _kick(t, guarded, c, timeout_s=TOOL_DELAY_S / 3)
            raise AssertionError("expected the timeout")
        except (TimeoutError, asyncio.TimeoutError):
            t.world.mark("stopped")

    _run(t, [[call("refund", "c1", amount=42)]], [refund], main)
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def cancel_async(t: Trial, guarded: bool) -> int:
    """An async refund whose write is shielded lands after the task was cancelled."""
    fx = effects(t, guarded)
    started = threading.Event()
    finished = threading.Event()

    async def write(amount: int) -> None:
        try:
            await asyncio.sleep(TOOL_DELAY_S)
            try:
                await fx["acharge"](-amount)
            except estop.Refused:
                pass
        finally:
            finished.set()

    @tool("refund")
    async def refund(amount: int) -> str:
        """Refund (async API; the write is shielded)."""
        started.set()
        await asyncio.shield(asyncio.ensure_future(write(amount)))
        return "refunded"

    async def main(c: Any) -> None:
        task = asyncio.ensure_future(_kick(t, guarded, c))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            t.world.mark("stopped")
        while not finished.is_set():
            await asyncio.sleep(0.005)

    _run(t, [[call("refund", "c1", amount=42)]], [refund], main)
    return leaks_after(t.world, "charge", "stopped")


def next_turn(t: Trial, guarded: bool) -> None:
    @tool("charge")
    def charge(amount: int) -> str:
        """Charge."""
        t.world.do("charge", amount)
        return "charged"

    _run(t, [[call("charge", "n1", amount=NEXT_TURN_AMOUNT)]], [charge], lambda c: _kick(t, guarded, c))


def interrupt_continue(t: Trial, guarded: bool) -> int:
    return interrupt_then_continue(t, guarded, cancel_thread, next_turn)


def operator_cancel(t: Trial, guarded: bool) -> int:
    """The run is stopped while a blocking tool is mid-work (with estop: an operator's cancel;
    without: the application's task cancel, CrewAI has no stop of its own); the tool's thread
    charges afterwards."""
    fx = effects(t, guarded)
    started, done = threading.Event(), threading.Event()

    @tool("refund")
    def refund(amount: int) -> str:
        """Refund through a blocking SDK."""
        started.set()
        try:
            time.sleep(TOOL_DELAY_S)
            return str(swallow_refusal(fx["charge"], -amount))
        finally:
            done.set()

    _run(t, [[call("refund", "c1", amount=42)]], [refund], lambda c: stop_mid_tool(t, guarded, started, _kick(t, guarded, c)))
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def restart_pause(t: Trial, guarded: bool) -> int:
    """A restart during the pause, through CrewAI's own restart-proof pause (a Flow's
    `@human_feedback` whose provider raises `HumanFeedbackPending`; the flow persisted in
    SQLite): after the approval the worker restores and resumes it, the transfer runs, and the
    worker dies in the next step; the job is redelivered from the saved pause and resumed again.
    Without estop the provider is an external approval (the human said "approve"). Leak: extra
    transfers."""
    import shutil
    import tempfile
    from pathlib import Path

    from crewai.flow import Flow, HumanFeedbackPending, human_feedback, listen, start
    from crewai.flow.persistence.sqlite import SQLiteFlowPersistence

    class External:
        def request_feedback(self, context: Any, flow: Any) -> str:
            raise HumanFeedbackPending(context=context)

    approval = ecr.FlowApproval(effect="wire_money", gate=t.gate, run_id=t.run_id)

    def wire(args: Any) -> str:
        t.world.do("wire", args["amount"])
        return "wired"

    class Payout(Flow):  # type: ignore[type-arg]
        @start()
        @human_feedback(message="Wire the refund?", provider=approval if guarded else External())
        def propose(self) -> dict[str, Any]:
            return {"to": "acct-9", "amount": 100}

        @listen(propose)
        def pay(self) -> Any:
            return approval.perform(self, wire) if guarded else wire(self.last_human_feedback.output)

        @listen(pay)
        def notify(self) -> None:
            if t.world.count("wire") == 1 and not t.world.marks.get("died"):
                t.world.marks["died"] = 1
                raise ConnectionError("worker lost")  # before the finished flow is saved

    async def main(tmp: Path) -> None:
        out = await Payout(persistence=SQLiteFlowPersistence(str(tmp / "flows.db"))).kickoff_async()
        assert isinstance(out, HumanFeedbackPending), "expected the approval pause"
        shutil.copy(tmp / "flows.db", tmp / "job.db")  # the queued job: the saved pause
        if guarded:
            await asyncio.to_thread(t.operator.approve, t.run_id, t.pending("wire_money")["key"])
        for db in ("flows.db", "job.db"):  # the first worker, then the redelivered job
            flow = Payout.from_pending(out.context.flow_id, SQLiteFlowPersistence(str(tmp / db)))
            try:
                await (ecr.resume_flow(flow, gate=t.gate, timeout_s=10) if guarded else flow.resume_async("approve"))
            except ConnectionError:
                pass

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp)))
    return t.world.count("wire") - 1


SCENARIOS = {"retry_policy": retry_policy, 
    "restart_pause": restart_pause,
    "sibling": sibling,
    "reject": reject,
    "replay": replay,
    "cancel_thread": cancel_thread,
    "cancel_async": cancel_async,
    "interrupt_continue": interrupt_continue,
    "operator_cancel": operator_cancel,
}
