"""PydanticAI: the five failure classes, without estop and through estop.adapters.pydantic_ai,
driven by PydanticAI's own FunctionModel (a scripted model, no network)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults, RunContext
from pydantic_ai.exceptions import RunCancelled
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from estop.adapters import pydantic_ai as ep

from .common import stop_mid_tool, DECIDE_AFTER_S, NEXT_TURN_AMOUNT, SIBLING_WORK_S, TOOL_DELAY_S, Trial, aswallow_refusal, effects, interrupt_then_continue, leaks_after, swallow_refusal


def _script(turns: list[Any]) -> FunctionModel:
    """A model that answers turn i with turns[i] (a list of parts, or an exception to raise)."""
    state = {"i": 0}

    def fn(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        i = state["i"]
        state["i"] += 1
        turn = turns[i] if i < len(turns) else [TextPart("done")]
        if isinstance(turn, BaseException):
            raise turn
        return ModelResponse(parts=turn)

    return FunctionModel(fn)


def _agent(turns: list[Any], guarded: bool, register: Callable[[Agent], None], effects_map: dict[str, str] | None = None) -> Agent:
    agent: Agent = Agent(_script(turns), output_type=[str, DeferredToolRequests])
    register(agent)
    if guarded:
        # The scenarios measure the gate's hold itself: the held call waits (on_hold="wait")
        # rather than ending the run with DeferredToolRequests.
        ep.gate_agent(agent, effects=effects_map, on_hold="wait")
    return agent


def sibling(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)

    def register(agent: Agent) -> None:
        @agent.tool_plain(requires_approval=True)
        def wire_money(to: str, amount: int) -> str:
            t.world.do("wire", amount)
            return "wired"

        @agent.tool_plain
        def notify(to: str) -> str:
            time.sleep(SIBLING_WORK_S)
            return swallow_refusal(fx["send_email"], to)

    turns = [[ToolCallPart("wire_money", {"to": "acct-9", "amount": 100}, tool_call_id="c1"), ToolCallPart("notify", {"to": "ops@example.com"}, tool_call_id="c2")]]
    agent = _agent(turns, guarded, register)

    async def main() -> None:
        if guarded:
            th = t.decide_later("reject", tool="wire_money")
            await ep.run(agent, "go", gate=t.gate, run_id=t.run_id)
            th.join()
            assert t.world.count("email") == 1, "the sibling proceeds once the decision is made"
        else:
            r = await agent.run("go")
            assert isinstance(r.output, DeferredToolRequests)
            await asyncio.sleep(DECIDE_AFTER_S)
            t.world.mark("decided")
            await agent.run(message_history=r.all_messages(), deferred_tool_results=DeferredToolResults(approvals={"c1": False}))

    asyncio.run(main())
    return t.world.count("email", before=t.world.marks["decided"])


def reject(t: Trial, guarded: bool) -> int:
    def register(agent: Agent) -> None:
        @agent.tool_plain(requires_approval=True)
        def wire_money(to: str, amount: int) -> str:
            t.world.do("wire", amount)
            return "wired"

        @agent.tool_plain
        def pay_invoice(to: str, amount: int) -> str:
            """Moves money too; nobody flagged it for approval."""
            t.world.do("wire", amount)
            return "paid"

    turns = [
        [ToolCallPart("wire_money", {"to": "acct-9", "amount": 100}, tool_call_id="c1")],
        [ToolCallPart("pay_invoice", {"to": "acct-9", "amount": 100}, tool_call_id="c2")],
    ]
    agent = _agent(turns, guarded, register, effects_map={"pay_invoice": "wire_money"})

    async def main() -> None:
        if guarded:
            def operator() -> None:
                p = t.pending("wire_money")
                t.world.mark("rejected")
                t.operator.reject(t.run_id, p["key"])

            th = threading.Thread(target=operator)
            th.start()
            await ep.run(agent, "go", gate=t.gate, run_id=t.run_id)
            th.join()
        else:
            r = await agent.run("go")
            t.world.mark("rejected")
            await agent.run(message_history=r.all_messages(), deferred_tool_results=DeferredToolResults(approvals={"c1": False}))

    asyncio.run(main())
    return leaks_after(t.world, "wire", "rejected")


def replay(t: Trial, guarded: bool) -> int:
    def register(agent: Agent) -> None:
        @agent.tool_plain
        def charge(amount: int) -> str:
            t.world.do("charge", amount)
            return f"ch_{amount}"

    async def attempt(turns: list[Any]) -> None:
        agent = _agent(turns, guarded, register)
        try:
            if guarded:
                await ep.run(agent, "charge order 42", gate=t.gate, run_id=t.run_id)
            else:
                await agent.run("charge order 42")
        except ConnectionError:
            pass

    call = [ToolCallPart("charge", {"amount": 42}, tool_call_id="c1")]
    asyncio.run(attempt([call, ConnectionError("worker lost")]))  # dies after the charge
    asyncio.run(attempt([call]))  # the job is redelivered
    return t.world.count("charge") - 1


def restart_pause(t: Trial, guarded: bool) -> int:
    """A restart during the pause (see common.EXTRA_CLASSES): the approval is PydanticAI's
    deferred tool call (`requires_approval`; with estop: estop's hold deferred the same way,
    `on_hold="defer"`), saved as the message history; after the approval worker A resumes with
    `DeferredToolResults`, the transfer runs and the model call after it fails (the worker dies
    before it can save the finished run); the job is redelivered and worker B resumes again."""

    def worker(turns: list[Any]) -> Agent:
        agent: Agent = Agent(_script(turns), output_type=[str, DeferredToolRequests])

        @agent.tool_plain(requires_approval=not guarded)
        def wire_money(to: str, amount: int) -> str:
            t.world.do("wire", amount)
            return "wired"

        if guarded:
            ep.gate_agent(agent, on_hold="defer")
        return agent

    async def go(agent: Agent, prompt: str | None = None, **kw: Any) -> Any:
        return await (ep.run(agent, prompt, gate=t.gate, run_id=t.run_id, **kw) if guarded else agent.run(prompt, **kw))

    async def main() -> None:
        r = await go(worker([[ToolCallPart("wire_money", {"to": "acct-9", "amount": 100}, tool_call_id="w1")]]), "pay")
        assert isinstance(r.output, DeferredToolRequests), "expected the approval pause"
        saved = r.all_messages()  # the saved job: the history and (below) the approval
        if guarded:
            await asyncio.to_thread(t.operator.approve, t.run_id, t.pending("wire_money")["key"])
        ok = DeferredToolResults(approvals={"w1": True})
        for turns in ([ConnectionError("worker lost")], []):  # worker A dies, worker B
            try:
                await go(worker(turns), message_history=saved, deferred_tool_results=ok)
            except ConnectionError:
                pass

    asyncio.run(main())
    return t.world.count("wire") - 1


def cancel_thread(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)
    done = threading.Event()

    def register(agent: Agent) -> None:
        @agent.tool_plain
        def refund(amount: int) -> str:
            try:
                time.sleep(TOOL_DELAY_S)
                return swallow_refusal(fx["charge"], -amount)
            finally:
                done.set()

    agent = _agent([[ToolCallPart("refund", {"amount": 42}, tool_call_id="c1")]], guarded, register)

    async def main() -> None:
        try:
            if guarded:
                await ep.run(agent, "refund", gate=t.gate, run_id=t.run_id, timeout_s=TOOL_DELAY_S / 3)
            else:
                await asyncio.wait_for(agent.run("refund"), TOOL_DELAY_S / 3)
            raise AssertionError("expected the timeout")
        except (TimeoutError, asyncio.TimeoutError):
            t.world.mark("stopped")

    asyncio.run(main())
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def operator_cancel(t: Trial, guarded: bool) -> int:
    fx = effects(t, guarded)
    started, done = threading.Event(), threading.Event()

    def register(agent: Agent) -> None:
        @agent.tool_plain
        def refund(amount: int) -> str:
            started.set()
            try:
                time.sleep(TOOL_DELAY_S)
                return swallow_refusal(fx["charge"], -amount)
            finally:
                done.set()

    agent = _agent([[ToolCallPart("refund", {"amount": 42}, tool_call_id="c1")]], guarded, register)
    run = ep.run(agent, "refund", gate=t.gate, run_id=t.run_id) if guarded else agent.run("refund")
    asyncio.run(stop_mid_tool(t, guarded, started, run))
    done.wait(5)
    return leaks_after(t.world, "charge", "stopped")


def framework_cancel(t: Trial, guarded: bool) -> int:
    """PydanticAI's own stop, `RunContext.cancel()` (here from a second tool of the turn, a
    guard that stops the run once the refund started), while a sync tool is mid-work in its
    thread; the run ends with `RunCancelled`."""
    fx = effects(t, guarded)
    started, done = threading.Event(), threading.Event()

    def register(agent: Agent) -> None:
        @agent.tool_plain
        def refund(amount: int) -> str:
            started.set()
            try:
                time.sleep(TOOL_DELAY_S)
                return swallow_refusal(fx["charge"], -amount)
            finally:
                done.set()

        @agent.tool
        async def stop_run(ctx: RunContext[None]) -> str:
            while not started.is_set():
                await asyncio.sleep(0.005)
            ctx.cancel()
            await asyncio.sleep(1)  # the cancel arrives here
            return "not stopped"

    turn = [ToolCallPart("refund", {"amount": 42}, tool_call_id="c1"), ToolCallPart("stop_run", {}, tool_call_id="s1")]
    agent = _agent([turn], guarded, register)

    async def main() -> None:
        try:
            await (ep.run(agent, "refund", gate=t.gate, run_id=t.run_id) if guarded else agent.run("refund"))
            raise AssertionError("expected RunCancelled")
        except RunCancelled:
            t.world.mark("stopped")

    asyncio.run(main())
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

    def register(agent: Agent) -> None:
        @agent.tool_plain
        async def refund(amount: int) -> str:
            started.set()
            await asyncio.shield(asyncio.ensure_future(write(amount)))
            return "refunded"

    agent = _agent([[ToolCallPart("refund", {"amount": 42}, tool_call_id="c1")]], guarded, register)

    async def main() -> None:
        coro = ep.run(agent, "refund", gate=t.gate, run_id=t.run_id) if guarded else agent.run("refund")
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


def timeout_retry(t: Trial, guarded: bool) -> int:
    """The documented integration (`gate_agent`): the tool call is the effect."""
    threads = []

    def register(agent: Agent) -> None:
        @agent.tool_plain(timeout=TOOL_DELAY_S / 3, retries=3)
        def charge(amount: int) -> str:
            threads.append(1)
            try:
                time.sleep(TOOL_DELAY_S)  # a slow payment API: past PydanticAI's timeout
                t.world.do("charge", amount)
                return "ch_42"
            finally:
                threads.pop()

    call = lambda cid: [ToolCallPart("charge", {"amount": 42}, tool_call_id=cid)]  # noqa: E731
    agent = _agent([call("c1"), call("c2")], guarded, register)  # the model retries the charge
    asyncio.run(ep.run(agent, "charge", gate=t.gate, run_id=t.run_id) if guarded else agent.run("charge"))
    t.wait_for(lambda: not threads)  # every abandoned thread has finished
    return t.world.count("charge") - 1


def retry_policy(t: Trial, guarded: bool) -> int:
    """PydanticAI's own tool retry: a checkout tool charges (an `@estop.effect` with estop), then
    the shipping API flakes and the tool raises `ModelRetry`; PydanticAI asks the model to call
    it again (up to the tool's `retries`), and the model does (the same arguments, a new call id)."""
    from pydantic_ai import ModelRetry

    fx = effects(t, guarded)
    attempts: list[str] = []

    def register(agent: Agent) -> None:
        @agent.tool_plain(retries=2)
        def checkout(amount: int) -> str:
            receipt = str(fx["charge"](amount))
            attempts.append(receipt)
            if len(attempts) == 1:
                raise ModelRetry("the shipping API flaked after the charge; try again")
            return receipt

    turns = [[ToolCallPart("checkout", {"amount": 42}, tool_call_id="c1")], [ToolCallPart("checkout", {"amount": 42}, tool_call_id="c2")]]
    agent = _agent(turns, guarded, register)
    if guarded:
        ep.run_sync(agent, "check out order 42", gate=t.gate, run_id=t.run_id)
    else:
        agent.run_sync("check out order 42")
    assert len(attempts) == 2, f"expected the model to call the tool again, got {len(attempts)} runs"
    return t.world.count("charge") - 1


def next_turn(t: Trial, guarded: bool) -> None:
    """The next turn of the same conversation (run id): the model charges."""

    def register(agent: Agent) -> None:
        @agent.tool_plain
        def charge(amount: int) -> str:
            t.world.do("charge", amount)
            return "charged"

    agent = _agent([[ToolCallPart("charge", {"amount": NEXT_TURN_AMOUNT}, tool_call_id="n1")]], guarded, register)
    asyncio.run(ep.run(agent, "charge", gate=t.gate, run_id=t.run_id) if guarded else agent.run("charge"))


def interrupt_continue(t: Trial, guarded: bool) -> int:
    return interrupt_then_continue(t, guarded, cancel_thread, next_turn)


SCENARIOS = {"retry_policy": retry_policy, "framework_cancel": framework_cancel, "restart_pause": restart_pause, "operator_cancel": operator_cancel, "sibling": sibling, "reject": reject, "replay": replay, "cancel_thread": cancel_thread, "cancel_async": cancel_async, "interrupt_continue": interrupt_continue, "timeout_retry": timeout_retry}
