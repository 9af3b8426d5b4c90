"""Microsoft Agent Framework: the five failure classes, without estop and through
estop.adapters.agent_framework, driven by a scripted chat client (no network)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from agent_framework import Agent, AgentExecutor, BaseChatClient, ChatResponse, Content, Executor, Message, WorkflowBuilder, WorkflowContext, handler, tool
from agent_framework._middleware import ChatMiddlewareLayer
from agent_framework._tools import FunctionInvocationLayer

from estop.adapters import agent_framework as eaf

from .common import DECIDE_AFTER_S, NEXT_TURN_AMOUNT, SIBLING_WORK_S, TOOL_DELAY_S, Trial, aswallow_refusal, effects, interrupt_then_continue, leaks_after, stop_mid_tool, swallow_refusal


class ScriptedChatClient(FunctionInvocationLayer, ChatMiddlewareLayer, BaseChatClient):
    """Answers model call i with steps[i]: a list of Contents, or an exception to raise."""

    def __init__(self, steps: list[Any], **kw: Any) -> None:
        super().__init__(**kw)
        self.steps = list(steps)

    async def _inner_get_response(self, *, messages: Any, stream: bool, options: Any, **kwargs: Any) -> ChatResponse:
        assert not stream
        step = self.steps.pop(0) if self.steps else [Content.from_text("done")]
        if isinstance(step, BaseException):
            raise step
        return ChatResponse(messages=[Message(role="assistant", contents=step)], response_id="scripted")


def call(name: str, call_id: str, **args: Any) -> Content:
    return Content.from_function_call(call_id=call_id, name=name, arguments=args)


def _agent(steps: list[Any], tools: list[Any], guarded: bool, effects_map: dict[str, str] | None = None, on_hold: str = "pause") -> Agent:
    if guarded:
        return Agent(client=ScriptedChatClient(steps), tools=eaf.gate_tools(tools), middleware=eaf.middleware(effects=effects_map, on_hold=on_hold))
    return Agent(client=ScriptedChatClient(steps), tools=tools)


async def _reject_all(agent: Agent, session: Any, response: Any) -> Any:
    reqs = list(response.user_input_requests)
    return await agent.run(Message(role="user", contents=[r.to_function_approval_response(False) for r in reqs]), session=session)


class _Start(Executor):
    @handler
    async def start(self, msg: str, ctx: WorkflowContext[str]) -> None:
        await ctx.send_message(msg)


def sibling(t: Trial, guarded: bool) -> int:
    """Two agents of one workflow run in parallel branches (fan-out): the payer's transfer needs
    approval, the notifier sends an email. (Within one agent's turn, Agent Framework already turns
    every call of a batch into an approval request when one needs it — no leak there; across the
    branches of a workflow it leaks.)"""
    fx = effects(t, guarded)

    @tool(approval_mode="always_require")
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        t.world.do("wire", amount)
        return "wired"

    @tool
    def notify(to: str) -> str:
        """Tell someone."""
        time.sleep(SIBLING_WORK_S)
        return swallow_refusal(fx["send_email"], to)

    # In a workflow the held call waits in its branch (on_hold="wait"): the hold of the payer's
    # branch is what must hold the notifier's.
    payer = _agent([[call("wire_money", "c1", to="acct-9", amount=100)]], [wire_money], guarded, on_hold="wait")
    notifier = _agent([[call("notify", "c2", to="ops@example.com")]], [notify], guarded, on_hold="wait")
    payer.name, notifier.name = "payer", "notifier"
    start = _Start(id="start")
    wf = WorkflowBuilder(start_executor=start).add_fan_out_edges(start, [AgentExecutor(payer), AgentExecutor(notifier)]).build()

    async def main() -> None:
        if guarded:
            th = t.decide_later("reject", tool="wire_money")
            await eaf.run_workflow(wf, "go", gate=t.gate, run_id=t.run_id)
            th.join()
            assert t.world.count("email") == 1, "the sibling proceeds once the decision is made"
        else:
            result = await wf.run("go")
            assert result.get_request_info_events(), "expected the payer's approval request"
            await asyncio.sleep(DECIDE_AFTER_S)
            t.world.mark("decided")

    asyncio.run(main())
    return t.world.count("email", before=t.world.marks["decided"])


def reject(t: Trial, guarded: bool) -> int:
    def transfer(to: str, amount: int) -> str:
        t.world.do("wire", amount)
        return "wired"

    @tool(approval_mode="always_require")
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        return transfer(to, amount)

    @tool
    def pay_invoice(to: str, amount: int) -> str:
        """Pay an invoice (moves money too; nobody flagged it for approval)."""
        return transfer(to, amount)

    steps = [[call("wire_money", "c1", to="acct-9", amount=100)], [call("pay_invoice", "c2", to="acct-9", amount=100)]]
    agent = _agent(steps, [wire_money, pay_invoice], guarded, effects_map={"pay_invoice": "wire_money"})

    async def main() -> None:
        if guarded:
            def operator() -> None:
                p = t.pending("wire_money")
                t.world.mark("rejected")
                t.operator.reject(t.run_id, p["key"])

            # The held transfer is the framework's own pause (an approval request); the operator's
            # reject in estop is what answers it.
            th = threading.Thread(target=operator)
            th.start()
            session = agent.create_session()
            r = await eaf.run(agent, "go", gate=t.gate, run_id=t.run_id, session=session)
            answers = await eaf.resolve(r.user_input_requests, gate=t.gate, run_id=t.run_id, timeout_s=10)
            th.join()
            await eaf.run(agent, Message(role="user", contents=answers), gate=t.gate, run_id=t.run_id, session=session)
        else:
            session = agent.create_session()
            r = await agent.run("go", session=session)
            t.world.mark("rejected")
            await _reject_all(agent, session, r)

    asyncio.run(main())
    return leaks_after(t.world, "wire", "rejected")


def replay(t: Trial, guarded: bool) -> int:
    @tool
    def charge(amount: int) -> str:
        """Charge the customer."""
        t.world.do("charge", amount)
        return f"ch_{amount}"

    async def attempt(steps: list[Any]) -> None:
        agent = _agent(steps, [charge], guarded)
        try:
            if guarded:
                await eaf.run(agent, "charge order 42", gate=t.gate, run_id=t.run_id)
            else:
                await agent.run("charge order 42")
        except Exception:
            pass

    asyncio.run(attempt([[call("charge", "c1", amount=42)], ConnectionError("worker lost")]))  # dies after the charge
    asyncio.run(attempt([[call("charge", "c1", amount=42)]]))  # the job is redelivered
    return t.world.count("charge") - 1


def restart_pause(t: Trial, guarded: bool) -> int:
    """A restart during the pause (see common.EXTRA_CLASSES): the session and its approval
    request are saved; after the approval the worker resumes, transfers and dies before saving;
    the job is redelivered from the saved pause."""
    import json

    from agent_framework import AgentSession

    @tool(approval_mode="always_require")
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        t.world.do("wire", amount)
        return "wired"

    async def resume(saved: str, steps: list[Any]) -> None:
        data = json.loads(saved)
        agent = _agent(steps, [wire_money], guarded)
        session = AgentSession.from_dict(data["session"])
        requests = [Content.from_dict(d) for d in data["requests"]]
        try:
            if guarded:
                answers = await eaf.resolve(requests, gate=t.gate, run_id=t.run_id, timeout_s=10)
                await eaf.run(agent, Message(role="user", contents=answers), gate=t.gate, run_id=t.run_id, session=session)
            else:  # the human approved (the answer is in the saved job)
                await agent.run(Message(role="user", contents=[r.to_function_approval_response(True) for r in requests]), session=session)
        except ConnectionError:
            pass

    async def main() -> None:
        agent = _agent([[call("wire_money", "w1", to="acct-9", amount=100)]], [wire_money], guarded)
        session = agent.create_session()
        r = await (eaf.run(agent, "pay", gate=t.gate, run_id=t.run_id, session=session) if guarded else agent.run("pay", session=session))
        assert r.user_input_requests, "expected the approval pause"
        saved = json.dumps({"session": session.to_dict(), "requests": [q.to_dict() for q in r.user_input_requests]})
        if guarded:
            await asyncio.to_thread(t.operator.approve, t.run_id, t.pending("wire_money")["key"])
        await resume(saved, [ConnectionError("worker lost")])
        await resume(saved, [[Content.from_text("done")]])

    asyncio.run(main())
    return t.world.count("wire") - 1


def cancel_thread(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)
    done = threading.Event()

    def slow_refund(amount: int) -> str:
        try:
            time.sleep(TOOL_DELAY_S)
            return swallow_refusal(fx["charge"], -amount)
        finally:
            done.set()

    @tool
    async def refund(amount: int) -> str:
        """Refund through a blocking SDK, run in a worker thread."""
        return await asyncio.to_thread(slow_refund, amount)

    agent = _agent([[call("refund", "c1", amount=42)]], [refund], guarded)

    async def main() -> None:
        try:
            if guarded:
                await eaf.run(agent, "refund", gate=t.gate, run_id=t.run_id, timeout_s=TOOL_DELAY_S / 3)
            else:
                await asyncio.wait_for(agent.run("refund"), TOOL_DELAY_S / 3)
            raise AssertionError("expected the timeout")
        except (TimeoutError, asyncio.TimeoutError):
            t.world.mark("stopped")

    asyncio.run(main())
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def operator_cancel(t: Trial, guarded: bool) -> int:
    """The run is stopped while a blocking refund runs in a worker thread (Agent Framework has
    no stop of its own: without estop the application's task cancel)."""
    fx = effects(t, guarded)
    started, done = threading.Event(), threading.Event()

    def slow_refund(amount: int) -> str:
        started.set()
        try:
            time.sleep(TOOL_DELAY_S)
            return swallow_refusal(fx["charge"], -amount)
        finally:
            done.set()

    @tool
    async def refund(amount: int) -> str:
        """Refund through a blocking SDK, run in a worker thread."""
        return await asyncio.to_thread(slow_refund, amount)

    agent = _agent([[call("refund", "c1", amount=42)]], [refund], guarded)

    async def run() -> Any:
        return await (eaf.run(agent, "refund", gate=t.gate, run_id=t.run_id) if guarded else agent.run("refund"))

    asyncio.run(stop_mid_tool(t, guarded, started, run()))
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def cancel_async(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)
    started = threading.Event()
    finished = threading.Event()

    async def write(amount: int) -> None:
        try:
            await asyncio.sleep(TOOL_DELAY_S)
            await aswallow_refusal(fx["acharge"], -amount)
        finally:
            finished.set()

    @tool
    async def refund(amount: int) -> str:
        """Refund (async API; the write is shielded so it is never half-done)."""
        started.set()
        await asyncio.shield(asyncio.ensure_future(write(amount)))
        return "refunded"

    agent = _agent([[call("refund", "c1", amount=42)]], [refund], guarded)

    async def main() -> None:
        coro = eaf.run(agent, "refund", gate=t.gate, run_id=t.run_id) if guarded else agent.run("refund")
        task = asyncio.ensure_future(coro)
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


def next_turn(t: Trial, guarded: bool) -> None:
    """The next turn of the same conversation (run id): the model charges."""

    @tool
    def charge(amount: int) -> str:
        """Charge."""
        t.world.do("charge", amount)
        return "charged"

    agent = _agent([[call("charge", "n1", amount=NEXT_TURN_AMOUNT)]], [charge], guarded)
    asyncio.run(eaf.run(agent, "charge", gate=t.gate, run_id=t.run_id) if guarded else agent.run("charge"))


def interrupt_continue(t: Trial, guarded: bool) -> int:
    return interrupt_then_continue(t, guarded, cancel_thread, next_turn)


SCENARIOS = {"operator_cancel": operator_cancel, "restart_pause": restart_pause, "sibling": sibling, "reject": reject, "replay": replay, "cancel_thread": cancel_thread, "cancel_async": cancel_async, "interrupt_continue": interrupt_continue}
