"""Google ADK: the failure classes, without estop (ADK's own tool confirmation for approvals) and
through estop.adapters.google_adk, driven by a scripted model (no network)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from google.adk.sessions import InMemorySessionService
from google.adk.tools import FunctionTool
from google.genai import types

import estop
from estop.adapters import google_adk as eadk

from .adk_support import ScriptedLlm, call, runner, user
from .common import DECIDE_AFTER_S, NEXT_TURN_AMOUNT, SIBLING_WORK_S, TOOL_DELAY_S, Trial, effects, interrupt_then_continue, leaks_after, stop_mid_tool, swallow_refusal


def _runner(t: Trial, guarded: bool, steps: list[Any], tools: list[Any], *, approval: set[str] = frozenset(), effects_map: dict[str, str] | None = None, **kw: Any) -> Any:
    if guarded:
        return runner(steps, tools, [eadk.EstopPlugin(approval=approval, effects=effects_map)], **kw)
    return runner(steps, [FunctionTool(f, require_confirmation=True) if f.__name__ in approval else f for f in tools], [], **kw)


async def _go(t: Trial, guarded: bool, r: Any, message: Any, session: Any = None, **kw: Any) -> tuple[list[Any], Any]:
    s = session or await r.session_service.create_session(app_name="ops", user_id="u")
    if guarded:
        return await eadk.run(r, gate=t.gate, run_id=t.run_id, user_id="u", session_id=s.id, new_message=message, **kw), s
    return [ev async for ev in r.run_async(user_id="u", session_id=s.id, new_message=message)], s


def _answer(events: list[Any], confirmed: bool) -> types.Content:
    confs = [p.function_call for ev in events if ev.content for p in ev.content.parts or [] if p.function_call and p.function_call.name == eadk.CONFIRMATION]
    return types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(name=eadk.CONFIRMATION, id=c.id, response={"confirmed": confirmed})) for c in confs])


def sibling(t: Trial, guarded: bool) -> int:
    """One turn: a transfer that needs approval and an email (50 ms of work first). ADK pauses
    the transfer for its confirmation and runs the email at once."""
    fx = effects(t, guarded)

    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        t.world.do("wire", amount)
        return "wired"

    def notify(to: str) -> str:
        """Tell someone."""
        time.sleep(SIBLING_WORK_S)
        return str(swallow_refusal(fx["send_email"], to))

    async def anotify(to: str) -> str:
        """Tell someone."""
        return await asyncio.to_thread(notify, to)

    anotify.__name__ = "notify"
    turn = [call("wire_money", "w1", to="acct-9", amount=100), call("notify", "n1", to="ops@example.com")]
    r = _runner(t, guarded, [turn], [wire_money, anotify], approval={"wire_money"})

    async def main() -> None:
        if guarded:
            th = t.decide_later("reject", tool="wire_money")
            await _go(t, guarded, r, user("pay and tell"))
            th.join()
            return
        await _go(t, guarded, r, user("pay and tell"))
        await asyncio.sleep(DECIDE_AFTER_S)  # the human decides after the request
        t.world.mark("decided")

    asyncio.run(main())
    return t.world.count("email", before=t.world.marks["decided"])


def reject(t: Trial, guarded: bool) -> int:
    """The human rejects the transfer; the model re-plans and pays the invoice instead."""

    def transfer(to: str, amount: int) -> str:
        t.world.do("wire", amount)
        return "wired"

    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        return transfer(to, amount)

    def pay_invoice(to: str, amount: int) -> str:
        """Pay an invoice (moves money too)."""
        return transfer(to, amount)

    steps = [[call("wire_money", "w1", to="acct-9", amount=100)], [call("pay_invoice", "c2", to="acct-9", amount=100)]]
    r = _runner(t, guarded, steps, [wire_money, pay_invoice], approval={"wire_money"}, effects_map={"pay_invoice": "wire_money"})

    async def main() -> None:
        evs, s = await _go(t, guarded, r, user("pay"))
        if guarded:
            p = await asyncio.to_thread(t.pending, "wire_money")
            t.world.mark("rejected")
            await asyncio.to_thread(t.operator.reject, t.run_id, p["key"])
            answers = types.Content(role="user", parts=await eadk.resolve(evs, gate=t.gate, run_id=t.run_id, timeout_s=10))
        else:
            t.world.mark("rejected")
            answers = _answer(evs, False)
        await _go(t, guarded, r, answers, s)

    asyncio.run(main())
    return leaks_after(t.world, "wire", "rejected")


def replay(t: Trial, guarded: bool) -> int:
    """The worker dies after the charge (the next model call fails); the job is redelivered."""

    def charge(amount: int) -> str:
        """Charge the customer."""
        t.world.do("charge", amount)
        return f"ch_{amount}"

    async def attempt(steps: list[Any]) -> None:
        try:
            await _go(t, guarded, _runner(t, guarded, steps, [charge]), user("charge order 42"))
        except ConnectionError:
            pass

    asyncio.run(attempt([[call("charge", "c1", amount=42)], ConnectionError("worker lost")]))
    asyncio.run(attempt([[call("charge", "c1", amount=42)]]))
    return t.world.count("charge") - 1


def cancel_thread(t: Trial, guarded: bool) -> int:
    """A blocking refund in a worker thread lands after the run's timeout returned."""
    fx = effects(t, guarded)
    done = threading.Event()

    def slow_refund(amount: int) -> str:
        try:
            time.sleep(TOOL_DELAY_S)
            return str(swallow_refusal(fx["charge"], -amount))
        finally:
            done.set()

    async def refund(amount: int) -> str:
        """Refund through a blocking SDK, run in a worker thread."""
        return await asyncio.to_thread(slow_refund, amount)

    r = _runner(t, guarded, [[call("refund", "c1", amount=42)]], [refund])

    async def main() -> None:
        try:
            if guarded:
                await _go(t, guarded, r, user("refund"), timeout_s=TOOL_DELAY_S / 3)
            else:
                await asyncio.wait_for(_go(t, guarded, r, user("refund")), TOOL_DELAY_S / 3)
            raise AssertionError("expected the timeout")
        except (TimeoutError, asyncio.TimeoutError):
            t.world.mark("stopped")

    asyncio.run(main())
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


