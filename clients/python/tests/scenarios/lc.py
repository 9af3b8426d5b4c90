"""LangChain `create_agent`: the failure classes, without estop (LangChain's own
HumanInTheLoopMiddleware for approvals) and through estop.adapters.langchain, driven by
LangChain's fake chat model (no network).

No sibling row: LangChain's HumanInTheLoopMiddleware interrupts after the model call
(`after_model`), before any tool of the turn runs, so a parallel sibling does not run during the
approval (a trial script: 0 of 5 emails before the decision)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

import estop
from estop.adapters import langchain as elc

from .common import NEXT_TURN_AMOUNT, TOOL_DELAY_S, Trial, effects, interrupt_then_continue, leaks_after, stop_mid_tool, swallow_refusal


class Scripted(FakeMessagesListChatModel):
    """Answers model call i with responses[i] (the last one repeats)."""

    def bind_tools(self, tools: Any, **kw: Any) -> Any:
        return self


def calls(*specs: tuple[str, str, dict[str, Any]]) -> AIMessage:
    return AIMessage(content="", tool_calls=[{"name": n, "id": i, "args": a} for n, i, a in specs])


def _agent(t: Trial, turns: list[Any], tools: list[Any], guarded: bool, *, approval: set[str] = frozenset(), effects_map: dict[str, str] | None = None, saver: Any = None) -> Any:
    saver = saver or InMemorySaver()
    if guarded:
        mw: list[Any] = [elc.EstopMiddleware(approval=approval, effects=effects_map, on_hold="wait")]
    else:
        mw = [HumanInTheLoopMiddleware(interrupt_on={name: True for name in approval})] if approval else []
    graph = create_agent(Scripted(responses=turns), tools=tools, middleware=mw, checkpointer=saver)
    return elc.EstopAgent(graph, t.gate) if guarded else graph


def _cfg(t: Trial) -> dict[str, Any]:
    return {"configurable": {"thread_id": t.run_id}}


def reject(t: Trial, guarded: bool) -> int:
    """The human rejects the transfer; the model re-plans and pays the invoice instead (another
    tool, the same transfer, no approval flag)."""

    def transfer(to: str, amount: int) -> str:
        t.world.do("wire", amount)
        return "wired"

    @tool
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        return transfer(to, amount)

    @tool
    def pay_invoice(to: str, amount: int) -> str:
        """Pay an invoice (moves money too)."""
        return transfer(to, amount)

    turns = [calls(("wire_money", "c1", {"to": "acct-9", "amount": 100})), calls(("pay_invoice", "c2", {"to": "acct-9", "amount": 100})), AIMessage(content="done")]
    agent = _agent(t, turns, [wire_money, pay_invoice], guarded, approval={"wire_money"}, effects_map={"pay_invoice": "wire_money"})
    if guarded:

        def operator() -> None:
            p = t.pending("wire_money")
            t.world.mark("rejected")
            t.operator.reject(t.run_id, p["key"])

        th = threading.Thread(target=operator)
        th.start()
        agent.invoke({"messages": [("user", "pay")]}, _cfg(t))
        th.join()
    else:
        out = agent.invoke({"messages": [("user", "pay")]}, _cfg(t))
        assert "__interrupt__" in out, "expected LangChain's approval interrupt"
        t.world.mark("rejected")
        agent.invoke(Command(resume={"decisions": [{"type": "reject", "message": "no"}]}), _cfg(t))
    return leaks_after(t.world, "wire", "rejected")


def replay(t: Trial, guarded: bool) -> int:
    """The worker dies after the charge (the model call after it fails); the job is redelivered
    and the same turn runs again on another worker."""

    @tool
    def charge(amount: int) -> str:
        """Charge the customer."""
        t.world.do("charge", amount)
        return f"ch_{amount}"

    class Lost(Scripted):
        def _generate(self, messages: Any, *a: Any, **kw: Any) -> Any:
            if self.i == 1:
                raise ConnectionError("worker lost")
            return super()._generate(messages, *a, **kw)

    for model in (Lost, Scripted):
        turns = [calls(("charge", "c1", {"amount": 42})), AIMessage(content="done")]
        graph = create_agent(model(responses=turns), tools=[charge], middleware=[elc.EstopMiddleware()] if guarded else [], checkpointer=InMemorySaver())
        agent = elc.EstopAgent(graph, t.gate) if guarded else graph
        try:
            agent.invoke({"messages": [("user", "charge order 42")]}, _cfg(t))
        except ConnectionError:
            pass
    return t.world.count("charge") - 1


class DyingSaver(InMemorySaver):
    """The durable checkpoint store both workers share. A worker that died (`dead`) saves
    nothing more: what it did after dying is lost, as with a killed process."""

    dead = False

    def put(self, config: Any, *a: Any, **kw: Any) -> Any:
        return config if self.dead else super().put(config, *a, **kw)

    def put_writes(self, *a: Any, **kw: Any) -> None:
        if not self.dead:
            super().put_writes(*a, **kw)


def restart_pause(t: Trial, guarded: bool) -> int:
    """A restart during the pause (see common.EXTRA_CLASSES): the approval is LangChain's
    `HumanInTheLoopMiddleware` interrupt (with estop: estop's hold, the same `interrupt()`), saved
    by the checkpointer; after the approval worker A resumes, the transfer runs and the worker
    dies right after it (nothing after is saved; its next model call fails); the job is redelivered and worker B resumes the same
    thread from the saved pause."""

    saver = DyingSaver()
    crash = [True]

    @tool
    def wire_money(to: str, amount: int) -> str:
        """Wire money."""
        t.world.do("wire", amount)
        if crash:
            saver.dead = crash.pop()  # worker A dies right after the transfer
        return "wired"

    class Lost(Scripted):
        def _generate(self, messages: Any, *a: Any, **kw: Any) -> Any:
            if saver.dead:
                raise ConnectionError("worker lost")
            return super()._generate(messages, *a, **kw)
    turns = [calls(("wire_money", "w1", {"to": "acct-9", "amount": 100}))]

    def worker(responses: list[Any]) -> Any:
        if guarded:
            mw: list[Any] = [elc.EstopMiddleware(approval={"wire_money"})]
        else:
            mw = [HumanInTheLoopMiddleware(interrupt_on={"wire_money": True})]
        graph = create_agent(Lost(responses=responses), tools=[wire_money], middleware=mw, checkpointer=saver)
        return elc.EstopAgent(graph, t.gate) if guarded else graph

    cfg = _cfg(t)
    out = worker(turns).invoke({"messages": [("user", "pay")]}, cfg)
    assert "__interrupt__" in out, "expected the approval pause"
    approve = {"decisions": [{"type": "approve"}]}
    if guarded:
        t.operator.approve(t.run_id, t.pending("wire_money")["key"])
    for _ in range(2):  # worker A (dies saving), then worker B (the job redelivered)
        w = worker([AIMessage(content="done")])
        try:
            w.resume(cfg) if guarded else w.invoke(Command(resume=approve), cfg)
        except ConnectionError:
            saver.dead = False  # the next worker saves again
    return t.world.count("wire") - 1


def cancel_thread(t: Trial, guarded: bool) -> int:
    """A blocking refund in ToolNode's worker thread lands after the run's timeout returned."""
    fx = effects(t, guarded)
    done = threading.Event()

    @tool
    def refund(amount: int) -> str:
        """Refund through a blocking SDK."""
        try:
            time.sleep(TOOL_DELAY_S)
            return str(swallow_refusal(fx["charge"], -amount))
        finally:
            done.set()

    agent = _agent(t, [calls(("refund", "c1", {"amount": 42})), AIMessage(content="done")], [refund], guarded)

    async def main() -> None:
        try:
            await asyncio.wait_for(agent.ainvoke({"messages": [("user", "refund")]}, _cfg(t)), TOOL_DELAY_S / 3)
            raise AssertionError("expected the timeout")
        except (TimeoutError, asyncio.TimeoutError):
            t.world.mark("stopped")

    asyncio.run(main())
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def operator_cancel(t: Trial, guarded: bool) -> int:
    """The run is stopped while a sync tool is mid-work in ToolNode's thread (LangChain has no
    stop of its own: without estop the application's task cancel around `ainvoke`)."""
    fx = effects(t, guarded)
    started, done = threading.Event(), threading.Event()

    @tool
    def refund(amount: int) -> str:
        """Refund through a blocking SDK."""
        started.set()
        try:
            time.sleep(TOOL_DELAY_S)
            return str(swallow_refusal(fx["charge"], -amount))
        finally:
            done.set()

    agent = _agent(t, [calls(("refund", "c1", {"amount": 42})), AIMessage(content="done")], [refund], guarded)
    asyncio.run(stop_mid_tool(t, guarded, started, agent.ainvoke({"messages": [("user", "refund")]}, _cfg(t))))
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

    @tool
    async def refund(amount: int) -> str:
        """Refund (async API; the write is shielded)."""
        started.set()
        await asyncio.shield(asyncio.ensure_future(write(amount)))
        return "refunded"

    agent = _agent(t, [calls(("refund", "c1", {"amount": 42})), AIMessage(content="done")], [refund], guarded)

    async def main() -> None:
        task = asyncio.ensure_future(agent.ainvoke({"messages": [("user", "refund")]}, _cfg(t)))
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
    """LangChain's own retry policy, `ToolRetryMiddleware`: a checkout tool charges (an
    `@estop.effect` with estop), then the shipping API flakes; the middleware runs the tool again
    (the same request), which charges again. With estop the middleware is listed after
    `EstopMiddleware` (inside estop's gated call: the retry re-runs the tool, whose charge
    presents the first run's key and reads its receipt)."""
    from langchain.agents.middleware import ToolRetryMiddleware

    fx = effects(t, guarded)
    attempts: list[str] = []

    @tool
    def checkout(amount: int) -> str:
        """Charge the order, then book the shipping."""
        receipt = fx["charge"](amount)
        attempts.append(receipt)
        if len(attempts) == 1:
            raise ConnectionError("the shipping API flaked after the charge")
        return receipt

    retry = ToolRetryMiddleware(max_retries=2, retry_on=(ConnectionError,), initial_delay=0.01, jitter=False)
    mw: list[Any] = [retry]
    if guarded:
        gate_mw = elc.EstopMiddleware()
        mw = [gate_mw, retry]
    graph = create_agent(Scripted(responses=[calls(("checkout", "c1", {"amount": 42})), AIMessage(content="done")]), tools=[checkout], middleware=mw, checkpointer=InMemorySaver())
    agent = elc.EstopAgent(graph, t.gate) if guarded else graph
    agent.invoke({"messages": [("user", "check out order 42")]}, _cfg(t))
    assert len(attempts) == 2, f"expected the middleware to retry once, got {len(attempts)} attempts"
    return t.world.count("charge") - 1


def next_turn(t: Trial, guarded: bool) -> None:
    @tool
    def charge(amount: int) -> str:
        """Charge."""
        t.world.do("charge", amount)
        return "charged"

    agent = _agent(t, [calls(("charge", "n1", {"amount": NEXT_TURN_AMOUNT})), AIMessage(content="ok")], [charge], guarded)
    agent.invoke({"messages": [("user", "charge")]}, _cfg(t))


def interrupt_continue(t: Trial, guarded: bool) -> int:
    return interrupt_then_continue(t, guarded, cancel_thread, next_turn)


SCENARIOS = {"retry_policy": retry_policy, "restart_pause": restart_pause, "operator_cancel": operator_cancel, "reject": reject, "replay": replay, "cancel_thread": cancel_thread, "cancel_async": cancel_async, "interrupt_continue": interrupt_continue}