class DyingSessions(InMemorySessionService):  # type: ignore[misc]
    """The durable session store both workers share. A worker that died (`dead`) saves nothing
    more: what it did after dying is lost, as with a killed process."""

    dead = False

    async def append_event(self, session: Any, event: Any) -> Any:
        return event if self.dead else await super().append_event(session, event)


def restart_pause(t: Trial, guarded: bool) -> int:
    """A restart during the pause (see common.EXTRA_CLASSES): the approval is ADK's tool
    confirmation (with estop: estop's hold, the same confirmation) saved in the session store;
    after the approval worker A sends the answer, the transfer runs and the worker dies right
    after it (nothing after is saved; its next model call fails); the job (the answer) is
    redelivered and worker B sends it again over the same session."""
    sessions = DyingSessions()
    crash = [True]

    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        t.world.do("wire", amount)
        if crash:
            sessions.dead = crash.pop()  # worker A dies right after the transfer
        return "wired"

    class Dying(ScriptedLlm):  # the model: fails once the worker died
        async def generate_content_async(self, llm_request: Any, stream: bool = False) -> Any:
            if sessions.dead:
                raise ConnectionError("worker lost")
            async for r in super().generate_content_async(llm_request, stream):
                yield r

    def worker(steps: list[Any]) -> Any:
        return _runner(t, guarded, steps, [wire_money], approval={"wire_money"}, sessions=sessions, llm=Dying)

    async def main() -> None:
        evs, s = await _go(t, guarded, worker([[call("wire_money", "w1", to="acct-9", amount=100)]]), user("pay"))
        if guarded:
            p = await asyncio.to_thread(t.pending, "wire_money")
            await asyncio.to_thread(t.operator.approve, t.run_id, p["key"])
            answers = types.Content(role="user", parts=await eadk.resolve(evs, gate=t.gate, run_id=t.run_id, timeout_s=10))
        else:
            answers = _answer(evs, True)  # the human approved (the answer is the saved job)
        assert answers.parts, "expected the approval pause"
        for _ in range(2):  # worker A (dies after the transfer), then worker B (redelivered)
            try:
                await _go(t, guarded, worker([]), answers, s)
            except ConnectionError:
                sessions.dead = False  # the next worker saves again

    asyncio.run(main())
    return t.world.count("wire") - 1


def operator_cancel(t: Trial, guarded: bool) -> int:
    """The run is stopped while a blocking refund runs in a worker thread (ADK has no stop of its
    own: without estop the application's task cancel around the run)."""
    fx = effects(t, guarded)
    started, done = threading.Event(), threading.Event()

    def slow_refund(amount: int) -> str:
        started.set()
        try:
            time.sleep(TOOL_DELAY_S)
            return str(swallow_refusal(fx["charge"], -amount))
        finally:
            done.set()

    async def refund(amount: int) -> str:
        """Refund through a blocking SDK, run in a worker thread."""
        return await asyncio.to_thread(slow_refund, amount)

    r = _runner(t, guarded, [[call("refund", "c1", amount=42)]], [refund])
    asyncio.run(stop_mid_tool(t, guarded, started, _go(t, guarded, r, user("refund"))))
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

    async def refund(amount: int) -> str:
        """Refund (async API; the write is shielded)."""
        started.set()
        await asyncio.shield(asyncio.ensure_future(write(amount)))
        return "refunded"

    r = _runner(t, guarded, [[call("refund", "c1", amount=42)]], [refund])

    async def main() -> None:
        task = asyncio.ensure_future(_go(t, guarded, r, user("refund")))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            t.world.mark("stopped")
        while not finished.is_set():
            await asyncio.sleep(0.005)

    asyncio.run(main())
    return leaks_after(t.world, "charge", "stopped")


def retry_policy(t: Trial, guarded: bool) -> int:
    """ADK's own retry policy, `ReflectAndRetryToolPlugin`: a checkout tool charges (an
    `@estop.effect` with estop), then the shipping API flakes; the plugin turns the error into
    retry guidance for the model, which calls the tool again (the same arguments, a new call id)."""
    from google.adk.plugins import ReflectAndRetryToolPlugin

    fx = effects(t, guarded)
    attempts: list[str] = []

    def checkout(amount: int) -> str:
        """Charge the order, then book the shipping."""
        receipt = str(fx["charge"](amount))
        attempts.append(receipt)
        if len(attempts) == 1:
            raise ConnectionError("the shipping API flaked after the charge")
        return receipt

    retry = ReflectAndRetryToolPlugin(max_retries=2)
    plugins: list[Any] = [eadk.EstopPlugin(), retry] if guarded else [retry]
    turns = [[call("checkout", "c1", amount=42)], [call("checkout", "c2", amount=42)]]
    r = runner(turns, [checkout], plugins)

    async def main() -> None:
        await _go(t, guarded, r, user("check out order 42"))

    asyncio.run(main())
    assert len(attempts) == 2, f"expected the model to retry the call once, got {len(attempts)} runs"
    return t.world.count("charge") - 1


def next_turn(t: Trial, guarded: bool) -> None:
    def charge(amount: int) -> str:
        """Charge."""
        t.world.do("charge", amount)
        return "charged"

    asyncio.run(_go(t, guarded, _runner(t, guarded, [[call("charge", "n1", amount=NEXT_TURN_AMOUNT)]], [charge]), user("charge")))


def interrupt_continue(t: Trial, guarded: bool) -> int:
    return interrupt_then_continue(t, guarded, cancel_thread, next_turn)


SCENARIOS = {"retry_policy": retry_policy, "restart_pause": restart_pause, "operator_cancel": operator_cancel, "sibling": sibling, "reject": reject, "replay": replay, "cancel_thread": cancel_thread, "cancel_async": cancel_async, "interrupt_continue": interrupt_continue}
